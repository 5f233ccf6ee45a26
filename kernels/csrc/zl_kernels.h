// Torch-free kernel interfaces of zlightning.kernels (see kernels/_build.py for how each file is compiled).
//
// The Adam kernel is compiled once per instruction set (adam_isa.cpp with -DZL_ISA_SUFFIX=...) and picked at run
// time by cpu feature detection in ops.cpp: one binary that is fast on AVX-512 machines and still runs on any x86-64.
#pragma once
#include <cstdint>

namespace zl {

// dtype codes shared by the ISA kernels and ops.cpp
enum class GradType : int { kFloat = 0, kBFloat16 = 1 };
enum class CopyType : int { kNone = 0, kBFloat16 = 1, kHalf = 2 };

struct AdamHyper {
  float neg_step_size;  // -lr / (1 - beta1^t)   (or -lr without bias correction)
  float beta1_comp;     // 1 - beta1 (lerp weight, as torch's exp_avg.lerp_(grad, 1 - beta1))
  float beta2;
  float beta2_comp;     // 1 - beta2
  float bc2_sqrt;       // sqrt(1 - beta2^t)   (1 without bias correction)
  float eps;
  float weight_decay;   // L2 mode: grad += weight_decay * param
  float decay_factor;   // AdamW mode: param *= 1 - lr * weight_decay
  int mode;             // 0: no weight decay, 1: AdamW (decoupled), 2: Adam with L2
};

// One fused pass over [0, n): updates fp32 param/exp_avg/exp_avg_sq from grad (fp32 or bf16 bits) and optionally
// writes the updated param rounded to bf16/fp16 into `copy`.
using AdamFn = void (*)(float* p, const void* g, float* m, float* v, void* copy, int64_t n, const AdamHyper& h,
                        GradType gt, CopyType ct);

void adam_avx512(float*, const void*, float*, float*, void*, int64_t, const AdamHyper&, GradType, CopyType);
void adam_avx2(float*, const void*, float*, float*, void*, int64_t, const AdamHyper&, GradType, CopyType);
void adam_base(float*, const void*, float*, float*, void*, int64_t, const AdamHyper&, GradType, CopyType);

// io_uring ring (aio_uring.cpp). One submitting/reaping thread per ring; requests are lists of blocks.
struct AioBlock {
  int fd;
  uint64_t addr;
  uint32_t len;
  uint64_t offset;
};

class AioRing;
AioRing* aio_ring_create(unsigned queue_depth, bool single_submit, int* err);
void aio_ring_destroy(AioRing*);
// Returns a request id (> 0). `write` selects pwrite. Blocks are owned by the ring after this call.
int64_t aio_ring_submit(AioRing*, bool write, const AioBlock* blocks, int64_t nblocks);
// Blocks until the request finished; returns 0 or a positive errno, filling the failing offset and bytes done.
int aio_ring_wait(AioRing*, int64_t id, uint64_t* fail_offset, int64_t* short_bytes);
bool aio_ring_done(AioRing*, int64_t id);
bool aio_uring_supported();

}  // namespace zl
