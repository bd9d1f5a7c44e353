// Paged attention on the CPU (vLLM PagedAttention cache layout, FlashAttention-style online
// softmax), for prefill, decode and tree-verify tokens in one kernel.
//
// Work item = (query token t, KV head g): the `group` query heads sharing KV head g read each
// K/V row once. Scores are computed one cache block at a time; the running max / sum / output
// are rescaled per block (online softmax, Milakov & Gimelshein 2018; Dao et al. 2022), all in
// float32 whatever the cache dtype.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "pool.h"
#include "vec.h"

namespace specengine {
namespace {

struct AttnArgs {
  const float* q;          // [T, H, D] float32, already multiplied by scale
  const void* k_cache;     // [NB, BS, KVH, D]
  const void* v_cache;
  const int32_t* block_tables;  // [S, MB]
  const int32_t* query_seq;     // [T]
  const int32_t* kv_lens;       // [T]
  const int32_t* tree_base;     // [T] or nullptr
  const bool* tree_mask;        // [T, W] or nullptr
  float* out;                   // [T, H, D] float32
  int64_t T, H, KVH, D, NB, BS, MB, W;
};

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

// Items [begin, end) of the (t, g) grid; scratch holds group*(D + BS + 16 + 2) floats.
template <class KT>
SE_INLINE void attend(const AttnArgs& a, int64_t begin, int64_t end, float* scratch) {
  const int64_t group = a.H / a.KVH, D = a.D, BS = a.BS;
  const KT* kc = static_cast<const KT*>(a.k_cache);
  const KT* vc = static_cast<const KT*>(a.v_cache);
  float* acc = scratch;                 // [group, D]
  const int64_t SW = BS + 16;           // score row width (vector reads past len)
  float* s = acc + group * D;           // [group, SW]
  float* m = s + group * SW;            // [group]
  float* l = m + group;                 // [group]
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t item = begin; item < end; ++item) {
    const int64_t t = item / a.KVH, g = item % a.KVH;
    const int64_t n = a.kv_lens[t];
    const int32_t* table = a.block_tables + static_cast<int64_t>(a.query_seq[t]) * a.MB;
    const int64_t base = a.tree_mask ? a.tree_base[t] : n;
    const bool* mask = a.tree_mask ? a.tree_mask + t * a.W : nullptr;
    const float* q = a.q + (t * a.H + g * group) * D;
    std::fill(acc, acc + group * D, 0.f);
    std::fill(m, m + group, ninf);
    std::fill(l, l + group, 0.f);
    for (int64_t b0 = 0; b0 < n; b0 += BS) {
      const int64_t block = table[b0 / BS];  // validated before the parallel region
      const int64_t len = std::min(BS, n - b0);
      const int64_t row0 = (block * BS * a.KVH + g) * D;  // (block, offset 0, head g)
      bool any = false;
      for (int64_t o = 0; o < len; ++o) {
        const int64_t p = b0 + o;
        const bool seen = p < base || (p - base < a.W && mask[p - base]);
        any |= seen;
        const KT* k = kc + row0 + o * a.KVH * D;
        for (int64_t h = 0; h < group; ++h) s[h * SW + o] = seen ? dot(q + h * D, k, D) : ninf;
      }
      if (!any) continue;
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
        // probabilities of the block, 16 at a time; masked (-inf) positions get exactly 0
        for (int64_t o = 0; o < len; o += 16) {
          f32x16 sv;
          std::memcpy(&sv, sh + o, sizeof(sv));  // s has BS + 16 floats per head: no overrun
          const f32x16 pv = vexp(sv - mnew);
          const f32x16 pz = sv == splat(ninf) ? splat(0.f) : pv;
          std::memcpy(sh + o, &pz, sizeof(pz));
        }
        for (int64_t o = 0; o < len; ++o) {
          const float p = sh[o];
          if (p == 0.f) continue;
          l[h] += p;
          axpy(acc + h * D, p, vc + row0 + o * a.KVH * D, D);
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

void check_index(const at::Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(x.dim() == dim, name, " must have ", dim, " dims, got shape ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kInt, name, " must be int32, got ", x.scalar_type());
}

}  // namespace

void check_paged_attention_args(const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& query_seq, const at::Tensor& kv_lens,
                                const std::optional<at::Tensor>& tree_base,
                                const std::optional<at::Tensor>& tree_mask) {
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be [T, H, D], got shape ", query.sizes());
  TORCH_CHECK_VALUE(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, KVH, D], got ",
                    k_cache.sizes());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache shape ", v_cache.sizes(),
                    " differs from k_cache shape ", k_cache.sizes());
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "k_cache and v_cache must be contiguous");
  TORCH_CHECK_TYPE(k_cache.scalar_type() == v_cache.scalar_type(),
                   "k_cache and v_cache dtypes differ");
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = k_cache.size(2);
  TORCH_CHECK_VALUE(k_cache.size(3) == D, "head_dim of k_cache (", k_cache.size(3),
                    ") != head_dim of query (", D, ")");
  TORCH_CHECK_VALUE(KVH > 0 && H % KVH == 0, "num_heads (", H,
                    ") must be a multiple of num_kv_heads (", KVH, ")");
  check_index(block_tables, "block_tables", 2);
  check_index(query_seq, "query_seq", 1);
  check_index(kv_lens, "kv_lens", 1);
  TORCH_CHECK_VALUE(query_seq.size(0) == T && kv_lens.size(0) == T,
                    "query_seq and kv_lens must have T=", T, " entries");
  TORCH_CHECK_VALUE(tree_base.has_value() == tree_mask.has_value(),
                    "tree_base and tree_mask must be given together");
  if (tree_mask.has_value()) {
    check_index(*tree_base, "tree_base", 1);
    TORCH_CHECK_VALUE(tree_base->size(0) == T, "tree_base must have T=", T, " entries");
    TORCH_CHECK_TYPE(tree_mask->scalar_type() == at::kBool, "tree_mask must be bool, got ",
                     tree_mask->scalar_type());
    TORCH_CHECK_VALUE(tree_mask->dim() == 2 && tree_mask->size(0) == T, "tree_mask must be [T=",
                      T, ", W], got ", tree_mask->sizes());
  }
  for (const at::Tensor* x : {&k_cache, &v_cache, &block_tables, &query_seq, &kv_lens})
    TORCH_CHECK_VALUE(x->device() == query.device(), "all attention inputs must be on ",
                      query.device(), ", got one on ", x->device());
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& query_seq, const at::Tensor& kv_lens,
                               double scale, const std::optional<at::Tensor>& tree_base,
                               const std::optional<at::Tensor>& tree_mask) {
  check_paged_attention_args(query, k_cache, v_cache, block_tables, query_seq, kv_lens,
                             tree_base, tree_mask);
  TORCH_CHECK_VALUE(query.device().is_cpu(), "paged_attention_cpu needs CPU tensors");
  const auto kdt = k_cache.scalar_type();
  TORCH_CHECK_TYPE(kdt == at::kFloat || kdt == at::kBFloat16,
                   "k_cache must be float32 or bfloat16, got ", kdt);
  const int64_t T = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KVH = k_cache.size(2);
  const auto bt = block_tables.contiguous();
  const auto qs = query_seq.contiguous();
  const auto kl = kv_lens.contiguous();
  const int64_t S = bt.size(0), MB = bt.size(1);
  const int32_t* qs_p = qs.data_ptr<int32_t>();
  const int32_t* kl_p = kl.data_ptr<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(qs_p[t] >= 0 && qs_p[t] < S, "query_seq[", t, "]=", qs_p[t],
                      " out of range [0, ", S, ")");
    TORCH_CHECK_VALUE(kl_p[t] >= 1 && kl_p[t] <= MB * BS, "kv_lens[", t, "]=", kl_p[t],
                      " outside [1, max_blocks*block_size=", MB * BS, "]");
  }
  // Every block a query reads must be a valid id (no exceptions inside the parallel region).
  std::vector<int64_t> used(S, 0);
  for (int64_t t = 0; t < T; ++t) used[qs_p[t]] = std::max<int64_t>(used[qs_p[t]], kl_p[t]);
  const int32_t* bt_p = bt.data_ptr<int32_t>();
  for (int64_t s = 0; s < S; ++s)
    for (int64_t i = 0; i < (used[s] + BS - 1) / BS; ++i) {
      const int32_t block = bt_p[s * MB + i];
      TORCH_CHECK_VALUE(block >= 0 && block < NB, "block_tables[", s, ", ", i, "]=", block,
                        " is not a block id in [0, ", NB, ")");
    }
  at::Tensor tb, tm;
  int64_t W = 0;
  if (tree_mask.has_value()) {
    tb = tree_base->contiguous();
    tm = tree_mask->contiguous();
    W = tm.size(1);
  }
  auto q = (query.to(at::kFloat) * scale).contiguous();
  auto out = at::empty({T, H, D}, query.options().dtype(at::kFloat));
  AttnArgs a{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr<int32_t>(),
             qs_p, kl_p, tb.defined() ? tb.data_ptr<int32_t>() : nullptr,
             tm.defined() ? tm.data_ptr<bool>() : nullptr, out.data_ptr<float>(),
             T, H, KVH, D, NB, BS, MB, W};
  const int64_t group = H / KVH;
  parallel_ranges(T * KVH, 1, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(group * (D + BS + 16 + 2));
    if (kdt == at::kFloat)
      attend_f32(a, begin, end, scratch.data());
    else
      attend_bf16(a, begin, end, scratch.data());
  });
  return out.scalar_type() == query.scalar_type() ? out : out.to(query.scalar_type());
}

void write_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key,
                  const at::Tensor& value, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
                    "k_cache/v_cache must both be [num_blocks, block_size, KVH, D]");
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(),
                    "k_cache and v_cache must be contiguous");
  const int64_t T = key.size(0), row = k_cache.size(2) * k_cache.size(3);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK_VALUE(key.dim() == 3 && key.sizes() == value.sizes() &&
                        key.size(1) * key.size(2) == row,
                    "key/value must be [T, KVH, D] matching the cache, got ", key.sizes(), " and ",
                    value.sizes());
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == T,
                    "slot_mapping must be [T=", T, "]");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  auto k = key.to(k_cache.scalar_type()).contiguous();
  auto v = value.to(v_cache.scalar_type()).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t bytes = row * k.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(sp[t] >= 0 && sp[t] < num_slots, "slot_mapping[", t, "]=", sp[t],
                      " out of range [0, ", num_slots, ")");
    std::memcpy(kc + sp[t] * bytes, ks + t * bytes, bytes);
    std::memcpy(vc + sp[t] * bytes, vs + t * bytes, bytes);
  }
}

}  // namespace specengine
