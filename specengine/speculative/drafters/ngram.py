"""N-gram drafter: prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` speculator).

The last n tokens of a sequence (prompt + output) are matched against their earlier
occurrences; the tokens that followed a match are the draft. Longer matches come first, and
among equally long ones the most recent; several distinct continuations share their common
prefixes in one trie. Nothing runs on the accelerator, so drafting is almost free: strong on
code, math and RL answers that repeat their prompt.
"""

from __future__ import annotations

import math

import numpy as np

from specengine.engine.sequence import Sequence
from specengine.speculative.drafters.base import Drafter
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree


class TokenHistory:
    """A growing int64 numpy copy of one sequence's tokens: appending is amortised O(1) per
    token, so a long sequence is not converted from a Python list at every step."""

    def __init__(self) -> None:
        self._buf = np.empty(256, dtype=np.int64)
        self._len = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        """Catch up with ``token_ids`` (append its new tail; rebuild if it is no longer an
        extension of what is held) and return a read-only view ``[len(token_ids)]`` int64."""
        n, held = len(token_ids), self._len
        if n < held or (held and token_ids[held - 1] != self._buf[held - 1]):
            held = 0
        if n > len(self._buf):
            buf = np.empty(max(n, 2 * len(self._buf)), dtype=np.int64)
            buf[:held] = self._buf[:held]
            self._buf = buf
        if n > held:
            self._buf[held:n] = token_ids[held:n]
        self._len = n
        view = self._buf[:n]
        view.flags.writeable = False
        return view


class NgramIndex:
    """Prompt-lookup drafter.

    Args:
        min_n: shortest suffix that counts as a match (>= 1).
        max_n: longest suffix tried (>= min_n).
        max_matches: most match positions examined per call (bounds the Python work when a
            token repeats thousands of times).

    Raises:
        ValueError: ``min_n < 1``, ``max_n < min_n`` or ``max_matches < 1``.
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, max_matches: int = 64):
        if min_n < 1:
            raise ValueError(f"NgramIndex.min_n={min_n}: must be >= 1")
        if max_n < min_n:
            raise ValueError(f"NgramIndex.max_n={max_n}: must be >= min_n={min_n}")
        if max_matches < 1:
            raise ValueError(f"NgramIndex.max_matches={max_matches}: must be >= 1")
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self._histories: dict[object, TokenHistory] = {}

    def forget(self, key: object) -> None:
        """Drop the token history kept for ``key`` (call when its sequence finishes)."""
        self._histories.pop(key, None)

    def match_ends(self, token_ids: list[int] | np.ndarray) -> list[int]:
        """End positions ``e`` of earlier occurrences of the sequence's last n tokens
        (``token_ids[e - n + 1 : e + 1] == token_ids[-n:]``, ``e <= len - 2`` so a continuation
        exists), longest match first, then most recent first; at most ``max_matches``.

        Cost: O(max_n * len) vectorised numpy comparisons.
        """
        return [e for e, _ in self.matches(token_ids)]

    def matches(self, token_ids: list[int] | np.ndarray) -> list[tuple[int, int]]:
        """``(end position, match length n)`` of each match, in ``match_ends`` order."""
        ids = np.asarray(token_ids)
        length = len(ids)
        if length < 2:
            return []
        top = min(self.max_n, length - 1)
        match_len = np.zeros(length - 1, dtype=np.int32)  # capped at top, for every end e
        alive = ids[:-1] == ids[-1]
        for t in range(top):
            if t:  # extend by one token: ids[e - t] == ids[-1 - t]
                alive[t:] &= ids[:length - 1 - t] == ids[length - 1 - t]
                alive[:t] = False
            if not alive.any():
                break
            match_len += alive
        ends: list[tuple[int, int]] = []
        for n in range(top, self.min_n - 1, -1):
            ends += [(e, n) for e in
                     np.flatnonzero(match_len == n)[::-1][:self.max_matches - len(ends)].tolist()]
            if len(ends) >= self.max_matches:
                break
        return ends

    def propose(self, token_ids: list[int] | np.ndarray, strategy: Strategy | None,
                key: object = None) -> DraftTree | None:
        """Draft a trie of continuations for one sequence.

        Args:
            token_ids: the sequence so far (prompt + output); its last token is the root.
            key: optional sequence id; with it, a numpy copy of ``token_ids`` is kept between
                calls and only new tokens are converted (``forget(key)`` releases it).
            strategy: depth d (tokens per path), topk k (most root-to-leaf paths) and budget m
                (most nodes); ``None`` drafts nothing.

        Returns:
            A deterministic ``DraftTree`` (children in match order; ``sources`` all
            ``"ngram"``), or ``None`` when no suffix of length >= ``min_n`` occurred before.
            Its nodes are scored for the policy's calibration: a node's confidence (``exp`` of
            its cumulative ``draft_logprobs``) is the share of the matches examined whose
            continuation passes through it, each match weighted by its length n, with one
            pseudo-match of weight 1 that continues elsewhere (a lone 3-token match gives its
            path 3/4; ten agreeing 1-token matches give 10/11).
        """
        if strategy is None:
            return None
        if key is not None and not isinstance(token_ids, np.ndarray):
            ids = self._histories.setdefault(key, TokenHistory()).sync(token_ids)
        else:
            ids = np.asarray(token_ids)
        found = self.matches(ids)
        tokens, parents, node_of = _match_trie(ids, found, strategy)
        if not tokens:
            return None
        depth = strategy.depth
        weight = [0.0] * len(tokens)  # match weight passing through each node
        for e, n in found:
            par = -1
            for tok in ids[e + 1:e + 1 + depth].tolist():
                node = node_of.get((par, tok))
                if node is None:
                    break
                weight[node] += n
                par = node
        total = sum(n for _, n in found) + 1.0
        lps = [math.log(w / (weight[p] if p >= 0 else total)) for w, p in zip(weight, parents)]
        return DraftTree(tokens, parents, lps, ["ngram"] * len(tokens))


def _match_trie(ids: np.ndarray, found: list[tuple[int, int]], strategy: Strategy
                ) -> tuple[list[int], list[int], dict[tuple[int, int], int]]:
    """The trie of the continuations (``strategy.depth`` tokens) after each match end of
    ``found``, in match order, within ``strategy.budget`` nodes and ``strategy.topk`` leaves.
    Returns its tokens, parents (-1: the root) and ``(parent, token) -> node`` index."""
    depth, width, budget = strategy.depth, strategy.topk, strategy.budget
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    has_child = [False]  # slot 0 = root, slot 1 + i = node i
    leaves = 0
    for e, _ in found:
        par = -1
        for tok in ids[e + 1:e + 1 + depth].tolist():
            node = node_of.get((par, tok))
            if node is None:
                grows_leaf = par >= 0 and not has_child[par + 1]
                if len(tokens) == budget or (not grows_leaf and leaves == width):
                    break
                leaves += not grows_leaf
                node = node_of[(par, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(par)
                has_child[par + 1] = True
                has_child.append(False)
            par = node
        if len(tokens) == budget:
            break
    return tokens, parents, node_of


class NgramDrafter(Drafter):
    """Prompt-lookup drafting (n-gram matching over prompt + output; no model cost)."""

    name = "ngram"

    def __init__(self, strategy: Strategy, min_n: int = 1, max_n: int = 4):
        super().__init__(strategy)
        self.ngram = NgramIndex(min_n=min_n, max_n=max_n)

    def propose(self, seqs: list[Sequence], strategy: Strategy) -> list[DraftTree | None]:
        return [self.ngram.propose(s.token_ids, strategy, key=s.seq_id) for s in seqs]

    def release(self, seq: Sequence) -> None:
        self.ngram.forget(seq.seq_id)
