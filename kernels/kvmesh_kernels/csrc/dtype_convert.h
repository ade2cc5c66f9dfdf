// Bit-exact scalar conversions between float and bfloat16 / IEEE half, matching torch's own
// (round to nearest even; NaN -> 0x7FC0 for bfloat16). Shared by the fused CPU kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvmesh_cvt {

#define KVM_CVT_INLINE inline __attribute__((always_inline))

KVM_CVT_INLINE float bits_to_f32(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

KVM_CVT_INLINE uint32_t f32_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

KVM_CVT_INLINE float bf16_to_f32(uint16_t x) { return bits_to_f32(static_cast<uint32_t>(x) << 16); }

// IEEE half -> float, branch-free (exact for normals, subnormals, inf, nan).
KVM_CVT_INLINE float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const uint32_t exp_offset = 0xE0u << 23;
  const float normalized = bits_to_f32((two_w >> 4) + exp_offset) * 0x1.0p-112f;
  const float denormalized = bits_to_f32((two_w >> 17) | (126u << 23)) - 0.5f;
  const float mag = two_w < (1u << 27) ? denormalized : normalized;
  return bits_to_f32(f32_to_bits(mag) | sign);
}

// float -> bfloat16 bits, round to nearest even, NaN -> 0x7FC0 (torch's conversion).
KVM_CVT_INLINE uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = f32_to_bits(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float -> IEEE half bits, round to nearest even, subnormals and overflow to inf exact (the
// FP16 library's fp16_ieee_from_fp32_value, which torch uses).
KVM_CVT_INLINE uint16_t f32_to_f16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_f32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f32_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

}  // namespace kvmesh_cvt
