// The fused Adam/AdamW pass, compiled once per ISA (see zl_kernels.h). Plain loops written so that GCC/Clang
// vectorise them (-O3, `omp simd`, restrict pointers, branch-free bf16 rounding); -ffp-contract=off keeps the
// arithmetic in the same order as torch.optim.AdamW's single-tensor path, so results agree to within an ulp.
#include <cmath>
#include <cstring>

#include "zl_kernels.h"

#ifndef ZL_ISA_FN
#error "compile with -DZL_ISA_FN=adam_avx512 (or adam_avx2, adam_base)"
#endif

namespace zl {
namespace {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (f != f) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

template <typename G>
inline float load_grad(const G* g, int64_t i) {
  if constexpr (sizeof(G) == 2) return bf16_to_float(g[i]); else return g[i];
}

template <typename G, int COPY, int MODE>
void run(float* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v, void* copy_raw,
         int64_t n, const AdamHyper& h) {
  const float c1 = h.beta1_comp, b2 = h.beta2, c2 = h.beta2_comp, bc2 = h.bc2_sqrt, eps = h.eps;
  const float neg_step = h.neg_step_size, wd = h.weight_decay, decay = h.decay_factor;
  uint16_t* __restrict cb = static_cast<uint16_t*>(copy_raw);
  _Float16* __restrict ch = static_cast<_Float16*>(copy_raw);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float gi = load_grad(g, i);
    float pi = p[i];
    if constexpr (MODE == 2) gi = gi + wd * pi;
    if constexpr (MODE == 1) pi = pi * decay;
    float mi = m[i];
#ifdef __FMA__
    mi = std::fma(c1, gi - mi, mi);  // torch's vectorised lerp is fmadd(weight, end - self, self)
#else
    mi = mi + c1 * (gi - mi);
#endif
    float vi = v[i] * b2;
    vi = vi + c2 * gi * gi;
    float denom = std::sqrt(vi) / bc2 + eps;
    pi = pi + neg_step * (mi / denom);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if constexpr (COPY == 1) cb[i] = float_to_bf16(pi);
    if constexpr (COPY == 2) ch[i] = static_cast<_Float16>(pi);
  }
}

template <typename G, int COPY>
void by_mode(float* p, const G* g, float* m, float* v, void* c, int64_t n, const AdamHyper& h) {
  switch (h.mode) {
    case 1: run<G, COPY, 1>(p, g, m, v, c, n, h); break;
    case 2: run<G, COPY, 2>(p, g, m, v, c, n, h); break;
    default: run<G, COPY, 0>(p, g, m, v, c, n, h); break;
  }
}

template <typename G>
void by_copy(float* p, const G* g, float* m, float* v, void* c, int64_t n, const AdamHyper& h, CopyType ct) {
  switch (ct) {
    case CopyType::kBFloat16: by_mode<G, 1>(p, g, m, v, c, n, h); break;
    case CopyType::kHalf: by_mode<G, 2>(p, g, m, v, c, n, h); break;
    default: by_mode<G, 0>(p, g, m, v, c, n, h); break;
  }
}

}  // namespace

void ZL_ISA_FN(float* p, const void* g, float* m, float* v, void* copy, int64_t n, const AdamHyper& h, GradType gt,
               CopyType ct) {
  if (gt == GradType::kBFloat16)
    by_copy(p, static_cast<const uint16_t*>(g), m, v, copy, n, h, ct);
  else
    by_copy(p, static_cast<const float*>(g), m, v, copy, n, h, ct);
}

}  // namespace zl
