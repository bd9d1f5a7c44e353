"""``SamplingParams.return_hidden_states``: per sample, the target's last hidden states that
produced each generated token, equal to a plain forward of prompt + response, with and without
speculation and prefix-cache hits."""

import pytest
import torch
from helpers import rand_prompts

from specengine import LLM, SamplingParams
from specengine.engine.batch import BatchEntry
from specengine.engine.model_runner import ModelRunner
from specengine.engine.sequence import Sequence
from specengine.kv.block_manager import BlockManager
from specengine.models.loader import load_model, save_random_model
from specengine.sampling.params import SampleNoise

BS = 8


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("t"), {"num_hidden_layers": 2}, seed=3)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype=torch.float32)


def plain_hidden(target, tokens):
    """Last hidden states ``[L, H]`` of ``tokens`` by one prefill in a private pool."""
    n = -(-len(tokens) // BS)
    runner = ModelRunner(target.model, n, BS)
    bm = BlockManager(n, BS, runner.copy_block)
    s = Sequence("ref", 0, list(tokens), SamplingParams(), SampleNoise(0, 0))
    bm.allocate_shared([s])
    return runner.run([BatchEntry(s, len(s), [s], True)], bm)[1]


SPECS = {"none": None,
         "ngram": {"method": "ngram", "num_speculative_tokens": 3},
         "eagle": {"method": "eagle", "model": "random", "num_speculative_tokens": 3,
                   "topk": 2, "num_verify_tokens": 6}}


@pytest.mark.parametrize("spec", list(SPECS))
def test_hidden_states_equal_a_plain_forward_of_prompt_and_response(target_dir, target, spec):
    cfg = None if SPECS[spec] is None else {"policy": "static", **SPECS[spec]}
    llm = LLM(str(target_dir), dtype="float32", block_size=BS, kv_cache_memory_bytes=8 << 20,
              speculative_config=cfg)
    g = torch.Generator().manual_seed(4)
    base = torch.randint(0, 512, (6,), generator=g).tolist()
    prompts = rand_prompts(3, lo=5, hi=30, seed=5) + [base * 5]  # repetitive: ngram accepts
    prompts = prompts + prompts[:2]  # repeats: prefix-cache hits
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                             return_hidden_states=True),
              SamplingParams(temperature=1.0, seed=9, n=2, max_tokens=20, ignore_eos=True,
                             return_hidden_states=True, stop_token_ids=[7, 8, 9])]
    checked = 0
    for sp in params:
        for _ in range(2):  # the second call hits the prefix cache on every prompt
            for p, r in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
                for o in r.outputs:
                    ref = plain_hidden(target, p + o.token_ids)
                    want = ref[len(p) - 1:len(p) - 1 + len(o.token_ids)]
                    assert o.hidden_states.shape == (len(o.token_ids), 64)
                    torch.testing.assert_close(o.hidden_states, want, atol=1e-4, rtol=1e-4)
                    # the state of row j gives token j (greedy: its argmax)
                    if sp.temperature == 0:
                        logits = target.model.compute_logits(o.hidden_states)
                        assert logits.argmax(-1).tolist() == o.token_ids
                    checked += 1
    assert checked == 2 * (len(prompts) + 2 * len(prompts))
    m = llm.get_metrics()
    assert m["prefix_cache_hit_tokens"] > 0
    if cfg is not None:
        assert m["accepted_tokens"] > 0  # rows of accepted tree nodes were checked


def test_hidden_states_off_by_default_and_validated(target_dir):
    llm = LLM(str(target_dir), dtype="float32", block_size=BS, kv_cache_memory_bytes=8 << 20)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert out[0].outputs[0].hidden_states is None
    with pytest.raises(ValueError, match="return_hidden_states"):
        SamplingParams(return_hidden_states=1)


def test_hidden_states_survive_preemption(target_dir, target):
    """A preempted sample is recomputed from its tokens so far; the rows it kept stay right and
    the recompute's last row gives the next token's."""
    probe = LLM(str(target_dir), dtype="float32", block_size=BS, kv_cache_memory_bytes=1 << 20)
    per_block = probe.engine.runner.kv_cache[:, :, 0].numel() * 4
    llm = LLM(str(target_dir), dtype="float32", block_size=BS,
              kv_cache_memory_bytes=12 * per_block)
    prompts = rand_prompts(6, lo=10, hi=20, seed=8)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, return_hidden_states=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert llm.get_metrics()["preemptions"] > 0
    for p, r in zip(prompts, outs):
        o = r.outputs[0]
        want = plain_hidden(target, p + o.token_ids)[len(p) - 1:len(p) - 1 + len(o.token_ids)]
        torch.testing.assert_close(o.hidden_states, want, atol=1e-4, rtol=1e-4)
