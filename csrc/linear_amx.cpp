// bf16 linear on Intel AMX tiles (TDPBF16PS) with weights packed once into the tile layout.
//
// Packed layout: output features in blocks of 16, processed in pairs; per pair and per
// 32-wide K step, two 1 KiB B tiles [16 K-pairs][16 features][2] (VNNI), so a thread streams
// its pairs' weights contiguously. K and N are zero-padded to whole tiles. In `glu` mode (fused
// gate_up [2I, K]) pair p is (gate block p, up block p) and the epilogue writes
// silu(gate) * up -> [M, I], rounding as silu_and_mul does (gate, up, silu(gate), product each
// to bf16), so the fusion does not change results.
//
// Per call: 32 rows of x per pass (two A tiles, four C tiles, two B tiles = 8 tiles).
// Each C element is one row of A times one column of B accumulated over K in a fixed order, and
// the tile unit computes rows independently, so row i of the result does not depend on M or on
// the other rows (batch invariance), nor on the thread that ran its chunk.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "amx_tiles.h"
#include "kernels.h"
#include "pool.h"
#include "vec.h"

namespace specengine {
namespace {

constexpr int64_t kPairElems = 2 * 16 * 32;  // two B tiles of bf16 per K step of a pair

// x86-64 only: AMX tiles and AVX-512 (function-level targets, chosen at run time).
#if defined(__x86_64__) && defined(__GNUC__)
#define SE_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

// Each lane rounded to bf16 (to nearest even, as c10::BFloat16; NaN -> quiet NaN 0x7fc0) and
// widened back to float.
SE_AMX_TARGET inline f32x16 bf16_round(f32x16 v) {
  u32x16 u;
  std::memcpy(&u, &v, sizeof(u));
  const u32x16 nan = static_cast<u32x16>(v != v);
  u = ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u & ~nan) | (0x7fc00000u & nan);
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

SE_AMX_TARGET inline void configure(int m0, int m1) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(m0), cfg.colsb[t] = 64;
  if (m1)
    for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(m1), cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // the whole struct is read by ldtilecfg
  _tile_loadconfig(&cfg);
}

// v rounded to bf16 as bf16_round does, as 16 bf16 bits: the conversion instruction (round to
// nearest even) for normal numbers, zeros and infinities; bf16_round where a lane is NaN or
// denormal (the instruction flushes denormals to zero and keeps a NaN's sign and payload).
SE_AMX_TARGET inline __m256i bf16_bits(__m512 v) {
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0xA1) != 0, 0)) {  // QNaN, SNaN, denormal
    f32x16 f;
    std::memcpy(&f, &v, sizeof(f));
    f = bf16_round(f);
    u32x16 bits;
    std::memcpy(&bits, &f, sizeof(bits));
    const u16x16 h = __builtin_convertvector(bits >> 16, u16x16);
    __m256i out;
    std::memcpy(&out, &h, sizeof(out));
    return out;
  }
  return (__m256i)_mm512_cvtneps_pbh(v);
}

// 16 bf16 bits widened to float.
SE_AMX_TARGET inline __m512 widen_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Output of one pair for rows [r0 + rb, r0 + re) from c[rows][32] float.
SE_AMX_TARGET inline void epilogue_rows(const AmxArgs& a, int64_t p, int64_t r0, int rb, int re,
                                        const float (*c)[32]) {
  if (a.glu) {
    uint16_t* y = static_cast<uint16_t*>(a.y) + r0 * a.ldy + p * 16;
    for (int r = rb; r < re; ++r) {
      const __m512 g = widen_bf16(bf16_bits(_mm512_loadu_ps(&c[r][0])));
      const __m512 u = widen_bf16(bf16_bits(_mm512_loadu_ps(&c[r][16])));
      f32x16 gv;
      std::memcpy(&gv, &g, sizeof(gv));
      const f32x16 sv = vsilu(gv);
      __m512 s;
      std::memcpy(&s, &sv, sizeof(s));
      const __m256i h = bf16_bits(_mm512_mul_ps(widen_bf16(bf16_bits(s)), u));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * a.ldy), h);
    }
    return;
  }
  const __m512 z = _mm512_setzero_ps();
  if (!a.out_f32 && !a.bias && p * 32 + 32 <= a.N) {  // both halves in one conversion and store
    uint16_t* y = static_cast<uint16_t*>(a.y) + r0 * a.ldy + p * 32;
    for (int r = rb; r < re; ++r) {  // + 0 as the bias path adds: a -0 sum becomes +0 there too
      const __m512i o = (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_loadu_ps(&c[r][16]), z),
                                                     _mm512_add_ps(_mm512_loadu_ps(&c[r][0]), z));
      _mm512_storeu_si512(y + r * a.ldy, o);
    }
    return;
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t col = p * 32 + h * 16;
    if (col >= a.N) break;
    const int valid = static_cast<int>(std::min<int64_t>(16, a.N - col));
    const __mmask16 mk = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = a.bias ? _mm512_maskz_loadu_ps(mk, a.bias + col) : z;
    for (int r = rb; r < re; ++r) {
      const __m512 v = _mm512_add_ps(_mm512_loadu_ps(&c[r][h * 16]), b);
      const int64_t at = (r0 + r) * a.ldy + col;
      if (a.out_f32) {
        float* dst = static_cast<float*>(a.y) + at;
        if (a.stream && valid == 16 && (reinterpret_cast<uintptr_t>(dst) & 63) == 0)
          _mm512_stream_ps(dst, v);  // a whole aligned line: no read for ownership
        else
          _mm512_mask_storeu_ps(dst, mk, v);
      } else {
        const __m256i o = (__m256i)_mm512_cvtneps_pbh(v);
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(a.y) + at, mk, o);
      }
    }
  }
}

SE_AMX_TARGET inline void epilogue(const AmxArgs& a, int64_t p, int64_t r0, int rows,
                                   const float (*c)[32]) {
  epilogue_rows(a, p, r0, 0, rows, c);
}

// A block whose output is still to be written (p < 0: none).
struct Pending {
  int64_t p = -1, r0 = 0;
  int rows = 0;
  const float (*c)[32] = nullptr;
};

// Where the A tiles of rows [r0, r0 + 16) start, and their stride in bytes: x itself, or its
// copy in tile order (`xt`, 1 KiB per 16 rows x 32 K).
struct RowTiles {
  const uint16_t* p;
  int64_t step, stride;  // elements from one K step to the next; bytes between rows
};
inline RowTiles row_tiles(const AmxArgs& a, const uint16_t* xt, int64_t r0) {
  if (xt) return {xt + (r0 / 16) * a.Kb * 512, 512, 64};
  return {a.x + r0 * a.xs, 32, a.xs * 2};
}

// The C tiles of pair p over rows [r0, r0 + m0 + m1) into c (rows x 32 floats). Each K step
// also prefetches `pf_lines` cache lines from `*pf` (advanced, up to `pf_end`) into L2 (the
// next pairs' weights arrive from memory while this pair computes) and writes its share of the
// rows of `pend`, the block before.
template <bool kTwo>
SE_AMX_TARGET void amx_block(const AmxArgs& a, const uint16_t* xt, int64_t p, int64_t r0,
                             float (*c)[32], const char*& pf, const char* pf_end,
                             int pf_lines, const Pending& pend) {
  const RowTiles t0 = row_tiles(a, xt, r0), t1 = row_tiles(a, xt, r0 + 16);
  const uint16_t* wp = a.w + p * a.Kb * kPairElems;
  _tile_zero(0);
  _tile_zero(1);
  if (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  int done = 0;
  for (int64_t kb = 0; kb < a.Kb; ++kb) {
    const uint16_t* wk = wp + kb * kPairElems;
    for (int i = 0; i < pf_lines && pf < pf_end; ++i, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
    if (pend.p >= 0 && kb > 0) {
      const int upto = static_cast<int>(kb * pend.rows / a.Kb);
      epilogue_rows(a, pend.p, pend.r0, done, upto, pend.c);
      done = upto;
    }
    _tile_loadd(4, t0.p + kb * t0.step, t0.stride);
    _tile_loadd(6, wk, 64);
    _tile_loadd(7, wk + 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (kTwo) {
      _tile_loadd(5, t1.p + kb * t1.step, t1.stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (pend.p >= 0) epilogue_rows(a, pend.p, pend.r0, done, pend.rows, pend.c);
}

SE_AMX_TARGET inline void store_block(bool two, float (*c)[32]) {
  _tile_stored(0, &c[0][0], 128);
  _tile_stored(1, &c[0][16], 128);
  if (two) {
    _tile_stored(2, &c[16][0], 128);
    _tile_stored(3, &c[16][16], 128);
  }
}

// Pairs [p0, p1) of the P pairs for every row of x: per pair, every 32-row block of x. A pair's
// weights are read from memory by its first block and from L2 by the others, and the next
// pair's weights are prefetched into L2 a few lines per K step, so the weight stream runs while
// the tiles compute. (Grouping 8 pairs per row block, as before, read A from L1 for the group
// but left the weight stream idle for all but the first block: at 48-128 rows the call took
// 1.2-1.45x as long, measured with qwen2.5-0.5B's gate_up and LM head on 2 cores.)
// Over 16 rows every block is a whole 32 rows of x's copy in tile order, padded with zero rows,
// so one tile configuration serves the whole call (a short last block would reconfigure the
// tiles at every pair); rows past M are computed and not written.
// A block's epilogue (vector work: rounding, SiLU) is spread over the next block's K steps,
// a few rows per step, so the vector and tile units work at once (run after the whole next
// block's tile work, the epilogue was measured at a third of the fused gate_up's time at 64-128
// rows; spread, the call takes 0.68x as long).
SE_AMX_TARGET void amx_pairs(const AmxArgs& a, const uint16_t* xt, int64_t p0, int64_t p1,
                             int64_t P) {
  alignas(64) float c[2][32][32];
  const int64_t pair_bytes = a.Kb * kPairElems * 2;
  const char* base = reinterpret_cast<const char*>(a.w);
  const int m0 = xt ? 16 : static_cast<int>(std::min<int64_t>(a.M, 16));
  const int m1 = xt ? 16 : 0;
  configure(m0, m1);
  const int64_t blocks = (a.M + 31) / 32;
  const int pf_lines = static_cast<int>((pair_bytes / 64 + blocks * a.Kb - 1) / (blocks * a.Kb));
  int cur = 0;
  Pending last;
  for (int64_t p = p0; p < p1; ++p) {
    // the next pair, also past the range's end (as another range's first pair it would
    // otherwise be read cold)
    const char* pf = base + std::min(P, p + 1) * pair_bytes;
    const char* pf_end = base + std::min(P, p + 2) * pair_bytes;
    for (int64_t r0 = 0; r0 < a.M; r0 += 32) {
      if (m1)
        amx_block<true>(a, xt, p, r0, c[cur], pf, pf_end, pf_lines, last);
      else
        amx_block<false>(a, xt, p, r0, c[cur], pf, pf_end, pf_lines, last);
      store_block(m1 != 0, c[cur]);
      last = {p, r0, static_cast<int>(std::min<int64_t>(32, a.M - r0)), c[cur]};
      cur ^= 1;
    }
  }
  if (last.p >= 0) epilogue(a, last.p, last.r0, last.rows, last.c);
  if (a.stream) _mm_sfence();  // the streamed lines are in memory before the call returns
  _tile_release();
}

// Rows [16 t, 16 t + 16) of x into tile order: xt[(t * Kb + kb) * 512 + r * 32 + k] =
// x[16 t + r][32 kb + k], zeros past K and past M.
SE_AMX_TARGET void pack_row_tile(const AmxArgs& a, int64_t K, int64_t t, uint16_t* xt) {
  const int64_t r1 = std::max<int64_t>(0, std::min<int64_t>(16, a.M - t * 16));
  for (int64_t kb = 0; kb < a.Kb; ++kb) {
    uint16_t* dst = xt + (t * a.Kb + kb) * 512;
    const int64_t k0 = kb * 32, valid = std::min<int64_t>(32, K - k0);
    const __mmask32 mk = valid >= 32 ? ~__mmask32{0} : ((__mmask32{1} << valid) - 1);
    for (int64_t r = 0; r < r1; ++r)
      _mm512_storeu_si512(dst + r * 32,
                          _mm512_maskz_loadu_epi16(mk, a.x + (t * 16 + r) * a.xs + k0));
    for (int64_t r = r1; r < 16; ++r) _mm512_storeu_si512(dst + r * 32, _mm512_setzero_si512());
  }
}
#endif

bool detect_amx() {
  if (const char* s = std::getenv("SPECENGINE_NO_AMX"); s && *s && std::strcmp(s, "0") != 0)
    return false;
#if defined(__x86_64__) && defined(__GNUC__)
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
  if (!amx_bf16 || !amx_tile || !__builtin_cpu_supports("avx512bf16")) return false;
#if defined(__linux__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
#else
  return false;
#endif
}

}  // namespace

bool amx_supported() {
  static const bool ok = detect_amx();
  return ok;
}

bool amx_available() { return amx_supported() && isa_cap() >= kIsaAmx; }

void amx_pack(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, bool glu) {
  const int64_t Kb = (K + 31) / 32;
  const int64_t P = glu ? N / 32 : (N + 31) / 32;
  const int64_t I = N / 2;
  for (int64_t p = 0; p < P; ++p)
    for (int t = 0; t < 2; ++t)
      for (int n = 0; n < 16; ++n) {
        const int64_t row = glu ? t * I + p * 16 + n : p * 32 + t * 16 + n;
        if (row >= N) continue;
        const uint16_t* s = src + row * K;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t kb = k / 32, kp = (k % 32) / 2, e = k % 2;
          dst[((p * Kb + kb) * 2 + t) * 512 + kp * 32 + n * 2 + e] = s[k];
        }
      }
}

void amx_linear_kernel(const AmxArgs& a, int64_t P, int64_t K) {
#if defined(__x86_64__) && defined(__GNUC__)
  const int64_t pair_bytes = a.Kb * kPairElems * 2;
  // Over 16 rows the A tiles are read once per pair: from a copy in tile order (1 KiB
  // contiguous per tile) they load faster than from x's rows.
  const uint16_t* xt = a.M > 16 ? a.xt : nullptr;
  if (xt) parallel_chunks((a.M + 31) / 32 * 2, [&](int64_t t) { pack_row_tile(a, K, t, a.xt); });
  parallel_ranges(P, std::max<int64_t>(1, (48 << 10) / pair_bytes), 4,
                  [&](int64_t p0, int64_t p1) { amx_pairs(a, xt, p0, p1, P); });
#else
  (void)a;
  (void)P;
  (void)K;
#endif
}

}  // namespace specengine
