"""Drafters behind one interface: given the decoding sequences and a strategy, a token tree each.

The engine calls ``propose`` before the target forward, ``observe`` after it (EAGLE reads the
target's hidden states there), ``release`` when a sequence finishes and ``set_weight_version``
when the target's weights change.

A drafter may wrap others (a training ``Harvester`` its inner drafter, a ``MergedDrafter`` its
parts): ``wrapped()`` lists them, ``walk()`` visits the whole nest and ``find(kind)`` picks the
first of a kind. What only some drafters have is declared here with neutral defaults:
``kv_pools`` (a KV pool of their own), ``packed_weights`` / ``drop_packed`` (kernel copies of
weights), ``trainable_model`` / ``publish`` (weights that can be trained and swapped in; EAGLE's
``version`` then says which are in use).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import torch

from specengine.engine.sequence import Sequence
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree

D = TypeVar("D", bound="Drafter")


class Drafter:
    """Base drafter. ``strategy`` is the tree shape used when no policy chooses one.

    Attributes:
        name: the source name its tree nodes carry.
        wants_hidden: True: the engine calls ``observe`` with target hidden states.
        observes_at_draft: True (with ``wants_hidden``): the drafter needs a sequence's
            features only when it drafts for it, so an engine that keeps the target's features
            per KV slot (``BlockFeatures``) hands them over then, the missing ones in one read
            (``phases.hand_features``, from ``observed``), and after a step only to the
            sequences drafted for; a step that drafts for none does no per-sequence work for
            it. False: ``observe`` gets every committed position every step.
        catches_up: True: the drafter keeps per-sequence state built from the tokens it has
            seen (EAGLE's and a draft model's KV), so a draft first catches up on the tokens
            committed since it last drafted (``Sequence.catch_up``); False: stateless
            (n-gram, suffix), drafting costs the same whenever it starts.
    """

    name = "base"
    wants_hidden = False
    observes_at_draft = False
    catches_up = False

    def __init__(self, strategy: Strategy):
        self.strategy = strategy

    def propose(self, seqs: list[Sequence], strategy: Strategy) -> list[DraftTree | None]:
        """One tree per sequence (None: nothing to draft), at most ``strategy.budget`` nodes
        and ``strategy.depth`` deep; the root is each sequence's last token. Each node should
        be scored (``draft_logprobs``: log-probability of the node given its parent, so that
        ``exp`` of the cumulative sum is the drafter's confidence in the path) and labelled
        (``sources``: the drafter's ``name``), for the per-source calibration that cuts trees
        and merges several drafters' trees (``merged.MergedDrafter``)."""
        raise NotImplementedError

    def observe(self, seq: Sequence, start: int, hidden: torch.Tensor) -> None:
        """After a target forward (only if ``wants_hidden``): ``hidden`` ``[r, hidden_size]``
        holds the target's last hidden states (after the final norm) of positions
        ``start .. start+r-1`` of ``seq``, which became committed in this step: the prompt at
        prefill (``start`` 0; also when a preempted sequence is recomputed), then the root and
        the accepted draft nodes of each verify step."""

    def observed(self, seq: Sequence) -> int:
        """``n``: the drafter holds the target features of positions ``0 .. n-1`` of ``seq``
        (0 here: it keeps none)."""
        return 0

    def release(self, seq: Sequence) -> None:
        """``seq`` finished (``seq.finish_reason`` says why: ``"stop"``, ``"length"``,
        ``"abort"`` or None when every request was aborted): drop any state kept for it. The
        engine calls it before ``seq``'s KV blocks go back (its stored features can still be
        read: the training ``Harvester`` does)."""

    def prefill(self, samples: list[Sequence]) -> list[Sequence]:
        """The target has just prefilled a prompt (its whole prompt cached, no token appended
        yet) whose ``samples`` (one request's ``n``, the same tokens) this drafter holds the
        target features of (``observed``, the first at least). A drafter with per-sequence
        state that it must build before it can draft (EAGLE's KV) may build it now, once for
        all samples, so that turning speculation on later costs only the tokens generated
        since (``Sequence.catch_up``) and not the prompt, for each sample. Returns the samples
        it built the state of (the engine then counts their prompt as seen:
        ``Sequence.drafted_through``); ``[]`` (default): none, the first draft catches up on
        the prompt."""
        return []

    def set_weight_version(self, version: int) -> None:
        """The target's weights are now version ``version`` (the engine calls this whenever
        its ``weight_version`` is set: at start and after each weight update). No-op here; the
        suffix drafter ages its rollout history by it."""

    def stats(self) -> dict:
        """Drafter metrics merged into ``LLM.get_metrics()`` (none here)."""
        return {}

    def discard(self, seq: Sequence) -> None:
        """``seq`` left this engine unfinished (it continues on another): drop its state
        without treating it as finished (default: ``release``)."""
        self.release(seq)

    def features(self, seq: Sequence) -> torch.Tensor | None:
        """The target features this drafter has observed for ``seq``, ``[n, hidden_size]``
        for positions ``0 .. n-1`` (a view; EAGLE keeps them), or None if it keeps none. A
        sample moved to another engine takes them along (``specengine.lifecycle.migration``); that
        engine's drafter gets them through ``observe(seq, 0, features)``."""
        return None

    # ---- drafters inside drafters -----------------------------------------------------------
    def wrapped(self) -> list[Drafter]:
        """The drafters this one wraps, in order (a ``Harvester``: its inner drafter; a
        ``MergedDrafter``: its parts); ``[]`` for a plain drafter."""
        return []

    def walk(self) -> Iterator[Drafter]:
        """This drafter, then every drafter it wraps, depth first (in ``wrapped`` order)."""
        yield self
        for d in self.wrapped():
            yield from d.walk()

    def find(self, kind: type[D]) -> D | None:
        """This drafter or the first one it wraps (depth first) that is an instance of
        ``kind``; None if there is none."""
        return next((d for d in self.walk() if isinstance(d, kind)), None)

    # ---- optional capabilities (neutral defaults) ---------------------------------------------
    def kv_pools(self) -> list[torch.Tensor]:
        """The KV pool tensors this drafter owns (not those of drafters it wraps; use
        ``walk``), which sleep releases and wake restores; ``[]`` (default): none."""
        return []

    def packed_weights(self) -> list:
        """The kernels' packed copies (``ops.kernels.PackedWeight``) of weights this drafter
        keeps (EAGLE: of its ``fc`` and the shared LM-head rows); ``[]`` (default): none."""
        return []

    def drop_packed(self) -> None:
        """Forget the packed copies of ``packed_weights`` (rebuilt on first use); no-op here."""

    def trainable_model(self) -> torch.nn.Module | None:
        """The network whose weights can be trained and published (``publish`` takes its
        ``state_dict``), or None (default): nothing to train."""
        return None

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Take new weights (a ``state_dict`` of ``trainable_model()``) as ``version``.

        Raises:
            ValueError: this drafter has no trainable weights (the default).
        """
        raise ValueError(f"drafter {self.name!r} takes no published weights")


def prune_tree(tree: DraftTree | None, max_depth: int, max_nodes: int) -> DraftTree | None:
    """``tree`` without nodes deeper than ``max_depth`` and with at most ``max_nodes`` nodes
    (parents precede children, so the kept nodes still form a tree); None if nothing is left."""
    if tree is None or max_depth < 1 or max_nodes < 1:
        return None
    keep = [i for i, d in enumerate(tree.depths) if d <= max_depth][:max_nodes]
    return tree.subset(keep)

