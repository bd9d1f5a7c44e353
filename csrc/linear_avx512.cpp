// Linear layers on AVX-512 CPUs without AMX, over weights packed once (bf16: AVX-512 BF16
// dot products; float32: AVX-512 FMA).
//
// Packed layout: output features in groups of 64; per group and per K step, the 64 features'
// weights lie next to each other, so a thread streams each group's weights from one contiguous
// run of memory and no horizontal sums are needed:
//   bf16: [G, ceil(K/2), 64, 2]  (pairs of K for VDPBF16PS, the "VNNI" layout)
//   f32:  [G, K, 64]
// A tile is up to 6 rows of x times the 64 features of a group (24 accumulators); x values are
// broadcast. In `glu` mode (fused gate_up [2I, K]) group g holds gate features 32g..32g+31 and
// the matching up features, and the epilogue writes silu(gate) * up -> [M, I]; for bf16 it
// rounds gate, up, silu(gate) and the product to bf16 as silu_and_mul does (the fusion changes
// no bits).
//
// Every output element is one row of x times one column of w accumulated over K in a fixed
// order, whatever M, the tile or the thread: row i of the result equals linear(x[i:i+1]) bit for
// bit (batch invariance), which keeps speculative verification (many rows) and plain decoding
// (one row) on identical numbers.
#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "pool.h"
#include "vec.h"

namespace specengine {
namespace {

constexpr int64_t kGroup = kAvx512Group;  // output features per group
constexpr int kMaxRows = 6;     // rows of x per tile

using Args = Avx512LinearArgs;

#if defined(__x86_64__) && defined(__GNUC__)
#define SE_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define SE_BF16_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// float -> bf16 bits, round to nearest even with NaN kept quiet: c10::BFloat16's rounding.
SE_AVX512_TARGET inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb,
                                                   _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

SE_AVX512_TARGET inline __m512 from_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

SE_AVX512_TARGET inline __m512 round_bf16(__m512 v) { return from_bf16(to_bf16(v)); }

SE_AVX512_TARGET inline __m512 silu(__m512 g) {
  f32x16 v;
  std::memcpy(&v, &g, sizeof(v));
  v = vsilu(v);
  __m512 r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
}

SE_AVX512_TARGET inline void store(const Args& a, int64_t row, int64_t col, __m512 v,
                                   __mmask16 mask) {
  if (a.out_f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(a.y) + row * a.ldy + col, mask, v);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.y) + row * a.ldy + col, mask,
                             to_bf16(v));
  }
}

inline __mmask16 lanes(int64_t valid) {
  return valid >= 16 ? __mmask16(0xffff) : valid <= 0 ? 0 : __mmask16((1u << valid) - 1);
}

// acc[i][j]: row m0 + i, features 16j..16j+15 of group g.
template <int MB>
SE_AVX512_TARGET inline void epilogue(const Args& a, int64_t g, int64_t m0, __m512 (&acc)[MB][4]) {
  if (a.glu) {  // features 32g.. of the [M, I] output: silu(gate) * up
    const int64_t col = g * 32;
    for (int h = 0; h < 2; ++h) {
      const __mmask16 mask = lanes(a.N - col - 16 * h);
      for (int i = 0; i < MB; ++i) {
        if (a.bf16) {
          const __m512 act = round_bf16(silu(round_bf16(acc[i][h])));
          store(a, m0 + i, col + 16 * h, _mm512_mul_ps(act, round_bf16(acc[i][2 + h])), mask);
        } else {
          store(a, m0 + i, col + 16 * h, _mm512_mul_ps(silu(acc[i][h]), acc[i][2 + h]), mask);
        }
      }
    }
    return;
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t col = g * kGroup + 16 * j;
    const __mmask16 mask = lanes(a.N - col);
    if (!mask) break;
    const __m512 b = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + col) : _mm512_setzero_ps();
    for (int i = 0; i < MB; ++i) store(a, m0 + i, col, _mm512_add_ps(acc[i][j], b), mask);
  }
}

// Each K step reads one 256-byte run of a group's weights (4 cache lines, bf16 and float32
// alike); all 4 lines of the run kPrefetchBytes ahead are prefetched. Prefetching 2 of the 4
// (leaving the others to the hardware prefetcher) read weights at ~40 GB/s instead of ~50 on 2
// Zen 4 cores: a SmolLM2-135M forward of 1 token 11.5 -> 9.9 ms bf16, 23.4 -> 18.2 ms float32
// (bench/bench_kernels.py --forward).
constexpr int64_t kStepBytes = 4 * 64;
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_step(const void* wk) {
  const char* p = static_cast<const char*>(wk) + kPrefetchBytes;
  for (int64_t l = 0; l < kStepBytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T0);
}

// Over 6 rows each row-block pass reads the group's weights again: the first pass from memory,
// the others from L2 (147 KiB for K = 576 float32), so without help the first pass waits on
// memory while the others compute. The next group of the thread's range is prefetched into L2
// during the current group's passes, spread over their K steps (ceil(4 / passes) lines a
// step), so memory and FMA work overlap, as the AMX kernel does for its pairs. Measured on a
// 2-core AMX Xeon (linears of all 30 layers of SmolLM2-135M in float32, in-process
// alternation): 1.06-1.08x at 8-16 rows, 1.09-1.10x at 32, 1.04-1.10x at 64; bf16 (qwen2.5-0.5b
// shapes, AVX-512 BF16) 1.06-1.07x at 12-24 rows, within noise at 8 and 64.
struct Ahead {
  const char* next = nullptr;  // the next line to prefetch
  const char* end = nullptr;
  int per_step = 0;
  inline void step() {
    for (int i = 0; i < per_step && next < end; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T1);
  }
};

template <int MB>
SE_BF16_TARGET void tile_bf16(const Args& a, int64_t g, int64_t m0, Ahead& ahead) {
  const int64_t kp_n = a.K / 2;
  const auto* w = static_cast<const uint16_t*>(a.w) + g * kp_n * 2 * kGroup;
  const auto* x = static_cast<const uint16_t*>(a.x) + m0 * a.xs;
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_n; ++kp) {
    const uint16_t* wk = w + kp * 2 * kGroup;
    prefetch_step(wk);
    ahead.step();
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 32);
    const __m512i w2 = _mm512_loadu_si512(wk + 64), w3 = _mm512_loadu_si512(wk + 96);
    for (int i = 0; i < MB; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * a.xs + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, (__m512bh)w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, (__m512bh)w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xb, (__m512bh)w2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xb, (__m512bh)w3);
    }
  }
  epilogue<MB>(a, g, m0, acc);
}

template <int MB>
SE_AVX512_TARGET void tile_f32(const Args& a, int64_t g, int64_t m0, Ahead& ahead) {
  const auto* w = static_cast<const float*>(a.w) + g * a.K * kGroup;
  const auto* x = static_cast<const float*>(a.x) + m0 * a.xs;
  __m512 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < a.K; ++k) {
    const float* wk = w + k * kGroup;
    prefetch_step(wk);
    ahead.step();
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int i = 0; i < MB; ++i) {
      const __m512 xb = _mm512_set1_ps(x[i * a.xs + k]);
      acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(xb, w2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(xb, w3, acc[i][3]);
    }
  }
  epilogue<MB>(a, g, m0, acc);
}

template <bool BF16>
void run_groups(const Args& a, int64_t g0, int64_t g1) {
  const int64_t passes = (a.M + kMaxRows - 1) / kMaxRows;
  const int64_t group_bytes = (BF16 ? a.K / 2 : a.K) * kStepBytes;
  const char* w = static_cast<const char*>(a.w);
  for (int64_t g = g0; g < g1; ++g) {
    Ahead ahead;  // one pass is memory-bound: the step prefetch is all it needs
    if (passes > 1 && g + 1 < g1)
      ahead = {w + (g + 1) * group_bytes, w + (g + 2) * group_bytes,
               static_cast<int>((4 + passes - 1) / passes)};
    for (int64_t m = 0; m < a.M; m += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, a.M - m);
#define SE_TILE(R) \
  case R: BF16 ? tile_bf16<R>(a, g, m, ahead) : tile_f32<R>(a, g, m, ahead); break;
      switch (rows) {
        SE_TILE(1) SE_TILE(2) SE_TILE(3) SE_TILE(4) SE_TILE(5) SE_TILE(6)
        default: break;
      }
#undef SE_TILE
    }
  }
}
#endif

bool has_avx512(bool bf16) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool f = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("fma");
  static const bool b = f && __builtin_cpu_supports("avx512bf16");
  return bf16 ? b : f;
#else
  (void)bf16;
  return false;
#endif
}

// Source row of feature slot s (0..63) of group g, or -1 for padding.
int64_t packed_row(int64_t N, bool glu, int64_t g, int64_t s) {
  if (glu) return (s < 32 ? 0 : N / 2) + g * 32 + s % 32;
  const int64_t r = g * kGroup + s;
  return r < N ? r : -1;
}

}  // namespace

bool avx512_linear_available(bool bf16) { return has_avx512(bf16) && isa_cap() >= kIsaAvx512; }

void avx512_pack_bf16(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, bool glu) {
  const int64_t G = glu ? N / 64 : (N + kGroup - 1) / kGroup;
  const int64_t kp_n = (K + 1) / 2;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t s = 0; s < kGroup; ++s) {
      const int64_t r = packed_row(N, glu, g, s);
      if (r < 0) continue;
      for (int64_t k = 0; k < K; ++k)
        dst[((g * kp_n + k / 2) * kGroup + s) * 2 + k % 2] = src[r * K + k];
    }
}

void avx512_pack_f32(const float* src, float* dst, int64_t N, int64_t K, bool glu) {
  const int64_t G = glu ? N / 64 : (N + kGroup - 1) / kGroup;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t s = 0; s < kGroup; ++s) {
      const int64_t r = packed_row(N, glu, g, s);
      if (r < 0) continue;
      for (int64_t k = 0; k < K; ++k) dst[(g * K + k) * kGroup + s] = src[r * K + k];
    }
}

void avx512_linear_kernel(const Avx512LinearArgs& a, int64_t G, int64_t element_size) {
#if defined(__x86_64__) && defined(__GNUC__)
  const int64_t group_bytes = a.K * kGroup * element_size;
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / group_bytes);
  parallel_ranges(G, grain, 4, [&](int64_t g0, int64_t g1) {
    if (a.bf16) run_groups<true>(a, g0, g1);
    else run_groups<false>(a, g0, g1);
  });
#else
  (void)a;
  (void)G;
  (void)element_size;
#endif
}

}  // namespace specengine
