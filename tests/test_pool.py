"""``specengine.distributed`` on a local Ray (2 actors x 1 CPU, tiny random models): pool outputs
equal one engine's (order, seeds, request ids), placement keeps identical prompts together and
balances predicted work, weight updates reach every actor from one object-store copy and equal a
fresh engine, a weight update refused by one actor is applied nowhere, a killed actor's requests
are re-run elsewhere with the same samples, a poison request (one whose engine step ends the actor
process) is retried once and then fails alone, and OpenRLHF's rollout-actor calls replayed against
``OpenRLHFRolloutActor`` (gloo broadcast) give what a fresh engine with the broadcast weights
gives. Faults are injected into the actors from the test with Ray's ``__ray_call__`` (a closure
run on the actor instance); the package has no fault flags."""

import socket
import threading
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")

from specengine import LLM, SamplingParams  # noqa: E402
from specengine.distributed import PoolController, RolloutPool, remote_actor  # noqa: E402
from specengine.distributed.balance import WorkModel, assign, group_requests  # noqa: E402
from specengine.distributed.collective import WeightGroup  # noqa: E402
from specengine.distributed.pool import RequestFailedError  # noqa: E402
from specengine.distributed.requests import SeedSource, prepare  # noqa: E402
from specengine.models.loader import (  # noqa: E402
    iter_safetensors,
    safetensors_files,
    save_random_model,
)

KW = {"dtype": "float32", "block_size": 8, "kv_cache_memory_bytes": 8 << 20}
# auto without its loss guard, so that these short runs speculate (tests/test_guard.py)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "policy_max_loss": None}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    return (save_random_model(root / "a", {"num_hidden_layers": 2}, seed=1),
            save_random_model(root / "b", {"num_hidden_layers": 2}, seed=2))


@pytest.fixture(scope="module")
def sds(dirs):
    return tuple(dict(iter_safetensors(safetensors_files(d))) for d in dirs)


@pytest.fixture(scope="module")
def pool(local_ray, dirs):
    """Actor 0 decodes plainly, actor 1 with n-gram speculation (outputs are the same)."""
    p = RolloutPool(str(dirs[0]), 2, seed=3, speculative_config=[None, NGRAM], **KW)
    yield p
    p.shutdown()


def samples(outs):
    return [[(c.token_ids, c.finish_reason, None if c.logprobs is None else
              [{t: round(lp.logprob, 5) for t, lp in d.items()} for d in c.logprobs])
             for c in o.outputs] for o in outs]


class Recorder(PoolController):
    def __init__(self):
        self.dispatched = {}

    def on_dispatch(self, pool, actor_id, indices):
        self.dispatched.setdefault(actor_id, []).extend(indices)


PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], {"prompt_token_ids": [42] * 7}, [5, 6, 7, 8, 9],
           [1, 2, 3, 4], [100, 200, 300], [9, 8, 7, 6, 5, 4, 3], [300, 301]]


def test_balance_groups_identical_prompts_longest_first():
    seeds = SeedSource(0)
    reqs = prepare([[1, 2], [3], [1, 2], [4, 5, 6]],
                   [SamplingParams(max_tokens=m) for m in (10, 50, 10, 30)], seeds)
    groups = group_requests(reqs)
    assert [[r.index for r in g] for g in groups] == [[0, 2], [1], [3]]
    model = WorkModel()
    assert [model.work(g) for g in groups] == [2 + 20, 1 + 50, 3 + 30]
    plan = assign(groups, [0, 1], model)
    assert {a: [r.index for r in rs] for a, rs in plan.items()} == {0: [1], 1: [0, 2, 3]}
    model.num_samples, model.num_tokens = 4, 20  # outputs seen so far: 5 tokens each
    assert model.work(groups[1]) == 1 + 5
    with pytest.raises(ValueError, match="no actors"):
        assign(groups, [], model)


def test_bad_speculative_config_is_refused_before_any_actor_starts():
    with pytest.raises(ValueError, match="actor 1: speculative_config method='eagel'"):
        RolloutPool("unused", num_actors=2, speculative_config=[None, {"method": "eagel"}])


def test_seed_source_draws_what_the_engine_draws(dirs):
    llm = LLM(str(dirs[0]), seed=11, **KW)
    reqs = prepare([[1, 2, 3]] * 3, SamplingParams(max_tokens=4), SeedSource(11))
    drawn = [int(torch.randint(0, 2**62, (1,), generator=llm.engine.seed_rng))
             for _ in range(3)]
    assert [r.params.seed for r in reqs] == drawn
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        prepare([[1]] * 3, [SamplingParams()] * 2, SeedSource(0))


def test_pool_outputs_equal_one_engine(pool, dirs):
    ref = LLM(str(dirs[0]), seed=3, **KW)
    ref.engine.seed_rng.set_state(pool.seeds.state())  # earlier tests may have drawn seeds
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = [SamplingParams(temperature=1.0, max_tokens=6 + 3 * i, n=1 + i % 3, logprobs=1,
                             seed=None if i % 2 else 100 + i) for i in range(len(PROMPTS))]
    rec = pool.controller = Recorder()
    runs = []
    try:
        for params in (greedy, seeded, seeded):  # the third call draws new seeds
            first = pool._next_id
            got = pool.generate(PROMPTS, params)
            want = ref.generate(PROMPTS, params, use_tqdm=False)
            assert samples(got) == samples(want)
            assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
            assert [o.request_id for o in got] == [str(first + i) for i in range(len(PROMPTS))]
            runs.append(samples(got))
    finally:
        pool.controller = PoolController()
    assert runs[1][0] == runs[2][0] and runs[1][1] != runs[2][1]  # seed 100 / drawn seeds
    # identical prompts stay on one actor; both actors got work
    assert set(rec.dispatched) == {0, 1}
    where = {i: a for a, idx in rec.dispatched.items() for i in idx}
    for i, j in ((0, 3), (1, 5)):
        assert where[i] == where[j]
    assert [ray.get(a.info.remote())["num_threads"] for a in pool.actors.values()] == [1, 1]
    metrics = pool.get_metrics()["actors"]
    assert metrics[0]["requests"] > 0 and metrics[1]["spec_steps"] > 0  # n-gram on actor 1
    assert metrics[0]["spec_steps"] == 0 and "policy" not in metrics[0]


def test_bad_input_draws_no_seed(pool):
    state = pool.seeds.state()
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        pool.generate([[1, 2]] * 3, [SamplingParams()] * 2)
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        pool.generate([[1, 2], []])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pool.generate([[1, 2], [10**6]])
    assert torch.equal(pool.seeds.state(), state)


def test_weight_updates_broadcast_once(pool, dirs, sds, monkeypatch):
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda obj, **kw: puts.append(obj) or real_put(obj, **kw))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    versions = [m["weight_version"] for m in pool.get_metrics()["actors"].values()]

    pool.update_weights((k, torch.nn.Parameter(v)) for k, v in sds[1].items())  # a trainer's
    assert len(puts) == 1
    seen = [ray.get(a.received_objects.remote())[-1] for a in pool.actors.values()]
    assert len(set(seen)) == 1  # both actors fetched the same stored object
    want_b = samples(LLM(str(dirs[1]), **KW).generate(PROMPTS, greedy, use_tqdm=False))
    assert samples(pool.generate(PROMPTS, greedy)) == want_b

    pool.begin_weight_update()  # streamed back to model a, two chunks
    names = sorted(sds[0])
    pool.load_weights({k: sds[0][k] for k in names[:5]})
    pool.load_weights([(k, sds[0][k]) for k in names[5:]])
    assert samples(pool.generate(PROMPTS, greedy)) == want_b  # old weights until finish
    pool.finish_weight_update()
    assert len(puts) == 3
    want_a = samples(LLM(str(dirs[0]), **KW).generate(PROMPTS, greedy, use_tqdm=False))
    assert samples(pool.generate(PROMPTS, greedy)) == want_a
    assert [m["weight_version"] for m in pool.get_metrics()["actors"].values()] == \
        [v + 2 for v in versions]

    released = pool.sleep(1)
    assert len(released) == 2 and all(r["total"] > 0 for r in released)
    pool.wake_up()
    assert pool.reset_prefix_cache()
    assert samples(pool.generate(PROMPTS, greedy)) == want_a


def on_actors(pool, fn, *args, actors=None):
    """Run ``fn(worker, *args)`` on each actor (all by default) and return the results. ``fn``
    must be a closure (defined in a function: cloudpickle sends it by value; a module-level
    function of this test file could not be imported on the actor)."""
    ids = list(pool.alive) if actors is None else actors
    return ray.get([pool.actors[a].__ray_call__.remote(fn, *args) for a in ids])


def fault_hooks():
    """Closures that change an actor's ``LLM`` for a test (run with ``on_actors``)."""

    def refuse(worker, method, exc_name):  # the actor's LLM.<method> raises
        import builtins

        def fail(*a, **k):
            raise getattr(builtins, exc_name)(f"injected {method} failure")

        setattr(worker.llm, method, fail)

    def restore(worker, method):
        worker.llm.__dict__.pop(method, None)

    def crash_on(worker, marker, delay):  # the process ends at a step holding ``marker``
        import os
        import time

        step = worker.llm.step

        def step_or_crash():
            if any(r.prompt_token_ids == marker for r in worker.llm.engine.requests.values()):
                os._exit(1)  # as a segfault or the OOM killer would end it
            time.sleep(delay)  # slow steps: other requests are still in flight then
            return step()

        worker.llm.step = step_or_crash

    return refuse, restore, crash_on


def versions(pool):
    """Each live actor's weight version."""
    return ray.get([pool.actors[a].weight_version.remote() for a in pool.alive])


def test_weight_broadcast_is_all_or_nothing(pool, dirs, sds):
    """One actor refusing (staging, a streamed chunk, or applying on every actor) leaves every
    actor on the old weights and weight version, generating what it generated before; then the
    same update goes through. The pool serves model a before and after."""
    refuse, restore, _ = fault_hooks()
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    before, v0 = samples(pool.generate(PROMPTS, greedy)), versions(pool)
    assert len(set(v0)) == 1
    names = sorted(sds[1])

    on_actors(pool, refuse, "load_weights", "ValueError", actors=[1])
    try:
        with pytest.raises(ValueError, match=r"update_weights failed on actor 1: ValueError: "
                           r"injected load_weights failure; the update was aborted on every "
                           rf"actor: nothing was applied, the 2 live actors keep their weights "
                           rf"\(weight_version {v0[0]}\)"):
            pool.update_weights(sds[1])
        assert versions(pool) == v0 and samples(pool.generate(PROMPTS, greedy)) == before
        # streamed: a chunk refused by actor 1 aborts the session on actor 0 too
        pool.begin_weight_update()
        with pytest.raises(ValueError, match="load_weights failed on actor 1.*nothing was "
                                             "applied"):
            pool.load_weights({k: sds[1][k] for k in names[:5]})
        with pytest.raises(RuntimeError, match="no weight update session is open"):
            pool.finish_weight_update()
        assert not any(on_actors(pool, lambda w: w.llm.weights.in_session))
        assert versions(pool) == v0 and samples(pool.generate(PROMPTS, greedy)) == before
    finally:
        on_actors(pool, restore, "load_weights", actors=[1])

    # applying fails on every actor: aborted everywhere, nothing applied
    on_actors(pool, refuse, "finish_weight_update", "RuntimeError")
    try:
        with pytest.raises(RuntimeError, match="update_weights failed on actor 0: RuntimeError: "
                                               "injected finish.*nothing was applied"):
            pool.update_weights(sds[1])
    finally:
        on_actors(pool, restore, "finish_weight_update")
    assert not any(on_actors(pool, lambda w: w.llm.weights.in_session))
    assert versions(pool) == v0 and samples(pool.generate(PROMPTS, greedy)) == before

    # an actor with requests in flight refuses to stage: nothing applied
    on_actors(pool, lambda w: w.llm.add_request([1, 2, 3], SamplingParams(max_tokens=2),
                                                request_id="held"), actors=[0])
    try:
        with pytest.raises(RuntimeError, match="failed on actor 0: RuntimeError: requests are "
                                               "in flight.*nothing was applied"):
            pool.update_weights(sds[1])
    finally:
        on_actors(pool, lambda w: w.llm.abort_request("held"), actors=[0])
    assert versions(pool) == v0

    pool.update_weights(sds[1])  # nothing is left over: the same update now goes through
    assert versions(pool) == [v0[0] + 1] * 2
    want_b = samples(LLM(str(dirs[1]), **KW).generate(PROMPTS, greedy, use_tqdm=False))
    assert samples(pool.generate(PROMPTS, greedy)) == want_b
    pool.load_weights(str(dirs[0]))  # a checkpoint with no session: one update, back to a
    assert versions(pool) == [v0[0] + 2] * 2
    assert samples(pool.generate(PROMPTS, greedy)) == before


def vllm_params(**kw):
    """Stands in for ``vllm.SamplingParams`` as OpenRLHF's trainer builds it (attributes with
    vLLM's names; a SimpleNamespace so the actor can unpickle it)."""
    d = dict(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, min_tokens=0,
             skip_special_tokens=True, logprobs=None, seed=None, ignore_eos=False)
    return SimpleNamespace(**dict(d, **kw))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_openrlhf_replay(local_ray, dirs, sds):
    actor = remote_actor(dict(model=str(dirs[0]), max_model_len=64, **KW), num_cpus=1)
    # what OpenRLHF's trainer does: engines sleep after creation (colocate), then before a
    # rollout: wake weights, set up the group, reset the prefix cache, broadcast each param,
    # wake the rest, generate one call per sample
    ray.get(actor.sleep.remote(1))
    ray.get(actor.wake_up.remote(["weights"]))
    port = free_port()
    joined = actor.init_process_group.remote("127.0.0.1", port, 1, 2, "openrlhf", "gloo", False)
    group = WeightGroup("127.0.0.1", port, 0, 2, "openrlhf")  # the trainer is rank 0
    ray.get(joined)
    assert not torch.distributed.is_initialized()  # the default group is left alone
    ray.get(actor.reset_prefix_cache.remote())
    for name, p in sds[1].items():
        ref = actor.update_weight.remote(name, p.dtype, list(p.shape), False)
        group.broadcast(p.clone(), src=0)
        ray.get(ref)
    ray.get(actor.wake_up.remote())

    prompts = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 7]
    shims = [vllm_params(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True),
             vllm_params(temperature=1.0, max_tokens=9, logprobs=1, seed=7,
                                ignore_eos=True),
             vllm_params(temperature=0, max_tokens=None, ignore_eos=True)]
    calls = [(p, s) for p in prompts for s in shims for _ in range(2)]
    outs = ray.get([actor.generate.remote(p, s) for p, s in calls])  # concurrent calls
    fresh = LLM(str(dirs[1]), max_model_len=64, **KW)
    want = fresh.generate([p for p, _ in calls], [SamplingParams(**{
        k: v for k, v in s.__dict__.items()}) if s.max_tokens else SamplingParams(
        **dict(s.__dict__, max_tokens=64 - len(p))) for p, s in calls], use_tqdm=False)
    assert samples(outs) == samples(want)
    assert len(outs[4].outputs[0].token_ids) == 64 - 5  # max_tokens=None: up to the context
    assert outs[0].outputs[0].logprobs[0][outs[0].outputs[0].token_ids[0]].logprob <= 0
    assert {o.weight_version for o in outs} == {1}
    assert ray.get(actor.get_num_unfinished_requests.remote()) == 0
    m = ray.get(actor.get_metrics.remote())  # the concurrent calls shared engine steps
    assert m["requests"] == len(calls) and m["steps"] < m["generated_tokens"] / 2

    # async mode: pause, a request arrives and is held, resume lets it run
    ray.get(actor.pause_generation.remote())
    held = actor.generate.remote(prompts[0], shims[0])
    for _ in range(600):
        if ray.get(actor.get_num_unfinished_requests.remote()) == 1:
            break
        threading.Event().wait(0.05)
    assert ray.get(actor.get_num_unfinished_requests.remote()) == 1
    assert ray.wait([held], timeout=0.2)[0] == []
    ray.get(actor.resume_generation.remote())
    assert samples([ray.get(held)]) == samples(want[:1])
    with pytest.raises(ray.exceptions.RayTaskError, match="use_ray=True"):
        ray.get(actor.init_process_group.remote("127.0.0.1", port, 1, 2, "g", "gloo", True))
    ray.kill(actor)


class KillFirst(PoolController):
    """Kills the actor of the first finished request while it still has work."""

    def __init__(self):
        self.killed, self.reruns = None, []

    def on_output(self, pool, actor_id, index, num_left):
        if self.killed is None and num_left > 0:
            self.killed = actor_id
            ray.kill(pool.actors[actor_id], no_restart=True)

    def on_actor_dead(self, pool, actor_id, error, rerun):
        self.reruns.append((actor_id, rerun))


def test_killed_actor_loses_nothing(pool, dirs):
    """Last in the module: it kills the pool's actors. The pool serves model a (as built, and
    as the weight test leaves it)."""
    ctl = pool.controller = KillFirst()
    ref = LLM(str(dirs[0]), **KW)
    ref.engine.seed_rng.set_state(pool.seeds.state())
    prompts = [[7, 8, 9, 10], [11, 12], [13, 14, 15], [16], [17, 18, 19], [20, 21]]
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True)
              for m in (600, 600, 8, 8, 3, 3)]  # the kill lands long before 600 steps
    try:
        got = pool.generate(prompts, params)  # the killed actor's requests run again
        assert samples(got) == samples(ref.generate(prompts, params, use_tqdm=False))
        assert ctl.killed is not None and [a for a, _ in ctl.reruns] == [ctl.killed]
        m = pool.get_metrics()
        assert m["num_actors"] == 1 and m["num_actors_dead"] == 1
        assert m["num_requests_rerun"] == len(ctl.reruns[0][1]) >= 1
        # the re-run requests are the killed actor's unfinished ones, run once more: all
        # outputs came back exactly once (samples equal, in order, one per prompt)
        assert len(got) == len(prompts)
        ray.kill(pool.actors[pool.alive[0]], no_restart=True)
        with pytest.raises(RuntimeError, match="no actor is left"):
            pool.generate(prompts[:2], params[:2])
    finally:
        pool.controller = PoolController()


class Place(PoolController):
    """Places each request on ``where[input index]``; records actor deaths."""

    def __init__(self, where):
        self.where, self.deaths = where, []

    def place(self, pool, groups, actors, model):
        plan = {}
        for g in groups:
            for r in g:
                plan.setdefault(self.where[r.index], []).append(r)
        return plan

    def on_actor_dead(self, pool, actor_id, error, rerun):
        self.deaths.append((actor_id, rerun))


POISON = [13, 13, 13, 13, 13]


def test_poison_request_is_retried_once_then_fails_alone(local_ray, dirs):
    """A request whose engine step ends the actor process kills its actor, is re-placed once,
    kills that actor too and fails alone; every other request (on the first dead actor, and
    in flight on the second) finishes token for token as one engine gives it, and the pool keeps
    serving. With ``max_request_retries=0`` it fails at the first death, returned in its
    place (``return_exceptions``). Its own 4-actor pool (0.2 CPU each, beside the module's pool)."""
    _, _, crash_on = fault_hooks()
    fragile = RolloutPool(str(dirs[0]), 4, seed=5, num_cpus_per_actor=0.2, **KW)
    try:
        on_actors(fragile, crash_on, POISON, 0.01)
        ref = LLM(str(dirs[0]), **KW)
        prompts = [POISON, [21, 22, 23], [24, 25], [26, 27, 28, 29], [30, 31], [32], [33, 34]]
        params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=m, ignore_eos=True,
                                 logprobs=1)
                  for i, m in enumerate((8, 8, 12, 6, 300, 300, 300))]
        # the poison and three victims on actor 0; one long request on each other actor
        ctl = fragile.controller = Place({0: 0, 1: 0, 2: 0, 3: 0, 4: 1, 5: 2, 6: 3})
        with pytest.raises(RequestFailedError) as info:
            fragile.generate(prompts, params)
        err = info.value
        assert list(err.failures) == [0]
        assert "request 0 (input index 0 was on 2 actors that died (actor 0 (" in str(err)
        assert "after 1 re-placement; not retried again" in str(err)
        assert err.outputs[0] is None
        want = ref.generate(prompts[1:], params[1:], use_tqdm=False)
        assert samples(err.outputs[1:]) == samples(want)
        assert [o.request_id for o in err.outputs[1:]] == [str(i) for i in range(1, 7)]
        assert [o.metrics.get("pool_retries", 0) for o in err.outputs[1:]] == [1, 1, 1, 1, 0, 0]
        # actor 0 died with four requests: all re-placed; the poison, re-placed first on the
        # least loaded actor (1), killed it: its long request was re-placed, not failed
        assert ctl.deaths == [(0, [0, 1, 2, 3]), (1, [4])]
        m = fragile.get_metrics()
        assert (m["num_actors"], m["num_actors_dead"]) == (2, 2)
        assert (m["num_requests_rerun"], m["num_requests_failed"]) == (5, 1)

        # the pool keeps serving. No retries now: whatever is on a dying actor fails at once
        # (here the poison alone), returned in its place
        fragile.max_request_retries = 0
        ctl = fragile.controller = Place({0: 2, 1: 3, 2: 3})
        got = fragile.generate([POISON, [40, 41], [42, 43, 44]], params[4:7],
                               return_exceptions=True)
        assert isinstance(got[0], RequestFailedError) and list(got[0].failures) == [0]
        assert str(got[0]).startswith("1 request failed (2 of the call's 3 finished; ")
        assert "request 7 (input index 0 was on 1 actor that died (actor 2 (" in str(got[0])
        assert "after 0 re-placements" in str(got[0])
        assert samples(got[1:]) == samples(ref.generate([[40, 41], [42, 43, 44]], params[5:7],
                                                        use_tqdm=False))
        assert [o.request_id for o in got[1:]] == ["8", "9"]
        assert ctl.deaths == [(2, [])] and fragile.alive == [3]
    finally:
        fragile.shutdown()


def test_weight_apply_failure_on_some_actors_retires_them(local_ray, dirs, sds):
    """Applying failing on one actor after another applied: that actor is retired (killed,
    with a warning), so every actor left serves the new weights. An actor dying while staging
    aborts the update everywhere. Its own 3-actor pool (0.2 CPU each)."""
    refuse, _, _ = fault_hooks()
    spare = RolloutPool(str(dirs[0]), 3, seed=5, num_cpus_per_actor=0.2, **KW)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        before = samples(spare.generate(PROMPTS, greedy))
        ray.kill(spare.actors[2], no_restart=True)
        with pytest.raises(RuntimeError, match=r"update_weights failed on actor 2 \(it died\)"
                                               r": ActorDiedError.*nothing was applied, the 2 "
                                               r"live actors keep their weights "
                                               r"\(weight_version 0\)"):
            spare.update_weights(sds[1])
        assert spare.alive == [0, 1] and versions(spare) == [0, 0]
        assert samples(spare.generate(PROMPTS, greedy)) == before

        on_actors(spare, refuse, "finish_weight_update", "RuntimeError", actors=[1])
        with pytest.warns(RuntimeWarning, match="actor 1 retired: it failed to apply weight "
                                                "version 1 .*the 1 actors left serve weight "
                                                "version 1"):
            spare.update_weights(sds[1])
        assert spare.alive == [0] and versions(spare) == [1]
        assert "retired" in spare.dead[1]
        want_b = samples(LLM(str(dirs[1]), **KW).generate(PROMPTS, greedy, use_tqdm=False))
        assert samples(spare.generate(PROMPTS, greedy)) == want_b
    finally:
        spare.shutdown()


def test_abort_all_returns_what_was_made(local_ray, dirs):
    """``abort_all`` from another thread while ``generate`` runs: every request comes back
    with the tokens, logprobs and versions made so far (``finish_reason="abort"``), each a
    prefix of what an uninterrupted engine samples; nothing is lost: the tokens returned are
    every token the actors generated."""
    import threading
    import time

    # a pool of its own: earlier tests of this module kill the shared pool's actors
    pool = RolloutPool(str(dirs[0]), 2, seed=3, speculative_config=[None, NGRAM], **KW)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=400, ignore_eos=True,
                            logprobs=0)
    prompts = PROMPTS[:4]
    before = sum(m["generated_tokens"] for m in pool.get_metrics()["actors"].values())
    got = {}
    t = threading.Thread(target=lambda: got.update(outs=pool.generate(prompts, params)))
    t.start()
    deadline = time.time() + 60
    while time.time() < deadline:  # let every request make some tokens
        if sum(m["generated_tokens"] for m in pool.get_metrics()["actors"].values()) \
                - before > 40 * len(prompts):
            break
        time.sleep(0.05)
    assert pool.abort_all() == len(prompts)
    t.join(60)
    outs = got["outs"]
    made = sum(m["generated_tokens"] for m in pool.get_metrics()["actors"].values()) - before
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == made
    ref = LLM(str(dirs[0]), seed=3, **KW).generate(prompts, params, use_tqdm=False)
    for o, w in zip(outs, ref):
        (c,), (cw,) = o.outputs, w.outputs
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 400
        assert list(c.token_ids) == list(cw.token_ids[:len(c.token_ids)])
        assert len(c.logprobs) == len(c.weight_versions) == len(c.token_ids)
    assert pool.abort_all() == 0  # no generate running
    pool.shutdown()
