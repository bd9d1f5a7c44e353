// The EAGLE-2 draft step (arXiv 2406.16858) of speculative/drafters/eagle/drafter.py in one call:
// the drafter forward over each sequence's real rows not cached yet, the depth-1 children of its
// last row (the root's feature), then per depth one drafter forward over the frontier nodes of
// every sequence (tree attention over the drafter's paged KV), their coupled
// top-k children (coupled_topk_kernel), and the next frontier (the k best new nodes by
// cumulative log-probability); then each sequence's tree of the `budget` best candidates. The
// same kernels in the same order as the Python loop, so the trees are the same bit for bit; what
// it saves is the Python between them.
#include <algorithm>
#include <cmath>
#include <vector>

#include <ATen/ATen.h>

#include "kernels.h"
#include "ops.h"

namespace specengine {
namespace {


struct Weights {
  at::Tensor embed, fc, fc_bias, input_norm, qkv, o, post_norm, gate_up, down, final_norm, head,
      rope;
  int64_t n_fc, n_qkv, n_o, n_gate_up, n_down, n_head;
  bool glu;
  int64_t kind;
};

struct Candidate {
  double cum;
  int64_t depth, token, parent;
  double logprob;
};

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> eagle_draft(
    const std::vector<int64_t>& prefix_ids, const at::Tensor& prefix_feats,
    const std::vector<int64_t>& prefix_pos, const std::vector<int64_t>& prefix_seq,
    const std::vector<int64_t>& last, const std::vector<at::Tensor>& weights,
    const std::vector<int64_t>& sizes, int64_t kind, bool glu, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale, double eps, at::Tensor k_cache,
    at::Tensor v_cache, const at::Tensor& block_tables, const std::vector<int64_t>& lengths,
    int64_t block_size, const at::Tensor& temperature, const at::Tensor& keys,
    const std::vector<int64_t>& n_out,
    const std::optional<at::Tensor>& vocab_map, int64_t depth, int64_t topk, int64_t budget) {
  TORCH_CHECK_VALUE(weights.size() == 12 && sizes.size() == 6,
                    "eagle_draft: 12 weights and 6 sizes expected, got ", weights.size(), " and ",
                    sizes.size());
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "eagle_draft: kind must be 0 (amx), 1 (avx512) or "
                    "2 (avx2), got ", kind);
  TORCH_CHECK_VALUE(depth >= 1 && topk >= 1 && budget >= 1,
                    "eagle_draft: depth, topk and budget must be >= 1");
  const int64_t B = static_cast<int64_t>(last.size());
  const int64_t P = static_cast<int64_t>(prefix_ids.size());
  TORCH_CHECK_VALUE(prefix_feats.dim() == 2 && prefix_feats.size(0) == P &&
                    static_cast<int64_t>(prefix_pos.size()) == P &&
                    static_cast<int64_t>(prefix_seq.size()) == P,
                    "eagle_draft: prefix_ids, prefix_feats, prefix_pos and prefix_seq must have "
                    "one entry per prefix row");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(last[b] >= 0 && last[b] < P, "eagle_draft: last[", b, "] = ", last[b],
                      " is not a prefix row");
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(lengths.size()) == B &&
                    static_cast<int64_t>(n_out.size()) == B && block_tables.size(0) == B &&
                    temperature.size(0) == B && keys.size(0) == B,
                    "eagle_draft: last, lengths, n_out, block_tables, temperature and keys "
                    "must have B = ", B, " rows");
  TORCH_CHECK_VALUE(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() &&
                    keys.scalar_type() == at::kLong && keys.is_contiguous() &&
                    block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                    block_tables.dim() == 2,
                    "eagle_draft: temperature float32, keys int64 and block_tables [B, W] int32 "
                    "must be contiguous");
  TORCH_CHECK_VALUE(!vocab_map.has_value() || (vocab_map->scalar_type() == at::kLong &&
                                               vocab_map->is_contiguous()),
                    "eagle_draft: vocab_map must be a contiguous int64 tensor");
  const Weights w{weights[0], weights[1], weights[2], weights[3], weights[4], weights[5],
                  weights[6], weights[7], weights[8], weights[9], weights[10], weights[11],
                  sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], glu, kind};
  const auto dtype = w.embed.scalar_type();
  const auto i64 = at::TensorOptions().dtype(at::kLong);
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  const int64_t nq = num_heads, nkv = num_kv_heads, D = head_dim;
  const auto final_norm = w.final_norm.to(dtype);
  const float* temp = temperature.data_ptr<float>();
  const int64_t* key = keys.data_ptr<int64_t>();
  const int64_t* map = vocab_map.has_value() ? vocab_map->data_ptr<int64_t>() : nullptr;
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);

  auto to_tensor = [](const std::vector<int64_t>& v, at::TensorOptions o) {
    return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(o.dtype());
  };
  // the drafter forward (EagleModel.forward and DecoderLayer.forward, same ops and order) over
  // rows of token ids `tok` and input features `feats` [R, H] at RoPE positions `pos`, writing
  // their K/V to `slot`; row r attends as sequence qseq[r] over kv_len[r] keys (tree rows: the
  // keys before tree_base plus those `mask` marks). With `out`, only the rows it lists go on
  // past the K/V write (the others are a catch-up: their keys are needed, not their outputs)
  auto forward = [&](const at::Tensor& feats, const std::vector<int64_t>& tok,
                     const std::vector<int64_t>& pos, const std::vector<int64_t>& slot,
                     const std::vector<int64_t>& qseq, const std::vector<int64_t>& kv_len,
                     const std::optional<at::Tensor>& tree_base,
                     const std::optional<at::Tensor>& mask,
                     const std::vector<int64_t>* out = nullptr) {
    int64_t R = static_cast<int64_t>(tok.size());
    auto x = at::cat({w.embed.index_select(0, to_tensor(tok, i64)), feats.to(dtype)}, -1);
    x = packed_linear(w.kind, x, w.fc, w.n_fc, w.fc_bias, false, false);
    const auto cs = w.rope.index_select(0, to_tensor(pos, i64)).unsqueeze(1).chunk(2, -1);
    auto residual = x;
    auto h = rms_norm_cpu(x, w.input_norm, eps);
    auto qkv = packed_linear(w.kind, h, w.qkv, w.n_qkv, std::nullopt, false, false)
                   .view({R, nq + 2 * nkv, D});
    auto qk = qkv.narrow(1, 0, nq + nkv);
    rope_inplace_cpu(qk, cs[0].reshape({R, D}), cs[1].reshape({R, D}));
    write_kv_cpu(k_cache, v_cache, qkv.narrow(1, nq, nkv), qkv.narrow(1, nq + nkv, nkv),
                 to_tensor(slot, i64));
    auto q = qkv.narrow(1, 0, nq);
    auto q_seq = to_tensor(qseq, i32), q_len = to_tensor(kv_len, i32);
    if (out != nullptr) {
      const auto rows = to_tensor(*out, i64);
      q = q.index_select(0, rows);
      residual = residual.index_select(0, rows);
      q_seq = q_seq.index_select(0, rows);
      q_len = q_len.index_select(0, rows);
      R = static_cast<int64_t>(out->size());
    }
    const auto attn = paged_attention_cpu(q, k_cache, v_cache, block_tables, q_seq, q_len, scale,
                                          tree_base, mask);
    h = packed_linear(w.kind, attn.reshape({R, nq * D}), w.o, w.n_o, std::nullopt, false, false);
    std::tie(h, residual) = add_rms_norm_cpu(h, residual, w.post_norm, eps);
    h = w.glu ? packed_linear(w.kind, h, w.gate_up, w.n_gate_up, std::nullopt, true, false)
              : silu_and_mul_cpu(packed_linear(w.kind, h, w.gate_up, w.n_gate_up,
                                               std::nullopt, false, false));
    h = packed_linear(w.kind, h, w.down, w.n_down, std::nullopt, false, false);
    return std::get<0>(add_rms_norm_cpu(h, residual, final_norm, eps));
  };
  auto slot_of = [&](int64_t b, int64_t p) {
    return static_cast<int64_t>(tables[b * width + p / block_size]) * block_size + p % block_size;
  };

  // the children of rows `feats` [R, H] (row r drafts for sequence seq[r] at output position
  // pos[r]): coupled top-k over the draft vocabulary, as (target id, log-probability)
  std::vector<float> values;
  std::vector<int64_t> ids;
  auto children = [&](const at::Tensor& feats, const std::vector<int64_t>& seq,
                      const std::vector<int64_t>& pos) {
    const auto logits = packed_linear(w.kind, feats, w.head, w.n_head, std::nullopt, false, true)
                            .contiguous();
    const int64_t R = logits.size(0), Vd = logits.size(1), k = std::min(topk, Vd);
    std::vector<float> t(R);
    std::vector<int64_t> ks(R);
    for (int64_t r = 0; r < R; ++r) t[r] = temp[seq[r]], ks[r] = key[seq[r]];
    values.assign(R * k, 0.f);
    ids.assign(R * k, 0);
    coupled_topk_kernel(logits.data_ptr<float>(), R, Vd, t.data(), ks.data(), pos.data(), map, k,
                        values.data(), ids.data());
    if (map != nullptr) {
      for (auto& i : ids) i = map[i];
    }
    return k;
  };

  std::vector<std::vector<Candidate>> cands(B);
  std::vector<std::vector<int64_t>> frontier(B), fed(B);
  std::vector<int64_t> feed_rows;  // per frontier node, in order: its row of `feed`
  at::Tensor feed;
  {
    // the real rows not cached yet; each sequence's last one predicts its depth-1 tokens
    std::vector<int64_t> slot(P), kv_len(P);
    for (int64_t r = 0; r < P; ++r) {
      slot[r] = slot_of(prefix_seq[r], prefix_pos[r]);
      kv_len[r] = prefix_pos[r] + 1;
    }
    bool all = B == P;  // one row per sequence, in order: each is its last
    for (int64_t b = 0; all && b < B; ++b) all = last[b] == b;
    const auto root = forward(prefix_feats, prefix_ids, prefix_pos, slot, prefix_seq, kv_len,
                              std::nullopt, std::nullopt, all ? nullptr : &last);
    std::vector<int64_t> seq(B), pos(n_out);
    for (int64_t b = 0; b < B; ++b) seq[b] = b;
    const int64_t k = children(root, seq, pos);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < k; ++j) {
        const double lp = values[b * k + j];
        if (!(lp > -INFINITY)) continue;
        frontier[b].push_back(cands[b].size());
        cands[b].push_back({lp, 1, ids[b * k + j], -1, lp});
        feed_rows.push_back(b);
      }
    }
    feed = root;
  }
  for (int64_t d = 2; d <= depth; ++d) {
    std::vector<int64_t> tok, pos, slot, seq, out_pos, kv_len, base, cand;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = lengths[b];
      for (const int64_t ci : frontier[b]) {
        fed[b].push_back(ci);
        const int64_t g = static_cast<int64_t>(fed[b].size()) - 1, p = n + g;
        tok.push_back(cands[b][ci].token);
        pos.push_back(n + d - 2);
        slot.push_back(slot_of(b, p));
        seq.push_back(b);
        out_pos.push_back(n_out[b] + d - 1);
        kv_len.push_back(n + g + 1);
        base.push_back(n);
        cand.push_back(ci);
      }
    }
    const int64_t R = static_cast<int64_t>(tok.size());
    if (R == 0) break;
    int64_t mask_width = 0;
    for (int64_t b = 0; b < B; ++b) {
      mask_width = std::max<int64_t>(mask_width, static_cast<int64_t>(fed[b].size()));
    }
    auto mask = at::zeros({R, mask_width}, at::TensorOptions().dtype(at::kBool));
    bool* m = mask.data_ptr<bool>();
    for (int64_t r = 0; r < R; ++r) {
      const auto& f = fed[seq[r]];
      for (int64_t a = cand[r]; a >= 0; a = cands[seq[r]][a].parent) {
        const int64_t g = std::find(f.begin(), f.end(), a) - f.begin();
        m[r * mask_width + g] = true;
      }
    }
    const auto f = forward(feed.index_select(0, to_tensor(feed_rows, i64)), tok, pos, slot, seq,
                           kv_len, to_tensor(base, i32), mask);
    const int64_t k = children(f, seq, out_pos);
    std::vector<std::vector<std::pair<int64_t, int64_t>>> fresh(B);  // (candidate, row)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t b = seq[r];
      const double cum = cands[b][cand[r]].cum;
      for (int64_t j = 0; j < k; ++j) {
        const double lp = values[r * k + j];
        if (!(lp > -INFINITY)) continue;
        fresh[b].push_back({static_cast<int64_t>(cands[b].size()), r});
        cands[b].push_back({cum + lp, d, ids[r * k + j], cand[r], lp});
      }
    }
    if (d == depth) break;
    feed_rows.clear();
    for (int64_t b = 0; b < B; ++b) {
      auto& nb = fresh[b];
      std::stable_sort(nb.begin(), nb.end(), [&](const auto& a, const auto& c) {
        return -cands[b][a.first].cum < -cands[b][c.first].cum;
      });
      nb.resize(std::min<size_t>(nb.size(), topk));
      frontier[b].clear();
      for (const auto& [c, r] : nb) frontier[b].push_back(c), feed_rows.push_back(r);
    }
    feed = f;
  }
  // each sequence's tree (EagleDrafter._tree): the `budget` best candidates by cumulative
  // log-probability (ties: shallower first, then earlier), ordered by depth, then best first
  auto count = at::zeros({B}, i64);
  auto token = at::zeros({B, budget}, i64), parent = at::full({B, budget}, -1, i64);
  auto logprob = at::zeros({B, budget}, at::TensorOptions().dtype(at::kDouble));
  for (int64_t b = 0; b < B; ++b) {
    const auto& c = cands[b];
    std::vector<int64_t> order(c.size());
    for (size_t i = 0; i < c.size(); ++i) order[i] = static_cast<int64_t>(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      return -c[x].cum < -c[y].cum || (-c[x].cum == -c[y].cum && c[x].depth < c[y].depth);
    });
    order.resize(std::min<size_t>(order.size(), budget));
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
      return c[x].depth < c[y].depth || (c[x].depth == c[y].depth && -c[x].cum < -c[y].cum);
    });
    std::vector<int64_t> index(c.size(), -1);
    for (size_t j = 0; j < order.size(); ++j) index[order[j]] = static_cast<int64_t>(j);
    count.data_ptr<int64_t>()[b] = static_cast<int64_t>(order.size());
    for (size_t j = 0; j < order.size(); ++j) {
      const auto& e = c[order[j]];
      token.data_ptr<int64_t>()[b * budget + j] = e.token;
      parent.data_ptr<int64_t>()[b * budget + j] = e.parent >= 0 ? index[e.parent] : -1;
      logprob.data_ptr<double>()[b * budget + j] = e.logprob;
    }
  }
  return {count, token, parent, logprob};
}

}  // namespace specengine
