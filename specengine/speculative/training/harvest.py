"""Harvesting the EAGLE drafter's training data: per finished sequence, its token ids and the
target's features (``SequenceFeatures``).

Features are the target's post-norm last hidden states of positions 0..L-2 (the last token's
feature is never computed in decoding). They come for free from decoding (``Harvester``,
installed by ``harvest``, reads a finished sequence's from the engine's KV feature store into a
bounded ``HiddenBuffer``) or from one teacher-forced target forward over given token sequences
(``teacher_force``).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

from specengine.engine.batch import BatchEntry
from specengine.engine.model_runner import ModelRunner
from specengine.engine.sequence import Sequence
from specengine.kv.block_manager import BlockManager
from specengine.sampling.params import SampleNoise, SamplingParams
from specengine.speculative.drafters.base import Drafter
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree


@dataclass
class SequenceFeatures:
    """One finished sequence: ``token_ids`` ``[L]`` and target features ``hidden`` ``[L-1, H]``
    (feature i belongs to position i)."""

    token_ids: list[int]
    hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size() + 8 * len(self.token_ids)


class HiddenBuffer:
    """Bounded FIFO of ``SequenceFeatures``: at most ``max_items`` and ``max_bytes``; the oldest
    are dropped first. Thread-safe."""

    def __init__(self, max_items: int = 1024, max_bytes: int = 1 << 30):
        if max_items < 1 or max_bytes < 1:
            raise ValueError(f"HiddenBuffer max_items={max_items}, max_bytes={max_bytes}: "
                             "both must be >= 1")
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: deque[SequenceFeatures] = deque()
        self.nbytes = 0
        self.total_added = 0
        self._lock = threading.Lock()

    def add(self, r: SequenceFeatures) -> None:
        if len(r.token_ids) < 3 or r.nbytes > self.max_bytes:
            return
        with self._lock:
            self.items.append(r)
            self.nbytes += r.nbytes
            self.total_added += 1
            while len(self.items) > self.max_items or self.nbytes > self.max_bytes:
                self.nbytes -= self.items.popleft().nbytes

    def snapshot(self) -> list[SequenceFeatures]:
        with self._lock:
            return list(self.items)

    def drain(self) -> list[SequenceFeatures]:
        """Take every rollout out (oldest first); the buffer is left empty."""
        with self._lock:
            out, self.items, self.nbytes = list(self.items), deque(), 0
            return out

    def __len__(self) -> int:
        return len(self.items)


class Harvester(Drafter):
    """Wraps a drafter (or none) and puts each finished sequence's tokens and target features
    into a ``HiddenBuffer``: no extra forward and no work per step. The engine keeps every
    committed position's features in its KV blocks (``BlockFeatures``, tracked for any drafter
    that ``wants_hidden``); ``release`` reads a finishing sequence's from there in one gather,
    before its blocks go back.

    Install with ``harvest(llm, buffer)``. Drafting is the inner drafter's (no inner: none);
    the inner drafter is handed features as it would be alone (``observes_at_draft``).

    Args:
        inner: the drafter that drafts, or None.
        buffer: where finished sequences go.
        target_blocks: the engine's ``BlockManager`` (its ``features`` store is read at
            release).

    Attributes:
        skipped: finished sequences not harvested because some of their positions have no
            stored feature (they were running before harvesting started).
    """

    name = "harvester"
    wants_hidden = True

    def __init__(self, inner: Drafter | None, buffer: HiddenBuffer,
                 target_blocks: BlockManager):
        super().__init__(inner.strategy if inner is not None else None)
        self.inner, self.buffer, self.target_blocks = inner, buffer, target_blocks
        self._feeds = inner is not None and inner.wants_hidden
        self.observes_at_draft = not self._feeds or inner.observes_at_draft
        self.catches_up = inner is not None and inner.catches_up
        self.skipped = 0

    def wrapped(self) -> list[Drafter]:
        """The inner drafter (``[]`` without one)."""
        return [] if self.inner is None else [self.inner]

    def propose(self, seqs: list[Sequence], strategy: Strategy) -> list[DraftTree | None]:
        if self.inner is None:
            return [None] * len(seqs)
        return self.inner.propose(seqs, strategy)

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        if self._feeds:
            self.inner.observe(seq, start, hidden)

    def prefill(self, samples: list[Sequence]) -> list[Sequence]:
        return self.inner.prefill(samples) if self.inner is not None else []

    def observed(self, seq: Sequence) -> int:
        """The inner drafter's; without one that reads features, every cached position (the
        engine has nothing to hand over)."""
        return self.inner.observed(seq) if self._feeds else seq.num_cached

    def features(self, seq: Sequence) -> torch.Tensor | None:
        return self.inner.features(seq) if self.inner is not None else None

    def discard(self, seq: Sequence) -> None:
        """``seq`` moved to another engine: its features go with it, not into the buffer."""
        if self.inner is not None:
            self.inner.discard(seq)

    def release(self, seq: Sequence) -> None:
        self._collect(seq)
        if self.inner is not None:
            self.inner.release(seq)

    def _collect(self, seq: Sequence) -> None:
        """Put ``seq``'s tokens and the stored features of positions ``0 .. n-1`` (``n`` its
        cached positions, at most ``len(seq) - 1``) into the buffer. A sequence that holds no
        target KV blocks (a policy's profiling dummy) is passed over; one with a position
        lacking its feature is counted in ``skipped``."""
        store = self.target_blocks.features
        n = min(seq.num_cached, len(seq) - 1)
        if store is None or n < 1 or len(seq.block_table) * self.target_blocks.block_size < n:
            return
        slots = self.target_blocks.slots(seq, 0, n)
        if not store.all_valid(slots):
            self.skipped += 1
            return
        self.buffer.add(SequenceFeatures(list(seq.token_ids[:n + 1]), store.read(slots)))

    def set_weight_version(self, version: int) -> None:
        if self.inner is not None:
            self.inner.set_weight_version(version)

    def stats(self) -> dict:
        """The inner drafter's ``stats()`` (``{}`` without one): harvesting adds none."""
        return self.inner.stats() if self.inner is not None else {}


def harvest(llm, buffer: HiddenBuffer) -> Harvester:
    """Make ``llm`` (an ``LLM``) put every finished sequence into ``buffer``; returns the
    installed ``Harvester`` (it keeps any drafter the engine had)."""
    eng = llm.engine
    if isinstance(eng.drafter, Harvester):
        eng.drafter.buffer = buffer
        return eng.drafter
    eng.drafter = Harvester(eng.drafter, buffer, eng.blocks)
    return eng.drafter


def stop_harvest(llm) -> None:
    """Undo ``harvest``: ``llm``'s engine drafts with the drafter it had before (none if it had
    none); no-op when nothing harvests."""
    eng = llm.engine
    if isinstance(eng.drafter, Harvester):
        eng.drafter = next(iter(eng.drafter.wrapped()), None)


@torch.inference_mode()
def teacher_force(model, sequences: list[list[int]], max_batch_tokens: int = 4096,
                  block_size: int = 16) -> list[torch.Tensor]:
    """Target features of given token sequences with one prefill forward each (our model and
    KV cache, no other code path).

    Args:
        model: target ``LlamaForCausalLM``.
        sequences: token id lists (length >= 2, shorter than the model's max positions).
        max_batch_tokens: tokens per forward (sequences are packed up to it).

    Returns:
        per sequence ``[L-1, H]`` features (positions 0..L-2) in the model dtype.

    Raises:
        ValueError: a sequence shorter than 2 tokens or too long for the model.
    """
    limit = model.config.max_position_embeddings
    for i, s in enumerate(sequences):
        if not 2 <= len(s) <= limit:
            raise ValueError(f"sequence {i} has {len(s)} tokens; need 2..{limit}")
    longest = max((len(s) for s in sequences), default=1)
    budget = max(max_batch_tokens, longest)
    num_blocks = -(-budget // block_size) + len(sequences) + 1
    runner = ModelRunner(model, min(num_blocks, -(-budget // block_size) * 2 + 64), block_size)
    out: list[torch.Tensor | None] = [None] * len(sequences)
    i = 0
    params = SamplingParams()
    while i < len(sequences):
        bm = BlockManager(runner.kv_cache.shape[2], block_size, runner.copy_block)
        entries, idx, used = [], [], 0
        while i < len(sequences) and (not entries or used + len(sequences[i]) <= budget):
            s = Sequence("tf", 0, list(sequences[i]), params, SampleNoise(0, 0))
            if bm.num_free < -(-len(s) // block_size):
                break
            bm.allocate_shared([s])
            entries.append(BatchEntry(s, len(s), [s], is_prefill=True))
            idx.append(i)
            used += len(s)
            i += 1
        _, hidden = runner.run(entries, bm)
        off = 0
        for e, j in zip(entries, idx):
            out[j] = hidden[off:off + e.num_new - 1].clone()
            off += e.num_new
    return out
