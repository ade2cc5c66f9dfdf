// Shared by the fused CPU kernels (cpu_fused_ops.cpp, cpu_sampling.cpp, cpu_cache_ops.cpp):
// float32 / bfloat16 / float16 traits, the target clones macro, a vectorizable float32 exp and
// SiLU-and-mul's element (also cpu_gemm.cpp's fused epilogue), all inline or templates.
// Include it after `#pragma GCC optimize("-ffp-contract=off")`: the exp's non-FMA path must
// not be contracted.
#pragma once

#include <cstdint>

#include "dtype_convert.h"

namespace kvmesh_fused {

using kvmesh_cvt::bf16_to_f32;
using kvmesh_cvt::f32_to_bf16;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVF_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVF_CLONES
#endif

constexpr int64_t kParallelElements = 1 << 16;  // elements a call splits across threads from

// dtype traits: load to float, store with the dtype's rounding
struct F32 {
  using T = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
  static float round(float v) { return v; }
};
struct BF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return bf16_to_f32(v); }
  static uint16_t store(float v) { return f32_to_bf16(v); }
  static float round(float v) { return bf16_to_f32(f32_to_bf16(v)); }
};
struct F16 {
  using T = uint16_t;
  static float load(uint16_t v) { return kvmesh_cvt::f16_to_f32(v); }
  static uint16_t store(float v) { return kvmesh_cvt::f32_to_f16(v); }
  static float round(float v) { return kvmesh_cvt::f16_to_f32(kvmesh_cvt::f32_to_f16(v)); }
};

// a * b + c: one fused rounding on the paths compiled for FMA, two elsewhere (this file is
// compiled without contraction; only the SiLU's exp asks for FMA, explicitly).
template <bool kFma>
inline __attribute__((always_inline)) float mla(float a, float b, float c) {
  if constexpr (kFma) return __builtin_fmaf(a, b, c);
  return a * b + c;
}

// exp(x) in float32, branch-free so that `omp simd` vectorizes it (std::exp does not without
// -ffast-math): x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in two (Cody-Waite: n * kLn2Hi is
// exact), exp(r) by Cephes' expf polynomial, times 2^n built from exponent bits in two halves
// so that n in [-150, 128] never overflows them. Within 1 ulp of exp on [-104, 88.72] with or
// without FMA; +inf above (the product overflows), 0 or the least subnormal below, NaN -> NaN.
template <bool kFma>
inline __attribute__((always_inline)) float exp_f32(float x) {
  constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer (even ties)
  float xc = x > 88.75f ? 88.75f : x;   // NaN compares false: passes both clamps
  xc = xc < -104.f ? -104.f : xc;
  const float t = mla<kFma>(xc, kLog2e, kRound);  // n in its low mantissa bits
  const float n = t - kRound;
  const float r = mla<kFma>(n, -kLn2Lo, mla<kFma>(n, -kLn2Hi, xc));
  float p = 1.9875691500e-4f;
  p = mla<kFma>(p, r, 1.3981999507e-3f);
  p = mla<kFma>(p, r, 8.3334519073e-3f);
  p = mla<kFma>(p, r, 4.1665795894e-2f);
  p = mla<kFma>(p, r, 1.6666665459e-1f);
  p = mla<kFma>(p, r, 5.0000001201e-1f);
  p = mla<kFma>(p, r * r, r) + 1.f;
  const uint32_t ni = kvmesh_cvt::f32_to_bits(t) - kvmesh_cvt::f32_to_bits(kRound);  // n
  const uint32_t half = static_cast<uint32_t>(static_cast<int32_t>(ni) >> 1);
  return p * kvmesh_cvt::bits_to_f32((half + 127u) << 23) *
         kvmesh_cvt::bits_to_f32((ni - half + 127u) << 23);
}

// silu(g) * u as torch's F.silu(g) * up computes it in D, from g and u already D's values:
// the quotient rounded to D, then the product (the caller rounds it when it stores).
template <class D, bool kFma>
inline __attribute__((always_inline)) float silu_mul_elem(float g, float u) {
  return D::round(g / (1.f + exp_f32<kFma>(-g))) * u;
}

}  // namespace kvmesh_fused
