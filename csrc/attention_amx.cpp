// Paged attention on Intel AMX tiles (TDPBF16PS): bf16 query and caches, head_dim % 32 == 0.
// Same cache layout, work items and online softmax as the AVX-512 path (attention.cpp); both
// matrix products run on the tile unit:
//
//   scores  S = Q K^T: A = 16 query rows x 32 dims, B = K^T of 16 keys in VNNI pairs (the 16 x 16
//           matrix of the keys' dimension pairs, transposed once per key tile for every row of
//           the work item), C = [16 rows][16 keys] float32; a work item of up to 16 rows (a
//           decode token) takes S^T = K Q^T instead, the same sums, with no key transposes;
//   output  O += P V:  A = 16 rows of probabilities (bf16) x 32 keys, B = V of 32 keys in VNNI
//           pairs (two keys' rows interleaved), C = [16 rows][16 dims] float32.
//
// The tile unit computes each C row from its A row alone, over K in a fixed order, and adding
// a zero product leaves a sum unchanged; a row's keys follow its own compact key sequence in
// fixed 256-key steps (positions [0, base), then its visible tree positions), so a row's result
// does not depend on the other rows of its work item, on the batch, on where its keys sit in the
// cache or on the thread (batch invariance, as on the AVX-512 path; the two paths round
// differently and a machine runs one of them). K and V rows a few key groups ahead are
// prefetched while one computes: a decode step reads every cache row once, from memory.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "amx_tiles.h"
#include "attention_runs.h"
#include "kernels.h"
#include "pool.h"
#include "vec.h"

namespace specengine {
namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#define SE_ATTN_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

constexpr int64_t kTileKeys = 256;  // keys per online-softmax step (a multiple of 32)
// Key groups of 16 that a decode row's score loop prefetches ahead: one group ahead left the
// K and V reads mostly unhidden (64 sequences x 192 keys x 30 layers of SmolLM2, cold caches,
// 2-core AMX Xeon: 22.3 ms median of 4 runs, the warm caches' 11.6 ms plus the reads);
// four ahead: 21.6 ms; three 21.5.
constexpr int64_t kAheadGroups = 4;
// Up to this many rows a decode item takes its scores out of the [key][row] tile by gathering
// each row's column, over it by transposing the whole 16 x 16 tile (64 sequences x 192 keys x
// 30 layers of SmolLM2, 3 rows an item, 2-core AMX Xeon: warm caches 13.5 -> 12.7 ms, cold
// 22.6 -> 20.9 ms, medians of 3).
constexpr int64_t kGatherRows = 8;

// Every tile 16 rows x 64 bytes: C tiles 0-3, A tile 4, B tiles 5-7.
SE_ATTN_AMX void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // the whole struct is read by ldtilecfg
  _tile_loadconfig(&cfg);
}

// r[i][j] -> r[j][i] for a 16 x 16 matrix of 32-bit elements (unpack 32, unpack 64, then two
// rounds of 128-bit lane shuffles).
SE_ATTN_AMX inline void transpose16(__m512i (&r)[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // b[4i + c], 128-bit lane L: rows 4i .. 4i+3 of column 4L + c
  for (int i = 0; i < 4; ++i) {
    b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
    b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
    b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
    const __m512i e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i f0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i f1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(e0, f0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(e0, f0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(e1, f1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(e1, f1, 0xDD);
  }
}

// K and V rows of keys [o0, o1) (element offsets kr into kc, vc; rows of D) into L2: a decode
// step reads each cache row once, from memory, scattered over blocks, so the key loops fetch
// the next group's rows while one computes (and the next work item's first ones).
SE_ATTN_AMX inline void prefetch_rows(const uint16_t* kc, const uint16_t* vc, const int64_t* kr,
                                      int64_t o0, int64_t o1, int64_t D) {
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t b = 0; b < D; b += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(kc + kr[o] + b), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(vc + kr[o] + b), _MM_HINT_T1);
    }
}

// K^T of keys [16 j0, n) (element offsets kr into kc) as B tiles: kt[(j * DC + c) * 512 +
// dp * 32 + key * 2 + e] = K[16 j + key][32 c + 2 dp + e]; keys past n are zeros.
SE_ATTN_AMX void pack_keys(const uint16_t* kc, const int64_t* kr, int64_t j0, int64_t n,
                           int64_t DC, uint16_t* kt, const uint16_t* vc) {
  for (int64_t j = j0; 16 * j < n; ++j) {
    const int64_t valid = std::min<int64_t>(16, n - 16 * j);
    prefetch_rows(kc, vc, kr, 16 * (j + 1), std::min(n, 16 * (j + 2)), 32 * DC);
    for (int64_t c = 0; c < DC; ++c) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = i < valid ? _mm512_loadu_si512(kc + kr[16 * j + i] + 32 * c)
                         : _mm512_setzero_si512();
      transpose16(r);
      uint16_t* out = kt + (j * DC + c) * 512;
      for (int dp = 0; dp < 16; ++dp) _mm512_storeu_si512(out + dp * 32, r[dp]);
    }
  }
}

// V of keys [2 kp0, n) as B tiles, key pairs kp up to the next multiple of 16 (zeros past n):
// vi[((kp * DC + c) * 2 + h) * 32 + 2 j + e] = V[2 kp + e][d] with d = 32 c + 8 (j / 4) +
// j % 4 + 4 h (unpacklo/unpackhi within 128-bit lanes: the output dims come out permuted, and
// the epilogue puts them back).
SE_ATTN_AMX void pack_values(const uint16_t* vc, const int64_t* kr, int64_t kp0, int64_t n,
                             int64_t DC, uint16_t* vi) {
  const int64_t pairs = (n + 31) / 32 * 16;
  for (int64_t kp = kp0; kp < pairs; ++kp) {
    const int64_t o = 2 * kp;
    for (int64_t c = 0; c < DC; ++c) {
      const __m512i v0 = o < n ? _mm512_loadu_si512(vc + kr[o] + 32 * c) : _mm512_setzero_si512();
      const __m512i v1 =
          o + 1 < n ? _mm512_loadu_si512(vc + kr[o + 1] + 32 * c) : _mm512_setzero_si512();
      _mm512_storeu_si512(vi + ((kp * DC + c) * 2) * 32, _mm512_unpacklo_epi16(v0, v1));
      _mm512_storeu_si512(vi + ((kp * DC + c) * 2 + 1) * 32, _mm512_unpackhi_epi16(v0, v1));
    }
  }
}

// Raw scores of 16 query rows (a: A tiles, row stride a_stride bytes) against key groups
// [j, j + NJ) of kt: out[i * ld + 16 jj + k] (floats), summed over the DC chunks in order.
template <int NJ>
SE_ATTN_AMX inline void score_groups(const uint16_t* a, int64_t a_stride, const uint16_t* kt,
                                     int64_t j, int64_t DC, float* out, int64_t ld) {
  _tile_zero(0);
  if (NJ > 1) _tile_zero(1);
  if (NJ > 2) _tile_zero(2);
  if (NJ > 3) _tile_zero(3);
  for (int64_t c = 0; c < DC; ++c) {
    _tile_loadd(4, a + 32 * c, a_stride);
    _tile_loadd(5, kt + (j * DC + c) * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (NJ > 1) {
      _tile_loadd(6, kt + ((j + 1) * DC + c) * 512, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (NJ > 2) {
      _tile_loadd(7, kt + ((j + 2) * DC + c) * 512, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (NJ > 3) {
      _tile_loadd(5, kt + ((j + 3) * DC + c) * 512, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, out, ld * 4);
  if (NJ > 1) _tile_stored(1, out + 16, ld * 4);
  if (NJ > 2) _tile_stored(2, out + 32, ld * 4);
  if (NJ > 3) _tile_stored(3, out + 48, ld * 4);
}

// Scores of row tiles [rt0, rt1) (query rows qa [16 RT, D]) against key groups [j0, j1):
// sc[r * kTileKeys + 16 j + k].
SE_ATTN_AMX void scores(const uint16_t* qa, int64_t D, const uint16_t* kt, int64_t rt0,
                        int64_t rt1, int64_t j0, int64_t j1, float* sc) {
  const int64_t DC = D / 32;
  for (int64_t rt = rt0; rt < rt1; ++rt) {
    const uint16_t* a = qa + rt * 16 * D;
    float* out = sc + rt * 16 * kTileKeys;
    for (int64_t j = j0; j < j1; j += 4) {
      switch (std::min<int64_t>(4, j1 - j)) {
        case 4: score_groups<4>(a, 2 * D, kt, j, DC, out + 16 * j, kTileKeys); break;
        case 3: score_groups<3>(a, 2 * D, kt, j, DC, out + 16 * j, kTileKeys); break;
        case 2: score_groups<2>(a, 2 * D, kt, j, DC, out + 16 * j, kTileKeys); break;
        default: score_groups<1>(a, 2 * D, kt, j, DC, out + 16 * j, kTileKeys); break;
      }
    }
  }
}

// Q^T of up to 16 query rows (qa, row stride D) as B tiles: qt[c * 512 + dp * 32 + row * 2 + e]
// = Q[row][32 c + 2 dp + e] (rows past R: whatever qa holds; their scores are not read).
SE_ATTN_AMX void pack_queries(const uint16_t* qa, int64_t D, uint16_t* qt) {
  for (int64_t c = 0; c < D / 32; ++c) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(qa + i * D + 32 * c);
    transpose16(r);
    for (int dp = 0; dp < 16; ++dp) _mm512_storeu_si512(qt + c * 512 + dp * 32, r[dp]);
  }
}

// Scores of the R <= 16 rows of row tile 0 against keys [0, n) as S^T = K Q^T: A = 16 cache
// rows as they are (a whole block's 16 slots load straight from the cache; other key groups
// are copied to `kbuf` first), B = qt (pack_queries). Each score is the same sum of the same
// products in the same order as in `scores` (TDPBF16PS adds the pair products of a dimension
// pair, pairs in order, whichever operand is A), so the two agree bit for bit; this one skips
// transposing every key group, which costs more than the products for a decode row.
// sc[r * kTileKeys + k]; K and V rows kAheadGroups groups ahead are prefetched meanwhile.
SE_ATTN_AMX void scores_transposed(const uint16_t* kc, const uint16_t* vc, const int64_t* kr,
                                   int64_t n, int64_t D, int64_t stride, const uint16_t* qt,
                                   int64_t R, uint16_t* kbuf, float* sc) {
  const int64_t DC = D / 32;
  alignas(64) float cbuf[16 * 16];
  for (int64_t j = 0; 16 * j < n; ++j) {
    const int64_t valid = std::min<int64_t>(16, n - 16 * j);
    const int64_t* k = kr + 16 * j;
    if (j == 0) prefetch_rows(kc, vc, kr, 16, std::min(n, 16 * kAheadGroups), D);
    prefetch_rows(kc, vc, kr, std::min(n, 16 * (j + kAheadGroups)),
                  std::min(n, 16 * (j + kAheadGroups + 1)), D);
    bool dense = valid == 16;
    for (int64_t i = 1; i < 16 && dense; ++i) dense = k[i] - k[i - 1] == stride;
    const uint16_t* a = kc + k[0];
    int64_t a_stride = stride * 2;
    if (!dense) {
      for (int64_t i = 0; i < 16; ++i) {
        if (i < valid)
          std::memcpy(kbuf + i * D, kc + k[i], D * 2);
        else
          std::memset(kbuf + i * D, 0, D * 2);
      }
      a = kbuf, a_stride = D * 2;
    }
    _tile_zero(0);
    for (int64_t c = 0; c < DC; ++c) {
      _tile_loadd(4, a + 32 * c, a_stride);
      _tile_loadd(5, qt + c * 512, 64);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, cbuf, 64);
    if (R <= kGatherRows) {  // [key][row] -> [row][key]: each row's column of cbuf
      const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6,
                                                               5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
      for (int64_t r = 0; r < R; ++r)
        _mm512_storeu_ps(sc + r * kTileKeys + 16 * j,
                         _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32(r)),
                                             cbuf, 4));
    } else {
      __m512i t[16];
      for (int i = 0; i < 16; ++i) t[i] = _mm512_load_si512(cbuf + 16 * i);
      transpose16(t);
      for (int64_t r = 0; r < R; ++r) _mm512_storeu_si512(sc + r * kTileKeys + 16 * j, t[r]);
    }
  }
}

// P V for 16 rows (p: [16][kTileKeys] bf16) over key steps [0, steps) of 32 keys, output
// column tiles [col, col + NC) (column tile 2c + h of the packed V): key steps below `own_from`
// read vi, the rest vi_own (a tree row's own keys), one accumulation chain per element.
// cbuf[i * 64 + 16 t + k] = column tile col + t, row i.
template <int NC>
SE_ATTN_AMX inline void pv_tiles(const uint16_t* p, const uint16_t* vi, const uint16_t* vi_own,
                                 int64_t own_from, int64_t steps, int64_t DC, int64_t col,
                                 float* cbuf) {
  const int64_t vstride = DC * 128;  // bytes between key pairs
  _tile_zero(0);
  if (NC > 1) _tile_zero(1);
  if (NC > 2) _tile_zero(2);
  if (NC > 3) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* v = (s < own_from ? vi : vi_own) + 16 * s * DC * 64 + col * 32;
    _tile_loadd(4, p + 32 * s, kTileKeys * 2);
    _tile_loadd(5, v, vstride);
    _tile_dpbf16ps(0, 4, 5);
    if (NC > 1) {
      _tile_loadd(6, v + 32, vstride);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (NC > 2) {
      _tile_loadd(7, v + 64, vstride);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (NC > 3) {
      _tile_loadd(5, v + 96, vstride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, cbuf, 256);
  if (NC > 1) _tile_stored(1, cbuf + 16, 256);
  if (NC > 2) _tile_stored(2, cbuf + 32, 256);
  if (NC > 3) _tile_stored(3, cbuf + 48, 256);
}

// acc[r] += (P V)[r] for the rows r of row tile rt with take[r] (acc [16 RT, D] floats).
SE_ATTN_AMX void pv_rows(const uint16_t* pb, const uint16_t* vi, const uint16_t* vi_own,
                         int64_t own_from, int64_t steps, int64_t D, int64_t rt,
                         const bool* take, float* acc) {
  const int64_t DC = D / 32, cols = 2 * DC;
  alignas(64) float cbuf[16 * 64];
  const uint16_t* p = pb + rt * 16 * kTileKeys;
  for (int64_t col = 0; col < cols; col += 4) {
    const int64_t nc = std::min<int64_t>(4, cols - col);
    switch (nc) {
      case 4: pv_tiles<4>(p, vi, vi_own, own_from, steps, DC, col, cbuf); break;
      case 3: pv_tiles<3>(p, vi, vi_own, own_from, steps, DC, col, cbuf); break;
      case 2: pv_tiles<2>(p, vi, vi_own, own_from, steps, DC, col, cbuf); break;
      default: pv_tiles<1>(p, vi, vi_own, own_from, steps, DC, col, cbuf); break;
    }
    for (int64_t i = 0; i < 16; ++i) {
      if (!take[rt * 16 + i]) continue;
      float* ar = acc + (rt * 16 + i) * D + col * 16;
      for (int64_t t = 0; t < nc; ++t)
        _mm512_storeu_ps(ar + 16 * t, _mm512_add_ps(_mm512_loadu_ps(ar + 16 * t),
                                                    _mm512_loadu_ps(cbuf + i * 64 + 16 * t)));
    }
  }
}

// Scores 16 j .. 16 j + 15 of a row times scale; keys from nk on are -inf.
SE_ATTN_AMX inline __m512 masked_scores(const float* sr, int64_t j, int64_t nk, __m512 scale) {
  const int64_t valid = std::min<int64_t>(16, nk - 16 * j);
  const __mmask16 vis = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  return _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), vis,
                            _mm512_mul_ps(_mm512_loadu_ps(sr + 16 * j), scale));
}

// One row's online-softmax step over its nk keys of this tile: scores sr (raw) -> probabilities
// pr (bf16; zeros from nk up to `width` keys), acc row rescaled, m and l updated.
SE_ATTN_AMX void softmax_row(const float* sr, int64_t nk, int64_t width, float scale, float& m,
                             float& l, float* ar, int64_t D, uint16_t* pr) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t n16 = nk > 0 ? (nk + 15) / 16 : 0;
  const __m512 sv = _mm512_set1_ps(scale);
  if (n16) {
    __m512 mx = _mm512_set1_ps(ninf);
    for (int64_t j = 0; j < n16; ++j) mx = _mm512_max_ps(mx, masked_scores(sr, j, nk, sv));
    const float mnew = std::max(m, _mm512_reduce_max_ps(mx));
    if (m != ninf && mnew != m) {
      const float alpha = std::exp(m - mnew);
      const __m512 av = _mm512_set1_ps(alpha);
      for (int64_t i = 0; i < D; i += 16)
        _mm512_storeu_ps(ar + i, _mm512_mul_ps(_mm512_loadu_ps(ar + i), av));
      l *= alpha;
    }
    m = mnew;
    __m512 lsum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n16; ++j) {
      const __m512 s = masked_scores(sr, j, nk, sv);
      const __m512 shifted = _mm512_sub_ps(s, _mm512_set1_ps(mnew));
      f32x16 e;
      std::memcpy(&e, &shifted, sizeof(e));
      e = vexp(e);
      __m512 pv;
      std::memcpy(&pv, &e, sizeof(pv));
      const __mmask16 seen = _mm512_cmp_ps_mask(s, _mm512_set1_ps(ninf), _CMP_NEQ_OQ);
      const __m256i p16 = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(seen, pv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * j), p16);
      lsum = _mm512_add_ps(
          lsum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(p16), 16)));
    }
    l += _mm512_reduce_add_ps(lsum);
  }
  std::memset(pr + 16 * n16, 0, (width - 16 * n16) * sizeof(uint16_t));
}

struct Args {
  const AttnArgs* a;         // a->q is not read: q below is
  const uint16_t* q;         // [T, H, D] bf16, unscaled
  const int64_t* run_start;  // [runs + 1] first token of each run
  float scale;
};

// Scratch bytes of one work item of up to R rows of D.
int64_t scratch_bytes(int64_t R, int64_t D) {
  const int64_t RP = (R + 15) / 16 * 16;
  return RP * D * 2 +                       // qa: query rows, bf16
         RP * D * 4 + 2 * RP * 4 +          // acc, m, l
         2 * RP * kTileKeys * 4 +           // scores, a tree row's own scores
         2 * RP * kTileKeys * 2 +           // probabilities, a tree row's own
         2 * kTileKeys * D * 2 +            // K^T, own K^T
         2 * kTileKeys * D * 2 +            // V pairs, own V pairs
         2 * kTileKeys * 8 + 2 * RP +       // key offsets, own key offsets, row flags
         16 * D * 2 +                      // Q^T of one row tile
         16 * 64;                           // alignment slack
}

template <class T>
T* carve(char*& p, int64_t count) {
  p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
  T* out = reinterpret_cast<T*>(p);
  p += count * sizeof(T);
  return out;
}

// The first 32 keys of work item `item` (the key loops prefetch the rest one group ahead).
SE_ATTN_AMX void prefetch_item(const Args& f, int64_t item) {
  const WorkItem w(*f.a, f.run_start, item);
  int64_t n = 0, kr[32];
  for (int64_t t = w.t0; t < w.t0 + w.nt; ++t) n = std::max<int64_t>(n, f.a->kv_lens[t]);
  n = std::min<int64_t>(n, 32);
  w.slots(0, n, kr);
  prefetch_rows(w.kc, w.vc, kr, 0, n, f.a->D);
}

SE_ATTN_AMX void attend_amx(const Args& f, int64_t item, char* scratch) {
  const AttnArgs& a = *f.a;
  const WorkItem w(a, f.run_start, item);
  const int64_t D = a.D, group = a.H / a.KVH, DC = D / 32, stride = w.stride;
  const int64_t g = w.g, t0 = w.t0, nt = w.nt, R = nt * group;
  const int64_t RT = (R + 15) / 16, RP = RT * 16;
  const uint16_t *kc = w.kc, *vc = w.vc;
  char* sp = scratch;
  auto* qa = carve<uint16_t>(sp, RP * D);
  float* acc = carve<float>(sp, RP * D);
  float* m = carve<float>(sp, RP);
  float* l = carve<float>(sp, RP);
  float* sc = carve<float>(sp, RP * kTileKeys);
  float* sc_own = carve<float>(sp, RP * kTileKeys);
  auto* pb = carve<uint16_t>(sp, RP * kTileKeys);
  auto* pb_own = carve<uint16_t>(sp, RP * kTileKeys);
  auto* kt = carve<uint16_t>(sp, kTileKeys * D);
  auto* kt_own = carve<uint16_t>(sp, kTileKeys * D);
  auto* vi = carve<uint16_t>(sp, kTileKeys * D);
  auto* vi_own = carve<uint16_t>(sp, kTileKeys * D);
  auto* rows = carve<int64_t>(sp, kTileKeys);
  auto* rows_own = carve<int64_t>(sp, kTileKeys);
  bool* take = carve<bool>(sp, RP);  // rows the shared P V adds to
  bool* mine = carve<bool>(sp, RP);  // a tree row's rows
  auto* qt = carve<uint16_t>(sp, 16 * D);  // one row tile's Q^T (scores_transposed)
  // row r: token t0 + r / group, query head g * group + r % group
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(qa + r * D, f.q + (t0 + r / group) * a.q_stride + (g * group + r % group) * D,
                D * 2);
  if (RT == 1) pack_queries(qa, D, qt);
  const float ninf = -std::numeric_limits<float>::infinity();
  std::fill(m, m + RP, ninf);
  std::fill(l, l + RP, 0.f);
  std::fill(acc, acc + RP * D, 0.f);
  const RunKeys keys(a, t0, nt);
  for (int64_t p0 = 0; p0 < keys.n_max; p0 += kTileKeys) {
    const int64_t n = std::min<int64_t>(kTileKeys, keys.n_max - p0), steps = (n + 31) / 32;
    w.slots(p0, n, rows);
    if (RT == 1) {  // up to 16 rows (decode): S^T, no key transposes
      scores_transposed(kc, vc, rows, n, D, stride, qt, R, kt, sc);
    } else {
      pack_keys(kc, rows, 0, n, DC, kt, vc);
      scores(qa, D, kt, 0, RT, 0, (n + 15) / 16, sc);
    }
    pack_values(vc, rows, 0, n, DC, vi);
    for (int64_t r = 0; r < RP; ++r) take[r] = r < R;
    for (int64_t tok = 0; tok < nt; ++tok) {
      const int64_t nk = std::min<int64_t>(n, keys.count[tok] - p0);  // this token's keys here
      const int64_t r0 = tok * group;
      if (nk <= 0 || !keys.gap[tok] || p0 + nk <= keys.base[tok]) {
        for (int64_t h = 0; h < group; ++h)
          softmax_row(sc + (r0 + h) * kTileKeys, nk, 32 * steps, f.scale, m[r0 + h], l[r0 + h],
                      acc + (r0 + h) * D, D, pb + (r0 + h) * kTileKeys);
        continue;
      }
      // A tree row off the first branch: keys from compact index `from` on are its own
      // (positions [p0, base) are shared). Scores of its own key groups, then its own P V over
      // every key step of the tile in one chain.
      const int64_t from = std::max<int64_t>(0, keys.base[tok] - p0);
      const int64_t j0 = from / 16, s0 = from / 32;
      for (int64_t o = 32 * s0; o < nk; ++o) {
        const int64_t k = p0 + o;
        rows_own[o] = k < keys.base[tok] ? rows[o] : w.slot(keys.tree_pos(tok, k));
      }
      pack_keys(kc, rows_own, j0, nk, DC, kt_own, vc);
      pack_values(vc, rows_own, 16 * s0, nk, DC, vi_own);
      const int64_t rt0 = r0 / 16, rt1 = (r0 + group + 15) / 16;
      scores(qa, D, kt_own, rt0, rt1, j0, (nk + 15) / 16, sc_own);
      for (int64_t h = 0; h < group; ++h) {
        const int64_t r = r0 + h;
        float* sr = sc + r * kTileKeys;
        std::memcpy(sr + 16 * j0, sc_own + r * kTileKeys + 16 * j0,
                    16 * ((nk + 15) / 16 - j0) * sizeof(float));
        softmax_row(sr, nk, 32 * steps, f.scale, m[r], l[r], acc + r * D, D,
                    pb_own + r * kTileKeys);
        std::memset(pb + r * kTileKeys, 0, kTileKeys * sizeof(uint16_t));
        take[r] = false;
      }
      // its rows alone: the other rows of pb_own are whatever they were (rows are independent)
      for (int64_t r = 0; r < RP; ++r) mine[r] = r >= r0 && r < r0 + group;
      for (int64_t rt = rt0; rt < rt1; ++rt)
        pv_rows(pb_own, vi, vi_own, s0, (nk + 31) / 32, D, rt, mine, acc);
    }
    for (int64_t rt = 0; rt < RT; ++rt) pv_rows(pb, vi, vi, steps, steps, D, rt, take, acc);
  }
  write_rows(a, acc, l, t0, R, group, g);
}

// Work items [begin, end) on one thread, with its own scratch and tile configuration.
SE_ATTN_AMX void attend_items(const Args& f, int64_t begin, int64_t end, int64_t bytes) {
  // kept per thread across calls: no allocation (and no zeroing) per call; an item writes what
  // it reads, except tile rows past its own rows, whose results it discards
  thread_local std::unique_ptr<char[]> scratch;
  thread_local int64_t size = 0;
  if (size < bytes) scratch.reset(new char[bytes]), size = bytes;
  configure_tiles();
  for (int64_t item = begin; item < end; ++item) {
    if (item + 1 < end) prefetch_item(f, item + 1);
    attend_amx(f, item, scratch.get());
  }
  _tile_release();
}
#endif

}  // namespace

bool paged_attention_amx_available(int64_t D) {
#if defined(__x86_64__) && defined(__GNUC__)
  return D % 32 == 0 && D <= 256 && amx_available();
#else
  (void)D;
  return false;
#endif
}

void paged_attention_amx(const AttnArgs& a, const uint16_t* q_bf16, float scale) {
#if defined(__x86_64__) && defined(__GNUC__)
  const int64_t group = a.H / a.KVH;
  const std::vector<int64_t> runs = query_runs(a);
  const int64_t bytes = scratch_bytes(kRunTokens * group, a.D);
  Args f{&a, q_bf16, runs.data(), scale};
  parallel_ranges((static_cast<int64_t>(runs.size()) - 1) * a.KVH, 1, 4,
                  [&](int64_t begin, int64_t end) { attend_items(f, begin, end, bytes); });
#else
  (void)a;
  (void)q_bf16;
  (void)scale;
#endif
}

}  // namespace specengine
