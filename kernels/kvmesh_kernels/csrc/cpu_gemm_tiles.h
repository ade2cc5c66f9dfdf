// The ISA-generic part of cpu_gemm.cpp: tiles, panels and threads, included once per ISA
// section inside its namespace, after that section's element types (each with T, kStep,
// kCols, the vector types, load / broadcast / madd / store, spill (a sum vector to floats,
// rounded as store rounds) and D, the dtype's traits in fused_common.h) and kMaxRows. Uses
// the file's Gemm<T>, kPanel, kLine, kChunkBytes and panels_of.

// silu(g) * u of one row's kCols columns into y (E::T), the sums g and u first rounded to the
// dtype as a stored gate|up product would be (E::spill; cpu_gemm.cpp, "silu").
template <class E>
inline __attribute__((always_inline)) void store_silu(typename E::T* y, typename E::Acc g,
                                                      typename E::Acc u) {
  using D = typename E::D;
  alignas(64) float gv[E::kCols], uv[E::kCols];
  E::spill(gv, g);
  E::spill(uv, u);
#pragma omp simd
  for (int64_t i = 0; i < E::kCols; ++i)
    y[i] = D::store(kvmesh_fused::silu_mul_elem<D, true>(gv[i], uv[i]));
}

// A part's sums (lo, hi: rows x two vectors) into y: with bias (float32 of the panel or
// null), or (kSilu) as silu(gate) * up.
template <class E, int R, bool kSilu>
inline __attribute__((always_inline)) void store_part(typename E::T* y, int64_t ldy,
                                                      const float* bias, int64_t part,
                                                      const typename E::Acc* lo,
                                                      const typename E::Acc* hi) {
  if constexpr (kSilu) {
    typename E::T* out = y + part * E::kCols;
    if constexpr (kPanel / (2 * E::kCols) > 1) {
      // Two parts (AVX2): unrolled. A loop over the rows indexed the sums at run time, and
      // from three rows (one part per pass) GCC kept them on the stack, stored at every step
      // of the multiply-adds: the epilogue's decode step 1.6-1.7x the time of the GEMM then
      // SiLU-and-mul at 64-256 rows. AVX-512 (one part) keeps the loop: unrolled, its code
      // changed, and it had no such spill to remove.
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) store_silu<E>(out + r * ldy, lo[r], hi[r]);
    } else {
      for (int r = 0; r < R; ++r) store_silu<E>(out + r * ldy, lo[r], hi[r]);
    }
    return;
  }
  const float* part_bias = bias != nullptr ? bias + part * 2 * E::kCols : nullptr;
  typename E::T* out = y + part * 2 * E::kCols;
  for (int r = 0; r < R; ++r) {
    E::store(out + r * ldy, lo[r], part_bias);
    E::store(out + r * ldy + E::kCols, hi[r], part_bias ? part_bias + E::kCols : nullptr);
  }
}

// rows x 32 columns of y from the panel (k / kStep steps), in parts of two vectors of kCols
// output columns (AVX2: two parts), each pass over the panel's steps summing kTogether parts:
// all of them when their sums fit the registers (AVX2 up to two rows), else one. While the
// first pass runs, `lines_per_step` cache lines of `next` per step are prefetched (none when
// next is null), and, in a panel's first tile (kFirst), the later passes' lines of each step:
// the panel streams from memory in consecutive lines, not in one strided pass per part.
// bias: the panel's 32 float32 values or null. kSilu: each part's two vectors are gate and up
// of the same kCols columns, and the tile writes silu(gate) * up of them (kCols per part, 16
// per panel; no bias).
template <class E, int R, bool kSilu, bool kFirst>
inline __attribute__((always_inline)) void tile(const Gemm<typename E::T>& g,
                                                const typename E::T* x,
                                                const typename E::T* panel, typename E::T* y,
                                                int64_t ldy, const float* bias,
                                                const char* next, int64_t lines_per_step) {
  constexpr int64_t kStride = kPanel * E::kStep;  // elements per step of the panel
  constexpr int64_t kParts = kPanel / (2 * E::kCols);
  constexpr int64_t kPartElems = 2 * E::kCols * E::kStep;  // a part's elements per step
  constexpr int64_t kTogether = kParts > 1 && R <= 2 ? kParts : 1;
  const int64_t steps = g.k / E::kStep;
  for (int64_t first = 0; first < kParts; first += kTogether) {
    const typename E::T* cols = panel + first * kPartElems;
    typename E::Acc lo[kTogether][R], hi[kTogether][R];
    for (int64_t q = 0; q < kTogether; ++q)
      for (int r = 0; r < R; ++r) lo[q][r] = hi[q][r] = E::zero();
    for (int64_t s = 0; s < steps; ++s) {
      typename E::B b0[kTogether], b1[kTogether];
      for (int64_t q = 0; q < kTogether; ++q) {
        b0[q] = E::load(cols + s * kStride + q * kPartElems);
        b1[q] = E::load(cols + s * kStride + q * kPartElems + E::kCols * E::kStep);
      }
      if constexpr (kFirst && kTogether < kParts)
        if (first == 0)  // the rest of this step's columns, read by the later passes
          for (int64_t q = kTogether; q < kParts; ++q)
            _mm_prefetch(reinterpret_cast<const char*>(cols + s * kStride + q * kPartElems),
                         _MM_HINT_T0);
      if (next != nullptr)
        for (int64_t j = 0; j < lines_per_step; ++j)
          _mm_prefetch(next + (s * lines_per_step + j) * kLine, _MM_HINT_T1);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const typename E::B a = E::broadcast(x + r * g.ldx + E::kStep * s);
        for (int64_t q = 0; q < kTogether; ++q) {
          lo[q][r] = E::madd(lo[q][r], a, b0[q]);
          hi[q][r] = E::madd(hi[q][r], a, b1[q]);
        }
      }
    }
    next = nullptr;
    for (int64_t q = 0; q < kTogether; ++q) store_part<E, R, kSilu>(y, ldy, bias, first + q,
                                                                  lo[q], hi[q]);
  }
}

template <class E>
using TileFn = void (*)(const Gemm<typename E::T>&, const typename E::T*, const typename E::T*,
                        typename E::T*, int64_t, const float*, const char*, int64_t);

template <class E, int R, bool kSilu, bool kFirst>
void tile_fn(const Gemm<typename E::T>& g, const typename E::T* x, const typename E::T* panel,
             typename E::T* y, int64_t ldy, const float* bias, const char* next,
             int64_t lines_per_step) {
  tile<E, R, kSilu, kFirst>(g, x, panel, y, ldy, bias, next, lines_per_step);
}

template <class E, bool kSilu, bool kFirst, int... R>
constexpr std::array<TileFn<E>, sizeof...(R) + 1> tiles_of(std::integer_sequence<int, R...>) {
  return {nullptr, &tile_fn<E, R + 1, kSilu, kFirst>...};
}

// kTiles<E, kSilu, kFirst>[rows]: the tile of `rows` rows (kFirst: a panel's first tile)
template <class E, bool kSilu, bool kFirst>
constexpr auto kTiles = tiles_of<E, kSilu, kFirst>(std::make_integer_sequence<int, kMaxRows>{});

// Rows [m0, m1) of panels [p0, p1): per panel every tile of the rows, the next panel of the
// range prefetched during the first. The last panel's columns past N go to a scratch row
// block and only the real ones are copied out. kSilu: a panel's output is its 16 columns of
// silu(gate) * up (N a multiple of 32: every panel whole).
template <class E, bool kSilu>
void run_panels(const Gemm<typename E::T>& g, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
  using T = typename E::T;
  const int64_t panel_elems = g.k * kPanel;
  const int64_t lines = panel_elems * static_cast<int64_t>(sizeof(T)) / kLine;
  const int64_t steps = g.k / E::kStep;
  const int64_t lines_per_step = (lines + steps - 1) / steps;
  T scratch[kMaxRows * kPanel];
  for (int64_t p = p0; p < p1; ++p) {
    const T* panel = g.w + p * panel_elems;
    const bool more = g.prefetch && p + 1 < p1;
    const char* next = more ? reinterpret_cast<const char*>(panel + panel_elems) : nullptr;
    const int64_t cols = std::min(kPanel, g.n - p * kPanel);
    const float* bias = g.bias != nullptr ? g.bias + p * kPanel : nullptr;
    for (int64_t m = m0; m < m1; m += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, m1 - m);
      T* y = g.y + m * g.ldy + p * (kSilu ? kPanel / 2 : kPanel);
      T* target = cols == kPanel ? y : scratch;
      const auto& tiles = m == m0 ? kTiles<E, kSilu, true> : kTiles<E, kSilu, false>;
      tiles[rows](g, g.x + m * g.ldx, panel, target, cols == kPanel ? g.ldy : kPanel, bias, next,
                  lines_per_step);
      next = nullptr;
      if (cols != kPanel)
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(y + r * g.ldy, scratch + r * kPanel, cols * sizeof(T));
    }
  }
}

template <class E, bool kSilu = false>
void gemm(const Gemm<typename E::T>& g, int64_t threads) {
  const int64_t panels = panels_of(g.n);
  const int64_t row_bytes = g.k * static_cast<int64_t>(sizeof(typename E::T));
  const int64_t chunk = std::max<int64_t>(kMaxRows, kChunkBytes / row_bytes / kMaxRows * kMaxRows);
  const int64_t work = g.m * g.n * g.k;
  const int team = static_cast<int>(std::min(threads, panels));
#pragma omp parallel num_threads(team) if (team > 1 && work >= (int64_t{1} << 18))
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    for (int64_t m = 0; m < g.m; m += chunk)
      run_panels<E, kSilu>(g, m, std::min(g.m, m + chunk), p0, p1);
  }
}
