"""The paged KV cache's bookkeeping: block allocator, block tables, and sizing."""

from __future__ import annotations

import torch


def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block in all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem
