// Sampling kernels on CPU, over rows of logits in float32 or bfloat16 (a bfloat16 value widens
// to float32 exactly, so every comparison is the same as on the widened row):
//
//   argmax_rows:   per row the index of its largest value, the first on ties; a row holding
//                  NaN gives its first NaN (torch's `max(dim=-1).indices`, exactly)
//   race_rows:     per row a token drawn from softmax(x * inv_temp) by the Gumbel-max race:
//                  argmax_i (x_i * inv_temp - log(-log(u_i))), u_i uniform in (0, 1) from a
//                  counter-based generator keyed by the row's 64-bit key (splitmix64 of key and
//                  i: the draw depends only on the key, never on the batch or the thread);
//                  with floors, only values x_i * inv_temp >= floor run
//   top_cut:       per row the smallest tempered value (x_i * inv_temp) that min_p, then top_k,
//                  then top_p keep (the sampler's filters; ties at each cut kept), found from
//                  a histogram of the row's values within kCutRange of its maximum (count and
//                  probability mass per bucket) and an exact sort of the one bucket holding
//                  each cut, instead of a sort of the row
//   logprob_rows:  per row log_softmax(x) at a given token, that token's rank (1 + the number
//                  of values greater than its value) and the k largest values' indices and
//                  log-probabilities (descending, the smaller index first on ties): one pass
//                  for the maximum, one for the sum of exponentials, the rank count and a
//                  k-slot selection, instead of a full float32 log_softmax row and a top-k
//
// Rows may be strided (any row stride, 0 included: rows are only read). Rows are split across
// OpenMP threads when the work is large enough to pay for the fork. Plain C ABI.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

#include <omp.h>

#pragma GCC optimize("-ffp-contract=off")  // before the shared header: its exp too

#include "fused_common.h"

namespace {

using namespace kvmesh_fused;  // NOLINT: the shared traits and exp

constexpr int64_t kParallelRaceElements = 1 << 14;  // two logs and a hash per element
constexpr int64_t kLanes = 16;  // one AVX-512 register of float32 per accumulator

// Folds lane maxima (best[j] first reached at index at[j]; lanes exist when whole > 0) into
// (m, arg): the larger value, the smaller index on ties.
inline void fold_lanes(const float* best, const int32_t* at, int32_t whole, float& m,
                       int64_t& arg) {
  for (int32_t j = 0; j < kLanes && j < whole; ++j)
    if (best[j] > m || (best[j] == m && at[j] < arg)) m = best[j], arg = at[j];
}

// A value of the tail after the lanes: it wins when larger, or equal at a smaller index.
inline void offer(float v, int64_t i, float& m, int64_t& arg) {
  if (v > m || (v == m && i < arg)) m = v, arg = i;
}

// out[row] = fn(row's first element) for every row, rows split across threads once rows * n
// reaches `parallel_from`; 1 on bad arguments (rows are only read: any stride, 0 included).
template <class T, class Out, class Fn>
int for_rows(const void* x, int64_t row_stride, int64_t rows, int64_t n, Out* out,
             int64_t threads, int64_t parallel_from, Fn fn) {
  if (rows < 0 || n <= 0 || n > INT32_MAX || row_stride < 0 || threads < 1) return 1;
  const T* xs = static_cast<const T*>(x);
  const bool parallel = rows > 1 && rows * n >= parallel_from && threads > 1;
#pragma omp parallel for num_threads(static_cast<int>(threads)) if (parallel) schedule(static)
  for (int64_t row = 0; row < rows; ++row) out[row] = fn(row, xs + row * row_stride);
  return 0;
}

// Index of the first largest value of a row of n < 2^31 (NaN never wins a comparison: where
// every value is NaN or -inf, the first -inf or 0), and whether the row holds a NaN. Lane j
// keeps the largest value among indices j, j+16, ... and its first index (a strict `>`, the
// lane's first index to start with, so a row of -inf gives 0); the compiler keeps the lanes
// in vector registers; they are folded at the end, the smaller index on ties.
template <class D>
KVF_CLONES int64_t row_argmax(const typename D::T* x, int64_t n, bool* has_nan) {
  float best[kLanes];
  int32_t at[kLanes];
  int32_t nan[kLanes];
  for (int32_t j = 0; j < kLanes; ++j) best[j] = -INFINITY, at[j] = j, nan[j] = 0;
  const int32_t whole = static_cast<int32_t>(n - n % kLanes);
  for (int32_t i = 0; i < whole; i += kLanes) {
#pragma omp simd
    for (int32_t j = 0; j < kLanes; ++j) {
      const float v = D::load(x[i + j]);
      const bool more = v > best[j];
      best[j] = more ? v : best[j];
      at[j] = more ? i + j : at[j];
      nan[j] |= v != v;
    }
  }
  float m = -INFINITY;
  int64_t arg = n;
  fold_lanes(best, at, whole, m, arg);
  int32_t any_nan = 0;
  for (int32_t j = 0; j < kLanes; ++j) any_nan |= nan[j];
  for (int64_t i = whole; i < n; ++i) {
    const float v = D::load(x[i]);
    any_nan |= v != v;
    offer(v, i, m, arg);
  }
  *has_nan = any_nan != 0;
  return arg < n ? arg : 0;
}

template <class D>
int64_t argmax_row(const typename D::T* x, int64_t n) {
  bool has_nan = false;
  const int64_t arg = row_argmax<D>(x, n, &has_nan);
  if (!has_nan) return arg;
  for (int64_t i = 0; i < n; ++i)  // rare: the first NaN, as torch gives
    if (D::load(x[i]) != D::load(x[i])) return i;
  return arg;
}

template <class D>
int argmax_rows(const void* x, int64_t row_stride, int64_t rows, int64_t n, int64_t* out,
                int64_t threads) {
  return for_rows<typename D::T>(x, row_stride, rows, n, out, threads, kParallelElements,
                                 [n](int64_t, const typename D::T* row) {
                                   return argmax_row<D>(row, n);
                                 });
}

// log(x) for positive normal floats, branch-free so that `omp simd` vectorizes it: x = m 2^e
// with m in [sqrt(1/2), sqrt(2)), log(m) by Cephes' logf polynomial; within about 1 ulp.
inline __attribute__((always_inline)) float log_pos_f32(float x) {
  constexpr float kSqrtHalf = 0.707106781186547524f;
  const uint32_t bits = kvmesh_cvt::f32_to_bits(x);
  float m = kvmesh_cvt::bits_to_f32((bits & 0x007FFFFFu) | 0x3F000000u);  // [0.5, 1)
  float e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 126);
  const bool low = m < kSqrtHalf;
  e = low ? e - 1.f : e;
  const float f = low ? m + m - 1.f : m - 1.f;
  const float z = f * f;
  float y = 7.0376836292e-2f;
  y = y * f - 1.1514610310e-1f;
  y = y * f + 1.1676998740e-1f;
  y = y * f - 1.2420140846e-1f;
  y = y * f + 1.4249322787e-1f;
  y = y * f - 1.6668057665e-1f;
  y = y * f + 2.0000714765e-1f;
  y = y * f - 2.4999993993e-1f;
  y = y * f + 3.3333331174e-1f;
  y = y * f * z;
  y += -2.12194440e-4f * e;
  y += -0.5f * z;
  return f + y + 0.693359375f * e;
}

// Uniform in (0, 1) for counter i of a row's key: the top 23 bits of splitmix64(key + (i + 1)
// golden) plus half a step, exact in float32's 24 bits, so never 0 or 1 (2^-24 .. 1 - 2^-24).
inline __attribute__((always_inline)) float uniform_at(uint64_t key, int64_t i) {
  uint64_t z = key + static_cast<uint64_t>(i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (static_cast<float>(z >> 41) + 0.5f) * 0x1.0p-23f;
}

// The race of one row: lane-wise best scores and their first indices, as in row_argmax (NaN
// and -inf never win; a row of nothing else gives 0).
template <class D>
KVF_CLONES int64_t race_row(const typename D::T* x, int64_t n, float inv_temp, uint64_t key,
                           float floor) {
  float best[kLanes];
  int32_t at[kLanes];
  for (int32_t j = 0; j < kLanes; ++j) best[j] = -INFINITY, at[j] = j;
  const int32_t whole = static_cast<int32_t>(n - n % kLanes);
  float row[kLanes];  // widened first: the race's loop then runs 16 lanes on 16-bit rows too
  for (int32_t i = 0; i < whole; i += kLanes) {
#pragma omp simd
    for (int32_t j = 0; j < kLanes; ++j) row[j] = D::load(x[i + j]) * inv_temp;
#pragma omp simd
    for (int32_t j = 0; j < kLanes; ++j) {
      const float gumbel = -log_pos_f32(-log_pos_f32(uniform_at(key, i + j)));
      const float t = row[j];
      const float v = t >= floor ? t + gumbel : -INFINITY;
      const bool more = v > best[j];
      best[j] = more ? v : best[j];
      at[j] = more ? i + j : at[j];
    }
  }
  float m = -INFINITY;
  int64_t arg = n;
  fold_lanes(best, at, whole, m, arg);
  for (int64_t i = whole; i < n; ++i) {
    const float t = D::load(x[i]) * inv_temp;
    offer(t >= floor ? t - log_pos_f32(-log_pos_f32(uniform_at(key, i))) : -INFINITY, i, m, arg);
  }
  return arg < n ? arg : 0;
}

template <class D>
int race_rows(const void* x, int64_t row_stride, int64_t rows, int64_t n, const float* inv_temp,
              const uint64_t* keys, const float* floors, int64_t* out, int64_t threads) {
  return for_rows<typename D::T>(
      x, row_stride, rows, n, out, threads, kParallelRaceElements,
      [=](int64_t r, const typename D::T* row) {
        const float floor = floors != nullptr ? floors[r] : -INFINITY;
        return race_row<D>(row, n, inv_temp[r], keys[r], floor);
      });
}

// ---- top_cut -------------------------------------------------------------------------------
constexpr int32_t kCutBuckets = 4096;  // over [max - kCutRange, max]: 1/64 nat each
constexpr float kCutRange = 64.f;      // below it a value's probability is < e^-64 of the top's

// A row's histogram: bucket b holds values in (max - (b + 1) w, max - b w] (b = 0: the top);
// one more bucket (kCutBuckets) counts the values further down (their mass is negligible).
struct CutHistogram {
  std::vector<int64_t> count = std::vector<int64_t>(kCutBuckets + 1);
  std::vector<double> mass = std::vector<double>(kCutBuckets + 1);
};

inline int32_t cut_bucket(float v, float top) {
  const float b = (top - v) * (kCutBuckets / kCutRange);
  return b < static_cast<float>(kCutBuckets) ? static_cast<int32_t>(b) : kCutBuckets;
}

template <class D>
KVF_CLONES float row_top(const typename D::T* x, int64_t n, float inv_temp) {
  float best = -INFINITY;
#pragma omp simd reduction(max : best)
  for (int64_t i = 0; i < n; ++i) {
    const float v = D::load(x[i]) * inv_temp;
    best = v > best ? v : best;
  }
  return best;
}

// Counts and masses exp(v - top) of the values >= floor (NaN never counts): buckets and masses
// of 64 values at a time computed in vector registers, then added one by one.
template <class D>
KVF_CLONES void fill_histogram(const typename D::T* x, int64_t n, float inv_temp, float top,
                               float floor, CutHistogram& h) {
  constexpr int64_t kChunk = 64;
  std::fill(h.count.begin(), h.count.end(), 0);
  std::fill(h.mass.begin(), h.mass.end(), 0.0);
  int32_t bucket[kChunk];
  float mass[kChunk];
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
#pragma omp simd
    for (int64_t j = 0; j < m; ++j) {
      const float v = D::load(x[i0 + j]) * inv_temp;
      const float b = (top - v) * (kCutBuckets / kCutRange);  // NaN: compares false below
      const bool kept = v >= floor;
      const bool near = b < static_cast<float>(kCutBuckets);
      bucket[j] = !kept ? -1 : near ? static_cast<int32_t>(b) : kCutBuckets;
      mass[j] = kept && near ? exp_f32<false>(v - top) : 0.f;
    }
    for (int64_t j = 0; j < m; ++j) {
      if (bucket[j] < 0) continue;
      h.count[bucket[j]] += 1;
      h.mass[bucket[j]] += mass[j];
    }
  }
}

// The tempered values of bucket b that are >= floor, largest first.
template <class D>
std::vector<float> bucket_values(const typename D::T* x, int64_t n, float inv_temp, float top,
                                 float floor, int32_t b) {
  std::vector<float> values;
  for (int64_t i = 0; i < n; ++i) {
    const float v = D::load(x[i]) * inv_temp;
    if (v >= floor && cut_bucket(v, top) == b) values.push_back(v);
  }
  std::sort(values.begin(), values.end(), std::greater<float>());
  return values;
}

// h reduced to the values >= cut, which lies in bucket b (values: that bucket's, largest first):
// the buckets below b emptied, b recounted.
inline void keep_from(CutHistogram& h, int32_t b, const std::vector<float>& values, float cut,
                      float top) {
  std::fill(h.count.begin() + b, h.count.end(), 0);
  std::fill(h.mass.begin() + b, h.mass.end(), 0.0);
  for (const float v : values) {
    if (v < cut) break;
    h.count[b] += 1;
    h.mass[b] += b < kCutBuckets ? static_cast<double>(exp_f32<false>(v - top)) : 0.0;
  }
}

// The k-th largest value >= floor (floor when fewer survive; ties at it are kept), with h
// reduced to the values it keeps (top_p then cuts those without another pass over the row).
template <class D>
float top_k_cut(const typename D::T* x, int64_t n, float inv_temp, float top, float floor,
                int64_t k, CutHistogram& h) {
  int64_t above = 0;
  for (int32_t b = 0; b <= kCutBuckets; ++b) {
    if (above + h.count[b] >= k) {
      const std::vector<float> values = bucket_values<D>(x, n, inv_temp, top, floor, b);
      const float cut = values[static_cast<size_t>(k - above - 1)];
      keep_from(h, b, values, cut, top);
      return cut;
    }
    above += h.count[b];
  }
  return floor;
}

// The smallest kept value of the smallest set (largest first) holding p of the mass of the
// values >= floor: a value stays while the mass of the values before it is below p.
template <class D>
float top_p_cut(const typename D::T* x, int64_t n, float inv_temp, float top, float floor,
                float p, const CutHistogram& h) {
  double total = 0.0;
  for (int32_t b = 0; b < kCutBuckets; ++b) total += h.mass[b];
  const double want = static_cast<double>(p) * total;
  double above = 0.0;
  for (int32_t b = 0; b < kCutBuckets; ++b) {
    if (h.count[b] == 0) continue;
    if (above + h.mass[b] >= want) {
      float cut = top;
      for (const float v : bucket_values<D>(x, n, inv_temp, top, floor, b)) {
        if (above >= want) break;
        cut = v;
        above += static_cast<double>(exp_f32<false>(v - top));
      }
      return cut;
    }
    above += h.mass[b];
  }
  return floor;  // p of the mass needs every value (rounding at p near 1)
}

template <class D>
float row_cut(const typename D::T* x, int64_t n, float inv_temp, int64_t k, float p, float min_p,
              CutHistogram& h) {
  const float top = row_top<D>(x, n, inv_temp);
  if (!(top > -INFINITY)) return -INFINITY;  // nothing to cut: the race keeps its own rules
  float floor = min_p > 0.f ? top + std::log(min_p) : -INFINITY;
  if (k <= 0 && !(p < 1.f)) return floor;
  fill_histogram<D>(x, n, inv_temp, top, floor, h);
  if (k > 0) floor = std::max(floor, top_k_cut<D>(x, n, inv_temp, top, floor, k, h));
  if (p < 1.f) floor = std::max(floor, top_p_cut<D>(x, n, inv_temp, top, floor, p, h));
  return floor;
}

template <class D>
int top_cut(const void* x, int64_t row_stride, int64_t rows, int64_t n, const float* inv_temp,
            const int64_t* top_k, const float* top_p, const float* min_p, float* out,
            int64_t threads) {
  using T = typename D::T;
  if (rows < 0 || n <= 0 || row_stride < 0 || threads < 1) return 1;
  const T* xs = static_cast<const T*>(x);
  const bool parallel = rows > 1 && rows * n >= kParallelRaceElements && threads > 1;
#pragma omp parallel num_threads(static_cast<int>(threads)) if (parallel)
  {
    CutHistogram h;
#pragma omp for schedule(dynamic, 1)
    for (int64_t row = 0; row < rows; ++row)
      out[row] = row_cut<D>(xs + row * row_stride, n, inv_temp[row], top_k[row], top_p[row],
                            min_p[row], h);
  }
  return 0;
}


// ---- logprob_rows ----------------------------------------------------------------------------
constexpr int64_t kMaxLogprobs = 64;  // slots of the per-row selection (the API allows 20)

// The k largest values seen so far, descending (the smaller index first on ties: a value
// enters only when larger than the last slot's, and after the slots it equals); offered
// values only when k > 0.
struct TopSlots {
  float value[kMaxLogprobs];
  int64_t index[kMaxLogprobs];
  int64_t k = 0;
  int64_t filled = 0;
  // Whether v would enter: any value but NaN while a slot is free, else one above the last.
  bool admits(float v) const { return filled < k ? v == v : v > value[k - 1]; }
  void offer(float v, int64_t i) {
    if (!admits(v)) return;
    int64_t at = filled < k ? filled++ : k - 1;
    for (; at > 0 && value[at - 1] < v; --at) value[at] = value[at - 1], index[at] = index[at - 1];
    value[at] = v, index[at] = i;
  }
};

// The row's largest value (NaN ignored) and whether it holds a NaN; with `widened`, the row's
// values in float32 are stored there too (16-bit rows: the scan then reads float32 and
// widens nothing).
template <class D>
KVF_CLONES float row_max(const typename D::T* x, int64_t n, bool* has_nan, float* widened) {
  float best[kLanes];
  int32_t nan[kLanes];
  for (int32_t j = 0; j < kLanes; ++j) best[j] = -INFINITY, nan[j] = 0;
  const int32_t whole = static_cast<int32_t>(n - n % kLanes);
  for (int32_t i = 0; i < whole; i += kLanes) {
#pragma omp simd
    for (int32_t j = 0; j < kLanes; ++j) {
      const float v = D::load(x[i + j]);
      best[j] = v > best[j] ? v : best[j];
      nan[j] |= v != v;
      if (widened != nullptr) widened[i + j] = v;
    }
  }
  float top = -INFINITY;
  int32_t any_nan = 0;
  for (int32_t j = 0; j < kLanes; ++j) top = best[j] > top ? best[j] : top, any_nan |= nan[j];
  for (int64_t i = whole; i < n; ++i) {
    const float v = D::load(x[i]);
    top = v > top ? v : top;
    any_nan |= v != v;
    if (widened != nullptr) widened[i] = v;
  }
  *has_nan = any_nan != 0;
  return top;
}

// Over a float32 row: the sum of exp(x - top) in float32 lanes (folded in double), the count
// of values above `mark`, and the k largest values into `slots` (a 16-value group is looked at
// one by one only when the slots admit its largest, which a random row's groups rarely do
// after the first few).
KVF_CLONES double row_scan(const float* x, int64_t n, float top, float mark, int64_t* above,
                           TopSlots& slots) {
  float sums[kLanes] = {};
  int32_t more[kLanes] = {};
  int64_t greater = 0;
  const int32_t whole = static_cast<int32_t>(n - n % kLanes);
  for (int32_t i = 0; i < whole; i += kLanes) {
    float group_max = -INFINITY;
#pragma omp simd reduction(max : group_max)
    for (int32_t j = 0; j < kLanes; ++j) {
      const float v = x[i + j];
      sums[j] += exp_f32<false>(v - top);
      more[j] += v > mark;
      group_max = v > group_max ? v : group_max;
    }
    if (slots.k > 0 && slots.admits(group_max))
      for (int32_t j = 0; j < kLanes; ++j) slots.offer(x[i + j], i + j);
  }
  for (int32_t j = 0; j < kLanes; ++j) greater += more[j];
  double sum = 0.0;
  for (int32_t j = 0; j < kLanes; ++j) sum += sums[j];
  for (int64_t i = whole; i < n; ++i) {
    sum += exp_f32<false>(x[i] - top);
    greater += x[i] > mark;
    if (slots.k > 0) slots.offer(x[i], i);
  }
  *above = greater;
  return sum;
}

// One row: out_logprob = log_softmax(x)[token] (float32: (x - max) - log(sum)), out_rank, and
// the k largest values' indices and log-probabilities. A row whose log_softmax is undefined
// (a NaN, +inf, or nothing above -inf) gets NaN log-probabilities, as log_softmax gives, and
// top ids 0 .. k-1 (a stable sort of equal values). `scratch` holds n floats (used for 16-bit
// rows).
template <class D>
void logprob_row(const typename D::T* x, int64_t n, int64_t token, int64_t k, float* scratch,
                 float* out_logprob, int64_t* out_rank, int64_t* top_index, float* top_logprob) {
  bool has_nan = false;
  float* widened = std::is_same_v<typename D::T, float> ? nullptr : scratch;
  const float top = row_max<D>(x, n, &has_nan, widened);
  const float* row = widened != nullptr ? widened : reinterpret_cast<const float*>(x);
  const float mark = row[token];
  TopSlots slots;
  slots.k = k;
  int64_t above = 0;
  const double sum = row_scan(row, n, top, mark, &above, slots);
  const float log_sum = has_nan || !(top > -INFINITY) ? NAN : static_cast<float>(std::log(sum));
  *out_logprob = (mark - top) - log_sum;
  *out_rank = above + 1;
  const bool undefined = log_sum != log_sum;  // NaN, all -inf, or +inf (inf - inf): all NaN
  for (int64_t j = 0; j < k; ++j) {
    const bool seen = j < slots.filled && !undefined;  // a finite row fills every slot
    top_index[j] = seen ? slots.index[j] : j;
    top_logprob[j] = seen ? (slots.value[j] - top) - log_sum : NAN;
  }
}

template <class D>
int logprob_rows(const void* x, int64_t row_stride, int64_t rows, int64_t n,
                 const int64_t* tokens, int64_t k, float* out_logprob, int64_t* out_rank,
                 int64_t* top_index, float* top_logprob, int64_t threads) {
  using T = typename D::T;
  if (rows < 0 || n <= 0 || row_stride < 0 || threads < 1 || k < 0 || k > kMaxLogprobs ||
      k > n)
    return 1;
  for (int64_t row = 0; row < rows; ++row)
    if (tokens[row] < 0 || tokens[row] >= n) return 2;
  const T* xs = static_cast<const T*>(x);
  const bool parallel = rows > 1 && rows * n >= kParallelElements && threads > 1;
#pragma omp parallel num_threads(static_cast<int>(threads)) if (parallel)
  {
    std::vector<float> scratch(std::is_same_v<T, float> ? 0 : static_cast<size_t>(n));
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row)
      logprob_row<D>(xs + row * row_stride, n, tokens[row], k, scratch.data(), out_logprob + row,
                     out_rank + row, top_index + row * k, top_logprob + row * k);
  }
  return 0;
}
}  // namespace

// x: rows of n values, row_stride elements apart; out: int64 [rows].
extern "C" int kvmesh_cpu_argmax_rows(int dtype, const void* x, int64_t row_stride, int64_t rows,
                                      int64_t n, int64_t* out, int64_t threads) {
  if (dtype == 0) return argmax_rows<F32>(x, row_stride, rows, n, out, threads);
  if (dtype == 1) return argmax_rows<BF16>(x, row_stride, rows, n, out, threads);
  return 3;
}

// x: rows of n logits, row_stride elements apart; inv_temp: float32 [rows]; keys: [rows];
// floors: float32 [rows] or null (the smallest tempered value that runs, from top_cut).
extern "C" int kvmesh_cpu_race_rows(int dtype, const void* x, int64_t row_stride, int64_t rows,
                                    int64_t n, const float* inv_temp, const uint64_t* keys,
                                    const float* floors, int64_t* out, int64_t threads) {
  if (dtype == 0)
    return race_rows<F32>(x, row_stride, rows, n, inv_temp, keys, floors, out, threads);
  if (dtype == 1)
    return race_rows<BF16>(x, row_stride, rows, n, inv_temp, keys, floors, out, threads);
  return 3;
}

// top_k: int64 [rows] (0: off); top_p, min_p: float32 [rows] (1, 0: off); out: float32 [rows].
extern "C" int kvmesh_cpu_top_cut(int dtype, const void* x, int64_t row_stride, int64_t rows,
                                  int64_t n, const float* inv_temp, const int64_t* top_k,
                                  const float* top_p, const float* min_p, float* out,
                                  int64_t threads) {
  if (dtype == 0)
    return top_cut<F32>(x, row_stride, rows, n, inv_temp, top_k, top_p, min_p, out, threads);
  if (dtype == 1)
    return top_cut<BF16>(x, row_stride, rows, n, inv_temp, top_k, top_p, min_p, out, threads);
  return 3;
}

// x: rows of n raw logits, row_stride elements apart; tokens: int64 [rows] (each in [0, n));
// out_logprob: float32 [rows]; out_rank: int64 [rows]; top_index: int64 [rows, k];
// top_logprob: float32 [rows, k] (0 <= k <= min(64, n)).
extern "C" int kvmesh_cpu_logprob_rows(int dtype, const void* x, int64_t row_stride,
                                       int64_t rows, int64_t n, const int64_t* tokens, int64_t k,
                                       float* out_logprob, int64_t* out_rank,
                                       int64_t* top_index, float* top_logprob, int64_t threads) {
  if (dtype == 0)
    return logprob_rows<F32>(x, row_stride, rows, n, tokens, k, out_logprob, out_rank,
                             top_index, top_logprob, threads);
  if (dtype == 1)
    return logprob_rows<BF16>(x, row_stride, rows, n, tokens, k, out_logprob, out_rank,
                              top_index, top_logprob, threads);
  return 3;
}
