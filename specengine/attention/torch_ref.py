"""Pure-torch paged attention: the reference every other backend is tested against."""

from __future__ import annotations

import torch

from specengine.attention.base import AttentionBackend, AttentionMetadata


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference paged attention, one query token at a time, computed in float32.

    Honours the tree mask (``meta.tree_base``/``meta.tree_mask``) when given. Args and result as
    in ``AttentionBackend.forward``; a query row that sees no position gets zeros. Slow; for
    tests and fallbacks.
    """
    T, H, D = query.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = H // kvh
    out = torch.zeros(T, H, D, dtype=torch.float32, device=query.device)
    width = meta.tree_mask.shape[1] if meta.tree_mask is not None else 0
    for t in range(T):
        pos = torch.arange(int(meta.kv_lens[t]), device=query.device)
        if meta.tree_mask is not None:
            rel = pos - int(meta.tree_base[t])
            seen = rel < 0
            if width:
                seen |= (rel < width) & meta.tree_mask[t, rel.clamp(0, width - 1)]
            pos = pos[seen]
        if pos.numel() == 0:
            continue
        blocks = meta.block_tables[int(meta.query_seq[t])][pos // bs].long()
        k = k_cache[blocks, pos % bs].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache[blocks, pos % bs].float().repeat_interleave(group, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", query[t].float(), k) * scale, dim=-1)
        out[t] = torch.einsum("hn,nhd->hd", p, v)
    return out.to(query.dtype)


class TorchAttention(AttentionBackend):
    """Backend running ``paged_attention_ref``; works on any device, slow."""

    name = "torch"

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        return paged_attention_ref(query, k_cache, v_cache, meta, scale)
