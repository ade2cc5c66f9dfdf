// Linear layers on x86-64 CPUs, bfloat16 (AMX tiles: cpu_gemm_amx.h; or AVX-512 with
// AVX512_BF16) and float32 (AVX-512, or AVX2 + FMA): y [M, N] = x [M, K] . W^T (+ bias), W [N, K]
// packed once at load, float32 sums.
//
//   packed  per 32-column panel, for each step of k (a pair of k in bfloat16, one k in
//           float32), the 32 columns' weights side by side: [ceil(N / 32)][K / step][32][step],
//           so that vector loads feed one step of a tile. Columns past N are zero. bfloat16
//           needs an even K. The layout is the same for every ISA.
//   tile    R rows x 32 columns of float32 sums in registers (AVX-512: up to 12 rows, two
//           16-float vectors each; AVX2: up to 6 rows, the panel in two parts of two 8-float
//           vectors, summed in one pass over the panel up to two rows, else one pass per part,
//           the second part's lines prefetched by the first pass of a panel's first tile: the
//           panel streams from memory in consecutive lines either way; docs/BENCHMARKS.md
//           "AVX2 GEMM at a few rows"), each row's step of x broadcast. bfloat16: vdpbf16ps adds both exact
//           products of a pair into float32 (subnormal inputs read as zero: oneDNN's bfloat16
//           GEMM on these CPUs uses the same instruction); float32: one FMA per k, k in order.
//   threads each takes a contiguous range of 32-column panels (an even split to one panel),
//           rows in chunks that keep the chunk of x in L2. While a panel's first tile runs,
//           the thread prefetches its next panel from memory (prefetcht1; from
//           kPrefetchMinRows rows on): a decode step's weights stream from DRAM once per
//           step, and the prefetch overlaps that stream with the multiply-adds instead of
//           stalling on it (docs/BENCHMARKS.md).
//   output  bias (float32, padded to whole panels) added to the sums; bfloat16 rounds to
//           nearest even (vcvtneps2bf16) once; row stride ldy; a last partial panel goes
//           through a scratch block, so nothing past N is written.
//   silu    kvmesh_cpu_gemm_silu_mul: a gate|up weight packed with its rows interleaved
//           (each tile's first vector of columns gate rows, its second the same up rows:
//           kvmesh_cpu_gemm_silu_width), so that a tile holds gate and up of the same output
//           columns and writes silu(gate) * up [M, N / 2] straight from its registers: the
//           [M, N] gate|up product is never stored. Per element the arithmetic of
//           kvmesh_cpu_silu_mul on the same ISA (fused_common.h's silu_mul_elem, with FMA),
//           after gate and up are rounded to the dtype by the store's own instruction (spill),
//           so the result equals the GEMM followed by that kernel bit for bit.
//
// The path is chosen at run time by the CPU's features; KVMESH_CPU_KERNEL_ISA (baseline |
// avx2 | avx512 | avx512bf16) caps it as it caps the attention kernel's (baseline: no path;
// avx2: float32 only; any cap keeps bfloat16 off AMX).
// Plain C ABI, no torch headers; kvmesh_cpu_gemm_supported(dtype) says whether this build and
// CPU run it (GCC 10 or later on x86-64).

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif

// The SiLU epilogue's arithmetic must not be contracted (fused_common.h); the GEMM's own
// multiply-adds are explicit FMA intrinsics, which this does not touch.
#pragma GCC optimize("-ffp-contract=off")

#include "fused_common.h"

namespace {

constexpr int64_t kPanel = 32;              // columns per packed panel (every ISA)
constexpr int64_t kChunkBytes = 256 << 10;  // the rows of x one chunk keeps in L2
constexpr int64_t kLine = 64;               // bytes per cache line
// Fewer rows than this run without the weight prefetch: a panel's multiply-adds are then too
// short to hide the requests, which only add to the hardware prefetcher's stream of the panel
// (AMD EPYC family 19h: a decode step's linears 0.71-0.99x the time without it at 1-4 rows,
// 0.95-1.09x at 8; docs/BENCHMARKS.md "The GEMM's weight prefetch at a few rows").
constexpr int64_t kPrefetchMinRows = 5;
// (rows per tile, kMaxRows, are per ISA section below)

int64_t panels_of(int64_t n) { return (n + kPanel - 1) / kPanel; }

template <class T>
struct Gemm {
  const T* x;
  int64_t ldx;
  const T* w;         // packed
  const float* bias;  // [panels * 32] or null
  T* y;
  int64_t ldy;
  int64_t m, n, k;
  bool prefetch;  // the next panel while the current one runs (off below kPrefetchMinRows)
};

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define KVG_BUILT 1
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")
namespace avx512 {

constexpr int kMaxRows = 12;

struct Bf16 {
  using T = uint16_t;
  using Acc = __m512;
  using B = __m512bh;
  using D = kvmesh_fused::BF16;
  static constexpr int64_t kStep = 2, kCols = 16;
  // the sums as `store` would round them (vcvtneps2bf16), back in float32
  static void spill(float* p, Acc a) {
    const __m256i bf = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(a));
    _mm512_storeu_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf), 16)));
  }
  static Acc zero() { return _mm512_setzero_ps(); }
  static B load(const T* p) { return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p)); }
  static B broadcast(const T* x) {
    int32_t both;
    std::memcpy(&both, x, sizeof(both));
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(both));
  }
  static Acc madd(Acc acc, B a, B b) { return _mm512_dpbf16_ps(acc, a, b); }
  static void store(T* y, Acc acc, const float* bias) {
    if (bias != nullptr) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc)));
  }
};

struct F32 {
  using T = float;
  using Acc = __m512;
  using B = __m512;
  using D = kvmesh_fused::F32;
  static constexpr int64_t kStep = 1, kCols = 16;
  static void spill(float* p, Acc a) { _mm512_storeu_ps(p, a); }  // float32: as stored
  static Acc zero() { return _mm512_setzero_ps(); }
  static B load(const T* p) { return _mm512_loadu_ps(p); }
  static B broadcast(const T* x) { return _mm512_set1_ps(*x); }
  static Acc madd(Acc acc, B a, B b) { return _mm512_fmadd_ps(a, b, acc); }
  static void store(T* y, Acc acc, const float* bias) {
    if (bias != nullptr) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, acc);
  }
};

#include "cpu_gemm_tiles.h"

}  // namespace avx512
#pragma GCC pop_options

// The AMX path: GCC 11 or later on Linux (the tile state is granted by arch_prctl), unless
// the build defines KVMESH_NO_AMX (cpu_build.py does when the assembler refused the first
// build: binutils before 2.36 do not take the tile instructions).
#if __GNUC__ >= 11 && defined(__linux__) && !defined(KVMESH_NO_AMX)
#define KVG_AMX 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")
namespace amx {
#include "cpu_gemm_amx.h"
}  // namespace amx
#pragma GCC pop_options
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

constexpr int kMaxRows = 6;

struct F32 {
  using T = float;
  using Acc = __m256;
  using B = __m256;
  using D = kvmesh_fused::F32;
  static constexpr int64_t kStep = 1, kCols = 8;
  static void spill(float* p, Acc a) { _mm256_storeu_ps(p, a); }
  static Acc zero() { return _mm256_setzero_ps(); }
  static B load(const T* p) { return _mm256_loadu_ps(p); }
  static B broadcast(const T* x) { return _mm256_broadcast_ss(x); }
  static Acc madd(Acc acc, B a, B b) { return _mm256_fmadd_ps(a, b, acc); }
  static void store(T* y, Acc acc, const float* bias) {
    if (bias != nullptr) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bias));
    _mm256_storeu_ps(y, acc);
  }
};

#include "cpu_gemm_tiles.h"

}  // namespace avx2
#pragma GCC pop_options
#endif

namespace {

enum class Path { kNone, kAvx2, kAvx512, kAmx };

// Whether this thread may use AMX tiles: the CPU has AMX-TILE and AMX-BF16 and Linux grants
// the process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; kernels before
// 5.16 refuse it, and the path is then not taken).
bool amx_granted() {
#ifdef KVG_AMX
  if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
  return false;
#endif
}

// The path this CPU runs for dtype (0 = float32, 1 = bfloat16), under KVMESH_CPU_KERNEL_ISA's
// cap (any cap, avx512bf16 included, keeps bfloat16 off AMX); read once per dtype.
Path path_for(int dtype) {
#ifdef KVG_BUILT
  static const auto pick = [](int dt) {
    const char* env = std::getenv("KVMESH_CPU_KERNEL_ISA");
    const std::string cap = env != nullptr ? env : "";
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    const bool bf16 = avx512 && __builtin_cpu_supports("avx512bf16");
    if (cap == "baseline") return Path::kNone;
    if (dt == 1 && bf16 && cap.empty() && amx_granted()) return Path::kAmx;
    if (dt == 1) return bf16 && cap != "avx2" ? Path::kAvx512 : Path::kNone;
    if (avx512 && cap != "avx2") return Path::kAvx512;
    return avx2 ? Path::kAvx2 : Path::kNone;
  };
  // each dtype's path on first use: the AMX grant is asked for only when bfloat16 is
  if (dtype == 0) {
    static const Path f32 = pick(0);
    return f32;
  }
  if (dtype == 1) {
    static const Path bf16 = pick(1);
    return bf16;
  }
#endif
  (void)dtype;
  return Path::kNone;
}

// The path a GEMM of dtype with inner size k runs: AMX takes inner sizes that are a multiple of
// its tile's 32 k (amx::fits), others run on AVX512_BF16.
Path path_for_k(int dtype, int64_t k) {
  const Path path = path_for(dtype);
#ifdef KVG_AMX
  if (path == Path::kAmx && !amx::fits(k)) return Path::kAvx512;
#else
  (void)k;
#endif
  return path;
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

extern "C" int kvmesh_cpu_gemm_supported(int dtype) {
  return path_for(dtype) != Path::kNone ? 1 : 0;
}

// The path of dtype on this CPU: 0 none, 1 AVX2, 2 AVX-512 (bfloat16: AVX512_BF16), 3 AMX
// (bfloat16 with an inner size that is a multiple of 32; other sizes take AVX512_BF16).
extern "C" int kvmesh_cpu_gemm_path(int dtype) { return static_cast<int>(path_for(dtype)); }

// The path of a GEMM of dtype whose inner size is k (the codes of kvmesh_cpu_gemm_path).
extern "C" int kvmesh_cpu_gemm_path_for_k(int dtype, int64_t k) {
  return static_cast<int>(path_for_k(dtype, k));
}

// The packed size in elements of an [n, k] weight; a bias is padded to panels * 32 floats.
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

// Columns per gate (then up) run of a gate|up weight interleaved for kvmesh_cpu_gemm_silu_mul
// on this CPU's path (the path's vector width: 16 on AVX-512, 8 on AVX2), 0 where the GEMM of
// dtype does not run. Row j of the intermediate's gate (and up) goes to packed column
// (j / 16) * 32 + ((j % 16) / w) * 2w + j % w (up: + w).
extern "C" int kvmesh_cpu_gemm_silu_width(int dtype) {
  const Path path = path_for(dtype);
  if (path == Path::kAvx512 || path == Path::kAmx) return 16;
  if (path == Path::kAvx2) return 8;
  return 0;
}

namespace {

// The checks both entries share, then the GEMM (kSilu: with SiLU-and-mul in its epilogue) on
// this CPU's path: 0, or the entries' error code.
template <bool kSilu>
int run_gemm(int dtype, const void* x, int64_t ldx, const void* packed, const float* bias,
             void* y, int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t threads,
             bool prefetch) {
  if (dtype == 1 && k % 2 != 0) return 1;
  if (dtype != 0 && dtype != 1) return 3;
  const Path path = path_for_k(dtype, k);
  if (path == Path::kNone) return 2;
  if (m == 0) return 0;
  prefetch = prefetch && m >= kPrefetchMinRows;
#ifdef KVG_BUILT
  if (dtype == 1) {
    const Gemm<uint16_t> g{static_cast<const uint16_t*>(x), ldx,
                           static_cast<const uint16_t*>(packed), bias,
                           static_cast<uint16_t*>(y), ldy, m, n, k, prefetch};
#ifdef KVG_AMX
    if (path == Path::kAmx) {
      amx::gemm<kSilu>(g, threads);
      return 0;
    }
#endif
    avx512::gemm<avx512::Bf16, kSilu>(g, threads);
    return 0;
  }
  const Gemm<float> g{static_cast<const float*>(x), ldx, static_cast<const float*>(packed), bias,
                      static_cast<float*>(y), ldy, m, n, k, prefetch};
  if (path == Path::kAvx512) {
    avx512::gemm<avx512::F32, kSilu>(g, threads);
  } else {
    avx2::gemm<avx2::F32, kSilu>(g, threads);
  }
#else
  (void)x, (void)packed, (void)bias, (void)y, (void)ldx, (void)ldy, (void)n, (void)threads;
  (void)prefetch;
#endif
  return 0;
}

}  // namespace

// y [m, n / 2] (row stride ldy) = silu(x . Wg^T) * (x . Wu^T) from a gate|up weight [n, k]
// interleaved (kvmesh_cpu_gemm_silu_width) and packed; n a multiple of 32, no bias.
extern "C" int kvmesh_cpu_gemm_silu_mul(int dtype, const void* x, int64_t ldx, const void* packed,
                                        void* y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                                        int64_t threads) {
  if (m < 0 || n <= 0 || n % kPanel != 0 || k <= 0 || ldx < k || ldy < n / 2 || threads < 1)
    return 1;
  return run_gemm<true>(dtype, x, ldx, packed, nullptr, y, ldy, m, n, k, threads, true);
}

// y [m, n] (row stride ldy) = x [m, k] (row stride ldx) . W^T + bias (float32, padded to
// whole panels, or null); prefetch 0 turns the weight prefetch off (benchmarks only).
extern "C" int kvmesh_cpu_gemm(int dtype, const void* x, int64_t ldx, const void* packed,
                               const float* bias, void* y, int64_t ldy, int64_t m, int64_t n,
                               int64_t k, int64_t threads, int prefetch) {
  if (m < 0 || n <= 0 || k <= 0 || ldx < k || ldy < n || threads < 1) return 1;
  return run_gemm<false>(dtype, x, ldx, packed, bias, y, ldy, m, n, k, threads, prefetch != 0);
}
