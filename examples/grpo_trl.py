"""TRL's real ``GRPOTrainer`` with specengine generating the rollouts, on CPU.

    python examples/grpo_trl.py                      # 3 steps, 4 prompts x 4 samples, 64 tokens
    python examples/grpo_trl.py --steps 20 --prompts 8 --generations 8 --max-completion-length 256
    python examples/grpo_trl.py --speculative ngram --policy static --out run.json

The policy is the default model (``smollm2-135m-instruct``) as a transformers
``AutoModelForCausalLM`` in float32, loaded from the HF directory specengine converted it into
(``specengine.models.loader.resolve_model``), so trainer and engine hold the same parameters.
The engine is a ``specengine.LLM`` over the same directory with speculation on (the shipped
EAGLE drafter by default, policy ``auto``) and ``logprobs_mode="processed_logprobs"``;
``specengine.integrations.trl.RolloutFunc`` is the trainer's ``rollout_func``: it pushes
the trainer's weights into the engine whenever the trainer's step changed and samples
``--generations`` completions per prompt with the trainer's sampling settings and step-derived
seeds (a rerun with the same flags samples the same tokens).

Task: GSM-style word problems (``specengine.data.rewards.gsm_task``, generator seed 1234, held out
from the drafter's training data), reward 1 when the number after ``####`` (else the last
number) equals the answer (``exact_answer_reward``). Each step logs generation seconds, tau
(tokens committed per speculative verify step, from the engine's counters), the batch's mean
reward and the engine's weight version. Needs ``pip install -e .[trl]`` (``trl==1.16.0``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental

MODEL = "smollm2-135m-instruct"


def build_trainer(model_dir, rows: list[dict], output_dir: str, *, steps: int,
                  prompts_per_step: int, generations: int, max_completion_length: int,
                  temperature: float = 1.0, learning_rate: float = 1e-6, seed: int = 0,
                  rollout_func=None, generation_kwargs: dict | None = None, callbacks=None,
                  micro_batch: int | None = None):
    """A ``GRPOTrainer`` on CPU for the model in ``model_dir`` (float32): one optimizer step per
    generation batch of ``prompts_per_step`` prompts x ``generations`` samples, no reference
    model (``beta=0``), no gradient checkpointing, logging every step, nothing saved.
    ``rollout_func=None`` keeps TRL's own transformers generation. ``micro_batch``: samples per
    forward/backward of the loss (the batch is then accumulated over several, still one
    generation and one optimizer step per batch; the whole batch in one pass needs about
    24 GB at 8 x 8 x 256 tokens); None: the whole batch at once.

    Raises:
        ValueError: too few rows, or a micro batch that does not divide the batch.
    """
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from specengine.data.rewards import exact_answer_reward

    if len(rows) < steps * prompts_per_step:
        raise ValueError(f"{len(rows)} rows for {steps} steps x {prompts_per_step} prompts")
    batch = prompts_per_step * generations
    micro = micro_batch or batch
    if micro < 1 or batch % micro:
        raise ValueError(f"micro_batch={micro_batch} must divide the batch of {batch} samples")
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    args = GRPOConfig(
        output_dir=output_dir, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
        max_steps=steps, per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        num_generations=generations, max_completion_length=max_completion_length,
        temperature=temperature, learning_rate=learning_rate, seed=seed, data_seed=seed,
        logging_steps=1, gradient_checkpointing=False, disable_tqdm=True,
        generation_kwargs=generation_kwargs)
    return GRPOTrainer(model=model, reward_funcs=exact_answer_reward, args=args,
                       train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                       rollout_func=rollout_func, callbacks=callbacks)


def speculative_config(method: str, policy: str) -> dict | None:
    """``speculative_config`` for ``--speculative`` (``none``: None)."""
    if method == "none":
        return None
    return {"method": method, "policy": policy}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (default 4)")
    ap.add_argument("--generations", type=int, default=4,
                    help="samples per prompt, TRL's num_generations (default 4)")
    ap.add_argument("--max-completion-length", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--learning-rate", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculative", choices=("eagle", "ngram", "none"), default="eagle")
    ap.add_argument("--policy", choices=("auto", "static", "bandit"), default="auto")
    ap.add_argument("--engine-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="engine weights and KV cache (the trainer stays float32)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: torch's default; 1 on a busy shared machine)")
    ap.add_argument("--out", help="write the per-step rows and the run's settings as JSON")
    ap.add_argument("--output-dir", default="/tmp/specengine-grpo-trl",
                    help="TRL's output_dir (nothing is saved there)")
    a = ap.parse_args(argv)
    for name in ("steps", "prompts", "generations", "max_completion_length"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.threads < 0:
        ap.error("--threads must be >= 0")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)

    from specengine import LLM
    from specengine.data.rewards import gsm_task
    from specengine.integrations.trl import RolloutFunc, RolloutLogger
    from specengine.models.loader import resolve_model

    model_dir = resolve_model(MODEL)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), dtype=a.engine_dtype, logprobs_mode="processed_logprobs",
              max_model_len=2048, seed=a.seed,
              speculative_config=speculative_config(a.speculative, a.policy))
    rollout = RolloutFunc(llm, seed=a.seed)
    logger = RolloutLogger(rollout, print_fn=lambda line: print(line, flush=True))
    trainer = build_trainer(
        model_dir, gsm_task(a.steps * a.prompts), a.output_dir, steps=a.steps,
        prompts_per_step=a.prompts, generations=a.generations,
        max_completion_length=a.max_completion_length, temperature=a.temperature,
        learning_rate=a.learning_rate, seed=a.seed, rollout_func=rollout, callbacks=[logger])
    print(f"# loaded engine and trainer in {time.perf_counter() - t0:.1f} s; "
          f"{a.steps} steps of {a.prompts} prompts x {a.generations} samples, "
          f"speculation {a.speculative} ({a.policy})", flush=True)
    trainer.train()
    metrics = llm.get_metrics()
    total = sum(r["generate_seconds"] for r in logger.rows)
    print(f"# generation {total:.1f} s in all, {metrics['generated_tokens']} tokens; "
          f"weight pushes {rollout.num_weight_pushes}; overall tau "
          f"{metrics.get('acceptance_length', float('nan')):.2f}")
    if a.out:
        doc = {"settings": vars(a), "rows": logger.rows,
               "rollouts": [h.as_dict() for h in rollout.history],
               "engine_metrics": {k: v for k, v in metrics.items()
                                  if isinstance(v, (int, float, str, type(None)))}}
        tmp = f"{a.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
