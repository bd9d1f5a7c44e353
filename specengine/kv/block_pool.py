"""``BlockPool``: sequences' block tables over the reference-counted block allocator (vLLM's
PagedAttention).

A sequence's K/V for position ``p`` live in block ``block_table[p // block_size]`` at offset
``p % block_size``. The ``n`` samples of one prompt share the prompt's blocks (reference counts);
the first sample that writes into a shared block gets its own copy (copy-on-write). With a
``PrefixCache`` the cache holds one reference of its own on each registered block; the blocks
nobody else uses are evictable and evicted least-recently-released first when a fresh block is
needed. Prefix caching itself (what is registered, matched, admitted) is ``BlockManager``'s
(``kv/block_manager.py``), built on this pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specengine.engine.sequence import Sequence
from specengine.kv.allocator import make_allocator
from specengine.kv.block_features import BlockFeatures
from specengine.kv.prefix_cache import PrefixCache


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (blocks needed for ``a`` tokens of ``b`` per block)."""
    return -(-a // b)


class BlockPool:
    """Gives sequences KV blocks and takes them back (no prefix caching decisions here).

    Args:
        num_blocks: size of the pool (blocks).
        block_size: tokens per block.
        copy_block: ``copy_block(src, dst)`` copies one block's K/V in every layer (used for
            copy-on-write of a shared block).
        cache: the prefix cache whose references count here, or None.

    ``num_free`` counts the blocks a request can get: the allocator's free blocks plus the
    cached blocks nobody uses (evicted on demand). ``features`` (target features per slot, for
    drafters that read them) is None until ``BlockManager.track_features``.
    """

    def __init__(self, num_blocks: int, block_size: int, copy_block: Callable[[int, int], None],
                 cache: PrefixCache | None = None):
        self.block_size = block_size
        self.allocator = make_allocator(num_blocks)
        self.copy_block = copy_block
        self.cache = cache
        self.features: BlockFeatures | None = None

    @property
    def num_free(self) -> int:
        """Blocks available to new work: free ones plus evictable cached ones."""
        return self.allocator.num_free + (self.cache.num_evictable if self.cache is not None else 0)

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self.cache) if self.cache is not None else 0

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody uses (refcount 1, the cache's own reference)."""
        return self.cache.num_evictable if self.cache is not None else 0

    # ---- allocation primitives -------------------------------------------------------------
    def _alloc_n(self, n: int) -> list[int]:
        """``n`` fresh blocks with refcount 1, evicting least-recently-released cached blocks
        when the free list is short. Raises RuntimeError (nothing changed) if ``n`` exceed
        ``num_free``."""
        if n > self.num_free:
            raise RuntimeError(f"out of KV blocks: asked for {n}, {self.num_free} free")
        while self.allocator.num_free < n:
            self.allocator.free(self.cache.pop_lru())  # drops the cache's reference
        blocks = list(self.allocator.allocate_n(n))
        if self.features is not None:
            self.features.invalidate(blocks)
        return blocks

    def _release(self, block: int) -> None:
        """Drop one user's reference; a cached block left with only the cache's reference
        becomes evictable."""
        self.allocator.free(block)
        if self.cache is not None and self.cache.is_registered(block) \
                and self.allocator.refcount(block) == 1:
            self.cache.release(block)

    def _attach(self, block: int) -> None:
        """One more user of cached ``block`` (revived if it was evictable)."""
        self.cache.acquire(block)
        self.allocator.incref(block)

    def _register(self, h: bytes, block: int) -> bool:
        """Register ``block`` under ``h`` (the cache takes a reference) unless either is
        registered already; returns whether it was."""
        if self.cache.lookup(h) is not None or self.cache.is_registered(block):
            return False
        self.cache.register(h, block)
        self.allocator.incref(block)
        return True

    def _drop(self, block: int) -> None:
        """Unregister ``block`` and drop the cache's reference."""
        self.cache.unregister(block)
        self._release(block)

    def _unshare(self, old: int) -> int:
        """Copy-on-write: a fresh block with ``old``'s K/V (and features), ``old`` released;
        returns the fresh block."""
        new = self._alloc_n(1)[0]
        self.copy_block(old, new)
        if self.features is not None:
            self.features.copy_block(old, new)
        self._release(old)
        return new

    # ---- features for drafters that read target hidden states (EAGLE) --------------------------
    def observe_features(self, spans: list[tuple[Sequence, int, int]], feats: torch.Tensor,
                         prefills: list[bool]) -> list[tuple[int, torch.Tensor]]:
        """Record the target features of one step: ``spans[i] = (seq, start, r)`` names the
        positions ``start .. start+r-1`` of ``seq`` whose features are the next ``r`` rows of
        ``feats`` ``[sum r, H]`` (stored when tracked, in one write for the whole step).
        Returns per span what a drafter should observe: for a prefill after a prefix-cache
        hit (``start`` > 0, ``prefills[i]``), the cached features of positions ``0 .. start-1``
        prepended and start 0; else ``(start, its rows of feats)``."""
        self.store_features(spans, feats)  # all writes first: a prefill may hit a prefix
        out, row = [], 0  # another entry of this step computed
        for (seq, start, r), prefill in zip(spans, prefills):
            rows = feats[row:row + r]
            row += r
            if self.features is not None and prefill and start > 0:
                prefix = self.features.read(self.slots(seq, 0, start)).to(rows.device, rows.dtype)
                out.append((0, torch.cat([prefix, rows])))
            else:
                out.append((start, rows))
        return out

    def store_features(self, spans: list[tuple[Sequence, int, int]], feats: torch.Tensor) -> None:
        """Store the target features ``feats`` ``[sum r, H]`` of one step in one write when
        tracked (``spans`` as ``observe_features`` takes them); nothing when not."""
        if self.features is None:
            return
        slots = []
        for seq, start, r in spans:
            slots += self.slots(seq, start, start + r)
        self.features.write(slots, feats)

    # ---- sequences ---------------------------------------------------------------------------
    def blocks_to_grow(self, seq: Sequence, num_new: int) -> int:
        """Blocks that ``grow(seq, num_new)`` would take from the pool."""
        first, end = seq.num_cached, seq.num_cached + num_new
        need = max(0, cdiv(end, self.block_size) - len(seq.block_table))
        i = first // self.block_size
        if num_new and i < len(seq.block_table) and self.allocator.refcount(seq.block_table[i]) > 1:
            need += 1  # copy-on-write of the shared block we will write into
        return need

    def grow(self, seq: Sequence, num_new: int) -> None:
        """Make positions ``num_cached .. num_cached+num_new-1`` of ``seq`` writable: add blocks
        and un-share the block written first if it is shared."""
        i = seq.num_cached // self.block_size
        if num_new and i < len(seq.block_table) and self.allocator.refcount(seq.block_table[i]) > 1:
            seq.block_table[i] = self._unshare(seq.block_table[i])
        need = cdiv(seq.num_cached + num_new, self.block_size) - len(seq.block_table)
        if need > 0:
            seq.block_table.extend(self._alloc_n(need))

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks past the first ``num_tokens`` positions of ``seq``."""
        keep = cdiv(num_tokens, self.block_size)
        for b in reversed(seq.block_table[keep:]):
            self._release(b)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release all blocks of ``seq`` (shared blocks stay with the other holders, registered
        ones with the prefix cache)."""
        for b in reversed(seq.block_table):  # the tail is evicted before the head
            self._release(b)
        seq.block_table = []
        seq.num_cached = 0
        seq.num_registered_blocks = 0

    def share(self, src: Sequence, dst: Sequence) -> None:
        """``dst`` (holding no blocks) takes ``src``'s blocks and cached positions, one more
        reference to each: the K/V of positions ``0 .. src.num_cached-1`` is then read by both
        from one copy, and ``grow`` copies a shared block before either writes into it.

        Raises:
            ValueError: ``dst`` already holds blocks.
        """
        if dst.block_table:
            raise ValueError(f"BlockPool.share: the destination sequence holds "
                             f"{len(dst.block_table)} blocks already")
        for b in src.block_table:
            self.allocator.incref(b)
        dst.block_table = list(src.block_table)
        dst.num_cached = src.num_cached

    def slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Flat cache slots of positions ``start .. end-1`` of ``seq``."""
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]
