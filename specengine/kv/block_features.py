"""Target hidden states kept per KV slot, so a prefix-cache hit can hand a feature-reading
drafter (EAGLE, the training ``Harvester``) the features of the tokens it did not recompute.

Slot ``b * block_size + o`` holds the target's last hidden state (after the final norm) of the
token whose K/V sit at that slot, once the engine has observed it. Validity is per slot: a
block handed out fresh is invalid until written, a copy-on-write copies features with the K/V,
and ``BlockManager`` attaches a cached block for a feature-reading drafter only when all its
slots are valid.
"""

from __future__ import annotations

import torch

from specengine.ops.extension import ext


class BlockFeatures:
    """Features ``[num_blocks * block_size, hidden_size]`` and their validity per slot.

    Args:
        num_blocks, block_size: the target's KV pool geometry.
        hidden_size: features per token.
        dtype, device: of the target's hidden states.
    """

    def __init__(self, num_blocks: int, block_size: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.hidden_size = hidden_size
        self.data = torch.zeros(num_blocks * block_size, hidden_size, dtype=dtype, device=device)
        self.valid = torch.zeros(num_blocks * block_size, dtype=torch.bool)

    def invalidate(self, blocks: list[int]) -> None:
        """Blocks handed out fresh: their slots hold no feature any more."""
        bs = self.block_size
        for b in blocks:
            self.valid[b * bs:(b + 1) * bs] = False

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: block ``dst`` gets ``src``'s features and validity."""
        bs = self.block_size
        self.data[dst * bs:(dst + 1) * bs] = self.data[src * bs:(src + 1) * bs]
        self.valid[dst * bs:(dst + 1) * bs] = self.valid[src * bs:(src + 1) * bs]

    def write(self, slots: list[int], feats: torch.Tensor) -> None:
        """Store ``feats`` ``[len(slots), hidden_size]`` at ``slots``.

        Raises:
            ValueError: the row count differs from ``len(slots)``.
        """
        if feats.shape[0] != len(slots):
            raise ValueError(f"BlockFeatures.write: {feats.shape[0]} rows for {len(slots)} slots")
        if not slots:
            return
        mod = ext()
        if mod is not None and self.data.device.type == "cpu" and hasattr(mod, "store_rows"):
            mod.store_rows(self.data, self.valid, slots, feats)  # one call, every step
            return
        idx = torch.tensor(slots, dtype=torch.int64)
        self.data.index_copy_(0, idx.to(self.data.device), feats.to(self.data.dtype))
        self.valid.index_fill_(0, idx, True)

    def read(self, slots: list[int]) -> torch.Tensor:
        """Features ``[len(slots), hidden_size]`` at ``slots`` (a copy).

        Raises:
            RuntimeError: a slot holds no valid feature.
        """
        idx = torch.tensor(slots, dtype=torch.int64)
        if not bool(self.valid[idx].all()):
            raise RuntimeError("BlockFeatures.read: a slot holds no valid feature")
        return self.data[idx.to(self.data.device)]

    def all_valid(self, slots: list[int]) -> bool:
        """Whether every one of ``slots`` holds a valid feature."""
        return bool(self.valid[torch.tensor(slots, dtype=torch.int64)].all())

    def covers(self, block: int, num_slots: int | None = None) -> bool:
        """Whether the first ``num_slots`` slots of ``block`` (default: all) hold valid
        features."""
        bs = self.block_size
        return bool(self.valid[block * bs:block * bs + (num_slots or bs)].all())
