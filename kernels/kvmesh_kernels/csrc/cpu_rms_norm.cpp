// Fused RMSNorm for bfloat16 rows on CPU, with transformers' Llama-family rounding.
//
//   h = float(x); r = 1 / sqrt(mean(h * h) + eps)
//   y = bf16(float(w) * float(bf16(h * r)))
//
// which is what `LlamaRMSNorm.forward` computes in bfloat16 (upcast, normalise in float32,
// round to bf16, multiply by the bf16 weight, round again) in one pass over each row instead of
// eight tensor operations. x rows may be strided (row stride in elements); y is contiguous
// [rows, n]. Rows are split across OpenMP threads only when the batch is large enough to pay
// for the fork. Plain C ABI, no torch headers.

#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "dtype_convert.h"

namespace {

using kvmesh_cvt::bf16_to_f32;
using kvmesh_cvt::f32_to_bf16;

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVM_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define KVM_CLONES
#endif

KVM_CLONES void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t n,
                         float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_f32(x[i]);
    sum += v * v;
  }
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float h = bf16_to_f32(f32_to_bf16(bf16_to_f32(x[i]) * r));
    y[i] = f32_to_bf16(bf16_to_f32(w[i]) * h);
  }
}

constexpr int64_t kParallelElements = 1 << 16;  // smaller batches: not worth waking a thread

}  // namespace

extern "C" int kvmesh_cpu_rms_norm_bf16(const uint16_t* x, int64_t rows, int64_t row_stride,
                                        const uint16_t* w, uint16_t* y, int64_t n, double eps,
                                        int64_t num_threads) {
  if (rows < 0 || n <= 0 || row_stride < n || num_threads < 1) return 1;
  const float e = static_cast<float>(eps);
  const bool parallel = rows * n >= kParallelElements && num_threads > 1;
#pragma omp parallel for num_threads(static_cast<int>(num_threads)) if (parallel) schedule(static)
  for (int64_t row = 0; row < rows; ++row) norm_row(x + row * row_stride, w, y + row * n, n, e);
  return 0;
}
