// The AVX-512 attention item (included twice by cpu_paged_attention.cpp, inside its own
// namespace and target pragma each time: once for AVX-512 F/BW/DQ/VL + FMA, once more with
// AVX512_BF16 and KVM_BF16_DOT defined, where bfloat16 keys meet bfloat16 queries in
// vdpbf16ps). No include guard: each inclusion is a separate copy.


// Sixteen float8 e4m3fn codes as float32, exactly, without the table: a normal code's exponent
// and mantissa bits placed in a float's (exponent rebiased from 7 to 127), a subnormal one
// (exponent 0) as m * 2^-9, 0x7F / 0xFF as NaN, the sign bit moved to bit 31.
KVM_INLINE __m512 e4m3fn16(__m128i codes) {
  const __m512i x = _mm512_cvtepu8_epi32(codes);
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512 normal = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32((127 - 7) << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(0x1.0p-9f));
  __m512 v = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8)), normal,
                                  subnormal);
  v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)), v,
                           _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

// Sixteen elements of a row from element d, as float32 (int8 as its integer value, fp8 by
// e4m3fn16: the scales are applied to scores and probabilities, not to the rows).
template <int LT>
KVM_INLINE __m512 ld16(const void* row, int64_t d) {
  if constexpr (LT == kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(row) + d);
  } else if constexpr (LT == kI8 || LT == kFP8) {
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(row) + d));
    if constexpr (LT == kI8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    return e4m3fn16(b);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + d));
    if constexpr (LT == kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// A cache row of D elements as float32 into dst (any element type; fp8 by e4m3fn16, not the
// table the other paths gather from: BENCHMARKS.md "Quantized KV caches in the attention
// kernel").
template <int DT>
KVM_INLINE void convert_row(const void* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, ld16<DT>(src, d));
}

// result[j] = sum of the 16 lanes of a[j], for j < 16.
KVM_INLINE __m512 reduce16(const __m512* a) {
  __m512 u[4];
  for (int k = 0; k < 4; ++k) {
    const __m512* x = a + 4 * k;
    // Per 128-bit lane: [x0 x1 | x0 x1] partial sums, then [x0 x1 x2 x3].
    const __m512 t01 =
        _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 t23 =
        _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    u[k] = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t01), _mm512_castps_pd(t23))));
  }
  // u[k] lane quarter i holds the quarter-i sums of a[4k .. 4k + 3]: add the quarters.
  const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                 _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                 _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
}

// Row r of a tile: lanes r * KB .. r * KB + KB - 1 of t to s[r * sp ..], straight from the
// register (a spill reloaded in quarters or halves waits on store forwarding).
template <int R, int KB>
KVM_INLINE void store_scores(__m512 t, float* s, int64_t sp) {
  static_assert(R * KB == 16 && (KB == 4 || KB == 8 || KB == 16), "a tile's 16 scores");
  if constexpr (KB == 16) {
    _mm512_storeu_ps(s, t);
  } else if constexpr (KB == 8) {
    _mm256_storeu_ps(s, _mm512_castps512_ps256(t));
    _mm256_storeu_ps(s + sp, _mm512_extractf32x8_ps(t, 1));
  } else {
    _mm_storeu_ps(s, _mm512_castps512_ps128(t));
    _mm_storeu_ps(s + sp, _mm512_extractf32x4_ps(t, 1));
    _mm_storeu_ps(s + 2 * sp, _mm512_extractf32x4_ps(t, 2));
    _mm_storeu_ps(s + 3 * sp, _mm512_extractf32x4_ps(t, 3));
  }
}

// Scores of R query rows (stride D) against KB key rows: s[r * sp + j].
template <int LT, int R, int KB, class Pf>
KVM_INLINE void qk_tile(const float* q, int64_t D, const void* const* kr, float* s, int64_t sp,
                        Pf& pf) {
  static_assert(R * KB == 16, "a tile fills one 16-way reduction");
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 kv[KB];
    for (int j = 0; j < KB; ++j) kv[j] = ld16<LT>(kr[j], d);
    pf.issue(KB);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_loadu_ps(q + r * D + d);
      for (int j = 0; j < KB; ++j) acc[r * KB + j] = _mm512_fmadd_ps(qv, kv[j], acc[r * KB + j]);
    }
  }
  store_scores<R, KB>(reduce16(acc), s, sp);
}

// The tiling of one scores pass over rows < nrows (q [nrows, D]) and keys < round_up(n, 16)
// (kr padded to that): 4 x 4 tiles while 4 rows remain, then 2 x 8, then 1 x 16, each tile
// one 16-way reduction; Tile::run<R, KB>(q rows, key rows, s) fills s[r * sp + j].
template <class Tile, class Q>
KVM_INLINE void tile_scores(const Tile& tile, const Q* q, int64_t nrows, const void* const* kr,
                            int64_t n, int64_t D, float* s, int64_t sp) {
  int64_t r = 0;
  for (; r + 4 <= nrows; r += 4)
    for (int64_t i = 0; i < n; i += 4) tile.template run<4, 4>(q + r * D, kr + i, s + r * sp + i);
  for (; r + 2 <= nrows; r += 2)
    for (int64_t i = 0; i < n; i += 8) tile.template run<2, 8>(q + r * D, kr + i, s + r * sp + i);
  for (; r < nrows; ++r)
    for (int64_t i = 0; i < n; i += 16) tile.template run<1, 16>(q + r * D, kr + i, s + r * sp + i);
}

template <int LT, class Pf>
struct FmaTile {  // float32 query rows (scaled) against LT key rows
  int64_t D, sp;
  Pf& pf;
  template <int R, int KB>
  KVM_INLINE void run(const float* q, const void* const* kr, float* s) const {
    qk_tile<LT, R, KB>(q, D, kr, s, sp, pf);
  }
};

// s[r * sp + i] = q_r . k_i for rows < nrows, keys < round_up(n, 16) (kr padded to that).
template <int LT, class Pf>
KVM_INLINE void scores(const float* q, int64_t nrows, const void* const* kr, int64_t n,
                       int64_t D, float* s, int64_t sp, Pf& pf) {
  tile_scores(FmaTile<LT, Pf>{D, sp, pf}, q, nrows, kr, n, D, s, sp);
}

#ifdef KVM_BF16_DOT
// Scores of R bfloat16 query rows (stride D, unscaled) against KB bfloat16 key rows, times
// scale: each accumulator lane sums pairs of exact bfloat16 products (vdpbf16ps), 32 elements
// of head_dim per instruction; s[r * sp + j]. D is a multiple of 32.
template <int R, int KB, class Pf>
KVM_INLINE void qk_tile_dot(const uint16_t* q, int64_t D, const void* const* kr, float* s,
                            int64_t sp, __m512 scale, Pf& pf) {
  static_assert(R * KB == 16, "a tile fills one 16-way reduction");
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    __m512bh kv[KB];
    for (int j = 0; j < KB; ++j)
      kv[j] = (__m512bh)_mm512_loadu_si512(static_cast<const uint16_t*>(kr[j]) + d);
    pf.issue(KB);
    for (int r = 0; r < R; ++r) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + r * D + d);
      for (int j = 0; j < KB; ++j) acc[r * KB + j] = _mm512_dpbf16_ps(acc[r * KB + j], qv, kv[j]);
    }
  }
  store_scores<R, KB>(_mm512_mul_ps(reduce16(acc), scale), s, sp);
}

template <class Pf>
struct DotTile {  // bfloat16 query rows (unscaled) against bfloat16 key rows, times scale
  int64_t D, sp;
  __m512 scale;
  Pf& pf;
  template <int R, int KB>
  KVM_INLINE void run(const uint16_t* q, const void* const* kr, float* s) const {
    qk_tile_dot<R, KB>(q, D, kr, s, sp, scale, pf);
  }
};

// scores<kBF16> from bfloat16 queries q [nrows, D] (unscaled) by vdpbf16ps, times scale.
template <class Pf>
KVM_INLINE void scores_dot(const uint16_t* q, int64_t nrows, const void* const* kr, int64_t n,
                           int64_t D, float* s, int64_t sp, float scale, Pf& pf) {
  tile_scores(DotTile<Pf>{D, sp, _mm512_set1_ps(scale), pf}, q, nrows, kr, n, D, s, sp);
}
#endif

// bfloat16 V rows are widened by unpacking: one load of 32 elements, its words interleaved with
// zeros per 128-bit lane (vpunpcklwd / vpunpckhwd: the float32 of each bfloat16), two in-lane
// shuffles in place of two widening loads and two shifts. The two vectors hold each lane's
// first four elements, then its last four ("unpacked order"), so the accumulators of a full
// group of 32 output elements hold them in that order: every such group of a row, and only
// those, goes through this path (pv_rows), and `natural_order` restores the order once per
// item. Each element still sums the same products in the same key order: same results.
constexpr bool unpacks(int LT, int DV) { return LT == kBF16 && DV % 2 == 0; }

// acc[r][d0 .. d0 + 16 DV) += sum_i p[r * sp + i] * v_i[d0 ..], accumulators in registers
// (in unpacked order where `unpacks`).
template <int LT, int R, int DV, class Pf>
KVM_INLINE void pv_tile(float* acc, int64_t D, const float* p, int64_t sp,
                        const void* const* vr, int64_t n, int64_t d0, Pf& pf) {
  __m512 a[R * DV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) a[r * DV + j] = _mm512_loadu_ps(acc + r * D + d0 + 16 * j);
  for (int64_t i = 0; i < n; ++i) {
    __m512 vv[DV];
    if constexpr (unpacks(LT, DV)) {
      const __m512i zero = _mm512_setzero_si512();
      for (int j = 0; j < DV; j += 2) {
        const __m512i w = _mm512_loadu_si512(static_cast<const uint16_t*>(vr[i]) + d0 + 16 * j);
        vv[j] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w));
        vv[j + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w));
      }
    } else {
      for (int j = 0; j < DV; ++j) vv[j] = ld16<LT>(vr[i], d0 + 16 * j);
    }
    pf.issue(DV);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * sp + i]);
      for (int j = 0; j < DV; ++j) a[r * DV + j] = _mm512_fmadd_ps(w, vv[j], a[r * DV + j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < DV; ++j) _mm512_storeu_ps(acc + r * D + d0 + 16 * j, a[r * DV + j]);
}

// Tiles of 16 DV elements, then (bfloat16) every remaining full group of 32, then the rest in
// tiles of 16: each full group of 32 of a bfloat16 row is unpacked, whatever DV.
template <int LT, int R, int DV, class Pf>
KVM_INLINE void pv_rows(float* acc, int64_t D, const float* p, int64_t sp,
                        const void* const* vr, int64_t n, Pf& pf) {
  int64_t d0 = 0;
  for (; d0 + 16 * DV <= D; d0 += 16 * DV) pv_tile<LT, R, DV>(acc, D, p, sp, vr, n, d0, pf);
  if constexpr (LT == kBF16)
    for (; d0 + 32 <= D; d0 += 32) pv_tile<LT, R, 2>(acc, D, p, sp, vr, n, d0, pf);
  for (; d0 < D; d0 += 16) pv_tile<LT, R, 1>(acc, D, p, sp, vr, n, d0, pf);
}

// Rows [rows, D] of acc from unpacked order back to natural order, every full group of 32:
// lane L (of 4) of a group's first 16 holds its elements 8L .. 8L + 3, of its last 16 its
// elements 8L + 4 .. 8L + 7.
KVM_INLINE void natural_order(float* acc, int64_t rows, int64_t D) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g + 32 <= D; g += 32) {
      float* x = acc + r * D + g;
      alignas(64) float t[32];
      for (int L = 0; L < 4; ++L)
        for (int e = 0; e < 4; ++e) {
          t[8 * L + e] = x[4 * L + e];
          t[8 * L + 4 + e] = x[16 + 4 * L + e];
        }
      std::memcpy(x, t, sizeof(t));
    }
  }
}

// Three remaining rows (3 query heads per kv head) share one pass over V; a single remaining
// row keeps at least four independent accumulators (a 1 x 16 tile is one FMA chain per key,
// bound by the FMA latency). Every accumulator still sums its keys in order: same results.
template <int LT, class Pf>
KVM_INLINE void pv(float* acc, int64_t nrows, const float* p, int64_t sp, const void* const* vr,
                   int64_t n, int64_t D, Pf& pf) {
  int64_t r = 0;
  for (; r + 4 <= nrows; r += 4) pv_rows<LT, 4, 4>(acc + r * D, D, p + r * sp, sp, vr, n, pf);
  if (nrows - r == 3) {
    pv_rows<LT, 3, 4>(acc + r * D, D, p + r * sp, sp, vr, n, pf);
    return;
  }
  for (; r + 2 <= nrows; r += 2) pv_rows<LT, 2, 4>(acc + r * D, D, p + r * sp, sp, vr, n, pf);
  for (; r < nrows; ++r) {
    if (D >= 128) {
      pv_rows<LT, 1, 8>(acc + r * D, D, p + r * sp, sp, vr, n, pf);
    } else {
      pv_rows<LT, 1, 4>(acc + r * D, D, p + r * sp, sp, vr, n, pf);
    }
  }
}

// exp(x) for x <= 0 (scores minus the running max), -inf -> 0. Cephes expf: Cody-Waite range
// reduction and a degree-6 polynomial, about 1 ulp; below ln(FLT_MIN) the result is 0.
KVM_INLINE __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654475f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
}

// Keys per step of the AVX-512 item: several blocks at once, so the per-step costs (the
// softmax's row reductions and rescale, P x V's accumulator loads and stores) are spread over
// up to 64 keys whatever the block size.
constexpr int64_t kChunk = 64;

// Keys per step for an item reading key_bytes of K and V per key: 64, halved (down to 16) while
// a step's K/V exceed 256 KiB: longer steps amortise the softmax rescale over small keys, and
// shorter ones keep large keys (8 kv heads x 128 float32, 8 KiB each) within L2. Compare
// settings with `python -m kvmesh_kernels.cpu_bench --baseline-source OLD.cpp`.
KVM_INLINE int64_t chunk_keys(int64_t key_bytes) {
  int64_t keys = kChunk;
  while (keys > 16 && keys * key_bytes > (int64_t{256} << 10)) keys /= 2;
  return keys;
}

// Prefill items (more than kDirectRows rows per kv head; float32 K rows, or bfloat16 pairs for
// vdpbf16ps) score against K transposed: kt[d * kChunk + i] is element d of key i, so one
// vector holds 16 keys' element d and each score accumulates in its own lane, its D products in
// order of d, with no 16-way reduction (about 45 shuffles and adds per 4 x 4 tile at head_dim
// 64). By instruction count the transposition costs about as much as six rows' reductions per
// key; a prefill item has up to 64 rows per kv head.

// kt[(d0 + k) * ld + j] = rows[j][d0 + k] for j, k < 16.
KVM_INLINE void transpose16(const void* const* rows, int64_t d0, float* kt, int64_t ld) {
  __m512 r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(static_cast<const float*>(rows[j]) + d0);
  for (int j = 0; j < 16; j += 2) {  // per 128-bit lane: pairs of rows interleaved
    t[j] = _mm512_unpacklo_ps(r[j], r[j + 1]);
    t[j + 1] = _mm512_unpackhi_ps(r[j], r[j + 1]);
  }
  for (int j = 0; j < 16; j += 4) {  // per lane: 4 rows' element k in one quarter
    r[j] = _mm512_shuffle_ps(t[j], t[j + 2], 0x44);
    r[j + 1] = _mm512_shuffle_ps(t[j], t[j + 2], 0xEE);
    r[j + 2] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0x44);
    r[j + 3] = _mm512_shuffle_ps(t[j + 1], t[j + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {  // lanes regrouped across groups of four rows
    t[j] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0x88);
    t[j + 4] = _mm512_shuffle_f32x4(r[j], r[j + 4], 0xDD);
    t[j + 8] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0x88);
    t[j + 12] = _mm512_shuffle_f32x4(r[j + 8], r[j + 12], 0xDD);
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
  for (int k = 0; k < 16; ++k) _mm512_storeu_ps(kt + (d0 + k) * ld, r[k]);
}

// kt from the first round_up(n, 16) key rows (padding rows included) of `units` 32-bit units
// each: float32 elements, or pairs of bfloat16 elements (moved as bits).
KVM_INLINE void transpose_keys(const void* const* kr, int64_t n, int64_t units, float* kt) {
  for (int64_t i = 0; i < n; i += 16)
    for (int64_t d0 = 0; d0 < units; d0 += 16) transpose16(kr + i, d0, kt + i, kChunk);
}

// Scores of R query rows (stride D, scaled) against NG groups of 16 transposed keys:
// s[r * sp + 16 g + j].
template <int R, int NG>
KVM_INLINE void qk_tile_t(const float* q, int64_t D, const float* kt, float* s, int64_t sp) {
  __m512 acc[R * NG];
  for (int j = 0; j < R * NG; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv[NG];
    for (int g = 0; g < NG; ++g) kv[g] = _mm512_loadu_ps(kt + d * kChunk + 16 * g);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * D + d]);
      for (int g = 0; g < NG; ++g) acc[r * NG + g] = _mm512_fmadd_ps(qv, kv[g], acc[r * NG + g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(s + r * sp + 16 * g, acc[r * NG + g]);
}

template <int NG>
KVM_INLINE void scores_t_keys(const float* q, int64_t nrows, const float* kt, int64_t D,
                              float* s, int64_t sp) {
  int64_t r = 0;
  for (; r + 4 <= nrows; r += 4) qk_tile_t<4, NG>(q + r * D, D, kt, s + r * sp, sp);
  if (nrows - r == 3) qk_tile_t<3, NG>(q + r * D, D, kt, s + r * sp, sp);
  if (nrows - r == 2) qk_tile_t<2, NG>(q + r * D, D, kt, s + r * sp, sp);
  if (nrows - r == 1) qk_tile_t<1, NG>(q + r * D, D, kt, s + r * sp, sp);
}

// s[r * sp + i] = q_r . k_i for rows < nrows, keys < round_up(n, 16) <= kChunk (kr padded to
// that), through K transposed into kt [D, kChunk].
KVM_INLINE void scores_transposed(const float* q, int64_t nrows, const void* const* kr,
                                  int64_t n, int64_t D, float* kt, float* s, int64_t sp) {
  transpose_keys(kr, n, D, kt);
  switch ((n + 15) / 16) {
    case 1: scores_t_keys<1>(q, nrows, kt, D, s, sp); break;
    case 2: scores_t_keys<2>(q, nrows, kt, D, s, sp); break;
    case 3: scores_t_keys<3>(q, nrows, kt, D, s, sp); break;
    default: scores_t_keys<4>(q, nrows, kt, D, s, sp); break;
  }
}

#ifdef KVM_BF16_DOT
// Scores of R bfloat16 query rows (stride D, unscaled) against NG groups of 16 transposed
// bfloat16 keys (kt[e * kChunk + i]: elements 2e and 2e + 1 of key i), times scale; each lane
// sums pairs of exact products (vdpbf16ps) in order of e: s[r * sp + 16 g + j].
template <int R, int NG>
KVM_INLINE void qk_tile_dot_t(const uint16_t* q, int64_t D, const float* kt, float* s,
                              int64_t sp, __m512 scale) {
  __m512 acc[R * NG];
  for (int j = 0; j < R * NG; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t e = 0; e < D / 2; ++e) {
    __m512bh kv[NG];
    for (int g = 0; g < NG; ++g) kv[g] = (__m512bh)_mm512_loadu_ps(kt + e * kChunk + 16 * g);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * D + 2 * e, sizeof(pair));
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(pair);
      for (int g = 0; g < NG; ++g) acc[r * NG + g] = _mm512_dpbf16_ps(acc[r * NG + g], qv, kv[g]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < NG; ++g)
      _mm512_storeu_ps(s + r * sp + 16 * g, _mm512_mul_ps(acc[r * NG + g], scale));
}

template <int NG>
KVM_INLINE void scores_dot_t_keys(const uint16_t* q, int64_t nrows, const float* kt, int64_t D,
                                  float* s, int64_t sp, __m512 scale) {
  int64_t r = 0;
  for (; r + 4 <= nrows; r += 4) qk_tile_dot_t<4, NG>(q + r * D, D, kt, s + r * sp, sp, scale);
  if (nrows - r == 3) qk_tile_dot_t<3, NG>(q + r * D, D, kt, s + r * sp, sp, scale);
  if (nrows - r == 2) qk_tile_dot_t<2, NG>(q + r * D, D, kt, s + r * sp, sp, scale);
  if (nrows - r == 1) qk_tile_dot_t<1, NG>(q + r * D, D, kt, s + r * sp, sp, scale);
}

// scores_dot through K transposed into kt [D / 2, kChunk] (pairs of bfloat16 elements).
KVM_INLINE void scores_dot_transposed(const uint16_t* q, int64_t nrows, const void* const* kr,
                                      int64_t n, int64_t D, float* kt, float* s, int64_t sp,
                                      float scale) {
  transpose_keys(kr, n, D / 2, kt);
  const __m512 sv = _mm512_set1_ps(scale);
  switch ((n + 15) / 16) {
    case 1: scores_dot_t_keys<1>(q, nrows, kt, D, s, sp, sv); break;
    case 2: scores_dot_t_keys<2>(q, nrows, kt, D, s, sp, sv); break;
    case 3: scores_dot_t_keys<3>(q, nrows, kt, D, s, sp, sv); break;
    default: scores_dot_t_keys<4>(q, nrows, kt, D, s, sp, sv); break;
  }
}
#endif

// Element offsets of keys [k_lo, k_hi) (K of kv head 0; V at + s_kv) through the block table
// into koff, and of their scales (quantized caches) into soff.
KVM_INLINE void key_offsets(const Params& p, const int32_t* table, int64_t k_lo, int64_t k_hi,
                            int64_t* koff, int64_t* soff) {
  const int64_t bs = p.block_size;
  int64_t i = 0;
  for (int64_t t = k_lo; t < k_hi;) {
    const int64_t blk = t / bs;
    int64_t phys = table[blk];
    phys = phys < 0 ? 0 : phys >= p.num_blocks ? p.num_blocks - 1 : phys;
    const int64_t end = k_hi < (blk + 1) * bs ? k_hi : (blk + 1) * bs;
    for (; t < end; ++t, ++i) {
      koff[i] = phys * p.s_block + (t - blk * bs) * p.s_tok;
      soff[i] = phys * p.ss_block + (t - blk * bs) * p.ss_tok;
    }
  }
}

// Vector loads of K and V rows per key of one kv head in an item with rph query rows per kv
// head: scores load each key row once per tile row group (4, then 2, then 1 rows: 16 or, by
// vdpbf16ps, 32 elements a load), P x V once per group (4 rows, 3, 2, then 1) per 16 elements.
KVM_INLINE int64_t loads_per_key(int64_t rph, int64_t D, bool dot) {
  const int64_t rest = rph % 4;
  const int64_t qk_groups = rph / 4 + rest / 2 + rest % 2;
  const int64_t pv_groups = rph / 4 + (rest == 3 ? 1 : rest / 2 + rest % 2);
  return qk_groups * (dot ? D / 32 : D / 16) + pv_groups * (D / 16);
}

// Requests the K and V rows of kv heads [h0, h1) of the n keys at koff into L1: the next
// step's rows load while this step computes (every line of a row: the rows sit in scattered
// blocks the hardware prefetcher does not follow).
template <int DT>
KVM_INLINE void prefetch_keys(const Params& p, const char* data, const int64_t* koff, int64_t n,
                              int64_t h0, int64_t h1) {
  const int64_t row_bytes = p.head_dim * elem_bytes(DT);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = h0; h < h1; ++h) {
      const char* k = data + (koff[i] + h * p.s_head) * elem_bytes(DT);
      const char* v = k + p.s_kv * elem_bytes(DT);
      for (int64_t c = 0; c < row_bytes; c += 64) {
        _mm_prefetch(k + c, _MM_HINT_T0);
        _mm_prefetch(v + c, _MM_HINT_T0);
      }
    }
  }
}

// The next chunk's K/V rows, prefetched in `slices` pieces spread over this chunk's work
// (piece j before the j-th group of keys of a pass), for items not paced by a Cursor (more
// than kDirectRows rows per kv head: prefill tiles, whose many rows make each pass
// compute-bound). n = 0: none.
template <int DT>
struct NextChunk {
  const Params& p;
  const char* data;
  const int64_t* koff;
  int64_t n, h0, h1, slices;
  KVM_INLINE void prefetch(int64_t j) const {
    const int64_t lo = n * j / slices, hi = n * (j + 1) / slices;
    prefetch_keys<DT>(p, data, koff + lo, hi - lo, h0, h1);
  }
};

// Load pointers of the n rows at data + (koff[i] + shift) elements, padded to sp with row 0:
// in place (LT == DT) or converted into buf (LT == kF32 != DT).
template <int DT, int LT>
KVM_INLINE void row_pointers(const char* data, const int64_t* koff, int64_t shift, int64_t n,
                             int64_t sp, int64_t D, float* buf, const void** rows) {
  for (int64_t i = 0; i < n; ++i) {
    const char* src = data + (koff[i] + shift) * elem_bytes(DT);
    if constexpr (LT == DT) {
      rows[i] = src;
    } else {
      convert_row<DT>(src, buf + i * D, D);
      rows[i] = buf + i * D;
    }
  }
  for (int64_t i = n; i < sp; ++i) rows[i] = rows[0];  // padding keys, scores discarded
}

// Largest lane of a, as a float.
KVM_INLINE float hmax16(__m512 a) {
  __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

// Sum of the lanes of a.
KVM_INLINE float hsum16(__m512 a) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// Sets the scores of chunk indexes outside [lo, hi] to -inf, sixteen at a time (sp a multiple
// of 16; lo and hi are clamped to [-1, sp] first, so they fit the 32-bit lanes).
KVM_INLINE void hide_outside(float* sr, int64_t sp, int64_t lo, int64_t hi) {
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i first = _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(lo, -1, sp)));
  const __m512i last = _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(hi, -1, sp)));
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  for (int64_t c = 0; c < sp; c += 16) {
    const __m512i idx = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int>(c)));
    const __mmask16 hide =
        _mm512_cmplt_epi32_mask(idx, first) | _mm512_cmpgt_epi32_mask(idx, last);
    if (hide) _mm512_mask_storeu_ps(sr + c, hide, ninf);  // a masked store stalls the reloads
  }
}

// Masks keys [k_lo, k_lo + n) a row cannot see (-inf), pads to sp, and turns the scores into
// probabilities relative to the running max, rescaling acc when the max moved.
KVM_INLINE void chunk_softmax(const Params& p, float* s, int64_t sp, int64_t rows, int64_t n,
                              int64_t k_lo, bool full, const int64_t* pos, float* acc,
                              float* m, float* l) {
  const int64_t D = p.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * sp;
    // Visible keys: chunk indexes [lo, hi] (key k_lo + i is after the row's position, or
    // before its window, outside them; so is every padding key i >= n).
    int64_t lo = 0, hi = n - 1;
    if (!full) {
      hi = std::min(hi, pos[r] - k_lo);
      if (p.window > 0) lo = std::max(lo, pos[r] - p.window + 1 - k_lo);
    }
    if (lo > 0 || hi < sp - 1) hide_outside(sr, sp, lo, hi);
    __m512 mx16 = _mm512_loadu_ps(sr);
    for (int64_t c = 16; c < sp; c += 16) mx16 = _mm512_max_ps(mx16, _mm512_loadu_ps(sr + c));
    const float mx = hmax16(mx16);
    if (mx == kNegInf) {
      for (int64_t i = 0; i < sp; ++i) sr[i] = 0.f;
      continue;
    }
    const float m_new = m[r] > mx ? m[r] : mx;
    const __m512 mv = _mm512_set1_ps(m_new);
    __m512 sum16 = _mm512_setzero_ps();
    for (int64_t c = 0; c < sp; c += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + c), mv));
      _mm512_storeu_ps(sr + c, e);
      sum16 = _mm512_add_ps(sum16, e);
    }
    if (m_new != m[r]) {
      const float corr = std::exp(m[r] - m_new);  // 0 on the first chunk a row sees
      const __m512 cv = _mm512_set1_ps(corr);
      float* ar = acc + r * D;
      for (int64_t d = 0; d < D; d += 16) {
        _mm512_storeu_ps(ar + d, _mm512_mul_ps(_mm512_loadu_ps(ar + d), cv));
      }
      l[r] *= corr;
    }
    l[r] += hsum16(sum16);
    m[r] = m_new;
  }
}

// Per-key scales (quantized caches) into the scores or probabilities of one kv head's rows.
KVM_INLINE void scale_keys(const float* scales, const int64_t* soff,
                           int64_t shift, int64_t n, int64_t rph, int64_t sp, float* sh) {
  for (int64_t i = 0; i < n; ++i) {
    const float f = scales[soff[i] + shift];
    for (int64_t r = 0; r < rph; ++r) sh[r * sp + i] *= f;
  }
}

// The lines to request while a chunk computes: the item's next keys [k_hi, k_next), whose
// offsets are in sc.koff + kChunk; at its last chunk (k_next == k_hi) the first chunk of the
// item this thread runs next (claimed here), its offsets computed into the same place.
template <int DT>
KVM_INLINE Cursor ahead(const Params& p, const Item& it, int64_t k_hi, int64_t k_next,
                        int64_t loads, Scratch& sc) {
  const char* data = reinterpret_cast<const char*>(p.data);
  int64_t* koff = sc.koff.data() + kChunk;
  const int64_t eb = elem_bytes(DT);
  if (k_next > k_hi) return lines_of(p, data, koff, k_next - k_hi, it.h0, it.h1, eb, loads);
  const Item* following = sc.following();
  if (following == nullptr || following->k1 <= following->k0) return Cursor{};
  const Item& f = *following;
  const int64_t keys = std::min(chunk_keys(2 * (f.h1 - f.h0) * p.head_dim * elem_bytes(DT)),
                                f.k1 - f.k0);
  const int32_t* table = reinterpret_cast<const int32_t*>(p.block_tables) + f.b * p.max_blocks;
  key_offsets(p, table, f.k0, f.k0 + keys, koff, sc.soff.data() + kChunk);
  return lines_of(p, data, koff, keys, f.h0, f.h1, eb, loads);
}

// The item with K rows loaded as KT and V rows as VT (DT itself, read in place, or float32
// from the conversion buffers).
template <int DT, int KT, int VT, class Pf>
KVM_INLINE void run_item_as(const Params& p, const Item& it, Scratch& sc, int64_t rmax,
                            float* part_acc, float* part_ml) {
  const int64_t D = p.head_dim;
  const int64_t sp = kChunk;  // score row stride: whole vectors
  const int64_t G = p.num_q_heads / p.num_kv_heads;
  const int64_t ntok = it.t1 - it.t0, nheads = it.h1 - it.h0;
  const int64_t rph = ntok * G;  // rows per kv head
  const int64_t rows = nheads * rph;
  const int32_t* table = reinterpret_cast<const int32_t*>(p.block_tables) + it.b * p.max_blocks;
  const char* data = reinterpret_cast<const char*>(p.data);
  const float* scales = reinterpret_cast<const float*>(p.scales);
  const bool quant = DT == kI8 || DT == kFP8;

  float* q = sc.q.data();
  float* acc = sc.acc.data();
  float* s = sc.s.data();
  float* m = sc.m.data();
  float* l = sc.l.data();
  int64_t* pos = sc.pos.data();
  int64_t* koff = sc.koff.data();  // this chunk's keys, then the next ones (see `ahead`)
  int64_t* soff = sc.soff.data();
  const void** kr = sc.kraw.data();
  const void** vr = sc.vraw.data();
#ifdef KVM_BF16_DOT
  // bfloat16 keys read in place by bfloat16 queries: scores by vdpbf16ps
  const bool dot = KT == kBF16 && p.q_dtype == kBF16 && D % 32 == 0;
#else
  constexpr bool dot = false;
#endif
  begin_item(p, it, sc, rows, dot);
  const int64_t pos_min = pos[0], pos_max = pos[rph - 1];  // first and last token positions

  const int64_t key_bytes = 2 * nheads * D * elem_bytes(DT);
  const int64_t CH = chunk_keys(key_bytes);
  const bool prefetch = std::is_same_v<Pf, Cursor> || prefetches(DT, key_bytes);
  // Decode items run each pass in groups of 16 keys (prefill tiles keep whole passes: their
  // many rows make a pass compute-bound, and splitting it costs).
  const int64_t group = prefetch && rph <= kDirectRows ? 16 : CH;
  const int64_t groups = (CH + group - 1) / group;
  // Decode items reading rows in place take the kv heads inside each group of keys, so a
  // group's K (then V) rows of all heads, adjacent in the block, are read together.
  // Others run head by head, each head's rows converted into one reused buffer. Both passes
  // step (outer, inner) = (group, head) or (head, group).
  const bool heads_inner = group < CH && KT == DT && VT == DT;
  // Prefill items (whole passes; float32 K rows, or bfloat16 ones by vdpbf16ps) score against K
  // transposed.
  const bool transposed = (KT == kF32 || dot) && rph > kDirectRows && group == CH;
  const int64_t n_outer = heads_inner ? groups : nheads;
  const int64_t n_inner = heads_inner ? nheads : groups;
  const int64_t run = heads_inner ? sp : 0;  // kv head hh's row pointers: kr / vr + hh * run
  int64_t k_hi = it.k0 + CH < it.k1 ? it.k0 + CH : it.k1;
  key_offsets(p, table, it.k0, k_hi, koff, soff);
  for (int64_t k_lo = it.k0; k_lo < it.k1;) {
    const int64_t n = k_hi - k_lo;
    const int64_t k_next = k_hi + CH < it.k1 ? k_hi + CH : it.k1;
    if (k_next > k_hi) key_offsets(p, table, k_hi, k_next, koff + kChunk, soff + kChunk);
    Pf pf{};
    int64_t next_keys = 0;  // unpaced: the next chunk in pieces, one before each group
    if constexpr (std::is_same_v<Pf, Cursor>) {
      const int64_t loads = n * nheads * loads_per_key(rph, D, dot);  // this chunk's row loads
      pf = ahead<DT>(p, it, k_hi, k_next, loads, sc);
    } else {
      next_keys = prefetch ? k_next - k_hi : 0;
    }
    const int64_t pieces = 2 * nheads * groups;
    const NextChunk<DT> next{p, data, koff + kChunk, next_keys, it.h0, it.h1, pieces};
    for (int64_t o = 0; o < n_outer; ++o) {
      for (int64_t i = 0; i < n_inner; ++i) {
        const int64_t hh = heads_inner ? i : o, i0 = (heads_inner ? o : i) * group;
        const int64_t h = it.h0 + hh;
        float* sh = s + hh * rph * sp;
        if (i0 == 0)  // the head's first group: its K row pointers (rows converted into kbuf)
          row_pointers<DT, KT>(data, koff, h * p.s_head, n, sp, D, sc.kbuf.data(),
                               kr + hh * run);
        next.prefetch(o * n_inner + i);
        if (i0 < n && dot && transposed) {
#ifdef KVM_BF16_DOT
          scores_dot_transposed(sc.qb.data() + hh * rph * D, rph, kr + hh * run, n, D,
                                sc.kt.data(), sh, sp, static_cast<float>(p.scale));
#endif
        } else if (i0 < n && dot) {
#ifdef KVM_BF16_DOT
          scores_dot(sc.qb.data() + hh * rph * D, rph, kr + hh * run + i0,
                     std::min(group, n - i0), D, sh + i0, sp, static_cast<float>(p.scale), pf);
#endif
        } else if (i0 < n && transposed) {
          scores_transposed(q + hh * rph * D, rph, kr + hh * run, n, D, sc.kt.data(), sh, sp);
        } else if (i0 < n) {
          scores<KT>(q + hh * rph * D, rph, kr + hh * run + i0, std::min(group, n - i0), D,
                     sh + i0, sp, pf);
        }
        if (quant && i0 + group >= CH) scale_keys(scales, soff, h * p.ss_head, n, rph, sp, sh);
      }
    }
    const bool full = k_hi - 1 <= pos_min && (p.window <= 0 || k_lo > pos_max - p.window);
    chunk_softmax(p, s, sp, rows, n, k_lo, full, pos, acc, m, l);
    for (int64_t o = 0; o < n_outer; ++o) {
      for (int64_t i = 0; i < n_inner; ++i) {
        const int64_t hh = heads_inner ? i : o, i0 = (heads_inner ? o : i) * group;
        const int64_t h = it.h0 + hh;
        float* sh = s + hh * rph * sp;
        if (i0 == 0) {  // the head's first group: its V row pointers, its keys' scales
          row_pointers<DT, VT>(data, koff, p.s_kv + h * p.s_head, n, sp, D, sc.vbuf.data(),
                               vr + hh * run);
          if (quant) scale_keys(scales, soff, p.ss_kv + h * p.ss_head, n, rph, sp, sh);
        }
        next.prefetch(nheads * groups + o * n_inner + i);
        if (i0 < n) {
          pv<VT>(acc + hh * rph * D, rph, sh + i0, sp, vr + hh * run + i0,
                 std::min(group, n - i0), D, pf);
        }
      }
    }
    std::memcpy(koff, koff + kChunk, sizeof(int64_t) * kChunk);
    std::memcpy(soff, soff + kChunk, sizeof(int64_t) * kChunk);
    k_lo = k_hi;
    k_hi = k_next;
  }

  if constexpr (VT == kBF16) natural_order(acc, rows, D);  // see `unpacks`
  finish_item(p, it, sc, rows, rmax, part_acc, part_ml);
}

// The item's kinds of K and V rows (read in place or converted), with Pf pacing its prefetch.
template <int DT, class Pf>
KVM_INLINE void run_item_kinds(const Params& p, const Item& it, Scratch& sc, int64_t rmax,
                               float* part_acc, float* part_ml) {
  if constexpr (DT != kF32) {
    const int64_t rph = (it.t1 - it.t0) * (p.num_q_heads / p.num_kv_heads);
    if (rph <= kDirectRows) {
      // fp8 K rows that two score tiles would each convert (3, 5, 6 or 7 rows per kv head:
      // a 4- or 2-row tile, then the rest) are converted once into the buffer instead; V rows
      // always as they load
      if constexpr (DT == kFP8) {
        if (rph > 2 && rph % 4 != 0) {
          run_item_as<DT, kF32, DT, Pf>(p, it, sc, rmax, part_acc, part_ml);
          return;
        }
      }
      run_item_as<DT, DT, DT, Pf>(p, it, sc, rmax, part_acc, part_ml);
      return;
    }
#ifdef KVM_BF16_DOT
    if constexpr (DT == kBF16) {
      if (p.q_dtype == kBF16 && p.head_dim % 32 == 0) {  // K read in place, V converted
        run_item_as<DT, DT, kF32, Pf>(p, it, sc, rmax, part_acc, part_ml);
        return;
      }
    }
#endif
  }
  run_item_as<DT, kF32, kF32, Pf>(p, it, sc, rmax, part_acc, part_ml);
}

// Items with at most kDirectRows rows per kv head pace their requests with their loads
// (Cursor); items with more request their next chunk in pieces (NoCursor).
template <int DT>
__attribute__((noinline)) void run_item_avx512(const Params& p, const Item& it, Scratch& sc,
                                               int64_t rmax, float* part_acc, float* part_ml) {
  const int64_t rph = (it.t1 - it.t0) * (p.num_q_heads / p.num_kv_heads);
  if (rph <= kDirectRows) {
    run_item_kinds<DT, Cursor>(p, it, sc, rmax, part_acc, part_ml);
  } else {
    run_item_kinds<DT, NoCursor>(p, it, sc, rmax, part_acc, part_ml);
  }
}
