"""verl's rollout contract (``specengine.integrations.verl``), replaying the calls and payloads
verl 0.9.1 makes (``/work/shared/rl-frameworks.md`` section 1): the agent loop's ``generate``
per sample (n interleaved copies of each prompt as separate requests, ``sampling_params`` as
verl sends them), the trainer's ``update_weights`` with a generator of float32 full tensors,
``release()`` / ``resume(tags)``, the replica's ``abort_all_requests`` / ``resume_generation``.

When verl imports (its real ``BaseRollout``, ``TokenOutput``, ``RolloutConfig``,
``HFModelConfig``), the configs are verl's own classes and the adapter subclasses verl's;
otherwise the same test runs on plain dicts against the local ``TokenOutput``. Every output is
compared token for token with offline ``LLM.generate`` on an engine of the same weights."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import pytest
import torch

from specengine import LLM, SamplingParams
from specengine.integrations import verl as sv
from specengine.models.loader import iter_safetensors, safetensors_files, save_random_model

PROMPT_LEN, RESPONSE_LEN = 48, 24
TOKEN_OUTPUT_FIELDS = ["token_ids", "log_probs", "routed_experts", "stop_reason",
                       "num_preempted", "extra_fields"]


def rollout_config(bucket_mb: int = 2048, **over):
    """verl's rollout config (``RolloutConfig`` when verl imports, else the same as a dict)."""
    spec = {"kv_cache_memory_bytes": 16 << 20, **over.pop("specengine", {})}
    base = dict(name="specengine", tensor_model_parallel_size=1, prompt_length=PROMPT_LEN,
                response_length=RESPONSE_LEN, dtype="float32", max_num_seqs=64,
                load_format="auto", free_cache_engine=True, engine_kwargs={"specengine": spec})
    base.update(over)
    if sv.VERL_AVAILABLE:
        from verl.workers.config import CheckpointEngineConfig, MtpConfig, RolloutConfig

        if "mtp" in base:
            base["mtp"] = MtpConfig(**base["mtp"])
        return RolloutConfig(**base, checkpoint_engine=CheckpointEngineConfig(
            update_weights_bucket_megabytes=bucket_mb))
    return {**base, "checkpoint_engine": {"update_weights_bucket_megabytes": bucket_mb}}


def model_config(path):
    if sv.VERL_AVAILABLE:
        from verl.workers.config import HFModelConfig

        return HFModelConfig(path=str(path))
    return {"path": str(path)}


@pytest.fixture
def rollouts():
    made = []

    def make(path, **over):
        r = sv.SpecEngineRollout(rollout_config(**over), model_config(path), None)
        made.append(r)
        return r

    yield make
    for r in made:
        r.shutdown()


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory, default_model_dir):
    """Other weights for the same architecture (what the trainer pushes)."""
    return save_random_model(tmp_path_factory.mktemp("verl_new"), {"tie_word_embeddings": True},
                             tokenizer_from=default_model_dir, seed=11)


def offline_llm(path, dtype="float32", **kw) -> LLM:
    return LLM(str(path), dtype=dtype, kv_cache_memory_bytes=16 << 20,
               max_model_len=PROMPT_LEN + RESPONSE_LEN, logprobs_mode="processed_logprobs",
               **kw)


def offline(llm, prompts, **kw):
    params = SamplingParams(**{"temperature": 0, "max_tokens": RESPONSE_LEN,
                               "ignore_eos": True, **kw})
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def prompts(k: int, length: int = 12, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 4000, (length + i,), generator=g).tolist() for i in range(k)]


def fp32_weights(path):
    """A generator of float32 full HF-named tensors, as verl's ``get_per_tensor_param``."""
    for name, t in iter_safetensors(safetensors_files(path)):
        yield name, t.to(torch.float32).clone()


async def agenerate(weights):
    for item in weights:
        await asyncio.sleep(0)
        yield item


def verl_params(**kw) -> dict:
    """``sampling_params`` as verl's agent loop sends them."""
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0,
            "logprobs": True, "max_tokens": RESPONSE_LEN, **kw}


def test_repeated_prompts_batched_with_logprobs(tiny_llama_tok_dir, rollouts):
    r = rollouts(tiny_llama_tok_dir)
    ref = offline_llm(tiny_llama_tok_dir)
    n, ps = 4, prompts(3)
    batch = [p for p in ps for _ in range(n)]  # batch.repeat(n, interleave=True)
    seeds = list(range(100, 100 + len(batch)))
    sent = [verl_params(seed=s, ignore_eos=True) for s in seeds]
    copies = [dict(p) for p in sent]

    async def run():
        return await asyncio.gather(*[r.generate(p, sp, uuid.uuid4().hex)
                                      for p, sp in zip(batch, sent)])

    outs = asyncio.run(run())
    assert sent == copies  # the caller's dicts are not modified
    assert r.engine.stats.max_batch_seqs == len(batch)  # all were batched together
    for p, s, out in zip(batch, seeds, outs):
        (want,) = offline(ref, [p], temperature=1.0, seed=s, logprobs=0)
        assert isinstance(out, sv.TokenOutput)
        assert out.token_ids == want.token_ids and len(out.token_ids) == RESPONSE_LEN
        assert len(out.log_probs) == len(out.token_ids)
        assert out.log_probs == pytest.approx(want.sampled_logprobs, abs=1e-4)
        assert out.stop_reason == "completed" and out.routed_experts is None
        assert out.extra_fields == {"global_steps": None, "weight_version": 0}
    # the n copies of a prompt are separate samples
    assert len({tuple(o.token_ids) for o in outs[:n]}) == n
    # greedy, logprobs off, no max_tokens: verl's default budget; max_new_tokens (SGLang's)
    outs = asyncio.run(run_one(r, ps[0], {"temperature": 0, "logprobs": False,
                                          "ignore_eos": True}))
    assert outs.token_ids == offline(ref, [ps[0]])[0].token_ids and outs.log_probs is None
    out = asyncio.run(run_one(r, ps[0], {"temperature": 0, "max_new_tokens": 5}))
    assert out.token_ids == offline(ref, [ps[0]], max_tokens=5, ignore_eos=False)[0].token_ids


async def run_one(r, p, sp, rid=None):
    return await r.generate(p, sp, rid or uuid.uuid4().hex)


def run_all(r, ps, sp) -> list:
    """Concurrent ``generate`` calls, one per prompt."""
    async def run():
        return await asyncio.gather(*[run_one(r, p, sp) for p in ps])

    return asyncio.run(run())


def test_max_tokens_clamped_to_context(tiny_llama_tok_dir, rollouts):
    r = rollouts(tiny_llama_tok_dir)
    max_len = PROMPT_LEN + RESPONSE_LEN
    long = prompts(1, length=max_len - 3)[0]
    out = asyncio.run(run_one(r, long, {"temperature": 0, "max_tokens": 1000,
                                        "ignore_eos": True}))
    assert len(out.token_ids) == 3  # max_model_len - len(prompt)
    # default: min(response_length, prompt_length + response_length - len(prompt))
    out = asyncio.run(run_one(r, long, {"temperature": 0, "ignore_eos": True}))
    assert len(out.token_ids) == 3
    with pytest.raises(ValueError, match="no room to generate within max_model_len=72"):
        asyncio.run(run_one(r, prompts(1, length=max_len)[0], {"max_tokens": 4}))
    with pytest.raises(ValueError, match="sampling_params: unknown sampling parameter 'beam'"):
        asyncio.run(run_one(r, long, {"beam": 2}))
    with pytest.raises(ValueError, match="multimodal"):
        asyncio.run(r.generate(long, {}, "x", image_data=[object()]))


def test_update_weights_fp32_generator_equals_fresh_engine(tiny_llama_tok_dir, new_dir,
                                                           rollouts):
    """verl's defaults: a bfloat16 engine started with dummy weights; the trainer pushes
    float32 full tensors (cast on load), in 1 MB buckets, sync and async generators."""
    r = rollouts(tiny_llama_tok_dir, dtype="bfloat16", load_format="dummy", bucket_mb=1)
    ps = prompts(4, seed=1)
    greedy = {"temperature": 0, "logprobs": True, "ignore_eos": True}
    loads = []
    real_load = r.llm.load_weights
    r.llm.load_weights = lambda chunk: loads.append(len(chunk)) or real_load(chunk)

    names = asyncio.run(r.update_weights(fp32_weights(new_dir), global_steps=3))
    assert len(loads) > 1 and sum(loads) == len(list(fp32_weights(new_dir)))
    assert len(names) == sum(loads)
    fresh = offline_llm(new_dir, dtype="bfloat16")
    want = offline(fresh, ps, logprobs=0)
    outs = run_all(r, ps, greedy)
    for out, w in zip(outs, want):
        assert out.token_ids == w.token_ids
        assert out.log_probs == pytest.approx(w.sampled_logprobs, abs=1e-3)
        assert out.extra_fields == {"global_steps": 3, "weight_version": 1}
    # an async generator, back to the original weights
    asyncio.run(r.update_weights(agenerate(fp32_weights(tiny_llama_tok_dir)), global_steps=4))
    back = offline(offline_llm(tiny_llama_tok_dir, dtype="bfloat16"), ps)
    outs = run_all(r, ps, greedy)
    assert [o.token_ids for o in outs] == [w.token_ids for w in back] != \
        [w.token_ids for w in want]
    assert outs[0].extra_fields["weight_version"] == 2
    # a bad tensor mid-stream: nothing applied, the old weights keep serving

    def bad():
        for i, (name, t) in enumerate(fp32_weights(new_dir)):
            yield (name, t[:1]) if i == 5 else (name, t)

    with pytest.raises(ValueError, match="has shape"):
        asyncio.run(r.update_weights(bad()))
    outs = run_all(r, ps, greedy)
    assert [o.token_ids for o in outs] == [w.token_ids for w in back]
    assert outs[0].extra_fields["weight_version"] == 2
    with pytest.raises(NotImplementedError, match="wire_format='delta_flush'"):
        asyncio.run(r.update_weights(iter([]), wire_format="delta_flush"))


def test_release_then_resume_hybrid_cycle(tiny_llama_tok_dir, new_dir, rollouts):
    """verl's hybrid step: release (level 2: weights discarded) -> resume(["weights"]) ->
    update_weights -> resume(["kv_cache"]) -> generate."""
    r = rollouts(tiny_llama_tok_dir)
    ps = prompts(3, seed=2)
    greedy = {"temperature": 0, "logprobs": False, "ignore_eos": True}
    gen = lambda: run_all(r, ps, greedy)  # noqa: E731
    before = [o.token_ids for o in gen()]
    released = asyncio.run(r.release())
    assert released["weights"] > 0 and released["kv_cache"] > 0
    with pytest.raises(RuntimeError, match="asleep"):
        gen()
    asyncio.run(r.resume(["weights"]))
    with pytest.raises(RuntimeError, match="asleep"):
        gen()
    asyncio.run(r.update_weights(fp32_weights(new_dir)))
    asyncio.run(r.resume(["kv_cache"]))
    want = offline(offline_llm(new_dir), ps)
    assert [o.token_ids for o in gen()] == [w.token_ids for w in want] != before
    # level 1 (colocated): no push needed, the same outputs after the cycle
    r1 = rollouts(tiny_llama_tok_dir, specengine={"sleep_level": 1})
    gen1 = lambda: run_all(r1, ps, greedy)  # noqa: E731
    asyncio.run(r1.release())
    asyncio.run(r1.resume(["weights"]))
    asyncio.run(r1.resume(["kv_cache"]))
    assert [o.token_ids for o in gen1()] == before
    asyncio.run(r1.sleep())
    asyncio.run(r1.wake_up())  # the replica's calls: everything back, prefix cache reset
    assert [o.token_ids for o in gen1()] == before
    with pytest.raises(ValueError, match="unknown tags"):
        asyncio.run(r1.resume(["gpu"]))
    # free_cache_engine off: release / resume do nothing
    r2 = rollouts(tiny_llama_tok_dir, free_cache_engine=False)
    assert asyncio.run(r2.release()) is None and not r2.llm.memory.is_sleeping


def test_abort_all_requests_then_resume_generation(tiny_llama_tok_dir, rollouts):
    r = rollouts(tiny_llama_tok_dir)
    ref = offline_llm(tiny_llama_tok_dir)
    ps = prompts(3, seed=3)
    long = PROMPT_LEN + RESPONSE_LEN - 16  # room left by the longest prompt (14 tokens)
    sp = {"temperature": 0, "logprobs": True, "ignore_eos": True, "max_tokens": long}

    async def scenario():
        rids = [f"req-{i}" for i in range(len(ps))]
        tasks = [asyncio.ensure_future(r.generate(p, sp, rid)) for p, rid in zip(ps, rids)]
        while r.engine.stats.steps < 4:  # in flight, some tokens out
            await asyncio.sleep(0.001)
        res = await r.abort_all_requests()
        assert res == {"aborted_count": 3, "request_ids": rids}
        aborted = await asyncio.gather(*tasks)
        late = asyncio.ensure_future(r.generate(ps[0], sp, "late"))  # parked while paused
        await asyncio.sleep(0.2)
        assert not late.done()
        await r.resume_generation()
        done = await late
        await r.abort_all_requests(reject_request=True)
        rejected = await r.generate(ps[0], sp, "rejected")
        await r.resume_generation()
        single = asyncio.ensure_future(r.generate(ps[1], sp, "one"))
        while "one" not in r._handles:
            await asyncio.sleep(0.001)
        assert await r.abort_request("one") == {"aborted": True, "request_id": "one"}
        assert await r.abort_request("nope") == {"aborted": False, "request_id": "nope"}
        return aborted, done, rejected, await single

    aborted, done, rejected, single = asyncio.run(scenario())
    want = offline(ref, ps, max_tokens=long)
    for out, w in zip(aborted, want):
        assert out.stop_reason == "aborted"
        assert len(out.token_ids) < long
        assert out.token_ids == w.token_ids[:len(out.token_ids)]
        assert len(out.log_probs) == len(out.token_ids)
    assert sum(len(o.token_ids) for o in aborted) > 0
    assert done.stop_reason == "completed" and done.token_ids == want[0].token_ids
    assert (rejected.stop_reason, rejected.token_ids) == ("aborted", [])
    assert single.stop_reason == "aborted" and single.token_ids == \
        want[1].token_ids[:len(single.token_ids)]
    assert r.engine.engine.blocks.num_free == r.engine.engine.blocks.num_blocks


def test_speculation_reports_counters_and_keeps_outputs(tiny_llama_tok_dir, rollouts):
    r = rollouts(tiny_llama_tok_dir, specengine={
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                               "policy_max_loss": None}})  # speculates from the first step
    ref = offline_llm(tiny_llama_tok_dir)
    p = [7, 8, 9, 10, 11] * 6
    out = asyncio.run(run_one(r, p, {"temperature": 0, "logprobs": True, "ignore_eos": True}))
    want = offline(ref, [p], logprobs=0)[0]
    assert out.token_ids == want.token_ids
    assert out.log_probs == pytest.approx(want.sampled_logprobs, abs=1e-3)
    f = out.extra_fields
    assert f["spec_num_verify_steps"] > 0 and f["spec_num_draft_tokens"] > 0
    assert 0 <= f["spec_num_accepted_tokens"] <= f["spec_num_draft_tokens"]


def test_contract_classes_and_config_errors(tiny_llama_tok_dir):
    if sv.VERL_AVAILABLE:
        from verl.workers.rollout.base import BaseRollout, get_rollout_class
        from verl.workers.rollout.replica import TokenOutput

        assert issubclass(sv.SpecEngineRollout, BaseRollout) and sv.TokenOutput is TokenOutput
        assert list(TokenOutput.model_fields) == TOKEN_OUTPUT_FIELDS
        sv.register()
        assert get_rollout_class("specengine", "async") is sv.SpecEngineRollout
    else:
        assert [f.name for f in dataclasses.fields(sv.TokenOutput)] == TOKEN_OUTPUT_FIELDS
        with pytest.raises(ImportError):
            sv.register()
    cfg, model = rollout_config, model_config(tiny_llama_tok_dir)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        sv.SpecEngineRollout(cfg(tensor_model_parallel_size=2), model)
    with pytest.raises(ValueError, match="MTP drafters are not supported"):
        sv.SpecEngineRollout(cfg(mtp={"enable": True, "enable_rollout": True}), model)
    with pytest.raises(ValueError, match="sleep_level=3 must be 1 or 2"):
        sv.SpecEngineRollout(cfg(specengine={"sleep_level": 3}), model)
    with pytest.raises(ValueError, match="no local_path or path"):
        sv.SpecEngineRollout({"dtype": "float32"}, {})
