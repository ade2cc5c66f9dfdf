// bfloat16 linear layers on AVX512_BF16: y [M, N] = x [M, K] . W^T (+ bias), W [N, K] packed
// once at load into vdpbf16ps operand order, accumulated in float32, rounded once to bfloat16.
//
//   packed  [ceil(N / 32)][K / 2][32][2]: per 32-column panel and pair of k, the 32 columns'
//           (W[n][k], W[n][k + 1]) side by side: two 512-bit loads feed one k pair of a tile.
//           Columns past N are zero. K must be even.
//   tile    MR rows x 32 columns (2 x MR accumulators, up to 12 rows: 24 of the 32 registers),
//           each row's (x[m][k], x[m][k + 1]) broadcast as one 32-bit value; vdpbf16ps adds
//           both products into float32 (inputs' subnormals read as zero, as oneDNN's bfloat16
//           GEMM on these CPUs: the same instruction).
//   threads each takes a contiguous range of 32-column panels (an even split to one panel),
//           rows in chunks that keep the chunk of x in L2. While a panel's first tile runs,
//           the thread prefetches its next panel from memory (prefetcht1): a decode step's
//           weights stream from DRAM once per step, and the prefetch overlaps that stream
//           with the multiply-adds instead of stalling on it (docs/BENCHMARKS.md).
//   output  bias (float32 sum) added, then round to nearest even (vcvtneps2bf16), row stride
//           ldc; the columns past N of the last panel are masked off.
//
// Plain C ABI, no torch headers; kvmesh_cpu_gemm_bf16_supported() says whether this build and
// CPU run it (x86-64 with AVX-512 F/BW/VL and AVX512_BF16, GCC 10 or later).

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

struct Gemm {
  const uint16_t* x;
  int64_t ldx;
  const uint16_t* w;  // packed
  const float* bias;  // [N] or null
  uint16_t* y;
  int64_t ldy;
  int64_t m, n, k;
};

// Store 32 float32 sums of one row (+ bias) as bfloat16; `mask` keeps the columns below N.
inline void store_row(uint16_t* y, __m512 lo, __m512 hi, const float* bias, __mmask32 mask) {
  if (bias != nullptr) {
    lo = _mm512_add_ps(lo, _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), bias));
    hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), bias + 16));
  }
  const __m512i both = _mm512_inserti64x4(
      _mm512_castsi256_si512(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo))),
      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(hi)), 1);
  _mm512_mask_storeu_epi16(y, mask, both);
}

// rows x 32 columns of y from the panel (k / 2 pairs); while it runs, `lines_per_pair` cache
// lines of `next` per k pair are prefetched (none when next is null).
template <int R>
inline __attribute__((always_inline)) void tile(const Gemm& g, const uint16_t* x,
                                                const uint16_t* panel, uint16_t* y,
                                                const float* bias, __mmask32 mask,
                                                const char* next, int64_t lines_per_pair) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  const int64_t pairs = g.k / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * 64));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(panel + p * 64 + 32));
    if (next != nullptr)
      for (int64_t j = 0; j < lines_per_pair; ++j)
        _mm_prefetch(next + (p * lines_per_pair + j) * kLine, _MM_HINT_T1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      int32_t both;
      std::memcpy(&both, x + r * g.ldx + 2 * p, sizeof(both));
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(both));
      lo[r] = _mm512_dpbf16_ps(lo[r], a, b0);
      hi[r] = _mm512_dpbf16_ps(hi[r], a, b1);
    }
  }
  for (int r = 0; r < R; ++r) store_row(y + r * g.ldy, lo[r], hi[r], bias, mask);
}

using TileFn = void (*)(const Gemm&, const uint16_t*, const uint16_t*, uint16_t*, const float*,
                        __mmask32, const char*, int64_t);

template <int R>
void tile_fn(const Gemm& g, const uint16_t* x, const uint16_t* panel, uint16_t* y,
             const float* bias, __mmask32 mask, const char* next, int64_t lines_per_pair) {
  tile<R>(g, x, panel, y, bias, mask, next, lines_per_pair);
}

constexpr TileFn kTiles[kMaxRows + 1] = {
    nullptr,      &tile_fn<1>,  &tile_fn<2>,  &tile_fn<3>, &tile_fn<4>,
    &tile_fn<5>,  &tile_fn<6>,  &tile_fn<7>,  &tile_fn<8>, &tile_fn<9>,
    &tile_fn<10>, &tile_fn<11>, &tile_fn<12>,
};

// Rows [m0, m1) of panels [p0, p1): per panel every tile of the rows, the next panel of the
// range prefetched during the first.
void run_panels(const Gemm& g, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  const int64_t panel_elems = g.k * kPanel;
  const int64_t lines = panel_elems * 2 / kLine;
  const int64_t lines_per_pair = (lines + g.k / 2 - 1) / (g.k / 2);
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* panel = g.w + p * panel_elems;
    const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr;
    const int64_t cols = std::min(kPanel, g.n - p * kPanel);
    const __mmask32 mask = cols == kPanel ? ~__mmask32{0} : ((__mmask32{1} << cols) - 1);
    const float* bias = g.bias != nullptr ? g.bias + p * kPanel : nullptr;
    for (int64_t m = m0; m < m1; m += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, m1 - m);
      kTiles[rows](g, g.x + m * g.ldx, panel, g.y + m * g.ldy + p * kPanel, bias, mask, next,
                   lines_per_pair);
      next = nullptr;
    }
  }
}

void gemm(const Gemm& g, int64_t threads) {
  const int64_t panels = panels_of(g.n);
  const int64_t chunk =
      std::max<int64_t>(kMaxRows, kChunkBytes / (2 * g.k) / kMaxRows * kMaxRows);
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

extern "C" int kvmesh_cpu_gemm_bf16_supported() {
#ifdef KVG_BUILT
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bf16");
#else
  return 0;
#endif
}

// The packed size in bfloat16 elements of an [n, k] weight (k even).
extern "C" int64_t kvmesh_cpu_gemm_bf16_packed_elems(int64_t n, int64_t k) {
  return panels_of(n) * kPanel * k;
}

// w [n, k] bfloat16 (row stride ldw) -> packed (kvmesh_cpu_gemm_bf16_packed_elems elements).
extern "C" int kvmesh_cpu_gemm_bf16_pack(const uint16_t* w, int64_t ldw, int64_t n, int64_t k,
                                         uint16_t* packed) {
  if (n <= 0 || k <= 0 || k % 2 != 0 || ldw < k) return 1;
  const int64_t panels = panels_of(n);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint16_t* out = packed + p * kPanel * k;
    for (int64_t pair = 0; pair < k / 2; ++pair)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t col = p * kPanel + c;
        uint16_t* dst = out + (pair * kPanel + c) * 2;
        dst[0] = col < n ? w[col * ldw + 2 * pair] : 0;
        dst[1] = col < n ? w[col * ldw + 2 * pair + 1] : 0;
      }
  }
  return 0;
}

// y [m, n] (row stride ldy) = x [m, k] (row stride ldx) . W^T + bias (float32 [n] or null).
extern "C" int kvmesh_cpu_gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* packed,
                                    const float* bias, uint16_t* y, int64_t ldy, int64_t m,
                                    int64_t n, int64_t k, int64_t threads) {
  if (m < 0 || n <= 0 || k <= 0 || k % 2 != 0 || ldx < k || ldy < n || threads < 1) return 1;
#ifdef KVG_BUILT
  if (!kvmesh_cpu_gemm_bf16_supported()) return 2;
  if (m > 0) gemm(Gemm{x, ldx, packed, bias, y, ldy, m, n, k}, threads);
  return 0;
#else
  (void)x, (void)packed, (void)bias, (void)y;
  return 2;
#endif
}
