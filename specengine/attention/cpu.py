"""Paged attention on the CPU through the C++ extension (``csrc/attention.cpp``).

One kernel serves prefill, decode and tree-verify tokens: work is split over (query token,
KV head), the query heads of a GQA group share each K/V row read, and the softmax is computed
online in float32 in fixed steps of keys, whatever the block size (FlashAttention-style). The
kernel is picked per call from the CPU and ``SPECENGINE_ISA``: AMX tiles or AVX-512 BF16 for
bfloat16 caches, AVX-512F for float32 caches (head_dim a multiple of 16, at most 128), AVX2 +
FMA for either (head_dim a multiple of 8, at most 128: CPUs without AVX-512, and the head sizes
the AVX-512 paths do not take), else a portable loop. Falls back to the torch reference when
the extension is missing or the tensors are not CPU float32/bfloat16.
"""

from __future__ import annotations

import torch

from specengine.attention.base import AttentionBackend, AttentionMetadata
from specengine.attention.torch_ref import paged_attention_ref
from specengine.ops.extension import ext

_FLOATS = (torch.float32, torch.bfloat16)


# The torch reference honours tree masks; kept under this name for the kernel tests.
paged_attention_masked_ref = paged_attention_ref


class CpuAttention(AttentionBackend):
    """Backend running the C++ CPU kernel (``specengine._C.paged_attention``)."""

    name = "cpu"

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        mod = ext()
        if (mod is None or k_cache.device.type != "cpu" or not k_cache.is_contiguous()
                or not v_cache.is_contiguous()):
            return super().write_kv(k_cache, v_cache, key, value, slot_mapping)
        mod.write_kv(k_cache, v_cache, key, value, slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        mod = ext()
        if (mod is None or query.device.type != "cpu" or query.dtype not in _FLOATS
                or k_cache.dtype not in _FLOATS):
            return paged_attention_ref(query, k_cache, v_cache, meta, scale)
        return mod.paged_attention(query, k_cache, v_cache, meta.block_tables, meta.query_seq,
                                   meta.kv_lens, scale, meta.tree_base, meta.tree_mask)
