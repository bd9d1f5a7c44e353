"""Replay projection: a rollout's wall time under another speculation policy or on another
machine, predicted from a ``RolloutTrace`` (``specengine.replay.trace``) and a step-cost table
(``specengine.replay.cost_table``).

Policies:

- ``"as-logged"`` (alias ``"auto"``: replaying a trace recorded under the ``auto`` policy): the
  logged steps as they ran (tokens in each forward, contexts, draft nodes per source, rows
  sampled), each priced by the table, with the trace's policy's own cost where the table
  prices it.
- ``"off"``: no speculation. Every sequence advances one token per step until it reaches its
  logged output length (seeded sampling is lossless, so the outputs, and their lengths, are the
  same under every policy); the batch shrinks as sequences finish.
- ``"static:d=4"``, ``"static:d=6,k=2,m=12"``, optionally ``",source=eagle"``: a fixed chain or
  tree. Each sequence commits, per step, the expected ``1 + sum_j p_j`` tokens with ``p_j`` the
  probability that the accepted path reaches depth ``j``, and sends the expected ``sum_j n_j``
  nodes to the verifier, both from the per-depth, per-source statistics of a trace
  (``AcceptanceStats``; rows of steps with the same branching ``k``; the sequence's own rows
  when the statistics' trace ran the same prompt and sample, else the whole trace's). Past
  the deepest logged depth ``p_j`` decays geometrically with the last logged ratio and ``n_j``
  stays at the last logged value. Depth is cut where a sequence's ``max_tokens`` leaves no
  room, as the engine does.

``off`` and ``static`` are fluid simulations: sequences are admitted in the trace's order as
soon as ``max_num_seqs`` and ``max_num_batched_tokens`` allow (an offline rollout: every request
queued at the start); KV-cache limits and preemption are not modelled (a trace with
preemptions says so in ``ReplayResult.warnings``). Cost per step: ``CostTable.step_seconds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specengine.replay.cost_table import CostTable, StepShape
from specengine.replay.trace import RolloutTrace
from specengine.speculative.strategy import Strategy


@dataclass
class ReplayResult:
    """A predicted rollout.

    Attributes:
        policy: the policy replayed. table: the cost table's label.
        seconds: predicted wall seconds. steps: predicted engine steps.
        forward_s, draft_s, other_s, policy_s: the split of ``seconds``.
        tokens: tokens committed (the trace's output tokens).
        measured_s: the trace's measured wall seconds (None if not recorded).
        warnings: what the prediction could not model.
    """

    policy: str
    table: str
    seconds: float
    steps: int
    forward_s: float
    draft_s: float
    other_s: float
    policy_s: float
    tokens: int
    measured_s: float | None = None
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def logged_shape(step: dict, default_source: str = "draft",
                 policy: str | None = None) -> StepShape:
    """The ``StepShape`` of one logged trace step (see ``specengine.replay.trace`` for the fields),
    decided by ``policy``.

    The drafting cost is charged per source for every decode sequence of a speculative step,
    ``depth`` deep, with the nodes built (``proposed``; split over sources by their verified
    nodes when several)."""
    context = pairs = rows = nodes = 0
    per_source: dict[str, int] = {}
    for r in step["decode"]:
        length = r["ctx"] + 1
        context += length
        pairs += length
        rows += 1
        for src, counts in r.get("nodes", {}).items():
            n = sum(counts)
            nodes += n
            per_source[src] = per_source.get(src, 0) + n
            pairs += n * length + sum((d + 1) * c for d, c in enumerate(counts))
    for p in step["prefill"]:
        new, cached = p["new"], p["cached"]
        context += cached + new
        pairs += new * cached + new * (new + 1) // 2
        rows += len(p["seqs"])
    drafts = {}
    depth = step.get("depth", 0)
    if depth and step["decode"]:
        proposed = step.get("proposed", 0) or nodes
        total = sum(per_source.values())
        if not per_source:
            per_source = {default_source: 0}
        for src, n in per_source.items():
            share = n / total if total else 1.0 / len(per_source)
            drafts[src] = (len(step["decode"]), depth, proposed * share)
    return StepShape(step["forward_tokens"], context, pairs, rows, nodes, drafts, policy)


class _Counts:
    """Per-depth tallies of verified rows: ``eligible[k][j-1]`` rows of steps with branching
    ``k`` and depth ``>= j``; ``reach[(source, k)][j-1]`` rows whose accepted path reached depth
    ``j`` through a node of ``source``; ``nodes[(source, k)][j-1]`` nodes of ``source`` at depth
    ``j``."""

    def __init__(self) -> None:
        self.eligible: dict[int, list[int]] = {}
        self.reach: dict[tuple[str, int], list[int]] = {}
        self.nodes: dict[tuple[str, int], list[int]] = {}

    def add(self, row: dict, depth: int, k: int) -> None:
        el = self.eligible.setdefault(k, [])
        el += [0] * (depth - len(el))
        for j in range(depth):
            el[j] += 1
        for src, counts in row.get("nodes", {}).items():
            acc = self.nodes.setdefault((src, k), [])
            acc += [0] * (len(counts) - len(acc))
            for j, c in enumerate(counts):
                acc[j] += c
        for j, src in enumerate(row.get("path", [])):
            acc = self.reach.setdefault((src, k), [])
            acc += [0] * (j + 1 - len(acc))
            acc[j] += 1


class AcceptanceStats:
    """Per-depth, per-source acceptance of a trace's verified trees, by branching ``k``, over
    the whole trace and per sequence.

    For the decode rows of speculative steps with branching ``k`` and depth ``>= j``:
    ``p(source, k, j)`` = fraction whose accepted path reached depth ``j`` through a node of
    ``source``; ``n(source, k, j)`` = mean nodes of ``source`` at depth ``j``. A sequence is
    known by ``(group, index)`` (its prompt's hash and sample index), so a trace of the same
    prompts under another policy finds its statistics; with at least ``min_rows`` rows of its
    own a sequence uses them (acceptance differs a lot between sequences, and the slowest ones
    make the rollout's tail), else the whole trace's.

    Args:
        trace: the trace (its speculative steps) to count.
        min_rows: rows a sequence needs for its own statistics.

    Raises:
        ValueError: ``per_depth``/``expected`` for a source or branching the trace has no
            rows for.
    """

    def __init__(self, trace: RolloutTrace, min_rows: int = 4):
        self.min_rows = min_rows
        self.overall = _Counts()
        self.per_seq: dict[tuple, _Counts] = {}
        for st in trace.steps:
            d, k = st.get("depth", 0), st.get("topk", 0)
            if not d:
                continue
            for r in st["decode"]:
                self.overall.add(r, d, k)
                info = trace.sequences[r["seq"]]
                key = (info.get("group"), info.get("index"))
                self.per_seq.setdefault(key, _Counts()).add(r, d, k)

    def sources(self) -> list[tuple[str, int]]:
        """``(source, k)`` pairs with nodes in the trace."""
        return sorted(self.overall.nodes)

    def per_depth(self, source: str, k: int, seq: tuple | None = None
                  ) -> tuple[list[float], list[float]]:
        """``(p, n)``: per depth ``j = 1..D`` (the deepest logged), the probability of reaching
        depth ``j`` and the mean nodes at depth ``j``, for ``source`` at branching ``k``; of
        sequence ``seq`` (``(group, index)``) when it has ``min_rows`` rows of its own."""
        if (source, k) not in self.overall.nodes:
            have = ", ".join(f"{s} k={kk}" for s, kk in self.sources()) or "none"
            raise ValueError(f"the acceptance trace has no draft nodes from source {source!r} "
                             f"with branching k={k} (it has: {have})")
        c = self.per_seq.get(seq)
        if (c is None or (source, k) not in c.nodes
                or c.eligible.get(k, [0])[0] < self.min_rows):
            c = self.overall
        el, nodes = c.eligible[k], c.nodes[(source, k)]
        reach = c.reach.get((source, k), [])
        depth = len(nodes)
        p = [reach[j] / el[j] if j < len(reach) and el[j] else 0.0 for j in range(depth)]
        n = [nodes[j] / el[j] if el[j] else 0.0 for j in range(depth)]
        return p, n

    def expected(self, source: str, strategy: Strategy, seq: tuple | None = None
                 ) -> tuple[list[float], list[float]]:
        """Cumulative ``(accepted, nodes)`` expected per sequence-step for ``strategy`` cut at
        depth ``0..strategy.depth``: ``accepted[d] = sum_{j<=d} p_j``, ``nodes[d] = sum_{j<=d}
        n_j`` (index 0 is 0, 0), extrapolated past the logged depth as the module says; of
        sequence ``seq`` as ``per_depth`` says."""
        p, n = self.per_depth(source, strategy.topk, seq)
        depth = len(p)
        ratio = 0.0
        if depth >= 2 and p[-2] > 0:
            ratio = min(p[-1] / p[-2], 1.0)
        acc, nod = [0.0], [0.0]
        for j in range(strategy.depth):
            pj = p[j] if j < depth else p[-1] * ratio ** (j - depth + 1)
            nj = n[j] if j < depth else n[-1]
            acc.append(acc[-1] + pj)
            nod.append(min(nod[-1] + nj, strategy.budget))
        return acc, nod


def parse_policy(policy: str) -> tuple[str, Strategy | None, str | None]:
    """``(kind, strategy, source)`` of a policy string: ``"off"``, ``"as-logged"`` /
    ``"auto"``, or ``"static:d=4[,k=2,m=8][,source=eagle]"``.

    Raises:
        ValueError: anything else, naming the policy.
    """
    if policy in ("off", "as-logged", "auto"):
        return ("as-logged" if policy == "auto" else policy), None, None
    if policy.startswith("static:"):
        keys = {}
        for part in policy[len("static:"):].split(","):
            name, eq, val = part.partition("=")
            if not eq or name.strip() not in ("d", "k", "m", "source"):
                raise ValueError(f"policy {policy!r}: expected 'static:d=D[,k=K,m=M]"
                                 f"[,source=NAME]', got the part {part!r}")
            keys[name.strip()] = val.strip()
        try:
            strategy = Strategy(int(keys["d"]), int(keys.get("k", 1)),
                                int(keys["m"]) if "m" in keys else None)
        except (KeyError, ValueError) as e:
            raise ValueError(f"policy {policy!r}: {e}") from None
        return "static", strategy, keys.get("source")
    raise ValueError(f"policy {policy!r}: use 'off', 'as-logged' (or 'auto') or "
                     "'static:d=D[,k=K,m=M][,source=NAME]'")


def replay(trace: RolloutTrace, table: CostTable, policy: str,
           stats: AcceptanceStats | None = None) -> ReplayResult:
    """Predict ``trace``'s rollout wall time under ``policy`` priced by ``table``.

    Args:
        trace: the logged rollout (output lengths, admission order, logged steps).
        table: step costs.
        policy: see ``parse_policy`` and the module docstring.
        stats: acceptance statistics for ``static`` (default: from ``trace`` itself).

    Raises:
        ValueError: a bad policy; ``static`` without acceptance statistics for its source.
    """
    kind, strategy, source = parse_policy(policy)
    warnings = []
    if not table.prices(trace.meta.get("model")):
        warnings.append(f"the table prices {table.model!r} but the trace ran "
                        f"{trace.meta.get('model')!r}: its seconds are another model's")
    if trace.meta.get("preemptions"):
        warnings.append(f"the trace had {trace.meta['preemptions']} preemptions; the replay "
                        "does not model KV-cache limits")
    if kind == "as-logged":
        if policy == "auto" and trace.meta.get("policy") != "auto":
            warnings.append(f"'auto' replays the logged steps, but the trace ran policy "
                            f"{trace.meta.get('policy')!r}")
        default = trace.meta.get("drafter") or "draft"
        pol = trace.meta.get("policy")
        parts = [table.step_seconds(logged_shape(st, default, pol)) for st in trace.steps]
        steps = len(parts)
    else:
        expect = None
        if kind == "static":
            stats = stats or AcceptanceStats(trace)
            source = source or trace.meta.get("drafter")
            if source is None:
                raise ValueError(f"policy {policy!r}: the trace has no drafter; name a source "
                                 "(',source=NAME') and give statistics from a speculative trace")
            stats.expected(source, strategy)  # raises for a source the statistics lack
            cache: dict = {}

            def expect(key):
                if key not in cache:
                    cache[key] = stats.expected(source, strategy, key)
                return cache[key]
        parts = _simulate(trace, table, strategy, source, expect)
        steps = len(parts)
    total = {k: sum(p[k] for p in parts)
             for k in ("forward", "draft", "other", "policy", "total")}
    return ReplayResult(policy, table.label, total["total"], steps, total["forward"],
                        total["draft"], total["other"], total["policy"], trace.output_tokens,
                        trace.wall_s, warnings)


def _admission_units(trace: RolloutTrace) -> list[tuple[list[int], int, int]]:
    """``(sequence ids, new prompt tokens, cached tokens)`` per first prefill, in the trace's
    order; sequences first seen decoding (traced mid-rollout) come first, with no prefill."""
    seen, units = set(), []
    early = sorted(i for i, s in trace.sequences.items() if s["first_step"] == 0)
    prefilled = {j for st in trace.steps[:1] for p in st["prefill"] for j in p["seqs"]}
    running = [i for i in early if i not in prefilled]
    if running:
        units.append((running, 0, 0))
        seen.update(running)
    for st in trace.steps:
        for p in st["prefill"]:
            ids = [j for j in p["seqs"] if j not in seen]
            if ids:
                units.append((ids, p["new"], p["cached"]))
                seen.update(ids)
    return units


@dataclass
class _StepSums:
    """One simulated step's totals (``StepShape``'s fields but ``drafts``)."""

    tokens: float = 0
    context: float = 0
    pairs: float = 0
    rows: int = 0
    nodes: float = 0.0


def _simulate(trace: RolloutTrace, table: CostTable, strategy: Strategy | None,
              source: str | None, expect) -> list[dict]:
    """The fluid simulation behind ``off`` and ``static``: one cost dict per step.
    ``expect((group, index))`` gives a sequence's cumulative ``(accepted, nodes)`` per depth
    (``AcceptanceStats.expected``; None for ``off``)."""
    max_seqs = trace.meta.get("max_num_seqs") or math.inf
    max_tokens = trace.meta.get("max_num_batched_tokens") or math.inf
    waiting = _admission_units(trace)
    running: list[list] = []  # [length, produced, output length, max_tokens, acc, nodes]
    parts = []
    while waiting or running:
        t = _StepSums()
        _decode(running, strategy, t)
        drafting = len(running)
        _admit(waiting, running, trace.sequences, expect, max_seqs, max_tokens - len(running), t)
        if t.tokens == 0 and not running:
            if waiting:
                raise ValueError("a sequence group of the trace cannot be admitted within its "
                                 f"max_num_seqs={max_seqs}")
            break
        drafts = {}
        if strategy is not None and drafting:
            drafts[source] = (drafting, strategy.depth, t.nodes)
        parts.append(table.step_seconds(StepShape(t.tokens, t.context, t.pairs, t.rows, t.nodes,
                                                  drafts)))
        running = [r for r in running if r[1] < r[2] - 1e-9]
    return parts


def _decode(running: list[list], strategy: Strategy | None, t: _StepSums) -> None:
    """One decode (or verify) step of every running sequence: adds its work to ``t`` and
    advances each by its expected committed tokens (``1 + accepted`` at the strategy's depth,
    capped by its output length)."""
    for r in running:
        length, produced, out, cap, acc, nod = r
        depth = 0
        if strategy is not None:
            depth = max(min(strategy.depth, int(cap - produced) - 1), 0)
        a = acc[depth] if depth else 0.0
        n = nod[depth] if depth else 0.0
        t.context += length
        t.tokens += 1 + n
        t.nodes += n
        t.pairs += length * (1 + n) + (sum(
            (j + 1) * (nod[j + 1] - nod[j]) for j in range(depth)) if depth else 0)
        t.rows += 1
        step = min(1 + a, out - produced)
        r[0] += step
        r[1] += step


def _admit(waiting: list, running: list[list], seqs: list[dict], expect, max_seqs: float,
           budget: float, t: _StepSums) -> None:
    """Admit waiting units (``_admission_units``) in order while ``max_seqs`` and the token
    ``budget`` allow (the first always fits a step with no other token): their prefills'
    work goes into ``t``, their sequences join ``running``."""
    while waiting and len(running) + len(waiting[0][0]) <= max_seqs:
        ids, new, cached = waiting[0]
        if new > budget and t.tokens:
            break
        waiting.pop(0)
        t.tokens += new
        budget -= new
        t.context += cached + new
        t.pairs += new * cached + new * (new + 1) // 2
        for i in ids:
            s = seqs[i]
            out = s["output_tokens"]
            if out <= 0:
                continue
            acc, nod = expect((s.get("group"), s.get("index"))) if expect else (None, None)
            first = 1 if new else 0  # the prefill samples each sequence's first token
            t.rows += first
            running.append([s["prompt_tokens"] + first, first, out,
                            s.get("max_tokens") or out, acc, nod])
