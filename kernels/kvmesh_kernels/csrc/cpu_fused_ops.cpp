// Fused elementwise ops of the native Llama-family executor on CPU, float32 and bfloat16, with
// transformers' roundings (every intermediate transformers rounds to the model dtype is rounded
// here too; float32 is computed without contraction into FMAs, so products round as torch's):
//
//   add_rms_norm:  s = x + r (rounded);  r <- s;  y = w * round(s * rsqrt(mean(s^2) + eps))
//   rms_norm:      the same without the add (y from x)
//   head_rms_norm: rms_norm in place over each head of each row (Qwen3's q/k norms: x [T, H, D]
//                  strided by token and by head, one weight [D] for every head)
//   silu_mul:      y = round(round(g / (1 + exp(-g))) * u) over rows of [g | u] (torch's
//                  F.silu(g) * up: silu in float32, rounded, then the rounded product);
//                  exp is our own vectorizable polynomial (exp_f32, within 1 ulp), with FMA
//                  on AVX2 / AVX-512 (a path per ISA, chosen at run time)
//   rope:          x1' = round(round(x1 c) - round(x2 s)), x2' = round(round(x2 c) + round(x1 s))
//                  in place over heads of rows, cos/sin rows picked by position ("rotate half")
//
// The sampling kernels (argmax, race, top cut) are in cpu_sampling.cpp; the traits and the exp
// both use are in fused_common.h.
//
// Rows may be strided (row stride in elements); outputs are contiguous unless in place. Rows
// are split across OpenMP threads only when the work is large enough to pay for the fork.
// Plain C ABI, no torch headers.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include <omp.h>

#pragma GCC optimize("-ffp-contract=off")  // before the shared header: its exp too

#include "fused_common.h"

namespace {

using namespace kvmesh_fused;  // NOLINT: the shared traits and exp

constexpr int64_t kParallelSiluElements = 1 << 14;  // an exp and a division each: ~0.5 ns
template <class D>
KVF_CLONES void norm_row(const typename D::T* s, const typename D::T* w, typename D::T* y,
                         int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = D::load(s[i]);
    sum += v * v;
  }
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = D::store(D::load(w[i]) * D::round(D::load(s[i]) * r));
}

template <class D>
KVF_CLONES void add_row(const typename D::T* x, typename D::T* r, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) r[i] = D::store(D::load(x[i]) + D::load(r[i]));
}

template <class D>
int add_rms_norm(const void* x, int64_t x_stride, void* residual, const void* w, void* y,
                 int64_t rows, int64_t n, double eps, int64_t threads) {
  using T = typename D::T;
  if (rows < 0 || n <= 0 || x_stride < n || threads < 1) return 1;
  const T* xs = static_cast<const T*>(x);
  T* rs = static_cast<T*>(residual);
  const bool parallel = rows * n >= kParallelElements && threads > 1;
#pragma omp parallel for num_threads(static_cast<int>(threads)) if (parallel) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    T* r = rs + row * n;
    if (xs != nullptr) add_row<D>(xs + row * x_stride, r, n);
    norm_row<D>(r, static_cast<const T*>(w), static_cast<T*>(y) + row * n, n,
                static_cast<float>(eps));
  }
  return 0;
}

template <class D>
int rms_norm(const void* x, int64_t x_stride, const void* w, void* y, int64_t rows, int64_t n,
             double eps, int64_t threads) {
  using T = typename D::T;
  if (rows < 0 || n <= 0 || x_stride < n || threads < 1) return 1;
  const bool parallel = rows * n >= kParallelElements && threads > 1;
#pragma omp parallel for num_threads(static_cast<int>(threads)) if (parallel) schedule(static)
  for (int64_t row = 0; row < rows; ++row)
    norm_row<D>(static_cast<const T*>(x) + row * x_stride, static_cast<const T*>(w),
                static_cast<T*>(y) + row * n, n, static_cast<float>(eps));
  return 0;
}

// One row: y = round(round(g / (1 + exp(-g))) * u), the quotient and the product rounded once
// each as torch's are; inlined into one function per ISA below.
template <class D, bool kFma>
inline __attribute__((always_inline)) void silu_mul_row(const typename D::T* g,
                                                        const typename D::T* u, typename D::T* y,
                                                        int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    y[i] = D::store(silu_mul_elem<D, kFma>(D::load(g[i]), D::load(u[i])));
}

template <class D>
using SiluRow = void (*)(const typename D::T*, const typename D::T*, typename D::T*, int64_t);

template <class D>
__attribute__((noinline)) void silu_mul_row_base(const typename D::T* g, const typename D::T* u,
                                                 typename D::T* y, int64_t n) {
  silu_mul_row<D, false>(g, u, y, n);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVF_SILU_DISPATCH 1
template <class D>
__attribute__((target("avx2,fma"), noinline)) void silu_mul_row_avx2(const typename D::T* g,
                                                                     const typename D::T* u,
                                                                     typename D::T* y,
                                                                     int64_t n) {
  silu_mul_row<D, true>(g, u, y, n);
}

template <class D>
__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma"), noinline)) void
silu_mul_row_avx512(const typename D::T* g, const typename D::T* u, typename D::T* y,
                    int64_t n) {
  silu_mul_row<D, true>(g, u, y, n);
}
#endif

// The SiLU row path this CPU runs (AVX-512 + FMA, AVX2 + FMA, or the baseline ISA without
// FMA: the exp's last bit may differ between them), read once; KVMESH_CPU_KERNEL_ISA
// (baseline | avx2) caps it as it caps the attention kernel's.
template <class D>
SiluRow<D> silu_row_path() {
  static const SiluRow<D> path = [] {
    const char* env = std::getenv("KVMESH_CPU_KERNEL_ISA");
    const std::string cap = env != nullptr ? env : "";
#ifdef KVF_SILU_DISPATCH
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    if (avx512 && cap != "baseline" && cap != "avx2") return &silu_mul_row_avx512<D>;
    if (avx2 && cap != "baseline") return &silu_mul_row_avx2<D>;
#endif
    return &silu_mul_row_base<D>;
  }();
  return path;
}

template <class D>
int silu_mul(const void* gate_up, int64_t row_stride, void* y, int64_t rows, int64_t n,
             int64_t threads) {
  using T = typename D::T;
  if (rows < 0 || n <= 0 || row_stride < 2 * n || threads < 1) return 1;
  const T* gu = static_cast<const T*>(gate_up);
  const SiluRow<D> row_fn = silu_row_path<D>();
  const bool parallel = rows * n >= kParallelSiluElements && threads > 1;
#pragma omp parallel for num_threads(static_cast<int>(threads)) if (parallel) schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const T* g = gu + row * row_stride;
    row_fn(g, g + n, static_cast<T*>(y) + row * n, n);
  }
  return 0;
}

template <class D>
int head_rms_norm(void* x, int64_t tokens, int64_t heads, int64_t token_stride,
                  int64_t head_stride, const void* w, int64_t dim, double eps, int64_t threads) {
  using T = typename D::T;
  if (tokens < 0 || heads <= 0 || dim <= 0 || head_stride < dim || threads < 1) return 1;
  if (tokens > 1 && token_stride < heads * head_stride) return 1;
  T* xs = static_cast<T*>(x);
  const bool parallel = tokens * heads * dim >= kParallelElements && threads > 1;
#pragma omp parallel for num_threads(static_cast<int>(threads)) if (parallel) schedule(static)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      T* head = xs + t * token_stride + h * head_stride;  // read whole, then written in place
      norm_row<D>(head, static_cast<const T*>(w), head, dim, static_cast<float>(eps));
    }
  return 0;
}

template <class D>
KVF_CLONES void rope_head(typename D::T* x, const typename D::T* c, const typename D::T* s,
                          int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = D::load(x[i]), x2 = D::load(x[i + half]);
    const float ci = D::load(c[i]), si = D::load(s[i]);
    const float a = D::round(x1 * ci), b = D::round(x2 * si);
    const float e = D::round(x2 * ci), f = D::round(x1 * si);
    x[i] = D::store(a - b);
    x[i + half] = D::store(e + f);
  }
}

template <class D>
int rope(void* x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t head_stride,
         int64_t dim, const void* cos, const void* sin, const int64_t* positions,
         int64_t max_positions, int64_t threads) {
  using T = typename D::T;
  if (tokens < 0 || heads <= 0 || dim <= 0 || dim % 2 || threads < 1) return 1;
  for (int64_t t = 0; t < tokens; ++t)
    if (positions[t] < 0 || positions[t] >= max_positions) return 2;
  T* xs = static_cast<T*>(x);
  const bool parallel = tokens * heads * dim >= kParallelElements && threads > 1;
#pragma omp parallel for num_threads(static_cast<int>(threads)) if (parallel) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = static_cast<const T*>(cos) + positions[t] * dim;
    const T* s = static_cast<const T*>(sin) + positions[t] * dim;
    for (int64_t h = 0; h < heads; ++h)
      rope_head<D>(xs + t * token_stride + h * head_stride, c, s, dim / 2);
  }
  return 0;
}

}  // namespace

// dtype: 0 = float32, 1 = bfloat16. x may be null in add_rms_norm (then y = norm(residual)).
extern "C" int kvmesh_cpu_add_rms_norm(int dtype, const void* x, int64_t x_stride, void* residual,
                                       const void* w, void* y, int64_t rows, int64_t n,
                                       double eps, int64_t threads) {
  if (dtype == 0) return add_rms_norm<F32>(x, x_stride, residual, w, y, rows, n, eps, threads);
  if (dtype == 1) return add_rms_norm<BF16>(x, x_stride, residual, w, y, rows, n, eps, threads);
  return 3;
}

extern "C" int kvmesh_cpu_rms_norm(int dtype, const void* x, int64_t x_stride, const void* w,
                                   void* y, int64_t rows, int64_t n, double eps, int64_t threads) {
  if (dtype == 0) return rms_norm<F32>(x, x_stride, w, y, rows, n, eps, threads);
  if (dtype == 1) return rms_norm<BF16>(x, x_stride, w, y, rows, n, eps, threads);
  return 3;
}

// x: [tokens, heads, dim] at token_stride / head_stride elements, normalized in place.
extern "C" int kvmesh_cpu_head_rms_norm(int dtype, void* x, int64_t tokens, int64_t heads,
                                        int64_t token_stride, int64_t head_stride, const void* w,
                                        int64_t dim, double eps, int64_t threads) {
  if (dtype == 0)
    return head_rms_norm<F32>(x, tokens, heads, token_stride, head_stride, w, dim, eps, threads);
  if (dtype == 1)
    return head_rms_norm<BF16>(x, tokens, heads, token_stride, head_stride, w, dim, eps, threads);
  return 3;
}

// gate_up: rows of [gate (n) | up (n)], row_stride elements apart; y: [rows, n] contiguous.
extern "C" int kvmesh_cpu_silu_mul(int dtype, const void* gate_up, int64_t row_stride, void* y,
                                   int64_t rows, int64_t n, int64_t threads) {
  if (dtype == 0) return silu_mul<F32>(gate_up, row_stride, y, rows, n, threads);
  if (dtype == 1) return silu_mul<BF16>(gate_up, row_stride, y, rows, n, threads);
  return 3;
}

extern "C" int kvmesh_cpu_rope(int dtype, void* x, int64_t tokens, int64_t heads,
                               int64_t token_stride, int64_t head_stride, int64_t dim,
                               const void* cos, const void* sin, const int64_t* positions,
                               int64_t max_positions, int64_t threads) {
  if (dtype == 0)
    return rope<F32>(x, tokens, heads, token_stride, head_stride, dim, cos, sin, positions,
                     max_positions, threads);
  if (dtype == 1)
    return rope<BF16>(x, tokens, heads, token_stride, head_stride, dim, cos, sin, positions,
                      max_positions, threads);
  return 3;
}
