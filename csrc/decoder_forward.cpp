// The decoder layers of models/llama.py (LlamaForCausalLM.forward over DecoderLayer.forward) in
// one call on the CPU: per layer the norm, the packed qkv linear, RoPE of q and k in place, the
// K/V write, paged attention, the packed o linear, the fused add + norm, the packed gate_up
// linear with SiLU-and-multiply, the packed down linear; then the final add + norm. The same
// kernels in the same order as the Python layer loop, so the hidden states and the KV caches are
// the same bit for bit; what it saves is the Python between the kernels (about 25 calls per
// layer, which at one token per step cost as much as a few layers' weight reads).
#include <tuple>
#include <vector>

#include <ATen/ATen.h>

#include "ops.h"

namespace specengine {

at::Tensor decoder_forward(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
                           const std::vector<at::Tensor>& layers,
                           const std::vector<std::optional<at::Tensor>>& biases,
                           const std::vector<int64_t>& sizes, int64_t kind, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
                           std::vector<at::Tensor> k_caches, std::vector<at::Tensor> v_caches,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& query_seq, const at::Tensor& kv_lens,
                           const std::optional<at::Tensor>& tree_base,
                           const std::optional<at::Tensor>& tree_mask,
                           const at::Tensor& final_norm) {
  constexpr size_t kPerLayer = 6;  // input_norm, qkv, o, post_norm, gate_up (glu), down
  const size_t L = k_caches.size();
  TORCH_CHECK_VALUE(L >= 1 && v_caches.size() == L && layers.size() == kPerLayer * L &&
                        biases.size() == 2 * L && sizes.size() == 4,
                    "decoder_forward: per layer 6 tensors, 2 biases and a K and a V cache, and 4 "
                    "sizes expected; got ", layers.size(), " tensors, ", biases.size(),
                    " biases, ", k_caches.size(), " / ", v_caches.size(), " caches, ",
                    sizes.size(), " sizes");
  TORCH_CHECK_VALUE(kind >= 0 && kind <= 2, "decoder_forward: kind must be 0 (amx), 1 (avx512) "
                    "or 2 (avx2), got ", kind);
  TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.device().is_cpu(),
                    "decoder_forward: hidden must be [T, hidden_size] on the CPU");
  const int64_t T = hidden.size(0), nq = num_heads, nkv = num_kv_heads, D = head_dim;
  const int64_t n_qkv = sizes[0], n_o = sizes[1], n_gate_up = sizes[2], n_down = sizes[3];
  TORCH_CHECK_VALUE(n_qkv == (nq + 2 * nkv) * D, "decoder_forward: qkv has ", n_qkv,
                    " outputs, heads need ", (nq + 2 * nkv) * D);
  const auto c = cos.reshape({T, D}), s = sin.reshape({T, D});
  at::Tensor residual;
  for (size_t l = 0; l < L; ++l) {
    const at::Tensor* w = &layers[kPerLayer * l];
    if (l == 0) {
      residual = hidden;
      hidden = rms_norm_cpu(hidden, w[0], eps);
    } else {
      std::tie(hidden, residual) = add_rms_norm_cpu(hidden, residual, w[0], eps);
    }
    const auto qkv = packed_linear(kind, hidden, w[1], n_qkv, biases[2 * l], false, false)
                         .view({T, nq + 2 * nkv, D});
    auto qk = qkv.narrow(1, 0, nq + nkv);
    rope_inplace_cpu(qk, c, s);
    write_kv_cpu(k_caches[l], v_caches[l], qkv.narrow(1, nq, nkv), qkv.narrow(1, nq + nkv, nkv),
                 slot_mapping);
    const auto attn = paged_attention_cpu(qkv.narrow(1, 0, nq), k_caches[l], v_caches[l],
                                          block_tables, query_seq, kv_lens, scale, tree_base,
                                          tree_mask);
    hidden = packed_linear(kind, attn.reshape({T, nq * D}), w[2], n_o, biases[2 * l + 1], false,
                           false);
    std::tie(hidden, residual) = add_rms_norm_cpu(hidden, residual, w[3], eps);
    const auto act = packed_linear(kind, hidden, w[4], n_gate_up, std::nullopt, true, false);
    hidden = packed_linear(kind, act, w[5], n_down, std::nullopt, false, false);
  }
  return std::get<0>(add_rms_norm_cpu(hidden, residual, final_norm, eps));
}

}  // namespace specengine
