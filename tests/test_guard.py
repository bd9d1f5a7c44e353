"""Never slower than no speculation: the loss guard (``policy.guard.LossGuard``), the price of
turning a stateful drafter on (catch-up tokens in the step record and the latency model), and
the correction table's fast learning, each alone and together in ``AutoPolicy`` on simulated
steps whose true costs the policy's models get wrong."""

from collections import deque

import numpy as np
import pytest

from specengine import LLM, SamplingParams
from specengine.speculative.policy import AutoPolicy, Policy, StaticPolicy, StepRecord
from specengine.speculative.policy.base import batch_bucket
from specengine.speculative.policy.correction import CorrectionTable
from specengine.speculative.policy.guard import LossGuard
from specengine.speculative.policy.latency import LatencyModel
from specengine.speculative.strategy import Strategy


def test_guard_pays_for_risk_out_of_savings_and_its_share_of_time():
    g = LossGuard(alpha=0.02, horizon=10_000)
    assert g.affords(8, 0.0) and not g.affords(8, 1e-6)  # nothing spent yet: no risk
    for _ in range(100):
        g.observe(8, 0.010, 0.0)  # 100 plain steps of 10 ms: 20 ms may be lost
    assert g.slack(8) == pytest.approx(0.02 * 1.0, rel=0.01)
    assert g.affords(9, 0.019) and not g.affords(9, 0.021)  # 8 and 9: the same bucket
    assert not g.affords(4, 0.001)  # another bucket has its own account
    g.observe(8, 0.012, -0.015)  # a speculative step lost 15 ms
    assert g.slack(8) == pytest.approx(0.02 * 1.012 - 0.015, rel=0.03)
    g.observe(8, 0.010, 0.050)  # one that saved 50 ms pays for much more
    assert g.affords(8, 0.05)
    assert g.refused == 3
    assert g.stats()["buckets"]["8-15"]["spent_s"] == pytest.approx(1.022, rel=0.01)


def test_guard_learns_how_far_the_models_underestimate_a_loss():
    """Two steps in a row that lost 10x and 12x their modelled worst case make the bucket ask
    10x the modelled worst case in slack (one such step alone: nothing learnt); steps that
    lose less bring the factor back 10% at a time."""
    g = LossGuard(alpha=0.02, horizon=10**6)
    for _ in range(1000):
        g.observe(8, 0.01, 0.0)  # 0.2 s of slack
    g.observe(8, 0.01, -0.1, worst_loss=0.01)  # lost 0.1 s where 0.01 was modelled
    assert g.underestimate.get(4, 1.0) == 1.0  # one sample: not learnt
    g.observe(8, 0.01, -0.06, worst_loss=0.005)  # again, 12x
    assert g.slack(8) == pytest.approx(0.0402, rel=2e-3)
    assert g.covers(8, 0.004) and not g.covers(8, 0.0041)
    assert g.covers(2, 0.001) is False and g.underestimate == {4: 10.0}  # its bucket only
    g.observe(8, 0.01, 0.005, worst_loss=0.01)  # saved: the factor fades
    assert g.underestimate[4] == pytest.approx(9.1)


def test_one_loss_beyond_the_noise_does_not_lock_a_bucket():
    """A single speculative step 20x slower than modelled (the machine busy for a moment)
    between steps that lost nothing is charged, but the bucket may speculate again as soon as
    its slack is back; with ``confirm=1`` (each ratio alone) it would wait ~20x longer."""
    waits = {}
    for confirm in (1, 2):
        g = LossGuard(alpha=0.02, horizon=10**6, confirm=confirm)
        for _ in range(500):
            g.observe(1, 0.01, 0.0)  # 0.1 s of slack
        g.observe(1, 0.01, 0.001, worst_loss=0.0001)  # saved
        g.observe(1, 0.012, -0.0021, worst_loss=0.0001)  # lost 2.1 ms: 20x (after 0.1 ms noise)
        g.observe(1, 0.01, 0.0, worst_loss=0.0001)  # lost nothing
        g.saved[1] -= g.slack(1)  # spend the slack: only the allowance earned from now on
        waits[confirm] = g.steps_to_cover(1, 0.0001, step_seconds=0.01)
    assert waits[2] <= 1 and waits[1] >= 15, waits


def test_guard_backs_off_where_speculation_keeps_losing():
    """Each modelled speculative step that lost while the bucket's recent ones lost on balance
    halves the rate at which the bucket earns allowance (down to 1/max_backoff of alpha); once
    they saved on balance it is restored. Allowance already earned is kept, and other buckets
    are not touched."""
    g = LossGuard(alpha=0.02, horizon=10**9, max_backoff=4)
    for _ in range(100):
        g.observe(8, 0.01, 0.0)  # 20 ms allowed
    assert g.slack(8) == pytest.approx(0.02, rel=1e-6)
    g.observe(8, 0.01, -0.005, worst_loss=0.01)  # lost 5 ms
    assert g.backoff == {4: 2} and g.slack(8) == pytest.approx(0.0152, rel=1e-6)
    for _ in range(100):
        g.observe(8, 0.01, 0.0)  # earns alpha / 2 now: 10 ms
    assert g.slack(8) == pytest.approx(0.0252, rel=1e-6)
    for _ in range(3):
        g.observe(8, 0.01, -0.001, worst_loss=0.01)
    assert g.backoff == {4: 4}  # capped
    before = g.slack(8)
    for _ in range(100):
        g.observe(8, 0.01, 0.0)
    assert g.slack(8) - before == pytest.approx(0.02 / 4, rel=1e-6)
    g.observe(1, 0.01, -0.001, worst_loss=0.01)
    assert g.backoff == {4: 4, 1: 2}
    g.observe(8, 0.01, 0.001, worst_loss=0.01)  # saved, but the recent steps lost 6.4 ms
    assert g.backoff == {4: 4, 1: 2} and g.recent[4] == pytest.approx(-0.00472, rel=1e-3)
    g.observe(8, 0.01, 0.006, worst_loss=0.01)  # saved on balance: back to alpha
    assert g.backoff == {1: 2} and g.stats()["buckets"]["8-15"]["backoff"] == 1
    before = g.slack(8)
    g.observe(8, 0.01, 0.0)
    assert g.slack(8) - before == pytest.approx(0.02 * 0.01, rel=1e-6)
    g.observe(8, 0.01, -0.5)  # a step the policy did not model (a thread probe's): no change
    assert 4 not in g.backoff


def test_backoff_follows_the_expected_saving_not_one_draw():
    """Two probes rejected at their first node lost 10 ms each, where the strategy's mean
    acceptance would have saved 15 ms: the books take both losses but the bucket does not back
    off (without ``expected_saved`` it backs off to 4, its slack growing 4x slower)."""
    judged, drawn = LossGuard(alpha=0.02), LossGuard(alpha=0.02)
    for g in (judged, drawn):
        for _ in range(50):
            g.observe(1, 0.04, 0.0)  # plain steps earn the allowance
    for _ in range(2):
        judged.observe(1, 0.05, -0.010, worst_loss=0.012, expected_saved=0.015)
        drawn.observe(1, 0.05, -0.010, worst_loss=0.012)
    assert judged.backoff.get(1, 1) == 1
    assert drawn.backoff[1] == 4
    assert judged.saved[1] == drawn.saved[1] < -0.019  # the books: the real losses
    # expected losses back it off as real ones do, once they outweigh the recent gains
    for _ in range(2):
        judged.observe(1, 0.05, -0.010, worst_loss=0.012, expected_saved=-0.008)
    assert judged.backoff.get(1, 1) == 1
    judged.observe(1, 0.05, -0.010, worst_loss=0.012, expected_saved=-0.008)
    assert judged.backoff[1] == 2


def test_losses_of_a_winning_bucket_do_not_back_it_off():
    """One sequence's chain either wins a few tokens or is rejected at its first node: where
    speculation pays on balance (here +10 ms, -6 ms in turn, 1.3x), its losses are draws of
    the acceptance, not a losing bucket, so ``backoff`` stays 1 after the first win; where it
    loses on balance (+4, -6), each loss doubles it as before. ``memory=1`` is the old rule:
    every loss doubles, the next win resets."""
    for memory, outcomes, settled in ((10, [0.01, -0.006] * 20, [1] * 36),
                                      (10, [-0.006, 0.01] * 20, [1] * 36),
                                      (10, [0.004, -0.006] * 12, [8] * 10),
                                      (1, [0.01, -0.006] * 20, [1, 2] * 18)):
        g = LossGuard(alpha=0.02, horizon=10**9, memory=memory)
        backoffs = []
        for saved in outcomes:
            g.observe(1, 0.05, saved, worst_loss=0.008)
            backoffs.append(g.backoff.get(1, 1))
        assert backoffs[-len(settled):] == settled, (memory, outcomes[:2], backoffs)


def test_a_loss_within_a_plain_steps_noise_is_charged_but_teaches_nothing():
    """A speculative step that lost less than a plain step's own noise costs the bucket its
    slack like any loss, but neither raises ``underestimate`` nor doubles ``backoff``; the
    part of a loss beyond the noise does both."""
    g = LossGuard(alpha=0.02, horizon=10**6)
    for _ in range(1000):
        g.observe(1, 0.01, 0.0)  # 0.2 s of slack
    g.observe(1, 0.01, -0.0015, worst_loss=0.0001, noise=0.002)  # 15x the model, in the noise
    assert g.slack(1) == pytest.approx(0.2002 - 0.0015, rel=1e-3)
    assert g.underestimate.get(1, 1.0) == 1.0 and g.backoff == {}
    g.observe(1, 0.01, -0.0025, worst_loss=0.0001, noise=0.002)  # 0.5 ms beyond the noise
    assert g.backoff == {1: 2}
    g.observe(1, 0.01, -0.0026, worst_loss=0.0001, noise=0.002)  # and again
    assert g.underestimate[1] == pytest.approx(5.0) and g.backoff == {1: 4}


def test_a_bucket_that_backed_off_still_earns_back_its_overhead():
    """Every step pays the policy's own time (``overhead``, charged to ``saved``); ``backoff``
    divides only the exploring part of the allowance, so at the largest backoff a bucket
    whose overhead is 1% of a step still gains (2% - 1%) / 8 of a step per plain step, where
    dividing all of it would lose 0.75% per step forever (and never speculate again)."""
    g = LossGuard(alpha=0.02, horizon=10**9, max_backoff=8)
    g.backoff[1] = 8
    before = g.slack(1)
    for _ in range(100):
        g.observe(1, 0.01, -0.0001, overhead=0.0001)  # 1% of each 10 ms step
    assert g.slack(1) - before == pytest.approx(100 * (0.0002 - 0.0001) / 8, rel=1e-6)
    g.observe(1, 0.01, -0.001, overhead=0.001)  # more than alpha's share: refunds the share
    assert g.allowance[1] == pytest.approx(100 * (0.0001 + 0.0001 / 8) + 0.0002, rel=1e-6)


def test_steps_to_cover_is_a_lower_bound_on_the_plain_steps_a_probe_waits():
    """``steps_to_cover``: plain steps of at most ``step_seconds`` before the slack could
    cover a worst case; it does not cover it any earlier (so an idle policy may skip checking
    that long), and 0 once it does."""
    for backoff in (1, 4):
        g = LossGuard(alpha=0.02, horizon=500)
        g.backoff[4] = backoff
        g.observe(8, 0.01, -0.001)  # some loss already
        n = g.steps_to_cover(8, 0.003, step_seconds=0.01)
        assert n > 0
        for i in range(n):
            assert not g.covers(8, 0.003), (backoff, i)
            g.observe(8, 0.01, 0.0)
        while not g.covers(8, 0.003):
            g.observe(8, 0.01, 0.0)
        assert g.steps_to_cover(8, 0.003, step_seconds=0.01) == 0
    assert LossGuard(alpha=0.0).steps_to_cover(1, 0.001, 0.01) >= 1 << 30


def test_guard_forgets_old_savings():
    g = LossGuard(alpha=0.0, horizon=100)
    g.observe(1, 0.01, 1.0)  # a big saving long ago
    for _ in range(1000):
        g.observe(1, 0.01, 0.0)
    assert g.slack(1) < 1e-3


@pytest.mark.parametrize("kw", [{"alpha": 1.0}, {"alpha": -0.1}, {"horizon": 0},
                                {"max_backoff": 0}, {"confirm": 0}, {"memory": 0}])
def test_guard_rejects_bad_arguments(kw):
    with pytest.raises(ValueError):
        LossGuard(**kw)


def test_correction_learns_a_young_cell_in_a_few_steps():
    """The first steps of a cell are averaged, not blended at 10% each: a strategy running at
    half its modelled rate is scored at half within three steps (turn off fast)."""
    t = CorrectionTable(3)
    t.observe(8, 0, observed=100.0, modelled=100.0)
    t.observe(8, 1, observed=50.0, modelled=100.0)
    assert t.per_bucket[8 .bit_length()][1] == pytest.approx(0.5)
    for _ in range(2):
        t.observe(8, 1, observed=50.0, modelled=100.0)
    assert t.factors(8)[1] == pytest.approx(0.5, abs=0.02)  # trusted: nothing borrowed


def test_latency_model_learns_the_catch_up_price():
    """Draft time = its usual terms + a per-token catch-up cost, learnt from steps that caught
    up (start-up profile and served steps alike) and 0 for a run of speculative steps."""
    lat = LatencyModel()
    rng = np.random.default_rng(0)
    for _ in range(60):
        b, d = int(rng.integers(1, 32)), int(rng.integers(1, 5))
        catch_up = int(rng.integers(0, 400)) if rng.random() < 0.3 else 0
        seconds = 1e-3 + 2e-4 * b * d + 40e-6 * catch_up
        lat.add_draft(b, d, b * d, seconds, catch_up=catch_up)
    assert lat.catch_up_time(1000) == pytest.approx(0.040, rel=0.05)
    assert lat.draft_time(8, 2, 16, catch_up=100) - lat.draft_time(8, 2, 16) == \
        pytest.approx(0.004, rel=0.05)


class Sim:
    """Steps of ``batch`` sequences whose true cost the policy's models do not know: a plain
    step takes ``t_off``; a speculative one ``t_off + extra * depth`` plus ``catch_up``
    seconds per token it catches up on, and commits ``1 + accepted`` tokens per sequence."""

    def __init__(self, batch=8, t_off=0.02, extra=0.004, catch_up=40e-6, accepted=0.0):
        self.batch, self.t_off, self.extra, self.catch_up = batch, t_off, extra, catch_up
        self.accepted = accepted
        self.gap = 0  # steps since the drafter last drafted

    def step(self, s: Strategy | None) -> StepRecord:
        b = self.batch
        if s is None:
            self.gap += 1
            return StepRecord(None, b, 0, b, b * 100, 0, b, [], 0.0, self.t_off, 0.0)
        catch_up, self.gap = b * self.gap, 0
        acc = [round(self.accepted * s.depth)] * b
        return StepRecord(s, b, 0, b * (1 + s.depth), b * 100, b * s.depth, b + sum(acc), acc,
                          self.extra * s.depth / 2 + self.catch_up * catch_up,
                          self.t_off + self.extra * s.depth / 2, 0.0, num_catch_up=catch_up)


def simulate(pol: Policy, sim: Sim, steps: int) -> tuple[float, int]:
    """Run ``steps`` steps; returns (seconds, committed tokens)."""
    seconds, tokens = 0.0, 0
    for _ in range(steps):
        rec = sim.step(pol.choose(sim.batch))
        pol.record(rec)
        seconds += rec.step_time
        tokens += rec.num_committed
    return seconds, tokens


def optimistic_policy(**kw) -> AutoPolicy:
    """An ``AutoPolicy`` whose models believe speculation is cheap and accepted often: a
    flat forward (memory-bound) and free drafting, 90% acceptance; its clock stands still."""
    lat = LatencyModel()
    for n in (8, 16, 32, 64):
        for ctx in (400, 800):
            lat.add_forward(n, ctx, 8, 0.02, prior=True)
    for b, d in ((1, 1), (8, 1), (8, 3), (16, 2)):
        lat.add_draft(b, d, b * d, 1e-5, prior=True)
    # a clock that never moves: the policy's own time (which the guard counts as loss) is 0,
    # so the simulated runs do not depend on the speed of the machine running the test
    pol = AutoPolicy([Strategy(1), Strategy(3)], latency=lat, clock=lambda: 0.0, **kw)
    for _ in range(20):
        pol.acceptance.observe(Strategy(3), [3] * 8, 8, 24, 24)
    return pol


def test_a_policy_misled_into_speculating_loses_at_most_its_budget():
    """Speculation accepts nothing and costs more than modelled (drafting and catch-up the
    models never saw): unguarded, the optimistic models speculate and lose over 3%; guarded,
    the whole run loses at most its 2% budget plus one step's overshoot (the last step it
    allowed may lose more than its slack: ~57 ms of a 40 s run here, 0.15%)."""
    base_s, base_tok = simulate(StaticPolicy(None), Sim(), 2000)
    rate_off = base_tok / base_s
    for max_loss, low, high in ((None, 0.0, 0.97), (0.02, 0.978, 1.0001)):
        s, tok = simulate(optimistic_policy(max_loss=max_loss), Sim(), 2000)
        assert low <= (tok / s) / rate_off <= high, max_loss


def test_no_speculation_before_a_loss_can_be_told_from_noise():
    """The first speculative step waits for 5 plain steps (at some batch size), whose spread
    is the noise its loss is judged against; an optimistic policy speculates right after."""
    pol, sim = optimistic_policy(max_loss=0.02), Sim(accepted=0.5, extra=0.002)
    for _ in range(30):  # earn slack first (a fresh policy has none)
        pol.record(sim.step(None))
    pol._plain_seconds.clear()
    pol._noise_frac = None  # as if those were never measured
    picks = []
    for _ in range(8):
        s = pol.choose(sim.batch)
        pol.record(sim.step(s))
        picks.append(s)
    assert picks[:5] == [None] * 5 and any(p is not None for p in picks[5:]), picks
    assert pol._noise_frac == 0.0  # the simulated plain steps take the same time


class ObservingSim(Sim):
    """``Sim`` with a drafter attached that costs every step ``observe`` seconds (storing the
    target's features for it), which no speculation without a drafter does not pay; the
    step record says so in ``observe_time`` when ``told``."""

    def __init__(self, observe: float, told: bool, **kw):
        super().__init__(**kw)
        self.observe, self.told = observe, told

    def step(self, s: Strategy | None) -> StepRecord:
        rec = super().step(s)
        rec.other_time += self.observe
        rec.observe_time = self.observe if self.told else 0.0
        return rec


def test_the_cost_of_an_attached_drafter_counts_against_the_budget():
    """A drafter attached costs every step 1.5% (its features stored), speculation accepts
    nothing (probes are cheap: no catch-up): told the cost (``StepRecord.observe_time``), the
    guard keeps the run within its 2% budget of no speculation without a drafter, spending
    what is left on a few probes; not told, it spends its whole exploring share on top of the
    1.5% (several times the probes) and the run is slower."""
    base_s, base_tok = simulate(StaticPolicy(None), Sim(), 2000)
    rates, probes = {}, {}
    for told in (True, False):
        pol = optimistic_policy(max_loss=0.02)
        s, tok = simulate(pol, ObservingSim(3e-4, told, catch_up=0.0), 2000)
        rates[told] = (tok / s) / (base_tok / base_s)
        probes[told] = sum(v["steps"] for k, v in pol.per_strategy.items() if k != "off")
    assert rates[False] < rates[True] and 0.98 <= rates[True], rates  # 0.9825 / 0.9843
    assert probes[False] > 2 * probes[True], probes  # 26 / 7 when written


def test_a_paying_strategy_is_found_and_kept_within_the_budget():
    """Speculation pays (half the draft accepted): the guard lets the first steps run out of
    the time budget, the savings then pay for the rest, and the run ends well ahead of no
    speculation."""
    sim = Sim(accepted=0.5, extra=0.002)
    base_s, base_tok = simulate(StaticPolicy(None), Sim(), 2000)
    pol = optimistic_policy()
    s, tok = simulate(pol, sim, 2000)
    assert (tok / s) / (base_tok / base_s) > 1.3
    spec_steps = sum(v["steps"] for k, v in pol.per_strategy.items() if k != "off")
    assert spec_steps > 1500


def test_catch_up_counts_the_tokens_a_drafter_did_not_see(target_dir):
    """The step record's ``num_catch_up``: a sequence's whole length at its first draft, then
    0 while it is drafted for every step; after plain steps, the tokens committed in them."""
    llm = LLM(str(target_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                  "policy": "static"})
    records = []
    spec = Strategy(2)
    schedule = iter([None] * 4 + [spec] * 3 + [None] * 2 + [spec] * 20)

    class Scripted(Policy):
        def choose(self, num_running):
            return next(schedule)

        def record(self, rec):
            records.append(rec)

    llm.engine.policy = Scripted()
    prompt = [5, 6, 7] * 4
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)
    # the prefill, 3 plain steps, 3 drafted, 2 plain, then drafted to the end (one token each
    # step at most: the random target rejects the drafts, or the drafter has none)
    decodes = [(r.strategy is not None, r.num_catch_up) for r in records if r.num_decode]
    assert decodes[:7] == [(False, 0)] * 3 + [(True, len(prompt) + 1 + 3), (True, 0),
                                              (True, 0), (False, 0)]
    assert decodes[8][0] and decodes[8][1] == 2 and all(c == 0 for _, c in decodes[9:])


def test_default_speculative_config_guards_auto(target_dir):
    llm = LLM(str(target_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "ngram"})
    assert llm.engine.policy.guard.alpha == 0.02 * AutoPolicy.GUARD_SHARE  # of the 2% promised
    with pytest.raises(ValueError, match="policy_max_loss"):
        LLM(str(target_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=8 << 20,
            speculative_config={"method": "ngram", "policy_max_loss": 1.5})
    free = LLM(str(target_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=8 << 20,
               speculative_config={"method": "ngram", "policy_max_loss": None})
    assert free.engine.policy.guard is None


def test_progress_counts_what_moves_the_batch_finish():
    """A speculative step's savings count the drop of the longest remaining output (the
    makespan), not the tokens: acceptance on a sequence that ends early anyway counts nothing,
    on the longest one all of it; where several tie for the longest, the mean of theirs, or,
    where their group's finished outputs all ran to ``max_tokens``, the least of theirs."""
    from types import SimpleNamespace

    from specengine.sampling.params import SamplingParams

    pol = AutoPolicy([Strategy(3)])
    params = SamplingParams(max_tokens=100)

    def seqs(outputs):
        return [SimpleNamespace(params=params, num_output_tokens=o, finish_reason=None)
                for o in outputs]

    def rec(ss, accepted):
        verified = [(s, None, [0] * a) for s, a in zip(ss, accepted)]
        return StepRecord(Strategy(3), len(ss), 0, 0, 0, 0, len(ss) + sum(accepted), accepted,
                          0.0, 0.01, 0.0, verified)

    ahead = seqs([50, 10])  # outputs after the step; the first is 40 tokens ahead
    pol.weights(ahead)
    assert pol._progress(rec(ahead, [3, 0])) == 1  # its 3 tokens move nothing
    behind = seqs([10, 12, 5])
    pol.weights(behind)
    assert pol._progress(rec(behind, [0, 2, 3])) == 4  # the longest one took 1 + 3
    alone = seqs([7])
    pol.weights(alone)
    assert pol._progress(rec(alone, [2])) == 3  # batch 1: the tokens committed
    group = seqs([11, 13, 12, 30])  # three tie for the longest (10 tokens out before the step)
    pol.weights(group)
    assert pol._progress(rec(group, [0, 2, 1, 5])) == 2  # each as likely last: their mean
    lagging = seqs([11, 13, 12, 4])  # the fourth (3 before, 1 committed) is longest alone
    pol.weights(lagging)
    assert pol._progress(rec(lagging, [0, 2, 1, 0])) == 1
    # estimated from finished lengths: three tie at 80 tokens left, below their max_tokens
    group = seqs([11, 13, 12, 30])
    left = {id(group[0]): 80.0, id(group[1]): 80.0, id(group[2]): 80.0, id(group[3]): 40.0}
    capped: set[int] = set()
    pol.remaining = SimpleNamespace(observed=True, expected=lambda s: left[id(s)],
                                    runs_to_cap=lambda s: id(s) in capped)
    pol.weights(group)
    assert pol._progress(rec(group, [0, 2, 1, 5])) == 2  # each as likely last: their mean
    # estimated at max_tokens (90 left before the step) from a guess, not from their group
    left.update({id(s): 90.0 for s in group[:3]})
    pol.weights(group)
    assert pol._progress(rec(group, [0, 2, 1, 5])) == 2
    # their group's finished outputs all ran to max_tokens: each ends last, the least moves
    capped.update(id(s) for s in group[:3])
    pol.weights(group)
    assert pol._progress(rec(group, [0, 2, 1, 5])) == 1
    assert pol._progress(rec(group, [2, 2, 1, 5])) == 2


def test_a_stop_in_a_speculative_step_is_not_counted_as_saved():
    """A sequence that stops (EOS) in a speculative step far short of its expected remaining
    output moved the finish by what it committed, not by all it was expected to need: plain
    steps reach the same stop a few steps later. Counting its whole remaining output had
    credited one step with hundreds of plain steps' savings (the guard's books of qwen's
    8-15 bucket read 16 s saved in an epoch whose steps there ran 1.7 s)."""
    from types import SimpleNamespace

    from specengine.sampling.params import SamplingParams

    pol = AutoPolicy([Strategy(3)])
    params = SamplingParams(max_tokens=1000)
    left: dict[int, float] = {}
    pol.remaining = SimpleNamespace(observed=True, expected=lambda s: left[id(s)],
                                    runs_to_cap=lambda s: False)

    def rec(ss, accepted):
        verified = [(s, None, [0] * a) for s, a in zip(ss, accepted)]
        return StepRecord(Strategy(3), len(ss), 0, 0, 0, 0, len(ss) + sum(accepted), accepted,
                          0.0, 0.01, 0.0, verified)

    alone = SimpleNamespace(params=params, num_output_tokens=40, finish_reason=None)
    left[id(alone)] = 300.0
    pol.weights([alone])
    alone.finish_reason = "stop"  # its EOS among the 3 tokens the step committed
    assert pol._progress(rec([alone], [2])) == 3
    pair = [SimpleNamespace(params=params, num_output_tokens=o, finish_reason=None)
            for o in (40, 40)]
    left.update({id(pair[0]): 300.0, id(pair[1]): 100.0})
    pol.weights(pair)
    pair[0].finish_reason = "stop"  # the longest expected stops: the finish moved 2, not 200
    assert pol._progress(rec(pair, [1, 0])) == 2


class ProbedSim(Sim):
    """``Sim`` whose kernels' thread tuner probes the new forward size that speculation
    brings: its first 4 speculative steps run at a slower thread count (``slow`` seconds
    more; each a forward size new to the tuner, so each probed), flagged ``thread_probe`` when
    ``flag``."""

    def __init__(self, flag: bool, slow: float = 0.03, **kw):
        super().__init__(**kw)
        self.flag, self.slow, self.spec_steps = flag, slow, 0

    def step(self, s: Strategy | None) -> StepRecord:
        rec = super().step(s)
        if s is not None:
            self.spec_steps += 1
            if self.spec_steps <= 4:
                rec.forward_time += self.slow
                rec.thread_probe = self.flag
        return rec


def test_a_thread_probe_is_not_taken_for_speculation_losing():
    """A thread-count probe's slow steps land on the first speculative steps (their forward
    size is new to the tuner). Flagged ``thread_probe``, they cost what they cost but teach
    neither the guard's underestimate nor the latency model, and the paying strategy is kept;
    unflagged, the guard takes them for its model underestimating the loss many times over
    and speculation stays off for most of the run."""
    base_s, base_tok = simulate(StaticPolicy(None), Sim(), 2000)
    rates = {}
    for flag in (True, False):
        pol = optimistic_policy()
        s, tok = simulate(pol, ProbedSim(flag, accepted=0.5, extra=0.002), 2000)
        rates[flag] = (tok / s) / (base_tok / base_s)
        if flag:
            assert max(pol.guard.underestimate.values(), default=1.0) < 2.0
    assert rates[True] > 1.3
    assert rates[False] < rates[True] - 0.1


def test_overhead_paid_in_bursts_is_earned_back_like_steady_overhead():
    """The policy learns from 64 idle steps at once: its overhead comes as one burst (2.56 ms
    every 64 steps of 10 ms, 0.04 ms a step on average, within alpha's 0.2 ms). At the largest
    backoff the bucket's slack grows as with the same overhead paid evenly, by (0.2 - 0.04) /
    8 ms a step; earning back at most alpha's share of the burst step, it would shrink."""
    growth = {}
    for burst in (False, True):
        g = LossGuard(alpha=0.02, horizon=10**9, max_backoff=8)
        g.backoff[1] = 8
        for i in range(640):
            ovh = (0.00256 if i % 64 == 0 else 0.0) if burst else 0.00004
            g.observe(1, 0.01, -ovh, overhead=ovh)
        growth[burst] = g.slack(1) / 640
    assert growth[True] == pytest.approx(growth[False], rel=1e-6)
    assert growth[False] == pytest.approx((0.0002 - 0.00004) / 8, rel=1e-6)


def test_savings_are_counted_against_a_plain_step_measured_lately():
    """Speculation pays and runs on, while a plain step gets 25% cheaper (the machine freed
    up): one step in ``PLAIN_EVERY`` at that batch size is plain, so the seconds a
    speculative step is credited with saving follow the new cost, not the one measured
    before speculation took over (which would credit each step 5 ms it never saved)."""
    pol, sim = optimistic_policy(), Sim(accepted=0.5, extra=0.002)
    simulate(pol, sim, 1000)
    sim.t_off = 0.015
    picks = []
    for _ in range(1000):
        s = pol.choose(sim.batch)
        pol.record(sim.step(s))
        picks.append(s)
    plain_at = [i for i, s in enumerate(picks) if s is None]
    assert sum(s is not None for s in picks) > 900  # speculation kept
    gaps = np.diff([-1, *plain_at, len(picks)])
    assert gaps.max() <= pol.PLAIN_EVERY + 1, gaps.max()
    assert np.median(pol._plain_seconds[sim.batch]) == pytest.approx(0.015)


def test_runs_to_cap_needs_the_group_to_have_reached_max_tokens():
    """``RemainingLength.runs_to_cap``: a sequence's group has finished outputs longer than
    its own and all of them reached its ``max_tokens``; a guess from the prior (no group
    lengths past it) is not enough."""
    from types import SimpleNamespace

    from specengine.sampling.params import SamplingParams
    from specengine.speculative.policy.remaining import RemainingLength

    est = RemainingLength()
    params = SamplingParams(max_tokens=256)

    def seq(prompt, out):
        return SimpleNamespace(seq_id=id(object()), prompt_token_ids=prompt,
                               num_output_tokens=out, params=params)

    est.add(est.group_key([1, 2]), 256)
    est.add(est.group_key([1, 2]), 256)
    est.add(est.group_key([3]), 200)
    est.add(est.group_key([3]), 256)
    assert est.runs_to_cap(seq([1, 2], 100))
    assert not est.runs_to_cap(seq([3], 100))  # one sibling stopped at 200
    assert est.runs_to_cap(seq([3], 210))  # the one past 210 ran to the cap
    assert not est.runs_to_cap(seq([9], 10))  # no group lengths: the prior's guess only
    assert est.expected(seq([9], 200)) == 56.0  # though the estimate puts it at the cap


def test_a_step_of_many_tied_sequences_is_afforded_on_its_likely_acceptance():
    """The guard's worst case for a step counts the accepted tokens' lower confidence bound
    (``AutoPolicy._assured``): 16 sequences tied for the longest remaining output, a depth-1
    chain measured at 0.69 accepted tokens per sequence, a 67 ms plain step: a step that
    would lose 25 ms with nothing accepted all but surely saves 30 ms, so it needs slack only
    for ``GUARD_FLOOR`` of the 25 ms. Not so when one sequence alone decides the finish, nor
    on an estimate from 4 sequences (a third of the credit)."""
    chain = Strategy(1)

    class Seq:
        def __init__(self, out):
            self.num_output_tokens, self.params = out, SamplingParams(max_tokens=256)
            self.num_cached, self.catch_up = 100, 0

        def __len__(self):
            return 101

    def policy(outputs, drafted):
        pol = AutoPolicy([chain], clock=lambda: 0.0)
        seqs = [Seq(o) for o in outputs]
        pol._running = lambda: seqs
        pol._plain_seconds[16] = deque([0.067] * 9, maxlen=9)
        for _ in range(drafted // 16 or 1):
            n = min(drafted, 16)
            pol.acceptance.observe(chain, [1] * round(0.69 * n) + [0] * (n - round(0.69 * n)),
                                   n, n, n)
        pol._ties = pol._tied(16)
        return pol

    tied = policy([10] * 16, 320)
    assert tied._ties == 16
    assured = tied._assured(16)[chain]
    a = tied.acceptance.expected_accepted(chain)
    assert 0.4 * 0.067 < assured < a * 0.067
    assert tied._worst_loss(0.025, assured) == pytest.approx(AutoPolicy.GUARD_FLOOR * 0.025)
    guard = tied.guard
    guard.allowance[batch_bucket(16)] = 0.005  # 5 ms of slack
    assert guard.covers(16, tied._worst_loss(0.025, assured)) and not guard.covers(16, 0.025)
    one = policy([10 + i for i in range(16)], 320)  # the longest sequence alone decides
    assert one._ties == 1 and one._assured(16)[chain] == 0.0
    # an off probe drafts for every tied sequence (its mean commit is what moves the finish),
    # else for the few (probe_seqs) with the least catch-up
    assert tied._probe(16)[0] == 1.0 and tied._probe(16)[2]
    assert one._probe(16)[0] == pytest.approx(4 / 16)
    few = policy([10] * 16, 4)  # 4 sequences measured: too little to count on
    assert few._ties == 16 and few._assured(16)[chain] < 0.35 * assured
