// Fused CPU paged attention (decode and prefill/extend) reading K/V blocks in place.
//
// Cache layer view (element strides, int64):
//   data   [num_blocks, 2, block_size, num_kv_heads, head_dim]   f32 | bf16 | f16 | int8 | fp8
//   scales [num_blocks, 2, block_size, num_kv_heads]             f32, quantized caches only
// Flat varlen queries: q [num_tokens, Hq, D] (strided); sequence b owns rows
// qsl[b]..qsl[b+1], the last q_len tokens of its seq_lens[b]-token context.
//
// One work item = (sequence, kv heads, query tile, context split). It holds the G = Hq / Hkv
// query heads of each of its kv heads for its query tokens (rows = heads x tokens x G), so every
// K/V row is loaded and converted once per item, and walks its key range block by block through
// the block table with an online softmax in float32. A decode item takes all kv heads, so it
// reads each block's [block_size, Hkv, D] K and V as contiguous bytes (no page hopping between
// head slices); a prefill tile takes one kv head and up to q_tile tokens, reusing each K/V row
// across q_tile x G rows. A query at position p sees key t iff t <= p and
// (no window or t > p - window). Rows that see no key give zeros. With more than one split,
// items write partial (m, l, acc) and a second pass combines them.
//
// Three item implementations, chosen at run time (Params.isa / KVMESH_CPU_KERNEL_ISA cap it):
// AVX-512 (16-float intrinsics in a target-pragma section; bf16/f16 rows converted in
// registers, several blocks per softmax step), AVX2 + FMA (register tiles of 8-float vectors,
// GCC vector extensions, in a target clone), and a portable path written for auto-vectorization
// at the baseline ISA. Queries are read and outputs written in float32, bfloat16 or float16
// with their own strides. Plain C ABI (called through ctypes) and OpenMP; no torch headers, so
// it builds in seconds.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

#include <vector>

#include <omp.h>

#include "dtype_convert.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define KVM_INLINE inline __attribute__((always_inline))

namespace {

enum DType : int64_t { kF32 = 0, kBF16 = 1, kF16 = 2, kI8 = 3, kFP8 = 4 };
enum Isa : int64_t {
  kIsaAuto = 0,
  kIsaBaseline = 1,
  kIsaAvx2 = 2,
  kIsaAvx512 = 3,
  kIsaAvx512Bf16 = 4,  // AVX-512 with AVX512_BF16 (vdpbf16ps scores for bfloat16 caches)
};

// Every field is 8 bytes so the ctypes mirror needs no padding rules. Fields after `scale` were
// added later: a library built from an older source reads only the prefix (and then needs
// float32 contiguous q and out).
struct Params {
  int64_t q, out, data, scales, fp8_lut, block_tables, seq_lens, query_start_loc;  // pointers
  int64_t dtype, num_blocks, block_size, num_kv_heads, num_q_heads, head_dim;
  int64_t s_block, s_kv, s_tok, s_head;      // data strides (elements)
  int64_t ss_block, ss_kv, ss_tok, ss_head;  // scales strides (elements)
  int64_t batch, max_blocks, window, q_tile, num_splits, num_threads;
  double scale;
  int64_t q_dtype, s_qtok, s_qhead;      // query element type (kF32/kBF16/kF16), strides
  int64_t out_dtype, s_otok, s_ohead;    // output element type and strides
  int64_t isa;                           // Isa: kIsaAuto picks the best the CPU runs
};

struct Item {
  int64_t b, h0, h1, t0, t1;  // sequence, kv heads [h0, h1), query tokens [t0, t1) of its chunk
  int64_t k0, k1;             // key range of this split
  int64_t slot;               // partial-result slot (split mode), else -1
  int64_t cost;
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using kvmesh_cvt::bf16_to_f32;
using kvmesh_cvt::bits_to_f32;
using kvmesh_cvt::f16_to_f32;
using kvmesh_cvt::f32_to_bf16;
using kvmesh_cvt::f32_to_bits;
using kvmesh_cvt::f32_to_f16;

// Element i of a float32 / bfloat16 / float16 array as float.
KVM_INLINE float load_elem(const void* base, int64_t dtype, int64_t i) {
  if (dtype == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  if (dtype == kF16) return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
  return static_cast<const float*>(base)[i];
}

// Row of head_dim elements as float: f32 rows are used in place, others converted into buf.
template <int DT>
KVM_INLINE const float* load_row(const char* base, int64_t elem, const float* lut, float* buf,
                                 int64_t n) {
  if constexpr (DT == kF32) {
    return reinterpret_cast<const float*>(base) + elem;
  } else if constexpr (DT == kBF16) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(base) + elem;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) buf[d] = bf16_to_f32(s[d]);
  } else if constexpr (DT == kF16) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(base) + elem;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) buf[d] = f16_to_f32(s[d]);
  } else if constexpr (DT == kI8) {
    const int8_t* s = reinterpret_cast<const int8_t*>(base) + elem;
#pragma omp simd
    for (int64_t d = 0; d < n; ++d) buf[d] = static_cast<float>(s[d]);
  } else {
    const uint8_t* s = reinterpret_cast<const uint8_t*>(base) + elem;
    for (int64_t d = 0; d < n; ++d) buf[d] = lut[s[d]];
  }
  return buf;
}

// Uninitialized per-thread buffer (every element is written before it is read).
template <typename T>
struct Buf {
  std::unique_ptr<T[]> ptr;
  void resize(int64_t n) { ptr.reset(new T[static_cast<size_t>(std::max<int64_t>(n, 1))]); }
  T* data() { return ptr.get(); }
};

struct Scratch {
  Buf<float> q, acc, s, kbuf, vbuf, kt, m, l;  // kt: K transposed [D, 64] (AVX-512 prefill)
  Buf<uint16_t> qb;  // bfloat16 query rows as given, unscaled (the vdpbf16ps scores' operand)
  Buf<int64_t> pos;
  Buf<const float*> kp, vp;
  Buf<const void*> kraw, vraw;  // key / value rows in the cache's element type
  Buf<int64_t> koff, soff;      // element offsets of keys and of their scales (two steps)
  // Dynamic scheduling: the call's items, their shared counter, and the item this thread
  // claimed to run next (-1: none yet). A decode item claims it at its last step, so that
  // step can prefetch the next item's first keys; claiming earlier would tie items to a
  // thread before another thread is free to take them.
  const Item* items = nullptr;
  std::atomic<int64_t>* counter = nullptr;
  int64_t count = 0, claimed = -1;

  const Item* following() {  // the next item this thread runs (claimed once), or null
    if (claimed < 0) claimed = counter->fetch_add(1);
    return claimed < count ? items + claimed : nullptr;
  }
};

// Element size in bytes of a cache element type.
constexpr int64_t elem_bytes(int64_t dt) {
  return dt == kF32 ? 4 : (dt == kI8 || dt == kFP8) ? 1 : 2;
}

// Query rows per kv head up to which an item counts as decode: the AVX-512 path converts its
// 16- and 8-bit rows in registers at every load (above it each block's rows are converted once
// into float32 buffers and reused), and both vector paths pace its prefetch with a Cursor
// (whatever its key size: with requests in bursts, float32 keys of 8 KiB and more, 8 kv heads x
// 128, were better left to the hardware prefetcher; paced, they run 0.73-0.82x the time).
constexpr int64_t kDirectRows = 8;

// Whether a prefill item reading key_bytes of K and V per key prefetches its next step (in
// pieces): not float32 keys of 8 KiB or more, whose long contiguous rows the hardware prefetcher
// streams by itself.
KVM_INLINE bool prefetches(int64_t dt, int64_t key_bytes) {
  return dt != kF32 || key_bytes < 8192;
}

// The K and V lines of the next keys an item reads (its next step, or at its last step the
// first step of the item this thread runs next), requested into L2 (prefetcht1) evenly over
// the current step's work: every vector load of a K or V row calls `issue(loads)`, which
// requests the lines due by then (`per_load` lines per `loads_due` loads), so memory requests
// keep flowing while the chunk computes. (Requests in bursts, even spread over the chunk in
// pieces, stall on the core's few line-fill buffers while nothing computes, and so do not
// overlap the compute; a standalone read of random 24 KiB blocks with compute between the
// lines ran 1.4-1.5x faster with one request per line than with bursts or none. Into L1, the
// requests in flight are bounded by those buffers, so where memory is far (an AMD EPYC of
// family 19h: decode attention at 18-21 GB/s of a 56 GB/s read) they bound the rate; into L2
// they use the L2's own, more numerous miss slots: 0.56-0.76x the time there.) Lines of key
// i in order: K of heads [h0, h1), then V of those heads, each half one run of bytes from head
// h0's row to the end of head h1 - 1's (adjacent rows in the cache's layout; with a wider head
// stride the run spans the gaps too), so a line costs an add and a compare and a run's address
// is computed once. n = 0: nothing to request.
struct Cursor {
  const char* data = nullptr;
  const int64_t* koff = nullptr;  // element offsets of the keys (K of kv head 0)
  int64_t n = 0, h0 = 0;
  int64_t s_head = 0, s_kv = 0, eb = 0;             // strides in elements, size in bytes
  int64_t run_bytes = 0;                            // a key's heads [h0, h1), one half
  int64_t per_load = 1, loads_due = 1, credit = 0;  // pace: lines per loads
  int64_t i = 0, half = 0;                          // the run: key i's K (0) or V (1) rows
  const char* line = nullptr;                       // the run's next line
  const char* end = nullptr;                        // one past the run's last byte

  // Points line / end at the current run (key i, half), from the line holding its first byte.
  KVM_INLINE void start_run() {
    const char* row = data + (koff[i] + h0 * s_head + half * s_kv) * eb;
    line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(row) & ~uintptr_t{63});
    end = row + run_bytes;
  }

  KVM_INLINE void issue(int64_t loads) {
    if (i >= n) return;
    credit += loads * per_load;
    for (; credit >= loads_due; credit -= loads_due) {
      __builtin_prefetch(line, 0, 2);  // prefetcht1 on x86
      line += 64;
      if (line < end) continue;
      half ^= 1;
      if (half == 0 && ++i >= n) return;
      start_run();
    }
  }
};

// A cursor that requests nothing (items whose next keys are prefetched in pieces, or not).
struct NoCursor {
  KVM_INLINE void issue(int64_t) {}
};

// A cursor over the lines of n keys at koff, kv heads [h0, h1), elements of eb bytes, paced
// over `loads` row loads.
KVM_INLINE Cursor lines_of(const Params& p, const char* data, const int64_t* koff, int64_t n,
                           int64_t h0, int64_t h1, int64_t eb, int64_t loads) {
  Cursor pf;
  pf.data = data;
  pf.koff = koff;
  pf.n = n;
  pf.h0 = h0;
  pf.s_head = p.s_head;
  pf.s_kv = p.s_kv;
  pf.eb = eb;
  const int64_t row_bytes = p.head_dim * eb;
  const int64_t lines = n * (h1 - h0) * 2 * ((row_bytes + 63) / 64);
  pf.loads_due = std::max<int64_t>(1, loads);
  // At most one line per load: a short last step of one item does not burst the next item's
  // first step out at once (the cursor then covers that step's first lines only).
  pf.per_load = std::min(lines, pf.loads_due);
  pf.run_bytes = (h1 - h0 - 1) * p.s_head * eb + row_bytes;
  if (n > 0) pf.start_run();
  return pf;
}

// An item's query rows, ordered [head][token][g] (row = (h - h0) * ntok * G + (t - t0) * G + g),
// as float32 times `scale` into q [rows, D]; pos[row] = the row's position in its sequence.
// With qb (bfloat16 queries only), the rows as given, unscaled, into qb [rows, D] too.
inline void load_queries(const Params& p, const Item& it, float* q, int64_t* pos,
                         uint16_t* qb = nullptr) {
  const int64_t D = p.head_dim, G = p.num_q_heads / p.num_kv_heads;
  const int64_t ntok = it.t1 - it.t0, rph = ntok * G;
  const int32_t* qsl = reinterpret_cast<const int32_t*>(p.query_start_loc);
  const int32_t* seq_lens = reinterpret_cast<const int32_t*>(p.seq_lens);
  const int64_t q_len = qsl[it.b + 1] - qsl[it.b];
  const int64_t pos0 = seq_lens[it.b] - q_len + it.t0;
  const float scale = static_cast<float>(p.scale);
  const void* src = reinterpret_cast<const void*>(p.q);
  for (int64_t hh = 0; hh < it.h1 - it.h0; ++hh) {
    for (int64_t t = 0; t < ntok; ++t) {
      const int64_t tok = qsl[it.b] + it.t0 + t;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t row = hh * rph + t * G + g;
        const int64_t head = (it.h0 + hh) * G + g;
        const int64_t base = tok * p.s_qtok + head * p.s_qhead;
        float* dst = q + row * D;
        if (p.q_dtype == kF32) {
          const float* s = static_cast<const float*>(src) + base;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] = s[d] * scale;
        } else if (p.q_dtype == kBF16) {
          const uint16_t* s = static_cast<const uint16_t*>(src) + base;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] = bf16_to_f32(s[d]) * scale;
          if (qb != nullptr) std::memcpy(qb + row * D, s, sizeof(uint16_t) * D);
        } else {
          const uint16_t* s = static_cast<const uint16_t*>(src) + base;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) dst[d] = f16_to_f32(s[d]) * scale;
        }
        pos[row] = pos0 + t;
      }
    }
  }
}

// Stores src [D] float32 times inv as output row (token tok, query head) in p.out_dtype.
inline void store_out_row(const Params& p, int64_t tok, int64_t head, const float* src,
                          float inv) {
  const int64_t D = p.head_dim;
  const int64_t base = tok * p.s_otok + head * p.s_ohead;
  if (p.out_dtype == kF32) {
    float* dst = reinterpret_cast<float*>(p.out) + base;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv;
  } else if (p.out_dtype == kBF16) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(p.out) + base;
    for (int64_t d = 0; d < D; ++d) dst[d] = f32_to_bf16(src[d] * inv);
  } else {
    uint16_t* dst = reinterpret_cast<uint16_t*>(p.out) + base;
    for (int64_t d = 0; d < D; ++d) dst[d] = f32_to_f16(src[d] * inv);
  }
}

// Final output of an unsplit item: row r of acc [rows, D] divided by l[r] (zeros when l is 0).
inline void store_item_output(const Params& p, const Item& it, const float* acc,
                              const float* l) {
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t ntok = it.t1 - it.t0, rph = ntok * G;
  const int32_t* qsl = reinterpret_cast<const int32_t*>(p.query_start_loc);
  for (int64_t hh = 0; hh < it.h1 - it.h0; ++hh) {
    for (int64_t t = 0; t < ntok; ++t) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = hh * rph + t * G + g;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        store_out_row(p, qsl[it.b] + it.t0 + t, (it.h0 + hh) * G + g, acc + r * p.head_dim, inv);
      }
    }
  }
}

// Split mode: the item's (acc, m, l) rows into its partial-result slot.
inline void store_item_partial(const Item& it, int64_t rows, int64_t rmax, int64_t D,
                               const float* acc, const float* m, const float* l, float* part_acc,
                               float* part_ml) {
  std::memcpy(part_acc + it.slot * rmax * D, acc, sizeof(float) * rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    part_ml[(it.slot * rmax + r) * 2] = m[r];
    part_ml[(it.slot * rmax + r) * 2 + 1] = l[r];
  }
}

// Start of an item: its query rows and positions loaded (with raw_bf16, also as given into
// sc.qb), the online-softmax state (acc, m, l) of its `rows` rows cleared.
inline void begin_item(const Params& p, const Item& it, Scratch& sc, int64_t rows,
                       bool raw_bf16 = false) {
  load_queries(p, it, sc.q.data(), sc.pos.data(), raw_bf16 ? sc.qb.data() : nullptr);
  std::fill(sc.acc.data(), sc.acc.data() + rows * p.head_dim, 0.f);
  std::fill(sc.m.data(), sc.m.data() + rows, kNegInf);
  std::fill(sc.l.data(), sc.l.data() + rows, 0.f);
}

// End of an item: its partial result into its slot (split mode), else its final output.
inline void finish_item(const Params& p, const Item& it, Scratch& sc, int64_t rows,
                        int64_t rmax, float* part_acc, float* part_ml) {
  if (it.slot >= 0) {
    store_item_partial(it, rows, rmax, p.head_dim, sc.acc.data(), sc.m.data(), sc.l.data(),
                       part_acc, part_ml);
  } else {
    store_item_output(p, it, sc.acc.data(), sc.l.data());
  }
}

#pragma GCC diagnostic ignored "-Wpsabi"  // f8 only crosses always-inline calls

// 8-float vectors (GCC vector extensions): one AVX2 register in the x86-64-v3 clone, two SSE
// registers in the baseline clone; a * b + c contracts to FMA where the ISA has it.
typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8v __attribute__((vector_size(32)));

KVM_INLINE f8 ld8(const float* p) {
  f8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
KVM_INLINE void st8(float* p, f8 v) { std::memcpy(p, &v, sizeof(v)); }
KVM_INLINE f8 vmax(f8 a, f8 b) { return a > b ? a : b; }
KVM_INLINE float hsum(f8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
KVM_INLINE float hmax(f8 v) {
  float m = v[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, v[j]);
  return m;
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define KVM_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define KVM_SHUF(a, b, ...) __builtin_shuffle(a, b, i8v{__VA_ARGS__})
#endif

// Broadcast. Written as a shuffle: GCC builds f8{x, x, ...} lane by lane inside target clones.
KVM_INLINE f8 splat(float x) {
  const f8 v = f8{x};
  return KVM_SHUF(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
}

// Pairwise horizontal add of a and b per 128-bit lane (vhaddps).
KVM_INLINE f8 hadd(f8 a, f8 b) {
  return KVM_SHUF(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + KVM_SHUF(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}
// Eight horizontal sums at once: result[j] = sum of the lanes of a[j].
KVM_INLINE f8 reduce8(const f8* a) {
  const f8 u0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));  // lanes: 0123 | 0123 halves
  const f8 u1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return KVM_SHUF(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) + KVM_SHUF(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// exp(x) for x <= 0 (scores minus the running max), -inf -> 0. Cephes expf: Cody-Waite range
// reduction and a degree-6 polynomial, about 1 ulp; below ln(FLT_MIN) the result is 0.
KVM_INLINE f8 exp8(f8 x) {
  const f8 lo = splat(-87.33654475f);
  const f8 xc = vmax(x, lo);
  const f8 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const f8 n = (xc * splat(1.44269504088896341f) + magic) - magic;
  f8 r = xc - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  f8 y = splat(1.9875691500e-4f);
  y = y * r + splat(1.3981999507e-3f);
  y = y * r + splat(8.3334519073e-3f);
  y = y * r + splat(4.1665795894e-2f);
  y = y * r + splat(1.6666665459e-1f);
  y = y * r + splat(5.0000001201e-1f);
  y = y * (r * r) + r + splat(1.f);
  const i8v e = (__builtin_convertvector(n, i8v) + 127) << 23;  // 2^n, n in [-126, 0]
  f8 pow2;
  std::memcpy(&pow2, &e, sizeof(pow2));
  y *= pow2;
  i8v bits;
  std::memcpy(&bits, &y, sizeof(bits));
  bits &= x >= lo;  // all-ones lanes where x >= lo
  std::memcpy(&y, &bits, sizeof(y));
  return y;
}

// Scores of R query rows (stride D) against KB key rows: R x KB accumulators over head_dim in
// registers, one reduction per tile. s[r * sp + j].
template <int R, int KB, class Pf>
KVM_INLINE void qk_tile(const float* q, int64_t D, const float* const* kp, float* s, int64_t sp,
                        Pf& pf) {
  f8 acc[R * KB];
  for (int j = 0; j < R * KB; ++j) acc[j] = f8{};
  for (int64_t d = 0; d < D; d += 8) {
    f8 kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = ld8(kp[j] + d);
    pf.issue(KB);
    for (int r = 0; r < R; ++r) {
      const f8 qv = ld8(q + r * D + d);
      for (int j = 0; j < KB; ++j) acc[r * KB + j] += qv * kv[j];
    }
  }
  if constexpr (R * KB == 8) {
    const f8 t = reduce8(acc);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < KB; ++j) s[r * sp + j] = t[r * KB + j];
  } else {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < KB; ++j) s[r * sp + j] = hsum(acc[r * KB + j]);
  }
}

// s[r * sp + i] = q_r . k_i for rows < nrows, keys < round_up(n, 8) (kp padded to that).
template <class Pf>
KVM_INLINE void scores(const float* q, int64_t nrows, const float* const* kp, int64_t n,
                       int64_t D, float* s, int64_t sp, Pf& pf) {
  int64_t r = 0;
  for (; r + 4 <= nrows; r += 4)
    for (int64_t i = 0; i < n; i += 2) qk_tile<4, 2>(q + r * D, D, kp + i, s + r * sp + i, sp, pf);
  for (; r + 2 <= nrows; r += 2)
    for (int64_t i = 0; i < n; i += 4) qk_tile<2, 4>(q + r * D, D, kp + i, s + r * sp + i, sp, pf);
  for (; r < nrows; ++r)
    for (int64_t i = 0; i < n; i += 8) qk_tile<1, 8>(q + r * D, D, kp + i, s + r * sp + i, sp, pf);
}

// Vector loads of K and V rows per key of one kv head in a vector-path item with rph query
// rows per kv head: scores and P x V each load every row once per row group (4 rows, then 2,
// then 1; P x V takes a last 3 rows as one group), 8 floats a load.
KVM_INLINE int64_t loads_per_key8(int64_t rph, int64_t D) {
  const int64_t rest = rph % 4;
  const int64_t qk_groups = rph / 4 + rest / 2 + rest % 2;
  const int64_t pv_groups = rph / 4 + (rest == 3 ? 1 : rest / 2 + rest % 2);
  return (qk_groups + pv_groups) * (D / 8);
}

// acc[r][d0 .. d0 + 8 DV) += sum_i p[r * sp + i] * v_i[d0 ..]: R x DV accumulators in registers
// for the whole block, so acc is loaded and stored once per block.
template <int R, int DV, class Pf>
KVM_INLINE void pv_tile(float* acc, int64_t D, const float* p, int64_t sp,
                        const float* const* vp, int64_t n, int64_t d0, Pf& pf) {
  f8 a[R * DV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) a[r * DV + j] = ld8(acc + r * D + d0 + 8 * j);
  for (int64_t i = 0; i < n; ++i) {
    f8 vv[DV];
    for (int j = 0; j < DV; ++j) vv[j] = ld8(vp[i] + d0 + 8 * j);
    pf.issue(DV);
    for (int r = 0; r < R; ++r) {
      const f8 w = splat(p[r * sp + i]);
      for (int j = 0; j < DV; ++j) a[r * DV + j] += w * vv[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) st8(acc + r * D + d0 + 8 * j, a[r * DV + j]);
}

template <class Pf>
KVM_INLINE void pv(float* acc, int64_t nrows, const float* p, int64_t sp, const float* const* vp,
                   int64_t n, int64_t D, Pf& pf) {
  int64_t r = 0;
  for (; r + 4 <= nrows; r += 4)
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      pv_tile<4, 2>(acc + r * D, D, p + r * sp, sp, vp, n, d0, pf);
  if (nrows - r == 3) {  // 3 query heads per kv head: one pass over V for the three
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      pv_tile<3, 2>(acc + r * D, D, p + r * sp, sp, vp, n, d0, pf);
    return;
  }
  for (; r + 2 <= nrows; r += 2)
    for (int64_t d0 = 0; d0 < D; d0 += 16)
      pv_tile<2, 2>(acc + r * D, D, p + r * sp, sp, vp, n, d0, pf);
  for (; r < nrows; ++r) {
    int64_t d0 = 0;
    for (; d0 + 32 <= D; d0 += 32) pv_tile<1, 4>(acc + r * D, D, p + r * sp, sp, vp, n, d0, pf);
    for (; d0 < D; d0 += 16) pv_tile<1, 2>(acc + r * D, D, p + r * sp, sp, vp, n, d0, pf);
  }
}

KVM_INLINE float dot1(const float* a, const float* k, int64_t n) {
  // Four chains over the four quarters of the row (head dims are multiples of 16).
  const int64_t q = n / 4;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < q; ++d) {
    s0 += a[d] * k[d];
    s1 += a[d + q] * k[d + q];
    s2 += a[d + 2 * q] * k[d + 2 * q];
    s3 += a[d + 3 * q] * k[d + 3 * q];
  }
  return (s0 + s1) + (s2 + s3);
}

KVM_INLINE void dot4(const float* q, int64_t n, const float* k, float* s, int64_t stride) {
  // Four query rows (q, q + n, ...) against one key row: K read once, four chains.
  const float *a0 = q, *a1 = q + n, *a2 = q + 2 * n, *a3 = q + 3 * n;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < n; ++d) {
    const float kd = k[d];
    s0 += a0[d] * kd;
    s1 += a1[d] * kd;
    s2 += a2[d] * kd;
    s3 += a3[d] * kd;
  }
  s[0] = s0;
  s[stride] = s1;
  s[2 * stride] = s2;
  s[3 * stride] = s3;
}

KVM_INLINE void axpy(float* acc, float w, const float* v, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += w * v[d];
}

// The part [k_lo, k_hi) of an item's key range inside one block (k_hi: the block's end or k1),
// as int64 element offsets of kv head 0's K row of key k_lo, its V row (+ s_kv) and its scale;
// a head adds h * s_head (h * ss_head for scales), a key i * s_tok. Table entries are clamped.
struct BlockSpan {
  int64_t k_hi, n, kbase, vbase, sbase;
};

KVM_INLINE BlockSpan block_span(const Params& p, const int32_t* table, int64_t k_lo, int64_t k1) {
  const int64_t bs = p.block_size;
  const int64_t blk = k_lo / bs;
  const int64_t k_hi = std::min(k1, (blk + 1) * bs);
  const int64_t phys = std::min<int64_t>(std::max<int64_t>(table[blk], 0), p.num_blocks - 1);
  const int64_t off0 = k_lo - blk * bs;
  const int64_t kbase = phys * p.s_block + off0 * p.s_tok;
  return {k_hi, k_hi - k_lo, kbase, kbase + p.s_kv, phys * p.ss_block + off0 * p.ss_tok};
}

// The lines of the block after [.., k_hi) of item `it` (at its last block, of the first block
// of the item this thread runs next, claimed here), paced over `loads` row loads; their key
// offsets go to sc.koff.
KVM_INLINE Cursor next_block(const Params& p, const Item& it, int64_t k_hi, int64_t eb,
                             int64_t loads, Scratch& sc) {
  const Item* owner = k_hi < it.k1 ? &it : sc.following();
  if (owner == nullptr || owner->k1 <= owner->k0) return Cursor{};
  const int32_t* table =
      reinterpret_cast<const int32_t*>(p.block_tables) + owner->b * p.max_blocks;
  const BlockSpan span = block_span(p, table, owner == &it ? k_hi : owner->k0, owner->k1);
  int64_t* koff = sc.koff.data();
  for (int64_t i = 0; i < span.n; ++i) koff[i] = span.kbase + i * p.s_tok;
  const char* data = reinterpret_cast<const char*>(p.data);
  return lines_of(p, data, koff, span.n, owner->h0, owner->h1, eb, loads);
}

// Rows are ordered [head][token][g]: row = (h - h0) * ntok * G + (t - t0) * G + g. Pf: Cursor
// (decode items: the next block's lines requested as this block's rows load) or NoCursor.
template <int DT, class Pf>
KVM_INLINE void run_item(const Params& p, const Item& it, Scratch& sc, int64_t rmax,
                         float* part_acc, float* part_ml) {
  const int64_t D = p.head_dim, bs = p.block_size, hq = p.num_q_heads;
  const int64_t sp = (bs + 7) / 8 * 8;  // score row stride: whole vectors
  const int64_t G = hq / p.num_kv_heads;
  const int64_t ntok = it.t1 - it.t0, nheads = it.h1 - it.h0;
  const int64_t rph = ntok * G;  // rows per kv head
  const int64_t rows = nheads * rph;
  const int32_t* table = reinterpret_cast<const int32_t*>(p.block_tables) + it.b * p.max_blocks;
  const char* data = reinterpret_cast<const char*>(p.data);
  const float* scales = reinterpret_cast<const float*>(p.scales);
  const float* lut = reinterpret_cast<const float*>(p.fp8_lut);
  const bool quant = DT == kI8 || DT == kFP8;

  float* q = sc.q.data();
  float* acc = sc.acc.data();
  float* s = sc.s.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  int64_t* pos = sc.pos.data();
  const float** kp = sc.kp.data();
  const float** vp = sc.vp.data();
  begin_item(p, it, sc, rows);
  const int64_t pos_min = pos[0], pos_max = pos[rph - 1];  // first and last token positions

  for (int64_t k_lo = it.k0; k_lo < it.k1;) {
    const BlockSpan span = block_span(p, table, k_lo, it.k1);
    const int64_t k_hi = span.k_hi, n = span.n;
    const int64_t kbase = span.kbase, vbase = span.vbase, sbase = span.sbase;
    Pf pf{};
    if constexpr (std::is_same_v<Pf, Cursor>) {
      const int64_t loads = n * nheads * loads_per_key8(rph, D);  // this block's row loads
      pf = next_block(p, it, k_hi, elem_bytes(DT), loads, sc);
    }

    // Scores s[r * sp + i]: per kv head, register tiles of query rows x keys.
    for (int64_t hh = 0; hh < nheads; ++hh) {
      const int64_t h = it.h0 + hh;
      for (int64_t i = 0; i < n; ++i) {
        kp[i] = load_row<DT>(data, kbase + i * p.s_tok + h * p.s_head, lut,
                             sc.kbuf.data() + i * D, D);
      }
      for (int64_t i = n; i < sp; ++i) kp[i] = kp[0];  // padding keys, scores discarded
      float* sh = s + hh * rph * sp;
      scores(q + hh * rph * D, rph, kp, n, D, sh, sp, pf);
      if (quant) {
        for (int64_t i = 0; i < n; ++i) {
          const float ks = scales[sbase + i * p.ss_tok + h * p.ss_head];
          for (int64_t r = 0; r < rph; ++r) sh[r * sp + i] *= ks;
        }
      }
    }
    const bool full = k_hi - 1 <= pos_min && (p.window <= 0 || k_lo > pos_max - p.window);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * sp;
      if (!full) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = k_lo + i;
          if (t > pos[r] || (p.window > 0 && t <= pos[r] - p.window)) sr[i] = kNegInf;
        }
      }
      for (int64_t i = n; i < sp; ++i) sr[i] = kNegInf;
    }
    // Online softmax, rescaling once per block: s becomes probabilities relative to the
    // running max.
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * sp;
      f8 mx8 = ld8(sr);
      for (int64_t c = 8; c < sp; c += 8) mx8 = vmax(mx8, ld8(sr + c));
      const float mx = hmax(mx8);
      if (mx == kNegInf) {
        std::fill(sr, sr + sp, 0.f);
        continue;
      }
      const float m_new = std::max(m[r], mx);
      const float corr = std::exp(m[r] - m_new);
      const f8 mv = splat(m_new);
      f8 sum8 = f8{};
      for (int64_t c = 0; c < sp; c += 8) {
        const f8 e = exp8(ld8(sr + c) - mv);
        st8(sr + c, e);
        sum8 += e;
      }
      if (corr != 1.f) {
        float* ar = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      }
      l[r] = l[r] * corr + hsum(sum8);
      m[r] = m_new;
    }
    // acc += p x V per kv head: rank-n update with accumulators in registers.
    for (int64_t hh = 0; hh < nheads; ++hh) {
      const int64_t h = it.h0 + hh;
      for (int64_t i = 0; i < n; ++i) {
        vp[i] = load_row<DT>(data, vbase + i * p.s_tok + h * p.s_head, lut,
                             sc.vbuf.data() + i * D, D);
      }
      float* sh = s + hh * rph * sp;
      if (quant) {
        for (int64_t i = 0; i < n; ++i) {
          const float vs = scales[sbase + p.ss_kv + i * p.ss_tok + h * p.ss_head];
          for (int64_t r = 0; r < rph; ++r) sh[r * sp + i] *= vs;
        }
      }
      pv(acc + hh * rph * D, rph, sh, sp, vp, n, D, pf);
    }
    k_lo = k_hi;
  }

  finish_item(p, it, sc, rows, rmax, part_acc, part_ml);
}

// Portable item: four query rows per K row with horizontal sums, scalar exp, written for
// auto-vectorization at the baseline ISA (where the 8-float tiles would be split and spilled).
// Same row order and results as run_item.
template <int DT>
KVM_INLINE void run_item_portable(const Params& p, const Item& it, Scratch& sc, int64_t rmax,
                         float* part_acc, float* part_ml) {
  const int64_t D = p.head_dim, bs = p.block_size, hq = p.num_q_heads;
  const int64_t G = hq / p.num_kv_heads;
  const int64_t ntok = it.t1 - it.t0, nheads = it.h1 - it.h0;
  const int64_t rph = ntok * G;  // rows per kv head
  const int64_t rows = nheads * rph;
  const int32_t* table = reinterpret_cast<const int32_t*>(p.block_tables) + it.b * p.max_blocks;
  const char* data = reinterpret_cast<const char*>(p.data);
  const float* scales = reinterpret_cast<const float*>(p.scales);
  const float* lut = reinterpret_cast<const float*>(p.fp8_lut);
  const bool quant = DT == kI8 || DT == kFP8;

  float* q = sc.q.data();
  float* acc = sc.acc.data();
  float* s = sc.s.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  int64_t* pos = sc.pos.data();
  begin_item(p, it, sc, rows);
  const int64_t pos_min = pos[0], pos_max = pos[rph - 1];  // first and last token positions

  for (int64_t k_lo = it.k0; k_lo < it.k1;) {
    const BlockSpan span = block_span(p, table, k_lo, it.k1);
    const int64_t k_hi = span.k_hi, n = span.n;
    const int64_t kbase = span.kbase, vbase = span.vbase, sbase = span.sbase;

    // Scores s[r * bs + i], token-major over the block so K is read in address order.
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t hh = 0; hh < nheads; ++hh) {
        const int64_t h = it.h0 + hh;
        const float* k = load_row<DT>(data, kbase + i * p.s_tok + h * p.s_head, lut,
                                      sc.kbuf.data(), D);
        const float* qh = q + hh * rph * D;
        float* sh = s + hh * rph * bs + i;
        int64_t r = 0;
        for (; r + 4 <= rph; r += 4) dot4(qh + r * D, D, k, sh + r * bs, bs);
        for (; r < rph; ++r) sh[r * bs] = dot1(qh + r * D, k, D);
        if (quant) {
          const float ks = scales[sbase + i * p.ss_tok + h * p.ss_head];
          for (r = 0; r < rph; ++r) sh[r * bs] *= ks;
        }
      }
    }
    const bool full = k_hi - 1 <= pos_min && (p.window <= 0 || k_lo > pos_max - p.window);
    if (!full) {
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t t = k_lo + i;
          if (t > pos[r] || (p.window > 0 && t <= pos[r] - p.window)) s[r * bs + i] = kNegInf;
        }
      }
    }
    // Online softmax: s becomes probabilities relative to the running max.
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * bs;
      float mx = kNegInf;
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sr[i]);
      if (mx == kNegInf) {
        std::fill(sr, sr + n, 0.f);
        continue;
      }
      const float m_new = std::max(m[r], mx);
      const float corr = std::exp(m[r] - m_new);
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i) {
        sr[i] = std::exp(sr[i] - m_new);
        sum += sr[i];
      }
      if (corr != 1.f) {
        float* ar = acc + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
      }
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
    }
    // acc += p * V per head: each output element accumulates over the block's n keys in a
    // register (V rows stay in L1), so acc is loaded and stored once per block.
    for (int64_t hh = 0; hh < nheads; ++hh) {
      const int64_t h = it.h0 + hh;
      for (int64_t i = 0; i < n; ++i) {
        sc.vp.data()[i] = load_row<DT>(data, vbase + i * p.s_tok + h * p.s_head, lut,
                                   sc.vbuf.data() + i * D, D);
      }
      if (quant) {
        for (int64_t i = 0; i < n; ++i) {
          const float vs = scales[sbase + p.ss_kv + i * p.ss_tok + h * p.ss_head];
          for (int64_t r = hh * rph; r < (hh + 1) * rph; ++r) s[r * bs + i] *= vs;
        }
      }
      const float* const* vr = sc.vp.data();
      for (int64_t r = hh * rph; r < (hh + 1) * rph; ++r) {
        const float* w = s + r * bs;
        float* ar = acc + r * D;
        for (int64_t d0 = 0; d0 < D; d0 += 16) {  // head dims are multiples of 16
          float a[16];
          for (int j = 0; j < 16; ++j) a[j] = ar[d0 + j];
          for (int64_t i = 0; i < n; ++i) {
            const float wi = w[i];
            const float* v = vr[i] + d0;
            for (int j = 0; j < 16; ++j) a[j] += wi * v[j];
          }
          for (int j = 0; j < 16; ++j) ar[d0 + j] = a[j];
        }
      }
    }
    k_lo = k_hi;
  }

  finish_item(p, it, sc, rows, rmax, part_acc, part_ml);
}

// ---------------------------------------------------------------------------------------
// AVX-512 item: the same algorithm and row order as run_item in 16-float vectors (32
// registers), compiled for AVX-512 F/BW/DQ/VL + FMA through a target pragma (everything in this
// section; the shared helpers above stay at the baseline ISA) and chosen at run time.
//   steps   up to 64 keys (several blocks: key offsets through the block table) per online-
//           softmax step, fewer when a key's K/V are large (chunk_keys);
//   scores  register tiles of 4 rows x 4 keys (2 x 8, 1 x 16 for remainder rows), 16
//           accumulators over head_dim reduced by one 16-way transpose-add per tile; prefill
//           items score 4 rows x 64 keys against the step's K transposed, no reduction;
//   softmax vectorized exp (Cephes polynomial + scalef), acc rescaled only when the max moved;
//   P x V   tiles of 4 rows x 64 dims (1 x 128 for remainder rows) in registers over a step.
// Items with at most kDirectRows query rows per kv head (decode, and short prefill tiles) run
// each pass in groups of 16 keys, every kv head within a group, and request the next step's
// lines (at their last step, the first step of the item their thread runs next) a few at a
// time as they load their rows (Cursor); items with more rows request the next step in pieces,
// one before each pass.
// bfloat16 / float16 / int8 / fp8 K and V rows are converted in registers as they are loaded
// (zero-extend and shift; vcvtph2ps; sign-extend and convert; e4m3fn bit placement), with no
// row buffer, when an item has few query rows per kv head (decode: G rows; quantized rows'
// scales multiply the scores and probabilities). Items with more rows (prefill tiles) convert
// each step's rows once into float32 buffers and reuse them.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVM_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12 on unpack/shuffle intrinsics
namespace avx512 {
#include "cpu_attention_avx512.h"
}  // namespace avx512
#pragma GCC diagnostic pop
#pragma GCC pop_options

// The same item with AVX512_BF16: a bfloat16 cache read by bfloat16 queries takes its scores
// from vdpbf16ps (pairs of bfloat16 products summed into float32, no conversion of K), the
// scale applied to each score after its sum. Run only on CPUs that have the extension; built
// by GCC 10 and later (the first with its intrinsics).
#if __GNUC__ >= 10
#define KVM_AVX512_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx512bf16")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define KVM_BF16_DOT 1
namespace avx512_bf16 {
#include "cpu_attention_avx512.h"
}  // namespace avx512_bf16
#undef KVM_BF16_DOT
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif  // __GNUC__ >= 10
#endif  // KVM_AVX512

// One item, by ISA: the AVX-512 path when the CPU has AVX-512 F/BW/DQ/VL (its AVX512_BF16
// copy for bfloat16 caches where the CPU has that too), else the register-tiled 8-float path
// compiled for AVX2 + FMA when the CPU has them, else the portable path at the baseline ISA.
// Checked at run time; Params.isa or the environment variable KVMESH_CPU_KERNEL_ISA
// (baseline | avx2 | avx512 | avx512bf16) caps the choice (tests, benches).
#if defined(__x86_64__) && defined(__GNUC__)
#define KVM_X86_DISPATCH 1
template <int DT>
__attribute__((target("avx2,fma"), noinline)) void run_item_avx2(const Params& p, const Item& it,
                                                                  Scratch& sc, int64_t rmax,
                                                                  float* part_acc,
                                                                  float* part_ml) {
  const int64_t rph = (it.t1 - it.t0) * (p.num_q_heads / p.num_kv_heads);
  if (rph <= kDirectRows) {
    run_item<DT, Cursor>(p, it, sc, rmax, part_acc, part_ml);
  } else {
    run_item<DT, NoCursor>(p, it, sc, rmax, part_acc, part_ml);
  }
}
#endif

template <int DT>
__attribute__((noinline)) void run_item_base(const Params& p, const Item& it, Scratch& sc,
                                             int64_t rmax, float* part_acc, float* part_ml) {
  run_item_portable<DT>(p, it, sc, rmax, part_acc, part_ml);
}

#ifdef KVM_AVX512
constexpr bool kAvx512Built = true;
#else
constexpr bool kAvx512Built = false;
#endif
#ifdef KVM_AVX512_BF16
constexpr bool kAvx512Bf16Built = true;
#else
constexpr bool kAvx512Bf16Built = false;
#endif

// The best ISA path this CPU (and this build) runs.
Isa best_isa() {
#ifdef KVM_X86_DISPATCH
  static const Isa best = [] {
    if (kAvx512Built && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma")) {
      const bool bf16 = kAvx512Bf16Built && __builtin_cpu_supports("avx512bf16");
      return bf16 ? kIsaAvx512Bf16 : kIsaAvx512;
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kIsaAvx2;
    return kIsaBaseline;
  }();
  return best;
#else
  return kIsaBaseline;
#endif
}

// KVMESH_CPU_KERNEL_ISA as an Isa cap (read once); kIsaAuto when unset or unknown.
Isa env_isa() {
  static const Isa cap = [] {
    const char* isa = std::getenv("KVMESH_CPU_KERNEL_ISA");
    if (isa == nullptr) return kIsaAuto;
    if (std::strcmp(isa, "baseline") == 0) return kIsaBaseline;
    if (std::strcmp(isa, "avx2") == 0) return kIsaAvx2;
    if (std::strcmp(isa, "avx512") == 0) return kIsaAvx512;
    if (std::strcmp(isa, "avx512bf16") == 0) return kIsaAvx512Bf16;
    return kIsaAuto;
  }();
  return cap;
}

// The path a call runs: the best available, capped by Params.isa, else by the environment.
Isa choose_isa(const Params& p) {
  Isa isa = best_isa();
  const Isa cap = p.isa != kIsaAuto ? static_cast<Isa>(p.isa) : env_isa();
  if (cap != kIsaAuto && cap < isa) isa = cap;
  return isa;
}

template <int DT>
void run_item_isa(Isa isa, const Params& p, const Item& it, Scratch& sc, int64_t rmax,
                  float* part_acc, float* part_ml) {
#ifdef KVM_AVX512
#ifdef KVM_AVX512_BF16
  if (isa == kIsaAvx512Bf16 && DT == kBF16) {
    avx512_bf16::run_item_avx512<DT>(p, it, sc, rmax, part_acc, part_ml);
    return;
  }
#endif
  if (isa >= kIsaAvx512) {
    avx512::run_item_avx512<DT>(p, it, sc, rmax, part_acc, part_ml);
    return;
  }
#endif
#ifdef KVM_X86_DISPATCH
  if (isa == kIsaAvx2) {
    run_item_avx2<DT>(p, it, sc, rmax, part_acc, part_ml);
    return;
  }
#endif
  run_item_base<DT>(p, it, sc, rmax, part_acc, part_ml);
}

template <int DT>
void run_items(const Params& p, const std::vector<Item>& items, int64_t rmax, float* part_acc,
               float* part_ml) {
  const int64_t D = p.head_dim, bs = p.block_size;
  const int64_t count = static_cast<int64_t>(items.size());
  const Isa isa = choose_isa(p);
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(p.num_threads))
  {
    Scratch sc;
    sc.q.resize(rmax * D);
    sc.qb.resize(rmax * D);
    sc.acc.resize(rmax * D);
    const int64_t sp = std::max<int64_t>((bs + 7) / 8 * 8, 64);  // 8-float rows; AVX-512 chunks
    sc.s.resize(rmax * sp);
    sc.koff.resize(2 * sp);
    sc.soff.resize(2 * sp);
    sc.kbuf.resize(sp * D);
    sc.vbuf.resize(sp * D);
    sc.kt.resize(64 * D);
    sc.kp.resize(sp);
    sc.vp.resize(sp);
    sc.kraw.resize(sp * p.num_kv_heads);  // one row-pointer run per kv head of an item
    sc.vraw.resize(sp * p.num_kv_heads);
    sc.m.resize(rmax);
    sc.l.resize(rmax);
    sc.pos.resize(rmax);
    // Dynamic scheduling over a shared counter; an item may claim this thread's next one
    // at its last step (Scratch::following) to prefetch it.
    sc.items = items.data();
    sc.counter = &next;
    sc.count = count;
    int64_t i = next.fetch_add(1);
    while (i < count) {
      sc.claimed = -1;
      run_item_isa<DT>(isa, p, items[i], sc, rmax, part_acc, part_ml);
      i = sc.claimed >= 0 ? sc.claimed : next.fetch_add(1);
    }
  }
}

// Combines the splits of each group: the rows of group j live in slots j * S .. j * S + S - 1.
void combine(const Params& p, const std::vector<Item>& groups, int64_t splits, int64_t rmax,
             const float* part_acc, const float* part_ml) {
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t D = p.head_dim;
  const int32_t* qsl = reinterpret_cast<const int32_t*>(p.query_start_loc);
  const int64_t count = static_cast<int64_t>(groups.size());
#pragma omp parallel num_threads(static_cast<int>(p.num_threads))
  {
    Buf<float> row;  // one combined output row, float32
    row.resize(D);
    float* o = row.data();
#pragma omp for schedule(static)
    for (int64_t j = 0; j < count; ++j) {
      const Item& it = groups[j];
      const int64_t ntok = it.t1 - it.t0, rph = ntok * G;
      for (int64_t hh = 0; hh < it.h1 - it.h0; ++hh) {
        for (int64_t t = 0; t < ntok; ++t) {
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = hh * rph + t * G + g;
            float mx = kNegInf;
            for (int64_t sp = 0; sp < splits; ++sp) {
              mx = std::max(mx, part_ml[((j * splits + sp) * rmax + r) * 2]);
            }
            std::fill(o, o + D, 0.f);
            float total = 0.f;
            for (int64_t sp = 0; sp < splits && mx != kNegInf; ++sp) {
              const int64_t idx = (j * splits + sp) * rmax + r;
              const float ms = part_ml[idx * 2];
              if (ms == kNegInf) continue;
              const float w = std::exp(ms - mx);
              total += part_ml[idx * 2 + 1] * w;
              axpy(o, w, part_acc + idx * D, D);
            }
            const float inv = total > 0.f ? 1.f / total : 0.f;
            store_out_row(p, qsl[it.b] + it.t0 + t, (it.h0 + hh) * G + g, o, inv);
          }
        }
      }
    }
  }
}

}  // namespace

// Return codes: 0 done; 1 bad shape parameters (heads, q_tile, block_size, head_dim); 2 unknown
// cache dtype; 3 a sequence whose lengths do not fit its block-table row (seq_len outside
// [0, max_blocks * block_size], or q_len = qsl[b + 1] - qsl[b] < 0), nothing computed. Block
// ids inside the table and query_start_loc's range are the caller's to check (dispatch,
// AttentionPlan).
extern "C" int kvmesh_cpu_paged_attention(const Params* params) {
  const Params& p = *params;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0 || p.q_tile <= 0 ||
      p.block_size <= 0 || p.head_dim % 16 != 0) {
    return 1;
  }
  const int32_t* qsl = reinterpret_cast<const int32_t*>(p.query_start_loc);
  const int32_t* seq_lens = reinterpret_cast<const int32_t*>(p.seq_lens);
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t rmax = std::max(p.q_tile * G, p.num_q_heads);

  // Groups: a decode row takes all kv heads; a prefill chunk is cut into (kv head, q_tile).
  std::vector<Item> groups;
  int64_t longest = 0;
  const int64_t capacity = p.max_blocks * p.block_size;  // tokens a block-table row holds
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t q_len = qsl[b + 1] - qsl[b], seq_len = seq_lens[b];
    // key_offsets / block_span index the row's first ceil(seq_len / block_size) entries.
    if (seq_len < 0 || seq_len > capacity || q_len < 0) return 3;
    const int64_t tile = q_len == 1 ? 1 : p.q_tile;
    const int64_t heads = q_len == 1 ? p.num_kv_heads : 1;
    for (int64_t t0 = 0; t0 < q_len; t0 += tile) {
      const int64_t t1 = std::min(q_len, t0 + tile);
      const int64_t first_pos = seq_len - q_len + t0, last_pos = seq_len - q_len + t1 - 1;
      int64_t k1 = std::max<int64_t>(0, last_pos + 1);
      int64_t k0 = p.window > 0 ? std::max<int64_t>(0, first_pos - p.window + 1) : 0;
      k0 = std::min(k0, k1);
      longest = std::max(longest, k1 - k0);
      for (int64_t h0 = 0; h0 < p.num_kv_heads; h0 += heads) {
        const int64_t cost = (k1 - k0 + 1) * (t1 - t0) * G * heads;
        groups.push_back({b, h0, h0 + heads, t0, t1, k0, k1, -1, cost});
      }
    }
  }
  if (groups.empty()) return 0;

  // Context splits only when there are too few groups to keep every thread busy.
  int64_t splits = p.num_splits;
  const int64_t count = static_cast<int64_t>(groups.size());
  if (splits <= 0) {
    const int64_t want = (4 * p.num_threads + count - 1) / count;
    const int64_t most = std::max<int64_t>(1, longest / 256);
    splits = count >= 2 * p.num_threads ? 1 : std::min(want, most);
  }
  splits = std::max<int64_t>(1, splits);

  std::vector<Item> items;
  std::vector<float> part_acc, part_ml;
  if (splits == 1) {
    items = groups;
  } else {
    items.reserve(count * splits);
    for (int64_t j = 0; j < count; ++j) {
      const Item& g = groups[j];
      int64_t chunk = (g.k1 - g.k0 + splits - 1) / splits;
      chunk = std::max<int64_t>(1, (chunk + p.block_size - 1) / p.block_size * p.block_size);
      for (int64_t sp = 0; sp < splits; ++sp) {
        Item it = g;
        it.k0 = std::min(g.k1, g.k0 + sp * chunk);
        it.k1 = std::min(g.k1, it.k0 + chunk);
        it.slot = j * splits + sp;
        it.cost = (it.k1 - it.k0 + 1) * (g.t1 - g.t0) * G * (g.h1 - g.h0);
        items.push_back(it);
      }
    }
    part_acc.assign(static_cast<size_t>(count * splits * rmax * p.head_dim), 0.f);
    part_ml.assign(static_cast<size_t>(count * splits * rmax * 2), 0.f);
  }
  // Longest first, so dynamic scheduling balances ragged lengths.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });

  float* pa = part_acc.empty() ? nullptr : part_acc.data();
  float* pm = part_ml.empty() ? nullptr : part_ml.data();
  switch (p.dtype) {
    case kF32: run_items<kF32>(p, items, rmax, pa, pm); break;
    case kBF16: run_items<kBF16>(p, items, rmax, pa, pm); break;
    case kF16: run_items<kF16>(p, items, rmax, pa, pm); break;
    case kI8: run_items<kI8>(p, items, rmax, pa, pm); break;
    case kFP8: run_items<kFP8>(p, items, rmax, pa, pm); break;
    default: return 2;
  }
  if (splits > 1) combine(p, groups, splits, rmax, pa, pm);
  return 0;
}
