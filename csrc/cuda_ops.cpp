// Torch-facing wrapper of the CUDA paged attention kernel (csrc/cuda/paged_attention.cu).
// Compiled only when the extension is built with CUDA (SPECENGINE_WITH_CUDA).
#ifdef SPECENGINE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include "cuda/paged_attention.h"
#include "ops.h"

namespace specengine {

at::Tensor paged_attention_cuda(const at::Tensor& query, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_tables,
                                const at::Tensor& query_seq, const at::Tensor& kv_lens,
                                double scale, const std::optional<at::Tensor>& tree_base,
                                const std::optional<at::Tensor>& tree_mask) {
  check_paged_attention_args(query, k_cache, v_cache, block_tables, query_seq, kv_lens,
                             tree_base, tree_mask);
  TORCH_CHECK_VALUE(query.is_cuda(), "paged_attention_cuda needs CUDA tensors");
  TORCH_CHECK_TYPE(query.scalar_type() == k_cache.scalar_type(), "query dtype ",
                   query.scalar_type(), " differs from cache dtype ", k_cache.scalar_type());
  AttnDtype dtype;
  switch (query.scalar_type()) {
    case at::kFloat: dtype = AttnDtype::kFloat32; break;
    case at::kHalf: dtype = AttnDtype::kFloat16; break;
    case at::kBFloat16: dtype = AttnDtype::kBFloat16; break;
    default: TORCH_CHECK_TYPE(false, "query must be float32, float16 or bfloat16, got ",
                              query.scalar_type());
  }
  TORCH_CHECK_VALUE(query.size(2) <= kCudaAttnMaxHeadDim, "head_dim ", query.size(2),
                    " > ", kCudaAttnMaxHeadDim, " is not supported");
  const c10::cuda::CUDAGuard guard(query.device());
  auto q = query.contiguous();
  auto bt = block_tables.contiguous();
  auto qs = query_seq.contiguous();
  auto kl = kv_lens.contiguous();
  at::Tensor tb, tm;
  if (tree_mask.has_value()) {
    tb = tree_base->contiguous();
    tm = tree_mask->contiguous();
  }
  auto out = at::empty_like(q);
  PagedAttentionParams p{q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                         bt.data_ptr<int32_t>(), qs.data_ptr<int32_t>(), kl.data_ptr<int32_t>(),
                         tb.defined() ? tb.data_ptr<int32_t>() : nullptr,
                         tm.defined() ? tm.data_ptr<bool>() : nullptr,
                         q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                         bt.size(1), tm.defined() ? tm.size(1) : 0, static_cast<float>(scale)};
  const int err = launch_paged_attention(dtype, p, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "paged_attention_cuda launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
  return out;
}

}  // namespace specengine
#endif  // SPECENGINE_WITH_CUDA
