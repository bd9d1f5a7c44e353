"""What the phases of one engine step hand each other: the target forward's ``ForwardLayout``
(which logits rows and which tokens belong to which entry) and each sequence's ``Commit``."""

from __future__ import annotations

from dataclasses import dataclass

from specengine.engine.batch import BatchEntry
from specengine.engine.sequence import Logprob, Sequence


@dataclass
class ForwardLayout:
    """Where each entry of one step sits in the target forward (``ModelRunner.prepare``'s
    order).

    Attributes:
        entries: the step's entries, in forward order.
        logits_rows: per entry, its first row of the logits ``[R, V]``: the one row its samplers
            draw from (an entry without a tree), or the root's row followed by one row per
            tree node.
        token_offsets: per entry, its first token among the forward's ``T`` tokens (rows of the
            hidden states ``[T, H]``).
        num_tokens: ``T``: prompt tokens, decode roots and tree nodes.
    """

    entries: list[BatchEntry]
    logits_rows: list[int]
    token_offsets: list[int]
    num_tokens: int

    @classmethod
    def of(cls, entries: list[BatchEntry]) -> ForwardLayout:
        """The layout of ``entries`` (their trees attached)."""
        rows, offsets, row, tok = [], [], 0, 0
        for e in entries:
            nodes = e.tree.num_nodes if e.tree is not None else 0
            rows.append(row)
            offsets.append(tok)
            row += 1 + nodes
            tok += e.num_new + nodes
        return cls(entries, rows, offsets, tok)

    def plain(self) -> list[tuple[BatchEntry, int]]:
        """``(entry, logits row)`` of each entry without a tree (prefills, plain decodes)."""
        return [(e, r) for e, r in zip(self.entries, self.logits_rows) if e.tree is None]

    def trees(self) -> list[tuple[BatchEntry, int]]:
        """``(entry, root's logits row)`` of each entry with a tree to verify."""
        return [(e, r) for e, r in zip(self.entries, self.logits_rows) if e.tree is not None]

    @property
    def decodes(self) -> list[BatchEntry]:
        """The decode entries (with or without a tree)."""
        return [e for e in self.entries if not e.is_prefill]

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens in the forward."""
        return sum(e.num_new for e in self.entries if e.is_prefill)

    def committed_token_rows(self, i: int, accepted: list[int] | None) -> list[int]:
        """Indices among the ``T`` tokens of what entry ``i`` commits: all its tokens without a
        tree; with one, the root and the ``accepted`` nodes, in path order."""
        off, e = self.token_offsets[i], self.entries[i]
        if e.tree is None:
            return list(range(off, off + e.num_new))
        return [off] + [off + 1 + a for a in accepted]

    def sampling_rows(self, i: int, accepted: list[int] | None) -> list[int]:
        """Indices among the ``T`` tokens whose logits produced what entry ``i`` commits, one per
        committed token: its last token without a tree; with one, the root and the
        ``accepted`` nodes (the last of them gives the bonus token)."""
        off, e = self.token_offsets[i], self.entries[i]
        if e.tree is None:
            return [off + e.num_new - 1]
        return [off] + [off + 1 + a for a in accepted]


@dataclass
class Commit:
    """The tokens one sequence commits in a step, before the stop rules cut them.

    Attributes:
        entry: the batch entry the tokens come from. seq: the sequence that commits them (one
            of ``entry.samplers``).
        tokens: token ids in order (one for a plain row; the accepted nodes' and the bonus
            token for a verified tree).
        logprobs: one logprob entry (or None) per token.
        accepted: node indices of ``entry.tree`` accepted (root excluded); None for a plain row.
    """

    entry: BatchEntry
    seq: Sequence
    tokens: list[int]
    logprobs: list[dict[int, Logprob] | None]
    accepted: list[int] | None = None

    @property
    def is_verified(self) -> bool:
        """True when the tokens come from verifying a token tree."""
        return self.accepted is not None
