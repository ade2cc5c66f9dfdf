// cpu_gemm.cpp's bfloat16 path on AMX tiles (Intel CPUs with AMX-BF16), included inside that
// file's `amx` namespace after avx512::Bf16 (whose rounding it reuses). Same
// packed weights as the other paths: a 32-column panel is [K / 2][32][2], so the 16 rows of
// k-pairs of one 16-column half are an AMX B tile as laid out (64 bytes per row, rows 128
// bytes apart), and x's rows are A tiles as they lie (32 k per row, rows ldx apart).
//
//   tiles   C: tmm0-3, rows block b (0, 1) x half h (0, 1) = tmm(2b + h), 16 x 16 float32
//           sums; A: tmm4 / tmm5, 16 rows x 32 k of blocks 0 / 1; B: tmm6 / tmm7, halves 0 / 1.
//           One configuration for the whole call: 16-row blocks, a last partial block copied
//           into a zero-padded 16-row scratch (its extra rows computed and dropped). A tiles
//           load with tileloaddt1 (not kept in L1) when the call has more than 32 rows.
//   sums    tdpbf16ps: pairs of products into float32 (subnormal inputs read as zero), k in
//           steps of 32; the order of the float32 additions is the instruction's, so results
//           match the other paths and oneDNN to rounding, not bit for bit.
//   output  the C tiles go through a float32 buffer (two, so that a row pair's conversions run
//           while the next pair's tiles multiply) to y: bias added, rounded once (vcvtneps2bf16),
//           the real columns only; or (silu) silu(gate half 0) * up half 1
//           (kvmesh_cpu_gemm_silu_width 16) with the sums first rounded as stored, so the SiLU
//           epilogue equals this path's GEMM followed by SiLU-and-mul bit for bit.
//   threads as the other paths: contiguous panel ranges, x in row chunks that stay in L2, the
//           next panel prefetched into L2 during the first rows of the current one. Each
//           thread loads the tile configuration and releases the tiles when done.
//
// K must be a multiple of 32 (`fits`); the caller takes the AVX512_BF16 path otherwise.

constexpr int64_t kTileRows = 16;  // rows of an A / C tile
constexpr int64_t kTileK = 32;     // bfloat16 k per A tile row (64 bytes)
constexpr int64_t kAmxChunkBytes = 1 << 20;  // the rows of x one chunk keeps in L2

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline TileConfig full_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kTileRows;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

inline bool fits(int64_t k) { return k % kTileK == 0; }

// One row pair's sums, stored from the C tiles into `sums` ([2 blocks][2 halves][16][16]
// floats), waiting to be written to y.
struct Pending {
  const float* sums = nullptr;
  uint16_t* y = nullptr;
  int blocks = 0;        // 1 or 2
  int64_t last = 0;      // real rows of the last block (1..16)
  const float* bias = nullptr;
  int64_t cols = 0;      // real columns of the panel (1..32; kSilu: 32)
};

inline void stash(float* sums, int blocks) {
  _tile_stored(0, sums, 64);
  _tile_stored(1, sums + 256, 64);
  if (blocks == 2) {
    _tile_stored(2, sums + 512, 64);
    _tile_stored(3, sums + 768, 64);
  }
}

// A pair's sums into y (row stride ldy): with bias (the panel's 32 floats or null) and only
// the real columns, or (kSilu) as silu(gate half) * up half, 16 columns per row.
template <bool kSilu>
void store_rows(const Pending& q, int64_t ldy) {
  for (int b = 0; b < q.blocks; ++b) {
    const int64_t rows = b + 1 == q.blocks ? q.last : kTileRows;
    const float* gate = q.sums + b * 512;
    uint16_t* y = q.y + b * kTileRows * ldy;
    if constexpr (kSilu) {
      // gate and up rounded as stored products (spill), then one loop over the block's
      // outputs, which the compiler pipelines (a 16-wide loop per row did not)
      using D = avx512::Bf16::D;
      alignas(64) float g[kTileRows * 16], u[kTileRows * 16];
      for (int64_t r = 0; r < rows; ++r) {
        avx512::Bf16::spill(g + r * 16, _mm512_loadu_ps(gate + r * 16));
        avx512::Bf16::spill(u + r * 16, _mm512_loadu_ps(gate + 256 + r * 16));
      }
      alignas(64) uint16_t out[kTileRows * 16];
#pragma omp simd
      for (int64_t i = 0; i < rows * 16; ++i)
        out[i] = D::store(kvmesh_fused::silu_mul_elem<D, true>(g[i], u[i]));
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(y + r * ldy, out + r * 16, 16 * sizeof(uint16_t));
      continue;
    }
    const __mmask16 lo = q.cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << q.cols) - 1);
    const __mmask16 hi = q.cols >= 32   ? 0xFFFF
                         : q.cols > 16 ? static_cast<__mmask16>((1u << (q.cols - 16)) - 1)
                                       : 0;
    const __m512 bias_lo = q.bias != nullptr ? _mm512_loadu_ps(q.bias) : _mm512_setzero_ps();
    const __m512 bias_hi = q.bias != nullptr ? _mm512_loadu_ps(q.bias + 16) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 s0 = _mm512_add_ps(_mm512_loadu_ps(gate + r * 16), bias_lo);
      const __m512 s1 = _mm512_add_ps(_mm512_loadu_ps(gate + 256 + r * 16), bias_hi);
      const __m256i y0 = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(s0));
      const __m256i y1 = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(s1));
      _mm256_mask_storeu_epi16(y + r * ldy, lo, y0);
      _mm256_mask_storeu_epi16(y + r * ldy + 16, hi, y1);
    }
  }
}

// An A tile from x (lda elements between rows). With more than one row pair per panel it is
// streamed (tileloaddt1: kept out of L1), so that the panel's B tiles, which each row pair
// reads again, stay in L1 instead of being evicted by x's rows and y's lines (a step's linears
// at 256 and 2,048 rows: 0.85-0.93x the time; docs/BENCHMARKS.md "kvmesh's GEMM on AMX"); one
// row pair reads its A tiles again for every panel, so they stay cached.
template <bool kStreamA>
inline __attribute__((always_inline)) void load_a(int tile, const uint16_t* a, int64_t lda) {
  if constexpr (kStreamA) {
    if (tile == 4) _tile_stream_loadd(4, a, lda * 2);
    else _tile_stream_loadd(5, a, lda * 2);
  } else {
    if (tile == 4) _tile_loadd(4, a, lda * 2);
    else _tile_loadd(5, a, lda * 2);
  }
}

// One or two row blocks (kBlocks) of one panel: the k loop over A and B tiles. a0 / a1: the
// blocks' first rows (lda0 / lda1 elements between rows), next: the panel to prefetch (or null).
template <int kBlocks, bool kStreamA>
inline __attribute__((always_inline)) void panel_blocks(const uint16_t* a0, int64_t lda0,
                                                        const uint16_t* a1, int64_t lda1,
                                                        const uint16_t* panel, int64_t k,
                                                        const char* next) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kBlocks == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  constexpr int64_t kStepElems = kTileK * kPanel;  // a k step's panel: 16 pairs x 32 x 2
  constexpr int64_t kStepLines = kStepElems * 2 / kLine;
  for (int64_t kk = 0; kk < k / kTileK; ++kk) {
    const uint16_t* b = panel + kk * kStepElems;
    if (next != nullptr)
      for (int64_t j = 0; j < kStepLines; ++j)
        _mm_prefetch(next + (kk * kStepLines + j) * kLine, _MM_HINT_T1);
    _tile_loadd(6, b, kPanel * 4);
    _tile_loadd(7, b + kPanel, kPanel * 4);
    load_a<kStreamA>(4, a0 + kk * kTileK, lda0);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kBlocks == 2) {
      load_a<kStreamA>(5, a1 + kk * kTileK, lda1);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// The C tiles of one row pair of one panel, then the previous pair's sums written to y while
// these tiles multiply (two sums buffers): the conversions overlap the tile work instead of
// following it.
template <bool kSilu>
struct PairRunner {
  PairRunner(const Gemm<uint16_t>& gemm, const uint16_t* tail_rows, int64_t whole, bool stream)
      : g(gemm), tail(tail_rows), whole_end(whole), stream_a(stream) {}  // sums: stashed first
  const Gemm<uint16_t>& g;
  const uint16_t* tail;
  int64_t whole_end;
  bool stream_a;
  alignas(64) float sums[2][4 * 256];
  Pending pending;
  int buffer = 0;

  void run(int64_t m, int64_t rows, int64_t p, const char* next) {
    const uint16_t* panel = g.w + p * g.k * kPanel;
    const int blocks = rows > kTileRows ? 2 : 1;
    const bool x0 = m < whole_end, x1 = m + kTileRows < whole_end;
    const uint16_t* a0 = x0 ? g.x + m * g.ldx : tail;
    const uint16_t* a1 = x1 ? g.x + (m + kTileRows) * g.ldx : tail;
    const int64_t lda0 = x0 ? g.ldx : g.k, lda1 = x1 ? g.ldx : g.k;
    if (blocks == 2 && stream_a) {
      panel_blocks<2, true>(a0, lda0, a1, lda1, panel, g.k, next);
    } else if (blocks == 2) {
      panel_blocks<2, false>(a0, lda0, a1, lda1, panel, g.k, next);
    } else if (stream_a) {
      panel_blocks<1, true>(a0, lda0, a0, lda0, panel, g.k, next);
    } else {
      panel_blocks<1, false>(a0, lda0, a0, lda0, panel, g.k, next);
    }
    flush();
    stash(sums[buffer], blocks);
    const float* bias = g.bias != nullptr ? g.bias + p * kPanel : nullptr;
    pending = Pending{sums[buffer], g.y + m * g.ldy + p * (kSilu ? kPanel / 2 : kPanel),
                      blocks, rows - (blocks - 1) * kTileRows, bias,
                      std::min(kPanel, g.n - p * kPanel)};
    buffer ^= 1;
  }

  void flush() {
    if (pending.blocks > 0) store_rows<kSilu>(pending, g.ldy);
    pending.blocks = 0;
  }
};

// Rows [m0, m1) of panels [p0, p1), each panel once with its row pairs inner (a decode step
// reads its weights from memory once); m0 a multiple of 32. A block of 16 rows starting before
// whole_end (the call's rows rounded down to 16) is read from x, the call's last partial block
// from `tail` (kTileRows x k, zero-padded). The next panel is prefetched into L2 while the
// first pair of rows runs on the current one. (The row pairs outside and the panels inside
// wrote y along its rows, but re-read the panels: 1.2x the time of this order at 256-512 rows
// of a decode step's linears, level at 2,048.)
template <bool kSilu>
void run_panels(const Gemm<uint16_t>& g, const uint16_t* tail, int64_t whole_end, int64_t m0,
                int64_t m1, int64_t p0, int64_t p1) {
  PairRunner<kSilu> pairs(g, tail, whole_end, g.m > 2 * kTileRows);
  const int64_t panel_bytes = g.k * kPanel * 2;
  const auto next_of = [&](int64_t p, int64_t m) -> const char* {
    if (!g.prefetch || p + 1 >= p1 || m != m0) return nullptr;
    return reinterpret_cast<const char*>(g.w) + (p + 1) * panel_bytes;
  };
  constexpr int64_t kPair = 2 * kTileRows;
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t m = m0; m < m1; m += kPair)
      pairs.run(m, std::min(kPair, m1 - m), p, next_of(p, m));
  pairs.flush();
}

// The call: x's last partial block copied into a zero-padded scratch, then each thread its
// panel range, row chunk by row chunk, under the one tile configuration. (x packed into
// contiguous A tiles per chunk, shared by the threads, took 1.0-1.6x the time of reading x
// where it lies, at 256 and 2,048 rows of one linear.)
template <bool kSilu>
void gemm(const Gemm<uint16_t>& g, int64_t threads) {
  static const TileConfig config = full_tiles();
  const int64_t panels = panels_of(g.n);
  const int64_t whole_end = g.m / kTileRows * kTileRows;
  thread_local std::vector<uint16_t> tail_rows;
  const uint16_t* tail = nullptr;
  if (whole_end < g.m) {
    // written before the parallel region: the tile loads' asm declares no memory read, so the
    // region's call boundary is what orders these writes before them
    tail_rows.assign(kTileRows * g.k, 0);
    for (int64_t r = whole_end; r < g.m; ++r)
      std::memcpy(tail_rows.data() + (r - whole_end) * g.k, g.x + r * g.ldx,
                  g.k * sizeof(uint16_t));
    tail = tail_rows.data();
  }
  constexpr int64_t kPair = 2 * kTileRows;
  const int64_t row_bytes = g.k * 2;
  const int64_t chunk = std::max<int64_t>(kPair, kAmxChunkBytes / row_bytes / kPair * kPair);
  const int64_t work = g.m * g.n * g.k;
  const int team = static_cast<int>(std::min(threads, panels));
#pragma omp parallel num_threads(team) if (team > 1 && work >= (int64_t{1} << 18))
  {
    _tile_loadconfig(&config);
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
    for (int64_t m = 0; m < g.m; m += chunk)
      run_panels<kSilu>(g, tail, whole_end, m, std::min(g.m, m + chunk), p0, p1);
    _tile_release();
  }
}
