"""Adaptive speculation: latency and acceptance models, the cost-model and bandit policies on
synthetic curves, and outputs unchanged by whatever the policy chooses."""

from types import SimpleNamespace

import numpy as np
import pytest
from fixed_timings import FakeClock, TimedDrafter, TimedRunner, forward_seconds

from specengine import LLM, SamplingParams
from specengine.engine import engine as engine_module
from specengine.models.loader import save_random_model
from specengine.speculative.config import SpeculativeConfig
from specengine.speculative.drafters.ngram import NgramDrafter
from specengine.speculative.policy import (
    AutoPolicy,
    BanditPolicy,
    Policy,
    StepRecord,
    batch_bucket,
    candidate_strategies,
    make_policy,
    profiling,
)
from specengine.speculative.policy.acceptance import AcceptanceModel
from specengine.speculative.policy.latency import LatencyModel
from specengine.speculative.strategy import Strategy

CHAINS = [Strategy(d) for d in range(1, 9)]
TREES = [Strategy(8, 2, 16), Strategy(8, 4, 32)]


def unguarded(*args, **kw) -> AutoPolicy:
    """An ``AutoPolicy`` without its loss guard: the tests of its criterion and probes see
    every choice its models make (the guard has its own tests)."""
    return AutoPolicy(*args, max_loss=None, **kw)


def fit_latency(forward, rng, steps=600, noise=0.03, lm=None) -> LatencyModel:
    """A LatencyModel (new, or ``lm``) fed ``steps`` noisy forwards of
    ``forward(tokens, context)`` seconds, a free drafter and a small fixed overhead."""
    lm = lm or LatencyModel()
    for _ in range(steps):
        batch = int(2 ** rng.uniform(0, 8))
        per_seq = 1 + int(rng.integers(0, 33))
        tokens, ctx = batch * per_seq, batch * int(rng.integers(16, 512))
        lm.add_forward(tokens, ctx, batch, forward(tokens, ctx) * rng.lognormal(0, noise))
        lm.add_draft(batch, per_seq - 1 or 1, tokens - batch, 1e-5 * rng.lognormal(0, noise))
        lm.add_other(batch, tokens - batch, batch, 1e-4 * rng.lognormal(0, noise))
    return lm


def fit_acceptance(chain_rate, tree_rate, rng, steps=100) -> AcceptanceModel:
    """An AcceptanceModel fed geometric acceptance: rate ``chain_rate`` per depth for chains,
    ``tree_rate`` for the trees."""
    am = AcceptanceModel(max_depth=8)
    for _ in range(steps):
        for s, rate in [(Strategy(8), chain_rate)] + [(t, tree_rate) for t in TREES]:
            acc = [int(min(rng.geometric(1 - rate) - 1, s.depth)) for _ in range(16)]
            am.observe(s, acc, 16, 16 * s.num_nodes)
    return am


def test_latency_model_converges_on_noisy_piecewise_linear_data():
    def truth(n, ctx):  # flat while memory-bound, a slope after 128 tokens, plus attention
        return 0.005 + 2e-6 * n + 1e-4 * max(0, n - 128) + 5e-8 * ctx

    rng = np.random.default_rng(0)
    lm = fit_latency(truth, rng, steps=1500, noise=0.05)
    assert lm.knee in (64, 128, 256)
    for n, ctx in [(1, 100), (16, 4000), (128, 20000), (512, 60000), (2048, 100000)]:
        assert lm.forward_time(n, ctx, max(1, n // 4)) == pytest.approx(truth(n, ctx), rel=0.06)
    # the machine gets twice as slow: the fit follows (memory ~ 1 / (1 - decay) = 500 steps)
    fit_latency(lambda n, c: 2 * truth(n, c), rng, steps=1500, noise=0.05, lm=lm)
    for n, ctx in [(1, 100), (128, 20000), (2048, 100000)]:
        got = lm.forward_time(n, ctx, max(1, n // 4))
        assert got == pytest.approx(2 * truth(n, ctx), rel=0.1)


def test_latency_model_prices_a_verify_step_apart_from_its_nodes():
    """Verifying any tree costs a fixed 4.5 ms besides 0.03 ms a node (what a qwen2.5-0.5B step
    at 16 sequences measured: probes of 4 nodes and chains of 16 both ~4.5 ms over a plain
    step): learnt from plain steps and steps of 2 and 4 nodes (the probes), the model prices a
    16-node chain at its real cost. Fitted per node alone (no fixed term: the old model) it
    cannot fit the probes themselves; in a qwen rollout it priced a node at 2-2.5 ms."""
    def truth(nodes):
        return 3.6e-3 + (4.5e-3 + 3e-5 * nodes if nodes else 0.0)

    rng = np.random.default_rng(0)
    lm = LatencyModel()
    for i in range(300):
        nodes = [0] * 9 + [2, 4]
        n = int(nodes[i % len(nodes)])
        lm.add_other(16, n, 16 + int(rng.integers(0, n + 1)), truth(n) * rng.lognormal(0, 0.03))
    for n, rel in ((0, 0.05), (4, 0.05), (16, 0.15)):
        assert lm.other_time(16, n, 16 + n // 2) == pytest.approx(truth(n), rel=rel), n
    x = np.array([[16, 0, 16], [16, 16, 26]], dtype=float)
    steps = lm.step_times(16, 4000, np.array([0.0, 1.0]), x[:, 1], x[:, 2])
    forward = lm.forward_time(16, 4000, 16), lm.forward_time(32, 4000, 16)
    assert steps - np.array(forward) == pytest.approx([truth(0), truth(16)], rel=0.15)


def test_latency_model_shrugs_off_a_stall():
    rng = np.random.default_rng(1)
    lm = fit_latency(lambda n, c: 0.01 + 1e-5 * n, rng, steps=200)
    before = lm.forward_time(64, 1000, 8)
    for _ in range(5):  # descheduled threads: 30x slower steps
        lm.add_forward(64, 1000, 8, 0.3)
    assert lm.forward_time(64, 1000, 8) < 1.5 * before


def test_acceptance_model_estimates_per_depth_rates_and_adapts():
    rng = np.random.default_rng(2)
    am = fit_acceptance(0.8, 0.9, rng, steps=100)
    want = sum(0.8 ** j for j in range(1, 5))
    assert am.expected_accepted(Strategy(4)) == pytest.approx(want, rel=0.1)
    assert am.expected_accepted(TREES[1]) > am.expected_accepted(Strategy(8))
    assert am.expected_committed(None) == 1.0
    # a sequence with no draft counts as a rejection at depth 1; the drafter got worse
    for _ in range(200):
        am.observe(Strategy(2), [0, 1], 8, 3)
    assert am.expected_accepted(Strategy(2)) < 0.2
    assert am.expected_nodes(Strategy(2)) == pytest.approx(3 / 8, rel=0.05)  # per sequence
    for _ in range(300):  # steps without speculation: back towards the prior (0.5 per depth)
        am.age()
    assert am.expected_accepted(Strategy(2)) == pytest.approx(0.5 + 0.25, rel=0.1)


def test_memory_bound_prefers_deep_trees_compute_bound_prefers_none():
    rng = np.random.default_rng(3)
    am = fit_acceptance(0.7, 0.85, rng)
    flat = unguarded(CHAINS + TREES, latency=fit_latency(lambda n, c: 0.01, rng),
                     acceptance=am)
    s = flat.choose(4)
    assert s is not None and s.depth == 8 and not s.is_chain
    linear = unguarded(CHAINS + TREES, acceptance=am,
                       latency=fit_latency(lambda n, c: 0.001 + 0.001 * n, rng))
    assert linear.choose(64) is None


def test_auto_policy_re_decides_as_the_batch_shrinks_in_one_scoring_each():
    rng = np.random.default_rng(4)
    am = fit_acceptance(0.7, 0.85, rng)
    lm = fit_latency(lambda n, c: 0.01 + 1e-4 * max(0, n - 256), rng)
    pol = unguarded(CHAINS + TREES, latency=lm, acceptance=am, probe_every=0)
    big, small = pol.choose(256), pol.choose(2)
    assert big is None and small is not None and small.depth >= 4
    # each new batch size is one vectorised scoring of all 11 candidates (its time per
    # decision: bench/bench_decisions.py)
    scorings, step_times = [], lm.step_times

    def counted(batch, context, depths, *rest):  # one call scores every candidate
        scorings.append(len(depths))
        return step_times(batch, context, depths, *rest)

    lm.step_times = counted
    for b in range(1, 200):
        pol.choose(b)
    assert scorings == [11] * 199


def test_auto_policy_hysteresis():
    a, b = Strategy(2), Strategy(4)
    pol = unguarded([a, b], hysteresis=0.05, probe_every=0)
    table = {None: 50.0, a: 100.0, b: 90.0}
    pol.scores = lambda batch, context, rates=None: dict(table)
    assert pol.choose(4) == a
    table[b] = 104.0  # 4% better: not enough to switch
    assert [pol.choose(4) for _ in range(3)] == [a] * 3
    table[b] = 106.0
    assert pol.choose(4) == b
    table[a] = 107.0  # and not straight back either
    assert pol.choose(4) == b


def test_auto_policy_probes_while_off():
    rng = np.random.default_rng(5)
    lm = fit_latency(lambda n, c: 0.001 * n, rng)
    pol = unguarded(CHAINS, latency=lm, acceptance=AcceptanceModel(8), probe_every=10)
    picks = [pol.choose(64) for _ in range(40)]
    # 4, 8, 16 steps after the last switch, then every 10
    assert [i + 1 for i, p in enumerate(picks) if p is not None] == [4, 8, 16, 26, 36]


def test_auto_policy_measures_the_baseline_on_a_close_call():
    """Speculating but predicted only a little better than no speculation, the policy runs a
    step without it now and then (so the off side is measured, not extrapolated); clearly
    better, it does not."""
    rng = np.random.default_rng(5)
    flat = fit_latency(lambda n, c: 0.01 + 1e-6 * n, rng)  # memory-bound: deep chains win big
    good = fit_acceptance(0.9, 0.9, rng)
    pol = unguarded(CHAINS, latency=flat, acceptance=good, probe_every=10)
    assert None not in [pol.choose(4) for _ in range(40)]
    steep = fit_latency(lambda n, c: 0.01 + 0.001 * n, rng)  # 4 more tokens: 30% longer
    close = fit_acceptance(0.45, 0.45, rng)
    pol = unguarded([Strategy(1)], latency=steep, acceptance=close, probe_every=10,
                    hysteresis=0.0)
    s = pol.score(Strategy(1), 4, 400) / pol.score(None, 4, 400)
    assert 1.0 < s < 1.25  # a close call
    picks = [pol.choose(4) for _ in range(40)]
    assert [i + 1 for i, p in enumerate(picks) if p is None] == [4, 8, 16, 26, 36]


def test_per_sequence_choice_skips_requests_whose_drafts_do_not_pay():
    rng = np.random.default_rng(7)
    pol = unguarded(CHAINS + TREES, latency=fit_latency(lambda n, c: 0.002 + 1e-4 * n, rng),
                    acceptance=fit_acceptance(0.7, 0.85, rng))
    s = pol.choose(8)
    assert s is not None
    pol.accept_ratio = 0.5
    good = [SimpleNamespace(num_accepted=90, num_drafted=100) for _ in range(4)]
    bad = [SimpleNamespace(num_accepted=0, num_drafted=100) for _ in range(4)]
    assert pol.select(good + bad, s) == [True] * 4 + [False] * 4
    new = [SimpleNamespace(num_accepted=0, num_drafted=0) for _ in range(8)]
    assert all(pol.select(new, s))  # no history: the batch estimate, which pays


def bandit_reward(batch: int, arm: Strategy | None) -> float:
    """Synthetic committed tokens/s: deep chains pay at small batches, none at large ones."""
    depth = arm.depth if arm else 0
    return 100.0 * (1 + 0.3 * depth) if batch < 8 else 100.0 * (1 - 0.1 * depth)


def test_bandit_explores_then_exploits_the_best_arm_per_bucket():
    arms = [Strategy(1), Strategy(2), Strategy(4)]
    pol = BanditPolicy(arms, epsilon=0.1, seed=0)
    rng = np.random.default_rng(6)
    for batch, best in [(4, Strategy(4)), (64, None)]:
        picks = []
        for _ in range(300):
            arm = pol.choose(batch)
            picks.append(arm)
            reward = bandit_reward(batch, arm) * rng.lognormal(0, 0.1)
            pol.record(StepRecord(arm, batch, 0, batch, 100 * batch, 0, batch, [], 0.0,
                                  batch / reward, 0.0))
        assert set(picks[:4]) == {None, *arms}  # every arm is tried first
        assert picks[-200:].count(best) >= 160
        assert pol.mean_reward(batch_bucket(batch), best) == max(
            pol.mean_reward(batch_bucket(batch), a) for a in [None, *arms])
    stats = pol.stats()["policy_strategies"]
    assert sum(v["steps"] for v in stats.values()) == 600


def test_config_policy_keys_and_candidates():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                       "policy": "bandit", "candidate_trees": [[2, 2, 4]]})
    assert candidate_strategies(cfg) == [Strategy(1), Strategy(2), Strategy(3), Strategy(2, 2, 4)]
    assert isinstance(make_policy(cfg), BanditPolicy)
    assert SpeculativeConfig(method="ngram").policy == "auto"
    with pytest.raises(ValueError, match="policy"):
        SpeculativeConfig.from_dict({"method": "ngram", "policy": "magic"})
    with pytest.raises(ValueError, match="candidate_trees"):
        SpeculativeConfig.from_dict({"method": "ngram", "candidate_trees": [[2, 0, 4]]})


# ---- the engine: outputs do not depend on the policy ------------------------------------------


class CyclePolicy(Policy):
    """A different strategy every step (deterministic), to stress switching."""

    name = "cycle"

    def __init__(self, strategies):
        super().__init__()
        self.strategies, self.i = strategies, 0

    def choose(self, num_running):
        self.i += 1
        return self.strategies[self.i % len(self.strategies)]


SWITCH = [None, Strategy(3), Strategy(1), Strategy(4, 2, 6), Strategy(2)]


def make(target_dir, spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(str(target_dir), dtype="float32", block_size=8, speculative_config=spec, **kw)


def prompts(n, seed=0):
    g = np.random.default_rng(seed)
    return [g.integers(0, 512, int(g.integers(4, 30))).tolist() for _ in range(n)]


def token_ids(llm, ps, sp):
    return [tuple(o.token_ids) for r in llm.generate(ps, sp, use_tqdm=False) for o in r.outputs]


@pytest.mark.parametrize("policy", ["auto", "bandit", "cycle"])
def test_greedy_output_unchanged_by_the_policy(target_dir, policy):
    ps = prompts(6)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = token_ids(make(target_dir), ps, sp)
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 4,
            "policy": "static" if policy == "cycle" else policy}
    llm = make(target_dir, spec)
    if policy == "cycle":
        llm.engine.policy = CyclePolicy(SWITCH)
    assert token_ids(llm, ps, sp) == want
    m = llm.get_metrics()
    assert m["policy"] == policy and m["kv_blocks_free"] == m["kv_blocks_total"]
    ran = m["policy_strategies"]
    assert sum(v["steps"] for v in ran.values()) > 0
    if policy != "auto":  # auto may rightly never speculate with a drafter as big as the target
        assert len(ran) >= 3 and m["spec_steps"] > 0
    # the policy's time as a share of step time (how small a share: bench_adaptive.py)
    pol = llm.engine.policy
    assert m["policy_decision_s"] == pol.decision_time >= 0
    assert m["policy_decision_frac"] == pytest.approx(pol.decision_time / pol.step_time)


@pytest.fixture
def fixed_profile(monkeypatch):
    """The start-up profile an ``LLM`` runs (``AutoPolicy.warm_start``) on fixed timings: a
    ``FakeClock`` that moves 1 us per read, forwards and drafting taking ``forward_seconds``
    and ``draft_seconds`` of it; so every point fits the budgets, on any machine."""
    clock = FakeClock(tick=1e-6)

    def profile(runner, blocks, model, drafter=None, **kw):
        kw["clock"] = clock
        return profiling.profile_forward(TimedRunner(runner, clock), blocks, model,
                                         drafter=drafter and TimedDrafter(drafter, clock), **kw)

    monkeypatch.setattr(engine_module, "profile_forward", profile)
    return clock


def test_start_up_profile_warms_the_latency_model_and_returns_the_kv(target_dir, fixed_profile):
    llm = make(target_dir, {"method": "draft_model", "model": str(target_dir),
                            "num_speculative_tokens": 3}, kv_cache_memory_bytes=32 << 20)
    lat = llm.engine.policy.latency
    # every point after the first forward (one-off allocations), all 9 draft points and
    # the catch-up before each but the first (one-off allocations)
    assert lat.num_forward == 13 and lat.num_draft == 9 + 8
    assert 0 < lat.forward_time(1, 32, 1) < lat.forward_time(4096, 4096 * 64, 64)
    assert lat.draft_time(4, 3, 12) > 0
    blocks, drafter = llm.engine.blocks, llm.engine.drafter.blocks
    assert blocks.num_free == blocks.num_blocks and drafter.num_free == drafter.num_blocks


def test_start_up_profile_stops_within_its_budgets(target_dir):
    """``warm_start`` spends its budgets (1.5 s of forwards, 0.5 s of drafting) on the
    policy's clock, stopping before a forward the fit predicts would overrun."""
    llm = make(target_dir, kv_cache_memory_bytes=32 << 20)  # no speculation: not profiled yet
    clock = FakeClock(tick=1e-6)
    pol = AutoPolicy([Strategy(3)], clock=clock)
    # forwards of 1-16 tokens take ~0.2 s: the first (not kept) and six more end at 1.45 s;
    # the next, 128 tokens, is predicted at 0.33 s > the 0.05 s left and is not run
    runner = TimedRunner(llm.engine.runner, clock, scale=100)
    # drafting twice per point: 0.09, 0.17 and 0.28 s, so three points start within 0.5 s
    # (each timed twice: its catch-up, but for the first point, and its drafting alone)
    drafter = TimedDrafter(NgramDrafter(Strategy(3)), clock, scale=100)
    blocks = llm.engine.blocks
    pol.warm_start(SimpleNamespace(profile_forward=lambda latency, clock: profiling.profile_forward(
        runner, blocks, latency, drafter=drafter, clock=clock)))
    assert runner.calls == 7 and pol.latency.num_forward == 6 and pol.latency.num_draft == 3 + 2
    assert pol.latency.forward_time(16, 1024, 16) == pytest.approx(
        100 * forward_seconds(16, 1024), rel=0.02)
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_start_up_profile_times_eagle_chains_and_trees(target_dir, fixed_profile):
    """An EAGLE drafter needs target features to draft: the profile gives it some, so its
    drafting is timed (not fitted as free), trees included; its KV and state are returned."""
    llm = make(target_dir, {"method": "eagle", "model": "random", "num_speculative_tokens": 3})
    lat, drafter = llm.engine.policy.latency, llm.engine.drafter
    assert lat.num_draft == 9 + 8  # every point drafted a tree (+ its catch-up but the first)
    assert lat.draft_time(1, 3, 3) > 0
    assert lat.draft_time(4, 6, 96) > lat.draft_time(4, 6, 24)
    assert drafter.blocks.num_free == drafter.blocks.num_blocks and not drafter.states


def test_ngram_auto_policy_greedy_unchanged(target_dir):
    ps = [p * 3 for p in prompts(4, seed=1)]  # repeats give the n-gram drafter matches
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    want = token_ids(make(target_dir), ps, sp)
    llm = make(target_dir, {"method": "ngram", "num_speculative_tokens": 5})
    assert token_ids(llm, ps, sp) == want
    assert llm.get_metrics()["policy"] == "auto"


def test_seeded_sampling_reproduces_under_a_switching_policy(target_dir):
    ps = prompts(5, seed=2)
    sp = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True)
          for i in range(5)]
    runs = []
    for _ in range(2):
        llm = make(target_dir, {"method": "draft_model", "model": str(target_dir),
                                "num_speculative_tokens": 4, "policy": "static"})
        llm.engine.policy = CyclePolicy(SWITCH)
        runs.append(token_ids(llm, ps, sp))
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 5


def test_samples_unchanged_by_a_switching_policy(target_dir, tmp_path):
    """Tokens 1..6 of 64 samples (T=1, top-k 3) with an imperfect drafter and a strategy
    switch every step equal plain sampling's with the same seed, sample for sample (the
    sampling noise is keyed by output position)."""
    draft = save_random_model(tmp_path / "d", {"num_hidden_layers": 1}, seed=5)
    prompt = prompts(1, seed=3)[0]
    n = 64
    sp = SamplingParams(n=n, temperature=1.0, top_k=3, seed=1, max_tokens=6, ignore_eos=True)
    plain = token_ids(make(target_dir, kv_cache_memory_bytes=16 << 20, max_num_seqs=n),
                      [prompt], sp)
    llm = make(target_dir, {"method": "draft_model", "model": str(draft),
                            "num_speculative_tokens": 2, "policy": "static"},
               kv_cache_memory_bytes=16 << 20, max_num_seqs=n)
    llm.engine.policy = CyclePolicy([Strategy(2), Strategy(1), Strategy(2, 3, 4)])
    spec = token_ids(llm, [prompt], sp)
    assert llm.get_metrics()["spec_steps"] > 0
    assert len(set(plain)) > 5  # really sampled
    assert spec == plain


# ---- draft confidence: calibration and tree refinement ------------------------------------
def scored_tree(rng, k=3, depth=4):
    """A full k-ary tree of ``depth`` levels with random draft log-probabilities."""
    from specengine.speculative.tree import DraftTree

    parents, lps, level = [], [], [-1]
    for _ in range(depth):
        nxt = []
        for par in level:
            probs = rng.dirichlet(np.ones(k + 1))[:k]
            for p in probs:
                parents.append(par)
                lps.append(float(np.log(p)))
                nxt.append(len(parents) - 1)
        level = nxt
    return DraftTree(list(range(len(parents))), parents, lps)


def test_calibrator_learns_an_overconfident_drafter():
    from specengine.speculative.policy.calibration import Calibrator, bins, confidences

    rng = np.random.default_rng(0)
    cal = Calibrator(decay=0.999)
    seen = []
    for _ in range(1500):  # true acceptance = confidence squared: an over-confident drafter
        conf = confidences(scored_tree(rng, 2, 3))
        hit = rng.random(conf.shape) < conf ** 2
        cal.observe(conf, hit)
        seen.append(conf)
    rates = cal.rate_per_bin()
    assert (np.diff(rates) >= 0).all()  # monotone in confidence
    conf = np.concatenate(seen)
    for lo, hi in [(0.05, 0.1), (0.2, 0.3), (0.5, 0.7)]:
        sel = (conf >= lo) & (conf < hi)
        want = (conf[sel] ** 2).mean()
        got = cal.predict(conf[sel]).mean()
        assert got == pytest.approx(want, rel=0.25, abs=0.02), (lo, hi)
        assert got < 0.8 * conf[sel].mean()  # below the uncalibrated confidence
    assert bins(np.array([1e-9, 1.0])).tolist() == [0, 15]


def test_refine_keeps_trees_when_memory_bound_and_cuts_them_when_compute_bound():
    from specengine.speculative.policy.calibration import confidences

    rng = np.random.default_rng(3)
    seqs = [SimpleNamespace(calib_accepted=0, calib_predicted=0.0) for _ in range(8)]
    trees = [scored_tree(rng, 3, 3) for _ in seqs]
    total = sum(t.num_nodes for t in trees)
    kept_by = {}
    for name, forward in [("memory", lambda n, c: 0.01 + 1e-7 * n),
                          ("compute", lambda n, c: 0.01 + 2e-3 * n)]:
        p = AutoPolicy(CHAINS + TREES)
        p.latency = fit_latency(forward, np.random.default_rng(1), steps=300)
        p.context_per_seq = 100
        p._predicted = 8 * 2.5 / (forward(8 * 40, 800) + 1e-3)  # ~2.5 tokens per sequence
        out = p.refine(seqs, trees, base_tokens=8)
        kept = kept_by[name] = sum(t.num_nodes for t in out if t is not None)
        if name == "memory":
            assert kept >= 0.85 * total
        else:
            assert kept < 0.5 * total
            for t, cut in zip(trees, out):  # the most confident node survives the cut
                if cut is not None:
                    assert max(confidences(cut)) == max(confidences(t))
        for cut in out:  # every kept node's parent is kept: a valid tree
            if cut is not None:
                assert all(par < i for i, par in enumerate(cut.parents))
    assert kept_by["memory"] > 2 * kept_by["compute"]


def test_request_factor_follows_a_requests_own_acceptance():
    from specengine.speculative.policy.calibration import Calibrator

    cal = Calibrator()
    good = SimpleNamespace(calib_accepted=40, calib_predicted=20.0)
    bad = SimpleNamespace(calib_accepted=2, calib_predicted=20.0)
    new = SimpleNamespace(calib_accepted=0, calib_predicted=0.0)
    assert cal.request_factor(good) > 1.5 > 1.0 == cal.request_factor(new) > 0.5 > \
        cal.request_factor(bad)
    conf = np.array([0.3])
    assert cal.predict(conf, cal.request_factor(good)) > cal.predict(conf) > \
        cal.predict(conf, cal.request_factor(bad))


def test_untried_tree_is_predicted_from_the_chain_then_judged_on_its_own_counts():
    """A tree shape never observed gets ``tree_prior`` of the chain's rates (better than the
    chain, not as good as independent candidates); once observed, its own counts decide."""
    rng = np.random.default_rng(0)
    am = AcceptanceModel(max_depth=8)
    for _ in range(50):
        am.observe(Strategy(8), [int(min(rng.geometric(0.4) - 1, 8)) for _ in range(16)], 16,
                   16 * 8)
    tree = TREES[0]  # w = 2 candidates per depth
    chain_rate = am.rates(Strategy(8))[0]
    assert chain_rate == pytest.approx(0.6, abs=0.05)
    assert am.rates(tree)[0] == pytest.approx(1 - (1 - chain_rate) ** np.sqrt(2))
    chain = am.expected_committed(Strategy(8))
    assert am.expected_committed(tree) > chain + 0.5
    for _ in range(20):  # the tree turns out no better than the chain
        am.observe(tree, [int(min(rng.geometric(0.4) - 1, 8)) for _ in range(16)], 16,
                   16 * tree.num_nodes)
    assert am.expected_committed(tree) == pytest.approx(chain, rel=0.15)


def test_probe_drafts_for_the_few_sequences_with_the_least_catch_up():
    """While off, a probe runs the best chain for ``probe_seqs`` sequences: those the drafter
    has the least to catch up on (so after the first probe, the same few, fed only the tokens
    since), the next few along among equals; the acceptance statistics count only those."""
    rng = np.random.default_rng(5)
    lm = fit_latency(lambda n, c: 0.001 * n, rng)  # compute-bound: off is best at batch 16
    pol = unguarded(CHAINS, latency=lm, acceptance=AcceptanceModel(8), probe_every=5,
                    probe_seqs=3)
    seqs = [SimpleNamespace(num_accepted=0, num_drafted=0, catch_up=200 + i % 2)
            for i in range(16)]
    kept, forwards = [], lm.num_forward
    for _ in range(10):
        s = pol.choose(16)
        keep = pol.select(seqs, s) if s is not None else None
        for i, q in enumerate(seqs):  # a drafted sequence has caught up; the others fall behind
            q.catch_up = 0 if keep is not None and keep[i] else q.catch_up + 1
        if s is not None:
            assert sum(keep) == 3
            kept.append(tuple(i for i, k in enumerate(keep) if k))
            pol.record(StepRecord(strategy=s, num_decode=16, num_prefill_tokens=0,
                                  num_forward_tokens=16 + 3 * s.depth, context_tokens=1600,
                                  num_drafted=3 * s.depth, num_committed=16 + 3 * s.depth,
                                  accepted_per_seq=[s.depth] * 3, draft_time=1e-5,
                                  forward_time=0.001 * (16 + 3 * s.depth), other_time=1e-4))
    assert kept == [(4, 6, 8), (4, 6, 8)]  # the least behind (200), then the same three again
    pol.flush()  # 3 of 16 sequences' nodes: too few tokens to time what a token costs
    assert lm.num_forward == forwards and lm.num_draft > 0
    # among equals, the next few along at each probe
    probes = pol.probes
    assert probes.drafted([7] * 8) == [i in (6, 7, 0) for i in range(8)]  # count = 2: from 6
    probes.count += 1
    assert probes.drafted([7] * 8) == [i in (1, 2, 3) for i in range(8)]
    # sequences tied for the longest remaining output first, then the least behind
    assert probes.drafted([7, 1, 7, 7, 2, 7, 7, 7], [i == 2 for i in range(8)]) == \
        [i in (1, 2, 4) for i in range(8)]
    assert probes.drafted([7] * 8, [i < 6 for i in range(8)]) == [i < 6 for i in range(8)]
    # every probed sequence accepted everything: the chain rate rises towards 1 (3 of 3, not
    # 3 of 16)
    assert pol.acceptance.rates(Strategy(1))[0] > 0.7
    assert any(name.startswith("probe ") for name in pol.stats()["policy_strategies"])


def test_draft_time_is_fitted_on_built_nodes_not_the_refined_ones():
    """The drafter's work is the tree it built; the policy's cuts shrink only the verify."""
    pol = AutoPolicy([Strategy(4, 4, 16)])
    s = Strategy(4, 4, 16)
    for _ in range(40):
        pol.record(StepRecord(strategy=s, num_decode=1, num_prefill_tokens=0,
                              num_forward_tokens=3, context_tokens=100, num_drafted=2,
                              num_committed=2, accepted_per_seq=[1], draft_time=0.004,
                              forward_time=0.008, other_time=0.0005, num_proposed=16))
    assert pol.acceptance.expected_proposed(s) == pytest.approx(16, rel=0.05)
    assert pol.acceptance.expected_nodes(s) == pytest.approx(2, rel=0.05)
    assert pol.latency.draft_time(1, 4, 16) == pytest.approx(0.004, rel=0.2)


def test_correction_drops_a_strategy_slower_than_modelled():
    """A strategy that keeps running slower than both models predict (a cost they miss) is
    scored by what it achieved: the policy leaves it for the next best."""
    rng = np.random.default_rng(5)
    lm = fit_latency(lambda n, c: 0.01 + 1e-5 * n, rng)  # memory-bound: chains pay
    pol = unguarded([Strategy(2)], latency=lm, acceptance=fit_acceptance(0.6, 0.6, rng),
                    probe_every=0)
    s = pol.choose(4)
    assert s == Strategy(2)
    for _ in range(30):
        if s is None:
            break
        predicted = pol._predicted
        committed = 4 + 2 * 4 * 0.6  # as modelled, but each step takes 3x the modelled time
        pol.record(StepRecord(strategy=s, num_decode=4, num_prefill_tokens=0,
                              num_forward_tokens=12, context_tokens=400, num_drafted=8,
                              num_committed=round(committed), accepted_per_seq=[1, 2, 1, 1],
                              draft_time=0.0, forward_time=3 * committed / predicted,
                              other_time=0.0))
        s = pol.choose(4)
    assert s is None


def test_refine_cuts_exactly_the_nodes_below_the_bar():
    """refine's plain-Python per-node probabilities (confidence_list, bin_of) cut exactly what
    keep_worth over the calibrator's array prediction cuts."""
    from specengine.speculative.policy.calibration import confidences, keep_worth

    rng = np.random.default_rng(11)
    seqs = [SimpleNamespace(calib_accepted=float(a), calib_predicted=float(p))
            for a, p in rng.uniform(0, 20, size=(6, 2))]
    trees = [scored_tree(rng, 2, 3) for _ in seqs]
    for forward in (lambda n, c: 0.01 + 1e-7 * n, lambda n, c: 0.01 + 5e-4 * n):
        p = AutoPolicy(CHAINS + TREES)
        p.cutter.verify_whole_every = 0  # every tree cut (the exploration is tested below)
        p.latency = fit_latency(forward, np.random.default_rng(2), steps=200)
        p.context_per_seq = 100
        p._predicted = 6 * 2.5 / (forward(6 * 15, 600) + 1e-3)
        out = p.refine(seqs, trees, base_tokens=6)
        tokens = 6 + sum(t.num_nodes for t in trees)
        lat = p.latency
        bar = p._predicted * (lat.forward_time(tokens + 1, 600, 6)
                              - lat.forward_time(tokens, 600, 6))
        cal = p.cutter.calibrator
        for seq, tree, got in zip(seqs, trees, out):
            want = keep_worth(tree, cal.predict(confidences(tree), cal.request_factor(seq)), bar)
            assert (list(range(tree.num_nodes)) if got is tree else
                    [] if got is None else got.tokens) == [tree.tokens[i] for i in want]


def test_refine_leaves_one_tree_in_k_whole_rotating():
    """Compute-bound, refine cuts low-confidence nodes; one tree in ``verify_whole_every``
    stays whole, a different sequence's each call, so every confidence bin keeps being
    verified and calibrated."""
    rng = np.random.default_rng(3)
    seqs = [SimpleNamespace(calib_accepted=0.0, calib_predicted=0.0) for _ in range(4)]
    p = AutoPolicy(CHAINS + TREES)
    p.cutter.explore_share = 1.0  # exploring costs 3-4% of the step: within this share
    p.latency = fit_latency(lambda n, c: 0.01 + 5e-4 * n, np.random.default_rng(2), steps=200)
    p.context_per_seq = 100
    p._predicted = 400.0
    whole = []
    for _ in range(8):
        trees = [scored_tree(rng, 2, 3) for _ in seqs]
        out = p.refine(seqs, trees, base_tokens=4)
        whole.append([i for i, (t, o) in enumerate(zip(trees, out)) if o is t])
        assert sum(o.num_nodes if o else 0 for o in out) < sum(t.num_nodes for t in trees)
    # calls 1..8: sequence i is left whole when (call + i) % 8 == 0
    assert whole == [[], [], [], [], [3], [2], [1], [0]]


def test_whole_trees_cost_at_most_the_exploration_share():
    """A tree is left whole only while ``explore_share`` of the modelled forward seconds
    covers its cut nodes at the marginal seconds per node: compute-bound (a node costs 2% of
    the step) the trees due to be left whole are cut until the credit covers them, so their
    extra nodes cost at most that share of the steps' seconds over the run; with free nodes,
    one tree in ``verify_whole_every`` is left whole as before."""
    from specengine.speculative.policy.cutter import TreeCutter

    rng = np.random.default_rng(4)
    seqs = [SimpleNamespace(calib_accepted=0.0, calib_predicted=0.0)]
    trees = [scored_tree(rng, 3, 3) for _ in range(64)]
    cuts = [TreeCutter(verify_whole_every=0).cut(seqs, [t], [0], 0.5)[0] for t in trees]
    extra = [t.num_nodes - (c.num_nodes if c else 0) for t, c in zip(trees, cuts)]
    assert sum(e > 0 for e in extra[3::4]) >= 12  # most trees due to stay whole lose nodes
    for node_seconds, share in ((0.0, 0.02), (2e-3, 0.02), (2e-3, 0.0)):
        cutter = TreeCutter(verify_whole_every=4, explore_share=share)
        whole = spent = 0
        for t, e in zip(trees, extra):
            out = cutter.cut(seqs, [t], [0], 0.5, node_seconds, step_seconds=0.1)
            if out[0] is t and e:
                whole += 1
                spent += e * node_seconds
        assert spent <= share * 0.1 * len(trees) + 1e-12
        if node_seconds == 0.0:
            assert whole == sum(e > 0 for e in extra[3::4])
        elif share == 0.0:
            assert whole == 0 and cutter.whole_refused == 16
        else:
            assert 0 < whole < 16 and cutter.whole_refused == 16 - whole


def test_probe_schedule_restarts_only_when_speculation_turns_on_or_off():
    """Switching between two speculative strategies keeps the schedule of baseline probes
    (4, 8, 16, ... steps after speculation was turned on); turning it off restarts it."""
    rng = np.random.default_rng(5)
    steep = fit_latency(lambda n, c: 0.01 + 0.001 * n, rng)
    a, b = Strategy(1), Strategy(2)
    pol = unguarded([a, b], latency=steep, acceptance=fit_acceptance(0.45, 0.45, rng),
                    probe_every=10, hysteresis=0.0)
    table = {None: 100.0, a: 110.0, b: 105.0}  # close calls: off is probed
    pol.scores = lambda batch, context, rates=None: dict(table)
    picks = []
    for i in range(20):
        if i == 6:
            table[b] = 120.0  # a switch from a to b after 6 steps
        picks.append(pol.choose(4))
    assert [i + 1 for i, s in enumerate(picks) if s is None] == [4, 8, 16]
    assert picks[6:] == [b, None] + [b] * 7 + [None] + [b] * 4
    table[None] = 200.0  # off wins: a new schedule of (chain) probes starts
    picks = [pol.choose(4) for _ in range(8)]
    assert [i + 1 for i, s in enumerate(picks) if s is not None] == [4, 8]


def synthetic_steps(rng, n=40):
    """Decode-step records of chains and a tree with scored trees verified, for learning."""
    seqs = [SimpleNamespace(calib_accepted=0, calib_predicted=0.0) for _ in range(4)]
    out = []
    for i in range(n):
        s = [Strategy(2), Strategy(3), TREES[0], None][i % 4]
        trees = [scored_tree(rng, 2, 2) for _ in seqs] if s is not None else []
        acc = [sorted(rng.choice(t.num_nodes, size=int(rng.integers(0, 2)), replace=False)
                      .tolist()) for t in trees]
        out.append(StepRecord(
            strategy=s, num_decode=4, num_prefill_tokens=0,
            num_forward_tokens=4 + sum(t.num_nodes for t in trees), context_tokens=400 + 4 * i,
            num_drafted=sum(t.num_nodes for t in trees), num_committed=4 + sum(map(len, acc)),
            accepted_per_seq=[len(a) for a in acc], draft_time=1e-3 if s else 0.0,
            forward_time=0.01 * rng.lognormal(0, 0.1), other_time=1e-3,
            verified=list(zip(seqs, trees, acc))))
    return out


def test_deferred_learning_learns_what_immediate_learning_does():
    """record defers the model updates to the next re-scoring; flushed, the models are the
    same as when every step is learnt at once."""
    models = []
    for every in (1, 7):
        pol = AutoPolicy(CHAINS + TREES, probe_every=0, clock=FakeClock(tick=1e-6))
        pol.rescore.every = every  # what choose sets from the decision budget
        pol._raw = {s: 300.0 for s in pol.candidates}
        for rec in synthetic_steps(np.random.default_rng(0)):
            pol.record(rec)
        assert len(pol._pending) == (0 if every == 1 else 40 % 7)
        pol.flush()
        models.append(pol)
    a, b = models
    assert a.acceptance.expected(a.candidates)[0] == pytest.approx(
        b.acceptance.expected(b.candidates)[0])
    assert a.latency.forward.theta(3) == pytest.approx(b.latency.forward.theta(3))
    assert a.cutter.calibrator.tried == pytest.approx(b.cutter.calibrator.tried)
    assert a.cutter.calibrator.accepted == pytest.approx(b.cutter.calibrator.accepted)
    assert a.correction.per_bucket[batch_bucket(4)] == pytest.approx(
        b.correction.per_bucket[batch_bucket(4)])
    assert a.decision_time > 0  # learning is counted as the policy's time


def test_rescoring_is_spaced_by_the_decision_budget(monkeypatch):
    """A re-scoring that costs much more than rescore_budget of a step is reused for up to 32
    steps of the same batch size; a new batch size is scored at once. Scores that cost 20.4
    steps' budget serve 21 steps."""
    clock = FakeClock()  # the policy's time is what model_steps takes
    pol = unguarded(CHAINS + TREES, probe_every=0, clock=clock)
    calls, cost = [], [2e-3]
    real = pol.model_steps

    def slow(batch, context):
        calls.append(batch)
        clock.advance(cost[0])
        return real(batch, context)

    monkeypatch.setattr(pol, "model_steps", slow)
    pol.rescore.mean_step = 0.01  # 10 ms steps: the budget is 25 us per step
    pol.rescore.decode_steps = 1000  # models no longer young
    pol.choose(8)
    assert pol.rescore.every == 32
    for _ in range(31):
        pol.choose(8)
    assert calls == [8]
    pol.choose(8)
    pol.choose(3)
    assert calls == [8, 8, 3]
    assert pol.decision_time == pytest.approx(3 * 2e-3)
    pol.rescore.cost, cost[0] = 0.0, 0.51e-3  # 20.4 steps' budget: the scores serve 21 steps
    for _ in range(21):
        pol.choose(4)
    assert pol.rescore.every == 21 and calls == [8, 8, 3, 4]
    pol.choose(4)
    assert calls == [8, 8, 3, 4, 4]


def test_correction_cells_without_evidence_borrow_from_the_nearest_measured_one():
    """A strategy never run in a bucket is scored with the correction its measured sibling
    earned there (the models' miss is shared), and a bucket never seen borrows the same
    candidate's from the nearest bucket; with no evidence anywhere every factor is 1."""
    from specengine.speculative.policy.correction import CorrectionTable

    t = CorrectionTable(4)  # off, d=1, d=2, d=3
    assert t.factors(8) == 1.0
    for _ in range(40):
        t.observe(8, 1, observed=70.0, modelled=100.0)  # d=1 runs at 0.7 of its model
        t.observe(8, 0, observed=100.0, modelled=100.0)
    f8 = t.factors(8)
    assert 0.7 <= f8[1] <= 0.8  # the moving average, its fade towards 1 included
    assert f8[2] == pytest.approx(f8[1]) and f8[3] == pytest.approx(f8[1])  # borrowed
    assert f8[0] == pytest.approx(1.0, abs=0.03)
    f32 = t.factors(32)  # an unseen bucket: each candidate from bucket 8
    assert f32[1] == pytest.approx(f8[1]) and f32[2] == pytest.approx(f8[1])
    for _ in range(40):  # d=2 measured in bucket 8 too: its own factor wins
        t.observe(8, 2, observed=120.0, modelled=100.0)
    assert 1.1 <= t.factors(8)[2] <= 1.2


def test_speculation_is_turned_off_without_the_hysteresis_margin():
    """The margin protects a switch that costs (speculation on: the drafter catches up), not
    turning it off: once no speculation scores above the running strategy, it is chosen."""
    pol = unguarded([Strategy(1)], probe_every=0, hysteresis=0.5)
    pol.current = Strategy(1)
    rates = {None: 101.0, Strategy(1): 100.0}
    pol.model_steps = lambda batch, context: (np.array([rates[c] for c in pol.candidates]),
                                              np.zeros(2))
    assert pol.choose(4) is None
    rates = {None: 100.0, Strategy(1): 140.0}  # on needs the 50% margin
    pol.rescore.every = 0
    assert pol.choose(4) is None
    rates = {None: 100.0, Strategy(1): 160.0}
    assert pol.choose(5) == Strategy(1)
