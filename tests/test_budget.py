"""Draft budget per sequence aimed at the rollout's finish: the expected-remaining-output
estimator (conditional expectation, prior, memory bound), the weights and the greedy
allocation over all trees (equal weights = the unweighted cut; a tight budget goes to the
longer sequences; a sequence can get nothing), the engine feeding finished lengths across
``generate`` calls, and outputs unchanged by the allocation. Timings are fixed functions."""

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from specengine import LLM, SamplingParams
from specengine.speculative.policy import AutoPolicy
from specengine.speculative.policy.acceptance import AcceptanceModel
from specengine.speculative.policy.budget import BudgetSpread, allocate, path_min
from specengine.speculative.policy.calibration import keep_worth
from specengine.speculative.policy.latency import LatencyModel
from specengine.speculative.policy.remaining import RemainingLength, length_weights
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree

_ids = itertools.count()


def fake_seq(prompt, out=0, max_tokens=1000, reason=None):
    """What the estimator and the cut read from a ``Sequence``."""
    return SimpleNamespace(seq_id=next(_ids), prompt_token_ids=list(prompt),
                           num_output_tokens=out, params=SimpleNamespace(max_tokens=max_tokens),
                           finish_reason=reason, calib_accepted=0, calib_predicted=0.0,
                           num_accepted=0, num_drafted=0)


def finish(est, prompt, lengths, reason="stop"):
    for n in lengths:
        est.finished(fake_seq(prompt, n, reason=reason))


# ---- the estimator ------------------------------------------------------------------------------
def test_remaining_is_the_conditional_mean_with_a_prior_from_all_groups():
    est = RemainingLength(prior_count=1.0)
    a, b = [1, 2, 3], [7, 8]
    assert est.expected(fake_seq(a, 0)) is None  # nothing finished yet: no estimate
    finish(est, a, [10, 20, 30, 40])
    finish(est, b, [100, 200])
    # prior at c = 15, over all six: L > 15 are 20, 30, 40, 100, 200 -> mean(L - 15) = 63
    # group a at c = 15: (5 + 15 + 25) + 1 * 63 over 3 + 1
    assert est.expected(fake_seq(a, 15)) == pytest.approx((45 + 63) / 4)
    assert est.expected(fake_seq(b, 15)) == pytest.approx((85 + 185 + 63) / 3)
    assert est.expected(fake_seq([9], 15)) == pytest.approx(63)  # unknown group: the prior
    # a sequences past all its group's lengths: the prior above c (L = 100, 200 at c = 50)
    assert est.expected(fake_seq(a, 50)) == pytest.approx((50 + 150) / 2)
    # past every length seen: as long again (c), clipped to what max_tokens leaves
    assert est.expected(fake_seq(a, 300)) == pytest.approx(300)
    assert est.expected(fake_seq(a, 300, max_tokens=320)) == pytest.approx(20)
    assert est.estimate(est.group_key(a), 15, room=10) == 10
    # the n samples of a request and a new request with the same prompt share the group
    assert est.group_key(list(a)) == est.group_key(tuple(a)) != est.group_key(b)


def test_remaining_counts_only_real_finishes():
    est = RemainingLength()
    finish(est, [1], [5], reason="abort")
    finish(est, [1], [5], reason=None)  # dropped by abort_all
    assert est.observed == 0 and est.expected(fake_seq([1], 0)) is None
    finish(est, [1], [12], reason="length")
    assert est.observed == 1 and est.expected(fake_seq([1], 2)) == pytest.approx(10)


def test_remaining_memory_is_bounded_and_evicts_the_least_recently_used_group():
    est = RemainingLength(max_groups=50, per_group=4, prior_lengths=30, max_running=20)
    keep = [999, 999]
    finish(est, keep, [500])
    rng = np.random.default_rng(0)
    for i in range(5000):  # a flood of distinct prompts
        finish(est, [i, 7], rng.integers(1, 100, size=2).tolist())
        if i % 10 == 0:  # the kept group is used: it stays
            est.expected(fake_seq(keep, 0))
    s = est.stats()
    assert s["groups"] == 50 and s["lengths"] <= 50 * 4 + 30 and s["observed"] == 10001
    assert est.group_key(keep) in est.groups
    assert est.group_key([0, 7]) not in est.groups  # the oldest flood groups are gone
    for _ in range(10):  # per group, the last per_group lengths
        finish(est, keep, [5])
    assert list(est.groups[est.group_key(keep)].recent) == [5] * 4
    # 500 sequences asked about and never finished: only the last 20 keys are cached
    assert len(est._keys) == 20
    with pytest.raises(ValueError, match="max_groups"):
        RemainingLength(max_groups=0)
    with pytest.raises(ValueError, match="prior_count"):
        RemainingLength(prior_count=0)


def test_length_weights():
    assert length_weights([30.0, 30.0, 30.0]) == [1.0, 1.0, 1.0]
    assert length_weights([10.0, 30.0]) == pytest.approx([0.5, 1.5])
    assert length_weights([10.0, 30.0], alpha=2) == pytest.approx([0.25, 2.25])
    assert length_weights([1.0, 1000.0]) == pytest.approx([0.25, 1.998], rel=1e-3)  # clipped
    assert length_weights([1.0, 1000.0], alpha=0) == [1.0, 1.0]
    with pytest.raises(ValueError, match="alpha"):
        length_weights([1.0], alpha=-1)


# ---- the allocation -----------------------------------------------------------------------------
def chain(confidences):
    """A scored chain whose nodes have these cumulative confidences."""
    lps, prev = [], 1.0
    for c in confidences:
        lps.append(math.log(c / prev))
        prev = c
    n = len(confidences)
    return DraftTree(list(range(n)), list(range(-1, n - 1)), lps)


def random_tree(rng, k=2, depth=3):
    parents, lps, level = [], [], [-1]
    for _ in range(depth):
        nxt = []
        for par in level:
            for p in rng.dirichlet(np.ones(k + 1))[:k]:
                parents.append(par)
                lps.append(float(np.log(p)))
                nxt.append(len(parents) - 1)
        level = nxt
    return DraftTree(list(range(len(parents))), parents, lps)


def test_allocate_with_equal_weights_is_the_unweighted_cut():
    rng = np.random.default_rng(0)
    for _ in range(50):
        trees = [random_tree(rng) for _ in range(5)]
        probs = [rng.uniform(0, 1, t.num_nodes).tolist() for t in trees]
        bar = float(rng.uniform(0.05, 0.6))
        bars, budget = allocate(probs, [t.parents for t in trees], [1.0] * 5, bar)
        assert bars == [bar] * 5
        assert budget == sum(len(keep_worth(t, p, bar)) for t, p in zip(trees, probs))


def test_allocate_gives_a_tight_budget_to_the_longer_sequence():
    p = [0.9, 0.8, 0.7, 0.6, 0.55, 0.5]  # a chain, acceptance per node (non-increasing)
    parents = [-1, 0, 1, 2, 3, 4]
    tree = SimpleNamespace(parents=parents)
    bar = 0.75  # two nodes per chain pay: the budget is 4
    bars, budget = allocate([p, p], [parents, parents], [1.5, 0.5], bar)
    kept = [len(keep_worth(tree, p, b)) for b in bars]
    # values 1.35 1.2 1.05 .9 .825 .75 vs .45 ...: six pay, the budget takes the best four
    assert budget == 4 and kept == [4, 0]
    bars, _ = allocate([p, p], [parents, parents], [1.1, 0.9], bar)
    kept = [len(keep_worth(tree, p, b)) for b in bars]
    assert kept == [3, 1]  # .99 .88 .77 | .81: the rest are below the bar
    # a loose budget (memory-bound: bar ~ 0): every node stays, whatever the weights
    bars, budget = allocate([p, p], [parents, parents], [1.6, 0.4], 1e-6)
    assert budget == 12 and bars[1] <= min(p)
    assert path_min([0.5, 0.7, 0.2, 0.3], [-1, 0, 1, 2]) == [0.5, 0.5, 0.2, 0.2]
    with pytest.raises(ValueError, match="weight"):
        allocate([p], [parents], [0.0], bar)


def compute_bound_policy(rate=100.0, **kw):
    """An AutoPolicy on fixed timings: forwards of 10 ms + 2 ms per token (compute-bound), a
    step predicted at ``rate`` tokens/s: a verify token must win back 0.2 tokens."""
    pol = AutoPolicy([Strategy(4)], probe_every=0, **kw)
    pol.latency.forward_time = lambda tokens, context, num_seqs: 0.01 + 2e-3 * tokens
    pol.cutter.verify_whole_every = 0
    pol.context_per_seq = 100
    pol._predicted = rate
    return pol


def kept_nodes(out):
    return [t.num_nodes if t is not None else 0 for t in out]


def test_refine_gives_the_tight_budget_to_the_sequence_with_longer_expected_output():
    # confidences at the calibration bins' centres (the prior map is the identity there):
    # with the bar at 0.2, three nodes of each chain pay
    confs = [10 ** (-4 + (b + 0.5) / 4) for b in (15, 14, 13, 12, 11, 10)]
    long_prompt, short_prompt = [5, 6, 7], [8, 9]
    results = {}
    for alpha in (0.0, 1.0):
        pol = compute_bound_policy(length_weight=alpha)
        finish(pol.remaining, long_prompt, [400, 420])  # history of the same prompts
        finish(pol.remaining, short_prompt, [12, 14])
        seqs = [fake_seq(long_prompt, 10), fake_seq(short_prompt, 10)]
        assert all(pol.select(seqs, Strategy(4)))
        trees = [chain(confs), chain(confs)]
        results[alpha] = kept_nodes(pol.refine(seqs, trees, base_tokens=2))
        budget = pol.stats()["policy_budget"]
        assert budget["seq_steps"] == 0  # counted when the step is recorded
    assert results[0.0] == [3, 3]  # unweighted: the old cut
    # weights 1.66 and 0.34 (expected remaining 334 and 69 tokens): the long one keeps a node
    # below the bar, the short one loses two; never more than the six nodes that pay
    assert results[1.0] == [4, 1]


def test_refine_with_equal_expected_lengths_matches_the_unweighted_cut():
    rng = np.random.default_rng(4)
    prompt = [1, 2, 3]
    for rate in (20.0, 100.0, 400.0):
        pol = compute_bound_policy(rate)
        finish(pol.remaining, prompt, [50, 80, 120])
        seqs = [fake_seq(prompt, 20) for _ in range(6)]  # one group, same progress
        trees = [random_tree(rng) for _ in seqs]
        pol.select(seqs, Strategy(4))
        out = pol.refine(seqs, trees, base_tokens=6)
        old = compute_bound_policy(rate)  # no lengths known: weights 1
        tokens = 6 + sum(t.num_nodes for t in trees)
        bar = rate * 2e-3
        want = old.cutter.cut(seqs, trees, old.cutter.scored(trees), bar)
        assert tokens > 0 and kept_nodes(out) == kept_nodes(want)
        assert [None if t is None else t.tokens for t in out] == \
            [None if t is None else t.tokens for t in want]


def test_off_stays_a_candidate_and_select_weighs_expected_length():
    lat = LatencyModel()  # fitted on exact compute-bound forwards: 1 ms per token
    for batch, per_seq, ctx in itertools.product((1, 4, 16, 64), (1, 3, 5), (100, 1000)):
        tokens = batch * per_seq
        lat.add_forward(tokens, batch * ctx, batch, 1e-3 * tokens)
        lat.add_draft(batch, per_seq, tokens - batch, 1e-5)
        lat.add_other(batch, tokens - batch, batch, 1e-4)
    pol = AutoPolicy([Strategy(2), Strategy(4)], probe_every=0, latency=lat)
    finish(pol.remaining, [1], [500])
    assert pol.choose(64) is None  # off for the whole batch, lengths or not
    # per sequence: the same acceptance, drafted for the long ones only
    am = AcceptanceModel(4)
    for _ in range(50):
        am.observe(Strategy(4), [1] * 8, 8, 32)
    pol = AutoPolicy([Strategy(4)], probe_every=0, acceptance=am)
    pol.latency.forward_time = lambda tokens, context, num_seqs: 0.01 + 1e-3 * tokens
    pol._predicted, pol.accept_ratio, pol.context_per_seq = 300.0, 0.25, 100
    seqs = [fake_seq([1], 5) for _ in range(4)] + [fake_seq([2], 5) for _ in range(4)]
    for s in seqs:
        s.num_accepted, s.num_drafted = 25, 100  # own ratio = the global one
    # need = 300 x 4 nodes x 1 ms = 1.2 > E[accepted] ~ 1: nobody pays unweighted
    assert pol.select(seqs, Strategy(4)) == [False] * 8
    finish(pol.remaining, [1], [800, 800])
    finish(pol.remaining, [2], [8, 8])
    assert pol.select(seqs, Strategy(4)) == [True] * 4 + [False] * 4


def test_budget_spread_tally():
    b = BudgetSpread()
    b.observe([0, 1, 5, 40], [1.0, 2.0, 3.0, 4.0], weighted=True)
    b.observe([2, 2], None)
    s = b.stats()
    assert s["seq_steps"] == 6 and s["nodes_per_seq_mean"] == pytest.approx(50 / 6)
    assert s["nodes_per_seq_max"] == 40 and s["drafted_frac"] == pytest.approx(5 / 6)
    assert s["nodes_hist"] == {"0": 1, "1": 1, "2-3": 2, "4-7": 1, "8-15": 0, "16-31": 0,
                               "32+": 1}
    assert s["weighted_steps"] == 1
    assert s["corr_nodes_remaining"] == pytest.approx(
        np.corrcoef([1, 2, 3, 4], [0, 1, 5, 40])[0, 1], abs=1e-4)
    assert s["nodes_longer_half"] == 22.5 and s["nodes_shorter_half"] == 0.5


# ---- the engine ---------------------------------------------------------------------------------
class ForcedAuto(AutoPolicy):
    """AutoPolicy that always speculates with ``strategy`` at a fixed predicted rate, on fixed
    compute-bound timings (free drafting): select and refine decide the same on any machine,
    refine cuts, and the allocation is exercised every step."""

    def __init__(self, strategy, rate, **kw):
        super().__init__([strategy], probe_every=0, **kw)
        self.strategy, self.rate = strategy, rate
        self.latency.forward_time = lambda tokens, context, num_seqs: 0.01 + 1e-3 * tokens
        self.latency.draft_time = lambda batch, depth, nodes: 0.0
        self.cutter.verify_whole_every = 0

    def choose(self, num_running):
        self._predicted = self.rate
        return self.strategy


def make(target_dir, spec=None):
    return LLM(str(target_dir), dtype="float32", block_size=8, speculative_config=spec,
               kv_cache_memory_bytes=8 << 20)


def rollout(llm, prompts, temperature=0.0):
    """Two generate calls over the same prompts: short then long outputs for prompt 0 and
    long for the others (seeded when sampled). Returns the second call's token ids."""
    first = [SamplingParams(n=2, temperature=temperature, seed=i, max_tokens=3 if i == 0 else 30,
                            ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, first, use_tqdm=False)
    sp = [SamplingParams(n=2, temperature=temperature, seed=10 + i, max_tokens=30,
                         ignore_eos=True) for i in range(len(prompts))]
    return [tuple(o.token_ids) for r in llm.generate(prompts, sp, use_tqdm=False)
            for o in r.outputs]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allocation_leaves_outputs_unchanged_and_learns_lengths(target_dir, temperature):
    """Greedy, and seeded T = 1: the same tokens as plain decoding with the allocation on and
    off; the finished lengths of both calls are remembered per prompt group."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, int(rng.integers(4, 20))).tolist() for _ in range(3)]
    want = rollout(make(target_dir), prompts, temperature)
    if temperature:
        assert len(set(want)) == len(want)  # really sampled
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 3,
            "policy": "static"}
    for alpha in (1.0, 0.0):
        llm = make(target_dir, spec)
        pol = llm.engine.policy = ForcedAuto(Strategy(3, 2, 6), rate=150.0,
                                             length_weight=alpha)
        assert rollout(llm, prompts, temperature) == want
        m = llm.get_metrics()
        assert m["kv_blocks_free"] == m["kv_blocks_total"] and m["spec_steps"] > 0
        # every finished sample was remembered, per prompt group, across the two calls
        assert m["policy_remaining"] == {"groups": 3, "lengths": 24, "observed": 12}
        est = pol.remaining
        short = est.estimate(est.group_key(prompts[0]), 0)
        assert short < est.estimate(est.group_key(prompts[1]), 0)
        b = m["policy_budget"]
        assert b["seq_steps"] > 0 and 0 < b["drafted_frac"] <= 1
        assert sum(b["nodes_hist"].values()) == b["seq_steps"]
        assert 0 < b["nodes_per_seq_mean"] <= b["nodes_per_seq_max"] <= 6
        if alpha:  # the second call's weights differ: prompt 0 is expected to end sooner
            # (which sequences got more is the unit tests' business: here acceptance
            # probabilities differ per sequence too)
            assert b["weighted_steps"] > 0 and -1 <= b["corr_nodes_remaining"] <= 1
            assert b["nodes_longer_half"] is not None
        else:
            assert b["weighted_steps"] == 0
