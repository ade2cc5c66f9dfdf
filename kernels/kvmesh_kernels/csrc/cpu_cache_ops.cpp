// KV write for CPU caches: K and V rows of a token batch stored at their slots.
//
// key, value [num_tokens, Hkv, D] (element strides s_*tok, s_*head; unit stride over D).
// Unquantized caches (quant 0): key/value in the cache's element type (f32, bf16 or f16: the
// copy is bitwise, so only the element size matters). Quantized caches (quant 1 = int8,
// 2 = fp8 e4m3fn): key/value in src_dtype (0 f32, 1 bf16, 2 f16), each (token, kv head) row
// quantized with its own float32 scale = max(amax|x| / QMAX, 1e-8) (QMAX 127 / 448), values
// round-half-even(x / scale) clamped to +-127 (int8) or x / scale clamped to +-448 and rounded
// to e4m3fn (fp8), exactly as kvmesh_kernels.quant.quantize computes them in torch.
// slots [num_tokens] int64, slot = block * block_size + offset, -1 skips the token.
// Cache layer view [num_blocks, 2, block_size, Hkv, D] with element strides s_block, s_kv,
// s_tok, s_head; scales [num_blocks, 2, block_size, Hkv] with ss_*. Every slot is checked
// before anything is written. Plain C ABI (ctypes).

#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#pragma GCC optimize("-ffp-contract=off")  // before the shared header (its exp)

#include "fused_common.h"  // dtype conversions, target clones

namespace {

// Every field is 8 bytes so the ctypes mirror needs no padding rules.
struct WriteParams {
  int64_t key, value, slots, data;  // pointers
  int64_t elem_bytes, num_tokens, num_kv_heads, head_dim;
  int64_t s_ktok, s_khead, s_vtok, s_vhead;  // key / value strides (elements)
  int64_t num_blocks, block_size;
  int64_t s_block, s_kv, s_tok, s_head;  // cache layer strides (elements)
  int64_t num_threads;
  // Added later: zero in a mirror that predates them (an unquantized copy).
  int64_t quant, src_dtype, scales;        // 0 / 1 int8 / 2 fp8; key/value dtype; pointer
  int64_t ss_block, ss_kv, ss_tok, ss_head;  // scales strides (elements)
};

using kvmesh_fused::BF16;
using kvmesh_fused::F16;
using kvmesh_fused::F32;

enum Quant : int { kNone = 0, kInt8 = 1, kFp8 = 2 };
constexpr float kMinScale = 1e-8f;

// Below this many bytes per call the copy stays on the calling thread (a parallel region
// costs more than a decode step's few kilobytes).
constexpr int64_t kParallelBytes = int64_t{1} << 20;

// Copies one token's [Hkv, D] rows from src (strides s_src_head) to dst (strides s_head).
inline void copy_token(char* dst, const char* src, int64_t s_src_head, const WriteParams& p,
                       bool whole) {
  const int64_t row = p.head_dim * p.elem_bytes;
  if (whole) {
    std::memcpy(dst, src, static_cast<size_t>(row * p.num_kv_heads));
    return;
  }
  for (int64_t h = 0; h < p.num_kv_heads; ++h) {
    std::memcpy(dst + h * p.s_head * p.elem_bytes, src + h * s_src_head * p.elem_bytes,
                static_cast<size_t>(row));
  }
}

// float -> float8 e4m3fn bits, round to nearest even (no infinities: 0x7F / 0xFF is NaN; the
// caller clamps to +-448, the largest finite value). Below 2^-6 the result is subnormal, in
// steps of 2^-9: adding 2^14 (whose float ulp is 2^-9) rounds the value to that step in the
// float addition itself, and the sum's low bits are the code. Above, the float's 23-bit
// mantissa is rounded to 3 bits and the exponent rebiased from 127 to 7. Branch-free (both
// candidates computed, one selected), so that the row's loop vectorizes.
inline __attribute__((always_inline)) uint8_t f32_to_e4m3fn(float f) {
  constexpr uint32_t kAlign = 141u << 23;  // 2^14
  uint32_t bits = kvmesh_cvt::f32_to_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  bits ^= sign;
  const uint32_t subnormal =
      kvmesh_cvt::f32_to_bits(kvmesh_cvt::bits_to_f32(bits) + kvmesh_cvt::bits_to_f32(kAlign)) -
      kAlign;
  const uint32_t odd = (bits >> 20) & 1u;  // ties go to the even 3-bit mantissa
  const uint32_t normal = (bits + (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu + odd) >> 20;
  const uint32_t out = bits >= (1087u << 20) ? 0x7Fu : bits < (121u << 23) ? subnormal : normal;
  return static_cast<uint8_t>(out | (sign >> 24));
}

// Quantizes one row of D source elements (dtype traits S) into dst (int8 or e4m3fn bytes,
// Q = kInt8 / kFp8); returns its scale. Vectorized loops in target clones (x86-64-v3 and v4
// round with vroundps; the baseline has no rounding instruction).
template <class S, int Q>
KVF_CLONES float quantize_row(const void* row, int64_t D, uint8_t* dst) {
  const typename S::T* src = static_cast<const typename S::T*>(row);
  float amax = 0.f;
  int32_t nan = 0;  // a NaN makes the scale NaN, as torch's amax does
#pragma omp simd reduction(max : amax) reduction(| : nan)
  for (int64_t d = 0; d < D; ++d) {
    const float a = std::fabs(S::load(src[d]));
    amax = a > amax ? a : amax;
    nan |= a != a;
  }
  float scale = (nan != 0 ? NAN : amax) / (Q == kInt8 ? 127.f : 448.f);
  scale = scale < kMinScale ? kMinScale : scale;  // NaN stays NaN, as torch's clamp_min
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) {
    const float x = S::load(src[d]) / scale;
    if constexpr (Q == kInt8) {
      const float r = std::nearbyint(x);  // half to even under the default rounding mode
      const float c = r < -127.f ? -127.f : r > 127.f ? 127.f : r;
      dst[d] = static_cast<uint8_t>(static_cast<int8_t>(c == c ? c : 0.f));  // NaN: 0
    } else {
      dst[d] = f32_to_e4m3fn(x < -448.f ? -448.f : x > 448.f ? 448.f : x);
    }
  }
  return scale;
}

using QuantizeRow = float (*)(const void*, int64_t, uint8_t*);

// quantize_row for a source dtype (0 f32, 1 bf16, 2 f16) and Quant.
QuantizeRow row_quantizer(int64_t src_dtype, int64_t quant) {
  static const QuantizeRow table[3][2] = {
      {quantize_row<F32, kInt8>, quantize_row<F32, kFp8>},
      {quantize_row<BF16, kInt8>, quantize_row<BF16, kFp8>},
      {quantize_row<F16, kInt8>, quantize_row<F16, kFp8>},
  };
  return table[src_dtype][quant == kInt8 ? 0 : 1];
}

// Bytes of one key / value element of a quantized write (src_dtype 0: float32, else 16-bit).
inline int64_t source_bytes(const WriteParams& p) { return p.src_dtype == 0 ? 4 : 2; }

// One token's K or V rows quantized into the cache (base: element offset of its head 0 row,
// scale_base: of its head 0 scale).
inline void quantize_token(const WriteParams& p, QuantizeRow quantize, const char* src,
                           int64_t s_src_head, int64_t base, int64_t scale_base) {
  const int64_t sb = source_bytes(p);
  uint8_t* data = reinterpret_cast<uint8_t*>(p.data);
  float* scales = reinterpret_cast<float*>(p.scales);
  for (int64_t h = 0; h < p.num_kv_heads; ++h) {
    scales[scale_base + h * p.ss_head] =
        quantize(src + h * s_src_head * sb, p.head_dim, data + base + h * p.s_head);
  }
}

}  // namespace

// Returns 0 on success, 1 for bad sizes, 2 when a slot lies outside [-1, num_blocks *
// block_size) (nothing written then).
extern "C" int kvmesh_cpu_write_kv(const WriteParams* params) {
  const WriteParams& p = *params;
  if (p.elem_bytes <= 0 || p.num_tokens < 0 || p.num_kv_heads <= 0 || p.head_dim <= 0 ||
      p.block_size <= 0 || p.quant < kNone || p.quant > kFp8 ||
      (p.quant != kNone && (p.elem_bytes != 1 || p.scales == 0 || p.src_dtype < 0 ||
                            p.src_dtype > 2))) {
    return 1;
  }
  const int64_t* slots = reinterpret_cast<const int64_t*>(p.slots);
  const int64_t total = p.num_blocks * p.block_size;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    if (slots[t] < -1 || slots[t] >= total) return 2;
  }
  const char* key = reinterpret_cast<const char*>(p.key);
  const char* value = reinterpret_cast<const char*>(p.value);
  char* data = reinterpret_cast<char*>(p.data);
  const int64_t eb = p.elem_bytes;
  const bool dense_cache = p.s_head == p.head_dim;
  const bool k_whole = dense_cache && p.s_khead == p.head_dim;
  const bool v_whole = dense_cache && p.s_vhead == p.head_dim;
  // quantizing reads the source row twice and computes per element: count it as 8 bytes
  const int64_t per_elem = p.quant != kNone ? 8 : eb;
  const int64_t bytes = 2 * p.num_tokens * p.num_kv_heads * p.head_dim * per_elem;
  const int threads = static_cast<int>(p.num_threads > 0 ? p.num_threads : 1);
  const QuantizeRow quantize = p.quant != kNone ? row_quantizer(p.src_dtype, p.quant) : nullptr;
#pragma omp parallel for schedule(static) num_threads(threads) if (bytes >= kParallelBytes)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t blk = slot / p.block_size, off = slot % p.block_size;
    const int64_t base = blk * p.s_block + off * p.s_tok;  // int64 element offset of K
    if (p.quant != kNone) {
      const int64_t sbytes = source_bytes(p);
      const int64_t scale_base = blk * p.ss_block + off * p.ss_tok;
      quantize_token(p, quantize, key + t * p.s_ktok * sbytes, p.s_khead, base, scale_base);
      quantize_token(p, quantize, value + t * p.s_vtok * sbytes, p.s_vhead, base + p.s_kv,
                     scale_base + p.ss_kv);
      continue;
    }
    copy_token(data + base * eb, key + t * p.s_ktok * eb, p.s_khead, p, k_whole);
    copy_token(data + (base + p.s_kv) * eb, value + t * p.s_vtok * eb, p.s_vhead, p, v_whole);
  }
  return 0;
}
