// Linear layers on x86-64 CPUs with AVX2 + FMA but no AVX-512, over the AVX-512 kernel's packed
// weights (linear_avx512.cpp: groups of 64 output features; bf16 [G, ceil(K/2), 64, 2], f32
// [G, K, 64]), so one pack serves both and the dispatch can change at run time.
//
// A 64-feature group is 8 ymm vectors. A tile is 1 row x the 8 vectors (8 accumulators), 2
// rows x 4 of them (vectors {v0, v0+1, v0+4, v0+5}, v0 in {0, 2}: in glu mode a gate vector and
// its up vector are always in the same tile) or, for calls of 6 rows or more, 6 rows x 2
// vectors {v, v+4} (the tall tile; 12 accumulators, each weight vector loaded once per 6 rows).
// bf16 weights are widened by shifting: in each 32-bit lane (a pair of K) the even k is the low
// half (<< 16), the odd k the high half (mask).
//
// Every output element is accumulated in k order with one FMA per product (bf16: odd k of a
// pair, then even, as VDPBF16PS), whatever the tile or thread: rows are batch-invariant, and
// the results equal the AVX-512 kernel's (bf16: up to its flushing of denormals).
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "pool.h"
#include "vec.h"

namespace specengine {
namespace {

constexpr int64_t kGroup = kAvx512Group;
using Args = Avx512LinearArgs;

#if defined(__x86_64__) && defined(__GNUC__)
#define SE_AVX2_TARGET __attribute__((target("avx2,fma")))

// Vector j of a tile of NV vectors starting at v0: the gate half, then the matching up half.
template <int NV>
constexpr int vec_index(int v0, int j) {
  return j < NV / 2 ? v0 + j : 4 + v0 + (j - NV / 2);
}

inline float round_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }

SE_AVX2_TARGET inline void store8(const Args& a, int64_t row, int64_t col, const float* v) {
  const int64_t n = std::min<int64_t>(8, a.N - col);
  if (n <= 0) return;
  if (a.out_f32) {
    std::memcpy(static_cast<float*>(a.y) + row * a.ldy + col, v, n * sizeof(float));
  } else {
    auto* y = static_cast<c10::BFloat16*>(a.y) + row * a.ldy + col;
    for (int64_t l = 0; l < n; ++l) y[l] = c10::BFloat16(v[l]);
  }
}

template <int MB, int NV>
SE_AVX2_TARGET inline void epilogue(const Args& a, int64_t g, int64_t m0, int v0,
                                    __m256 (&acc)[MB][NV]) {
  alignas(32) float t[16];
  if (a.glu) {  // features 32g + 8 * vec of the [M, I] output: silu(gate) * up
    for (int j = 0; j < NV / 2; ++j) {
      const int64_t col = g * 32 + 8 * (v0 + j);
      for (int i = 0; i < MB; ++i) {
        _mm256_store_ps(t, acc[i][j]);
        _mm256_store_ps(t + 8, acc[i][j + NV / 2]);
        f32x16 gate{};
        for (int l = 0; l < 8; ++l) gate[l] = a.bf16 ? round_bf16(t[l]) : t[l];
        const f32x16 act = vsilu(gate);
        for (int l = 0; l < 8; ++l)
          t[l] = a.bf16 ? round_bf16(act[l]) * round_bf16(t[8 + l]) : act[l] * t[8 + l];
        store8(a, m0 + i, col, t);
      }
    }
    return;
  }
  for (int j = 0; j < NV; ++j) {
    const int64_t col = g * kGroup + 8 * vec_index<NV>(v0, j);
    if (col >= a.N) continue;
    for (int i = 0; i < MB; ++i) {
      _mm256_store_ps(t, acc[i][j]);
      if (a.bias)
        for (int l = 0; l < 8 && col + l < a.N; ++l) t[l] += a.bias[col + l];
      store8(a, m0 + i, col, t);
    }
  }
}

// Each K step of a group is one 256-byte run of weights (4 cache lines; bf16 and float32
// alike) and vector v of the group lies in line v / 2. A tile's K loop prefetches the lines of
// its own vectors kPrefetchBytes ahead (all 4 for the 1-row tile, 2 for a 2-row one), as the
// AVX-512 kernel does (linear_avx512.cpp: there it read weights ~25% faster at batch 1).
constexpr int64_t kPrefetchBytes = 4096;

template <int NV>
inline void prefetch_tile(const void* wk, int v0) {
  const char* p = static_cast<const char*>(wk) + kPrefetchBytes;
  for (int j = 0; j < NV; j += 2) _mm_prefetch(p + 64 * (vec_index<NV>(v0, j) / 2), _MM_HINT_T0);
}

// The K loops are noinline with private accumulators copied out at the end: inlined next to
// the epilogue (which indexes the array), GCC stored every accumulator on each k.
template <int MB, int NV>
SE_AVX2_TARGET __attribute__((noinline)) void accumulate_bf16(const Args& a, int64_t g,
                                                              int64_t m0, int v0,
                                                              __m256 (&out)[MB][NV]) {
  // Locals, not a.*: the accumulators stay in registers only if no loop bound is read from
  // memory the compiler thinks they might alias.
  const int64_t kp_n = a.K / 2, xs = a.xs;
  const auto* w = static_cast<const uint16_t*>(a.w) + g * kp_n * 2 * kGroup;
  const auto* x = static_cast<const uint16_t*>(a.x) + m0 * xs;
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[MB][NV];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < kp_n; ++kp) {
    const uint16_t* wk = w + kp * 2 * kGroup;
    prefetch_tile<NV>(wk, v0);
    __m256 xe[MB], xo[MB];
    for (int i = 0; i < MB; ++i) {
      uint32_t pair;
      std::memcpy(&pair, x + i * xs + 2 * kp, 4);
      const uint32_t e = pair << 16, o = pair & 0xffff0000u;
      float fe, fo;
      std::memcpy(&fe, &e, 4);
      std::memcpy(&fo, &o, 4);
      xe[i] = _mm256_set1_ps(fe);
      xo[i] = _mm256_set1_ps(fo);
    }
    for (int j = 0; j < NV; ++j) {
      const __m256i wv = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(wk + 16 * vec_index<NV>(v0, j)));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, hi_mask));
      for (int i = 0; i < MB; ++i) {
        acc[i][j] = _mm256_fmadd_ps(xo[i], wo, acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(xe[i], we, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NV; ++j) out[i][j] = acc[i][j];
}

template <int MB, int NV>
SE_AVX2_TARGET __attribute__((noinline)) void accumulate_f32(const Args& a, int64_t g,
                                                             int64_t m0, int v0,
                                                             __m256 (&out)[MB][NV]) {
  const int64_t K = a.K, xs = a.xs;  // locals: see tile_bf16
  const auto* w = static_cast<const float*>(a.w) + g * K * kGroup;
  const auto* x = static_cast<const float*>(a.x) + m0 * xs;
  __m256 acc[MB][NV];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kGroup;
    prefetch_tile<NV>(wk, v0);
    __m256 xb[MB];
    for (int i = 0; i < MB; ++i) xb[i] = _mm256_broadcast_ss(x + i * xs + k);
    for (int j = 0; j < NV; ++j) {
      const __m256 wv = _mm256_loadu_ps(wk + 8 * vec_index<NV>(v0, j));
      for (int i = 0; i < MB; ++i) acc[i][j] = _mm256_fmadd_ps(xb[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NV; ++j) out[i][j] = acc[i][j];
}

// The tall tile, for calls of many rows: kTall rows x 2 vectors {v, v + 4} (in glu mode a gate
// vector and its up vector), v in 0..3. Each weight vector is loaded once per kTall rows (the
// 2 x 4 tile: once per 2 rows), so the K loop is bound by the FMAs rather than by loads from
// L2; x is broadcast from float32 rows (xf: a bf16 x widened once per call), 12 accumulators.
// Per output element the same FMAs in the same order as the other tiles (bf16: odd k of a
// pair, then even), so the same bits.
constexpr int kTall = 6;

template <int MB>
SE_AVX2_TARGET __attribute__((noinline)) void accumulate_f32_tall(const Args& a, const float* xf,
                                                                  int64_t xs, int64_t g, int v,
                                                                  __m256 (&out)[MB][2]) {
  const int64_t K = a.K;
  const auto* w = static_cast<const float*>(a.w) + g * K * kGroup;
  // Two arrays of MB, not one of [MB][2]: GCC keeps each in registers, where as one 384-byte
  // array (past its scalarisation limit) it stored every accumulator on each k.
  __m256 acc0[MB], acc1[MB];
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kGroup;
    const __m256 w0 = _mm256_loadu_ps(wk + 8 * v), w1 = _mm256_loadu_ps(wk + 8 * (v + 4));
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xb = _mm256_broadcast_ss(xf + i * xs + k);
      acc0[i] = _mm256_fmadd_ps(xb, w0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(xb, w1, acc1[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) out[i][0] = acc0[i], out[i][1] = acc1[i];
}

SE_AVX2_TARGET inline __m256 high_half(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(pairs, 16), 16));
}

template <int MB>
SE_AVX2_TARGET __attribute__((noinline)) void accumulate_bf16_tall(const Args& a,
                                                                   const float* xf, int64_t xs,
                                                                   int64_t g, int v,
                                                                   __m256 (&out)[MB][2]) {
  const int64_t kp_n = a.K / 2;
  const auto* w = static_cast<const uint16_t*>(a.w) + g * kp_n * 2 * kGroup;
  __m256 acc0[MB], acc1[MB];  // two arrays: see accumulate_f32_tall
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < kp_n; ++kp) {
    const auto* p0 = reinterpret_cast<const __m256i*>(w + kp * 2 * kGroup + 16 * v);
    const auto* p1 = reinterpret_cast<const __m256i*>(w + kp * 2 * kGroup + 16 * (v + 4));
    // odd k of the pair: the high halves (no mask register: shift down and back up)
    __m256 w0 = high_half(_mm256_loadu_si256(p0)), w1 = high_half(_mm256_loadu_si256(p1));
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xo = _mm256_broadcast_ss(xf + i * xs + 2 * kp + 1);
      acc0[i] = _mm256_fmadd_ps(xo, w0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(xo, w1, acc1[i]);
    }
    // Reload the pairs (from L1) rather than keep them: with them live next to the 12
    // accumulators GCC spilled accumulators to the stack on every k.
    asm volatile("" ::: "memory");
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(p0), 16));  // even k
    w1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(p1), 16));
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const __m256 xe = _mm256_broadcast_ss(xf + i * xs + 2 * kp);
      acc0[i] = _mm256_fmadd_ps(xe, w0, acc0[i]);
      acc1[i] = _mm256_fmadd_ps(xe, w1, acc1[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MB; ++i) out[i][0] = acc0[i], out[i][1] = acc1[i];
}

SE_AVX2_TARGET void tile_tall(const Args& a, const float* xf, int64_t g, int64_t m0, int v) {
  __m256 acc[kTall][2];
  const float* x = xf + m0 * a.K;
  if (a.bf16) accumulate_bf16_tall<kTall>(a, x, a.K, g, v, acc);
  else accumulate_f32_tall<kTall>(a, x, a.K, g, v, acc);
  epilogue<kTall, 2>(a, g, m0, v, acc);
}

template <int MB, int NV>
SE_AVX2_TARGET void tile_bf16(const Args& a, int64_t g, int64_t m0, int v0) {
  __m256 acc[MB][NV];
  accumulate_bf16<MB, NV>(a, g, m0, v0, acc);
  epilogue<MB, NV>(a, g, m0, v0, acc);
}

template <int MB, int NV>
SE_AVX2_TARGET void tile_f32(const Args& a, int64_t g, int64_t m0, int v0) {
  __m256 acc[MB][NV];
  accumulate_f32<MB, NV>(a, g, m0, v0, acc);
  epilogue<MB, NV>(a, g, m0, v0, acc);
}

// xf: x as float32 [M, K] rows when a.M >= kTall (else unused).
template <bool BF16>
void run_groups(const Args& a, const float* xf, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t m = 0;
    if (a.M >= kTall)
      for (; m + kTall <= a.M; m += kTall)
        for (int v = 0; v < 4; ++v) tile_tall(a, xf, g, m, v);
    for (; m + 2 <= a.M; m += 2)
      for (int v0 = 0; v0 < 4; v0 += 2) {
        if (BF16) tile_bf16<2, 4>(a, g, m, v0);
        else tile_f32<2, 4>(a, g, m, v0);
      }
    if (m < a.M) {
      if (BF16) tile_bf16<1, 8>(a, g, m, 0);
      else tile_f32<1, 8>(a, g, m, 0);
    }
  }
}
#endif

}  // namespace

bool avx2_linear_available() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool hw = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return hw && isa_cap() >= kIsaAvx2;
#else
  return false;
#endif
}

void avx2_linear_kernel(const Avx512LinearArgs& a, int64_t G, int64_t element_size) {
#if defined(__x86_64__) && defined(__GNUC__)
  const int64_t group_bytes = a.K * kGroup * element_size;
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / group_bytes);
  // The tall tile reads x as float32 rows of K: a bf16 or strided x is copied once per call.
  std::vector<float> widened;
  const float* xf = static_cast<const float*>(a.x);
  if (a.M >= kTall && (a.bf16 || a.xs != a.K)) {
    widened.resize(static_cast<size_t>(a.M * a.K));
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t k = 0; k < a.K; ++k)
        widened[m * a.K + k] =
            a.bf16 ? static_cast<float>(static_cast<const c10::BFloat16*>(a.x)[m * a.xs + k])
                   : static_cast<const float*>(a.x)[m * a.xs + k];
    xf = widened.data();
  }
  parallel_ranges(G, grain, 4, [&](int64_t g0, int64_t g1) {
    if (a.bf16) run_groups<true>(a, xf, g0, g1);
    else run_groups<false>(a, xf, g0, g1);
  });
#else
  (void)a;
  (void)G;
  (void)element_size;
#endif
}

}  // namespace specengine
