"""Speculative decoding in the engine on tiny random models: lossless, KV accounting, metrics."""

import pytest
import torch
from helpers import rand_prompts

from specengine import LLM, SamplingParams
from specengine.models.loader import save_random_model
from specengine.speculative.drafters import draft_model


def make(target_dir, spec=None, **kw):
    """An engine on ``target_dir``; speculation runs every step (static policy) so the tests
    exercise it whatever the cost model would choose."""
    kw.setdefault("kv_cache_memory_bytes", 8 << 20)
    if spec is not None and spec.get("method") in ("ngram", "draft_model", "eagle"):
        spec = {"policy": "static", **spec}
    return LLM(str(target_dir), dtype="float32", block_size=8, speculative_config=spec, **kw)


@pytest.fixture(scope="module")
def plain(target_dir):
    return make(target_dir)


def greedy(n=32, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_self_draft_accepts_everything(target_dir, plain):
    prompts = rand_prompts(3)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(), use_tqdm=False)]
    d = 4
    llm = make(target_dir, {"method": "draft_model", "model": str(target_dir),
                            "num_speculative_tokens": d})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert got == want
    m = llm.get_metrics()
    assert m["acceptance_length"] == d + 1
    assert m["acceptance_rate_per_depth"] == [1.0] * d
    assert m["kv_blocks_free"] == m["kv_blocks_total"]


@pytest.mark.parametrize("topk,budget", [(1, None), (3, 8)])
def test_draft_model_greedy_equals_plain(target_dir, draft_dir, plain, topk, budget):
    prompts = rand_prompts(6, seed=4)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy(), use_tqdm=False)]
    llm = make(target_dir, {"method": "draft_model", "model": str(draft_dir),
                            "num_speculative_tokens": 3, "topk": topk,
                            "num_verify_tokens": budget})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]
    assert got == want
    m = llm.get_metrics()
    assert m["spec_steps"] > 0 and m["drafted_tokens"] > 0
    assert m["kv_blocks_free"] == m["kv_blocks_total"]
    drafter = llm.engine.drafter
    assert drafter.blocks.num_free == drafter.blocks.num_blocks  # draft KV released too


def test_stops_inside_an_accepted_block_match_plain(target_dir, plain):
    prompt = rand_prompts(1, seed=7)[0]
    full = plain.generate([prompt], greedy(40), use_tqdm=False)[0].outputs[0].token_ids
    llm = make(target_dir, {"method": "draft_model", "model": str(target_dir),
                            "num_speculative_tokens": 5})
    for k in range(1, 12):  # every offset inside the first accepted blocks
        tok = full[k]
        for sp in (greedy(40, stop_token_ids=[tok]), greedy(k), greedy(40, stop_token_ids=[tok],
                                                                      min_tokens=k + 1)):
            a = plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
            b = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
            assert (b.token_ids, b.finish_reason, b.stop_reason) == \
                (a.token_ids, a.finish_reason, a.stop_reason)
    assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


def test_logprobs_are_the_targets(target_dir, plain):
    prompt = rand_prompts(1, seed=8)[0]
    sp = greedy(20, logprobs=2)
    a = plain.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    llm = make(target_dir, {"method": "draft_model", "model": str(target_dir),
                            "num_speculative_tokens": 4})
    b = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids and len(b.logprobs) == 20
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys()
        for t in x:
            assert abs(x[t].logprob - y[t].logprob) < 1e-4 and x[t].rank == y[t].rank


def test_sampling_seeds_reproduce_alone_and_in_a_batch(target_dir, draft_dir):
    llm = make(target_dir, {"method": "draft_model", "model": str(draft_dir),
                            "num_speculative_tokens": 3, "topk": 2})
    prompts = rand_prompts(8, seed=9)
    sp = [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=24, ignore_eos=True)
          for i in range(8)]
    batch = llm.generate(prompts, sp, use_tqdm=False)
    for i in (0, 5):
        alone = llm.generate([prompts[i]], sp[i], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
    n8 = llm.generate([prompts[0]], SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=16,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert len({tuple(o.token_ids) for o in n8.outputs}) == 8
    assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


def test_bad_speculative_configs(target_dir, tmp_path):
    for cfg, msg in [({"method": "magic"}, "method"), ({"method": "ngram", "bogus": 1}, "bogus"),
                     ({"method": "ngram", "num_speculative_tokens": -1},
                      "num_speculative_tokens"),
                     ({"method": "ngram", "num_speculative_tokens": 4, "num_verify_tokens": 2},
                      "num_verify_tokens"),
                     ({"method": "draft_model"}, "needs 'model'")]:
        with pytest.raises(ValueError, match=msg):
            make(target_dir, cfg)
    other = save_random_model(tmp_path / "o", {"vocab_size": 256}, seed=3)
    with pytest.raises(ValueError, match="vocab_size"):
        make(target_dir, {"method": "draft_model", "model": str(other)})


def test_request_metrics_count_forwards_and_acceptance(target_dir):
    d = 3
    llm = make(target_dir, {"method": "draft_model", "model": str(target_dir),
                            "num_speculative_tokens": d})
    out = llm.generate([rand_prompts(1, seed=12)[0]],
                       SamplingParams(n=2, temperature=0, max_tokens=17, ignore_eos=True),
                       use_tqdm=False)[0]
    m = out.metrics
    # per sample: 1 prefill forward (1 token) + 4 verify forwards committing 4 tokens each
    assert m["num_generated_tokens"] == 34
    assert m["target_forwards"] == 2 * 5 and m["spec_steps"] == 8
    assert m["accepted_tokens"] == 8 * d and m["acceptance_length"] == d + 1
    assert m["acceptance_rate_per_depth"] == [1.0] * d


def test_sequences_past_the_drafts_context_continue_without_speculation(target_dir, plain,
                                                                         tmp_path):
    short = save_random_model(tmp_path / "short", {"num_hidden_layers": 1,
                                                   "max_position_embeddings": 40}, seed=2)
    prompts = [list(range(1, 31)), list(range(5, 10))]  # 30 and 5 prompt tokens
    sp = greedy(40)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    llm = make(target_dir, {"method": "draft_model", "model": str(short),
                            "num_speculative_tokens": 3})
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[0].metrics["spec_steps"] < 10 <= outs[0].metrics["target_forwards"]
    assert outs[1].metrics["spec_steps"] > 0
    m = llm.get_metrics()
    assert m["kv_blocks_free"] == m["kv_blocks_total"]
    assert llm.engine.drafter.blocks.num_free == llm.engine.drafter.blocks.num_blocks


def test_prompt_one_token_below_max_model_len(target_dir):
    llm = make(target_dir, {"method": "ngram", "num_speculative_tokens": 4}, max_model_len=32)
    out = llm.generate([list(range(1, 32))], greedy(10), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    out = llm.generate([[1, 2, 3, 1, 2, 3, 1, 2]], greedy(100), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 32 - 8 and out.finish_reason == "length"


def test_200_sequential_requests_leave_the_pool_at_baseline(target_dir):
    llm = make(target_dir, {"method": "ngram", "num_speculative_tokens": 3, "topk": 2})
    base = llm.engine.blocks.num_free
    for i in range(200):
        sp = SamplingParams(temperature=0 if i % 2 else 1.0, seed=i, max_tokens=1 + i % 7,
                            ignore_eos=True)
        llm.generate([[1 + i % 50, 2, 3, 1 + i % 50, 2, 3]], sp, use_tqdm=False)
        assert llm.engine.blocks.num_free == base


@pytest.mark.parametrize("spec", [
    {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3, "topk": 2},
    {"method": "draft_model", "model": "SELF", "num_speculative_tokens": 4, "topk": 2,
     "num_verify_tokens": 6},
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 3, "policy": "auto"},
], ids=["draft-tree", "self-draft-tree", "ngram-chain", "draft-auto-policy"])
def test_seeded_sampling_equals_plain_sampling_token_for_token(target_dir, draft_dir, plain,
                                                                spec):
    """The sampling noise is keyed by output position, so speculation (any drafter, tree or
    policy; drafting coupled to that noise, which the self-draft accepts almost always)
    commits exactly the tokens plain sampling draws with the same seed."""
    if "model" in spec:
        spec = {**spec, "model": str(draft_dir if spec["model"] == "DRAFT" else target_dir)}
    llm = make(target_dir, spec)
    prompts = rand_prompts(8, seed=21)
    sp = [SamplingParams(temperature=t, top_p=tp, top_k=k, seed=i, max_tokens=24,
                         ignore_eos=True)
          for i, (t, tp, k) in enumerate([(1.0, 1.0, 0), (0.7, 0.9, 0), (1.0, 1.0, 5),
                                          (0.0, 1.0, 0), (1.3, 0.8, 20), (0.6, 1.0, 0),
                                          (1.0, 0.9, 0), (1.0, 0.95, 40)])]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want
    assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


def test_coupled_self_draft_accepts_almost_everything_at_t1(target_dir, monkeypatch):
    """Drafting with the sampling noise (``drafters.coupling``): a draft equal to the
    target proposes the very tokens the target samples, so tau is about d + 1 at T=1 (with
    top-p / top-k too); the same drafter ranking by its plain top-k gets far less, with the
    same (lossless) output."""
    d = 4
    prompts = rand_prompts(6, seed=31)
    sp = [SamplingParams(temperature=1.0, top_p=tp, top_k=k, seed=i, max_tokens=1 + 5 * 8,
                         ignore_eos=True)  # 8 full verify steps of d + 1 tokens
          for i, (tp, k) in enumerate([(1.0, 0), (0.9, 0), (1.0, 20), (0.8, 50), (1.0, 0),
                                       (0.95, 0)])]

    def run():
        llm = make(target_dir, {"method": "draft_model", "model": str(target_dir),
                                "num_speculative_tokens": d})
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return llm.get_metrics()["acceptance_length"], [o.outputs[0].token_ids for o in outs]

    coupled, want = run()
    def uncoupled(logits, k, *args):
        top = torch.topk(torch.log_softmax(logits, -1), k, dim=-1)
        return top.values, top.indices

    monkeypatch.setattr(draft_model, "coupled_topk", uncoupled)
    uncoupled, got = run()
    print(f"self-draft tau at T=1, d={d}: coupled {coupled:.3f}, uncoupled {uncoupled:.3f}")
    assert coupled >= d + 0.9
    assert uncoupled <= coupled - 1.0
    assert got == want
