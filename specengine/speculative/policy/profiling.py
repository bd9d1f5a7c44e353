"""Start-up profile: warm-start a ``LatencyModel`` before the first request.

``profile_forward`` times dummy decode forwards of the target over borrowed KV blocks, and
``profile_draft`` times the drafter on dummy sequences; both add their points to the model's
fixed prior (``prior=True``), which anchors the online fit (``latency.py``) where the served
steps do not reach. ``AutoPolicy.warm_start`` runs them (1.5 s + 0.5 s at most by default).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specengine.speculative.policy.latency import LatencyModel


def profile_forward(runner, blocks, model: LatencyModel, budget_s: float = 1.5,
                    drafter=None, draft_budget_s: float = 0.5,
                    clock: Callable[[], float] = time.perf_counter) -> int:
    """Warm-start ``model`` by timing dummy decode forwards of growing size with ``runner`` (a
    ``ModelRunner``) over KV blocks borrowed from ``blocks`` (returned afterwards), and, when a
    ``drafter`` is given, drafting chains and trees for dummy sequences (``profile_draft``).
    Stops before a point the fit so far predicts would overrun ``budget_s`` seconds; skips
    points the KV pool cannot hold. Returns the number of forward profile points added.
    ``clock`` (seconds) times the forwards and spends the budgets; tests pass a fake one, so
    the points that fit a budget are known exactly.

    The points span 1 .. 512 forward tokens, chains of 0, 1, 3 and 7 nodes per sequence (16
    sequences with 1 and 3: a chain's verify at an RL batch) and short and long contexts, so
    each feature of the forward fit is seen. The KV contents are whatever
    the pool holds (timing does not depend on them); the engine's sequences are not touched.
    """
    import torch

    from specengine.engine.batch import BatchEntry
    from specengine.engine.sequence import Sequence
    from specengine.sampling.params import SamplingParams
    from specengine.speculative.tree import DraftTree

    # (sequences, chain nodes per sequence, context per sequence)
    grid = [(1, 0, 32), (1, 0, 32), (1, 3, 32), (1, 7, 512), (4, 3, 64), (16, 0, 64),
            (1, 0, 1024), (16, 1, 64), (16, 3, 64), (16, 7, 64), (64, 3, 64), (8, 0, 512),
            (64, 7, 128), (128, 3, 64)]
    params = SamplingParams(temperature=0.0)
    start = clock()
    added = 0
    feature = None  # one hidden row of the target: what a drafter's dummy features are made of
    for i, (b, m, ctx) in enumerate(grid):
        left = budget_s - (clock() - start)
        if left <= 0 or (added >= 3 and model.forward_time(b * (1 + m), b * ctx, b) > left):
            break
        need = b * -(-(ctx + 1 + m) // blocks.block_size)
        if need > blocks.num_free:
            continue
        seqs, entries = [], []
        for _ in range(b):
            s = Sequence("profile", 0, [1] * (ctx + 1), params, torch.Generator())
            blocks.grow(s, ctx + 1 + m)
            s.num_cached = ctx
            tree = DraftTree([1] * m, list(range(-1, m - 1))) if m else None
            seqs.append(s)
            entries.append(BatchEntry(s, 1, [s], tree=tree))
        try:
            t0 = clock()
            logits, hidden = runner.run(entries, blocks)
            logits.cpu()  # wait for an accelerator
            seconds = clock() - t0
            feature = hidden[:1]
            if i > 0:  # the first forward pays one-off allocations
                model.add_forward(b * (1 + m), b * ctx, b, seconds, prior=True)
                added += 1
        finally:
            for s in seqs:
                blocks.free(s)
    if drafter is not None and feature is not None:
        profile_draft(drafter, model, feature, draft_budget_s, clock)
    return added


def profile_draft(drafter, model: LatencyModel, feature, budget_s: float = 0.5,
                  clock: Callable[[], float] = time.perf_counter) -> int:
    """Warm-start the draft part of ``model`` by timing ``drafter`` (a ``Drafter``) on dummy
    sequences: chains and trees of several depths, widths and batch sizes, so the fit sees
    nodes apart from depth x batch (from chains alone a tree's drafting cost is a guess). A
    drafter that reads target features (``wants_hidden``) is given ``feature`` (``[1, hidden]``,
    a real hidden row of the target) at every position: drafting time does not depend on the
    values. Each point is drafted twice: the first catches up on the whole context (a point
    with ``catch_up`` the sequences' tokens, but for the first point, which pays one-off
    allocations), the second drafts only (catch-up 0). Stops when
    ``budget_s`` seconds of ``clock`` are spent. Returns points added."""
    import torch

    from specengine.engine.sequence import Sequence
    from specengine.sampling.params import SamplingParams
    from specengine.speculative.strategy import Strategy

    grid = [(1, Strategy(3)), (1, Strategy(7)), (4, Strategy(3)), (1, Strategy(4, 4, 16)),
            (4, Strategy(3, 2, 6)), (16, Strategy(2)), (1, Strategy(6, 2, 12)),
            (16, Strategy(3, 2, 6)), (4, Strategy(6, 4, 24))]
    params = SamplingParams(temperature=0.0)
    ctx = 48
    start = clock()
    added = 0
    for i, (b, strategy) in enumerate(grid):
        if clock() - start > budget_s:
            break
        seqs = [Sequence("profile", 0, [1] * (ctx + 1), params, torch.Generator())
                for _ in range(b)]
        try:
            for s in seqs:
                s.num_cached = ctx
                if drafter.wants_hidden:
                    drafter.observe(s, 0, feature.expand(ctx + 1, -1))
            t0 = clock()
            drafter.propose(seqs, strategy)
            t1 = clock()
            trees = drafter.propose(seqs, strategy)
            seconds = clock() - t1
            nodes = sum(t.num_nodes for t in trees if t is not None)
            if nodes:
                if i > 0:  # the first drafts pay one-off allocations
                    model.add_draft(b, strategy.depth, nodes, t1 - t0, prior=True,
                                    catch_up=sum(len(s) for s in seqs))
                    added += 1
                model.add_draft(b, strategy.depth, nodes, seconds, prior=True)
                added += 1
        finally:
            for s in seqs:
                drafter.release(s)
    return added
