// The torch-facing side of the CPU ops declared in ops.h: argument checks (shapes, dtypes,
// devices, index ranges; errors are c10::ValueError / c10::TypeError, Python's ValueError and
// TypeError), output allocation and dtype conversions, then the plain C++ kernels of kernels.h
// on raw pointers. Only per-operator ATen headers are included, so this file compiles fast.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#endif

#include "kernels.h"
#include "ops.h"

namespace specengine {
namespace {

void check_index(const at::Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK_VALUE(x.dim() == dim, name, " must have ", dim, " dims, got shape ", x.sizes());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kInt, name, " must be int32, got ", x.scalar_type());
}

void check_float_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
                   " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor");
}

}  // namespace

// ---- paged attention -----------------------------------------------------------------------
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
  const bool bf16_query = query.scalar_type() == at::kBFloat16;
  const bool fast = kdt == at::kBFloat16 && bf16_query && paged_attention_fast_available(D);
  const bool f32_fast =
      !fast && kdt == at::kFloat && paged_attention_f32_fast_available(D, H / KVH);
  const bool avx2 = !fast && !f32_fast && paged_attention_avx2_available(D, H / KVH);
  at::Tensor q;
  if (!fast) q = query.to(at::kFloat).mul(scale).contiguous();  // x * scale, as at::mul
  // a bf16 query gets a bf16 output: the kernels other than the generic one round their rows
  // themselves (to nearest even), with no float32 [T, H, D] and no conversion pass
  const bool out_bf16 = bf16_query && (fast || f32_fast || avx2);
  auto out = at::empty({T, H, D}, query.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  AttnArgs a{fast ? nullptr : q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
             bt.data_ptr<int32_t>(), qs_p, kl_p, tb.defined() ? tb.data_ptr<int32_t>() : nullptr,
             tm.defined() ? tm.data_ptr<bool>() : nullptr,
             out_bf16 ? nullptr : out.data_ptr<float>(), T, H, KVH, D, NB, BS, MB, W};
  if (out_bf16) a.out_bf16 = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (fast) {
    // heads of a token must be D apart; tokens may be further apart (q of a fused qkv row)
    const auto qc = query.stride(2) == 1 && query.stride(1) == D ? query : query.contiguous();
    a.q_stride = qc.stride(0);
    const auto* qb = reinterpret_cast<const uint16_t*>(qc.data_ptr());
    if (paged_attention_amx_available(D))
      paged_attention_amx(a, qb, static_cast<float>(scale));
    else
      paged_attention_bf16_fast(a, qb, static_cast<float>(scale));
  } else if (f32_fast) {
    paged_attention_f32_fast(a);
  } else if (avx2) {
    paged_attention_avx2(a, kdt == at::kBFloat16);
  } else {
    paged_attention_generic(a, kdt == at::kBFloat16);
  }
  return out.scalar_type() == query.scalar_type() ? out : out.to(query.scalar_type());
}

void store_rows_cpu(at::Tensor& data, at::Tensor& valid, const std::vector<int64_t>& slots,
                    const at::Tensor& rows) {
  TORCH_CHECK_VALUE(data.dim() == 2 && data.is_contiguous() && data.device().is_cpu(),
                    "data must be a contiguous [N, H] CPU tensor");
  TORCH_CHECK_VALUE(valid.dim() == 1 && valid.size(0) == data.size(0) &&
                        valid.scalar_type() == at::kBool && valid.is_contiguous(),
                    "valid must be a contiguous bool [N] tensor");
  const int64_t S = static_cast<int64_t>(slots.size()), N = data.size(0), H = data.size(1);
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(0) == S && rows.size(1) == H,
                    "rows must be [", S, ", ", H, "], got ", rows.sizes());
  for (int64_t i = 0; i < S; ++i)
    TORCH_CHECK_VALUE(slots[i] >= 0 && slots[i] < N, "slots[", i, "]=", slots[i],
                      " out of range [0, ", N, ")");
  auto src = rows.to(data.scalar_type()).contiguous();
  const int64_t bytes = H * data.element_size();
  auto* dst = static_cast<char*>(data.data_ptr());
  const auto* from = static_cast<const char*>(src.data_ptr());
  bool* ok = valid.data_ptr<bool>();
#if defined(__x86_64__) || defined(_M_X64)
  // Rows are read back only when a drafter drafts, many steps later: streaming stores write
  // them without first reading their (cold) lines into the cache, the slow part of a step's
  // store (measured in an engine: ~11 us a 1792-byte row, 0.2 ms of a 16-row step).
  const bool stream = bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(from) % 16 == 0;
  if (stream) {
    for (int64_t i = 0; i < S; ++i) {
      auto* d = reinterpret_cast<__m128i*>(dst + slots[i] * bytes);
      const auto* f = reinterpret_cast<const __m128i*>(from + i * bytes);
      for (int64_t j = 0; j < bytes / 16; ++j) _mm_stream_si128(d + j, _mm_load_si128(f + j));
      ok[slots[i]] = true;
    }
    _mm_sfence();
    return;
  }
#endif
  for (int64_t i = 0; i < S; ++i) {
    std::memcpy(dst + slots[i] * bytes, from + i * bytes, bytes);
    ok[slots[i]] = true;
  }
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
  // a token's KVH x D values must be one run (a view of a fused qkv row is); tokens may be
  // further apart: then no copy is made
  const auto rows_of = [&](const at::Tensor& x, const at::Tensor& cache) {
    const bool run = x.stride(2) == 1 && x.stride(1) == x.size(2);
    return x.scalar_type() == cache.scalar_type() && run ? x
                                                         : x.to(cache.scalar_type()).contiguous();
  };
  const auto k = rows_of(key, k_cache), v = rows_of(value, v_cache);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t bytes = row * k.element_size();
  const int64_t k_step = k.stride(0) * k.element_size(), v_step = v.stride(0) * v.element_size();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(sp[t] >= 0 && sp[t] < num_slots, "slot_mapping[", t, "]=", sp[t],
                      " out of range [0, ", num_slots, ")");
    std::memcpy(kc + sp[t] * bytes, ks + t * k_step, bytes);
    std::memcpy(vc + sp[t] * bytes, vs + t * v_step, bytes);
  }
}

// ---- linear, RoPE, RMSNorm, SiLU-and-multiply ---------------------------------------------
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& b) {
  check_float_dtype(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x must be [M, K], got shape ", x.sizes());
  TORCH_CHECK_VALUE(w.dim() == 2 && w.size(1) == x.size(1), "weight must be [N, K=", x.size(1),
                    "], got shape ", w.sizes());
  TORCH_CHECK_TYPE(w.scalar_type() == x.scalar_type(), "weight dtype ", w.scalar_type(),
                   " differs from x dtype ", x.scalar_type());
  TORCH_CHECK_VALUE(w.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  at::Tensor bias;
  if (b.has_value() && b->defined()) {
    TORCH_CHECK_VALUE(b->dim() == 1 && b->size(0) == N, "bias must be [N=", N, "], got ",
                      b->sizes());
    bias = b->to(at::kFloat).contiguous();
  }
  auto xc = x.contiguous();
  auto y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y.to(x.scalar_type());
  LinearArgs a{xc.data_ptr(), w.data_ptr(), bias.defined() ? bias.data_ptr<float>() : nullptr,
               y.data_ptr<float>(), M, N, K};
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  linear_kernel(a, is_bf16);
  return is_bf16 ? y.to(at::kBFloat16) : y;
}

void rope_inplace_cpu(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_float_dtype(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
                    "x must be [T, H, D] with contiguous even D, got ", x.sizes(), " strides ",
                    x.strides());
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2);
  for (const at::Tensor* c : {&cos, &sin}) {
    TORCH_CHECK_TYPE(c->scalar_type() == at::kFloat, "cos/sin must be float32, got ",
                     c->scalar_type());
    TORCH_CHECK_VALUE(c->dim() == 2 && c->size(0) == T && c->size(1) == D && c->stride(1) == 1,
                      "cos/sin must be [T=", T, ", D=", D, "] with contiguous rows, got ",
                      c->sizes());
  }
  if (T == 0 || H == 0) return;
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  rope_kernel(x.data_ptr(), x.scalar_type() == at::kBFloat16, cp, sp, T, H, D, x.stride(0),
              x.stride(1), cos.stride(0), sin.stride(0));
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_float_dtype(x, "x");
  const int64_t D = x.size(-1);
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == D, "weight must be [", D, "], got ", w.sizes());
  auto xc = x.contiguous();
  auto wc = w.to(x.scalar_type()).contiguous();
  auto out = at::empty_like(xc);
  const int64_t R = D ? xc.numel() / D : 0;
  rms_norm_kernel(xc.data_ptr(), nullptr, wc.data_ptr(), out.data_ptr(), nullptr,
                  x.scalar_type() == at::kBFloat16, R, D, static_cast<float>(eps));
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x,
                                                    const at::Tensor& residual,
                                                    const at::Tensor& w, double eps) {
  check_float_dtype(x, "x");
  TORCH_CHECK_VALUE(residual.sizes() == x.sizes(), "residual shape ", residual.sizes(),
                    " differs from x shape ", x.sizes());
  TORCH_CHECK_TYPE(residual.scalar_type() == x.scalar_type(), "residual dtype differs from x");
  const int64_t D = x.size(-1);
  TORCH_CHECK_VALUE(w.dim() == 1 && w.size(0) == D, "weight must be [", D, "], got ", w.sizes());
  auto xc = x.contiguous();
  auto rc = residual.contiguous();
  auto wc = w.to(x.scalar_type()).contiguous();
  auto out = at::empty_like(xc);
  auto new_res = at::empty_like(xc);
  const int64_t R = D ? xc.numel() / D : 0;
  rms_norm_kernel(xc.data_ptr(), rc.data_ptr(), wc.data_ptr(), out.data_ptr(),
                  new_res.data_ptr(), x.scalar_type() == at::kBFloat16, R, D,
                  static_cast<float>(eps));
  return {out, new_res};
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  check_float_dtype(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) % 2 == 0, "x last dim must be even, got ",
                    x.sizes());
  const int64_t d = x.size(-1) / 2;
  auto xc = x.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = d;
  auto out = at::empty(sizes, x.options());
  const int64_t R = d ? out.numel() / d : 0;
  silu_and_mul_kernel(xc.data_ptr(), out.data_ptr(), x.scalar_type() == at::kBFloat16, R, d);
  return out;
}

// ---- AMX-BF16 linear ----------------------------------------------------------------------
at::Tensor amx_pack_weight(const at::Tensor& w, bool glu) {
  TORCH_CHECK_VALUE(amx_available(), "AMX-BF16 is not available on this machine");
  TORCH_CHECK_TYPE(w.scalar_type() == at::kBFloat16, "weight must be bfloat16, got ",
                   w.scalar_type());
  TORCH_CHECK_VALUE(w.dim() == 2 && w.device().is_cpu(), "weight must be a 2-D CPU tensor");
  const int64_t N = w.size(0), K = w.size(1), Kb = (K + 31) / 32;
  TORCH_CHECK_VALUE(!glu || N % 32 == 0, "glu packing needs 2*I rows with I % 16 == 0, got ",
                    N);
  const int64_t P = glu ? N / 32 : (N + 31) / 32;
  auto wc = w.contiguous();
  auto packed = at::zeros({P, Kb, 2, 16, 32}, w.options());
  amx_pack(reinterpret_cast<const uint16_t*>(wc.data_ptr()),
           reinterpret_cast<uint16_t*>(packed.data_ptr()), N, K, glu);
  return packed;
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      const std::optional<at::Tensor>& bias, bool glu, bool out_f32) {
  TORCH_CHECK_VALUE(amx_available(), "AMX-BF16 is not available on this machine");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
                   "x and packed weight must be bfloat16");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.device().is_cpu(), "x must be [M, K] on the CPU");
  TORCH_CHECK_VALUE(packed.dim() == 5 && packed.size(2) == 2 && packed.size(3) == 16 &&
                        packed.size(4) == 32 && packed.is_contiguous(),
                    "packed weight must come from pack_weight_amx, got ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), Kb = packed.size(1);
  TORCH_CHECK_VALUE((K + 31) / 32 == Kb, "x has K=", K, " but the packed weight has ", Kb * 32,
                    " (padded) input features");
  TORCH_CHECK_VALUE(!(glu && out_f32), "glu mode writes bfloat16 (out_f32 must be false)");
  const int64_t out_n = glu ? N / 2 : N;
  TORCH_CHECK_VALUE(glu ? (N % 32 == 0 && P == N / 32) : (P == (N + 31) / 32),
                    "N=", N, " does not match the packed weight (", P, " pairs)");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(!glu, "glu mode takes no bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "bias must be [N=", N, "]");
    b = bias->scalar_type() == at::kFloat && bias->is_contiguous()
            ? *bias
            : bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, out_n}, x.options().dtype(out_f32 ? at::kFloat : at::kBFloat16));
  if (M == 0 || out_n == 0) return y;
  at::Tensor xp, xt;
  const uint16_t* xptr;
  int64_t xs;
  if (M > 16) {  // the kernel copies x into tile order (xt), zero-padding K itself
    xt = at::empty({(M + 31) / 32 * 2 * Kb * 512}, x.options());  // whole 32-row blocks
    xp = x.stride(1) == 1 ? x : x.contiguous();
    xptr = reinterpret_cast<const uint16_t*>(xp.data_ptr());
    xs = xp.stride(0);
  } else if (K % 32 == 0 && x.stride(1) == 1 && x.stride(0) >= K) {
    xptr = reinterpret_cast<const uint16_t*>(x.data_ptr());
    xs = x.stride(0);
  } else {
    xp = at::zeros({M, Kb * 32}, x.options());
    xp.narrow(1, 0, K).copy_(x);
    xptr = reinterpret_cast<const uint16_t*>(xp.data_ptr());
    xs = Kb * 32;
  }
  AmxArgs a{xptr, xs, reinterpret_cast<const uint16_t*>(packed.data_ptr()),
            b.defined() ? b.data_ptr<float>() : nullptr,
            y.data_ptr(), out_n, M, out_n, Kb, glu, out_f32,
            xt.defined() ? reinterpret_cast<uint16_t*>(xt.data_ptr()) : nullptr};
  // Logits bigger than a core's L2 cache: streamed to memory, their lines never read first.
  // SmolLM2's LM head at 64 rows (12.6 MB of float32 logits) took 4.0-4.4 ms instead of 5.6
  // on a 2-core AMX Xeon, the sampling after it no slower; smaller outputs stay in the caches
  // for the reader right after (a drafter's top-k).
  a.stream = out_f32 && M * out_n * 4 >= (int64_t{4} << 20);
  amx_linear_kernel(a, P, K);
  return y;
}

at::Tensor packed_linear(int64_t kind, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias, bool glu, bool out_f32) {
  if (kind == 0) return amx_linear(x, packed, n, bias, glu, out_f32);
  if (kind == 1) return avx512_linear(x, packed, n, bias, glu, out_f32);
  return avx2_linear(x, packed, n, bias, glu, out_f32);
}

// ---- AVX-512 linear -----------------------------------------------------------------------
at::Tensor avx512_pack_weight(const at::Tensor& w, bool glu) {
  TORCH_CHECK_VALUE(w.dim() == 2 && w.device().is_cpu(), "weight must be a 2-D CPU tensor, got ",
                    w.sizes());
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK_TYPE(bf16 || w.scalar_type() == at::kFloat,
                   "weight must be bfloat16 or float32, got ", w.scalar_type());
  TORCH_CHECK_VALUE(avx512_linear_available(bf16) || avx2_linear_available(),
                    "this CPU (or the SPECENGINE_ISA cap) has neither AVX-512",
                    bf16 ? " BF16" : "", " nor AVX2 + FMA");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK_VALUE(!glu || N % 64 == 0, "glu packing needs 2*I rows with I % 32 == 0, got ", N);
  const int64_t G = glu ? N / 64 : (N + kAvx512Group - 1) / kAvx512Group;
  auto wc = w.contiguous();
  if (bf16) {
    auto packed = at::zeros({G, (K + 1) / 2, kAvx512Group, 2}, w.options());
    avx512_pack_bf16(reinterpret_cast<const uint16_t*>(wc.data_ptr()),
                     reinterpret_cast<uint16_t*>(packed.data_ptr()), N, K, glu);
    return packed;
  }
  auto packed = at::zeros({G, K, kAvx512Group}, w.options());
  avx512_pack_f32(wc.data_ptr<float>(), packed.data_ptr<float>(), N, K, glu);
  return packed;
}

namespace {
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias, bool glu, bool out_f32,
                         bool avx2) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK_TYPE(x.scalar_type() == packed.scalar_type(), "x dtype ", x.scalar_type(),
                   " differs from the packed weight's ", packed.scalar_type());
  if (avx2) {
    TORCH_CHECK_VALUE(avx2_linear_available(),
                      "this CPU (or the SPECENGINE_ISA cap) lacks AVX2 + FMA");
  } else {
    TORCH_CHECK_VALUE(avx512_linear_available(bf16),
                      "this CPU (or the SPECENGINE_ISA cap) lacks AVX-512", bf16 ? " BF16" : "");
  }
  TORCH_CHECK_VALUE(x.dim() == 2 && x.device().is_cpu(), "x must be [M, K] on the CPU, got ",
                    x.sizes());
  TORCH_CHECK_VALUE(packed.is_contiguous() && packed.size(-1) == (bf16 ? 2 : kAvx512Group) &&
                        packed.dim() == (bf16 ? 4 : 3),
                    "packed weight must come from avx512_pack_weight, got ", packed.sizes());
  const int64_t M = x.size(0), K = x.size(1), G = packed.size(0);
  const int64_t Kpad = bf16 ? 2 * packed.size(1) : packed.size(1);
  TORCH_CHECK_VALUE(bf16 ? (K + 1) / 2 * 2 == Kpad : K == Kpad, "x has K=", K,
                    " but the packed weight has ", Kpad, " input features");
  TORCH_CHECK_VALUE(glu ? (N % 64 == 0 && G == N / 64)
                        : (G == (N + kAvx512Group - 1) / kAvx512Group),
                    "N=", N, " does not match the packed weight (", G, " groups)");
  const int64_t out_n = glu ? N / 2 : N;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK_VALUE(!glu, "glu mode takes no bias");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "bias must be [N=", N, "], got ",
                      bias->sizes());
    b = bias->scalar_type() == at::kFloat && bias->is_contiguous()
            ? *bias
            : bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, out_n}, x.options().dtype(out_f32 ? at::kFloat : x.scalar_type()));
  if (M == 0 || out_n == 0) return y;
  at::Tensor xc = x;
  if (x.stride(1) != 1 || Kpad != K || x.stride(0) < K) {
    xc = at::zeros({M, Kpad}, x.options());
    xc.narrow(1, 0, K).copy_(x);
  }
  Avx512LinearArgs a{xc.data_ptr(), xc.stride(0), packed.data_ptr(),
                     b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr(), out_n, M, out_n,
                     Kpad, glu, out_f32 || !bf16, bf16};
  if (avx2) avx2_linear_kernel(a, G, packed.element_size());
  else avx512_linear_kernel(a, G, packed.element_size());
  return y;
}
}  // namespace

at::Tensor avx512_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                         const std::optional<at::Tensor>& bias, bool glu, bool out_f32) {
  return packed_linear(x, packed, N, bias, glu, out_f32, false);
}

at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       const std::optional<at::Tensor>& bias, bool glu, bool out_f32) {
  return packed_linear(x, packed, N, bias, glu, out_f32, true);
}

// ---- sampling noise -----------------------------------------------------------------------
namespace {
void check_positions(const at::Tensor& positions, int64_t vocab) {
  TORCH_CHECK_VALUE(positions.dim() == 1 && positions.scalar_type() == at::kLong,
                    "positions must be a 1-D int64 tensor, got ", positions.sizes(), " ",
                    positions.scalar_type());
  TORCH_CHECK_VALUE(vocab >= 1, "vocab must be >= 1, got ", vocab);
}

void check_streams(const at::Tensor& keys, const at::Tensor& positions) {
  TORCH_CHECK_VALUE(keys.dim() == 1 && keys.scalar_type() == at::kLong,
                    "keys must be a 1-D int64 tensor, got ", keys.sizes(), " ",
                    keys.scalar_type());
  TORCH_CHECK_VALUE(keys.size(0) == positions.size(0), "keys and positions must have the same "
                    "length, got ", keys.size(0), " and ", positions.size(0));
}
}  // namespace

at::Tensor exponential_noise(int64_t key, const at::Tensor& positions, int64_t vocab) {
  check_positions(positions, vocab);
  const auto pos = positions.contiguous();
  const int64_t P = pos.size(0);
  auto out = at::empty({P, vocab}, at::TensorOptions().dtype(at::kFloat));
  exponential_noise_kernel(key, pos.data_ptr<int64_t>(), P, vocab, out.data_ptr<float>());
  return out;
}

at::Tensor exponential_noise_batch(const at::Tensor& keys, const at::Tensor& positions,
                                   int64_t vocab) {
  check_positions(positions, vocab);
  check_streams(keys, positions);
  const auto k = keys.contiguous();
  const auto pos = positions.contiguous();
  const int64_t P = pos.size(0);
  auto out = at::empty({P, vocab}, at::TensorOptions().dtype(at::kFloat));
  exponential_noise_rows_kernel(k.data_ptr<int64_t>(), 1, pos.data_ptr<int64_t>(), P, vocab,
                                out.data_ptr<float>());
  return out;
}

at::Tensor exponential_race(const at::Tensor& probs, const at::Tensor& keys,
                            const at::Tensor& positions) {
  TORCH_CHECK_VALUE(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.size(1) >= 1,
                    "probs must be a [S, V >= 1] float32 tensor, got ", probs.sizes(), " ",
                    probs.scalar_type());
  check_positions(positions, probs.size(1));
  check_streams(keys, positions);
  TORCH_CHECK_VALUE(keys.size(0) == probs.size(0), "probs must have one row per key, got ",
                    probs.size(0), " rows and ", keys.size(0), " keys");
  const auto pr = probs.contiguous();
  const auto k = keys.contiguous();
  const auto pos = positions.contiguous();
  const int64_t S = pr.size(0), V = pr.size(1);
  auto out = at::empty({S}, at::TensorOptions().dtype(at::kLong));
  exponential_race_kernel(pr.data_ptr<float>(), k.data_ptr<int64_t>(), pos.data_ptr<int64_t>(),
                          S, V, out.data_ptr<int64_t>());
  return out;
}

namespace {
// x as a contiguous [R, V >= 1] float32 CPU tensor; a ValueError naming what is wrong else.
at::Tensor checked_rows(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) >= 1 &&
                        x.device().is_cpu(),
                    "x must be a [R, V >= 1] float32 CPU tensor, got ", x.sizes(), " ",
                    x.scalar_type(), " on ", x.device());
  return x.contiguous();
}
}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  const auto xc = checked_rows(x);
  auto out = at::empty({x.size(0)}, at::TensorOptions().dtype(at::kLong));
  argmax_rows_kernel(xc.data_ptr<float>(), xc.size(0), xc.size(1), out.data_ptr<int64_t>());
  return out;
}

at::Tensor softmax_rows(const at::Tensor& x) {
  const auto xc = checked_rows(x);
  auto out = at::empty_like(xc);
  softmax_rows_kernel(xc.data_ptr<float>(), xc.size(0), xc.size(1), out.data_ptr<float>());
  return out;
}

at::Tensor softmax_race(const at::Tensor& x, const at::Tensor& keys,
                        const at::Tensor& positions, const std::optional<at::Tensor>& rows) {
  const auto xc = checked_rows(x);
  check_positions(positions, xc.size(1));
  check_streams(keys, positions);
  at::Tensor rc;
  if (rows.has_value()) {
    TORCH_CHECK_VALUE(rows->dim() == 1 && rows->scalar_type() == at::kLong,
                      "rows must be a [S] int64 tensor, got ", rows->sizes(), " ",
                      rows->scalar_type());
    rc = rows->contiguous();
    const int64_t* r = rc.data_ptr<int64_t>();
    for (int64_t i = 0; i < rc.size(0); ++i)
      TORCH_CHECK_VALUE(r[i] >= 0 && r[i] < xc.size(0), "rows[", i, "]=", r[i],
                        " is not a row of x (", xc.size(0), " rows)");
  }
  const int64_t S = rc.defined() ? rc.size(0) : xc.size(0);
  TORCH_CHECK_VALUE(keys.size(0) == S, "x must have one row per key (or rows one entry per "
                    "key), got ", S, " rows and ", keys.size(0), " keys");
  const auto k = keys.contiguous();
  const auto pos = positions.contiguous();
  auto out = at::empty({S}, at::TensorOptions().dtype(at::kLong));
  softmax_race_kernel(xc.data_ptr<float>(), rc.defined() ? rc.data_ptr<int64_t>() : nullptr,
                      k.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), S, xc.size(1),
                      out.data_ptr<int64_t>());
  return out;
}

std::tuple<at::Tensor, at::Tensor> coupled_topk(const at::Tensor& logits, int64_t k,
                                                const at::Tensor& temperature,
                                                const at::Tensor& keys,
                                                const at::Tensor& positions,
                                                const std::optional<at::Tensor>& vocab_map) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && logits.scalar_type() == at::kFloat &&
                    logits.size(1) >= 1 && logits.device().is_cpu(),
                    "logits must be a CPU [R, Vd >= 1] float32 tensor, got ", logits.sizes(),
                    " ", logits.scalar_type());
  const int64_t R = logits.size(0), Vd = logits.size(1);
  TORCH_CHECK_VALUE(k >= 1 && k <= Vd, "k must be in [1, ", Vd, "], got ", k);
  TORCH_CHECK_VALUE(temperature.dim() == 1 && temperature.size(0) == R &&
                    temperature.scalar_type() == at::kFloat,
                    "temperature must be a [R] float32 tensor with R = ", R, ", got ",
                    temperature.sizes(), " ", temperature.scalar_type());
  check_streams(keys, positions);
  TORCH_CHECK_VALUE(keys.size(0) == R, "keys must have one entry per row of logits (", R,
                    "), got ", keys.size(0));
  check_positions(positions, 1);
  const int64_t* map = nullptr;
  at::Tensor vm;
  if (vocab_map.has_value()) {
    vm = vocab_map->contiguous();
    TORCH_CHECK_VALUE(vm.dim() == 1 && vm.size(0) == Vd && vm.scalar_type() == at::kLong,
                      "vocab_map must be a [Vd] int64 tensor with Vd = ", Vd, ", got ",
                      vm.sizes(), " ", vm.scalar_type());
    map = vm.data_ptr<int64_t>();
    for (int64_t i = 0; i < Vd; ++i) {
      TORCH_CHECK_VALUE(map[i] >= 0, "vocab_map must hold token ids >= 0, got ", map[i]);
    }
  }
  const auto lg = logits.contiguous();
  const auto t = temperature.contiguous();
  for (int64_t r = 0; r < R; ++r) {
    const float tr = t.data_ptr<float>()[r];
    TORCH_CHECK_VALUE(tr >= 0.f, "temperature must be >= 0 (0: greedy), got ", tr, " in row ",
                      r);
  }
  const auto ks = keys.contiguous();
  const auto pos = positions.contiguous();
  auto values = at::empty({R, k}, at::TensorOptions().dtype(at::kFloat));
  auto indices = at::empty({R, k}, at::TensorOptions().dtype(at::kLong));
  coupled_topk_kernel(lg.data_ptr<float>(), R, Vd, t.data_ptr<float>(), ks.data_ptr<int64_t>(),
                      pos.data_ptr<int64_t>(), map, k, values.data_ptr<float>(),
                      indices.data_ptr<int64_t>());
  return {values, indices};
}

}  // namespace specengine
