// The read a decode step's attention cannot avoid, alone: every K and V row of each
// sequence's first lens[b] tokens (every kv head) through its block table, and nothing else.
// Benchmarks time it beside the attention kernel on the same cache and tables, so the kernel's
// rate is compared with what this machine reads from a paged cache (blocks scattered in
// memory), not with a streaming read of one buffer.
//
// Per sequence the blocks go in table order; per block the K rows of its tokens (one run: the
// layout keeps a block's tokens and heads adjacent), then their V rows. While a block is read,
// the lines of the block after it (the sequence's next, or the first of the sequence this
// thread reads next) are requested into L2 (prefetcht1), one line per line read: the attention
// kernel's paced prefetch (cpu_paged_attention.cpp, Cursor). Threads take sequences from a
// shared counter. Every 64-byte line read is folded into a 64-bit xor of its eight words, and
// a run's last bytes short of a line one by one (the result, so the reads are not optimized
// away). Cache layer view [num_blocks, 2, block_size, Hkv, D], contiguous within a block half
// (s_tok = Hkv * D, s_head = D; the caller checks), block and half strides s_block, s_kv in
// elements. Plain C ABI (ctypes).

#include <omp.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace {

// Every field is 8 bytes so the ctypes mirror needs no padding rules.
struct ReadParams {
  int64_t data, tables, lens;  // pointers: layer data, int32 [batch, max_blocks], int32 [batch]
  int64_t batch, max_blocks, num_blocks, block_size;
  int64_t elem_bytes, token_bytes;  // token_bytes: one token's K (or V) rows, all heads
  int64_t s_block, s_kv;            // cache layer strides (elements)
  int64_t num_threads;
};

constexpr int64_t kLine = 64;

// One run of bytes [p, p + n) read 64 bytes at a time; per line read, the next line of the
// run at `ahead` (while it lasts) requested into L2.
struct Ahead {
  const char* p = nullptr;
  int64_t left = 0;
  inline void issue() {
    if (left <= 0) return;
    __builtin_prefetch(p, 0, 2);  // prefetcht1 on x86
    p += kLine;
    left -= kLine;
  }
};

inline uint64_t read_run(const char* p, int64_t bytes, Ahead& ahead) {
  uint64_t acc = 0;
  int64_t i = 0;
  for (; i + kLine <= bytes; i += kLine) {
    uint64_t w[8];
    std::memcpy(w, p + i, sizeof(w));
    acc ^= w[0] ^ w[1] ^ w[2] ^ w[3] ^ w[4] ^ w[5] ^ w[6] ^ w[7];
    ahead.issue();
  }
  for (; i < bytes; ++i) acc ^= static_cast<uint64_t>(static_cast<unsigned char>(p[i]));
  return acc;
}

struct Reader {
  const ReadParams& p;
  const char* data;
  const int32_t* tables;
  const int32_t* lens;

  int64_t blocks_of(int64_t b) const {
    const int64_t n = lens[b] < 0 ? 0 : lens[b];
    const int64_t blocks = (n + p.block_size - 1) / p.block_size;
    return blocks < p.max_blocks ? blocks : p.max_blocks;
  }
  // Tokens of block j of sequence b.
  int64_t tokens_in(int64_t b, int64_t j) const {
    const int64_t rest = lens[b] - j * p.block_size;
    return rest < p.block_size ? rest : p.block_size;
  }
  // The K rows of block j of sequence b (token 0, head 0), its id clamped into the cache.
  const char* block_k(int64_t b, int64_t j) const {
    int64_t phys = tables[b * p.max_blocks + j];
    phys = phys < 0 ? 0 : phys >= p.num_blocks ? p.num_blocks - 1 : phys;
    return data + phys * p.s_block * p.elem_bytes;
  }
  // The K (half 0) or V (half 1) rows of n tokens at block k.
  uint64_t read_half(const char* k, int64_t half, int64_t n, Ahead& ahead) const {
    return read_run(k + half * p.s_kv * p.elem_bytes, n * p.token_bytes, ahead);
  }
  // Block (b, j): K then V; meanwhile the lines of block `next` (n_next tokens) are requested,
  // its K while K is read, its V while V is.
  uint64_t read_block(int64_t b, int64_t j, const char* next, int64_t n_next) const {
    const int64_t n = tokens_in(b, j);
    const int64_t run = n_next * p.token_bytes;
    Ahead ahead{next, next != nullptr ? run : 0};
    const char* k = block_k(b, j);
    uint64_t acc = read_half(k, 0, n, ahead);
    if (next != nullptr) ahead = Ahead{next + p.s_kv * p.elem_bytes, run};
    return acc ^ read_half(k, 1, n, ahead);
  }
};

}  // namespace

// Returns the xor of every 64-bit word read (0 with nothing to read); -1 on bad arguments (a
// null pointer, a size below 1, or a block half shorter than block_size tokens). A sequence
// reads at most max_blocks blocks (longer lengths are cut there); a negative length reads
// nothing; table ids are clamped into [0, num_blocks).
extern "C" int64_t kvmesh_cpu_kv_read(const ReadParams* params) {
  if (params == nullptr) return -1;
  const ReadParams& p = *params;
  if (p.data == 0 || p.tables == 0 || p.lens == 0 || p.batch < 0 || p.max_blocks < 1 ||
      p.num_blocks < 1 || p.block_size < 1 || p.elem_bytes < 1 || p.token_bytes < 1 ||
      p.num_threads < 1 || p.block_size * p.token_bytes > p.s_kv * p.elem_bytes ||
      2 * p.s_kv > p.s_block)
    return -1;
  const Reader r{p, reinterpret_cast<const char*>(p.data),
                 reinterpret_cast<const int32_t*>(p.tables),
                 reinterpret_cast<const int32_t*>(p.lens)};
  std::atomic<int64_t> counter{0};
  uint64_t total = 0;
#pragma omp parallel num_threads(static_cast<int>(p.num_threads)) reduction(^ : total)
  {
    int64_t b = counter.fetch_add(1);
    while (b < p.batch) {
      const int64_t following = counter.fetch_add(1);  // claimed now: its first block is
      const int64_t blocks = r.blocks_of(b);           // requested during b's last one
      for (int64_t j = 0; j < blocks; ++j) {
        const char* next = nullptr;
        int64_t n_next = 0;
        if (j + 1 < blocks) {
          next = r.block_k(b, j + 1);
          n_next = r.tokens_in(b, j + 1);
        } else if (following < p.batch && r.blocks_of(following) > 0) {
          next = r.block_k(following, 0);
          n_next = r.tokens_in(following, 0);
        }
        total ^= r.read_block(b, j, next, n_next);
      }
      b = following;
    }
  }
  return static_cast<int64_t>(total & 0x7FFFFFFFFFFFFFFFULL);
}
