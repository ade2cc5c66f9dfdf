// KV write for unquantized CPU caches: K and V rows of a token batch stored at their slots.
//
// key, value [num_tokens, Hkv, D] (element strides s_*tok, s_*head; unit stride over D), in the
// cache's element type (f32, bf16 or f16: the copy is bitwise, so only the element size
// matters). slots [num_tokens] int64, slot = block * block_size + offset, -1 skips the token.
// Cache layer view [num_blocks, 2, block_size, Hkv, D] with element strides s_block, s_kv,
// s_tok, s_head. Every slot is checked before anything is written. Plain C ABI (ctypes).

#include <cstdint>
#include <cstring>

#include <omp.h>

namespace {

// Every field is 8 bytes so the ctypes mirror needs no padding rules.
struct WriteParams {
  int64_t key, value, slots, data;  // pointers
  int64_t elem_bytes, num_tokens, num_kv_heads, head_dim;
  int64_t s_ktok, s_khead, s_vtok, s_vhead;  // key / value strides (elements)
  int64_t num_blocks, block_size;
  int64_t s_block, s_kv, s_tok, s_head;  // cache layer strides (elements)
  int64_t num_threads;
};

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

}  // namespace

// Returns 0 on success, 1 for bad sizes, 2 when a slot lies outside [-1, num_blocks *
// block_size) (nothing written then).
extern "C" int kvmesh_cpu_write_kv(const WriteParams* params) {
  const WriteParams& p = *params;
  if (p.elem_bytes <= 0 || p.num_tokens < 0 || p.num_kv_heads <= 0 || p.head_dim <= 0 ||
      p.block_size <= 0) {
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
  const int64_t bytes = 2 * p.num_tokens * p.num_kv_heads * p.head_dim * eb;
  const int threads = static_cast<int>(p.num_threads > 0 ? p.num_threads : 1);
#pragma omp parallel for schedule(static) num_threads(threads) if (bytes >= kParallelBytes)
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    const int64_t blk = slot / p.block_size, off = slot % p.block_size;
    const int64_t base = blk * p.s_block + off * p.s_tok;  // int64 element offset of K
    copy_token(data + base * eb, key + t * p.s_ktok * eb, p.s_khead, p, k_whole);
    copy_token(data + (base + p.s_kv) * eb, value + t * p.s_vtok * eb, p.s_vhead, p, v_whole);
  }
  return 0;
}
