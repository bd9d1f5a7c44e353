// Paged attention on CUDA with the semantics of specengine/attention/base.py (vLLM
// PagedAttention cache layout; online softmax as in FlashAttention, Dao et al. 2022).
//
// One thread block per (query token, query head); its kWarps warps take KV positions
// round-robin, each lane holding head_dim/32 strided elements of q and of the output, and keep
// their own running max / sum; the warps' partial results are merged through shared memory.
// All math is float32 whatever the storage dtype (float32, float16, bfloat16).
// Self-contained (no torch headers) so it compiles quickly on its own.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "paged_attention.h"

namespace specengine {
namespace {

constexpr int kWarps = 4;
constexpr int kPerLane = kCudaAttnMaxHeadDim / 32;

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
paged_attention_kernel(PagedAttentionParams p) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t g = h / (p.H / p.KVH), D = p.D;
  const int64_t n = p.kv_lens[t];
  const int64_t base = p.tree_mask ? p.tree_base[t] : n;
  const bool* mask = p.tree_mask ? p.tree_mask + t * p.W : nullptr;
  const int32_t* table = p.block_tables + static_cast<int64_t>(p.query_seq[t]) * p.MB;
  const T* query = static_cast<const T*>(p.query) + (t * p.H + h) * D;
  const T* kc = static_cast<const T*>(p.k_cache);
  const T* vc = static_cast<const T*>(p.v_cache);

  float q[kPerLane], acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t d = lane + 32 * i;
    q[i] = d < D ? to_f(query[d]) * p.scale : 0.f;
    acc[i] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  auto attend = [&](int64_t pos) {
    const int64_t row = ((static_cast<int64_t>(table[pos / p.BS]) * p.BS + pos % p.BS) * p.KVH
                         + g) * D;
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < D) s += q[i] * to_f(kc[row + d]);
    }
    s = warp_sum(s);
    const float mnew = fmaxf(m, s);
    const float alpha = expf(m - mnew);  // 0 while m is -inf
    const float e = expf(s - mnew);
    l = l * alpha + e;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t d = lane + 32 * i;
      if (d < D) acc[i] = acc[i] * alpha + e * to_f(vc[row + d]);
    }
    m = mnew;
  };
  // The visible keys as one compact sequence (committed keys, then the node's visible tree
  // slots in order), key k to warp k % kWarps: a tree node's warps then sum the same keys in
  // the same order as decoding its path alone, where those keys sit next to each other, and
  // its output is bit for bit that decode's.
  const int64_t committed = n < base ? n : base;
  for (int64_t pos = warp; pos < committed; pos += kWarps) attend(pos);
  int64_t k = committed;
  for (int64_t j = 0; j < n - committed; ++j) {  // warp-uniform: the mask is per query row
    if (!(j < p.W && mask[j])) continue;
    if (k % kWarps == warp) attend(base + j);
    ++k;
  }

  __shared__ float s_m[kWarps], s_l[kWarps];
  __shared__ float s_acc[kWarps][kCudaAttnMaxHeadDim];
  if (lane == 0) {
    s_m[warp] = m;
    s_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int64_t d = lane + 32 * i;
    if (d < D) s_acc[warp][d] = acc[i];
  }
  __syncthreads();
  if (warp != 0) return;
  float mx = -INFINITY;
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, s_m[w]);
  float wgt[kWarps], total = 0.f;
  for (int w = 0; w < kWarps; ++w) {
    wgt[w] = s_m[w] == -INFINITY ? 0.f : expf(s_m[w] - mx);
    total += wgt[w] * s_l[w];
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;  // no visible position: zeros
  T* out = static_cast<T*>(p.out) + (t * p.H + h) * D;
  for (int64_t d = lane; d < D; d += 32) {
    float o = 0.f;
    for (int w = 0; w < kWarps; ++w) o += wgt[w] * s_acc[w][d];
    out[d] = from_f<T>(o * inv);
  }
}

template <typename T>
int launch(const PagedAttentionParams& p, cudaStream_t stream) {
  if (p.T == 0) return 0;
  const dim3 grid(static_cast<unsigned>(p.T), static_cast<unsigned>(p.H));
  paged_attention_kernel<T><<<grid, kWarps * 32, 0, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_paged_attention(AttnDtype dtype, const PagedAttentionParams& p, void* stream) {
  if (p.D > kCudaAttnMaxHeadDim || p.KVH <= 0 || p.H % p.KVH != 0)
    return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case AttnDtype::kFloat32: return launch<float>(p, s);
    case AttnDtype::kFloat16: return launch<__half>(p, s);
    case AttnDtype::kBFloat16: return launch<__nv_bfloat16>(p, s);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace specengine
