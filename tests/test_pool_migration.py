"""Migration across a ``RolloutPool`` on a local Ray (2 actors x 1 CPU, tiny random model,
float32): a skewed rollout (every long request placed on actor 0) has samples moved to actor 1
once it runs dry, by K/V transfer (two stages) or by re-prefill as the cost rule says; the
outputs equal one engine's (greedy and seeded T=1, logprobs included), split requests come back
joined in input order, and every actor's KV blocks are back to baseline. Also: the controller's
rule alone, a destination dying after a move, and migration beside spare-instance training
(EAGLE actors)."""

import pytest

ray = pytest.importorskip("ray")

from specengine import LLM, SamplingParams  # noqa: E402
from specengine.distributed import RolloutPool  # noqa: E402
from specengine.distributed.migration_controller import MigrationController  # noqa: E402
from specengine.lifecycle.migration import MigrationCost, SequenceInfo  # noqa: E402
from specengine.models.loader import save_random_model  # noqa: E402

KW = {"dtype": "float32", "block_size": 8, "kv_cache_memory_bytes": 8 << 20}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("poolmig"), {"num_hidden_layers": 2},
                             seed=1)


class Skewed(MigrationController):
    """Places the shortest request on actor 1 and every other one on actor 0; moves only
    running samples (waiting ones would always move as tokens), once actor 1 ran dry."""

    dry = False

    def place(self, pool, groups, actors, model):
        self.dry = False
        groups = sorted(groups, key=lambda g: model.work(g))
        return {1: groups[0], 0: [r for g in groups[1:] for r in g]}

    def on_output(self, pool, actor_id, index, num_left):
        self.dry = self.dry or (actor_id == 1 and num_left == 0)
        super().on_output(pool, actor_id, index, num_left)

    def plan(self, sequences, movable=lambda q: True):
        if not self.dry:
            return None
        return super().plan(sequences, lambda q: q.running and movable(q))


def workload():
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [100, 200, 300] * 4, [42] * 11, [1, 2]]
    params = [SamplingParams(temperature=0, max_tokens=96, ignore_eos=True, n=2),
              SamplingParams(temperature=1.0, max_tokens=96, ignore_eos=True, n=3, logprobs=1),
              SamplingParams(temperature=1.0, seed=7, max_tokens=90, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)]
    return prompts, params


def samples(outs):
    return [[(c.index, c.token_ids, c.finish_reason, None if c.logprobs is None else
              [{t: round(lp.logprob, 4) for t, lp in d.items()} for d in c.logprobs])
             for c in o.outputs] for o in outs]


@pytest.mark.parametrize("path", ["kv", "reprefill"])
def test_skewed_rollout_migrates_exactly(local_ray, model_dir, path):
    bandwidth = 1e15 if path == "kv" else 1e-3  # the cost rule then picks one path only
    ctl = Skewed(interval=0.05, ratio=0.5, cost=MigrationCost(bandwidth=bandwidth, latency=0))
    pool = RolloutPool(str(model_dir), 2, seed=5, controller=ctl, **KW)
    try:
        prompts, params = workload()
        ref = LLM(str(model_dir), seed=5, **KW)
        want = ref.generate(prompts, params, use_tqdm=False)
        got = pool.generate(prompts, params)
        assert samples(got) == samples(want)
        assert [o.request_id for o in got] == ["0", "1", "2", "3"]
        assert [o.prompt_token_ids for o in got] == prompts
        m = pool.get_metrics()
        assert ctl.moves and {how for *_, how in ctl.moves} == {path}
        assert all(src == 0 and dst == 1 for _, _, src, dst, _ in ctl.moves)
        moved = {(i, s) for i, s, *_ in ctl.moves}
        # some request came back in parts from both actors and was joined
        assert any(0 < sum((i, s) in moved for s in range(p.n)) < p.n
                   for i, p in enumerate(params)), ctl.moves
        key = "migrated_samples" if path == "kv" else "reprefilled_samples"
        assert m[key] == len(ctl.moves) and m["migration_rounds"] >= 1
        assert m["migration_bytes"] > 0 and m["migration_seconds"] > 0
        assert m["controller_seconds"] >= m["migration_seconds"]
        src, dst = m["actors"][0], m["actors"][1]
        if path == "kv":
            assert src["migrated_out"] == dst["migrated_in"] == len(ctl.moves)
            assert src["migration_stage1_bytes"] > 0  # stage one sent full blocks
        else:
            assert src["reprefilled_out"] == dst["reprefilled_in"] == len(ctl.moves)
            assert src["migration_stage1_bytes"] == 0
        for a in m["actors"].values():
            assert a["kv_blocks_free"] == a["kv_blocks_total"]
        # the pool works on afterwards (nothing left over on the actors)
        again = pool.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))
        assert samples(again) == samples(ref.generate(
            prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False))
    finally:
        pool.shutdown()


def test_controller_arguments():
    for kw, msg in (({"interval": 0}, "interval"), ({"ratio": 1.0}, "ratio"),
                    ({"min_samples": 1}, "min_samples"), ({"max_moves": 0}, "max_moves"),
                    ({"min_remaining": -1}, "min_remaining"),
                    ({"step_fixed_cost": -1}, "step_fixed_cost")):
        with pytest.raises(ValueError, match=msg):
            MigrationController(**kw)


def info(rid, index, remaining, tau=1.0):
    return SequenceInfo(rid, index, True, 10, 5, 200, 14, 1000, float(remaining), tau)


def test_plan_moves_the_longest_samples_while_the_gap_narrows():
    ctl = MigrationController(min_remaining=4, step_fixed_cost=0)
    busy = [info("a", 0, 100), info("a", 1, 90), info("b", 0, 80), info("b", 1, 3),
            info("c", 0, 60, tau=2.0)]  # c: 30 steps
    # work 100 + 90 + 80 + 3 + 30 = 303 against 10: move 100 (gap 293 -> 93), then 90 < 93
    # (gap -> -87); the rest would widen the gap again
    src, dst, picks = ctl.plan({0: busy, 1: [info("d", 0, 10)]})
    assert (src, dst) == (0, 1)
    assert [(q.request_id, q.index) for q in picks] == [("a", 0), ("a", 1)]
    # the idle actor is not idle enough, or too few samples are left: no round
    assert ctl.plan({0: busy, 1: [info("d", 0, 200)]}) is None
    assert ctl.plan({0: busy[:1], 1: []}) is None
    # samples moved before (or not movable) stay; short ones stay; one always stays
    ctl._done = {("a", 0)}
    _, _, picks = ctl.plan({0: busy, 1: []}, movable=lambda q: q.request_id != "a")
    assert [(q.request_id, q.index) for q in picks] == [("b", 0), ("c", 0)]
    ctl._done = set()
    _, _, picks = ctl.plan({0: [info("a", 0, 50), info("a", 1, 50)], 1: []})
    assert len(picks) == 1
    _, _, picks = MigrationController(max_moves=1).plan({0: busy, 1: []})
    assert len(picks) == 1
    # with a step's fixed cost, one long sample among short ones moves alone: 8 * 300 + 480
    # against 0 -> 8 * 20 + 180 and 8 * 300 + 300; a short one more would raise the second
    fixed = MigrationController(step_fixed_cost=8, min_remaining=4)
    tail = [info("a", 0, 300)] + [info("b", i, 20) for i in range(9)]
    assert fixed.work([300] + [20] * 9) == 8 * 300 + 480
    _, _, picks = fixed.plan({0: tail, 1: []})
    assert [(q.request_id, q.index) for q in picks] == [("a", 0)]


class KillDestination(Skewed):
    """Kills the destination right after the first round moved samples there."""

    killed = None

    def _move(self, pool, run, src, dst, picks, prefill_rate):
        super()._move(pool, run, src, dst, picks, prefill_rate)
        if self.killed is None and self.moves:
            self.killed = dst
            ray.kill(pool.actors[dst], no_restart=True)


def test_destination_dying_after_a_move_loses_nothing(local_ray, model_dir):
    ctl = KillDestination(interval=0.05, cost=MigrationCost(bandwidth=1e15, latency=0))
    pool = RolloutPool(str(model_dir), 2, seed=5, controller=ctl, **KW)
    try:
        prompts, params = workload()
        want = LLM(str(model_dir), seed=5, **KW).generate(prompts, params, use_tqdm=False)
        got = pool.generate(prompts, params)  # the moved samples' requests run again on 0
        assert samples(got) == samples(want)
        assert ctl.killed == 1 and ctl.moves
        m = pool.get_metrics()
        assert m["num_actors_dead"] == 1
        moved = {i for i, *_ in ctl.moves}
        assert m["num_requests_rerun"] >= 1 and m["num_requests_rerun"] <= len(moved) + 1
        a = m["actors"][0]
        assert a["kv_blocks_free"] == a["kv_blocks_total"]
    finally:
        pool.shutdown()


def test_migration_beside_spare_training(local_ray, model_dir):
    """EAGLE actors with spare-instance training: actor 1 falls idle (it may start a training
    round), samples migrate to it (their K/V and EAGLE features), a round there stops for them;
    the outputs are still one engine's."""
    from specengine.distributed import SpareTraining
    from specengine.speculative.training.fit import TrainConfig

    eagle = {"method": "eagle", "model": "random", "num_speculative_tokens": 3, "topk": 2,
             "policy": "static"}
    cfg = SpareTraining(seconds=600, max_steps=20, min_rollouts=1,
                        train=TrainConfig(steps=100, batch_tokens=256, warmup=1, lr=1e-3))
    ctl = Skewed(interval=0.05, cost=MigrationCost(bandwidth=1e15, latency=0))
    pool = RolloutPool(str(model_dir), 2, seed=5, controller=ctl, speculative_config=eagle,
                       spare_training=cfg, **KW)
    try:
        prompts, params = workload()
        ref = LLM(str(model_dir), seed=5, speculative_config=eagle, **KW)
        got = pool.generate(prompts, params)
        assert samples(got) == samples(ref.generate(prompts, params, use_tqdm=False))
        m = pool.get_metrics()
        assert ctl.moves and m["migrated_samples"] == len(ctl.moves)
        assert m["actors"][1]["migrated_in"] == len(ctl.moves)
        assert m["actors"][1]["spec_steps"] > 0  # actor 1 drafted for the moved samples
        st = m["spare_training"]
        assert st["versions_published"] == st["drafter_version"] <= st["train_rounds"]
        for a in m["actors"].values():
            assert a["kv_blocks_free"] == a["kv_blocks_total"]
    finally:
        pool.shutdown()
