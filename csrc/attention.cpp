// Paged attention on the CPU (vLLM PagedAttention cache layout, FlashAttention-style online
// softmax), for prefill, decode and tree-verify tokens in one kernel.
//
// Work item = (query token t, KV head g): the `group` query heads sharing KV head g read each
// K/V row once. Scores are computed one cache block at a time; the running max / sum / output
// are rescaled per block (online softmax, Milakov & Gimelshein 2018; Dao et al. 2022), all in
// float32 whatever the cache dtype.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "attention_runs.h"
#include "kernels.h"
#include "pool.h"
#include "vec.h"

namespace specengine {
namespace {

template <class KT>
SE_INLINE float dot(const float* q, const KT* k, int64_t D) {
  f32x16 acc{};
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) acc += load16(q + i) * load16(k + i);
  float s = hsum(acc);
  for (; i < D; ++i) s += q[i] * to_float(k[i]);
  return s;
}

template <class KT>
SE_INLINE void axpy(float* acc, float p, const KT* v, int64_t D) {
  int64_t i = 0;
  f32x16 pv = splat(p);
  for (; i + 16 <= D; i += 16) store16(acc + i, load16(acc + i) + pv * load16(v + i));
  for (; i < D; ++i) acc[i] += p * to_float(v[i]);
}

SE_INLINE void scale_row(float* acc, float a, int64_t D) {
  int64_t i = 0;
  f32x16 av = splat(a);
  for (; i + 16 <= D; i += 16) store16(acc + i, load16(acc + i) * av);
  for (; i < D; ++i) acc[i] *= a;
}

// Keys per online-softmax step of the generic path: fixed, so the result does not depend on
// the cache's block size either (16: what it was with the default 16-token blocks).
constexpr int64_t kGenericStep = 16;

// Items [begin, end) of the (t, g) grid; scratch holds group*(D + kGenericStep + 16 + 2)
// floats.
template <class KT>
SE_INLINE void attend(const AttnArgs& a, int64_t begin, int64_t end, float* scratch) {
  const int64_t group = a.H / a.KVH, D = a.D, BS = a.BS;
  const KT* kc = static_cast<const KT*>(a.k_cache);
  const KT* vc = static_cast<const KT*>(a.v_cache);
  float* acc = scratch;                 // [group, D]
  const int64_t SW = kGenericStep + 16;  // score row width (vector reads past len)
  float* s = acc + group * D;           // [group, SW]
  float* m = s + group * SW;            // [group]
  float* l = m + group;                 // [group]
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<int64_t> keys;  // visible positions of the item's query, as one compact sequence
  for (int64_t item = begin; item < end; ++item) {
    const int64_t t = item / a.KVH, g = item % a.KVH;
    const int64_t n = a.kv_lens[t];
    const int32_t* table = a.block_tables + static_cast<int64_t>(a.query_seq[t]) * a.MB;
    const int64_t base = a.tree_mask ? std::min<int64_t>(a.tree_base[t], n) : n;
    const bool* mask = a.tree_mask ? a.tree_mask + t * a.W : nullptr;
    // the context [0, base), then the visible tree positions: steps of kGenericStep keys
    // follow this sequence, not slots, so where the keys sit in the cache cannot change the
    // result
    keys.clear();
    for (int64_t p = 0; p < base; ++p) keys.push_back(p);
    for (int64_t p = base; p < n; ++p)
      if (p - base < a.W && mask[p - base]) keys.push_back(p);
    const int64_t count = static_cast<int64_t>(keys.size());
    const float* q = a.q + (t * a.H + g * group) * D;
    std::fill(acc, acc + group * D, 0.f);
    std::fill(m, m + group, ninf);
    std::fill(l, l + group, 0.f);
    for (int64_t c0 = 0; c0 < count; c0 += kGenericStep) {
      const int64_t len = std::min(kGenericStep, count - c0);
      for (int64_t o = 0; o < len; ++o) {
        const int64_t p = keys[c0 + o];
        const int64_t row = ((static_cast<int64_t>(table[p / BS]) * BS + p % BS) * a.KVH + g) * D;
        for (int64_t h = 0; h < group; ++h) s[h * SW + o] = dot(q + h * D, kc + row, D);
      }
      for (int64_t h = 0; h < group; ++h) {
        float* sh = s + h * SW;
        const float bmax = *std::max_element(sh, sh + len);
        const float mnew = std::max(m[h], bmax);
        if (m[h] != ninf && mnew != m[h]) {
          const float alpha = std::exp(m[h] - mnew);
          scale_row(acc + h * D, alpha, D);
          l[h] *= alpha;
        }
        m[h] = mnew;
        for (int64_t o = 0; o < len; o += 16) {  // s has SW floats per head: no overrun
          f32x16 sv;
          std::memcpy(&sv, sh + o, sizeof(sv));
          const f32x16 pv = vexp(sv - mnew);
          std::memcpy(sh + o, &pv, sizeof(pv));
        }
        for (int64_t o = 0; o < len; ++o) {
          const int64_t p = keys[c0 + o];
          const int64_t row =
              ((static_cast<int64_t>(table[p / BS]) * BS + p % BS) * a.KVH + g) * D;
          l[h] += sh[o];
          axpy(acc + h * D, sh[o], vc + row, D);
        }
      }
    }
    float* out = a.out + (t * a.H + g * group) * D;
    for (int64_t h = 0; h < group; ++h) {
      const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;  // no visible position: zeros
      for (int64_t i = 0; i < D; ++i) out[h * D + i] = acc[h * D + i] * inv;
    }
  }
}

SE_CLONES void attend_f32(const AttnArgs& a, int64_t begin, int64_t end, float* scratch) {
  attend<float>(a, begin, end, scratch);
}
SE_CLONES void attend_bf16(const AttnArgs& a, int64_t begin, int64_t end, float* scratch) {
  attend<c10::BFloat16>(a, begin, end, scratch);
}

// ---- bf16 caches, head_dim % 32 == 0: AVX-512 BF16 ---------------------------------------
// Work item = (run of up to kRunTokens consecutive query tokens of one sequence, KV head g):
// its rows are the run's tokens x the group's query heads, and each K/V tile of up to 16
// positions is read once for all of them. Scores: per row and key, D/32 VDPBF16PS into one
// 16-lane vector per key, the 16 vectors of a tile reduced together by a transpose-add tree (no
// per-key horizontal sum). P @ V: VDPBF16PS over key pairs, with V of two keys interleaved once
// per tile for all rows; probabilities are rounded to bf16 for it (as FlashAttention does) and
// the softmax denominator sums the same rounded values. Online softmax in float32.
#if defined(__x86_64__) && defined(__GNUC__)
#define SE_ATTN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define SE_F32_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

constexpr int64_t kTileKeys = 256;  // KV positions per online-softmax step
constexpr int kMaxD = 256;

bool has_avx512_bf16_attn() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
  return ok;
}

// r[i] = sum of the 16 lanes of v[i], for 16 vectors.
SE_F32_TARGET inline __m512 reduce16(__m512 (&v)[16]) {
  // level 1: pairs (2j, 2j+1) -> 8 vectors, lanes [a0..7 + a8..15 | b0..7 + b8..15]
  __m512 a[8];
  for (int j = 0; j < 8; ++j) {
    const __m512 lo = _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44);  // a0-7, b0-7
    const __m512 hi = _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE);  // a8-15, b8-15
    a[j] = _mm512_add_ps(lo, hi);
  }
  // level 2: (a[2j], a[2j+1]) -> 4 vectors of four 4-lane partial sums
  __m512 b[4];
  for (int j = 0; j < 4; ++j) {
    const __m512 lo = _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88);  // lanes 0-3, 8-11
    const __m512 hi = _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xDD);  // lanes 4-7, 12-15
    b[j] = _mm512_add_ps(lo, hi);
  }
  // b[j] 128-bit lanes: [v4j, v4j+1 (from a[2j]) ... ] each lane holds 4 partial sums of one key
  // level 3: within 128-bit lanes, pairs of floats
  __m512 c[2];
  for (int j = 0; j < 2; ++j) {
    const __m512 lo = _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0x88);  // elements 0, 2
    const __m512 hi = _mm512_shuffle_ps(b[2 * j], b[2 * j + 1], 0xDD);  // elements 1, 3
    c[j] = _mm512_add_ps(lo, hi);
  }
  const __m512 lo = _mm512_shuffle_ps(c[0], c[1], 0x88);
  const __m512 hi = _mm512_shuffle_ps(c[0], c[1], 0xDD);
  return _mm512_add_ps(lo, hi);
}

// exp(s - m) per lane with the portable vexp (vec.h), for AVX-512 code.
SE_F32_TARGET inline __m512 exp_minus(__m512 s, float m) {
  const __m512 shifted = _mm512_sub_ps(s, _mm512_set1_ps(m));
  f32x16 e;
  std::memcpy(&e, &shifted, sizeof(e));
  e = vexp(e);
  __m512 out;
  std::memcpy(&out, &e, sizeof(out));
  return out;
}

struct FastArgs {
  const AttnArgs* a;         // a->q is not used: the bf16 query below is
  const uint16_t* q;         // [T, H, D] bf16, unscaled
  const int64_t* run_start;  // [R + 1] token index where each run starts
  float scale;
};

// reduce16 puts the sum of v[order[i]] into lane i; order is found once by reducing vectors
// of distinct constants (lane i then holds 16 * value of the vector that landed there).
SE_F32_TARGET void find_reduce16_order(int* order) {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_set1_ps(static_cast<float>(i + 1) / 16.f);
  alignas(64) float r[16];
  _mm512_store_ps(r, reduce16(v));
  for (int i = 0; i < 16; ++i) order[i] = static_cast<int>(r[i] + 0.5f) - 1;  // lane i <- input
}

const int* reduce16_order() {
  static int order[16];
  static const bool done = (find_reduce16_order(order), true);
  (void)done;
  return order;
}

// slot_key[i]: the key whose dot product goes into reduce16's input i, so that lane j of the
// sum is key j's score (the inverse of reduce16_order).
const int* reduce16_slot_keys() {
  static int inv[16];
  static const bool done = [] {
    const int* order = reduce16_order();
    for (int o = 0; o < 16; ++o) inv[order[o]] = o;
    return true;
  }();
  (void)done;
  return inv;
}

// Scores of one query row (bf16 q, DCT 32-wide chunks) against 16 keys at element offsets
// kr[0..15] of kc: lane j is key j's dot product (lanes >= valid: a copy of a valid key's,
// for the caller to mask). Each key's sum runs over the chunks in order from zero, as the
// generic loop does; the 16 accumulators stay in registers (compile-time DCT) and reduce16
// adds them up without a per-key horizontal sum.
template <int DCT>
SE_ATTN_TARGET inline __m512 qk16_fixed(const uint16_t* q, const uint16_t* kc, const int64_t* kr,
                                        int valid, const int* slot_key) {
  __m512bh qv[DCT];
  for (int c = 0; c < DCT; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  __m512 dots[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const int o = std::min(slot_key[i], valid - 1);
    const uint16_t* k = kc + kr[o];
    __m512 s = _mm512_setzero_ps();
    for (int c = 0; c < DCT; ++c)
      s = _mm512_dpbf16_ps(s, qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
    dots[i] = s;
  }
  return reduce16(dots);
}

SE_ATTN_TARGET inline __m512 qk16(const uint16_t* q, const uint16_t* kc, const int64_t* kr,
                                  int valid, const int* slot_key, int64_t DC) {
  switch (DC) {
    case 1: return qk16_fixed<1>(q, kc, kr, valid, slot_key);
    case 2: return qk16_fixed<2>(q, kc, kr, valid, slot_key);
    case 3: return qk16_fixed<3>(q, kc, kr, valid, slot_key);
    case 4: return qk16_fixed<4>(q, kc, kr, valid, slot_key);
    case 5: return qk16_fixed<5>(q, kc, kr, valid, slot_key);
    case 6: return qk16_fixed<6>(q, kc, kr, valid, slot_key);
    case 7: return qk16_fixed<7>(q, kc, kr, valid, slot_key);
    default: return qk16_fixed<8>(q, kc, kr, valid, slot_key);  // DC <= kMaxD / 32 = 8
  }
}

// Scratch floats attend_fast needs for R rows and head_dim D.
int64_t fast_scratch_floats(int64_t R, int64_t D) {
  return R * D + 2 * R + R * kTileKeys + R * kTileKeys / 2 + 2 * (kTileKeys * D / 2) +
         4 * kTileKeys;
}

// V rows of `n` keys (element offsets `offs`) interleaved in pairs for VDPBF16PS:
// vi[kp][c][half] = unpack{lo,hi}(v[2kp][c], v[2kp+1][c]); a missing second key is zeros.
SE_ATTN_TARGET inline void interleave_v(const uint16_t* vc, const int64_t* offs, int64_t n,
                                        int64_t DC, uint16_t* vi) {
  for (int64_t kp = 0; kp < (n + 1) / 2; ++kp) {
    const int64_t o = 2 * kp;
    for (int64_t c = 0; c < DC; ++c) {
      const __m512i v0 = _mm512_loadu_si512(vc + offs[o] + 32 * c);
      const __m512i v1 = o + 1 < n ? _mm512_loadu_si512(vc + offs[o + 1] + 32 * c)
                                   : _mm512_setzero_si512();
      _mm512_storeu_si512(vi + ((kp * DC + c) * 2) * 32, _mm512_unpacklo_epi16(v0, v1));
      _mm512_storeu_si512(vi + ((kp * DC + c) * 2 + 1) * 32, _mm512_unpackhi_epi16(v0, v1));
    }
  }
}

// The bf16 K and V cache rows (D elements each) at element offsets offs[0..n) into L2. Paged
// blocks lie anywhere in memory, so the hardware prefetcher cannot see the next block coming;
// attend_fast asks for a whole tile's rows (256 keys) before it reads them, and they arrive
// while the first are used. B=64 x 300 keys x 30 layers on 2 Zen 4 cores: 38.4 -> 30.5 ms (into
// L1 instead, or a few keys ahead: no gain; the float32 and AVX2 paths, bound by their
// per-16-key softmax steps rather than by memory, gained nothing from it either).
SE_INLINE void prefetch_rows(const uint16_t* kc, const uint16_t* vc, const int64_t* offs,
                             int64_t n, int64_t D) {
  for (int64_t o = 0; o < n; ++o)
    for (int64_t b = 0; b < 2 * D; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kc + offs[o]) + b, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(vc + offs[o]) + b, _MM_HINT_T1);
    }
}

constexpr int64_t kPvRows = 4;  // rows sharing one V pair load in P @ V

// acc[r] += P[r] @ V for rows r0 .. r0 + NR - 1 over `np` key pairs of the interleaved V tile
// `vt`. Per row and 32-wide chunk c: even pairs into one accumulator set, odd pairs into a
// second (more independent chains), the last odd-count pair into the first, then their sum.
template <int NR>
SE_ATTN_TARGET inline void pv_rows(const uint16_t* pb, float* acc, int64_t r0, int64_t np,
                                   int64_t DC, int64_t D, const uint16_t* vt) {
  const int32_t* pairs[NR];
  for (int i = 0; i < NR; ++i) pairs[i] = reinterpret_cast<const int32_t*>(pb + (r0 + i) * kTileKeys);
  for (int64_t c = 0; c < DC; ++c) {
    __m512 lo0[NR], hi0[NR], lo1[NR], hi1[NR];
    for (int i = 0; i < NR; ++i) {
      float* ar = acc + (r0 + i) * D + 32 * c;
      lo0[i] = _mm512_loadu_ps(ar);
      hi0[i] = _mm512_loadu_ps(ar + 16);
      lo1[i] = _mm512_setzero_ps();
      hi1[i] = _mm512_setzero_ps();
    }
    int64_t kp = 0;
    for (; kp + 1 < np; kp += 2) {
      const uint16_t* v0 = vt + ((kp * DC + c) * 2) * 32;
      const uint16_t* v1 = vt + (((kp + 1) * DC + c) * 2) * 32;
      const __m512bh v0l = (__m512bh)_mm512_loadu_si512(v0);
      const __m512bh v0h = (__m512bh)_mm512_loadu_si512(v0 + 32);
      const __m512bh v1l = (__m512bh)_mm512_loadu_si512(v1);
      const __m512bh v1h = (__m512bh)_mm512_loadu_si512(v1 + 32);
      for (int i = 0; i < NR; ++i) {
        const __m512bh p0v = (__m512bh)_mm512_set1_epi32(pairs[i][kp]);
        const __m512bh p1v = (__m512bh)_mm512_set1_epi32(pairs[i][kp + 1]);
        lo0[i] = _mm512_dpbf16_ps(lo0[i], p0v, v0l);
        hi0[i] = _mm512_dpbf16_ps(hi0[i], p0v, v0h);
        lo1[i] = _mm512_dpbf16_ps(lo1[i], p1v, v1l);
        hi1[i] = _mm512_dpbf16_ps(hi1[i], p1v, v1h);
      }
    }
    if (kp < np) {
      const uint16_t* v0 = vt + ((kp * DC + c) * 2) * 32;
      const __m512bh v0l = (__m512bh)_mm512_loadu_si512(v0);
      const __m512bh v0h = (__m512bh)_mm512_loadu_si512(v0 + 32);
      for (int i = 0; i < NR; ++i) {
        const __m512bh p0v = (__m512bh)_mm512_set1_epi32(pairs[i][kp]);
        lo0[i] = _mm512_dpbf16_ps(lo0[i], p0v, v0l);
        hi0[i] = _mm512_dpbf16_ps(hi0[i], p0v, v0h);
      }
    }
    for (int i = 0; i < NR; ++i) {
      float* ar = acc + (r0 + i) * D + 32 * c;
      _mm512_storeu_ps(ar, _mm512_add_ps(lo0[i], lo1[i]));
      _mm512_storeu_ps(ar + 16, _mm512_add_ps(hi0[i], hi1[i]));
    }
  }
}

// Every query row attends to its visible keys as one compact sequence: the context positions
// [0, base) and then its visible tree positions in slot order. Tiles, 16-key score groups,
// V pairs and the softmax steps all follow indices into that sequence, never slot positions,
// so a row's result is bit for bit the same wherever its keys sit in the cache: a draft node
// off the first branch of a tree (its ancestors are not the slots right before it) gets
// exactly what decoding its path one token at a time gets.
SE_ATTN_TARGET void attend_fast(const FastArgs& f, int64_t item, float* scratch) {
  const AttnArgs& a = *f.a;
  const WorkItem w(a, f.run_start, item);
  const int64_t D = a.D, group = a.H / a.KVH, g = w.g, t0 = w.t0, nt = w.nt, R = nt * group;
  const int64_t DC = D / 32;  // 32-wide chunks of D
  const uint16_t *kc = w.kc, *vc = w.vc;
  // scratch: acc [R, D] f32 (d permuted, see the end), m [R], l [R], scores [R, kTileKeys] f32,
  // p [R, kTileKeys] bf16, vi and a private vi [kTileKeys / 2, DC, 2, 32] bf16, key offsets
  // and private key offsets [kTileKeys] int64
  float* acc = scratch;
  float* m = acc + R * D;
  float* l = m + R;
  float* sc = l + R;
  auto* pb = reinterpret_cast<uint16_t*>(sc + R * kTileKeys);
  auto* vi = pb + R * kTileKeys;
  auto* vi_own = vi + kTileKeys * D;
  auto* rows = reinterpret_cast<int64_t*>(vi_own + kTileKeys * D);
  int64_t* rows_own = rows + kTileKeys;
  const float ninf = -std::numeric_limits<float>::infinity();
  const RunKeys keys(a, t0, nt);
  std::fill(m, m + R, ninf);  // row r: token t0 + r / group, query head g * group + r % group
  std::fill(l, l + R, 0.f);
  std::fill(acc, acc + R * D, 0.f);
  const int* slot_key = reduce16_slot_keys();  // slot i of reduce16 holds key slot_key[i]
  const __m512 scale = _mm512_set1_ps(f.scale);
  for (int64_t p0 = 0; p0 < keys.n_max; p0 += kTileKeys) {
    const int64_t n = std::min<int64_t>(kTileKeys, keys.n_max - p0);
    w.slots(p0, n, rows);
    prefetch_rows(kc, vc, rows, n, D);
    interleave_v(vc, rows, n, DC, vi);
    for (int64_t tok = 0; tok < nt; ++tok) {
      const int64_t nk = std::min<int64_t>(n, keys.count[tok] - p0);  // this token's keys here
      if (nk <= 0) continue;
      const int64_t* kr = rows;
      const uint16_t* vt = vi;
      if (keys.gap[tok] && p0 + nk > keys.base[tok]) {  // its own compact keys for this tile
        for (int64_t o = 0; o < nk; ++o) {
          const int64_t k = p0 + o;
          rows_own[o] = k < keys.base[tok] ? rows[o] : w.slot(keys.tree_pos(tok, k));
        }
        interleave_v(vc, rows_own, nk, DC, vi_own);
        kr = rows_own;
        vt = vi_own;
      }
      const int64_t n16 = (nk + 15) / 16;
      const int64_t t = t0 + tok;
      for (int64_t h = 0; h < group; ++h) {
        const int64_t r = tok * group + h;
        const uint16_t* q = f.q + t * a.q_stride + (g * group + h) * D;
        float* sr = sc + r * kTileKeys;
        for (int64_t j = 0; j < n16; ++j) {
          const int64_t valid = std::min<int64_t>(16, nk - 16 * j);
          const __mmask16 vis = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
          const __m512 dots = qk16(q, kc, kr + 16 * j, static_cast<int>(valid), slot_key, DC);
          const __m512 sv = _mm512_mul_ps(dots, scale);
          _mm512_storeu_ps(sr + 16 * j, _mm512_mask_mov_ps(_mm512_set1_ps(ninf), vis, sv));
        }
      }
      // online softmax over the tile for each of the group's rows, then P @ V
      for (int64_t h = 0; h < group; ++h) {
        const int64_t r = tok * group + h;
        const float* sr = sc + r * kTileKeys;
        __m512 mx = _mm512_set1_ps(ninf);
        for (int64_t j = 0; j < n16; ++j) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sr + 16 * j));
        const float tmax = _mm512_reduce_max_ps(mx);
        const float mnew = std::max(m[r], tmax);
        float* ar = acc + r * D;
        if (m[r] != ninf && mnew != m[r]) {
          const float alpha = std::exp(m[r] - mnew);
          const __m512 av = _mm512_set1_ps(alpha);
          for (int64_t i = 0; i < D; i += 16)
            _mm512_storeu_ps(ar + i, _mm512_mul_ps(_mm512_loadu_ps(ar + i), av));
          l[r] *= alpha;
        }
        m[r] = mnew;
        uint16_t* pr = pb + r * kTileKeys;
        __m512 lsum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n16; ++j) {
          const __m512 s = _mm512_loadu_ps(sr + 16 * j);
          const __m512 pv = exp_minus(s, mnew);
          const __mmask16 seen = _mm512_cmp_ps_mask(s, _mm512_set1_ps(ninf), _CMP_NEQ_OQ);
          const __m256i p16 = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(seen, pv));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + 16 * j), p16);
          lsum = _mm512_add_ps(lsum, _mm512_castsi512_ps(
                                         _mm512_slli_epi32(_mm512_cvtepu16_epi32(p16), 16)));
        }
        l[r] += _mm512_reduce_add_ps(lsum);
      }
      // P @ V for the group's rows (same token: same keys and V pairs), up to kPvRows at a
      // time so each V pair is loaded once for them and their chains run side by side; each
      // row's sums are taken in exactly the order of one row alone (bit-identical results)
      const int64_t np = (nk + 1) / 2;
      for (int64_t h0 = 0; h0 < group; h0 += kPvRows) {
        const int64_t nr = std::min<int64_t>(kPvRows, group - h0);
        const int64_t r0 = tok * group + h0;
        switch (nr) {
          case 4: pv_rows<4>(pb, acc, r0, np, DC, D, vt); break;
          case 3: pv_rows<3>(pb, acc, r0, np, DC, D, vt); break;
          case 2: pv_rows<2>(pb, acc, r0, np, DC, D, vt); break;
          default: pv_rows<1>(pb, acc, r0, np, DC, D, vt); break;
        }
      }
    }
  }
  write_rows(a, acc, l, t0, R, group, g);
}

// ---- float32 caches, head_dim % 16 == 0 and <= 128: AVX-512F ------------------------------
// Work item = (run of query tokens of one sequence, KV head g), as the bf16 path; each token
// walks its visible keys (RunKeys: one compact sequence) in tiles of 16. Per tile and query
// head: the 16 scores from 16 in-register accumulators (each key's sum over the D/16 chunks in
// order, from the first chunk's product) added by reduce16 (no per-key horizontal sum), one
// online-softmax step over the tile (running max, exp, sum of the tile's 16 lanes), then
// P @ V with the head's accumulator in registers for the tile. Every step follows indices into
// the compact sequence, so a row's result depends only on its query and its visible keys: not
// on the rows it shares a call with, the block size, or where the keys sit in the cache.
constexpr int kF32MaxD = 128;
constexpr int kF32MaxGroup = 64;  // query heads per KV head (m, l on the stack)

bool has_avx512f_attn() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("fma");
  return ok;
}

// Element offsets of the cache rows of token tok's compact keys [k0, k0 + W): past the tile's
// valid keys, the last valid key's row again (read, then masked by the caller).
template <int W>
inline void tile_offsets(const RunKeys& keys, int64_t tok, int64_t k0, int valid,
                         const int32_t* table, int64_t BS, int64_t stride, int64_t* offs) {
  for (int o = 0; o < W; ++o) {
    const int64_t k = k0 + std::min(o, valid - 1);
    const int64_t pos = keys.gap[tok] && k >= keys.base[tok] ? keys.tree_pos(tok, k) : k;
    offs[o] = (static_cast<int64_t>(table[pos / BS]) * BS + pos % BS) * stride;
  }
}

// Token t's output rows for KV head g: each query head's acc / l (zeros when it saw nothing).
inline void write_token_rows(const AttnArgs& a, const float* acc, const float* l, int64_t t,
                             int64_t g, int64_t group) {
  float row[kMaxHeadDim];
  for (int64_t h = 0; h < group; ++h) {
    const int64_t at = (t * a.H + g * group + h) * a.D;
    float* out = a.out_bf16 ? row : a.out + at;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    for (int64_t i = 0; i < a.D; ++i) out[i] = acc[h * a.D + i] * inv;
    if (a.out_bf16) store_bf16(a.out_bf16 + at, row, a.D);
  }
}

template <int DC>
SE_F32_TARGET void attend_f32_fast(const AttnArgs& a, const int64_t* run_start, int64_t item,
                                   float* acc) {
  const int64_t KVH = a.KVH, D = a.D, group = a.H / KVH, g = item % KVH;
  const int64_t t0 = run_start[item / KVH], nt = run_start[item / KVH + 1] - t0;
  const float* kc = static_cast<const float*>(a.k_cache) + g * D;
  const float* vc = static_cast<const float*>(a.v_cache) + g * D;
  const int32_t* table = a.block_tables + static_cast<int64_t>(a.query_seq[t0]) * a.MB;
  const int64_t BS = a.BS, stride = KVH * D;
  const RunKeys keys(a, t0, nt);
  const int* slot_key = reduce16_slot_keys();
  const float ninf = -std::numeric_limits<float>::infinity();
  float m[kF32MaxGroup], l[kF32MaxGroup];
  alignas(64) float p[16];
  int64_t offs[16];
  for (int64_t tok = 0; tok < nt; ++tok) {
    const int64_t t = t0 + tok, n = keys.count[tok];
    std::fill(m, m + group, ninf);
    std::fill(l, l + group, 0.f);
    std::fill(acc, acc + group * D, 0.f);
    for (int64_t k0 = 0; k0 < n; k0 += 16) {
      const int valid = static_cast<int>(std::min<int64_t>(16, n - k0));
      tile_offsets<16>(keys, tok, k0, valid, table, BS, stride, offs);
      const __mmask16 vis = valid == 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
      for (int64_t h = 0; h < group; ++h) {
        const float* q = a.q + (t * a.H + g * group + h) * D;  // scaled
        __m512 qv[DC];
        for (int c = 0; c < DC; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
        __m512 dots[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          const float* kr = kc + offs[slot_key[i]];
          __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
          for (int c = 1; c < DC; ++c) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), s);
          dots[i] = s;
        }
        const __m512 sv = _mm512_mask_mov_ps(_mm512_set1_ps(ninf), vis, reduce16(dots));
        const float mnew = std::max(m[h], _mm512_reduce_max_ps(sv));
        float* ar = acc + h * D;
        __m512 av[DC];
        for (int c = 0; c < DC; ++c) av[c] = _mm512_loadu_ps(ar + 16 * c);
        if (m[h] != ninf && mnew != m[h]) {
          const float alpha = std::exp(m[h] - mnew);
          for (int c = 0; c < DC; ++c) av[c] = _mm512_mul_ps(av[c], _mm512_set1_ps(alpha));
          l[h] *= alpha;
        }
        m[h] = mnew;
        const __m512 pv = _mm512_maskz_mov_ps(vis, exp_minus(sv, mnew));
        l[h] += _mm512_reduce_add_ps(pv);
        _mm512_store_ps(p, pv);
        for (int o = 0; o < valid; ++o) {
          const __m512 po = _mm512_set1_ps(p[o]);
          const float* vr = vc + offs[o];
          for (int c = 0; c < DC; ++c) av[c] = _mm512_fmadd_ps(po, _mm512_loadu_ps(vr + 16 * c), av[c]);
        }
        for (int c = 0; c < DC; ++c) _mm512_storeu_ps(ar + 16 * c, av[c]);
      }
    }
    write_token_rows(a, acc, l, t, g, group);
  }
}

using F32Item = void (*)(const AttnArgs&, const int64_t*, int64_t, float*);

F32Item f32_item(int64_t D) {
  switch (D / 16) {
    case 1: return attend_f32_fast<1>;
    case 2: return attend_f32_fast<2>;
    case 3: return attend_f32_fast<3>;
    case 4: return attend_f32_fast<4>;
    case 5: return attend_f32_fast<5>;
    case 6: return attend_f32_fast<6>;
    case 7: return attend_f32_fast<7>;
    default: return attend_f32_fast<8>;  // D <= kF32MaxD = 128
  }
}

// ---- float32 or bf16 caches, head_dim % 8 == 0 and <= 128: AVX2 + FMA ----------------------
// The AVX-512F path's scheme in 8-wide vectors, for CPUs without AVX-512 (and bf16 caches
// there, which otherwise take the portable loop): per 8-key tile and query head, 8 in-register
// dot products (each key's sum over the D/8 chunks in order, from the first chunk's product;
// bf16 keys widened by shifting) added by reduce8 (a fixed hadd tree, lane j = key j), one
// online-softmax step over the tile, then P @ V with the head's accumulator in registers.
// Steps follow indices into the compact key sequence (RunKeys): a row's result depends only on
// its query and its visible keys.
#define SE_AVX2_ATTN_TARGET __attribute__((target("avx2,fma")))

bool has_avx2_attn() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

// 8 consecutive cache elements as float32.
SE_AVX2_ATTN_TARGET inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
SE_AVX2_ATTN_TARGET inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// r[j] = sum of the 8 lanes of v[j]: ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)).
SE_AVX2_ATTN_TARGET inline __m256 reduce8(const __m256 (&v)[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// exp(s - m) per lane with the portable vexp (vec.h), the upper 8 lanes unused.
SE_AVX2_ATTN_TARGET inline __m256 exp_minus8(__m256 s, float m) {
  const __m256 shifted = _mm256_sub_ps(s, _mm256_set1_ps(m));
  f32x16 e{};
  std::memcpy(&e, &shifted, sizeof(shifted));
  e = vexp(e);
  __m256 out;
  std::memcpy(&out, &e, sizeof(out));
  return out;
}

SE_AVX2_ATTN_TARGET inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

SE_AVX2_ATTN_TARGET inline float hmax8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

template <class KT, int DC>
SE_AVX2_ATTN_TARGET void attend_avx2(const AttnArgs& a, const int64_t* run_start, int64_t item,
                                     float* acc) {
  const int64_t KVH = a.KVH, D = a.D, group = a.H / KVH, g = item % KVH;
  const int64_t t0 = run_start[item / KVH], nt = run_start[item / KVH + 1] - t0;
  const KT* kc = static_cast<const KT*>(a.k_cache) + g * D;
  const KT* vc = static_cast<const KT*>(a.v_cache) + g * D;
  const int32_t* table = a.block_tables + static_cast<int64_t>(a.query_seq[t0]) * a.MB;
  const int64_t BS = a.BS, stride = KVH * D;
  const RunKeys keys(a, t0, nt);
  const float ninf = -std::numeric_limits<float>::infinity();
  float m[kF32MaxGroup], l[kF32MaxGroup];
  alignas(32) float p[8];
  int64_t offs[8];
  for (int64_t tok = 0; tok < nt; ++tok) {
    const int64_t t = t0 + tok, n = keys.count[tok];
    std::fill(m, m + group, ninf);
    std::fill(l, l + group, 0.f);
    std::fill(acc, acc + group * D, 0.f);
    for (int64_t k0 = 0; k0 < n; k0 += 8) {
      const int valid = static_cast<int>(std::min<int64_t>(8, n - k0));
      tile_offsets<8>(keys, tok, k0, valid, table, BS, stride, offs);
      const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256 vis = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(valid)),
                                       _CMP_LT_OQ);
      for (int64_t h = 0; h < group; ++h) {
        const float* q = a.q + (t * a.H + g * group + h) * D;  // scaled
        __m256 dots[8];
        {
          const __m256 qc = _mm256_loadu_ps(q);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i) dots[i] = _mm256_mul_ps(qc, load8(kc + offs[i]));
        }
        for (int c = 1; c < DC; ++c) {
          const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
          for (int i = 0; i < 8; ++i)
            dots[i] = _mm256_fmadd_ps(qc, load8(kc + offs[i] + 8 * c), dots[i]);
        }
        const __m256 sv = _mm256_blendv_ps(_mm256_set1_ps(ninf), reduce8(dots), vis);
        const float mnew = std::max(m[h], hmax8(sv));
        float* ar = acc + h * D;
        __m256 av[DC];
        for (int c = 0; c < DC; ++c) av[c] = _mm256_loadu_ps(ar + 8 * c);
        if (m[h] != ninf && mnew != m[h]) {
          const float alpha = std::exp(m[h] - mnew);
          for (int c = 0; c < DC; ++c) av[c] = _mm256_mul_ps(av[c], _mm256_set1_ps(alpha));
          l[h] *= alpha;
        }
        m[h] = mnew;
        const __m256 pv = _mm256_and_ps(vis, exp_minus8(sv, mnew));
        l[h] += hsum8(pv);
        _mm256_store_ps(p, pv);
        for (int o = 0; o < valid; ++o) {
          const __m256 po = _mm256_set1_ps(p[o]);
          const KT* vr = vc + offs[o];
          for (int c = 0; c < DC; ++c) av[c] = _mm256_fmadd_ps(po, load8(vr + 8 * c), av[c]);
        }
        for (int c = 0; c < DC; ++c) _mm256_storeu_ps(ar + 8 * c, av[c]);
      }
    }
    write_token_rows(a, acc, l, t, g, group);
  }
}

template <class KT>
F32Item avx2_item(int64_t D) {
  switch (D / 8) {
    case 1: return attend_avx2<KT, 1>;
    case 2: return attend_avx2<KT, 2>;
    case 3: return attend_avx2<KT, 3>;
    case 4: return attend_avx2<KT, 4>;
    case 5: return attend_avx2<KT, 5>;
    case 6: return attend_avx2<KT, 6>;
    case 7: return attend_avx2<KT, 7>;
    case 8: return attend_avx2<KT, 8>;
    case 9: return attend_avx2<KT, 9>;
    case 10: return attend_avx2<KT, 10>;
    case 11: return attend_avx2<KT, 11>;
    case 12: return attend_avx2<KT, 12>;
    case 13: return attend_avx2<KT, 13>;
    case 14: return attend_avx2<KT, 14>;
    case 15: return attend_avx2<KT, 15>;
    default: return attend_avx2<KT, 16>;  // D <= kF32MaxD = 128
  }
}

// fn over every work item (a run of query tokens, KV head) of the call, in parallel.
void run_items(const AttnArgs& a, F32Item fn) {
  const std::vector<int64_t> runs = query_runs(a);
  const int64_t group = a.H / a.KVH;
  parallel_ranges((static_cast<int64_t>(runs.size()) - 1) * a.KVH, 1, 4,
                  [&](int64_t begin, int64_t end) {
                    std::vector<float> acc(group * a.D);
                    for (int64_t item = begin; item < end; ++item)
                      fn(a, runs.data(), item, acc.data());
                  });
}
#endif

}  // namespace

bool paged_attention_f32_fast_available(int64_t D, int64_t group) {
#if defined(__x86_64__) && defined(__GNUC__)
  return D % 16 == 0 && D <= kF32MaxD && group <= kF32MaxGroup && has_avx512f_attn() &&
         isa_cap() >= kIsaAvx512;
#else
  (void)D;
  (void)group;
  return false;
#endif
}

void paged_attention_f32_fast(const AttnArgs& a) {
#if defined(__x86_64__) && defined(__GNUC__)
  run_items(a, f32_item(a.D));
#else
  (void)a;
#endif
}

bool paged_attention_avx2_available(int64_t D, int64_t group) {
#if defined(__x86_64__) && defined(__GNUC__)
  return D % 8 == 0 && D <= kF32MaxD && group <= kF32MaxGroup && has_avx2_attn() &&
         isa_cap() >= kIsaAvx2;
#else
  (void)D;
  (void)group;
  return false;
#endif
}

void paged_attention_avx2(const AttnArgs& a, bool bf16_cache) {
#if defined(__x86_64__) && defined(__GNUC__)
  run_items(a, bf16_cache ? avx2_item<c10::BFloat16>(a.D) : avx2_item<float>(a.D));
#else
  (void)a;
  (void)bf16_cache;
#endif
}

bool paged_attention_fast_available(int64_t D) {
#if defined(__x86_64__) && defined(__GNUC__)
  return D % 32 == 0 && D <= kMaxD && has_avx512_bf16_attn() && isa_cap() >= kIsaAvx512;
#else
  (void)D;
  return false;
#endif
}

void paged_attention_bf16_fast(const AttnArgs& a, const uint16_t* q_bf16, float scale) {
#if defined(__x86_64__) && defined(__GNUC__)
  const int64_t KVH = a.KVH, D = a.D, group = a.H / a.KVH;
  const std::vector<int64_t> runs = query_runs(a);
  const int64_t R = kRunTokens * group;
  const int64_t floats = fast_scratch_floats(R, D);
  FastArgs f{&a, q_bf16, runs.data(), scale};
  parallel_ranges((static_cast<int64_t>(runs.size()) - 1) * KVH, 1, 4,
                  [&](int64_t begin, int64_t end) {
                    std::vector<float> scratch(floats + 16);
                    for (int64_t item = begin; item < end; ++item)
                      attend_fast(f, item, scratch.data());
                  });
#else
  (void)a;
  (void)q_bf16;
  (void)scale;
#endif
}

void paged_attention_generic(const AttnArgs& a, bool bf16_cache) {
  const int64_t group = a.H / a.KVH;
  parallel_ranges(a.T * a.KVH, 1, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(group * (a.D + kGenericStep + 16 + 2));
    if (!bf16_cache)
      attend_f32(a, begin, end, scratch.data());
    else
      attend_bf16(a, begin, end, scratch.data());
  });
}

}  // namespace specengine
