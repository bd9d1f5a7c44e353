// Sampling noise: E ~ Exp(1) per (stream key, output position, token), counter-based.
//
// Element (p, i) of a call is E = -log(1 - v), v = min(float(h | 1) / 2^64, 1 - 2^-24), with
//   h = mix64(row + 0x9e3779b97f4a7c15 * (i + 1)),  row = mix64(key + 0xd1b54a32d192ed03 * (pos + 1))
// where mix64 is SplitMix64's finalizer (Steele, Lea & Flood 2014, "Fast splittable
// pseudorandom number generators"). v keeps 24 significant bits however small it is, and
// -log(1 - v) is evaluated as log1p (Goldberg's correction), so E has float32 relative precision
// down to 2^-64: the exponential race picks the argmax of p / E, which small E decide. No state: any (key, position) row can be produced alone, in
// any order, on any thread, and is the same every time; specengine/sampling.py holds the same
// formula in torch (the reference, and the path without the extension). About 40x faster than
// torch's exponential_ with a seeded generator (0.7 ms for 49k tokens on one core).
// exponential_noise_rows_kernel draws rows of many keys (all the sampled rows of a step) in one
// call; exponential_race_kernel draws the tokens argmax(p / E) of many rows without the noise in
// memory; coupled_topk_kernel ranks a drafter's children by its noise-perturbed log-probabilities
// (speculative/drafters/coupling.py) without the noise in memory; softmax_rows_kernel gives the
// probabilities the race reads, rows and chunks of rows on the kernel pool. The tensor checks
// are in ops.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "kernels.h"
#include "pool.h"
#include "vec.h"

namespace specengine {
namespace {

constexpr uint64_t kRowMul = 0xd1b54a32d192ed03ULL;
constexpr uint64_t kColMul = 0x9e3779b97f4a7c15ULL;

SE_INLINE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

typedef uint64_t u64x8 __attribute__((vector_size(64)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef float f32x8v __attribute__((vector_size(32)));

SE_INLINE u64x8 vmix64(u64x8 z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// -log(u) for normal u > 0 (the noise needs (0, 1]; coupled_topk also takes log E), on 8 or 16
// lanes (F float and I int32 vectors of one length): natural log by exponent / mantissa split
// and the Cephes logf polynomial (~1 ulp), written with portable vectors so every ISA clone
// computes it alike.
template <typename F, typename I>
SE_INLINE F neg_log_t(F x) {
  I bits;
  std::memcpy(&bits, &x, sizeof(bits));
  I e = ((bits >> 23) & 0xff) - 126;
  I mb = (bits & 0x7fffff) | 0x3f000000;  // mantissa in [0.5, 1)
  F m;
  std::memcpy(&m, &mb, sizeof(m));
  const auto small = m < 0.707106781186547524f;
  e = small ? e - 1 : e;
  m = small ? m + m - 1.f : m - 1.f;
  const F z = m * m;
  F y = F{} + 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  const F ef = __builtin_convertvector(e, F);
  y = y * m * z;
  y = y + ef * -2.12194440e-4f;
  y = y - 0.5f * z;
  const F r = m + y + ef * 0.693359375f;
  return -r;
}

SE_INLINE f32x8v neg_log(f32x8v x) { return neg_log_t<f32x8v, i32x8>(x); }

// Exp(1) noise from the uniform v behind it (v as exp_noise computes it from the hash).
template <typename F, typename I>
SE_INLINE F exp_noise_of(F v) {
  const F w = 1.f - v;
  const F big = neg_log_t<F, I>(w) * (v / (1.f - w));  // -log1p(-v), Goldberg's correction
  return w == 1.f ? v : big;
}

SE_INLINE f32x8v uniform_of(u64x8 h) {
  const f32x8v v0 = __builtin_convertvector(h | 1, f32x8v) * 5.42101086242752217e-20f;  // 2^-64
  return v0 < 0.99999994f ? v0 : f32x8v{} + 0.99999994f;
}

SE_INLINE f32x8v exp_noise(u64x8 h) { return exp_noise_of<f32x8v, i32x8>(uniform_of(h)); }

SE_CLONES void noise_row(uint64_t row, float* out, int64_t V) {
  const u64x8 lane = {1, 2, 3, 4, 5, 6, 7, 8};
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const f32x8v e = exp_noise(vmix64(row + kColMul * (lane + static_cast<uint64_t>(i))));
    std::memcpy(out + i, &e, sizeof(e));
  }
  if (i < V) {  // the tail, from a full vector of counters
    const f32x8v e = exp_noise(vmix64(row + kColMul * (lane + static_cast<uint64_t>(i))));
    std::memcpy(out + i, &e, (V - i) * sizeof(float));
  }
}

#define SE_INLINE_LAMBDA __attribute__((always_inline))

SE_INLINE bool all_set(i32x8 m) {
  uint64_t a[4];
  std::memcpy(a, &m, sizeof(a));
  return (a[0] & a[1] & a[2] & a[3]) == ~0ULL;
}

// (a, ia) beats (b, ib) in an argmax that, like torch.argmax, takes NaN as the largest value
// and the first index among equals.
SE_INLINE bool beats(float a, int64_t ia, float b, int64_t ib) {
  if (a != a) return b == b || ia < ib;
  if (b != b) return false;
  return a > b || (a == b && ia < ib);
}

// The exponential race over tokens [0, n) of a chunk: the largest p[i] / E[i] (E the noise of
// stream `row`, shifted to the chunk as in noise_row) and the first index holding it, with the
// same float32 quotients as dividing by noise_row's output. With b the best quotient so far (of
// an earlier token), a token with p <= v * b / 2 (v the uniform behind E, E >= v) has a quotient
// below b, so when all tokens of a block of 32 are such, it skips the logarithm and the
// division: the result is that of computing every quotient. (b >= 2^-80 keeps v * b / 2 from
// underflowing into a bound that is not one; below it only p = 0 skips, whose quotient 0 cannot
// beat b >= 0. A NaN p never skips.) The hash of the noise is the floor of this loop; testing a
// block of 32 at once rather than each 8 took it from 1.26 to 0.97 ns per token on one core of
// an Intel Xeon with AVX-512 (the hash alone: 0.62). kScaled: p[i] * scale are the
// probabilities (the product softmax_scale_chunk writes), so a softmax's last pass is the race's.
template <bool kScaled>
SE_INLINE void race_chunk_t(uint64_t row, const float* p, int64_t n, float scale, float* best_out,
                            int64_t* index_out) {
  const u64x8 lane = {1, 2, 3, 4, 5, 6, 7, 8};
  const i32x8 lane_index = {0, 1, 2, 3, 4, 5, 6, 7};
  const i32x8 every = lane_index >= 0;
  const f32x8v inf = f32x8v{} + __builtin_inff();
  f32x8v best = -inf, bound = -inf;
  i32x8 best_index = {};
  // row + kColMul * (lane + i) for the tokens of the step: advanced by an addition (the same
  // values mod 2^64 as the products; one 64-bit multiply in three fewer per vector)
  u64x8 counter = row + kColMul * lane;
  const u64x8 stride = u64x8{} + kColMul * 8;
  // the exact step of 8 tokens from i (v their uniforms, lanes outside valid take no part)
  auto step = [&](int64_t i, f32x8v pv, f32x8v v, i32x8 valid) SE_INLINE_LAMBDA {
    if (all_set((pv <= v * bound) | ~valid)) return;
    const f32x8v q = pv / exp_noise_of<f32x8v, i32x8>(v);
    const i32x8 take = ((q > best) | ((q != q) & (best == best))) & valid;
    best = take ? q : best;
    best_index = take ? lane_index + static_cast<int32_t>(i) : best_index;
    float top = -__builtin_inff();  // the best quotient so far over all lanes (NaN aside)
    for (int l = 0; l < 8; ++l) top = best[l] > top ? best[l] : top;
    bound = f32x8v{} + (top >= 0x1p-80f ? top * 0.5f : (top >= 0.f ? 0.f : -__builtin_inff()));
  };
  const auto load = [&](int64_t at) SE_INLINE_LAMBDA {
    f32x8v v;
    std::memcpy(&v, p + at, sizeof(v));
    return kScaled ? v * scale : v;
  };
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const f32x8v p0 = load(i), p1 = load(i + 8), p2 = load(i + 16), p3 = load(i + 24);
    const f32x8v v0 = uniform_of(vmix64(counter));
    const f32x8v v1 = uniform_of(vmix64(counter + stride));
    const f32x8v v2 = uniform_of(vmix64(counter + stride * 2));
    const f32x8v v3 = uniform_of(vmix64(counter + stride * 3));
    counter += stride * 4;
    i32x8 skip = (p0 <= v0 * bound) & (p1 <= v1 * bound) & (p2 <= v2 * bound) &
                 (p3 <= v3 * bound);
    skip &= __builtin_shufflevector(skip, skip, 4, 5, 6, 7, 0, 1, 2, 3);
    skip &= __builtin_shufflevector(skip, skip, 2, 3, 0, 1, 6, 7, 4, 5);
    skip &= __builtin_shufflevector(skip, skip, 1, 0, 3, 2, 5, 4, 7, 6);
    if (skip[0]) continue;
    step(i, p0, v0, every);
    step(i + 8, p1, v1, every);
    step(i + 16, p2, v2, every);
    step(i + 24, p3, v3, every);
  }
  for (; i + 8 <= n; i += 8) {
    step(i, load(i), uniform_of(vmix64(counter)), every);
    counter += stride;
  }
  if (i < n) {  // the tail: lanes past n take part in nothing
    f32x8v pv = {};
    std::memcpy(&pv, p + i, (n - i) * sizeof(float));
    step(i, kScaled ? pv * scale : pv, uniform_of(vmix64(counter)),
         lane_index < static_cast<int32_t>(n - i));
  }
  float b = best[0];
  int64_t bi = best_index[0];
  for (int l = 1; l < 8; ++l) {
    if (beats(best[l], best_index[l], b, bi)) b = best[l], bi = best_index[l];
  }
  *best_out = b;
  *index_out = bi;
}

SE_CLONES void race_chunk(uint64_t row, const float* p, int64_t n, float* best_out,
                          int64_t* index_out) {
  race_chunk_t<false>(row, p, n, 1.f, best_out, index_out);
}

SE_CLONES void race_chunk_scaled(uint64_t row, const float* e, int64_t n, float scale,
                                 float* best_out, int64_t* index_out) {
  race_chunk_t<true>(row, e, n, scale, best_out, index_out);
}

// log E_i for i in [0, Vd): the noise of stream `row` at the token whose column offset is
// cols[i] (kColMul * (token + 1), column_offsets), 16 tokens at a time (exp_noise's steps on 16
// lanes); cols holds Vd rounded up to 16 entries.
SE_CLONES void log_noise_row(uint64_t row, const uint64_t* cols, int64_t Vd, float* out) {
  const auto block = [&](int64_t i) SE_INLINE_LAMBDA {
    u64x8 lo, hi;
    std::memcpy(&lo, cols + i, sizeof(lo));
    std::memcpy(&hi, cols + i + 8, sizeof(hi));
    const f32x8v a = uniform_of(vmix64(row + lo));
    const f32x8v b = uniform_of(vmix64(row + hi));
    const f32x16 v = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                             14, 15);
    return -neg_log_t<f32x16, i32x16>(exp_noise_of<f32x16, i32x16>(v));
  };
  int64_t i = 0;
  for (; i + 32 <= Vd; i += 32) {  // two independent blocks: their polynomials overlap
    const f32x16 e0 = block(i), e1 = block(i + 16);
    store16(out + i, e0);
    store16(out + i + 16, e1);
  }
  for (; i + 16 <= Vd; i += 16) store16(out + i, block(i));
  if (i < Vd) {  // cols is padded to a multiple of 16
    const f32x16 e = block(i);
    std::memcpy(out + i, &e, (Vd - i) * sizeof(float));
  }
}

// kColMul * (token + 1) of each of the Vd tokens (token map[i], or i without a map), padded
// with zeros to a multiple of 16: the products log_noise_row adds to a row's hash, once per call
// rather than per row.
std::vector<uint64_t> column_offsets(const int64_t* map, int64_t Vd) {
  std::vector<uint64_t> cols((Vd + 15) / 16 * 16, 0);
  for (int64_t i = 0; i < Vd; ++i)
    cols[i] = kColMul * (static_cast<uint64_t>(map != nullptr ? map[i] : i) + 1);
  return cols;
}

// The largest of p[0, n) (n >= 1) and the first index holding it, a NaN counting as the
// largest (the first NaN): torch.argmax's rule. Each of 16 lanes keeps its own first maximum
// (a later value replaces it only when strictly larger), the lanes are merged with `beats`;
// a NaN seen in the vectors sends the chunk to a scalar scan for the first one.
SE_CLONES void argmax_chunk(const float* p, int64_t n, float* best_out, int64_t* index_out) {
  int64_t i = 0;
  float top = p[0];
  int64_t at = 0;
  if (n >= 16) {
    const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    f32x16 best = load16(p);
    i32x16 best_index = lane, nan = best != best;
    for (i = 16; i + 16 <= n; i += 16) {
      const f32x16 v = load16(p + i);
      nan |= v != v;
      const i32x16 take = v > best;
      best = take ? v : best;
      best_index = take ? lane + static_cast<int32_t>(i) : best_index;
    }
    bool any_nan = false;
    for (int l = 0; l < 16; ++l) any_nan |= nan[l] != 0;
    if (any_nan) {
      for (int64_t j = 0;; ++j) {
        if (p[j] != p[j]) {
          *best_out = p[j], *index_out = j;
          return;
        }
      }
    }
    top = best[0], at = best_index[0];
    for (int l = 1; l < 16; ++l) {
      if (beats(best[l], best_index[l], top, at)) top = best[l], at = best_index[l];
    }
  }
  for (; i < n; ++i) {
    if (p[i] != p[i]) {
      *best_out = p[i], *index_out = i;
      return;
    }
    if (beats(p[i], i, top, at)) top = p[i], at = i;
  }
  *best_out = top, *index_out = at;
}

// One row of coupled_topk_kernel: z_i = logits[i] (log_e null: greedy) or logits[i] / t -
// log_e[i]; then the k largest z_i - lse(z) (ties: the lower index first; NaN never taken),
// written to values / indices (-inf / 0 when the row has fewer than k finite entries). z is
// scratch of Vd floats (unused when greedy: z is the logits). Two passes over the row: z and
// its maximum, then the sum of exp(z - max) with the top-k insertions in the same loop (the
// sum's lanes and order, so its value, as in three passes).
SE_CLONES void coupled_topk_row(const float* logits, int64_t Vd, float t, const float* log_e,
                                int64_t k, float* z, float* values, int64_t* indices) {
  const float inf = __builtin_inff();
  f32x16 mx = f32x16{} - inf;
  int64_t i = 0;
  if (log_e == nullptr) {
    z = const_cast<float*>(logits);  // read only below
    for (; i + 16 <= Vd; i += 16) {
      const f32x16 v = load16(z + i);
      mx = v > mx ? v : mx;
    }
  } else {
    const f32x16 tv = f32x16{} + t;
    for (; i + 16 <= Vd; i += 16) {
      const f32x16 v = load16(logits + i) / tv - load16(log_e + i);
      store16(z + i, v);
      mx = v > mx ? v : mx;
    }
    for (int64_t j = i; j < Vd; ++j) z[j] = logits[j] / t - log_e[j];
  }
  float m = -inf;
  for (int l = 0; l < 16; ++l) m = mx[l] > m ? mx[l] : m;
  for (; i < Vd; ++i) m = z[i] > m ? z[i] : m;
  for (int64_t j = 0; j < k; ++j) values[j] = -inf, indices[j] = 0;
  if (!(m > -inf)) return;  // nothing finite (or only NaN)
  // top-k by insertion into values (descending), skipping the lanes of a vector when none beats
  // the k-th best so far
  auto insert = [&](int64_t at, int64_t n) {
    for (int64_t l = 0; l < n; ++l) {
      const float v = z[at + l];
      if (!(v > values[k - 1])) continue;
      int64_t j = k - 1;
      for (; j > 0 && v > values[j - 1]; --j) {
        values[j] = values[j - 1], indices[j] = indices[j - 1];
      }
      values[j] = v, indices[j] = at + l;
    }
  };
  f32x16 acc = {};
  const f32x16 mv = f32x16{} + m;
  for (i = 0; i + 16 <= Vd; i += 16) {
    const f32x16 v = load16(z + i);
    const f32x16 d = v - mv;
    acc += d > -87.f ? vexp(d) : f32x16{};
    const auto beat = v > (f32x16{} + values[k - 1]);
    bool any = false;
    for (int l = 0; l < 16; ++l) any |= beat[l] != 0;
    if (any) insert(i, 16);
  }
  float sum = hsum(acc);
  for (int64_t j = i; j < Vd; ++j) sum += z[j] - m > -87.f ? std::exp(z[j] - m) : 0.f;
  insert(i, Vd - i);
  const float lse = m + std::log(sum);
  for (int64_t j = 0; j < k; ++j) values[j] -= lse;
}

}  // namespace

void exponential_noise_rows_kernel(const int64_t* keys, int64_t key_step,
                                   const int64_t* positions, int64_t P, int64_t vocab,
                                   float* out) {
  const int64_t chunk = 8192;  // tokens per task
  const int64_t per_row = (vocab + chunk - 1) / chunk;
  parallel_chunks(P * per_row, [&](int64_t c) {
    const int64_t r = c / per_row, i0 = (c % per_row) * chunk;
    const uint64_t k = static_cast<uint64_t>(keys[r * key_step]);
    const uint64_t row = mix64(k + kRowMul * (static_cast<uint64_t>(positions[r]) + 1));
    // the row's stream is indexed from token 0: shift the counter by i0
    const int64_t n = std::min(chunk, vocab - i0);
    noise_row(row + kColMul * static_cast<uint64_t>(i0), out + r * vocab + i0, n);
  });
}

void exponential_noise_kernel(int64_t key, const int64_t* positions, int64_t P, int64_t vocab,
                              float* out) {
  exponential_noise_rows_kernel(&key, 0, positions, P, vocab, out);
}

void exponential_race_kernel(const float* probs, const int64_t* keys, const int64_t* positions,
                             int64_t S, int64_t V, int64_t* out) {
  const int64_t chunk = 8192;  // tokens per task
  const int64_t per_row = (V + chunk - 1) / chunk;
  std::vector<float> best(S * per_row);
  std::vector<int64_t> index(S * per_row);
  parallel_chunks(S * per_row, [&](int64_t c) {
    const int64_t r = c / per_row, i0 = (c % per_row) * chunk;
    const uint64_t row = mix64(static_cast<uint64_t>(keys[r]) +
                               kRowMul * (static_cast<uint64_t>(positions[r]) + 1));
    race_chunk(row + kColMul * static_cast<uint64_t>(i0), probs + r * V + i0,
               std::min(chunk, V - i0), &best[c], &index[c]);
    index[c] += i0;
  });
  for (int64_t r = 0; r < S; ++r) {
    int64_t c = r * per_row;
    for (int64_t j = c + 1; j < (r + 1) * per_row; ++j) {
      if (beats(best[j], index[j], best[c], index[c])) c = j;
    }
    out[r] = index[c];
  }
}

void argmax_rows_kernel(const float* x, int64_t R, int64_t V, int64_t* out) {
  const int64_t chunk = 16384;  // values per task
  const int64_t per_row = (V + chunk - 1) / chunk;
  std::vector<float> best(R * per_row);
  std::vector<int64_t> index(R * per_row);
  const auto task = [&](int64_t c) {
    const int64_t r = c / per_row, i0 = (c % per_row) * chunk;
    argmax_chunk(x + r * V + i0, std::min(chunk, V - i0), &best[c], &index[c]);
    index[c] += i0;
  };
  if (R * V <= (int64_t{1} << 17)) {  // a few microseconds: waking a helper costs more
    for (int64_t c = 0; c < R * per_row; ++c) task(c);
  } else {
    parallel_chunks(R * per_row, task);
  }
  for (int64_t r = 0; r < R; ++r) {
    int64_t c = r * per_row;
    for (int64_t j = c + 1; j < (r + 1) * per_row; ++j) {
      if (beats(best[j], index[j], best[c], index[c])) c = j;
    }
    out[r] = index[c];
  }
}

// softmax_rows_kernel's three passes over one chunk of a row (n values from p): the largest
// value (NaN if any), then e = exp(x - m) stored with the chunk's sum (16 lanes in order, then
// hsum), then e scaled by the row's 1 / S. exp of x - m < -87.3 is 0 (vexp would clamp it to
// ~1e-38; a probability that small never wins a race), so a -inf logit gets probability 0.
SE_CLONES float softmax_max_chunk(const float* p, int64_t n) {
  f32x16 m = splat(-__builtin_inff()), nan = splat(0.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 v = load16(p + i);
    nan = v != v ? splat(1.f) : nan;
    m = v > m ? v : m;
  }
  float top = -__builtin_inff();
  bool any_nan = false;
  for (int l = 0; l < 16; ++l) top = m[l] > top ? m[l] : top, any_nan |= nan[l] != 0.f;
  for (; i < n; ++i) top = p[i] > top ? p[i] : top, any_nan |= p[i] != p[i];
  return any_nan ? __builtin_nanf("") : top;
}

SE_INLINE f32x16 softmax_exp(f32x16 d) {
  const f32x16 e = vexp(d);
  return d < splat(-87.3f) ? splat(0.f) : e;
}

SE_CLONES float softmax_exp_chunk(const float* p, int64_t n, float m, float* out) {
  f32x16 acc = splat(0.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 e = softmax_exp(load16(p + i) - m);
    std::memcpy(out + i, &e, sizeof(e));
    acc += e;
  }
  if (i < n) {  // the tail as one vector: lanes past n are 0
    f32x16 v = splat(-__builtin_inff());
    std::memcpy(&v, p + i, (n - i) * sizeof(float));
    const f32x16 e = softmax_exp(v - m);
    std::memcpy(out + i, &e, (n - i) * sizeof(float));
    acc += e;
  }
  return hsum(acc);
}

SE_CLONES void softmax_scale_chunk(float* out, int64_t n, float c) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const f32x16 v = load16(out + i) * c;
    std::memcpy(out + i, &v, sizeof(v));
  }
  for (; i < n; ++i) out[i] *= c;
}

void softmax_rows_kernel(const float* x, int64_t R, int64_t V, float* out) {
  const int64_t chunk = 8192;  // values per task; also the fixed order of the row's sum
  const int64_t per_row = (V + chunk - 1) / chunk, tasks = R * per_row;
  std::vector<float> part(tasks), top(R), scale(R);
  const bool serial = R * V <= (int64_t{1} << 16);  // a few microseconds: no helper wakes
  const auto run = [&](auto&& task) {
    if (serial) {
      for (int64_t c = 0; c < tasks; ++c) task(c);
    } else {
      parallel_chunks(tasks, task);
    }
  };
  const auto span = [&](int64_t c) {
    const int64_t r = c / per_row, i0 = (c % per_row) * chunk;
    return std::make_pair(r * V + i0, std::min(chunk, V - i0));
  };
  run([&](int64_t c) {
    const auto [at, n] = span(c);
    part[c] = softmax_max_chunk(x + at, n);
  });
  for (int64_t r = 0; r < R; ++r) {
    float m = -__builtin_inff();
    for (int64_t j = r * per_row; j < (r + 1) * per_row; ++j) {
      if (part[j] != part[j]) {
        m = part[j];
        break;
      }
      m = part[j] > m ? part[j] : m;
    }
    top[r] = m;
  }
  // a row holding NaN, or whose max is infinite, is all NaN (torch's NaN row)
  std::vector<char> nan_row(R);
  for (int64_t r = 0; r < R; ++r)
    nan_row[r] = top[r] != top[r] || top[r] == -__builtin_inff() || top[r] == __builtin_inff();
  run([&](int64_t c) {
    const auto [at, n] = span(c);
    if (nan_row[c / per_row]) {
      std::fill(out + at, out + at + n, __builtin_nanf(""));
      part[c] = 0.f;
      return;
    }
    part[c] = softmax_exp_chunk(x + at, n, top[c / per_row], out + at);
  });
  for (int64_t r = 0; r < R; ++r) {
    float sum = 0.f;
    for (int64_t j = r * per_row; j < (r + 1) * per_row; ++j) sum += part[j];
    scale[r] = 1.f / sum;
  }
  run([&](int64_t c) {
    const auto [at, n] = span(c);
    if (!nan_row[c / per_row]) softmax_scale_chunk(out + at, n, scale[c / per_row]);
  });
}

void softmax_race_kernel(const float* x, const int64_t* rows, const int64_t* keys,
                         const int64_t* positions, int64_t S, int64_t V, int64_t* out) {
  const int64_t chunk = 8192;  // softmax_rows_kernel's and exponential_race_kernel's chunks
  const int64_t per_row = (V + chunk - 1) / chunk;
  if (S < 2 * static_cast<int64_t>(pool_threads())) {  // too few rows to share: split them
    const std::unique_ptr<float[]> probs(new float[S * V]);  // not zeroed: all written
    if (rows != nullptr) {  // the few rows gathered first (the probabilities' buffer holds them)
      for (int64_t r = 0; r < S; ++r)
        std::memcpy(probs.get() + r * V, x + rows[r] * V, V * sizeof(float));
      softmax_rows_kernel(probs.get(), S, V, probs.get());
      exponential_race_kernel(probs.get(), keys, positions, S, V, out);
      return;
    }
    softmax_rows_kernel(x, S, V, probs.get());
    exponential_race_kernel(probs.get(), keys, positions, S, V, out);
    return;
  }
  // a row per task, its passes one after the other on one thread: the row's probabilities
  // (V floats) stay in that core's cache between them and are never written out
  parallel_chunks(S, [&](int64_t r) {
    thread_local std::vector<float> probs, part;
    if (static_cast<int64_t>(probs.size()) < V) probs.resize(V);
    part.resize(per_row);
    const float* xr = x + (rows != nullptr ? rows[r] : r) * V;
    float m = -__builtin_inff();
    for (int64_t j = 0; j < per_row; ++j) {  // softmax_rows_kernel's max, NaN first
      const float c = softmax_max_chunk(xr + j * chunk, std::min(chunk, V - j * chunk));
      if (c != c) {
        m = c;
        break;
      }
      m = c > m ? c : m;
    }
    const bool nan_row = m != m || m == -__builtin_inff() || m == __builtin_inff();
    float sum = 0.f;
    for (int64_t j = 0; j < per_row; ++j) {
      const int64_t i0 = j * chunk, n = std::min(chunk, V - i0);
      if (nan_row) {
        std::fill(probs.data() + i0, probs.data() + i0 + n, __builtin_nanf(""));
      } else {
        part[j] = softmax_exp_chunk(xr + i0, n, m, probs.data() + i0);
      }
    }
    if (!nan_row) {
      for (int64_t j = 0; j < per_row; ++j) sum += part[j];
    }
    const float scale = 1.f / sum;
    const uint64_t row = mix64(static_cast<uint64_t>(keys[r]) +
                               kRowMul * (static_cast<uint64_t>(positions[r]) + 1));
    float best = 0.f;
    int64_t index = 0;
    for (int64_t j = 0; j < per_row; ++j) {
      const int64_t i0 = j * chunk, n = std::min(chunk, V - i0);
      const uint64_t at = row + kColMul * static_cast<uint64_t>(i0);
      float b;
      int64_t bi;
      if (nan_row) {
        race_chunk(at, probs.data() + i0, n, &b, &bi);
      } else {  // the probabilities e * scale, as softmax_scale_chunk would write them
        race_chunk_scaled(at, probs.data() + i0, n, scale, &b, &bi);
      }
      if (j == 0 || beats(b, bi + i0, best, index)) best = b, index = bi + i0;
    }
    out[r] = index;
  });
}

void coupled_topk_kernel(const float* logits, int64_t R, int64_t Vd, const float* temperature,
                         const int64_t* keys, const int64_t* positions, const int64_t* vocab_map,
                         int64_t k, float* values, int64_t* indices) {
  // tasks: each greedy row alone, and each noise stream (key, position) with all its sampled
  // rows (siblings of a token tree share one), whose noise is computed once
  std::vector<std::vector<int64_t>> tasks;
  std::vector<bool> sampled;
  std::map<std::pair<int64_t, int64_t>, size_t> streams;  // (key, position) -> task
  for (int64_t r = 0; r < R; ++r) {
    if (temperature[r] == 0.f) {
      tasks.push_back({r});
      sampled.push_back(false);
      continue;
    }
    const auto [it, fresh] = streams.try_emplace({keys[r], positions[r]}, tasks.size());
    if (fresh) {
      tasks.push_back({r});
      sampled.push_back(true);
    } else {
      tasks[it->second].push_back(r);
    }
  }
  const std::vector<uint64_t> cols =
      std::find(sampled.begin(), sampled.end(), true) != sampled.end()
          ? column_offsets(vocab_map, Vd)
          : std::vector<uint64_t>();
  parallel_chunks(static_cast<int64_t>(tasks.size()), [&](int64_t c) {
    thread_local std::vector<float> z, log_e;
    if (static_cast<int64_t>(z.size()) < Vd) z.resize(Vd), log_e.resize(Vd);
    const auto& rows = tasks[c];
    if (sampled[c]) {
      const int64_t r = rows[0];
      log_noise_row(mix64(static_cast<uint64_t>(keys[r]) +
                          kRowMul * (static_cast<uint64_t>(positions[r]) + 1)),
                    cols.data(), Vd, log_e.data());
    }
    for (const int64_t r : rows) {
      coupled_topk_row(logits + r * Vd, Vd, temperature[r], sampled[c] ? log_e.data() : nullptr,
                       k, z.data(), values + r * k, indices + r * k);
    }
  });
}

}  // namespace specengine
