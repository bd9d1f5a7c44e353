"""The phases of one ``Engine.step``: schedule, draft, sample / verify, KV commit, the
drafter's observation of the committed positions, and the appending of tokens with the stop
rules. What they hand each other is in ``specengine.engine.step``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specengine.engine.batch import BatchEntry
from specengine.engine.model_runner import ModelRunner
from specengine.engine.output_processor import OutputProcessor
from specengine.engine.scheduler import Scheduler
from specengine.engine.sequence import Request, Sequence
from specengine.engine.step import Commit, ForwardLayout
from specengine.kv.block_manager import BlockManager
from specengine.sampling.sampler import Sampler
from specengine.speculative.drafters.base import Drafter, prune_tree
from specengine.speculative.strategy import Strategy


def schedule(scheduler: Scheduler, blocks: BlockManager, runner: ModelRunner,
             drafter: Drafter | None, policy) -> tuple[Strategy | None, list[BatchEntry]]:
    """The policy's strategy for this step (None without a drafter, or to decode plainly)
    and the scheduler's entries, with KV room for the strategy's draft tokens."""
    strategy = None
    if drafter is not None:
        strategy = policy.choose(len(scheduler.running))
        if drafter.wants_hidden:  # prefix hits must bring their features along
            blocks.track_features(runner.model.config.hidden_size, runner.dtype, runner.device)
    return strategy, scheduler.schedule(lookahead=strategy.budget if strategy else 0)


def max_forward_tokens(entries: list[BatchEntry], strategy: Strategy | None) -> int:
    """Tokens the forward holds at most (every decode drafting the full budget): sizes the
    kernels' threads (decode-sized steps use the kernels' threads only)."""
    lookahead = strategy.budget if strategy else 0
    return sum(e.num_new + (lookahead if not e.is_prefill else 0) for e in entries)


def draft(drafter: Drafter, policy, blocks: BlockManager, entries: list[BatchEntry],
          strategy: Strategy | None, max_model_len: int) -> tuple[int | None, int]:
    """Attach a draft tree to each decode entry, pruned to what the sequence may still
    commit (``max_tokens``, ``max_model_len``), then cut by the policy's ``refine``.
    Returns the draft nodes built (before the policy's cuts; None without a strategy) and the
    tokens the drafter caught up on (``Sequence.catch_up`` of the sequences drafted for)."""
    if strategy is None:
        return None, 0
    decodes = [e for e in entries if not e.is_prefill]
    if not decodes:
        return 0, 0
    keep = policy.select([e.seq for e in decodes], strategy)  # may skip some
    decodes = [e for e, k in zip(decodes, keep) if k]
    catch_up = sum(e.seq.catch_up for e in decodes)
    for e in decodes:
        e.drafted = True
    if decodes and at_draft(drafter, blocks):
        hand_features(drafter, blocks, [e.seq for e in decodes])
    trees = drafter.propose([e.seq for e in decodes], strategy) if decodes else []
    for e, tree in zip(decodes, trees):
        s = e.seq
        room = min(s.params.max_tokens - s.num_output_tokens, max_model_len - len(s)) - 1
        e.tree = prune_tree(tree, max_depth=room, max_nodes=max_model_len - len(s)) \
            if tree is not None else None
    built = sum(e.tree.num_nodes for e in decodes if e.tree is not None)
    if decodes:  # the policy may cut trees further
        base = sum(e.num_new for e in entries)
        cut = policy.refine([e.seq for e in decodes], [e.tree for e in decodes], base)
        for e, tree in zip(decodes, cut):
            e.tree = tree
    return built, catch_up


def sample(sampler: Sampler, layout: ForwardLayout, logits: torch.Tensor) -> list[Commit]:
    """Draw every plain row in one ``Sampler.sample`` (each of a prefill's samples from the
    prompt's last row) and verify every token tree in one ``Sampler.verify_trees``.

    Args:
        logits: ``[R, V]`` float32, rows as ``layout.logits_rows`` says.

    Returns:
        The commits: the plain rows' first, then the trees', in entry order.
    """
    plain = [(e, s, r) for e, r in layout.plain() for s in e.samplers]
    commits = []
    if plain:
        rows = [r for _, _, r in plain]  # all rows in order (plain decoding): no copy
        tokens, lps = sampler.sample(
            logits if rows == list(range(len(logits))) else logits[rows],
            [s for _, s, _ in plain])
        commits += [Commit(e, s, [t], [lp]) for (e, s, _), t, lp in zip(plain, tokens, lps)]
    trees = layout.trees()
    verified = sampler.verify_trees(
        [e.seq for e, _ in trees], [e.tree for e, _ in trees],
        [logits[r:r + 1 + e.tree.num_nodes] for e, r in trees])
    for (e, _), (accepted, tokens, lps) in zip(trees, verified):
        commits.append(Commit(e, e.seq, tokens, lps, accepted))
    return commits


def commit_kv(runner: ModelRunner, blocks: BlockManager, layout: ForwardLayout,
              commits: list[Commit]) -> None:
    """KV commit: an entry without a tree has its tokens cached now (for each of its
    samples); a verified tree's accepted nodes move to the contiguous positions after the
    root, the rest of its slots are dropped."""
    for e, _ in layout.plain():
        cached = e.seq.num_cached + e.num_new
        for s in e.samplers:
            s.num_cached = cached
    for c in commits:
        if not c.is_verified:
            continue
        seq = c.seq
        ctx = seq.num_cached + 1  # committed tokens including the root
        src = [ctx + a for a in c.accepted]
        dst = [ctx + j for j in range(len(c.accepted))]
        if src != dst:
            runner.move_kv(blocks, seq, src, dst)
        seq.num_cached = ctx + len(c.accepted)


def at_draft(drafter: Drafter, blocks: BlockManager) -> bool:
    """Whether ``drafter`` gets a sequence's target features when it drafts for it
    (``Drafter.observes_at_draft``, from the KV blocks' feature store) instead of every
    step."""
    return drafter.wants_hidden and drafter.observes_at_draft and blocks.features is not None


def hand_features(drafter: Drafter, blocks: BlockManager, seqs: list[Sequence]) -> None:
    """Before drafting for ``seqs``: hand ``drafter`` the target features of each one's
    cached positions it does not hold yet (``Drafter.observed`` .. ``num_cached``), read
    from the KV blocks' feature store in one gather. A sequence whose features are not all
    in the store (none here for it) gets none and is not drafted for."""
    spans = [(s, drafter.observed(s), s.num_cached) for s in seqs]
    spans = [(s, a, b, blocks.slots(s, a, b)) for s, a, b in spans if a < b]
    store = blocks.features
    slots = [slot for *_, span_slots in spans for slot in span_slots]
    if slots and not store.all_valid(slots):  # rare: find the spans that lack some
        spans = [sp for sp in spans if store.all_valid(sp[3])]
        slots = [slot for *_, span_slots in spans for slot in span_slots]
    if not slots:
        return
    feats = store.read(slots)
    row = 0
    for s, a, b, _ in spans:
        drafter.observe(s, a, feats[row:row + b - a])
        row += b - a


def observe(drafter: Drafter | None, blocks: BlockManager, layout: ForwardLayout,
            hidden: torch.Tensor, commits: list[Commit],
            fed_slots: list[int] | None = None) -> None:
    """Store the hidden states (``hidden`` ``[T, H]``) of the positions committed this step
    (a prefill's tokens, a decode's root and the accepted tree nodes after it) in the KV
    blocks' feature store, and hand them to a drafter that reads the target's features
    (EAGLE): every sequence's, or, for one that takes them at draft time (``at_draft``),
    only those of the sequences drafted for this step whose earlier features it holds.
    ``fed_slots``: the KV slot of each of the ``T`` tokens fed (``ModelRunner.last_slots``);
    in a step without trees every token fed is committed where it was written, so a drafter
    that takes features at draft time and drafted for none costs one store of ``hidden`` at
    those slots (no per-sequence work: a step's Python runs on caches the forward evicted)."""
    if drafter is None or not drafter.wants_hidden:
        return
    if (fed_slots is not None and len(fed_slots) == hidden.shape[0] and at_draft(drafter, blocks)
            and not any(e.drafted for e in layout.entries)):
        blocks.features.write(fed_slots, hidden)
        return
    accepted = {id(c.entry): c.accepted for c in commits if c.is_verified}
    rows, spans = [], []
    for i, e in enumerate(layout.entries):
        r = layout.committed_token_rows(i, accepted.get(id(e)))
        rows += r
        spans.append((e.seq, e.seq.num_cached - len(r), len(r)))
    # without trees every row is committed, in order: no gather
    feats = hidden if not layout.trees() and len(rows) == hidden.shape[0] else hidden[rows]
    if not at_draft(drafter, blocks):
        observed = blocks.observe_features(  # + the cached prefix after a hit
            spans, feats, [e.is_prefill for e in layout.entries])
        for e, (start, f) in zip(layout.entries, observed):
            for s in e.samplers or [e.seq]:
                drafter.observe(s, start, f)
        return
    blocks.store_features(spans, feats)  # the drafter reads it there when it drafts
    row = 0
    for e, (_, start, r) in zip(layout.entries, spans):
        if e.drafted:  # a decode: no cached prefix to prepend
            for s in e.samplers or [e.seq]:
                if drafter.observed(s) >= start:
                    drafter.observe(s, start, feats[row:row + r])
        row += r


def prefill_drafter(drafter: Drafter | None, blocks: BlockManager,
                    layout: ForwardLayout) -> None:
    """After ``observe``: for each prompt whose prefill finished this step (whole prompt
    cached, no token appended yet), a drafter that keeps per-sequence state builds it now,
    once for the prompt's samples (``Drafter.prefill``; its first sample's features handed
    over first, from the KV blocks' feature store when the drafter reads them at draft
    time), and their prompt counts as seen (``Sequence.drafted_through``): turning
    speculation on later catches up on the generated tokens only."""
    if drafter is None or not drafter.catches_up:
        return
    for e in layout.entries:
        if not e.is_prefill or e.seq.num_cached < len(e.seq):
            continue  # a decode, or a chunk of a prompt still prefilling
        samples = e.samplers or [e.seq]
        if at_draft(drafter, blocks):
            hand_features(drafter, blocks, samples[:1])
        for s in drafter.prefill(samples):
            s.drafted_through = len(s.token_ids)


def append(requests: dict[str, Request], output: OutputProcessor, blocks: BlockManager,
           finish_sample: Callable[[Sequence], None], weight_version: int,
           layout: ForwardLayout, commits: list[Commit], hidden: torch.Tensor,
           now: float) -> tuple[int, list[Request]]:
    """Append each commit's tokens one at a time with the stop rules (``OutputProcessor``),
    each stamped with ``weight_version``; a sequence that stops is handed to
    ``finish_sample`` (its KV blocks go back) and drops the rest of its tokens. A sequence
    with ``return_hidden_states`` keeps the rows of ``hidden`` ``[T, H]`` that produced the
    tokens it appended. Then the decodes still running give back their unused draft slots.

    Returns:
        ``(tokens appended, requests whose samples have all finished)``.
    """
    num_appended, finished = 0, []
    index = None
    for c in commits:
        req = requests[c.seq.request_id]
        req.first_token_time = req.first_token_time or now
        n = 0
        for tok, lp in zip(c.tokens, c.logprobs):
            num_appended += 1
            c.seq.weight_versions.append(weight_version)
            n += 1
            if output.append(c.seq, tok, lp):
                finish_sample(c.seq)
                if all(s.is_finished for s in req.seqs):
                    finished.append(req)
                break
        if c.seq.hidden_states is not None:
            index = index or {id(e): i for i, e in enumerate(layout.entries)}
            rows = layout.sampling_rows(index[id(c.entry)], c.accepted)[:n]
            c.seq.hidden_states.append(hidden[rows].cpu())
    for e in layout.decodes:
        if not e.seq.is_finished:  # give back the draft slots
            blocks.shrink(e.seq, e.seq.num_cached)
    return num_appended, finished
