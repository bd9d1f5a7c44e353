"""Paged (tree) attention on NVIDIA GPUs through the CUDA kernel of the C++ extension
(``csrc/cuda/paged_attention.cu``; built when torch has CUDA and nvcc is present)."""

from __future__ import annotations

import torch

from specengine.attention.base import AttentionBackend, AttentionMetadata
from specengine.ops.extension import ext


class CudaAttention(AttentionBackend):
    """Backend running ``specengine._C.paged_attention_cuda`` (fp32, fp16, bf16; tree masks).

    Raises:
        ImportError: the extension was built without CUDA.
    """

    name = "cuda"

    def __init__(self):
        mod = ext()
        if mod is None or not getattr(mod, "with_cuda", False):
            raise ImportError("specengine._C was built without CUDA; rebuild with a CUDA torch "
                              "and nvcc on PATH")
        self._attention = mod.paged_attention_cuda

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._attention(query.contiguous(), k_cache, v_cache, meta.block_tables,
                               meta.query_seq, meta.kv_lens, scale, meta.tree_base,
                               meta.tree_mask)
