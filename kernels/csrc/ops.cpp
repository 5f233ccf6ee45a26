// torch.library registration of zlightning's native ops (namespace `zlightning`). The Python wrappers live in
// kernels/_cpu_adam.py, kernels/_quant.py and kernels/_aio.py; fake (meta) kernels in kernels/_ext.py.
//
//   zlightning::adam_step_   fused Adam/AdamW update of fp32 state (+ optional bf16/fp16 copy), CPU
//   zlightning::quantize     group-wise int8/int4 quantization, CPU (CUDA: Python/Triton impl registered at load)
//   zlightning::dequantize   its inverse
//   zlightning::build_info   ISA chosen at run time, compiler, flags
//   torch.classes.zlightning.AioRing   io_uring ring (aio_uring.cpp)
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "zl_kernels.h"

#ifndef ZL_BUILD_FLAGS
#define ZL_BUILD_FLAGS "unknown"
#endif

namespace zl {
namespace {

struct Isa {
  AdamFn fn;
  const char* name;
};

Isa pick_isa(std::string f) {
  __builtin_cpu_init();
  bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (f == "base") return {adam_base, "base (x86-64 SSE2)"};
  if (f == "avx2" && has2) return {adam_avx2, "avx2"};
  if ((f.empty() || f == "avx512") && has512) return {adam_avx512, "avx512"};
  if (has2) return {adam_avx2, "avx2"};
  return {adam_base, "base (x86-64 SSE2)"};
}

Isa& isa() {
  static Isa chosen = [] {
    const char* forced = std::getenv("ZLIGHTNING_KERNELS_ISA");
    return pick_isa(forced ? forced : "");
  }();
  return chosen;
}

// Switches the Adam kernel's ISA ("avx512", "avx2", "base", or "" for the best supported); returns the one chosen
// (an unsupported request falls back to the best supported below it). For tests and benchmarks.
std::string set_isa(const std::string& name) {
  TORCH_CHECK(name.empty() || name == "avx512" || name == "avx2" || name == "base",
              "zlightning::set_isa: unknown ISA '", name, "'; choose avx512, avx2, base or '' (auto)");
  isa() = pick_isa(name);
  return isa().name;
}

void adam_step_(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                const std::optional<at::Tensor>& param_copy, double lr, double beta1, double beta2, double eps,
                double weight_decay, int64_t step, bool bias_correction, bool adamw_mode) {
  TORCH_CHECK(param.device().is_cpu(), "zlightning::adam_step_: param must be a CPU tensor, got ", param.device());
  TORCH_CHECK(param.scalar_type() == at::kFloat, "zlightning::adam_step_: param (the fp32 master) must be float32, got ",
              param.scalar_type());
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat && exp_avg_sq.scalar_type() == at::kFloat,
              "zlightning::adam_step_: exp_avg/exp_avg_sq must be float32");
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16,
              "zlightning::adam_step_: grad must be float32 or bfloat16, got ", grad.scalar_type());
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n,
              "zlightning::adam_step_: param, grad, exp_avg, exp_avg_sq need equal numel; got ", n, ", ", grad.numel(),
              ", ", exp_avg.numel(), ", ", exp_avg_sq.numel());
  TORCH_CHECK(param.is_contiguous() && grad.is_contiguous() && exp_avg.is_contiguous() && exp_avg_sq.is_contiguous(),
              "zlightning::adam_step_: all tensors must be contiguous");
  TORCH_CHECK(step >= 1, "zlightning::adam_step_: step must be >= 1 (1 for the first update), got ", step);
  CopyType ct = CopyType::kNone;
  void* copy_ptr = nullptr;
  if (param_copy.has_value()) {
    const at::Tensor& c = *param_copy;
    TORCH_CHECK(c.numel() == n && c.is_contiguous() && c.device().is_cpu(),
                "zlightning::adam_step_: param_copy must be a contiguous CPU tensor with ", n, " elements");
    TORCH_CHECK(c.scalar_type() == at::kBFloat16 || c.scalar_type() == at::kHalf,
                "zlightning::adam_step_: param_copy must be bfloat16 or float16, got ", c.scalar_type());
    ct = c.scalar_type() == at::kBFloat16 ? CopyType::kBFloat16 : CopyType::kHalf;
    copy_ptr = c.data_ptr();
  }
  // Scalars computed in double, then rounded to float, as torch.optim.AdamW's Python arithmetic does.
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  AdamHyper h{};
  h.neg_step_size = static_cast<float>(-(lr / bc1));
  h.beta1_comp = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.beta2_comp = static_cast<float>(1.0 - beta2);
  h.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  h.eps = static_cast<float>(eps);
  h.weight_decay = static_cast<float>(weight_decay);
  h.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  h.mode = weight_decay == 0.0 ? 0 : (adamw_mode ? 1 : 2);
  const GradType gt = grad.scalar_type() == at::kBFloat16 ? GradType::kBFloat16 : GradType::kFloat;
  const size_t gsize = gt == GradType::kBFloat16 ? 2 : 4;
  float* p = param.data_ptr<float>();
  const char* g = static_cast<const char*>(grad.data_ptr());
  float* m = exp_avg.data_ptr<float>();
  float* v = exp_avg_sq.data_ptr<float>();
  char* c = static_cast<char*>(copy_ptr);
  AdamFn fn = isa().fn;
  at::parallel_for(0, n, 1 << 15, [&](int64_t b, int64_t e) {
    fn(p + b, g + b * gsize, m + b, v + b, c ? c + b * 2 : nullptr, e - b, h, gt, ct);
  });
}

// ---- group-wise quantization --------------------------------------------------------------------------------------
template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// Round half to even without a libm call (nearbyint is not inlined for baseline x86-64): adding and removing
// 1.5 * 2^23 rounds in the current (nearest-even) mode; exact for |v| < 2^22, and quantized values are clamped to
// at most 255 in magnitude (the scale makes |v| <= qmax up to rounding). -ffp-contract=off keeps it unfolded.
inline float round_even(float v) {
  const float magic = 12582912.0f;
  return (v + magic) - magic;
}

template <typename T>
void quantize_groups(const T* x, int64_t n, int64_t gs, int64_t bits, bool sym, uint8_t* out, float* scale,
                     float* offset, int64_t g0, int64_t g1) {
  const int64_t bytes_per_group = gs * bits / 8;
  const float qmax = sym ? static_cast<float>((1 << (bits - 1)) - 1) : static_cast<float>((1 << bits) - 1);
  const float qmin = sym ? -qmax : 0.0f;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t start = g * gs, len = std::min(gs, n - start);
    const T* xs = x + start;
    float s, off = 0.0f;
    // NaN exactly when the group holds a NaN or an infinity (x * 0 is +-0 for finite x): std::min/max skip NaNs, so
    // without this a NaN was silently dropped from the scale and coded as garbage. See [Note: quantized layout].
    float poison = 0.0f;
    if (sym) {
      float amax = 0.0f;
#pragma omp simd reduction(max : amax) reduction(+ : poison)
      for (int64_t i = 0; i < len; ++i) {
        float f = to_f(xs[i]);
        amax = std::max(amax, std::fabs(f));
        poison += f * 0.0f;
      }
      s = amax / qmax;
    } else {
      float mn = to_f(xs[0]), mx = mn;
      poison = mn * 0.0f;
#pragma omp simd reduction(min : mn) reduction(max : mx) reduction(+ : poison)
      for (int64_t i = 1; i < len; ++i) {
        float f = to_f(xs[i]);
        mn = std::min(mn, f);
        mx = std::max(mx, f);
        poison += f * 0.0f;
      }
      s = (mx - mn) / qmax;
      off = mn;
    }
    uint8_t* o = out + g * bytes_per_group;
    if (poison != poison) {  // non-finite group: NaN scale (and offset), zero codes: it dequantizes to NaN
      scale[g] = std::numeric_limits<float>::quiet_NaN();
      offset[g] = sym ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      std::memset(o, 0, bytes_per_group);
      continue;
    }
    if (s == 0.0f) s = 1.0f;
    scale[g] = s;
    offset[g] = off;
    if (bits == 8) {
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {
        float q = round_even((to_f(xs[i]) - off) / s);
        q = std::min(std::max(q, qmin), qmax);
        o[i] = static_cast<uint8_t>(static_cast<int>(q) & 0xFF);
      }
      for (int64_t i = len; i < gs; ++i) o[i] = 0;
    } else {
      std::memset(o, 0, bytes_per_group);
      for (int64_t i = 0; i < len; ++i) {
        float q = round_even((to_f(xs[i]) - off) / s);
        q = std::min(std::max(q, qmin), qmax);
        uint8_t nib = static_cast<uint8_t>(static_cast<int>(q) & 0xF);
        o[i >> 1] |= (i & 1) ? static_cast<uint8_t>(nib << 4) : nib;
      }
    }
  }
}

void check_qargs(const char* op, int64_t bits, int64_t group_size) {
  TORCH_CHECK(bits == 8 || bits == 4, "zlightning::", op, ": bits must be 8 or 4, got ", bits);
  TORCH_CHECK(group_size > 0 && (bits == 8 || group_size % 2 == 0), "zlightning::", op,
              ": group_size must be positive (and even for 4 bits), got ", group_size);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x_in, int64_t bits, int64_t group_size,
                                                         bool symmetric) {
  check_qargs("quantize", bits, group_size);
  TORCH_CHECK(x_in.device().is_cpu(), "zlightning::quantize: CPU kernel got a ", x_in.device(), " tensor");
  at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  const int64_t groups = (n + group_size - 1) / group_size;
  auto qdtype = (bits == 8 && symmetric) ? at::kChar : at::kByte;
  at::Tensor q = at::empty({groups, group_size * bits / 8}, x.options().dtype(qdtype));
  at::Tensor scale = at::empty({groups}, x.options().dtype(at::kFloat));
  at::Tensor offset = at::empty({groups}, x.options().dtype(at::kFloat));
  uint8_t* qp = static_cast<uint8_t*>(q.data_ptr());
  float* sp = scale.data_ptr<float>();
  float* op = offset.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "zl_quantize", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, groups, std::max<int64_t>(1, 16384 / group_size), [&](int64_t g0, int64_t g1) {
      quantize_groups<scalar_t>(xp, n, group_size, bits, symmetric, qp, sp, op, g0, g1);
    });
  });
  return {q, scale, offset};
}

at::Tensor dequantize(const at::Tensor& q_in, const at::Tensor& scale_in, const at::Tensor& offset_in, int64_t bits,
                      int64_t group_size, bool symmetric, int64_t numel, at::ScalarType dtype) {
  check_qargs("dequantize", bits, group_size);
  at::Tensor q = q_in.contiguous(), scale = scale_in.contiguous().to(at::kFloat), offset = offset_in.contiguous().to(at::kFloat);
  const int64_t groups = scale.numel();
  const bool numel_ok = groups == 0 ? numel == 0 : (numel <= groups * group_size && numel > (groups - 1) * group_size);
  TORCH_CHECK(q.numel() == groups * group_size * bits / 8 && offset.numel() == groups && numel_ok,
              "zlightning::dequantize: inconsistent shapes: data ", q.sizes(), ", scale ", scale.sizes(), ", offset ",
              offset.sizes(), " for numel=", numel, ", group_size=", group_size, ", bits=", bits);
  at::Tensor out = at::empty({numel}, q.options().dtype(dtype));
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  const int64_t bpg = group_size * bits / 8;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "zl_dequantize", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, groups, std::max<int64_t>(1, 16384 / group_size), [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t start = g * group_size, len = std::min(group_size, numel - start);
        const float s = sp[g], off = op[g];
        const uint8_t* qg = qp + g * bpg;
        for (int64_t i = 0; i < len; ++i) {
          int v;
          if (bits == 8) v = symmetric ? static_cast<int>(static_cast<int8_t>(qg[i])) : static_cast<int>(qg[i]);
          else {
            int nib = (i & 1) ? (qg[i >> 1] >> 4) : (qg[i >> 1] & 0xF);
            v = symmetric ? ((nib ^ 8) - 8) : nib;
          }
          float f = static_cast<float>(v) * s;
          if (!symmetric) f = f + off;
          o[start + i] = static_cast<scalar_t>(f);
        }
      }
    });
  });
  return out;
}

std::string build_info() {
  return std::string("isa=") + isa().name + ";compiler=" + __VERSION__ + ";flags=" + ZL_BUILD_FLAGS +
         ";io_uring=" + (aio_uring_supported() ? "yes" : "no");
}

// ---- io_uring ring as a TorchScript custom class ------------------------------------------------------------------
struct AioRingHolder : torch::CustomClassHolder {
  AioRing* ring = nullptr;
  AioRingHolder(int64_t queue_depth, bool single_submit) {
    TORCH_CHECK(queue_depth >= 1 && queue_depth <= 4096, "AioRing: queue_depth must be in [1, 4096], got ", queue_depth);
    int err = 0;
    ring = aio_ring_create(static_cast<unsigned>(queue_depth), single_submit, &err);
    TORCH_CHECK(ring != nullptr, "AioRing: io_uring_setup failed: ", std::strerror(err), " (errno ", err, ")");
  }
  ~AioRingHolder() override { aio_ring_destroy(ring); }
  // blocks: int64 tensor [n, 4] of (fd, address, length, file offset)
  int64_t submit(bool write, const at::Tensor& blocks) {
    TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 2 && blocks.size(1) == 4,
                "AioRing.submit: blocks must be an int64 tensor of shape [n, 4]");
    at::Tensor b = blocks.contiguous();
    const int64_t* d = b.data_ptr<int64_t>();
    std::vector<AioBlock> v(static_cast<size_t>(b.size(0)));
    for (int64_t i = 0; i < b.size(0); ++i) {
      TORCH_CHECK(d[4 * i + 2] > 0 && d[4 * i + 2] <= (1ll << 30), "AioRing.submit: block length out of range");
      v[i] = AioBlock{static_cast<int>(d[4 * i]), static_cast<uint64_t>(d[4 * i + 1]),
                      static_cast<uint32_t>(d[4 * i + 2]), static_cast<uint64_t>(d[4 * i + 3])};
    }
    return aio_ring_submit(ring, write, v.data(), static_cast<int64_t>(v.size()));
  }
  // Returns [errno (0 = ok), failing offset, short-read bytes (-1: not a short read)].
  std::vector<int64_t> wait(int64_t id) {
    uint64_t off = 0;
    int64_t sb = -1;
    int err = aio_ring_wait(ring, id, &off, &sb);
    return {err, static_cast<int64_t>(off), sb};
  }
  bool done(int64_t id) { return aio_ring_done(ring, id); }
};

}  // namespace
}  // namespace zl

TORCH_LIBRARY(zlightning, m) {
  m.def("adam_step_(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor(d!)? param_copy, "
        "float lr, float beta1, float beta2, float eps, float weight_decay, int step, bool bias_correction, "
        "bool adamw_mode) -> ()");
  m.def("quantize(Tensor x, int bits, int group_size, bool symmetric) -> (Tensor, Tensor, Tensor)");
  m.def("dequantize(Tensor data, Tensor scale, Tensor offset, int bits, int group_size, bool symmetric, int numel, "
        "ScalarType dtype) -> Tensor");
  m.def("build_info() -> str", &zl::build_info);
  m.def("set_isa(str name) -> str", &zl::set_isa);
  m.class_<zl::AioRingHolder>("AioRing")
      .def(torch::init<int64_t, bool>())
      .def("submit", &zl::AioRingHolder::submit)
      .def("wait", &zl::AioRingHolder::wait)
      .def("done", &zl::AioRingHolder::done);
}

TORCH_LIBRARY_IMPL(zlightning, CPU, m) {
  m.impl("adam_step_", &zl::adam_step_);
  m.impl("quantize", &zl::quantize);
  m.impl("dequantize", &zl::dequantize);
}
