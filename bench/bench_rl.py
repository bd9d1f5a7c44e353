"""TRL GRPO with three generation backends, same seeds: what specengine buys an RL step.

    python bench/bench_rl.py [--out bench/results/rl.json]   # 2 steps, 2 prompts x 4, 64 tokens
    python bench/bench_rl.py --steps 10 --prompts 8 --generations 8 --max-completion-length 256
    python bench/bench_rl.py --rollout-epochs 3 [...]   # multi-epoch rollouts: bench/rl_epochs.py

TRL's real ``GRPOTrainer`` (``trl==1.16.0``) trains ``smollm2-135m-instruct`` (transformers,
float32, CPU) on GSM-style questions (``specengine.rewards.gsm_task``, seed 1234) with the
exact-answer reward, for ``--steps`` optimizer steps, once per backend; the trainer, data order
and seeds are the same in every run:

  (a) ``trl``: TRL's built-in generation (``use_vllm=False``, no ``rollout_func``: the
      trainer's model calls transformers ``generate`` on the left-padded batch);
  (b) ``specengine``: ``SpecEngineRollout`` over a ``specengine.LLM`` without speculation;
  (c) ``specengine+eagle``: the same with ``speculative_config={"method": "eagle"}`` (the
      shipped, frozen EAGLE drafter; policy ``auto``).

Per step: generation seconds (transformers ``generate`` for (a), ``LLM.generate`` for (b),
(c)), rollout seconds (TRL's whole ``_generate``: tokenization, weight push for (b), (c),
generation, decoding), weight-sync seconds, tau (tokens committed per speculative verify step,
from the engine's counters), reward (the batch mean TRL logs), TRL's step time. Then
(b) and (c) run ``--t0-steps`` more steps with greedy generation
(``generation_kwargs={"temperature": 0.0}``) to check that (c)'s samples equal (b)'s token for
token at T=0; the sampled runs are compared too (same step-derived seeds). The engines run in
``--engine-dtype`` (float32: the trainer's weights arrive exactly). Results go to ``--out``
(JSON, written atomically) and a markdown table is printed. ``--threads 1`` on a machine
shared with other jobs: with 2 threads on 2 busy cores, OpenMP threads wait on each other (a
batch-2 float32 linear of the default model measured 35 ms with 2 threads, 0.65 ms with 1).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

from common import machine_info, markdown_table, quiet_transformers, stderr_logger, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from grpo_trl import build_trainer  # noqa: E402

from specengine import LLM  # noqa: E402
from specengine.integrations.trl import SpecEngineRollout  # noqa: E402
from specengine.models.loader import resolve_model  # noqa: E402
from specengine.rewards import gsm_task  # noqa: E402

MODEL = "smollm2-135m-instruct"
BACKENDS = ("trl", "specengine", "specengine+eagle")


class Recorder:
    """A rollout_func around ``SpecEngineRollout`` that keeps each step's completion ids."""

    def __init__(self, rollout: SpecEngineRollout):
        self.rollout, self.completions = rollout, []

    def __call__(self, prompts, trainer):
        out = self.rollout(prompts, trainer)
        self.completions.append(out["completion_ids"])
        return out


def timed_method(obj, name: str, sink: list) -> None:
    """Replace ``obj.name`` by a wrapper appending each call's wall seconds to ``sink``."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def run(backend: str, a, model_dir, rows, steps: int, greedy: bool, log) -> dict:
    """One GRPO run; returns its per-step rows, completions and engine metrics."""
    llm = rollout = recorder = None
    if backend != "trl":
        spec = {"method": "eagle", "policy": "auto"} if backend == "specengine+eagle" else None
        llm = LLM(str(model_dir), dtype=a.engine_dtype, logprobs_mode="processed_logprobs",
                  max_model_len=1024, kv_cache_memory_bytes=256 << 20, seed=a.seed,
                  speculative_config=spec)
        rollout = SpecEngineRollout(llm, seed=a.seed)
        recorder = Recorder(rollout)
    gen_kwargs = None
    if greedy:
        gen_kwargs = {"do_sample": False} if backend == "trl" else {"temperature": 0.0}
    trainer = build_trainer(
        model_dir, rows, a.output_dir, steps=steps, prompts_per_step=a.prompts,
        generations=a.generations, max_completion_length=a.max_completion_length,
        learning_rate=a.learning_rate, seed=a.seed, rollout_func=recorder,
        generation_kwargs=gen_kwargs)
    rollout_seconds, hf_generate_seconds = [], []
    timed_method(trainer, "_generate", rollout_seconds)
    if backend == "trl":
        timed_method(trainer.model, "generate", hf_generate_seconds)
    t0 = time.perf_counter()
    trainer.train()
    log(f"{backend}{' (T=0)' if greedy else ''}: {steps} steps in "
        f"{time.perf_counter() - t0:.0f} s")
    logs = [h for h in trainer.state.log_history if "reward" in h]
    out_rows = []
    for i in range(steps):
        row = {"step": i, "reward": logs[i]["reward"] if i < len(logs) else None,
               "step_time": logs[i].get("step_time") if i < len(logs) else None,
               "rollout_seconds": rollout_seconds[i]}
        if backend == "trl":
            row.update(generate_seconds=hf_generate_seconds[i], sync_seconds=None, tau=None,
                       generated_tokens=None)
        else:
            h = rollout.history[i]
            row.update(generate_seconds=h.generate_seconds, sync_seconds=h.sync_seconds,
                       tau=h.tau, generated_tokens=h.generated_tokens,
                       tokens_per_forward=h.tokens_per_forward)
        out_rows.append(row)
    result = {"backend": backend, "greedy": greedy, "rows": out_rows,
              "completions": recorder.completions if recorder else None}
    if llm is not None:
        m = llm.get_metrics()
        result["engine"] = {k: m.get(k) for k in (
            "generated_tokens", "acceptance_length", "spec_steps", "prefix_cache_hit_rate",
            "policy_strategies") if k in m}
    del trainer, llm, rollout, recorder
    gc.collect()
    return result


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].startswith("--rollout-epochs"):  # the multi-epoch rollout mode
        import rl_epochs

        first = argv.pop(0)
        epochs = first.split("=", 1)[1] if "=" in first else argv.pop(0)
        return rl_epochs.main(["--epochs", epochs, *argv])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--generations", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-completion-length", type=int, default=64)
    ap.add_argument("--t0-steps", type=int, default=1,
                    help="greedy steps of (b) and (c) for the T=0 equality check (0: skip)")
    ap.add_argument("--learning-rate", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads for everything (0: torch's default); on a "
                         "machine shared with other jobs, 1 avoids OpenMP threads waiting on "
                         "each other")
    ap.add_argument("--backends", default=",".join(BACKENDS),
                    help=f"comma-separated subset of {BACKENDS}")
    ap.add_argument("--output-dir", default="/tmp/specengine-bench-rl")
    ap.add_argument("--out", help="JSON results file")
    a = ap.parse_args(argv)
    backends = [b for b in a.backends.split(",") if b]
    if not backends or any(b not in BACKENDS for b in backends):
        ap.error(f"--backends: use names from {BACKENDS}")
    for name in ("steps", "prompts", "generations", "max_completion_length"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.threads < 0:
        ap.error("--threads must be >= 0")
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    quiet_transformers()
    log = stderr_logger(time.perf_counter())
    model_dir = resolve_model(MODEL)
    rows = gsm_task(max(a.steps, a.t0_steps) * a.prompts)
    runs = [run(b, a, model_dir, rows, a.steps, False, log) for b in backends]
    greedy_runs = [run(b, a, model_dir, rows, a.t0_steps, True, log)
                   for b in backends if b != "trl"] if a.t0_steps else []

    by_name = {r["backend"]: r for r in runs}
    base = mean(r["generate_seconds"] for r in by_name["trl"]["rows"]) \
        if "trl" in by_name else None
    table, summary = [], {}
    for r in runs:
        gen = mean(x["generate_seconds"] for x in r["rows"])
        s = {"generate_seconds_per_step": gen,
             "rollout_seconds_per_step": mean(x["rollout_seconds"] for x in r["rows"]),
             "speedup_vs_trl": base / gen if base and gen else None,
             "tau": mean(x["tau"] for x in r["rows"]),
             "sync_seconds": mean(x["sync_seconds"] for x in r["rows"]),
             "rewards": [x["reward"] for x in r["rows"]],
             "step_time": mean(x["step_time"] for x in r["rows"])}
        summary[r["backend"]] = s
        table.append([r["backend"], gen, s["rollout_seconds_per_step"], s["speedup_vs_trl"],
                      " ".join("-" if x["tau"] is None else f"{x['tau']:.2f}"
                               for x in r["rows"]),
                      " ".join(f"{x:.3f}" for x in s["rewards"] if x is not None),
                      s["sync_seconds"], s["step_time"]])
    checks = {}
    if {"specengine", "specengine+eagle"} <= set(by_name):
        checks["sampled_identical"] = (by_name["specengine"]["completions"]
                                       == by_name["specengine+eagle"]["completions"])
        g = {r["backend"]: r for r in greedy_runs}
        if g:
            checks["t0_identical"] = (g["specengine"]["completions"]
                                      == g["specengine+eagle"]["completions"])
            checks["t0_tau"] = [x["tau"] for x in g["specengine+eagle"]["rows"]]
    doc = {"settings": vars(a), "machine": machine_info(), "summary": summary,
           "checks": checks, "runs": runs, "greedy_runs": greedy_runs}
    if a.out:
        write_json(a.out, doc)
    print(markdown_table(["backend", "generation s/step", "rollout s/step", "vs TRL",
                          "tau per step", "reward per step", "sync s", "step s"], table))
    print()
    for k, v in checks.items():
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
