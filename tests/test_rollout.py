"""What an RL rollout reads from ``generate``: prompt/response ids, the sampled token's
logprob per response token (``processed_logprobs``), finish reason, weight version; speculation
stays on when logprobs are requested and gives the plain engine's logprobs; tau per weight
version shows drift after an update."""

import pytest
import torch

from specengine import LLM, SamplingParams
from specengine.models.loader import iter_safetensors, safetensors_files, save_random_model

KW = {"block_size": 8, "kv_cache_memory_bytes": 8 << 20, "logprobs_mode": "processed_logprobs"}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("t"), {"num_hidden_layers": 2}, seed=1)


def prompts(n=6, seed=3):
    """Repetitive prompts (a motif repeated), so n-gram drafts get accepted."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (5,), generator=g).tolist() * 4 for _ in range(n)]


PARAMS = [SamplingParams(temperature=0, max_tokens=24, logprobs=0),
          SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, logprobs=0)]


def rollout(llm, params):
    outs = llm.generate(prompts(), params, use_tqdm=False)
    return [(o.prompt_token_ids, c.token_ids, c.sampled_logprobs, c.finish_reason,
             o.weight_version) for o in outs for c in o.outputs]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "policy": "static"},
    {"method": "ngram", "num_speculative_tokens": 3, "topk": 2, "num_verify_tokens": 6,
     "policy": "static"},
    {"method": "eagle", "model": "random", "num_speculative_tokens": 3, "policy": "static"},
])
@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "sampled"])
def test_speculation_stays_on_with_logprobs_and_matches_plain(target, spec, params):
    plain = LLM(str(target), dtype="float32", **KW)
    llm = LLM(str(target), dtype="float32", speculative_config=spec, **KW)
    want, got = rollout(plain, params), rollout(llm, params)
    m = llm.get_metrics()
    assert m["spec_steps"] > 0 and m["drafted_tokens"] > 0
    if spec["method"] == "ngram":
        assert m["accepted_tokens"] > 0
    for (p, t, lp, fin, v), (wp, wt, wlp, wfin, wv) in zip(got, want):
        assert (p, t, fin, v) == (wp, wt, wfin, wv) and v == 0
        assert len(lp) == len(t) and all(x <= 0 for x in lp)
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(wlp), rtol=0, atol=1e-3)


def test_sampled_logprobs_are_the_processed_distribution(target):
    """``processed_logprobs``: at T=0.8 the sampled token's logprob is that of the tempered
    distribution (it differs from raw mode), and ``sampled_logprobs`` reads it per token."""
    p = SamplingParams(temperature=0.8, seed=5, max_tokens=8, logprobs=0)
    proc = LLM(str(target), dtype="float32", **KW).generate([[7, 8, 9]], p, use_tqdm=False)
    raw = LLM(str(target), dtype="float32", block_size=8, kv_cache_memory_bytes=8 << 20
              ).generate([[7, 8, 9]], p, use_tqdm=False)
    c, r = proc[0].outputs[0], raw[0].outputs[0]
    assert c.token_ids == r.token_ids
    assert c.sampled_logprobs == [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
    assert all(len(d) == 1 for d in c.logprobs)  # logprobs=0: the sampled token only
    assert c.sampled_logprobs != r.sampled_logprobs
    assert c.cumulative_logprob == pytest.approx(sum(c.sampled_logprobs), abs=1e-4)
    assert proc[0].outputs[0].finish_reason == "length"
    no = LLM(str(target), dtype="float32", **KW).generate(
        [[7, 8, 9]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert no[0].outputs[0].sampled_logprobs is None


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_tau_per_weight_version(target, tmp_path, method):
    spec = {"method": method, "num_speculative_tokens": 3, "policy": "static"}
    if method == "eagle":
        spec["model"] = "random"
    llm = LLM(str(target), dtype="float32", speculative_config=spec, **KW)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tau_of_call():
        m0 = llm.get_metrics()
        outs = llm.generate(prompts(), greedy, use_tqdm=False)
        m1 = llm.get_metrics()
        steps = m1["spec_steps"] - m0["spec_steps"]
        assert steps > 0
        return outs, round((m1["accepted_tokens"] - m0["accepted_tokens"] + steps) / steps, 3)

    outs, tau0 = tau_of_call()
    assert {o.weight_version for o in outs} == {0}
    assert llm.get_metrics()["tau_per_weight_version"] == {0: tau0}
    other = save_random_model(tmp_path / "o", {"num_hidden_layers": 2}, seed=9)
    llm.update_weights(dict(iter_safetensors(safetensors_files(other))))
    assert llm.get_metrics()["tau_per_weight_version"] == {0: tau0}  # nothing run on v1 yet
    outs, tau1 = tau_of_call()
    assert {o.weight_version for o in outs} == {1}
    m = llm.get_metrics()
    assert m["tau_per_weight_version"] == {0: tau0, 1: tau1}
    if method == "eagle":  # the drafter's own key is kept (by drafter version)
        assert set(m["tau_per_version"]) == {0} and m["drafter_version"] == 0
