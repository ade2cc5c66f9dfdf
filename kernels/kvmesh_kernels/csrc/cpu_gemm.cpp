// Linear layers on AVX-512 CPUs, bfloat16 (AVX512_BF16) and float32: y [M, N] = x [M, K] .
// W^T (+ bias), W [N, K] packed once at load, sums in float32.
//
//   packed  per 32-column panel, for each step of k (a pair of k in bfloat16, one k in
//           float32), the 32 columns' weights side by side: [ceil(N / 32)][K / step][32][step],
//           so that two 512-bit loads feed one step of a tile. Columns past N are zero.
//           bfloat16 needs an even K.
//   tile    MR rows x 32 columns (2 x MR accumulators, up to 12 rows: 24 of the 32 registers),
//           each row's step of x broadcast. bfloat16: vdpbf16ps adds both exact products of a
//           pair into float32 (subnormal inputs read as zero: oneDNN's bfloat16 GEMM on these
//           CPUs uses the same instruction); float32: one FMA per k, k in order.
//   threads each takes a contiguous range of 32-column panels (an even split to one panel),
//           rows in chunks that keep the chunk of x in L2. While a panel's first tile runs,
//           the thread prefetches its next panel from memory (prefetcht1): a decode step's
//           weights stream from DRAM once per step, and the prefetch overlaps that stream
//           with the multiply-adds instead of stalling on it (docs/BENCHMARKS.md).
//   output  bias (float32) added to the sums; bfloat16 rounds to nearest even
//           (vcvtneps2bf16) once; row stride ldy; the columns past N are masked off.
//
// Plain C ABI, no torch headers; kvmesh_cpu_gemm_supported(dtype) says whether this build and
// CPU run it (x86-64 with AVX-512 F/BW/DQ/VL, AVX512_BF16 for bfloat16; GCC 10 or later).

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPanel = 32;          // columns per packed panel
constexpr int kMaxRows = 12;            // rows per tile
constexpr int64_t kChunkBytes = 256 << 10;  // the rows of x one chunk keeps in L2
constexpr int64_t kLine = 64;

int64_t panels_of(int64_t n) { return (n + kPanel - 1) / kPanel; }

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define KVG_BUILT 1
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")
namespace {

// The two element types: bfloat16 takes k in pairs (one vdpbf16ps per pair and vector of
// 16 columns), float32 one k at a time (one FMA).
struct Bf16 {
  using T = uint16_t;
  static constexpr int64_t kStep = 2;
  using B = __m512bh;
  static B load(const T* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
  static B broadcast(const T* x) {
    int32_t both;
    std::memcpy(&both, x, sizeof(both));
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(both));
  }
  static __m512 madd(__m512 acc, B a, B b) { return _mm512_dpbf16_ps(acc, a, b); }
  static void store(T* y, __m512 lo, __m512 hi, __mmask32 mask) {
    const __m512i both = _mm512_inserti64x4(
        _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo))),
        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)), 1);
    _mm512_mask_storeu_epi16(y, mask, both);
  }
};

struct F32 {
  using T = float;
  static constexpr int64_t kStep = 1;
  using B = __m512;
  static B load(const T* p) { return _mm512_loadu_ps(p); }
  static B broadcast(const T* x) { return _mm512_set1_ps(*x); }
  static __m512 madd(__m512 acc, B a, B b) { return _mm512_fmadd_ps(a, b, acc); }
  static void store(T* y, __m512 lo, __m512 hi, __mmask32 mask) {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>(mask), lo);
    _mm512_mask_storeu_ps(y + 16, static_cast<__mmask16>(mask >> 16), hi);
  }
};

template <class E>
struct Gemm {
  using T = typename E::T;
  const T* x;
  int64_t ldx;
  const T* w;  // packed
  const float* bias;  // [N] or null
  T* y;
  int64_t ldy;
  int64_t m, n, k;
};

// rows x 32 columns of y from the panel (k / kStep steps); while it runs, `lines_per_step`
// cache lines of `next` per step are prefetched (none when next is null).
template <class E, int R>
inline __attribute__((always_inline)) void tile(const Gemm<E>& g, const typename E::T* x,
                                                const typename E::T* panel, typename E::T* y,
                                                const float* bias, __mmask32 mask,
                                                const char* next, int64_t lines_per_step) {
  constexpr int64_t kStride = kPanel * E::kStep;  // elements per step of the panel
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const int64_t steps = g.k / E::kStep;
  for (int64_t s = 0; s < steps; ++s) {
    const typename E::B b0 = E::load(panel + s * kStride);
    const typename E::B b1 = E::load(panel + s * kStride + kStride / 2);
    if (next != nullptr)
      for (int64_t j = 0; j < lines_per_step; ++j)
        _mm_prefetch(next + (s * lines_per_step + j) * kLine, _MM_HINT_T1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const typename E::B a = E::broadcast(x + r * g.ldx + E::kStep * s);
      lo[r] = E::madd(lo[r], a, b0);
      hi[r] = E::madd(hi[r], a, b1);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (bias != nullptr) {
      lo[r] = _mm512_add_ps(lo[r], _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), bias));
      hi[r] = _mm512_add_ps(hi[r],
                            _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), bias + 16));
    }
    E::store(y + r * g.ldy, lo[r], hi[r], mask);
  }
}

template <class E>
using TileFn = void (*)(const Gemm<E>&, const typename E::T*, const typename E::T*,
                        typename E::T*, const float*, __mmask32, const char*, int64_t);

template <class E, int R>
void tile_fn(const Gemm<E>& g, const typename E::T* x, const typename E::T* panel,
             typename E::T* y, const float* bias, __mmask32 mask, const char* next,
             int64_t lines_per_step) {
  tile<E, R>(g, x, panel, y, bias, mask, next, lines_per_step);
}

template <class E>
constexpr TileFn<E> kTiles[kMaxRows + 1] = {
    nullptr,         &tile_fn<E, 1>,  &tile_fn<E, 2>,  &tile_fn<E, 3>, &tile_fn<E, 4>,
    &tile_fn<E, 5>,  &tile_fn<E, 6>,  &tile_fn<E, 7>,  &tile_fn<E, 8>, &tile_fn<E, 9>,
    &tile_fn<E, 10>, &tile_fn<E, 11>, &tile_fn<E, 12>,
};

// Rows [m0, m1) of panels [p0, p1): per panel every tile of the rows, the next panel of the
// range prefetched during the first.
template <class E>
void run_panels(const Gemm<E>& g, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  const int64_t panel_elems = g.k * kPanel;
  const int64_t lines = panel_elems * static_cast<int64_t>(sizeof(typename E::T)) / kLine;
  const int64_t steps = g.k / E::kStep;
  const int64_t lines_per_step = (lines + steps - 1) / steps;
  for (int64_t p = p0; p < p1; ++p) {
    const typename E::T* panel = g.w + p * panel_elems;
    const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr;
    const int64_t cols = std::min(kPanel, g.n - p * kPanel);
    const __mmask32 mask = cols == kPanel ? ~__mmask32{0} : ((__mmask32{1} << cols) - 1);
    const float* bias = g.bias != nullptr ? g.bias + p * kPanel : nullptr;
    for (int64_t m = m0; m < m1; m += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, m1 - m);
      kTiles<E>[rows](g, g.x + m * g.ldx, panel, g.y + m * g.ldy + p * kPanel, bias, mask,
                      next, lines_per_step);
      next = nullptr;
    }
  }
}

template <class E>
void gemm(const Gemm<E>& g, int64_t threads) {
  const int64_t panels = panels_of(g.n);
  const int64_t row_bytes = g.k * static_cast<int64_t>(sizeof(typename E::T));
  const int64_t chunk = std::max<int64_t>(kMaxRows, kChunkBytes / row_bytes / kMaxRows * kMaxRows);
  const int64_t work = g.m * g.n * g.k;
  const int team = static_cast<int>(std::min(threads, panels));
#pragma omp parallel num_threads(team) if (team > 1 && work >= (int64_t{1} << 18))
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    for (int64_t m = 0; m < g.m; m += chunk) run_panels(g, m, std::min(g.m, m + chunk), p0, p1);
  }
}

}  // namespace
#pragma GCC pop_options
#endif

namespace {

#ifdef KVG_BUILT
bool cpu_has_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
#endif

// dtype 0 = float32, 1 = bfloat16: whether this build and CPU run that GEMM.
bool supported(int dtype) {
#ifdef KVG_BUILT
  if (dtype == 0) return cpu_has_avx512();
  if (dtype == 1) return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
#endif
  (void)dtype;
  return false;
}

template <class T>
void pack(const T* w, int64_t ldw, int64_t n, int64_t k, int64_t step, T* packed) {
  const int64_t panels = panels_of(n);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    T* out = packed + p * kPanel * k;
    for (int64_t s = 0; s < k / step; ++s)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t col = p * kPanel + c;
        for (int64_t j = 0; j < step; ++j)
          out[(s * kPanel + c) * step + j] = col < n ? w[col * ldw + s * step + j] : T{0};
      }
  }
}

}  // namespace

extern "C" int kvmesh_cpu_gemm_supported(int dtype) { return supported(dtype) ? 1 : 0; }

// The packed size in elements of an [n, k] weight.
extern "C" int64_t kvmesh_cpu_gemm_packed_elems(int64_t n, int64_t k) {
  return panels_of(n) * kPanel * k;
}

// w [n, k] (row stride ldw) -> packed (kvmesh_cpu_gemm_packed_elems elements); bfloat16 needs
// an even k.
extern "C" int kvmesh_cpu_gemm_pack(int dtype, const void* w, int64_t ldw, int64_t n, int64_t k,
                                    void* packed) {
  if (n <= 0 || k <= 0 || ldw < k) return 1;
  if (dtype == 0) {
    pack(static_cast<const float*>(w), ldw, n, k, 1, static_cast<float*>(packed));
  } else if (dtype == 1) {
    if (k % 2 != 0) return 1;
    pack(static_cast<const uint16_t*>(w), ldw, n, k, 2, static_cast<uint16_t*>(packed));
  } else {
    return 3;
  }
  return 0;
}

// y [m, n] (row stride ldy) = x [m, k] (row stride ldx) . W^T + bias (float32 [n] or null).
extern "C" int kvmesh_cpu_gemm(int dtype, const void* x, int64_t ldx, const void* packed,
                               const float* bias, void* y, int64_t ldy, int64_t m, int64_t n,
                               int64_t k, int64_t threads) {
  if (m < 0 || n <= 0 || k <= 0 || ldx < k || ldy < n || threads < 1) return 1;
  if (dtype == 1 && k % 2 != 0) return 1;
  if (dtype != 0 && dtype != 1) return 3;
  if (!supported(dtype)) return 2;
#ifdef KVG_BUILT
  if (m == 0) return 0;
  if (dtype == 0) {
    gemm(Gemm<F32>{static_cast<const float*>(x), ldx, static_cast<const float*>(packed), bias,
                   static_cast<float*>(y), ldy, m, n, k},
         threads);
  } else {
    gemm(Gemm<Bf16>{static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(packed),
                    bias, static_cast<uint16_t*>(y), ldy, m, n, k},
         threads);
  }
#else
  (void)x, (void)packed, (void)bias, (void)y;
#endif
  return 0;
}
