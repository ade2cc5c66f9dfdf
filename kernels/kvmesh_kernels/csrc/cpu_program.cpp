// A recorded sequence of this library's kernel calls, replayed by one call: the CPU form of a
// step graph (kvmesh_kernels/cpu_program.py builds it).
//
// A step of the native executor is about ten kernel calls per layer; made one by one from
// Python each costs its wrapper's checks, a fresh output tensor and a ctypes call, and while
// the calling thread does that the OpenMP team waits. A program is the same calls with their
// arguments fixed at build time (static buffers, packed weights, cache layers), except the
// step's two counts, which the replay passes in: its token rows (every op but attention) and
// its sequences (attention's batch). The calls and their arguments are exactly the eager
// path's, so the results are bit for bit the same.
//
// Each op is 16 int64 slots; slot 0 is its kind, the others its arguments in the order of the
// kernel's C signature with the row count left out (doubles travel as their bit pattern).

#include <cstdint>
#include <cstring>

extern "C" {
int kvmesh_cpu_add_rms_norm(int dtype, const void* x, int64_t x_stride, void* residual,
                            const void* w, void* y, int64_t rows, int64_t n, double eps,
                            int64_t threads);
int kvmesh_cpu_rms_norm(int dtype, const void* x, int64_t x_stride, const void* w, void* y,
                        int64_t rows, int64_t n, double eps, int64_t threads);
int kvmesh_cpu_head_rms_norm(int dtype, void* x, int64_t tokens, int64_t heads,
                             int64_t token_stride, int64_t head_stride, const void* w,
                             int64_t dim, double eps, int64_t threads);
int kvmesh_cpu_rope(int dtype, void* x, int64_t tokens, int64_t heads, int64_t token_stride,
                    int64_t head_stride, int64_t dim, const void* cos, const void* sin,
                    const int64_t* positions, int64_t max_positions, int64_t threads);
int kvmesh_cpu_gemm(int dtype, const void* x, int64_t ldx, const void* packed, const float* bias,
                    void* y, int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t threads,
                    int prefetch);
int kvmesh_cpu_gemm_silu_mul(int dtype, const void* x, int64_t ldx, const void* packed, void* y,
                             int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t threads);
}

namespace {

enum OpKind : int64_t {
  kRmsNorm = 1,     // dtype, x, x_stride, w, y, n, eps, threads
  kAddRmsNorm = 2,  // dtype, x, x_stride, residual, w, y, n, eps, threads
  kRope = 3,        // dtype, x, heads, token_stride, head_stride, dim, cos, sin, positions,
                    // max_positions, threads
  kGemm = 4,        // dtype, x, ldx, packed, bias, y, ldy, n, k, threads, prefetch
  kGemmSiluMul = 5,  // dtype, x, ldx, packed, y, ldy, n, k, threads
  kParams = 6,      // entry, params, field index, count: entry(params) with params[index] set
                    // to the step's token rows (count 0) or its sequences (count 1)
  kHeadRmsNorm = 7,  // dtype, x, heads, token_stride, head_stride, w, dim, eps, threads
};

constexpr int kSlots = 16;
constexpr int kUnknownKind = 999;  // the kernels' own codes are 1..3

using ParamsEntry = int (*)(const void*);

template <typename T>
T* ptr(int64_t v) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(v));
}

double as_double(int64_t bits) {
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

int run_op(const int64_t* a, int64_t rows, int64_t seqs) {
  const int dt = static_cast<int>(a[1]);
  switch (a[0]) {
    case kRmsNorm:
      return kvmesh_cpu_rms_norm(dt, ptr<void>(a[2]), a[3], ptr<void>(a[4]), ptr<void>(a[5]),
                                 rows, a[6], as_double(a[7]), a[8]);
    case kAddRmsNorm:
      return kvmesh_cpu_add_rms_norm(dt, ptr<void>(a[2]), a[3], ptr<void>(a[4]),
                                     ptr<void>(a[5]), ptr<void>(a[6]), rows, a[7],
                                     as_double(a[8]), a[9]);
    case kRope:
      return kvmesh_cpu_rope(dt, ptr<void>(a[2]), rows, a[3], a[4], a[5], a[6], ptr<void>(a[7]),
                             ptr<void>(a[8]), ptr<int64_t>(a[9]), a[10], a[11]);
    case kGemm:
      return kvmesh_cpu_gemm(dt, ptr<void>(a[2]), a[3], ptr<void>(a[4]), ptr<float>(a[5]),
                             ptr<void>(a[6]), a[7], rows, a[8], a[9], a[10],
                             static_cast<int>(a[11]));
    case kGemmSiluMul:
      return kvmesh_cpu_gemm_silu_mul(dt, ptr<void>(a[2]), a[3], ptr<void>(a[4]),
                                      ptr<void>(a[5]), a[6], rows, a[7], a[8], a[9]);
    case kHeadRmsNorm:
      return kvmesh_cpu_head_rms_norm(dt, ptr<void>(a[2]), rows, a[3], a[4], a[5],
                                      ptr<void>(a[6]), a[7], as_double(a[8]), a[9]);
    case kParams: {
      int64_t* params = ptr<int64_t>(a[2]);
      params[a[3]] = a[4] == 1 ? seqs : rows;
      return reinterpret_cast<ParamsEntry>(static_cast<intptr_t>(a[1]))(params);
    }
    default:
      return kUnknownKind;
  }
}

}  // namespace

// Runs `count` ops (kSlots int64 each) over `rows` token rows of `seqs` sequences; stops at
// the first op that fails. Returns 0, or 1000 * (op index + 1) + that op's own code (1..999;
// 999: an unknown kind).
extern "C" int64_t kvmesh_cpu_run_program(const int64_t* ops, int64_t count, int64_t rows,
                                          int64_t seqs) {
  for (int64_t i = 0; i < count; ++i) {
    const int rc = run_op(ops + i * kSlots, rows, seqs);
    if (rc != 0) return 1000 * (i + 1) + rc;
  }
  return 0;
}
