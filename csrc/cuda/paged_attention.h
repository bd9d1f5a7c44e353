// Launcher of the CUDA paged attention kernel; plain C++ types only, so the torch-facing
// wrapper (csrc/cuda_ops.cpp) and the self-contained kernel (paged_attention.cu) share it.
#pragma once

#include <cstdint>

namespace specengine {

enum class AttnDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct PagedAttentionParams {
  const void* query;            // [T, H, D], dtype
  const void* k_cache;          // [num_blocks, BS, KVH, D], dtype
  const void* v_cache;
  void* out;                    // [T, H, D], dtype
  const int32_t* block_tables;  // [S, MB]
  const int32_t* query_seq;     // [T]
  const int32_t* kv_lens;       // [T]
  const int32_t* tree_base;     // [T] or nullptr
  const bool* tree_mask;        // [T, W] or nullptr
  int64_t T, H, KVH, D, BS, MB, W;
  float scale;
};

constexpr int64_t kCudaAttnMaxHeadDim = 256;

// Launches on `stream` (a cudaStream_t); returns a cudaError_t as int (0 = success).
int launch_paged_attention(AttnDtype dtype, const PagedAttentionParams& p, void* stream);

}  // namespace specengine
