"""``BlockManager``: sequences' block tables (``BlockPool``, ``kv/block_pool.py``: reference
counts, copy-on-write) with automatic prefix caching.

With prefix caching (``enable_prefix_caching``), every block full of committed tokens is
registered in a ``PrefixCache`` under the chain hash of its tokens and all tokens before it; the
cache holds one reference of its own, so the block outlives its sequences with its K/V intact.
A new prompt's leading full blocks that are registered are attached instead of recomputed
(``match`` / ``allocate_shared``); so is its last, partial block when a prompt with exactly the
same tokens was cached (``hash_partial``). A prompt found whole still runs its last token through
the model (its logits are needed), written into the prompt's own copy of that block
(copy-on-write). A cached partial block's owner copies it before its first decode write (the
cache's reference makes it shared), so a cached block only ever holds its prompt's K/V.
Registered blocks nobody uses are evicted least-recently-released first, only when a fresh
block is needed. Only the scheduler registers blocks (``allocate_shared`` for a prompt's full
blocks and partial last block, ``commit`` for full blocks filled since); draft-tree slots past
``num_cached`` are never registered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specengine.engine.sequence import Sequence
from specengine.kv.block_features import BlockFeatures
from specengine.kv.block_pool import BlockPool, cdiv
from specengine.kv.prefix_cache import PrefixCache, chain_hashes, hash_partial


class BlockManager(BlockPool):
    """Gives sequences KV blocks and takes them back.

    Args:
        num_blocks: size of the pool (blocks).
        block_size: tokens per block.
        copy_block: ``copy_block(src, dst)`` copies one block's K/V in every layer (used for
            copy-on-write of a shared partial block).
        enable_prefix_caching: keep and reuse full blocks by hash (see the module docstring);
            off for drafters' own pools.

    ``num_free`` counts the blocks a request can get: the allocator's free blocks plus the
    cached blocks nobody uses (evicted on demand).
    """

    def __init__(self, num_blocks: int, block_size: int, copy_block: Callable[[int, int], None],
                 enable_prefix_caching: bool = False):
        super().__init__(num_blocks, block_size, copy_block,
                         PrefixCache() if enable_prefix_caching else None)
        # seq id -> (blocks the sequence registered at admission, tokens its prefill computes):
        # registered before their K/V are written (this step's forward); unregistered again if
        # the sequence is freed before that forward completed (an error, an abort)
        self._unconfirmed: dict[int, tuple[list[int], int]] = {}
        self._pending: set[int] = set()  # the blocks in ``_unconfirmed``
        self._version = 0  # weight version and resets so far: the namespace (``salt``)
        self._resets = 0

    # ---- prefix caching ----------------------------------------------------------------------
    @property
    def salt(self) -> bytes:
        """The prefix-cache namespace of sequences admitted now: the weight version
        (``set_weight_version``) and the number of resets (``reset_prefix_cache``). A sequence
        keeps the namespace it was admitted under (``Sequence.cache_salt``): the blocks it
        registers later are found only by requests of that namespace (prime-rl's salting of
        the cache per policy version), so KV of old weights is never served to new requests."""
        return f"{self._version}/{self._resets}".encode()

    def set_weight_version(self, version: int) -> None:
        """Requests admitted from now on look up and register blocks of weight ``version``
        only; blocks of other versions stay until evicted (least recently used first)."""
        self._version = version

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """Chain hashes of (at least) ``seq``'s first ``n`` full blocks in its namespace
        (``seq.block_hashes``, extended in place)."""
        return chain_hashes(seq.token_ids, self.block_size, n, seq.block_hashes,
                            root=seq.cache_salt)

    def _enter_namespace(self, seq: Sequence) -> None:
        """A sequence not holding blocks takes the current namespace (its hashes of another
        one are dropped)."""
        if not seq.block_table and seq.cache_salt != self.salt:
            seq.cache_salt = self.salt
            seq.block_hashes = []

    def match(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s leading blocks, in order (nothing is changed): full
        blocks by chain hash, then, when all of them hit, the partial last block by
        ``hash_partial`` (cached by a sequence with exactly these tokens).

        A hit may cover the whole sequence. The block the last token lives in is copied at
        admission (that token runs through the model again), so it counts only if its K/V are
        written already (not pending: this step's forward writes those, which later blocks of
        the same step may share but not copy). With ``features`` tracked, a block counts only
        if the features of its hit slots are valid too.
        """
        if self.cache is None or len(seq) < 2:
            return []
        self._enter_namespace(seq)
        size, bs = len(seq), self.block_size
        last, n = (size - 1) // bs, size // bs
        hashes = self._hashes(seq, n)
        hit = []
        for i in range(n):
            b = self.cache.lookup(hashes[i])
            if b is None or not self._usable(b, i == last, bs):
                break
            hit.append(b)
        if len(hit) == n and size % bs:
            b = self.cache.lookup(hash_partial(hashes[n - 1] if n else seq.cache_salt,
                                               seq.token_ids[n * bs:]))
            if b is not None and self._usable(b, True, size % bs):
                hit.append(b)
        return hit

    def _usable(self, block: int, copied: bool, num_slots: int) -> bool:
        if block in self._pending:  # K/V (and features) written by this step's forward
            return not copied
        return self.features is None or self.features.covers(block, num_slots)

    def cached_tokens(self, seq: Sequence, hit: list[int]) -> int:
        """Leading tokens of ``seq`` whose K/V ``hit`` (from ``match``) provides and the prefill
        skips: all hit tokens but the last token of the sequence."""
        return min(len(hit) * self.block_size, len(seq) - 1)

    def admission_cost(self, seq: Sequence, hit: list[int]) -> int:
        """Blocks of ``num_free`` that ``allocate_shared([seq, ...], hit)`` uses up: fresh
        blocks for the tokens after ``hit``, the evictable blocks of ``hit`` revived, and the
        copy of the last token's block when ``hit`` holds it."""
        revived = sum(1 for b in hit if self.cache.is_evictable(b)) if hit else 0
        copy = 1 if len(hit) > (len(seq) - 1) // self.block_size else 0
        return cdiv(len(seq), self.block_size) - len(hit) + revived + copy

    def allocate_shared(self, seqs: list[Sequence], hit: list[int] | None = None) -> None:
        """Give all ``seqs`` (sequences with the same tokens: the samples of one prompt, and
        separate requests with that prompt) one set of blocks for their tokens: the cached
        blocks ``hit`` (from ``match``) first, then fresh ones; the block of the last token is
        a private copy when it was a hit. Sets each sequence's ``num_cached`` (see
        ``cached_tokens``); registers the other full blocks and the partial last block (their
        K/V are written by this step's forward, which later admissions of the same step may
        already share). Counts the lookup: each request among ``seqs`` queried its tokens; the
        first one hit ``hit``'s tokens (the whole sequence when ``hit`` covers it, although the
        last token is run again for its logits: ``prefix_cache_rerun_tokens``), the others
        every token (their prefill is the first one's).

        Raises:
            RuntimeError: the pool is short (check ``admission_cost`` against ``num_free``).
        """
        hit = list(hit or [])
        leader, bs = seqs[0], self.block_size
        self._enter_namespace(leader)
        size = len(leader)
        cost = self.admission_cost(leader, hit)
        if cost > self.num_free:
            raise RuntimeError(f"out of KV blocks: {cost} needed, {self.num_free} free")
        for b in hit:
            self._attach(b)
        blocks = hit + self._alloc_n(cdiv(size, bs) - len(hit))
        last = (size - 1) // bs
        if len(hit) > last:  # the last token is written again: into a copy of its block
            blocks[last] = self._unshare(blocks[last])
        for _ in seqs[1:]:
            for b in blocks:
                self.allocator.incref(b)
        cached = self.cached_tokens(leader, hit)
        for s in seqs:
            s.block_table = list(blocks)
            s.num_cached = cached
        if self.cache is None:
            return
        self._count_lookup(seqs, len(hit), cached)
        self._register_admitted(seqs, blocks, len(hit))

    def _count_lookup(self, seqs: list[Sequence], num_hit: int, cached: int) -> None:
        """``allocate_shared``'s prefix-cache counters (its docstring)."""
        size = len(seqs[0])
        requests = len({s.request_id for s in seqs})
        found = min(num_hit * self.block_size, size)
        self.cache.queried_tokens += requests * size
        self.cache.hit_tokens += found + (requests - 1) * size
        self.cache.rerun_tokens += found - cached

    def _register_admitted(self, seqs: list[Sequence], blocks: list[int], num_hit: int) -> None:
        """Register the admitted blocks past the hit (full ones, then the partial last one),
        pending until the leader's prefill forward completes (``commit``); every sequence
        takes the leader's hashes and namespace."""
        leader, bs = seqs[0], self.block_size
        size = len(leader)
        full = size // bs
        hashes = self._hashes(leader, full)
        pending = [blocks[i] for i in range(num_hit, full) if self._register(hashes[i], blocks[i])]
        if size % bs and self._register(
                hash_partial(hashes[full - 1] if full else leader.cache_salt,
                             leader.token_ids[full * bs:]),
                blocks[full]):
            pending.append(blocks[full])
        if pending:
            self._unconfirmed[leader.seq_id] = (pending, size)
            self._pending.update(pending)
        for s in seqs:
            s.block_hashes = hashes if s is leader else list(hashes)
            s.cache_salt = leader.cache_salt
            s.num_registered_blocks = full

    def commit(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks that became full of committed tokens (positions below
        ``min(num_cached, len(seq))``) since the last call. Called by the scheduler between
        steps, before a sequence's blocks are freed, never on draft slots."""
        if self.cache is None or not seq.block_table:
            return
        pend = self._unconfirmed.get(seq.seq_id)
        if pend is not None and seq.num_cached >= pend[1]:  # its prefill forward completed
            del self._unconfirmed[seq.seq_id]
            self._pending.difference_update(pend[0])
        full = min(seq.num_cached, len(seq)) // self.block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self._register(hashes[i], seq.block_table[i])
        seq.num_registered_blocks = full

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (blocks in use stay with their sequences, unregistered)
        and start a new namespace (``salt``): sequences running now register their later
        blocks in their old one, which no request admitted from now on looks up. Returns how
        many blocks were forgotten."""
        self._resets += 1
        if self.cache is None:
            return 0
        blocks = self.cache.blocks()
        for b in blocks:
            self._drop(b)
        self._unconfirmed.clear()
        self._pending.clear()
        return len(blocks)

    def prefix_cache_stats(self) -> dict:
        """``prefix_cache_hit_rate`` (hit / queried tokens), ``prefix_cache_hit_tokens`` (prompt
        tokens whose K/V were found: in the cache, or in the prefill of an identical prompt
        admitted with them), ``prefix_cache_queried_tokens`` (prompt tokens looked up at
        admission, recomputed preempted sequences included), ``prefix_cache_rerun_tokens`` (hit
        tokens run through the model again: the last token of a prompt found whole, for its
        logits), ``prefix_cache_blocks`` (registered now)."""
        c = self.cache
        return {"prefix_cache_hit_rate": c.hit_rate() if c is not None else 0.0,
                "prefix_cache_hit_tokens": c.hit_tokens if c is not None else 0,
                "prefix_cache_queried_tokens": c.queried_tokens if c is not None else 0,
                "prefix_cache_rerun_tokens": c.rerun_tokens if c is not None else 0,
                "prefix_cache_blocks": self.num_cached_blocks}

    # ---- features for drafters that read target hidden states (EAGLE) --------------------------
    def track_features(self, hidden_size: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> None:
        """Keep target features per slot from now on (idempotent): for prefix-cache hits and
        for a drafter that reads them only when it drafts (``Drafter.observes_at_draft``).
        Blocks cached before have none: the cache is emptied when tracking starts (call it
        between requests)."""
        if self.features is None:
            if self.cache is not None:
                self.reset_prefix_cache()
            self.features = BlockFeatures(self.num_blocks, self.block_size, hidden_size, dtype,
                                          device)

    def free(self, seq: Sequence) -> None:
        """Release all blocks of ``seq`` (shared blocks stay with the other holders, registered
        ones with the prefix cache). Blocks ``seq`` registered at admission whose K/V its
        prefill never wrote (freed before that forward completed) are unregistered first."""
        pend = self._unconfirmed.pop(seq.seq_id, None)
        if pend is not None:
            self._pending.difference_update(pend[0])
            if seq.num_cached < pend[1]:
                for b in pend[0]:
                    if self.cache.is_registered(b):
                        self._drop(b)
        super().free(seq)
