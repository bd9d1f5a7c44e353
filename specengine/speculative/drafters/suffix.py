"""Suffix drafter (``method: "suffix"``): token trees from the rollout memory of the prompt group.

SuffixDecoding (Oliaro et al., arXiv 2411.04975; vLLM's and Arctic Inference's ``suffix``
method) matches a sequence's last tokens against earlier text and drafts the continuations that
followed, as a tree scored by how often each continuation occurred. Here the earlier text is the
sequence's prompt group in ``RolloutMemory``: the prompt, the in-flight siblings, the sequence's
own output and the finished responses of earlier calls (weighed down per weight version of
age). No model runs, so drafting costs only the index update and the lookup (both timed, see
``stats``).

The tree: the continuations of the most recent occurrences of the longest matching n-gram (and,
weighted down by ``backoff`` per level, of the shorter ones: on recorded T = 1 GSM rollouts of
the default model this drafted ~0.05 more accepted tokens per step than the longest match
alone) are merged into a trie; a node's count is the summed weight of the continuations through
it, its path probability ``count(node) / count(root)`` and its draft log-probability
``log(count(node) / count(parent))``. Nodes are taken best-first by path probability, at most
``topk`` children per node, ``budget`` nodes, ``min(depth, max_tree_depth)`` deep, and none whose
path probability is below ``min_token_prob``.

For a sampled sequence the children are ranked with the sequence's own sampling noise
(``coupled``, the shared-noise coupling of ``drafters/coupling.py``, Daliri et al. 2024,
arXiv 2408.07978): by ``log count - log E`` of each child's token at its output position, so
the child first in line is the continuation the target's exponential race is likeliest to draw
(on recorded T = 1 GSM rollouts of the default model: ~0.05 more accepted tokens per step).
The noise of single tokens is computed by ``noise_fn`` (no vocabulary-wide rows).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable

from specengine.engine.sequence import Sequence
from specengine.ops.extension import ext
from specengine.speculative.drafters.base import Drafter
from specengine.speculative.drafters.rollout_memory import INDEX_NS, RolloutMemory
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree

KEPT_FINISH_REASONS = ("stop", "length")  # responses added to history (not aborted ones)
_M64 = (1 << 64) - 1
_V_MAX = 0.99999994  # float32 just below 1: csrc/noise.cpp's cap on v


def _mix64(z: int) -> int:
    """SplitMix64's finalizer (Steele, Lea & Flood 2014), as in ``csrc/noise.cpp``."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def noise_fn(key: int, first_position: int) -> Callable[[int, int], float]:
    """The sampling noise ``E`` of single tokens, without drawing whole rows: the returned
    ``f(depth, token)`` is the ``Exp(1)`` noise of ``token`` at output position
    ``first_position + depth - 1`` of noise stream ``key`` (``SampleNoise.key``), by the formula
    of ``csrc/noise.cpp`` in Python integers and float64 (equal to the extension's float32 up to
    rounding; ~2 us a token where a row of 49k tokens costs ~0.25 ms)."""
    rows: dict[int, int] = {}

    def f(depth: int, token: int) -> float:
        row = rows.get(depth)
        if row is None:
            pos = first_position + depth - 1
            row = rows[depth] = _mix64((key + 0xD1B54A32D192ED03 * (pos + 1)) & _M64)
        h = _mix64((row + 0x9E3779B97F4A7C15 * (token + 1)) & _M64) | 1
        v = min(float(h) * 2.0 ** -64, _V_MAX)
        return -math.log1p(-v)

    return f


def _conditionals(node: list, depth: int, noise: Callable[[int, int], float] | None
                  ) -> list[tuple[int, list, float]]:
    """``(token, child, conditional probability)`` of ``node``'s children at ``depth``: count
    over the node's count; with ``noise``, the children's share of the node's count split by
    the softmax of the perturbed scores ``log count - log E`` instead (Daliri et al. 2024)."""
    items = node[1].items()
    if noise is None or len(items) == 1:  # one child: the noise does not change its share
        return [(t, c, c[0] / node[0]) for t, c in items]
    scores = [math.log(c[0]) - math.log(noise(depth, t)) for t, c in items]
    top = max(scores)
    ex = [math.exp(x - top) for x in scores]
    share = sum(c[0] for _, c in items) / node[0] / sum(ex)
    return [(t, c, e * share) for (t, c), e in zip(items, ex)]


def _count_trie(continuations: list[tuple[float, list[int]]], depth: int) -> list:
    """The trie of the continuations' first ``depth`` tokens, each node ``[count, {token:
    child}]`` with count the summed weight of the continuations through it (the root's: all
    of positive weight)."""
    root: list = [0.0, {}]
    for w, toks in continuations:
        if w <= 0.0:
            continue
        root[0] += w
        node = root
        for t in toks[:depth]:
            child = node[1].get(t)
            if child is None:
                child = node[1][t] = [0.0, {}]
            child[0] += w
            node = child
    return root


def build_tree(continuations: list[tuple[float, list[int]]], depth: int, topk: int,
               budget: int, min_prob: float = 0.0, source: str = "suffix",
               noise: Callable[[int, int], float] | None = None) -> DraftTree | None:
    """Merge weighted continuations into a scored token tree, best-first by path probability.

    Args:
        continuations: ``(weight > 0, tokens)`` pairs, earlier ones first among ties.
        depth: most nodes on a root-to-leaf path (>= 1).
        topk: most children per node (>= 1).
        budget: most nodes (>= 1).
        min_prob: nodes whose path probability (count / total weight) is below it are left out.
        source: the name written into ``DraftTree.sources``.
        noise: for a sampled sequence, ``f(depth, token)``, the sampling noise ``E`` of
            ``token`` at the output position of a node at ``depth`` (``noise_fn``): children
            are then scored by ``log count - log E``, the shared-noise coupling of
            ``drafters/coupling.py``, so the child first in line is the one the target's
            exponential race is likeliest to draw. None: plain counts (greedy).

    Returns:
        A ``DraftTree`` (distinct sibling tokens; ``draft_logprobs`` the log of each node's
        count over its parent's), or None when no node qualifies.
    """
    root = _count_trie(continuations, depth)
    total = root[0]
    if total <= 0.0:
        return None
    tokens: list[int] = []
    parents: list[int] = []
    lps: list[float] = []
    nchild = [0]  # slot 0 = root, slot 1 + i = node i
    order = 0
    heap: list = []
    for t, child, p in _conditionals(root, 1, noise):
        heap.append((-p, order, -1, t, child, p, 1))
        order += 1
    heapq.heapify(heap)
    while heap and len(tokens) < budget:
        negp, _, par, tok, node, cond, d = heapq.heappop(heap)
        if -negp < min_prob:
            break
        if nchild[par + 1] >= topk:
            continue
        nchild[par + 1] += 1
        i = len(tokens)
        tokens.append(tok)
        parents.append(par)
        lps.append(math.log(cond))
        nchild.append(0)
        if d < depth and node[1]:
            for t, child, p in _conditionals(node, d + 1, noise):
                heapq.heappush(heap, (negp * p, order, i, t, child, p, d + 1))
                order += 1
    if not tokens:
        return None
    return DraftTree(tokens, parents, lps, [source] * len(tokens))


class SuffixDrafter(Drafter):
    """Drafts from the rollout memory of each sequence's prompt group (see the module
    docstring).

    Args:
        strategy: the default tree shape.
        max_tree_depth: most draft tokens per path whatever the strategy (vLLM's
            ``suffix_decoding_max_tree_depth``).
        min_token_prob: least path probability of a drafted node (vLLM's
            ``suffix_decoding_min_token_prob``).
        memory_bytes, history_decay, history_max_age, max_matches, backoff:
            ``RolloutMemory``'s ``cap_bytes``, ``decay``, ``max_age``, ``max_matches``,
            ``backoff``.
        coupled: rank a sampled sequence's children with its sampling noise (``noise_fn``;
            only with the C++ extension, whose noise ``noise_fn`` reproduces).
        clock: seconds, for the update and lookup timers (tests inject one).

    Raises:
        ValueError: an argument out of range, naming it.
    """

    name = "suffix"

    def __init__(self, strategy: Strategy, max_tree_depth: int = 24,
                 min_token_prob: float = 0.1, memory_bytes: int = 256 << 20,
                 history_decay: float = 0.5, history_max_age: int = 4, max_matches: int = 32,
                 backoff: float = 0.5, coupled: bool = True,
                 clock: Callable[[], float] = time.perf_counter):
        super().__init__(strategy)
        if not isinstance(max_tree_depth, int) or max_tree_depth < 1:
            raise ValueError(f"SuffixDrafter.max_tree_depth={max_tree_depth!r}: must be an "
                             f"int >= 1")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"SuffixDrafter.min_token_prob={min_token_prob!r}: must be in "
                             f"[0, 1]")
        self.max_tree_depth, self.min_token_prob = max_tree_depth, min_token_prob
        self.memory = RolloutMemory(memory_bytes, history_decay, history_max_age, max_matches,
                                    backoff)
        self.clock = clock
        self.coupled = coupled and ext() is not None
        self._live: dict[int, Sequence] = {}
        self.update_seconds = 0.0
        self.lookup_seconds = 0.0
        self.steps = 0  # propose calls
        self.lookups = 0  # sequences looked up
        self.matched = 0  # lookups that found a match
        self.match_len_sum = 0  # summed n of the matches found

    def propose(self, seqs: list[Sequence], strategy: Strategy) -> list[DraftTree | None]:
        """Catch every tracked sequence up (new sequences start tracking here), then one tree
        per sequence of ``seqs``."""
        t0 = self.clock()
        mem = self.memory
        for s in seqs:
            if s.seq_id not in self._live and mem.start(s.seq_id, s.token_ids,
                                                        s.num_prompt_tokens):
                self._live[s.seq_id] = s
        for sid, s in list(self._live.items()):
            if mem.is_tracked(sid):
                mem.sync(sid, s.token_ids)
            else:  # detached by an eviction
                del self._live[sid]
        t1 = self.clock()
        depth = min(strategy.depth, self.max_tree_depth)
        trees = []
        tail_len = max(INDEX_NS)
        for s in seqs:
            n, conts = mem.lookup(s.seq_id, s.token_ids[-tail_len:], depth)
            if n:
                self.matched += 1
                self.match_len_sum += n
            if not conts:
                trees.append(None)
                continue
            noise = None
            if self.coupled and not s.params.greedy:
                noise = noise_fn(s.noise.key, s.num_output_tokens)
            trees.append(build_tree(conts, depth, strategy.topk, strategy.budget,
                                    self.min_token_prob, noise=noise))
        t2 = self.clock()
        self.update_seconds += t1 - t0
        self.lookup_seconds += t2 - t1
        self.steps += 1
        self.lookups += len(seqs)
        return trees

    def release(self, seq: Sequence) -> None:
        """A finished sequence's response becomes history (``stop``/``length``; an aborted one
        is dropped)."""
        t0 = self.clock()
        keep = seq.finish_reason in KEPT_FINISH_REASONS
        if self._live.pop(seq.seq_id, None) is not None:
            self.memory.sync(seq.seq_id, seq.token_ids)
            self.memory.finish(seq.seq_id, keep)
        elif keep:  # never drafted for (e.g. the policy ran without speculation)
            self.memory.add_finished(seq.token_ids, seq.num_prompt_tokens)
        self.update_seconds += self.clock() - t0

    def set_weight_version(self, version: int) -> None:
        """Age the history: see ``RolloutMemory.set_version``."""
        t0 = self.clock()
        self.memory.set_version(version)
        self.update_seconds += self.clock() - t0

    def stats(self) -> dict:
        """``RolloutMemory.stats`` plus ``suffix_update_seconds`` / ``suffix_lookup_seconds``
        (totals), their ``_per_step`` means over ``suffix_steps`` propose calls and
        ``_per_sequence`` means over ``suffix_lookups`` sequence lookups, ``suffix_match_rate``
        (lookups that matched) and ``suffix_mean_match_len`` (tokens)."""
        steps, looks = max(self.steps, 1), max(self.lookups, 1)
        d = self.memory.stats()
        d.update(suffix_update_seconds=self.update_seconds,
                 suffix_lookup_seconds=self.lookup_seconds,
                 suffix_steps=self.steps, suffix_lookups=self.lookups,
                 suffix_update_seconds_per_step=self.update_seconds / steps,
                 suffix_lookup_seconds_per_step=self.lookup_seconds / steps,
                 suffix_update_seconds_per_sequence=self.update_seconds / looks,
                 suffix_lookup_seconds_per_sequence=self.lookup_seconds / looks,
                 suffix_match_rate=self.matched / looks,
                 suffix_mean_match_len=self.match_len_sum / max(self.matched, 1))
        return d
