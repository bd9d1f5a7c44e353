"""Automatic prefix caching: full KV blocks found again by a hash of their tokens and all tokens
before them (vLLM's and nano-vllm's scheme), kept after their last user is gone and evicted
least-recently-used only when a fresh block is needed. A prompt's last, partial block is cached
too, under a hash of its exact tokens (``hash_partial``): only a prompt equal to that one finds
it (the repeated prompts that RL frameworks send as separate requests).

This module holds the pure bookkeeping; ``BlockManager`` (``kv/block_manager.py``) decides when
blocks are registered, attached, released and evicted, and keeps the allocator's reference
counts: a registered block carries one extra reference held by the cache, so a cached block
nobody uses has refcount 1, is never on the allocator's free list and keeps its K/V intact
until ``BlockManager`` evicts it (drops the cache's reference) to hand it out again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

DIGEST_BYTES = 16  # 128-bit chain hash: a collision is not a practical concern


def hash_block(parent: bytes, tokens: Seq[int]) -> bytes:
    """Chain hash of one full block.

    Args:
        parent: the hash of the previous block of the same sequence (``b""`` for block 0).
        tokens: the block's ``block_size`` token ids (ints in ``[0, 2**63)``).

    Returns:
        a 16-byte BLAKE2b digest of ``parent`` and the tokens: equal digests mean equal tokens
        in this block and in every block before it.
    """
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def hash_partial(parent: bytes, tokens: Seq[int]) -> bytes:
    """Hash of a sequence's last, partial block: its ``1 .. block_size-1`` tokens after the
    full blocks whose chain hash is ``parent`` (``b""`` if none). A separate BLAKE2b domain
    (``person``), so it never equals a full block's ``hash_block``."""
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES, person=b"partial-block")
    h.update(array("q", tokens).tobytes())
    return h.digest()


def chain_hashes(token_ids: Seq[int], block_size: int, num_blocks: int,
                 known: list[bytes] | None = None, root: bytes = b"") -> list[bytes]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids``.

    ``known`` (hashes of a leading part, e.g. computed earlier for the same tokens and
    ``root``) is extended in place and returned; pass None for a fresh list. ``root``: the
    parent of block 0, a namespace (``BlockManager.salt``: blocks computed under another
    weight version never match).

    Raises:
        ValueError: ``num_blocks`` full blocks do not fit in ``token_ids``.
    """
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"chain_hashes: {num_blocks} blocks of {block_size} tokens need "
                         f"{num_blocks * block_size} tokens, got {len(token_ids)}")
    hashes = [] if known is None else known
    while len(hashes) < num_blocks:
        i = len(hashes)
        hashes.append(hash_block(hashes[-1] if hashes else root,
                                 token_ids[i * block_size:(i + 1) * block_size]))
    return hashes


class PrefixCache:
    """Hash -> block map of cached blocks (full ones, and prompts' partial last blocks), and the
    LRU order of those nobody uses.

    A block is *registered* (its hash known, content valid) or not. A registered block is
    *evictable* when only the cache holds it; ``evictable`` keeps those in least-recently-
    released order (``pop_lru`` takes the oldest).

    Counters: ``queried_tokens`` (prompt tokens looked up at admission), ``hit_tokens`` (of
    those, tokens whose K/V were found) and ``rerun_tokens`` (hit tokens run again for their
    logits); ``BlockManager`` adds to them.
    """

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.rerun_tokens = 0

    def __len__(self) -> int:
        """Registered blocks (in use or evictable)."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, h: bytes) -> int | None:
        """The block registered under hash ``h``, or None."""
        return self._block_of.get(h)

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def blocks(self) -> list[int]:
        """Every registered block id."""
        return list(self._hash_of)

    def register(self, h: bytes, block: int) -> None:
        """Map ``h`` to ``block``.

        Raises:
            ValueError: ``h`` or ``block`` is registered already.
        """
        if h in self._block_of:
            raise ValueError(f"prefix cache: hash {h.hex()} is registered already "
                             f"(block {self._block_of[h]})")
        if block in self._hash_of:
            raise ValueError(f"prefix cache: block {block} is registered already")
        self._block_of[h] = block
        self._hash_of[block] = h

    def unregister(self, block: int) -> None:
        """Forget ``block``'s hash (and its place in the LRU order).

        Raises:
            KeyError: ``block`` is not registered.
        """
        h = self._hash_of.pop(block)
        del self._block_of[h]
        self._evictable.pop(block, None)

    def release(self, block: int) -> None:
        """``block`` (registered) lost its last user: it becomes the most recently released
        evictable block."""
        if block not in self._hash_of:
            raise KeyError(f"prefix cache: block {block} is not registered")
        self._evictable[block] = None
        self._evictable.move_to_end(block)

    def acquire(self, block: int) -> None:
        """``block`` has a user again: no longer evictable (no-op if it was not)."""
        self._evictable.pop(block, None)

    def pop_lru(self) -> int:
        """Unregister and return the least recently released evictable block.

        Raises:
            RuntimeError: nothing is evictable.
        """
        if not self._evictable:
            raise RuntimeError("prefix cache: no evictable block")
        block = next(iter(self._evictable))
        self.unregister(block)
        return block

    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0.0 before any query)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
