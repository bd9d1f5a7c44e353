// Declarations of the CPU (and, with SPECENGINE_WITH_CUDA, CUDA) tensor ops bound in
// bindings.cpp: ops.cpp checks their arguments and runs the plain C++ kernels of kernels.h.
#pragma once

#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

namespace specengine {

// Shape/dtype/device checks shared by the CPU and CUDA paged attention (reads no data).
void check_paged_attention_args(const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& query_seq, const at::Tensor& kv_lens,
                                const std::optional<at::Tensor>& tree_base,
                                const std::optional<at::Tensor>& tree_mask);

// Paged attention; see specengine/attention/base.py for the semantics of every argument.
// tree_base [T] int32 and tree_mask [T, W] bool (both or neither): query t sees KV position p
// (< kv_lens[t]) iff p < tree_base[t] or tree_mask[t, p - tree_base[t]].
at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, const at::Tensor& block_tables,
                               const at::Tensor& query_seq, const at::Tensor& kv_lens,
                               double scale, const std::optional<at::Tensor>& tree_base,
                               const std::optional<at::Tensor>& tree_mask);

// Writes key/value [T, KVH, D] into the caches at slot_mapping [T] (int64).
void write_kv_cpu(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key,
                  const at::Tensor& value, const at::Tensor& slot_mapping);

// Copies rows [S, H] into data [N, H] at slots (S indices < N) and marks valid [N] (bool) there.
void store_rows_cpu(at::Tensor& data, at::Tensor& valid, const std::vector<int64_t>& slots,
                    const at::Tensor& rows);

// x [M, K] @ w[N, K]^T + b; bf16 (AVX-512 BF16) or fp32; batch-invariant rows.
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b);

// AMX-BF16 linear over weights packed once by amx_pack_weight ([N, K] bf16 -> tiles; glu:
// fused gate_up [2I, K] whose linear_amx output is silu(gate) * up [M, I]).
at::Tensor amx_pack_weight(const at::Tensor& w, bool glu);
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      const std::optional<at::Tensor>& bias, bool glu, bool out_f32);

// Linear on AVX-512 CPUs over weights packed once by avx512_pack_weight ([N, K] bf16 or f32;
// glu: fused gate_up [2I, K] whose avx512_linear output is silu(gate) * up [M, I]); out_f32
// writes float32 (logits) instead of x's dtype. Rows are batch-invariant.
at::Tensor avx512_pack_weight(const at::Tensor& w, bool glu);
at::Tensor avx512_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias, bool glu, bool out_f32);
// The same on AVX2 + FMA CPUs, over the same packed weights (linear_avx2.cpp).
at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::optional<at::Tensor>& bias, bool glu, bool out_f32);

// The packed linear kernels by kind, as kernels._packed_linear (PACKED_KINDS): 0 AMX tiles,
// 1 AVX-512, 2 AVX2.
at::Tensor packed_linear(int64_t kind, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias, bool glu, bool out_f32);

// In-place rotate-half RoPE of x [T, H, D] (any T/H strides) with float32 cos/sin [T, D].
void rope_inplace_cpu(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x,
                                                    const at::Tensor& residual,
                                                    const at::Tensor& w, double eps);
at::Tensor silu_and_mul_cpu(const at::Tensor& x);

// Sampling noise E ~ Exp(1) [P, vocab] float32 for output positions [P] (int64) of the stream
// `key`: counter-based, every row the same whatever else is asked (csrc/noise.cpp).
at::Tensor exponential_noise(int64_t key, const at::Tensor& positions, int64_t vocab);
// Row r: exponential_noise(keys[r], [positions[r]], vocab)[0]: all sampled rows of a step.
at::Tensor exponential_noise_batch(const at::Tensor& keys, const at::Tensor& positions,
                                   int64_t vocab);
// [S] int64: argmax(probs[r] / exponential_noise(keys[r], [positions[r]], V)[0]) per row, as
// torch.argmax (first index of the largest, NaN largest), the noise never stored.
at::Tensor argmax_rows(const at::Tensor& x);
// [R, V] float32: softmax of each row of x [R, V] float32 (softmax_rows_kernel's definition),
// rows and chunks of rows in parallel.
at::Tensor softmax_rows(const at::Tensor& x);
// [S] int64: exponential_race(softmax_rows(x), keys, positions), bit for bit, the probabilities
// never stored (softmax_race_kernel); with `rows` ([S] int64), of x[rows] without the copy.
at::Tensor softmax_race(const at::Tensor& x, const at::Tensor& keys,
                        const at::Tensor& positions,
                        const std::optional<at::Tensor>& rows = std::nullopt);
at::Tensor exponential_race(const at::Tensor& probs, const at::Tensor& keys,
                            const at::Tensor& positions);
std::tuple<at::Tensor, at::Tensor> coupled_topk(const at::Tensor& logits, int64_t k,
                                                const at::Tensor& temperature,
                                                const at::Tensor& keys,
                                                const at::Tensor& positions,
                                                const std::optional<at::Tensor>& vocab_map);

// models/llama.py's decoder layers and final norm over hidden [T, hidden_size] in one call
// (decoder_forward.cpp): per layer `layers` holds input_norm, qkv, o, post_norm, gate_up (glu)
// and down (the last four packed for `kind`) and `biases` the qkv and o biases (or None);
// sizes: qkv, o, gate_up and down output features. Returns the final-norm hidden states.
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
                           const at::Tensor& final_norm);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> eagle_draft(
    const std::vector<int64_t>& prefix_ids, const at::Tensor& prefix_feats,
    const std::vector<int64_t>& prefix_pos, const std::vector<int64_t>& prefix_seq,
    const std::vector<int64_t>& last, const std::vector<at::Tensor>& weights,
    const std::vector<int64_t>& sizes, int64_t kind, bool glu, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale, double eps, at::Tensor k_cache,
    at::Tensor v_cache, const at::Tensor& block_tables, const std::vector<int64_t>& lengths,
    int64_t block_size, const at::Tensor& temperature, const at::Tensor& keys,
    const std::vector<int64_t>& n_out, const std::optional<at::Tensor>& vocab_map, int64_t depth,
    int64_t topk, int64_t budget);

#ifdef SPECENGINE_WITH_CUDA
at::Tensor paged_attention_cuda(const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& query_seq, const at::Tensor& kv_lens,
                                double scale, const std::optional<at::Tensor>& tree_base,
                                const std::optional<at::Tensor>& tree_mask);
#endif

}  // namespace specengine
