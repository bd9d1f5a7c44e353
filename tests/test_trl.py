"""TRL's real ``GRPOTrainer`` generating through ``specengine.integrations.trl.RolloutFunc``.

Each GRPO run wraps the rollout so that, at every step, while the trainer still holds the
weights it generated with, the test records: the engine's weights against the trainer's, the
engine's counters, the trainer's own log-probabilities of the returned completions, and what a
second rollout over an engine *without* speculation returns for the same prompts and step
(same derived seeds): speculation must not change a single token.
"""

import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from specengine import LLM
from specengine.data.rewards import answers_equal, exact_answer_reward, final_answer, gsm_task
from specengine.integrations.trl import RolloutFunc, RolloutLogger, _runs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                        "ignore::DeprecationWarning")

QUESTIONS = ["What is 2 + 3?", "Name a colour.", "Count to five.", "Say hello in French."]


def parity_reward(completion_ids, **kwargs):
    """Fraction of even token ids: varies between samples, so GRPO's advantages are non-zero
    and the weights move (the GSM reward is ~0 for these models)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def make_trainer(model_dir, tmp_path, rollout_func, *, prompts=2, generations=2, max_len=12,
                 steps=2, lr=1e-3, generation_kwargs=None, conversational=True, callbacks=None):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    qs = (QUESTIONS * steps)[:prompts * steps]
    rows = [{"prompt": [{"role": "user", "content": q}] if conversational else q} for q in qs]
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), use_cpu=True, bf16=False, report_to=[],
        save_strategy="no", max_steps=steps, per_device_train_batch_size=prompts * generations,
        num_generations=generations, max_completion_length=max_len, learning_rate=lr, seed=0,
        logging_steps=1, gradient_checkpointing=False, disable_tqdm=True,
        generation_kwargs=generation_kwargs)
    return GRPOTrainer(model=model, reward_funcs=parity_reward, args=args,
                       train_dataset=Dataset.from_list(rows), processing_class=tok,
                       rollout_func=rollout_func, callbacks=callbacks)


def engine_llm(model_dir, spec=None, **kw):
    return LLM(str(model_dir), dtype="float32", logprobs_mode="processed_logprobs",
               max_model_len=512, kv_cache_memory_bytes=64 << 20, speculative_config=spec,
               **kw)


class Checked:
    """A rollout_func that runs ``rollout`` and records, per step, what the test asserts."""

    def __init__(self, rollout: RolloutFunc, plain: RolloutFunc):
        self.rollout, self.plain, self.records = rollout, plain, []

    def __call__(self, prompts, trainer):
        before = self.rollout.llm.get_metrics()["generated_tokens"]
        out = self.rollout(prompts, trainer)
        after = self.rollout.llm.get_metrics()["generated_tokens"]
        engine = self.rollout.llm.engine.runner.model.hf_parameters()
        trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        seqs = [p + c for p, c in zip(out["prompt_ids"], out["completion_ids"])]
        width = max(len(x) for x in seqs)  # one right-padded forward for all
        ids = torch.tensor([x + [0] * (width - len(x)) for x in seqs])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids, attention_mask=mask).logits.float()
        scored = []
        for row, p_ids, c_ids in zip(logits, out["prompt_ids"], out["completion_ids"]):
            lp = torch.log_softmax(row[len(p_ids) - 1:len(p_ids) + len(c_ids) - 1]
                                   / trainer.temperature, dim=-1)
            scored.append(lp.gather(1, torch.tensor(c_ids)[:, None])[:, 0])
        self.records.append({
            "prompts": list(prompts), "out": out, "served": after - before,
            "trl_prompt_ids": trainer._tokenize_prompts(prompts)[0],
            "weights_equal": sorted(n for n, p in trained.items()
                                    if torch.equal(engine[n], p)) == sorted(trained),
            "weights": trained, "scored": scored, "plain": self.plain(prompts, trainer)})
        return out


def run_checked(model_dir, tmp_path, llm, plain_llm, **kw):
    """Train; returns ``(rollout, records, logger, weight version before the run)`` (an
    engine shared between runs has its version counted on from the earlier ones)."""
    base = llm.weight_version
    rollout, plain = RolloutFunc(llm), RolloutFunc(plain_llm)
    checked = Checked(rollout, plain)
    logger = RolloutLogger(rollout, print_fn=None)
    trainer = make_trainer(model_dir, tmp_path, checked, callbacks=[logger], **kw)
    trainer.train()
    return rollout, checked.records, logger, base


def check_run(rollout, records, logger, *, steps, prompts, generations, max_len, greedy,
              base=0):
    """The assertions shared by the tiny and the real-model runs (``base``: the engine's
    weight version before the run; each step's push adds one)."""
    assert len(records) == steps == len(rollout.history) == len(logger.rows)
    assert rollout.num_weight_pushes == steps
    for step, (rec, stats) in enumerate(zip(records, rollout.history)):
        out = rec["out"]
        n = prompts * generations
        assert len(rec["prompts"]) == n
        for key in ("prompt_ids", "completion_ids", "logprobs", "finish_reason",
                    "weight_version"):
            assert len(out[key]) == n, key
        assert out["prompt_ids"] == [list(p) for p in rec["trl_prompt_ids"]]
        lengths = [len(c) for c in out["completion_ids"]]
        assert [len(lp) for lp in out["logprobs"]] == lengths
        assert all(1 <= k <= max_len for k in lengths)
        assert all(r in ("stop", "length") for r in out["finish_reason"])
        assert out["weight_version"] == [base + step + 1] * n
        # the engine served every token, with speculation
        assert rec["served"] == sum(lengths) == stats.generated_tokens
        assert stats.spec_steps > 0 and stats.accepted_tokens > 0 and stats.tau > 1.0
        assert stats.step == step and stats.synced and stats.weight_version == base + step + 1
        # the engine held exactly the trainer's weights (float32 both: the cast is exact)
        assert rec["weights_equal"]
        # speculation changed nothing: token for token what plain decoding samples
        assert out["completion_ids"] == rec["plain"]["completion_ids"]
        assert out["prompt_ids"] == rec["plain"]["prompt_ids"]
        for lp, plain_lp in zip(out["logprobs"], rec["plain"]["logprobs"]):
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(plain_lp),
                                       atol=1e-4, rtol=0)
        # the logprobs are the trainer's own (processed: temperature 1 here), up to kernels
        for lp, scored in zip(out["logprobs"], rec["scored"]):
            torch.testing.assert_close(torch.tensor(lp), scored, atol=2e-3, rtol=0)
        if greedy:
            for g in range(prompts):
                group = out["completion_ids"][g * generations:(g + 1) * generations]
                assert all(c == group[0] for c in group)
    if not greedy:  # the optimizer step moved the weights, and the engine got the new ones
        assert any(not torch.equal(records[0]["weights"][k], records[1]["weights"][k])
                   for k in records[0]["weights"])
    assert [r["weight_version"] for r in logger.rows] == list(range(base + 1, base + steps + 1))
    assert all(r["tau"] > 1.0 and r["generate_seconds"] > 0 for r in logger.rows)


# ------------------------------------------------------------------ tiny model (fast)

@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_grpo_tiny_served_by_engine(tiny_llama_tok_dir, tmp_path, greedy):
    """2 GRPO steps: the draft model is the target itself, so speculation accepts a lot."""
    spec = {"method": "draft_model", "model": str(tiny_llama_tok_dir), "policy": "static",
            "num_speculative_tokens": 3}
    llm, plain_llm = engine_llm(tiny_llama_tok_dir, spec), engine_llm(tiny_llama_tok_dir)
    kw = dict(prompts=2, generations=2, max_len=12, steps=2)
    rollout, records, logger, base = run_checked(
        tiny_llama_tok_dir, tmp_path, llm, plain_llm,
        generation_kwargs={"temperature": 0.0} if greedy else None, **kw)
    check_run(rollout, records, logger, greedy=greedy, max_len=12, prompts=2, generations=2,
              steps=2, base=base)


@pytest.fixture(scope="module")
def tiny_trainer(tiny_llama_tok_dir, tmp_path_factory):
    llm = engine_llm(tiny_llama_tok_dir)
    rollout = RolloutFunc(llm)
    trainer = make_trainer(tiny_llama_tok_dir, tmp_path_factory.mktemp("t"), rollout)
    return trainer, rollout, tiny_llama_tok_dir


def test_tokenize_matches_trl(tiny_trainer):
    trainer, rollout, _ = tiny_trainer
    convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
    texts = ["Once upon a time", "def f(x):", "The answer is"]
    for prompts in (convs, texts):
        ours = rollout.tokenize(prompts, trainer)
        assert ours == [list(p) for p in trainer._tokenize_prompts(prompts)[0]]
    assert ours[0] == trainer.processing_class("Once upon a time")["input_ids"]


def test_push_only_when_step_changes(tiny_trainer):
    trainer, _, model_dir = tiny_trainer
    rollout = RolloutFunc(engine_llm(model_dir))
    prompts = [[{"role": "user", "content": "Hi"}]] * 3 + [[{"role": "user", "content": "Yo"}]]
    trainer.state.global_step = 5
    a = rollout(prompts, trainer)
    b = rollout(prompts, trainer)  # same step: no push, new seeds
    assert rollout.num_weight_pushes == 1 == rollout.weight_version
    assert [h.synced for h in rollout.history] == [True, False]
    assert rollout.history[1].sync_seconds == 0.0
    assert [h.num_prompts for h in rollout.history] == [2, 2]
    assert a["completion_ids"] != b["completion_ids"]
    assert a["prompt_ids"][:3] == [a["prompt_ids"][0]] * 3 != a["prompt_ids"][3:]
    trainer.state.global_step = 6
    rollout(prompts, trainer)
    assert rollout.num_weight_pushes == 2 and rollout.history[-1].synced
    # a rerun with the same step and call samples the same tokens
    again = RolloutFunc(engine_llm(model_dir))
    trainer.state.global_step = 5
    assert again(prompts, trainer)["completion_ids"] == a["completion_ids"]
    trainer.state.global_step = 0


def test_sync_weights_off(tiny_trainer):
    trainer, _, model_dir = tiny_trainer
    rollout = RolloutFunc(engine_llm(model_dir),
                                sync_weights=False, seed=3)
    out = rollout(["a b c"] * 2, trainer)
    assert rollout.num_weight_pushes == 0 and out["weight_version"] == [0, 0]
    assert not rollout.history[0].synced


def test_sampling_params_follow_trainer(tiny_trainer):
    trainer, rollout, _ = tiny_trainer
    p = rollout.sampling_params(trainer, n=3, seed=7)
    assert (p.n, p.seed, p.logprobs, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) \
        == (3, 7, 0, 1.0, 1.0, 0, 0.0, 12)
    old = trainer.args.generation_kwargs
    try:
        trainer.args.generation_kwargs = {"temperature": 0.0, "stop": ["\n"]}
        p = rollout.sampling_params(trainer, n=1, seed=0)
        assert p.temperature == 0.0 and p.stop == ["\n"]
        trainer.args.generation_kwargs = {"do_sample": False}
        with pytest.raises(ValueError, match=r"generation_kwargs \['do_sample'\]"):
            rollout.sampling_params(trainer, n=1, seed=0)
    finally:
        trainer.args.generation_kwargs = old


def test_repetition_penalty(tiny_trainer):
    trainer, rollout, _ = tiny_trainer
    trainer.repetition_penalty = 1.2
    try:
        assert rollout.sampling_params(trainer, 1, 0).repetition_penalty == 1.2
    finally:
        trainer.repetition_penalty = 1.0


def test_bad_arguments(tiny_trainer):
    trainer, rollout, model_dir = tiny_trainer
    with pytest.raises(TypeError, match="prompts must be a non-empty list"):
        rollout([], trainer)
    with pytest.raises(TypeError, match="prompts must be a non-empty list, got str"):
        rollout("hello", trainer)
    with pytest.raises(TypeError, match="llm must be a specengine.LLM"):
        RolloutFunc(object())
    with pytest.raises(TypeError, match="seed must be an int"):
        RolloutFunc(rollout.llm, seed="1")
    with pytest.warns(RuntimeWarning, match="processed_logprobs"):
        RolloutFunc(LLM(str(model_dir), dtype="float32",
                              max_model_len=64, kv_cache_memory_bytes=8 << 20))


def test_runs():
    assert _runs(["a", "a", "b", "a"]) == [(0, 2), (2, 1), (3, 1)]
    c = [{"role": "user", "content": "x"}]
    assert _runs([c, list(c), [{"role": "user", "content": "y"}]]) == [(0, 2), (2, 1)]


def test_integrations_package_does_not_import_trl():
    code = ("import sys, specengine.integrations; "
            "assert 'trl' not in sys.modules, 'trl imported'; print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# ------------------------------------------------------------------ the reward

def test_final_answer_and_reward():
    assert final_answer("so 3 + 4 = 7.\n#### 7") == "7"
    assert final_answer("#### 1,234.50 dollars") == "1234.50"
    assert final_answer("first 3 then 12, done.") == "12"
    assert final_answer("#### 5 but later 9") == "5"
    assert final_answer("no digits") is None
    assert answers_equal("15.0", "15") and not answers_equal("15.5", "15")
    assert not answers_equal(None, "1") and not answers_equal("x", "1")
    comps = [[{"role": "assistant", "content": "It is 98.\n#### 98"}], "about 97", "98"]
    assert exact_answer_reward(comps, ["98", "98", "98.0"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 completions for 1 answers"):
        exact_answer_reward(["1", "2"], ["1"])
    with pytest.raises(TypeError, match="text must be a str"):
        final_answer(3)
    rows = gsm_task(2)
    assert rows[0]["prompt"][0]["role"] == "user" and "####" in rows[0]["prompt"][0]["content"]
    assert all(answers_equal(r["answer"], r["answer"]) for r in rows)


# ------------------------------------------------------------------ the real model

@pytest.fixture(scope="module")
def real_engines(default_model_dir):
    """The default model with EAGLE speculation (shipped drafter, static chain of 3) and
    without; each GRPO run's first rollout pushes the checkpoint's weights back into both."""
    spec = {"method": "eagle", "policy": "static", "num_speculative_tokens": 3}
    return engine_llm(default_model_dir, spec), engine_llm(default_model_dir)


@pytest.mark.integration
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_grpo_real_model_served_by_engine(default_model_dir, real_engines, tmp_path, greedy):
    """2 GRPO steps of the default model through TRL, generated with EAGLE speculation."""
    llm, plain_llm = real_engines
    rollout, records, logger, base = run_checked(
        default_model_dir, tmp_path, llm, plain_llm, prompts=2, generations=2, max_len=12,
        steps=2, lr=1e-5, generation_kwargs={"temperature": 0.0} if greedy else None)
    check_run(rollout, records, logger, greedy=greedy, max_len=12, prompts=2, generations=2,
              steps=2, base=base)
