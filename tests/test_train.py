"""Drafter training: harvesting, teacher forcing, the loss and fit (deterministic, resumable),
online training with hot swap, and the ``train-drafter`` command."""

import json

import pytest
import torch

from specengine import LLM, SamplingParams
from specengine.models.loader import load_model
from specengine.speculative.drafters.eagle import EagleConfig, EagleModel, load_drafter
from specengine.speculative.training.distill import read_prompts
from specengine.speculative.training.fit import (
    TrainConfig,
    evaluate,
    fit,
    reduced_vocab,
    trainable_copy,
)
from specengine.speculative.training.harvest import (
    HiddenBuffer,
    SequenceFeatures,
    harvest,
    teacher_force,
)
from specengine.speculative.training.online import DrafterTrainer


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype=torch.float32)


def prompts(n, seed=0, length=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (length,), generator=g).tolist() for _ in range(n)]


def greedy(n=16):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def rollouts(target):
    seqs = [(p * 6)[:48] for p in prompts(12, seed=3, length=8)]  # repetitive: learnable
    return [SequenceFeatures(s, h) for s, h in zip(seqs, teacher_force(target.model, seqs))]


def test_hidden_buffer_bounds():
    buf = HiddenBuffer(max_items=3, max_bytes=10_000)
    for i in range(5):
        buf.add(SequenceFeatures([i] * 10, torch.zeros(9, 16)))  # 576 + 80 bytes each
    assert [r.token_ids[0] for r in buf.snapshot()] == [2, 3, 4]
    small = HiddenBuffer(max_items=100, max_bytes=1500)
    for i in range(5):
        small.add(SequenceFeatures([i] * 10, torch.zeros(9, 16)))
    assert [r.token_ids[0] for r in small.snapshot()] == [3, 4] and small.nbytes <= 1500
    with pytest.raises(ValueError, match="max_items"):
        HiddenBuffer(max_items=0)


def test_harvested_features_equal_teacher_forced(target_dir, target):
    llm = LLM(str(target_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=4 << 20)
    buf = HiddenBuffer()
    harvest(llm, buf)
    ps = prompts(3)
    outs = llm.generate(ps, greedy(), use_tqdm=False)
    assert len(buf) == 3
    by_prompt = {tuple(r.token_ids[:12]): r for r in buf.snapshot()}
    for p, o in zip(ps, outs):
        r = by_prompt[tuple(p)]
        assert r.token_ids == p + o.outputs[0].token_ids[:-1] or \
            r.token_ids == p + o.outputs[0].token_ids
        assert r.hidden.shape == (len(r.token_ids) - 1, 64)
        want = teacher_force(target.model, [r.token_ids])[0]
        torch.testing.assert_close(r.hidden, want, atol=1e-4, rtol=1e-4)
    assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


@pytest.mark.parametrize("drafting", [True, False])
def test_harvesting_adds_no_per_step_work(target_dir, drafting):
    """Wrapped in a ``Harvester``, EAGLE is handed features exactly as alone (at draft time,
    and once per prompt at its prefill, for the drafter KV its samples share: so while the
    policy drafts for no sequence, one hand-over per prompt and none per step), the outputs
    do not change, and each finished sample is read from the KV feature store once, on top
    of EAGLE's own reads."""
    spec = {"method": "eagle", "model": "random", "num_speculative_tokens": 3, "topk": 2,
            "policy": "static"}
    from specengine.kv.block_features import BlockFeatures

    def run(harvested):
        llm = LLM(str(target_dir), dtype="float32", block_size=8,
                  kv_cache_memory_bytes=4 << 20, speculative_config=spec)
        eagle, buf = llm.engine.drafter, HiddenBuffer()
        if not drafting:  # speculation off for every sequence, as auto does where it loses
            llm.engine.policy.select = lambda seqs, strategy: [False] * len(seqs)
        if harvested:
            harvest(llm, buf)
        calls = {"observe": 0, "read": 0}
        observe, read = eagle.observe, BlockFeatures.read

        def count_observe(*a):
            calls["observe"] += 1
            return observe(*a)

        def count_read(self, slots):
            calls["read"] += 1
            return read(self, slots)

        eagle.observe = count_observe
        BlockFeatures.read = count_read
        try:
            sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
            outs = llm.generate(prompts(3, seed=7), sp, use_tqdm=False)
        finally:
            BlockFeatures.read = read
        return [c.token_ids for o in outs for c in o.outputs], calls, buf

    plain_tokens, plain_calls, _ = run(False)
    tokens, calls, buf = run(True)
    assert tokens == plain_tokens
    assert calls["observe"] == plain_calls["observe"]
    assert plain_calls["observe"] > 3 if drafting else plain_calls["observe"] == 3
    assert calls["read"] == plain_calls["read"] + 6 and len(buf) == 6


def test_harvest_started_mid_rollout_skips_the_samples_already_running(target_dir, target):
    """Samples running before ``harvest`` have no stored features for their first positions:
    they are counted in ``skipped``, not put in the buffer with features of other positions;
    a sample admitted after it is harvested whole."""
    llm = LLM(str(target_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=4 << 20)
    early, late = prompts(2, seed=11), prompts(1, seed=12)[0]
    for p in early:
        llm.add_request(p, greedy(12))
    for _ in range(4):
        llm.step()
    buf = HiddenBuffer()
    h = harvest(llm, buf)
    llm.add_request(late, greedy(12))
    while llm.has_unfinished_requests():
        llm.step()
    assert h.skipped == 2 and len(buf) == 1
    (r,) = buf.snapshot()
    assert r.token_ids[:12] == late and len(r.token_ids) == 24 and r.hidden.shape[0] == 23
    want = teacher_force(target.model, [r.token_ids])[0]
    torch.testing.assert_close(r.hidden, want, atol=1e-4, rtol=1e-4)
    assert llm.get_metrics()["kv_blocks_free"] == llm.get_metrics()["kv_blocks_total"]


def test_teacher_force_errors(target):
    with pytest.raises(ValueError, match="sequence 1 has 1 tokens"):
        teacher_force(target.model, [[1, 2, 3], [4]])


def test_read_prompts_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\nnot json\n')
    with pytest.raises(ValueError, match="no usable lines.*'prompt'"):
        read_prompts(bad)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_prompts(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError):
        read_prompts(tmp_path / "missing.jsonl")
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "a"}\n{"messages": [{"role": "user", "content": "b"}]}\n[1]\n')
    assert len(read_prompts(ok)) == 2


def test_reduced_vocab_ranks_by_frequency():
    v = reduced_vocab([[5, 5, 5, 7, 7, 9]], 5, 20, always=[2])
    assert v.tolist() == [2, 5, 7, 9, 0]


def new_model(target, seed=0):
    vm = reduced_vocab([], 512, 512)
    base = EagleModel(EagleConfig.for_target(target), target.model, torch.float32, vm)
    return trainable_copy(base.random_init(seed))


CFG = TrainConfig(steps=4, batch_tokens=200, lr=3e-3, warmup=2, unroll=2, max_len=48)


def test_fit_learns_is_deterministic_and_resumes(target, rollouts, tmp_path):
    a = new_model(target)
    fit(a, rollouts[4:], [], CFG, tmp_path / "a", save_every=3, progress=False)
    b = new_model(target)
    fit(b, rollouts[4:], [], CFG, None, progress=False)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    # resume: stop at step 2, then run to 4 from the saved state
    c = new_model(target)
    fit(c, rollouts[4:], [], CFG, tmp_path / "c", save_every=2, progress=False, until=2)
    d = new_model(target)
    fit(d, rollouts[4:], [], CFG, tmp_path / "c", save_every=2, progress=False)
    for (n, p), (_, q) in zip(a.named_parameters(), d.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6), n
    more = TrainConfig(**{**CFG.__dict__, "steps": 30})
    e = new_model(target)
    seen = rollouts[4:7]
    before = evaluate(e, seen, more)
    after = fit(e, seen, seen, more, None, progress=False)
    assert after["top1"][0] > before["top1"][0] + 0.2  # fits what it was trained on
    assert after["tau_chain_est"] > before["tau_chain_est"]
    assert load_drafter(tmp_path / "a", target).config.draft_vocab_size == 512


def test_online_trainer_hot_swaps_without_changing_output(target_dir, rollouts):
    spec = {"method": "eagle", "model": "random", "num_speculative_tokens": 3, "topk": 2,
            "policy": "static"}
    llm = LLM(str(target_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=4 << 20,
              speculative_config=spec)
    plain = LLM(str(target_dir), dtype="float32", block_size=8, kv_cache_memory_bytes=4 << 20)
    drafter = llm.engine.drafter
    buf = HiddenBuffer()
    harvest(llm, buf)
    for r in rollouts:
        buf.add(r)
    trainer = DrafterTrainer(drafter, buf, TrainConfig(steps=10, batch_tokens=200, warmup=1),
                             publish_every=2, min_rollouts=2)
    assert trainer.train_now(2) == 2 and trainer.version == 1
    trainer.start(max_steps=4)
    ps = prompts(3, seed=5)
    got = [o.outputs[0].token_ids for o in llm.generate(ps, greedy(24), use_tqdm=False)]
    # the thread's 4 steps, however many ran during generate (the timeout only stops a hang)
    trainer._thread.join(timeout=300)
    assert not trainer._thread.is_alive()
    trainer.stop()
    got2 = [o.outputs[0].token_ids for o in llm.generate(ps, greedy(24), use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in plain.generate(ps, greedy(24), use_tqdm=False)]
    assert got == want and got2 == want
    assert drafter.version == trainer.version == 3  # published after steps 2 and 4
    st = drafter.stats()
    assert st["drafter_version"] == drafter.version and st["tau_per_version"]
    assert all(t >= 1.0 for t in st["tau_per_version"].values())
    assert len(buf) >= len(rollouts)  # the engine's own rollouts were harvested too


def test_train_drafter_command(tmp_path, tiny_llama_tok_dir):
    from specengine.cli import main

    data = tmp_path / "d.jsonl"
    recs = [{"prompt": f"def f{i}(x):", "response": "    return x * 2\n" * 3} for i in range(6)]
    recs.append({"messages": [{"role": "user", "content": "Add 2 and 3."}]})
    data.write_text("\n".join(json.dumps(r) for r in recs) + "\nnot json\n")
    out = tmp_path / "ck"
    rc = main(["train-drafter", "--model", str(tiny_llama_tok_dir), "--data", str(data),
               "--out", str(out), "--steps", "2", "--batch-tokens", "256", "--max-tokens", "8",
               "--draft-vocab", "256", "--max-len", "64", "--dtype", "float32",
               "--no-progress"])
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 256 and cfg["training"]["train_sequences"] >= 5
    assert cfg["target"]["tokenizer_sha256"]
    llm = LLM(str(tiny_llama_tok_dir), dtype="float32", kv_cache_memory_bytes=4 << 20,
              speculative_config={"method": "eagle", "model": str(out), "policy": "static"})
    a = llm.generate("def g(x):", greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    assert len(a) == 8
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"nothing": 1}\n')
    assert main(["train-drafter", "--model", str(tiny_llama_tok_dir), "--data", str(empty),
                 "--out", str(tmp_path / "x")]) == 2
