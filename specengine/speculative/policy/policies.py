"""``AutoPolicy`` and the factory: ``make_policy`` builds the policy a ``SpeculativeConfig``
names, over ``candidate_strategies``.

- ``AutoPolicy``: RLHFSpec's criterion (arXiv 2512.04752): each step, the strategy with the most
  expected committed tokens per second for the whole batch, from an online latency model
  (``latency.py``) and an online acceptance model (``acceptance.py``), with hysteresis.

The ``Policy`` interface, ``StepRecord`` and the fixed policies are in ``base.py``; TLT's bandit
in ``bandit.py``.
"""

from __future__ import annotations

import math
import time

import numpy as np

from specengine.speculative.config import POLICIES
from specengine.speculative.policy.acceptance import AcceptanceModel
from specengine.speculative.policy.bandit import BanditPolicy
from specengine.speculative.policy.base import (
    Policy,
    StaticPolicy,
    StepRecord,
    batch_bucket,
    strategy_name,
)
from specengine.speculative.policy.calibration import (
    Calibrator,
    bin_of,
    confidence_list,
    is_scored,
    keep_worth,
)
from specengine.speculative.policy.latency import LatencyModel
from specengine.speculative.policy.profiling import profile_forward
from specengine.speculative.strategy import Strategy


class AutoPolicy(Policy):
    """Cost-model policy: maximise expected committed tokens per second for the batch.

    For each candidate s and a batch of B sequences with total context C:
    ``score(s) = B * E[committed | s] / T(B, C, s)``, with ``E[committed]`` from the
    ``AcceptanceModel`` and ``T`` from the ``LatencyModel`` (draft + verify forward of
    ``B*(1+E[nodes|s])`` tokens, plus the rest). The current strategy is kept unless another
    scores ``hysteresis`` better. Probes measure what the current choice cannot: 4, 8, 16, ...
    steps after speculation was switched on or off (not between two strategies), then every
    ``probe_every`` steps. While speculation is off, a probe runs the best chain for
    ``probe_seqs`` of the sequences only (rotating), so the acceptance statistics stay current
    at the cost of a few forward tokens, not a speculative step of the whole batch; while
    speculating and predicted less than ``probe_margin`` better than no speculation, a probe
    runs a step without it, so the latency model sees both sides of a close call instead of
    extrapolating to the one not taken. With probes disabled the statistics decay towards the
    prior instead (``AcceptanceModel.age``) so speculation is retried. A tree shape never run is
    predicted from the chain's rates (``acceptance.tree_prior``), so trees compete only once the
    chain has been measured on a few sequences. Each score is multiplied by a per-bucket
    correction, the moving average of observed over modelled throughput of the steps that
    strategy ran (what the two models miss, e.g. a drafter's real cost); an unrun strategy has
    1, and a correction not refreshed fades back to 1 (1% per step of its bucket), so a strategy
    judged on another workload is tried again. After drafting, ``refine`` cuts each scored tree
    (EAGLE, draft model) to the nodes whose calibrated acceptance probability
    (``calibration.Calibrator``: the drafter's own confidence, calibrated online globally and
    per request) pays for the verify time they add. Scores are recomputed when the batch size
    changes, else as often as re-scoring stays within ``rescore_budget`` (0.25%) of step time;
    the updates from recorded steps are batched into those re-scorings, so the policy's own
    time, choosing and learning, stays ~1-2% of a step even on a CPU.

    Args:
        candidates: strategies to choose from; ``None`` (no speculation) is always added.
        hysteresis: relative margin a new strategy must win by (0.05 = 5%).
        probe_every: steps with speculation off between probes (0: never probe).
        probe_seqs: sequences drafted for in a probe step.
        per_sequence: let ``select`` skip sequences whose own acceptance does not pay.
    """

    name = "auto"

    def __init__(self, candidates: list[Strategy | None], hysteresis: float = 0.05,
                 probe_every: int = 50, probe_seqs: int = 4,
                 latency: LatencyModel | None = None,
                 acceptance: AcceptanceModel | None = None, per_sequence: bool = True):
        super().__init__()
        self.candidates = (None, *(s for s in dict.fromkeys(candidates) if s is not None))
        max_depth = max((s.depth for s in self.candidates if s is not None), default=1)
        self.latency = latency or LatencyModel()
        self.acceptance = acceptance or AcceptanceModel(max_depth)
        self.hysteresis, self.probe_every, self.probe_seqs = hysteresis, probe_every, probe_seqs
        self.probe_margin = 0.25  # speculation predicted less than this much better: probe off
        self._probing = False  # this step is a probe
        self._probes = 0
        self._steps_held, self._next_probe = 0, 4  # steps since speculation went on/off; next probe
        self.current: Strategy | None = None
        self.context_per_seq = 0.0  # context tokens per decode sequence, last step
        self.last_scores: dict[Strategy | None, float] = {}
        self.per_sequence, self.prior_steps = per_sequence, 4.0
        self.accept_ratio = 0.0  # accepted per drafted node, all sequences (moving average)
        self._offered: int | None = None  # sequences ``select`` kept this step
        self._select_calls = 0
        self._refine_calls = 0
        self.verify_whole_every = 8  # refine leaves one tree in this many whole (exploration)
        self._depths = np.array([s.depth if s else 0 for s in self.candidates], dtype=float)
        self._is_tree = np.array([s is not None and not s.is_chain for s in self.candidates])
        # per batch bucket, per candidate: observed / modelled committed tokens per second
        # (moving average over the steps it ran; 1 before any), what the models miss
        self._correction: dict[int, np.ndarray] = {}
        self._raw: dict[Strategy | None, float] = {}  # model scores before the correction
        self._index = {s: i for i, s in enumerate(self.candidates)}
        self.min_chain_trials = 8.0  # sequences drafted for by a chain before trees compete
        self.calibrator = Calibrator()
        self.nodes_cut = 0  # draft nodes refine() removed
        # Scores of an unchanged batch size are reused for as many steps as keep re-scoring
        # within ``rescore_budget`` of step time (the models move little per step), but at
        # most 1 + (decode steps so far) / 2 steps while the models are young.
        self.rescore_budget = 0.0025
        self.rescore_every = 1
        self._rescore_cost = 0.0  # seconds per re-scoring (moving average)
        self._mean_step = 0.0  # seconds per decode step (moving average)
        self._decode_steps = 0
        self._scored_for: tuple[int, int] = (-1, 0)  # (batch, steps since scored)
        self._pending: list[tuple] = []  # recorded steps not learnt from yet (``flush``)
        self.nodes_seen = 0

    def select(self, seqs: list, strategy: Strategy) -> list[bool]:
        """Per-sequence choice (the engine drafts only for sequences marked True): a sequence
        is drafted for when its expected accepted tokens pay for its draft nodes at the
        step's predicted rate, i.e. ``E[accepted_i] >= rate * dT/d(its nodes)``.
        ``E[accepted_i]`` is the batch estimate scaled by the request's own accepted-per-drafted
        ratio against the global one (``prior_steps`` pseudo-steps of the global ratio)."""
        t0 = time.perf_counter()
        keep = [True] * len(seqs)
        rate = self._predicted
        if self._probing:  # a probe drafts for a few sequences, a different few each time
            n, k = len(seqs), min(self.probe_seqs, len(seqs))
            first = self._probes * k % n
            keep = [(i - first) % n < k for i in range(n)]
        elif self.per_sequence and len(seqs) > 1 and rate and self.accept_ratio > 0:
            acc = self.acceptance
            nodes, built = acc.expected_nodes(strategy), acc.expected_proposed(strategy)
            n = len(seqs)
            ctx = self.context_per_seq * n
            lat = self.latency
            base = n * (1 + nodes)
            marginal = (lat.forward_time(base, ctx, n) - lat.forward_time(base - nodes, ctx, n)
                        + lat.draft_time(n, strategy.depth, n * built)
                        - lat.draft_time(n - 1, strategy.depth, (n - 1) * built))
            need = rate * marginal  # tokens one sequence's nodes must win back
            if need > 0:
                e_acc, r, c = acc.expected_accepted(strategy), self.accept_ratio, self.prior_steps
                self._select_calls += 1
                for i, s in enumerate(seqs):
                    own = (s.num_accepted + c * r) / (s.num_drafted + c)
                    # a skipped sequence is still drafted for one step in 16, to notice change
                    keep[i] = e_acc * own / r >= need or (self._select_calls + i) % 16 == 0
        self._offered = sum(keep)
        self.decision_time += time.perf_counter() - t0
        return keep

    def refine(self, seqs: list, trees: list, base_tokens: int) -> list:
        """Per scored tree, keep the nodes whose acceptance probability ``p`` pays for its
        verify token: ``p >= rate * dT/dn``, with ``rate`` the step's predicted committed tokens
        per second and ``dT/dn`` the latency model's marginal seconds per forward token at this
        step's size (``base_tokens``: the forward's tokens besides draft nodes). Memory-bound,
        the bar is near 0 and trees stay whole; compute-bound, only confident nodes stay.

        One tree in ``verify_whole_every`` (rotating over the sequences; 0: none) is left
        whole: the calibrator learns only from verified nodes, and nodes below the bar would
        otherwise never be verified, so a too pessimistic rate for their confidence bins (the
        prior, or counts from another workload) would never be corrected."""
        rate = self._predicted
        scored = [i for i, t in enumerate(trees) if t is not None and is_scored(t)]
        if not scored or not rate:
            return trees
        t0 = time.perf_counter()
        self._refine_calls += 1
        if every := self.verify_whole_every:
            whole = [i for i in scored if (self._refine_calls + i) % every == 0]
            self.nodes_seen += sum(trees[i].num_nodes for i in whole)
            scored = [i for i in scored if (self._refine_calls + i) % every]
        n = len(seqs)
        tokens = base_tokens + sum(t.num_nodes for t in trees if t is not None)
        ctx = self.context_per_seq * n
        lat = self.latency
        bar = rate * max(lat.forward_time(tokens + 1, ctx, n) - lat.forward_time(tokens, ctx, n),
                         0.0)
        cal = self.calibrator
        rates = cal.rate_per_bin().tolist()
        out = list(trees)
        for i in scored:
            tree, factor = trees[i], cal.request_factor(seqs[i])
            p = [min(rates[bin_of(c)] * factor, 1.0) for c in confidence_list(tree)]
            out[i] = tree.subset(keep_worth(tree, p, bar))
            self.nodes_seen += tree.num_nodes
            self.nodes_cut += tree.num_nodes - (out[i].num_nodes if out[i] else 0)
        self.decision_time += time.perf_counter() - t0
        return out

    def warm_start(self, engine) -> None:
        """Profile the engine's runner (and drafter) for about a second."""
        profile_forward(engine.runner, engine.blocks, self.latency, drafter=engine.drafter)

    def score(self, s: Strategy | None, batch: int, context: float) -> float:
        """Modelled committed tokens per second of one step of candidate ``s`` (tokens/s;
        before the observed/modelled correction ``scores`` applies)."""
        return float(self.model_rates(batch, context)[self._index[s]])

    def model_rates(self, batch: int, context: float) -> np.ndarray:
        """Modelled committed tokens per second (``[len(candidates)]``, in ``candidates``
        order): batch x expected committed tokens over the modelled step time of each."""
        per_seq_committed, per_seq_nodes, per_seq_built = self.acceptance.expected(self.candidates)
        committed, nodes = batch * per_seq_committed, batch * per_seq_nodes
        seconds = self.latency.step_times(batch, context, self._depths, nodes, committed,
                                          batch * per_seq_built)
        return committed / np.maximum(seconds, 1e-9)

    def scores(self, batch: int, context: float,
               rates: np.ndarray | None = None) -> dict[Strategy | None, float]:
        """What the choice compares (tokens/s): the modelled ``rates`` (default
        ``model_rates``) times the bucket's observed/modelled correction; trees 0 until the
        chain has been measured."""
        rate = self.model_rates(batch, context) if rates is None else rates
        rate = rate * self._correction.get(batch_bucket(batch), 1.0)
        if self.acceptance.chain.trials[0] < self.min_chain_trials:
            rate[self._is_tree] = 0.0  # a tree's prior is the chain's rates: measure those first
        return dict(zip(self.candidates, rate.tolist()))

    def choose(self, num_running: int) -> Strategy | None:
        t0 = time.perf_counter()
        batch = max(num_running, 1)
        context = self.context_per_seq * batch
        last_batch, age = self._scored_for
        if last_batch == batch and age < self.rescore_every and self.last_scores:
            scores = self.last_scores  # re-scored when the batch changes, else every few steps
            self._scored_for = (batch, age + 1)
        else:
            self.flush()
            rates = self.model_rates(batch, context)
            self._raw = dict(zip(self.candidates, rates.tolist()))
            scores = self.scores(batch, context, rates)
            self._scored_for = (batch, 1)
            cost = time.perf_counter() - t0
            self._rescore_cost = cost if not self._rescore_cost else \
                0.9 * self._rescore_cost + 0.1 * cost
            if self._mean_step:  # young models change fast: re-scored more often at first
                self.rescore_every = min(32, 1 + self._decode_steps // 2, max(1, math.ceil(
                    self._rescore_cost / (self.rescore_budget * self._mean_step))))
        best = max(scores, key=scores.get)
        current = self.current if self.current in scores else None
        if scores[best] > scores[current] * (1 + self.hysteresis):
            current = best
        if (current is None) != (self.current is None):  # on <-> off restarts the probes
            self._steps_held, self._next_probe = 0, 4
        self.current = current
        choice = current
        self._probing = False
        self._steps_held += 1
        if self.probe_every and self._steps_held >= self._next_probe:
            self._next_probe = min(2 * self._next_probe, self._steps_held + self.probe_every)
            if current is None:
                # the best chain: cheap, and it refreshes the rates every prior builds on
                spec = [s for s in self.candidates if s is not None and s.is_chain]
                if spec:
                    choice = max(spec, key=scores.get)
                    self._probing = True
                    self._probes += 1
            elif scores[current] < (1 + self.probe_margin) * scores[None]:
                choice, self._probing = None, True  # a close call: measure the baseline too
        self._predicted = scores[choice]
        self.last_scores = scores
        self.decision_time += time.perf_counter() - t0
        return choice

    def record(self, rec: StepRecord) -> None:
        """Tally the step; what it teaches the models is learnt at the next re-scoring
        (``flush``): a few steps' updates run back to back cost much less than each one alone
        right after a forward has evicted the CPU caches."""
        t0 = time.perf_counter()
        self._tally(rec, f"probe {strategy_name(rec.strategy)}" if self._probing else None)
        if rec.num_decode:
            self.context_per_seq = rec.context_tokens / rec.num_decode
        self._pending.append((rec, self._probing, self._offered, self._raw.get(rec.strategy)))
        self._offered = None
        if rec.is_decode_only:  # the steps the re-scoring is spread over
            self._decode_steps += 1
            self._mean_step = rec.step_time if not self._mean_step else \
                0.9 * self._mean_step + 0.1 * rec.step_time
        if len(self._pending) >= self.rescore_every:
            self.flush()
        self.decision_time += time.perf_counter() - t0

    def flush(self) -> None:
        """Learn from the recorded steps not learnt from yet (``record`` defers it)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        self._calibrate([rec for rec, *_ in pending])
        for rec, probing, offered, raw in pending:
            self._learn(rec, probing, offered, raw)
        lat = self.latency
        fwd = [r for r, *_ in pending if r.is_decode_only]
        lat.add_forwards([r.num_forward_tokens for r in fwd], [r.context_tokens for r in fwd],
                         [r.num_decode for r in fwd], [r.forward_time for r in fwd])
        spec = [r for r in fwd if r.strategy is not None]
        lat.add_drafts([r.num_decode for r in spec], [r.strategy.depth for r in spec],
                       [r.num_drafted if r.num_proposed is None else r.num_proposed
                        for r in spec], [r.draft_time for r in spec])
        lat.add_others([r.num_decode for r in fwd], [r.num_drafted for r in fwd],
                       [r.num_committed for r in fwd], [r.other_time for r in fwd])

    def _calibrate(self, recs: list[StepRecord]) -> None:
        """The calibrator's update from the scored trees verified in ``recs`` (one update per
        step), and each request's predicted/accepted node counts (with the map as it was
        before them: one lookup for all)."""
        cal = self.calibrator
        rates = None
        for rec in recs:
            node_bins, hits = [], []
            for seq, tree, accepted in rec.verified:
                if not is_scored(tree):
                    continue
                if rates is None:
                    rates = cal.rate_per_bin().tolist()
                b = [bin_of(c) for c in confidence_list(tree)]
                seq.calib_predicted += sum(rates[j] for j in b)
                seq.calib_accepted += len(accepted)
                acc = set(accepted)
                hits += [j in acc for j in range(len(b))]
                node_bins += b
            if node_bins:
                cal.observe_bins(node_bins, hits)

    def _learn(self, rec: StepRecord, probing: bool, offered: int | None,
               raw: float | None) -> None:
        """One step's updates of the acceptance and correction models (``flush`` updates the
        latency model for all steps at once); ``probing``, ``offered`` (sequences ``select``
        kept) and ``raw`` (the strategy's model rate) as they were for that step."""
        if rec.strategy is not None:
            offered = rec.num_decode if offered is None else offered
            self.acceptance.observe(rec.strategy, rec.accepted_per_seq, offered,
                                    rec.num_drafted, rec.num_proposed)
            if rec.num_drafted:
                ratio = sum(rec.accepted_per_seq) / rec.num_drafted
                self.accept_ratio = ratio if self.accept_ratio == 0 else \
                    0.9 * self.accept_ratio + 0.1 * ratio
        elif rec.num_decode and not self.probe_every:
            self.acceptance.age()
        if not rec.is_decode_only:
            return
        if raw and not probing and rec.step_time > 0:
            corr = self._correction.setdefault(batch_bucket(rec.num_decode),
                                               np.ones(len(self.candidates)))
            corr += (1.0 - corr) * 0.01  # unrefreshed corrections fade (the workload changes)
            i = self._index[rec.strategy]
            ratio = min(max(rec.num_committed / rec.step_time / raw, 0.25), 4.0)
            corr[i] = 0.9 * corr[i] + 0.1 * ratio

    def stats(self) -> dict:
        self.flush()
        d = super().stats()
        d["policy_latency_knee_tokens"] = self.latency.knee
        d["policy_nodes_cut_frac"] = self.nodes_cut / self.nodes_seen if self.nodes_seen else 0.0
        d["policy_calibration"] = [round(x, 3) for x in self.calibrator.rate_per_bin().tolist()]
        d["policy_expected_committed"] = {
            strategy_name(s): round(self.acceptance.expected_committed(s), 3)
            for s in self.candidates}
        return d


def candidate_strategies(cfg) -> list[Strategy]:
    """Candidates of a ``SpeculativeConfig``: chains of depth 1..``num_speculative_tokens`` and
    the trees of ``candidate_trees`` (default: the configured tree if ``topk > 1``, plus
    ``(D, 2, 2D)`` and ``(D, 4, 4D)`` for D = ``num_speculative_tokens``)."""
    depth = cfg.strategy.depth
    chains = [Strategy(d) for d in range(1, depth + 1)]
    trees = cfg.candidate_trees
    if trees is None:
        trees = [(depth, 2, 2 * depth), (depth, 4, 4 * depth)]
        if not cfg.strategy.is_chain:
            trees = [cfg.strategy, *trees]
    out = chains + [t if isinstance(t, Strategy) else Strategy(*t) for t in trees]
    return list(dict.fromkeys(out))


def make_policy(cfg, seed: int = 0) -> Policy:
    """The policy named by ``cfg.policy`` (a ``SpeculativeConfig``)."""
    if cfg.policy == "static":
        return StaticPolicy(cfg.strategy)
    if cfg.policy == "bandit":
        return BanditPolicy(candidate_strategies(cfg), seed=seed)
    if cfg.policy == "auto":
        return AutoPolicy(candidate_strategies(cfg))
    raise ValueError(f"speculative_config policy={cfg.policy!r}: use one of {POLICIES}")
