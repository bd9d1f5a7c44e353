"""Spare-instance drafter training (TLT) on a local Ray (tiny random model, EAGLE with random
weights): a pool actor whose share is done trains the drafter on the pool's harvested rollouts
and the version it publishes reaches every actor; outputs equal one engine's without training
(greedy and seeded); a round stops when new work reaches its actor (injected between steps);
nothing trains without a spare actor or without enough harvested rollouts."""

import threading

import pytest
import torch

ray = pytest.importorskip("ray")

from specengine import LLM, SamplingParams  # noqa: E402
from specengine.distributed import PoolController, RolloutPool, SpareTraining  # noqa: E402
from specengine.distributed import spare_training as spare  # noqa: E402
from specengine.distributed.spare_training import HarvestStore, merge_tau  # noqa: E402
from specengine.distributed.worker import RolloutWorker  # noqa: E402
from specengine.models.loader import save_random_model  # noqa: E402
from specengine.speculative.training.fit import TrainConfig  # noqa: E402

KW = {"dtype": "float32", "block_size": 8, "kv_cache_memory_bytes": 8 << 20}
EAGLE = {"method": "eagle", "model": "random", "num_speculative_tokens": 3, "topk": 2,
         "policy": "static"}
TRAIN = TrainConfig(steps=100, batch_tokens=256, warmup=1, lr=1e-3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("spare"), {"num_hidden_layers": 2}, seed=1)


@pytest.fixture(scope="module")
def reference(model_dir):
    """One engine with the same (untrained) EAGLE drafter: what every pool must return."""
    return LLM(str(model_dir), seed=3, speculative_config=EAGLE, **KW)


def tokens(outs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def test_config_store_and_tau_merge():
    with pytest.raises(ValueError, match="seconds"):
        SpareTraining(seconds=0)
    with pytest.raises(ValueError, match="max_steps"):
        SpareTraining(max_steps=0)
    with pytest.raises(ValueError, match="min_rollouts"):
        SpareTraining(min_rollouts=0)
    store = HarvestStore(max_rollouts=5, max_bytes=1000)
    for name, count, nbytes in (("a", 2, 100), ("b", 0, 0), ("c", 2, 100), ("d", 2, 100)):
        store.add(name, count, nbytes)
    assert store.refs() == ["c", "d"] and store.num_rollouts == 4 and store.total_added == 6
    store.add("e", 1, 950)  # over the byte bound: older chunks go, the newest stays
    assert store.refs() == ["e"] and store.nbytes == 950
    assert merge_tau([{0: [4, 8], 1: [1, 3]}, {1: [1, 1]}, {}]) == {0: 2.0, 1: 2.0}


def test_round_stops_when_work_arrives(local_ray, model_dir, monkeypatch):
    """In-process actor body: new work arriving after step 2 ends the round before step 3; the
    stop flag, the step cap, the (injected) clock budget and an empty store end it too."""
    w = RolloutWorker(dict(model=str(model_dir), seed=3, speculative_config=EAGLE, **KW))
    assert w.enable_harvest(max_rollouts=64)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 7, [1, 2, 3, 4]]
    list(w.rollout([(str(i), p, greedy) for i, p in enumerate(prompts)]))
    meta, rollouts = w.take_harvest()
    assert meta["count"] == 4 == len(rollouts) and meta["nbytes"] > 0
    assert w.take_harvest()[0]["count"] == 0  # taken out
    refs = [ray.put(rollouts)]
    weights_before = {n: p.detach().clone() for n, p in w._eagle().model.named_parameters()}

    later = [[9, 9, 8], [300, 301, 302, 303]]
    got = {}
    step = spare.Fitter.step

    def step_then_work(self, batch):
        out = step(self, batch)
        if self.step_no == 2:  # new work reaches the actor during step 2
            t = threading.Thread(target=lambda: got.update(
                out=list(w.rollout([(f"l{i}", p, greedy) for i, p in enumerate(later)]))))
            t.start()
            got["thread"] = t
            for _ in range(6000):
                if w.work_received == 2:
                    break
                threading.Event().wait(0.01)
        return out

    monkeypatch.setattr(spare.Fitter, "step", step_then_work)
    cfg = SpareTraining(seconds=1e6, max_steps=50, min_rollouts=1, train=TRAIN)
    stats, weights = w.train_drafter(refs, cfg, 1)
    got["thread"].join(timeout=600)
    assert stats["steps"] == 2 and stats["stop"] == "work" and stats["rollouts"] == 4
    assert weights is not None and w.trainer.fitter.step_no == 2
    plain = LLM(str(model_dir), seed=3, **KW).generate(later, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sorted(got["out"], key=lambda o: o.request_id)] == \
        [o.outputs[0].token_ids for o in plain]
    monkeypatch.setattr(spare.Fitter, "step", step)

    # the pool publishes the round's weights: swapped in at once on an idle engine
    assert w.set_drafter([ray.put(weights)], 1, 1) == 1 and w.trainer.version == 1
    drafter = w._eagle()
    assert all(torch.equal(p, weights[n]) for n, p in drafter.model.named_parameters())
    assert not torch.equal(drafter.model.fc, weights_before["fc"])

    # a version published while the engine decodes is swapped in between two of its steps
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    t = threading.Thread(target=lambda: got.update(long=list(w.rollout([("0", [7, 8, 9], long)]))))
    t.start()
    for _ in range(60000):  # until a verify step ran with version 1
        if drafter.per_version.get(1, [0])[0] >= 1:
            break
        threading.Event().wait(0.005)
    nudged = {k: v + 0.01 for k, v in weights.items()}
    assert w.set_drafter([ray.put(nudged)], 2) == 1  # queued: the engine is busy
    t.join(timeout=600)
    assert drafter.version == 2 and drafter.per_version[2][0] >= 1
    plain_long = LLM(str(model_dir), seed=3, **KW).generate([[7, 8, 9]], long, use_tqdm=False)
    assert got["long"][0].outputs[0].token_ids == plain_long[0].outputs[0].token_ids

    w.stop_training(2)  # a stop sent before the round starts: it still runs one step
    stats, _ = w.train_drafter(refs, cfg, 2)
    assert (stats["steps"], stats["stop"]) == (1, "pool")
    stats, _ = w.train_drafter(refs, SpareTraining(seconds=1e6, max_steps=3, train=TRAIN), 3)
    assert (stats["steps"], stats["stop"]) == (3, "steps")
    w.trainer.cfg = SpareTraining(seconds=2.5, train=TRAIN)
    ticks = iter(range(100))  # an injected clock: 1 s per step, budget 2.5 s
    stats, _ = w.trainer.run(lambda: False, lambda: False, clock=lambda: float(next(ticks)))
    assert (stats["steps"], stats["stop"], stats["seconds"]) == (2, "budget", 2.0)  # 3rd: 3 s
    w.trainer.cfg = SpareTraining(seconds=3.0, train=TRAIN)
    ticks = iter(range(100))
    stats, _ = w.trainer.run(lambda: False, lambda: False, clock=lambda: float(next(ticks)))
    assert (stats["steps"], stats["stop"]) == (3, "budget")
    assert w.trainer.load([]) == 0  # nothing harvested: no step, no weights
    stats, weights = w.trainer.run(lambda: False, lambda: False)
    assert (stats["steps"], stats["stop"], weights) == (0, "data", None)


def test_eagle_inside_a_merged_drafter_trains(local_ray, model_dir):
    spec = {"method": ["suffix", "eagle"], "model": "random", "num_speculative_tokens": 3,
            "topk": 2, "policy_max_loss": None}  # speculates from the first step
    w = RolloutWorker(dict(model=str(model_dir), seed=3, speculative_config=spec, **KW))
    assert w.enable_harvest() and w._eagle() is w.llm.engine.drafter.wrapped()[0].part("eagle")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [5, 6, 7, 8, 9]]
    want = [o.outputs[0].token_ids
            for o in LLM(str(model_dir), **KW).generate(prompts, greedy, use_tqdm=False)]
    items = [(str(i), p, greedy) for i, p in enumerate(prompts)]

    def run(items):
        return sorted(w.rollout(items), key=lambda o: o.request_id)

    assert [o.outputs[0].token_ids for o in run(items)] == want
    meta, rollouts = w.take_harvest()
    assert meta["count"] == 3
    stats, weights = w.train_drafter([ray.put(rollouts)],
                                     SpareTraining(seconds=600, max_steps=2, min_rollouts=1,
                                                   train=TRAIN), 1)
    assert stats["steps"] == 2 and w.set_drafter([ray.put(weights)], 1, 1) == 1
    assert [o.outputs[0].token_ids for o in run(items)] == want
    assert w.get_metrics()["drafter_version"] == 1 and 1 in w.drafter_counts()


class Recorder(PoolController):
    def __init__(self):
        self.dispatched = {}

    def on_dispatch(self, pool, actor_id, indices):
        self.dispatched.setdefault(actor_id, []).extend(indices)


@pytest.fixture(scope="module")
def pool(local_ray, model_dir):
    cfg = SpareTraining(seconds=600, max_steps=2, min_rollouts=3, train=TRAIN)
    p = RolloutPool(str(model_dir), 2, seed=3, speculative_config=EAGLE, spare_training=cfg,
                    controller=Recorder(), **KW)
    yield p
    p.shutdown()


def long_and_short(n_short, temperature=0.0):
    """A long request and a short group: on different actors, the short one's actor is spare
    for most of the rollout."""
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    params = [SamplingParams(temperature=temperature, max_tokens=200, ignore_eos=True, seed=11),
              SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True, n=n_short,
                             seed=12)]
    return prompts, params


def test_nothing_trains_before_enough_is_harvested(pool, reference):
    prompts, params = long_and_short(1)  # the spare actor finds 1 rollout (< min_rollouts 3)
    assert tokens(pool.generate(prompts, params)) == \
        tokens(reference.generate(prompts, params, use_tqdm=False))
    m = pool.get_metrics()
    st = m["spare_training"]
    assert st["train_rounds"] == 0 and st["versions_published"] == 0 and st["train_steps"] == 0
    assert st["harvested_rollouts"] == 2  # collected at the end, for the next generate
    assert m["drafter_versions"] == {0: 0, 1: 0}


def test_spare_actor_publishes_a_version_every_actor_uses(pool, reference):
    rec = pool.controller = Recorder()
    prompts, params = long_and_short(4)
    got = pool.generate(prompts, params)
    assert tokens(got) == tokens(reference.generate(prompts, params, use_tqdm=False))
    short_actor = next(a for a, idx in rec.dispatched.items() if 1 in idx)
    assert 0 not in rec.dispatched[short_actor]  # the long request ran elsewhere
    m = pool.get_metrics()
    st = m["spare_training"]
    v = st["drafter_version"]
    assert v >= 1 and st["versions_published"] == v and st["train_steps"] >= 1
    assert st["train_rounds"] >= 1 and st["train_seconds"] > 0
    assert {r["actor"] for r in pool.spare.rounds} == {short_actor}
    assert [r["version"] for r in pool.spare.rounds if r["version"]] == list(range(1, v + 1))
    assert m["drafter_versions"] == {0: v, 1: v}  # every actor swapped the newest version in
    last = {ray.get(a.received_objects.remote())[-1] for a in pool.actors.values()}
    assert len(last) == 1  # both read the one stored copy of the weights

    # seeded sampling with the published drafter: still what the untrained engine samples
    prompts, params = long_and_short(3, temperature=1.0)
    got = pool.generate(prompts, params)
    assert tokens(got) == tokens(reference.generate(prompts, params, use_tqdm=False))
    m = pool.get_metrics()
    taus = m["tau_per_drafter_version"]
    assert any(ver >= v for ver in taus) and all(t >= 1.0 for t in taus.values())
    assert m["drafter_versions"][0] == m["drafter_versions"][1] == \
        m["spare_training"]["drafter_version"] >= v


def test_spare_training_needs_an_eagle_actor(local_ray, model_dir):
    with pytest.raises(ValueError, match="no actor has an EAGLE drafter"):
        RolloutPool(str(model_dir), 1, spare_training=SpareTraining(), **KW)
    with pytest.raises(ValueError, match="spare_training is a dict"):
        RolloutPool(str(model_dir), 1, spare_training={"seconds": 1}, **KW)


def test_no_spare_actor_no_training(local_ray, model_dir, reference):
    cfg = SpareTraining(seconds=600, max_steps=2, min_rollouts=1, train=TRAIN)
    solo = RolloutPool(str(model_dir), 1, seed=3, speculative_config=EAGLE, spare_training=cfg,
                       **KW)
    try:
        for n in (4, 2):  # harvested plenty, but the only actor is never idle while others run
            prompts, params = long_and_short(n)
            params[0].max_tokens = 20
            assert tokens(solo.generate(prompts, params)) == \
                tokens(reference.generate(prompts, params, use_tqdm=False))
        st = solo.get_metrics()["spare_training"]
        assert st["train_rounds"] == 0 and st["drafter_version"] == 0
        assert st["harvested_total"] == 1 + 4 + 1 + 2
    finally:
        solo.shutdown()
