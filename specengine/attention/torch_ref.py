"""Pure-torch paged attention: the reference every other backend is tested against."""

from __future__ import annotations

import torch

from specengine.attention.base import AttentionBackend, AttentionMetadata


def paged_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Reference paged attention, one query token at a time, computed in float32.

    Args and result as in ``AttentionBackend.forward``. Slow; for tests and fallbacks.
    """
    T, H, D = query.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    group = H // kvh
    out = torch.empty(T, H, D, dtype=torch.float32, device=query.device)
    for t in range(T):
        n = int(meta.kv_lens[t])
        row = meta.block_tables[int(meta.query_seq[t])]
        pos = torch.arange(n, device=query.device)
        blocks = row[pos // bs].long()
        k = k_cache[blocks, pos % bs].float()  # [n, kvh, D]
        v = v_cache[blocks, pos % bs].float()
        k = k.repeat_interleave(group, dim=1)  # [n, H, D]
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", query[t].float(), k) * scale
        p = torch.softmax(s, dim=-1)
        out[t] = torch.einsum("hn,nhd->hd", p, v)
    return out.to(query.dtype)


class TorchAttention(AttentionBackend):
    """Backend running ``paged_attention_ref``; works on any device, slow."""

    name = "torch"

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        return paged_attention_ref(query, k_cache, v_cache, meta, scale)
