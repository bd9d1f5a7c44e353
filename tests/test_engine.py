"""Engine behaviour on tiny random-weight models: exactness, batching, stops, KV accounting."""

import pytest
import torch
from helpers import rand_prompts

from specengine import LLM, SamplingParams
from specengine.models.loader import save_random_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("tiny"), {"num_hidden_layers": 2}, seed=1)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", kv_cache_memory_bytes=8 << 20, block_size=8)


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_equals_transformers_generate(tiny_dir, llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompts = rand_prompts(4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(24), use_tqdm=False)
    for p, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                          min_new_tokens=24, eos_token_id=None, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(p):].tolist()
        assert out.outputs[0].finish_reason == "length"


def test_raw_logprobs_equal_log_softmax_of_transformers_logits(tiny_dir, llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    prompt = rand_prompts(1, seed=3)[0]
    out = llm.generate([prompt], greedy(12, logprobs=3), use_tqdm=False)[0].outputs[0]
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[0].float(), -1)[len(prompt) - 1:-1]
    assert len(out.logprobs) == 12
    total = 0.0
    for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert abs(lp[tok].logprob - ref[j, tok].item()) < 1e-3
        assert lp[tok].rank == 1  # greedy picks the top token
        top3 = torch.topk(ref[j], 3).indices.tolist()
        assert set(top3) <= set(lp)
        total += lp[tok].logprob
    assert abs(out.cumulative_logprob - total) < 1e-4


def test_processed_logprobs_follow_temperature(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8,
              logprobs_mode="processed_logprobs")
    raw = LLM(str(tiny_dir), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    p = SamplingParams(temperature=0.5, seed=3, max_tokens=6, logprobs=0, ignore_eos=True)
    a = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].outputs[0]
    b = raw.generate([[1, 2, 3]], p, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == b.token_ids  # logprobs_mode never changes what is sampled
    assert all(abs(x[t].logprob - y[t].logprob) > 1e-4
               for t, x, y in zip(a.token_ids, a.logprobs, b.logprobs))


def test_batch_invariance_greedy_and_seeded(llm):
    prompts = rand_prompts(16, lo=2, hi=60, seed=5)
    batch = llm.generate(prompts, greedy(20), use_tqdm=False)
    for p, out in zip(prompts[:4] + prompts[-2:], batch[:4] + batch[-2:]):
        alone = llm.generate([p], greedy(20), use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
    sp = [SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=20,
                         ignore_eos=True) for i in range(16)]
    batch = llm.generate(prompts, sp, use_tqdm=False)
    for i in (0, 7, 15):
        alone = llm.generate([prompts[i]], sp[i], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == batch[i].outputs[0].token_ids
    # other seeds give other samples (the seed really is used)
    other = llm.generate([prompts[0]], SamplingParams(temperature=1.0, top_p=0.9, seed=999,
                                                       max_tokens=20, ignore_eos=True),
                         use_tqdm=False)[0]
    assert other.outputs[0].token_ids != batch[0].outputs[0].token_ids


def test_n_samples_share_prompt_blocks(llm):
    eng = llm.engine
    base = eng.blocks.num_free
    prompt = list(range(1, 21))  # 20 tokens -> 3 blocks of 8, the last one partial
    rid = eng.add_request(prompt, SamplingParams(n=8, temperature=1.0, seed=4, max_tokens=10,
                                                 ignore_eos=True))
    eng.step()  # prefill: the 8 samples share the prompt's 3 blocks
    assert base - eng.blocks.num_free == 3
    seqs = eng.requests[rid].seqs
    assert all(s.block_table[:2] == seqs[0].block_table[:2] for s in seqs)
    eng.step()  # first decode: the shared partial block is copied for 7 of the 8 samples
    assert base - eng.blocks.num_free == 3 + 7
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert eng.blocks.num_free == base
    samples = [tuple(o.token_ids) for o in outs[0].outputs]
    assert len(samples) == 8 and len(set(samples)) == 8
    assert [o.index for o in outs[0].outputs] == list(range(8))


def test_preemption_under_tiny_kv_budget_keeps_outputs(tiny_dir, llm):
    prompts = rand_prompts(6, lo=5, hi=20, seed=9)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(30), use_tqdm=False)]
    per_block = llm.engine.runner.kv_cache[:, :, 0].numel() * 4
    small = LLM(str(tiny_dir), dtype="float32", kv_cache_memory_bytes=10 * per_block,
                block_size=8)
    outs = small.generate(prompts, greedy(30), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    m = small.get_metrics()
    assert m["preemptions"] > 0
    assert m["kv_blocks_free"] == m["kv_blocks_total"] == 10
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=30, ignore_eos=True)
    a = llm.generate(prompts, sampled, use_tqdm=False)
    b = small.generate(prompts, sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_kv_blocks_back_to_baseline_after_every_call(llm):
    base = llm.engine.blocks.num_free
    assert base == llm.engine.blocks.num_blocks
    for n, t in [(1, 0.0), (3, 1.0), (2, 0.7)]:
        llm.generate(rand_prompts(5, seed=n), SamplingParams(n=n, temperature=t, max_tokens=9),
                     use_tqdm=False)
        assert llm.engine.blocks.num_free == base


def test_max_tokens_min_tokens_and_stop_token_ids(llm):
    prompt = rand_prompts(1, seed=11)[0]
    full = llm.generate([prompt], greedy(30), use_tqdm=False)[0].outputs[0].token_ids
    assert len(full) == 30
    # stop at the first occurrence of a token that appears mid-way
    k = 12
    tok = full[k]
    first = full.index(tok)
    out = llm.generate([prompt], greedy(30, stop_token_ids=[tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", tok)
    # min_tokens masks the stop token until enough tokens were generated
    out = llm.generate([prompt], greedy(30, stop_token_ids=[tok], min_tokens=first + 2),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert tok not in out.token_ids[:first + 1]
    out = llm.generate([prompt], greedy(7), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:7] and out.finish_reason == "length"


def test_eos_stops_unless_ignore_eos(tmp_path, llm):
    prompt = rand_prompts(1, seed=12)[0]
    full = llm.generate([prompt], greedy(25), use_tqdm=False)[0].outputs[0].token_ids
    eos = full[10]
    d = save_random_model(tmp_path / "m", {"num_hidden_layers": 2, "eos_token_id": eos}, seed=1)
    m = LLM(str(d), dtype="float32", kv_cache_memory_bytes=4 << 20, block_size=8)
    sp = SamplingParams(temperature=0, max_tokens=25)
    out = m.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full[:full.index(eos) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = m.generate([prompt], greedy(25), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full and out.finish_reason == "length"


def test_max_model_len_stops_with_length(tiny_dir):
    m = LLM(str(tiny_dir), dtype="float32", max_model_len=20, kv_cache_memory_bytes=4 << 20)
    out = m.generate([list(range(1, 16))], greedy(50), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    out = m.generate([list(range(1, 20))], greedy(50), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1  # prompt one token below max_model_len
    with pytest.raises(ValueError, match="prompt 0.*20 tokens.*max_model_len=20"):
        m.generate([list(range(1, 21))], greedy(5), use_tqdm=False)


def test_bad_prompts_are_named(llm):
    with pytest.raises(ValueError, match="prompt 1.*empty"):
        llm.generate([[1, 2], []], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0.*outside the vocabulary"):
        llm.generate([[1, 100000]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0.*unknown keys"):
        llm.generate([{"prompt_token_ids": [1], "bogus": 1}], greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([[1, 2]], [greedy(), greedy()], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0 is text but the model has no tokenizer"):
        llm.generate(["hello"], greedy(), use_tqdm=False)
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


def test_metrics_count_tokens_and_steps(tiny_dir):
    m = LLM(str(tiny_dir), dtype="float32", kv_cache_memory_bytes=4 << 20)
    outs = m.generate(rand_prompts(3, seed=2), greedy(8), use_tqdm=False)
    met = m.get_metrics()
    assert met["requests"] == 3 and met["generated_tokens"] == 24
    assert met["steps"] == 8  # all prompts prefilled together, then 7 decode steps
    assert met["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs)
    assert met["prefill_time"] > 0 and met["decode_time"] > 0
    assert outs[0].metrics["num_generated_tokens"] == 8
