"""Attention backend interface and the metadata every backend reads.

The KV cache of one layer is two tensors ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype (vLLM's PagedAttention
layout, one block = ``block_size`` consecutive token positions of one sequence). A flat *slot*
index is ``block_id * block_size + offset``.

One forward packs the new tokens of every scheduled sequence into ``T`` rows (prefill chunks,
decode tokens and, later, draft-tree tokens). Query row ``t`` belongs to batch row
``query_seq[t]`` whose block table is ``block_tables[query_seq[t]]``, and attends to the KV
positions ``0 .. kv_lens[t]-1`` of that sequence (causal attention: ``kv_lens[t] = position+1``).
The new tokens' K/V are written into the cache (``write_kv``) before ``forward`` reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where new K/V go and what each query token attends to.

    Attributes:
        slot_mapping: ``[T]`` int64, flat cache slot for each new token's K/V.
        block_tables: ``[S, max_blocks]`` int32, block ids per batch row (padding: any value,
            never read past ``ceil(kv_len / block_size)``).
        query_seq: ``[T]`` int32, batch row of each query token.
        kv_lens: ``[T]`` int32, number of KV positions each query token attends to (>= 1).
        max_kv_len: ``max(kv_lens)`` as a Python int (sizing scratch buffers).
        tree_base: optional ``[T]`` int32, start of each query's masked window of new (draft
            tree) KV positions; given together with ``tree_mask``.
        tree_mask: optional ``[T, W]`` bool. With it, query ``t`` attends to KV position
            ``p < kv_lens[t]`` iff ``p < tree_base[t]`` or ``tree_mask[t, p - tree_base[t]]``
            (its committed context plus its ancestors and itself in the tree). Rows that are not
            tree tokens use ``tree_base[t] = kv_lens[t]`` (plain causal attention).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_seq: torch.Tensor
    kv_lens: torch.Tensor
    max_kv_len: int
    tree_base: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None


class AttentionBackend:
    """Paged attention over the KV cache; one instance is shared by all layers.

    Subclasses: ``TorchAttention`` (reference, used in tests), ``CpuAttention`` (C++ extension).
    Later: Triton, CUDA and FlashInfer backends and tree-verify masks plug in here.
    """

    name = "base"

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[T]``."""
        bs = k_cache.shape[1]
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        k_cache[blocks, offsets] = key.to(k_cache.dtype)
        v_cache[blocks, offsets] = value.to(v_cache.dtype)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention output ``[T, num_heads, head_dim]`` (dtype of ``query``) for ``query``
        ``[T, num_heads, head_dim]``; ``num_heads`` is a multiple of ``num_kv_heads`` (GQA)."""
        raise NotImplementedError
