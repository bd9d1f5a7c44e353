"""Weight updates of a running engine (``LLM.update_weights``) and drafter drift: a target
changed by a few optimizer steps makes its EAGLE drafter stale (tau falls), online training on
rollouts of the changed target recovers it, and outputs stay those of plain decoding."""

import pytest
import torch

from specengine import LLM, SamplingParams
from specengine.models.llama import LlamaForCausalLM
from specengine.models.loader import (
    iter_safetensors,
    load_config,
    load_model,
    safetensors_files,
    save_random_model,
)
from specengine.speculative.drafters.eagle import EagleConfig, EagleModel, save_drafter
from specengine.speculative.training.fit import TrainConfig, fit, reduced_vocab, trainable_copy
from specengine.speculative.training.harvest import HiddenBuffer, harvest, teacher_force
from specengine.speculative.training.online import DrafterTrainer

KW = {"block_size": 8, "kv_cache_memory_bytes": 8 << 20}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: on a loaded 2-core machine OpenMP barriers make the many tiny
    training ops of this module 10-30x slower with two."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def weights(model_dir):
    return dict(iter_safetensors(safetensors_files(model_dir)))


def prompts(n, seed, length=6, repeats=4):
    """Repetitive prompts (a random motif repeated), so a small drafter can learn them."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (length,), generator=g).tolist() * repeats for _ in range(n)]


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(llm, ps, n=32, logprobs=None):
    """(token ids, logprobs) per prompt and tau (tokens committed per verify step, this call)."""
    m0 = llm.get_metrics()
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
    outs = [o.outputs[0] for o in llm.generate(ps, params, use_tqdm=False)]
    m1 = llm.get_metrics()
    steps = m1.get("spec_steps", 0) - m0.get("spec_steps", 0)
    tau = (m1["accepted_tokens"] - m0["accepted_tokens"] + steps) / steps if steps else None
    return [o.token_ids for o in outs], [o.logprobs for o in outs], tau


def fresh_model(model_dir, sd, dtype):
    m = LlamaForCausalLM(load_config(model_dir), dtype)
    m.load_weights(sd.items())
    return m


def logits(model, seqs):
    """float32 logits ``[sum(L - 1), V]`` of positions 0..L-2 of each sequence, through our
    model's forward (packed weights) and LM head."""
    return model.compute_logits(torch.cat(teacher_force(model, seqs)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_weights_equals_fresh_load(tmp_path, dtype):
    a = save_random_model(tmp_path / "a", {"num_hidden_layers": 2}, seed=1)
    b = save_random_model(tmp_path / "b", {"num_hidden_layers": 2}, seed=2)
    wa, wb = weights(a), weights(b)
    llm = LLM(str(a), dtype=dtype, **KW)
    model = llm.engine.runner.model
    ps = prompts(3, seed=0)
    toks_a, lps_a, _ = run(llm, ps, 12, logprobs=3)  # packs the weights, fills the KV pool

    # a subset: layer 1 and the LM head only
    part = {k: v for k, v in wb.items() if k.startswith("model.layers.1.") or k == "lm_head.weight"}
    before = logits(model, ps)
    assert sorted(llm.update_weights(part)) == sorted(part)
    want = fresh_model(a, {**wa, **part}, dtype)
    got = logits(model, ps)
    assert not torch.equal(got, before)
    assert torch.equal(got, logits(want, ps))

    # everything, as (name, tensor) pairs: same tokens and logprobs as a freshly loaded engine
    llm.update_weights(wb.items())
    fresh = LLM(str(b), dtype=dtype, **KW)
    toks, lps, _ = run(llm, ps, 12, logprobs=3)
    want_toks, want_lps, _ = run(fresh, ps, 12, logprobs=3)
    assert toks == want_toks and lps == want_lps and toks != toks_a
    assert torch.equal(logits(model, ps), logits(fresh.engine.runner.model, ps))
    # and back: the original weights give the original outputs
    llm.update_weights(wa)
    assert run(llm, ps, 12, logprobs=3)[:2] == (toks_a, lps_a)


def test_update_weights_errors_change_nothing(tmp_path):
    a = save_random_model(tmp_path / "a", {"num_hidden_layers": 2}, seed=1)
    llm = LLM(str(a), dtype="float32", **KW)
    model = llm.engine.runner.model
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    good = ("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 64))
    bad = [
        ("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64), ValueError,
         "unexpected weight 'model.layers.7.mlp.up_proj.weight'"),
        ("model.layers.0.self_attn.q_proj.bias", torch.zeros(64), ValueError,
         "unexpected weight 'model.layers.0.self_attn.q_proj.bias'"),
        ("model.norm.weight", torch.ones(65), ValueError,
         r"'model.norm.weight' has shape \(65,\), expected \(64,\)"),
        ("model.norm.weight", [1.0] * 64, TypeError, "'model.norm.weight' is a list"),
    ]
    for name, value, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            llm.update_weights([good, (name, value)])
    ps = prompts(2, seed=4)
    it = llm.generate_iter(ps, [greedy(2), greedy(20)], use_tqdm=False)
    next(it)  # the first request finished, the second is in flight
    with pytest.raises(RuntimeError, match="in flight"):
        llm.update_weights([good])
    list(it)
    for k, v in model.state_dict().items():
        assert torch.equal(v, snapshot[k]), k
    # skipped as load_weights skips it
    assert llm.update_weights([("model.layers.0.self_attn.rotary_emb.inv_freq",
                                torch.zeros(8))]) == []


def test_stale_drafter_tau_falls_and_online_training_recovers_it(tmp_path):
    from transformers import AutoModelForCausalLM

    target_dir = save_random_model(tmp_path / "t", {"num_hidden_layers": 2}, seed=1)
    ps = prompts(12, seed=101)
    plain = LLM(str(target_dir), dtype="float32", **KW)

    # (a) offline drafter on greedy rollouts of target A
    buf = HiddenBuffer()
    harvest(plain, buf)
    out_a = run(plain, ps)[0]
    plain.engine.drafter = None
    target = load_model(target_dir, dtype=torch.float32)
    vmap = reduced_vocab([r.token_ids for r in buf.snapshot()], 512, 512)  # frequency order
    drafter = trainable_copy(EagleModel(EagleConfig.for_target(target), target.model,
                                        torch.float32, vmap).random_init(1))
    cfg = TrainConfig(steps=150, batch_tokens=600, lr=3e-3, warmup=10, unroll=3, max_len=64,
                      seed=1, autocast=False)
    fit(drafter, buf.snapshot(), [], cfg, None, progress=False)
    ckpt = save_drafter(drafter, tmp_path / "drafter", torch.float32)
    spec = LLM(str(target_dir), dtype="float32", **KW, speculative_config={
        "method": "eagle", "model": str(ckpt), "policy": "static", "num_speculative_tokens": 4})
    eagle = spec.engine.drafter
    toks, _, tau_a = run(spec, ps)
    assert toks == out_a

    # (b) a few AdamW steps of the HF model on other text, pushed into both engines
    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-3)
    text = torch.randint(3, 512, (4, 64), generator=torch.Generator().manual_seed(7))
    for _ in range(5):
        opt.zero_grad()
        hf(input_ids=text, labels=text).loss.backward()
        opt.step()
    for llm in (spec, plain):
        llm.update_weights(hf.named_parameters())
    hf.save_pretrained(tmp_path / "changed")
    out_b = run(LLM(str(tmp_path / "changed"), dtype="float32", **KW), ps)[0]
    assert run(plain, ps)[0] == out_b != out_a
    torch.testing.assert_close(eagle.model.head_weight(),  # shared head follows the update
                               hf.lm_head.weight.detach()[vmap], rtol=0, atol=0)
    online = HiddenBuffer()
    harvest(spec, online)  # the stale drafter's rollouts are the training data
    toks, _, tau_b = run(spec, ps)
    assert toks == out_b

    # (c) online training on rollouts of the changed target, hot-swapped in
    trainer = DrafterTrainer(eagle, online, TrainConfig(
        steps=100, batch_tokens=600, lr=3e-3, warmup=5, unroll=3, max_len=64, seed=1,
        autocast=False), min_rollouts=4)
    assert trainer.train_now(100) == 100
    toks, _, tau_c = run(spec, ps)
    assert toks == out_b
    m = spec.get_metrics()
    assert m["drafter_version"] == eagle.version == 1
    assert set(m["tau_per_version"]) == {0, 1}  # counted per drafter (not engine) step
    assert m["tau_per_version"][1] == pytest.approx(tau_c, abs=0.1)
    print(f"tau: target A {tau_a:.2f}, changed target (stale drafter) {tau_b:.2f}, "
          f"after online training {tau_c:.2f}")
    # seeds 1..5 gave A 1.95-2.14, stale 1.14-1.22, recovered 2.46-2.70
    assert tau_a > 1.6
    assert tau_b < tau_a - 0.5
    assert tau_c > tau_b + 0.8 and tau_c > tau_a - 0.3

