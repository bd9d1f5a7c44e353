"""Isolation: one bad request never fails the others (issue 23, item 1, engine side).

A request that could make a step fail is refused by ``Engine.add_request`` with a ValueError
naming the field (a 400 from the server's routes); a step that still raises because of one
request fails only that request (``StepRecovery.recover_from_failed_step`` and ``isolate``,
``AsyncEngine``), and every other request finishes with the tokens and logprobs (compared with
``==``) a fresh engine gives it alone. Faults are injected with monkeypatches that raise
when a step sees the bad request, in each phase of the step; victims are in flight each time,
and the KV pool returns to all blocks free.
"""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import rand_prompts

from specengine import LLM, SamplingParams
from specengine.async_llm import AsyncEngine, EngineStepError
from specengine.engine.engine import InvalidRequestError

DTYPES = ["bfloat16", "float32"]
BS = 8
VOCAB = 512  # target_dir's


class Injected(RuntimeError):
    """The fault the tests inject."""


def make(path, dtype="float32", spec=None, **kw):
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    if spec is not None:
        spec = {"policy": "static", **spec}
    return LLM(str(path), dtype=dtype, block_size=BS, speculative_config=spec, **kw)


def key(out):
    """A request's samples: (token ids, per token the sorted (token, logprob, rank)), and its
    prompt logprobs."""
    def entries(es):
        return None if es is None else tuple(
            None if e is None else tuple(sorted((t, lp.logprob, lp.rank) for t, lp in e.items()))
            for e in es)
    return ([(tuple(c.token_ids), entries(c.logprobs), c.cumulative_logprob, c.finish_reason,
              tuple(c.weight_versions)) for c in out.outputs],
            entries(out.prompt_logprobs))


def victims(max_tokens=24):
    """Prompts and params of the requests that must not notice the bad one: greedy, seeded
    sampling with n=2 and top-p, penalties, and prompt logprobs, all with logprobs."""
    ps = rand_prompts(4, lo=6, hi=30, seed=21)
    sps = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3),
           SamplingParams(temperature=1.0, top_p=0.9, seed=5, n=2, max_tokens=max_tokens,
                          ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.8, seed=6, repetition_penalty=1.3,
                          presence_penalty=0.5, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=1),
           SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                          prompt_logprobs=2)]
    return list(zip(ps, sps))


def alone(path, dtype, reqs, spec=None):
    """Each request alone on a fresh engine: its ``key``."""
    llm = make(path, dtype, spec)
    return [key(llm.generate([p], sp, use_tqdm=False)[0]) for p, sp in reqs]


def at_baseline(engine) -> bool:
    b = engine.blocks
    return (b.allocator.num_free + b.num_evictable == b.num_blocks and not engine.requests
            and not engine.scheduler.has_work())


BAD_PROMPT = [11, 12, 13, 14, 15, 16, 17]


def is_bad(seq) -> bool:
    return seq.prompt_token_ids == BAD_PROMPT


# ---- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,param,match", [
    ({"stop_token_ids": [1000000], "min_tokens": 2, "max_tokens": 4}, "stop_token_ids",
     r"stop_token_ids \[1000000\] are outside the vocabulary \[0, 512\)"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "outside the vocabulary"),
    ({"stop_token_ids": ["7"]}, "stop_token_ids", "outside the vocabulary"),
    ({"logprobs": 1000000}, "logprobs", "logprobs=1000000 is more than the vocabulary size 512"),
    ({"prompt_logprobs": 513}, "prompt_logprobs", "prompt_logprobs=513 is more than"),
    ({"n": 300}, "n", r"n=300 samples can never be scheduled.*max_num_seqs=256"),
    ({"n": 1000000000}, "n", "max_num_seqs"),
])
def test_add_request_refuses_what_would_fail_a_step(target_dir, kw, param, match):
    llm = make(target_dir)
    e = llm.engine
    with pytest.raises(InvalidRequestError, match=match) as info:
        e.add_request([1, 2, 3], SamplingParams(**kw))
    assert isinstance(info.value, ValueError) and info.value.param == param
    assert "request 0" in str(info.value)
    assert not e.requests and not e.scheduler.has_work()
    # at the limits they run
    ok = {"stop_token_ids": [VOCAB - 1], "logprobs": VOCAB, "prompt_logprobs": VOCAB,
          "n": e.config.max_num_seqs}
    if param in ok:
        e.add_request([1, 2, 3], SamplingParams(**{param: ok[param], "max_tokens": 2}))
        while e.has_unfinished():
            e.step()
        assert at_baseline(e)


def test_add_request_refuses_prompts_and_lengths(target_dir):
    per_block = make(target_dir).engine.runner.kv_cache[:, :, 0].numel() * 4
    llm = make(target_dir, kv_cache_memory_bytes=6 * per_block, max_model_len=128)
    e = llm.engine
    assert e.blocks.num_blocks == 6
    cases = [([1, 2.5], {}, "prompt", r"token ids \[2.5\] are not integers"),
             ([1, True], {}, "prompt", "not integers"),
             ([1, 512], {}, "prompt", r"token ids \[512\] are outside the vocabulary"),
             ([], {}, "prompt", "the prompt is empty"),
             ([1] * 128, {}, "prompt", "the prompt has 128 tokens; it must be shorter than "
                                       "max_model_len=128"),
             ([1] * 49, {"max_tokens": 1}, "prompt", "50 tokens .* need 7 KV blocks but the "
                                                    "pool has 6"),
             ([1] * 10, {"max_tokens": 40}, "max_tokens", "50 tokens"),
             ([1, 2], {"stop": "x"}, "stop", "stop strings need a tokenizer")]
    for ids, kw, param, match in cases:
        with pytest.raises(InvalidRequestError, match=match) as info:
            e.add_request(ids, SamplingParams(**kw))
        assert info.value.param == param
    with pytest.raises(InvalidRequestError, match="not SamplingParams"):
        e.add_request([1, 2], {"n": 1})
    assert not e.requests and not e.scheduler.has_work()
    rid = e.add_request([1] * 10, SamplingParams(max_tokens=38))  # 48 tokens: 6 blocks
    with pytest.raises(InvalidRequestError, match="already in use") as info:
        e.add_request([1, 2], SamplingParams(), request_id=rid)
    assert info.value.param == "request_id"
    while e.has_unfinished():
        e.step()
    assert at_baseline(e)


# ---- engine-level recovery -------------------------------------------------------------------
def inject(engine, phase, monkeypatch):
    """Make ``engine``'s steps raise ``Injected`` in ``phase`` whenever the bad request is
    part of the step (after the victims' tokens were appended, for ``append``)."""
    # phase -> (object, method, the sequences of a call's positional arguments)
    where = {"sample": ("sampler", "sample", lambda a: a[1]),
             "forward": ("runner", "run", lambda a: [e.seq for e in a[0]]),
             "append": ("output", "append", lambda a: [a[0]]),
             "draft": ("drafter", "propose", lambda a: a[0])}
    if phase not in where:
        raise AssertionError(phase)
    part, name, seqs_of = where[phase]
    obj = getattr(engine, part)
    real = getattr(obj, name)

    def faulty(*args):
        if any(is_bad(s) for s in seqs_of(args)):
            raise Injected(f"injected in {name}")
        return real(*args)
    monkeypatch.setattr(obj, name, faulty)


def drive(engine, outs, max_steps=10_000):
    """Step ``engine`` until idle, collecting outputs by request id."""
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        for o in engine.step():
            outs[o.request_id] = o
    raise AssertionError("the engine did not drain")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("phase,spec", [
    ("sample", None), ("forward", None), ("append", None),
    ("draft", {"method": "ngram", "num_speculative_tokens": 3}),
    ("sample", {"method": ["suffix", "eagle"], "model": "random", "num_speculative_tokens": 3,
                "topk": 2, "num_verify_tokens": 6}),
])
def test_engine_recovers_and_isolates_the_failing_request(target_dir, dtype, phase, spec,
                                                         monkeypatch):
    reqs = victims()
    want = alone(target_dir, dtype, reqs, spec)
    llm = make(target_dir, dtype, spec)
    e = llm.engine
    outs = {}
    rids = [e.add_request(p, sp) for p, sp in reqs]
    for _ in range(4):  # the victims are mid-generation (decoding, drafting) when it fails
        for o in e.step():
            outs[o.request_id] = o
    bad_sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    bad = e.add_request(BAD_PROMPT, bad_sp)
    if phase == "draft":  # the bad request must reach a decode step first
        for o in e.step():
            outs[o.request_id] = o
    inject(e, phase, monkeypatch)
    with pytest.raises(Injected):
        e.step()
    suspects = e.recovery.recover_from_failed_step()
    assert suspects[0] == bad and set(suspects) == set(rids) | {bad}
    assert not e.scheduler.running
    # the most suspect request alone: it fails again, so it is the culprit
    e.recovery.isolate(bad)
    assert {g[0].request_id for g in e.scheduler.waiting} == {bad}
    assert {g[0].request_id for g in e.held} == set(rids)
    with pytest.raises(Injected):
        drive(e, outs, max_steps=3)
    e.recovery.recover_from_failed_step()
    assert e.recovery.fail_request(bad) and not e.recovery.fail_request(bad)
    e.recovery.end_isolation()
    assert e.held is None
    drive(e, outs)
    assert bad not in outs
    assert [key(outs[r]) for r in rids] == want
    assert at_baseline(e)
    monkeypatch.undo()  # the engine serves on, exactly
    assert key(llm.generate([reqs[0][0]], reqs[0][1], use_tqdm=False)[0]) == want[0]


def test_recovery_trims_a_half_appended_token(target_dir, monkeypatch):
    """A step that fails inside one sample's append (its weight version recorded, the token
    not appended): recovery cuts the sample's records back to complete tokens."""
    reqs = victims()
    want = alone(target_dir, "float32", reqs)
    e = make(target_dir).engine
    rids = [e.add_request(p, sp) for p, sp in reqs]
    outs = {}
    for _ in range(3):
        for o in e.step():
            outs[o.request_id] = o
    real = e.output.append

    def append(seq, token, logprobs):
        if seq.request_id == rids[1] and seq.index == 1:
            raise Injected("half appended")
        return real(seq, token, logprobs)
    monkeypatch.setattr(e.output, "append", append)
    with pytest.raises(Injected):
        e.step()
    seq = e.requests[rids[1]].seqs[1]
    assert len(seq.weight_versions) == seq.num_output_tokens + 1
    e.recovery.recover_from_failed_step()
    for r in rids:
        for s in e.requests[r].seqs:
            assert len(s.weight_versions) == len(s.logprobs) == s.num_output_tokens
    monkeypatch.undo()
    drive(e, outs)
    assert [key(outs[r]) for r in rids] == want
    assert at_baseline(e)


def test_a_probe_that_passes_changes_nothing(target_dir):
    """Isolating a request that does not fail, then resuming, leaves every output exact."""
    reqs = victims()
    want = alone(target_dir, "float32", reqs)
    e = make(target_dir).engine
    rids = [e.add_request(p, sp) for p, sp in reqs]
    outs = {}
    for _ in range(3):
        for o in e.step():
            outs[o.request_id] = o
    with pytest.raises(ValueError, match="4 sequences of other requests are running"):
        e.recovery.isolate(rids[0])
    for rid in reversed(rids):
        e.recovery.recover_from_failed_step()  # also fine after a step that did not fail
        e.recovery.isolate(rid)
        with pytest.raises(ValueError, match="already isolating"):
            e.recovery.isolate(rid)
        for _ in range(2):
            for o in e.step():
                outs[o.request_id] = o
        assert {s.request_id for s in e.scheduler.running} == {rid}
        e.recovery.end_isolation()
    drive(e, outs)
    assert [key(outs[r]) for r in rids] == want
    assert at_baseline(e)


# ---- AsyncEngine ------------------------------------------------------------------------------
def serve(llm, submissions, after=None):
    """Run ``AsyncEngine(llm)``; ``submissions`` is a list of (prompt, params), submitted at
    once; returns per submission its ``RequestOutput`` or the exception its handle raised,
    and the engine's stats. ``after``: more submissions once those are done."""
    eng = AsyncEngine(llm)
    eng.start()

    async def main(batch):
        handles = [eng.submit(p, sp) for p, sp in batch]
        return await asyncio.gather(*(h.result() for h in handles), return_exceptions=True)

    try:
        results = asyncio.run(main(submissions))
        later = asyncio.run(main(after)) if after else []
    finally:
        eng.shutdown()
    return results, later, eng.stats


@pytest.mark.parametrize("dtype", DTYPES)
def test_async_engine_fails_only_the_request_that_fails_a_step(target_dir, dtype,
                                                               monkeypatch):
    reqs = victims()
    want = alone(target_dir, dtype, reqs)
    llm = make(target_dir, dtype)
    inject(llm.engine, "sample", monkeypatch)
    bad = (BAD_PROMPT, SamplingParams(temperature=0, max_tokens=10))
    # the victims first, the bad one last, then one more victim after it
    results, later, stats = serve(llm, reqs[:3] + [bad] + reqs[3:], after=reqs[:1])
    err = results[3]
    assert isinstance(err, EngineStepError) and isinstance(err.__cause__, Injected)
    assert "engine step failed on this request" in str(err)
    assert [key(r) for r in results[:3] + results[4:]] == want
    assert key(later[0]) == want[0]  # and it serves on
    assert stats.requests_failed == stats.requests_failed_in_step == 1
    assert stats.step_failures >= 2 and stats.unexplained_step_failures == 0
    assert stats.requests_finished == len(reqs) + 1
    assert at_baseline(llm.engine)


def test_async_engine_refuses_bad_requests_as_400s_beside_victims(target_dir):
    """What the routes do not check themselves still comes back from the handle as the
    engine's ``InvalidRequestError`` (the routes answer 400 naming it), the victims unchanged."""
    from specengine.server.state import as_api_error

    reqs = victims()
    want = alone(target_dir, "float32", reqs)
    llm = make(target_dir)
    bads = [SamplingParams(stop_token_ids=[1000000], min_tokens=2, max_tokens=4),
            SamplingParams(logprobs=1000000), SamplingParams(prompt_logprobs=1000000),
            SamplingParams(n=300)]
    subs = [x for pair in zip(reqs, [(BAD_PROMPT, b) for b in bads]) for x in pair]
    results, _, stats = serve(llm, subs)
    for err, field in zip(results[1::2], ["stop_token_ids", "logprobs", "prompt_logprobs", "n"]):
        assert isinstance(err, InvalidRequestError) and err.param == field
        api = as_api_error(err)
        assert api.status == 400 and api.type == "invalid_request_error" and field in api.message
    assert [key(r) for r in results[0::2]] == want
    assert stats.requests_failed == len(bads) and stats.step_failures == 0
    assert at_baseline(llm.engine)


def test_async_engine_probes_newer_requests_before_finding_an_older_culprit(target_dir,
                                                                             monkeypatch):
    """The bad request was added first and fails only at its 4th token: the newer requests
    are probed alone first (they pass), then it."""
    reqs = victims()
    want = alone(target_dir, "float32", reqs)
    llm = make(target_dir)
    real = llm.engine.sampler.sample

    def sample(logits, seqs):
        if any(is_bad(s) and s.num_output_tokens >= 3 for s in seqs):
            raise Injected("injected at the 4th token")
        return real(logits, seqs)
    monkeypatch.setattr(llm.engine.sampler, "sample", sample)
    bad = (BAD_PROMPT, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    results, _, stats = serve(llm, [bad] + reqs)
    assert isinstance(results[0], EngineStepError)
    assert [key(r) for r in results[1:]] == want
    assert stats.requests_failed_in_step == 1 and stats.probe_steps >= 2 * len(reqs) + 1
    assert at_baseline(llm.engine)


def test_async_engine_rides_out_a_transient_failure(target_dir, monkeypatch):
    """A step fails once for no request's fault: no request fails alone, every one finishes
    exactly; a failure that needs several requests together, twice in a row, fails the
    requests in flight (nothing else can make progress) and the engine serves on."""
    reqs = victims()
    want = alone(target_dir, "float32", reqs)
    llm = make(target_dir)
    real = llm.engine.sampler.sample
    calls = {"n": 0}

    def once(logits, seqs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise Injected("transient")
        return real(logits, seqs)
    monkeypatch.setattr(llm.engine.sampler, "sample", once)
    results, _, stats = serve(llm, reqs)
    assert [key(r) for r in results] == want
    assert stats.step_failures == 1 and stats.unexplained_step_failures == 1
    assert stats.requests_failed == 0
    assert at_baseline(llm.engine)

    def together(logits, seqs):
        if len({s.request_id for s in seqs}) > 1:
            raise Injected("only together")
        return real(logits, seqs)
    monkeypatch.setattr(llm.engine.sampler, "sample", together)
    results, later, stats = serve(llm, reqs, after=reqs[:1])
    assert all(isinstance(r, RuntimeError) and "only together" in str(r) for r in results)
    assert stats.unexplained_step_failures == 2 and stats.requests_failed == len(reqs)
    assert key(later[0]) == want[0]
    assert at_baseline(llm.engine)


@pytest.mark.parametrize("when", ["before", "after"])
def test_async_engine_survives_a_failure_inside_one_append(target_dir, monkeypatch, when):
    """A step fails once while appending one victim's token (before it is appended: its
    weight version is recorded already; or after: the stop check's answer is lost): nobody
    is to blame, and every victim's tokens, logprobs, cumulative logprob and weight versions
    are exact."""
    reqs = victims()
    want = alone(target_dir, "float32", reqs)
    llm = make(target_dir)
    real = llm.engine.output.append
    calls = {"n": 0}

    def append(seq, token, logprobs):
        if seq.request_id == "srv-1" and seq.index == 1 and seq.num_output_tokens == 5:
            calls["n"] += 1
            if calls["n"] == 1:
                if when == "after":
                    real(seq, token, logprobs)
                raise Injected("once, in the middle of a step's appends")
        return real(seq, token, logprobs)
    monkeypatch.setattr(llm.engine.output, "append", append)
    results, _, stats = serve(llm, reqs)
    assert calls["n"] >= 1
    assert [key(r) for r in results] == want
    assert stats.step_failures == 1 and stats.unexplained_step_failures == 1
    assert stats.requests_failed == 0
    assert at_baseline(llm.engine)


def test_async_engine_rebuilds_outputs_a_failed_step_dropped(target_dir, monkeypatch,
                                                             caplog):
    """A step that fails after finishing requests (building their outputs): the finished
    ones are delivered, rebuilt from their samples."""
    import specengine.engine.engine as engine_mod

    reqs = victims(max_tokens=6)
    want = alone(target_dir, "float32", reqs)
    llm = make(target_dir)
    real = engine_mod.request_output
    calls = {"n": 0}

    def flaky(req, metrics, version):
        calls["n"] += 1
        if calls["n"] == 2:  # the second output of the step that finishes them all
            raise Injected("output")
        return real(req, metrics, version)
    monkeypatch.setattr(engine_mod, "request_output", flaky)
    with caplog.at_level("WARNING", logger="specengine.server"):
        results, _, stats = serve(llm, reqs)
    assert [key(r) for r in results] == want
    assert stats.step_failures == 1 and stats.requests_failed == 0
    assert stats.unexplained_step_failures == 0  # nothing was left in flight to blame
    assert "output rebuilt after the failed step" in caplog.text
    assert at_baseline(llm.engine)


# ---- through the server ------------------------------------------------------------------------
requests = pytest.importorskip("requests")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_server import Server  # noqa: E402

from specengine.server.app import build_app  # noqa: E402
from specengine.server.protocol import trl_logprobs  # noqa: E402

MAX_LEN = 256
VICTIM_TOKENS = 120


def make_tok_llm(path, dtype):
    return LLM(str(path), dtype=dtype, kv_cache_memory_bytes=16 << 20, max_model_len=MAX_LEN)


@pytest.fixture(scope="module", params=DTYPES)
def served(request, tiny_llama_tok_dir):
    """(dtype, the served LLM, a fresh reference LLM, the server)."""
    llm = make_tok_llm(tiny_llama_tok_dir, request.param)
    ref = make_tok_llm(tiny_llama_tok_dir, request.param)
    with Server(build_app(llm, "tiny")) as s:
        yield request.param, llm, ref, s


def post(server, route, body):
    return requests.post(f"{server.url}{route}", json=body, timeout=120)


def metrics(server) -> dict:
    return requests.get(f"{server.url}/metrics", timeout=30).json()


VICTIM_BODIES = [
    {"prompts": ["The victim's long story"], "n": 2, "temperature": 1.0, "top_p": 0.95,
     "max_tokens": VICTIM_TOKENS, "logprobs": 2,
     "generation_kwargs": {"seed": 3, "ignore_eos": True}},
    {"prompts": [[5, 6, 7, 8, 9, 10]], "temperature": 0.0, "max_tokens": VICTIM_TOKENS // 2,
     "logprobs": 1, "generation_kwargs": {"ignore_eos": True}},
]


def trl_reference(ref, body):
    """What ``/generate/`` answers for ``body`` on a fresh engine, alone."""
    sp = SamplingParams(n=body.get("n", 1), temperature=body["temperature"],
                        top_p=body.get("top_p", 1.0), max_tokens=body["max_tokens"],
                        logprobs=body["logprobs"], **body["generation_kwargs"])
    tok = ref.get_tokenizer()
    p = body["prompts"][0]
    out = ref.generate([tok(p).input_ids if isinstance(p, str) else p], sp, use_tqdm=False)[0]
    lps, ids = trl_logprobs(out.outputs)
    return {"prompt_ids": [out.prompt_token_ids],
            "completion_ids": [o.token_ids for o in out.outputs],
            "logprobs": lps, "logprob_token_ids": ids}


def with_victims(served, bad_calls, slow=0.01):
    """Start the victims (``/generate/``), send each of ``bad_calls`` (``(route, body)``)
    once they are mid-generation, and return the victims' and the bad calls' responses."""
    _, llm, _, server = served
    e = llm.engine
    step = e.step

    def slow_step():  # the victims last long enough for the bad calls to meet them
        time.sleep(slow)
        return step()

    e.step = slow_step
    try:
        base = metrics(server)["generated_tokens"]
        with ThreadPoolExecutor(len(VICTIM_BODIES) + len(bad_calls)) as pool:
            vs = [pool.submit(post, server, "/generate/", b) for b in VICTIM_BODIES]
            deadline = time.time() + 30
            while metrics(server)["generated_tokens"] < base + 10:
                assert time.time() < deadline
                time.sleep(0.01)
            bads = [pool.submit(post, server, route, body) for route, body in bad_calls]
            bad_out = [f.result() for f in bads]
            assert not all(f.done() for f in vs)  # the bad calls met victims in flight
            v_out = [f.result() for f in vs]
    finally:
        del e.step
    return v_out, bad_out


def check_victims(served, v_out):
    _, llm, ref, server = served
    for body, r in zip(VICTIM_BODIES, v_out):
        assert r.status_code == 200, r.text
        assert r.json() == trl_reference(ref, body)
    deadline = time.time() + 10
    while True:
        m = metrics(server)
        if m["kv_blocks_free"] == m["kv_blocks_total"] or time.time() > deadline:
            break
        time.sleep(0.05)
    assert m["kv_blocks_free"] == m["kv_blocks_total"]
    return m


BAD_CALLS = [  # (route, body, a pattern the error message must match: the field)
    ("/v1/completions", {"prompt": "x", "min_tokens": 2, "max_tokens": 4,
                         "stop_token_ids": [1000000]}, r"stop_token_ids"),
    ("/generate/", {"prompts": ["x"], "max_tokens": 4,
                    "generation_kwargs": {"stop_token_ids": [1000000], "min_tokens": 2}},
     r"stop_token_ids"),
    ("/generate/", {"prompts": ["x"], "max_tokens": 4, "logprobs": 1000000}, r"\blogprobs"),
    ("/generate/", {"prompts": ["x"], "max_tokens": 4,
                    "generation_kwargs": {"prompt_logprobs": 1000000}}, r"prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "n": 300}, r"\bn=300\b"),
    ("/generate/", {"prompts": ["x"], "max_tokens": 4, "n": 300}, r"\bn=300\b"),
]


def test_server_bad_requests_are_400s_and_victims_run_on(served):
    v_out, bad_out = with_victims(served, [(route, body) for route, body, _ in BAD_CALLS])
    for (route, body, field), r in zip(BAD_CALLS, bad_out):
        assert r.status_code == 400, (route, body, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and re.search(field, err["message"]), err
    m = check_victims(served, v_out)
    assert m["server"]["step_failures"] == 0


def test_server_step_fault_fails_only_that_request(served, monkeypatch):
    dtype, llm, ref, server = served
    tok = llm.get_tokenizer()
    poison = tok("POISON PILL").input_ids
    real = llm.engine.sampler.sample

    def sample(logits, seqs):
        if any(s.prompt_token_ids == poison for s in seqs):
            raise Injected("injected for the poisoned request")
        return real(logits, seqs)
    monkeypatch.setattr(llm.engine.sampler, "sample", sample)
    m0 = metrics(server)["server"]
    v_out, bad_out = with_victims(served, [
        ("/v1/completions", {"prompt": "POISON PILL", "max_tokens": 5}),
        ("/generate/", {"prompts": [poison], "max_tokens": 5})])
    for r in bad_out:
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "internal_server_error"
        assert "engine step failed on this request" in err["message"]
        assert "injected for the poisoned request" in err["message"]
    m = check_victims(served, v_out)["server"]
    assert m["requests_failed_in_step"] - m0["requests_failed_in_step"] == 2
    assert m["step_failures"] > m0["step_failures"]
    assert m["unexplained_step_failures"] == m0["unexplained_step_failures"]
    monkeypatch.undo()
    # the server serves on: a victim again, alone, exactly
    r = post(server, "/generate/", VICTIM_BODIES[1])
    assert r.status_code == 200 and r.json() == trl_reference(ref, VICTIM_BODIES[1])
