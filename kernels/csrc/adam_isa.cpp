// The fused Adam/AdamW pass, compiled once per ISA (see zl_kernels.h). Plain loops written so that GCC/Clang
// vectorise them (-O3, `omp simd`, restrict pointers, branch-free bf16 rounding); -ffp-contract=off keeps the
// arithmetic in the same order as torch.optim.AdamW's single-tensor path, so results agree to within an ulp.
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ZL_ADAM_STREAM_COPY 1
#endif

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

#ifdef ZL_ADAM_STREAM_COPY
// [Note: the low-precision copy folded into the step's memory traffic]
// The step reads p, g, m, v and writes p, m, v back into the cache lines it just read: 28 bytes per parameter. A
// copy written with ordinary stores costs 4 more: the 2 bytes written plus the 2 the core first reads to own the
// line (read-for-ownership). Streaming (non-temporal) stores skip that read, so the copy adds 2 bytes, about 7%
// of the step, instead of a separate pass over p (8 bytes per parameter). The step's own stores stay ordinary
// (their lines are already in cache; streaming them measured slower). Streaming only pays for arrays far larger
// than the cache (a small copy would be evicted right before its use), hence kStreamMinElems. Arithmetic is op for
// op the loop in run() (same order, one fma where it uses one), so both paths give identical bits.
constexpr int64_t kStreamMinElems = int64_t{1} << 16;

template <typename G>
inline __m512 load_grad16(const G* g) {
  if constexpr (sizeof(G) == 2) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else {
    return _mm512_loadu_ps(g);
  }
}

inline __m256i to_bf16_16(__m512 x) {  // round to nearest even, NaN -> 0x7FC0, as float_to_bf16
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

template <typename G, int COPY, int MODE>
void run_stream_copy(float* __restrict p, const G* __restrict g, float* __restrict m, float* __restrict v,
                     uint16_t* __restrict c, int64_t n, const AdamHyper& h) {
  // scalar head up to a 32-byte aligned copy address (16 low-precision elements per streaming store)
  int64_t head = static_cast<int64_t>(((32 - (reinterpret_cast<uintptr_t>(c) & 31)) & 31) / 2);
  if (head > n) head = n;
  run<G, COPY, MODE>(p, g, m, v, c, head, h);
  const __m512 c1 = _mm512_set1_ps(h.beta1_comp), b2 = _mm512_set1_ps(h.beta2), c2 = _mm512_set1_ps(h.beta2_comp);
  const __m512 bc2 = _mm512_set1_ps(h.bc2_sqrt), eps = _mm512_set1_ps(h.eps), ns = _mm512_set1_ps(h.neg_step_size);
  const __m512 wd = _mm512_set1_ps(h.weight_decay), decay = _mm512_set1_ps(h.decay_factor);
  int64_t i = head;
  for (; i + 16 <= n; i += 16) {
    __m512 gi = load_grad16(g + i);
    __m512 pi = _mm512_loadu_ps(p + i);
    if constexpr (MODE == 2) gi = _mm512_add_ps(gi, _mm512_mul_ps(wd, pi));
    if constexpr (MODE == 1) pi = _mm512_mul_ps(pi, decay);
    __m512 mi = _mm512_fmadd_ps(c1, _mm512_sub_ps(gi, _mm512_loadu_ps(m + i)), _mm512_loadu_ps(m + i));
    __m512 vi = _mm512_mul_ps(_mm512_loadu_ps(v + i), b2);
    vi = _mm512_add_ps(vi, _mm512_mul_ps(_mm512_mul_ps(c2, gi), gi));
    __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2), eps);
    pi = _mm512_add_ps(pi, _mm512_mul_ps(ns, _mm512_div_ps(mi, denom)));
    _mm512_storeu_ps(p + i, pi);
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    __m256i lo = COPY == 1 ? to_bf16_16(pi) : _mm512_cvtps_ph(pi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(c + i), lo);
  }
  _mm_sfence();  // streaming stores are weakly ordered: make them visible before the caller's join
  run<G, COPY, MODE>(p + i, g + i, m + i, v + i, c + i, n - i, h);
}
#endif

template <typename G, int COPY, int MODE>
void dispatch(float* p, const G* g, float* m, float* v, void* c, int64_t n, const AdamHyper& h) {
#if defined(ZL_ADAM_STREAM_COPY) && defined(__FMA__)
  if constexpr (COPY != 0) {
    if (n >= kStreamMinElems) return run_stream_copy<G, COPY, MODE>(p, g, m, v, static_cast<uint16_t*>(c), n, h);
  }
#endif
  run<G, COPY, MODE>(p, g, m, v, c, n, h);
}

template <typename G, int COPY>
void by_mode(float* p, const G* g, float* m, float* v, void* c, int64_t n, const AdamHyper& h) {
  switch (h.mode) {
    case 1: dispatch<G, COPY, 1>(p, g, m, v, c, n, h); break;
    case 2: dispatch<G, COPY, 2>(p, g, m, v, c, n, h); break;
    default: dispatch<G, COPY, 0>(p, g, m, v, c, n, h); break;
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
