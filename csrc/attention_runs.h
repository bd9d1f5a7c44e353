// What the AVX-512 (attention.cpp) and AMX (attention_amx.cpp) paged-attention paths share:
// their work items (runs of query tokens of one sequence), each token's visible keys as one
// compact sequence, and the epilogue that writes a row's output.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include <c10/util/BFloat16.h>

#include "kernels.h"

namespace specengine {

constexpr int64_t kRunTokens = 16;  // query tokens per work item

// Token index where each run of up to kRunTokens consecutive tokens of one sequence starts,
// then a.T.
inline std::vector<int64_t> query_runs(const AttnArgs& a) {
  std::vector<int64_t> runs{0};
  for (int64_t t = 1; t < a.T; ++t)
    if (a.query_seq[t] != a.query_seq[t - 1] || t - runs.back() == kRunTokens) runs.push_back(t);
  runs.push_back(a.T);
  return runs;
}

// A work item (a run of query tokens, KV head g) and where its sequence's cache rows are:
// bf16 caches, kc / vc already offset to head g; slot(p) is the element offset of position p's
// row (its block from the block table).
struct WorkItem {
  int64_t g, t0, nt;
  const uint16_t* kc;
  const uint16_t* vc;
  const int32_t* table;
  int64_t block_size, stride;

  WorkItem(const AttnArgs& a, const int64_t* run_start, int64_t item)
      : g(item % a.KVH),
        t0(run_start[item / a.KVH]),
        nt(run_start[item / a.KVH + 1] - t0),
        kc(static_cast<const uint16_t*>(a.k_cache) + g * a.D),
        vc(static_cast<const uint16_t*>(a.v_cache) + g * a.D),
        table(a.block_tables + static_cast<int64_t>(a.query_seq[t0]) * a.MB),
        block_size(a.BS),
        stride(a.KVH * a.D) {}

  int64_t slot(int64_t p) const {
    return (static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size) * stride;
  }

  // slot(p0 + o) for o in [0, n) into out, one division per call instead of one per position
  // (a decode step fills every position of every work item: the divisions were ~15% of it).
  void slots(int64_t p0, int64_t n, int64_t* out) const {
    int64_t b = p0 / block_size, i = p0 % block_size;
    for (int64_t o = 0; o < n; ++b, i = 0) {
      const int64_t base = static_cast<int64_t>(table[b]) * block_size;
      const int64_t m = std::min(n - o, block_size - i);
      for (int64_t j = 0; j < m; ++j) out[o + j] = (base + i + j) * stride;
      o += m;
    }
  }
};

// The visible keys of tokens [t0, t0 + nt) of a run. Token i sees the context [0, base[i]) and
// then its visible tree positions in slot order: count[i] keys in all, compact key k >= base[i]
// at position tree_pos(i, k). gap[i]: those are not simply positions [0, count[i]) (a tree node
// off the first branch). n_max: the most keys any of them sees.
struct RunKeys {
  int64_t count[kRunTokens], base[kRunTokens], first[kRunTokens];
  bool gap[kRunTokens];
  std::vector<int32_t> tree;
  int64_t n_max = 0;

  RunKeys(const AttnArgs& a, int64_t t0, int64_t nt) {
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t t = t0 + i, kv = a.kv_lens[t];
      const int64_t b = a.tree_mask ? std::min<int64_t>(a.tree_base[t], kv) : kv;
      first[i] = static_cast<int64_t>(tree.size());
      int64_t c = b;
      gap[i] = false;
      for (int64_t p = b; p < kv; ++p) {
        if (p - b < a.W && a.tree_mask[t * a.W + p - b]) {
          gap[i] |= p != c;
          tree.push_back(static_cast<int32_t>(p));
          ++c;
        }
      }
      count[i] = c;
      base[i] = b;
      n_max = std::max(n_max, c);
    }
  }

  int64_t tree_pos(int64_t i, int64_t k) const { return tree[first[i] + k - base[i]]; }
};

// Head dims up to this (the bf16 paths check D <= 256).
constexpr int64_t kMaxHeadDim = 256;

// n floats to bf16 bits as c10::BFloat16 rounds them (to nearest even; NaN -> 0x7fc0).
inline void store_bf16(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const c10::BFloat16 b(src[i]);
    dst[i] = b.x;
  }
}

// a.out (or a.out_bf16) rows of R rows of KV head g from the run starting at token t0 (row r:
// token t0 + r / group, query head g * group + r % group): acc / l, where acc's 32-wide chunk c
// holds in lane j the dimension 32c + (j / 4) * 8 + j % 4 and in lane 16 + j that one + 4 (the
// order VNNI pair interleaving leaves them in). A row with l = 0 (no visible key) is zeros.
inline void write_rows(const AttnArgs& a, const float* acc, const float* l, int64_t t0,
                       int64_t R, int64_t group, int64_t g) {
  const int64_t D = a.D;
  float row[kMaxHeadDim];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t at = ((t0 + r / group) * a.H + g * group + r % group) * D;
    float* out = a.out_bf16 ? row : a.out + at;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    const float* ar = acc + r * D;
    for (int64_t c = 0; c < D / 32; ++c)
      for (int j = 0; j < 16; ++j) {
        const int64_t d = 32 * c + (j / 4) * 8 + j % 4;
        out[d] = ar[32 * c + j] * inv;
        out[d + 4] = ar[32 * c + 16 + j] * inv;
      }
    if (a.out_bf16) store_bf16(a.out_bf16 + at, row, D);
  }
}

}  // namespace specengine
