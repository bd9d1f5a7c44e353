"""TRL GRPO with several generation backends, same seeds: what specengine buys an RL step.

    python bench/bench_rl.py [--out bench/results/rl.json]   # 2 steps, 2 prompts x 4, 64 tokens
    python bench/bench_rl.py --steps 10 --prompts 8 --generations 8 --max-completion-length 256
    python bench/bench_rl.py --rollout-epochs 3 [...]   # multi-epoch rollouts: bench/rl_epochs.py

TRL's real ``GRPOTrainer`` (``trl==1.16.0``) trains ``smollm2-135m-instruct`` (transformers,
float32, CPU) on GSM-style questions (``specengine.data.rewards.gsm_task``, seed 1234) with the
exact-answer reward, for ``--steps`` optimizer steps, once per backend; the trainer, data order
and seeds are the same in every run:

  (a) ``trl``: TRL's built-in generation (``use_vllm=False``, no ``rollout_func``: the
      trainer's model calls transformers ``generate`` on the left-padded batch);
  (b) ``specengine``: ``RolloutFunc`` over a ``specengine.LLM`` without speculation;
  (c) ``specengine+eagle``: the same with ``speculative_config={"method": "eagle"}`` (policy
      ``auto``) and the EAGLE drafter trained online: the engine harvests each step's rollouts
      (token ids and the target's features, recorded during decoding: no extra forward;
      ``speculative.training.harvest``) and after every GRPO step but the last
      ``DrafterTrainer.train_now(--train-steps)`` fits the shipped drafter on the newest
      ``--train-window`` rollouts and swaps the new version in before the next step's
      generation (``OnlineDrafter``);
  (c') ``specengine+eagle-frozen``: (c) with the shipped drafter left frozen;
  (d) ``specengine+suffix+eagle``: ``{"method": ["suffix", "eagle"]}``: the rollout-memory
      drafter (the prompt's GRPO siblings and earlier samples) and EAGLE merged into one token
      tree, the EAGLE part trained online as in (c).

Per step: generation seconds (transformers ``generate`` for (a), ``LLM.generate`` for the
others; harvesting included), rollout seconds (TRL's whole ``_generate``: tokenization, weight
push, generation, decoding), weight-sync seconds, tau (tokens committed per speculative verify
step, from the engine's counters), the EAGLE drafter version the step drafted with, drafter
training seconds after the step (not in generation, rollout or step seconds), reward (the
batch mean TRL logs), TRL's step time; per run ``tau_by_drafter_version`` (tau pooled over the
steps each drafter version drafted for, from the engine's counters) and the drafter's own
``tau_per_version`` (``EagleDrafter.stats``; it counts in the drafter's ``observe`` hook, so
the two need not agree). Then every specengine backend runs ``--t0-steps`` more steps with
greedy generation (``generation_kwargs={"temperature": 0.0}``, drafters trained online as in
the sampled run) to check that each speculative backend's samples equal (b)'s token for token
at T=0 (``t0_identical``); the sampled runs are compared too (``sampled_identical``: same
step-derived seeds). The engines run in ``--engine-dtype`` (float32: the trainer's weights
arrive exactly). Results go to ``--out`` (JSON, written atomically) and a markdown table is
printed. ``--threads 1`` on a machine shared with other jobs: with 2 threads on 2 busy cores,
OpenMP threads wait on each other (a batch-2 float32 linear of the default model measured 35 ms
with 2 threads, 0.65 ms with 1).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

from common import (
    machine_info,
    markdown_table,
    quiet_transformers,
    stderr_logger,
    timed_method,
    write_json,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from grpo_trl import build_trainer  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from specengine import LLM  # noqa: E402
from specengine.data.rewards import gsm_task  # noqa: E402
from specengine.integrations.trl import RolloutFunc  # noqa: E402
from specengine.models.loader import resolve_model  # noqa: E402
from specengine.speculative.drafters.merged import MergedDrafter  # noqa: E402
from specengine.speculative.training.fit import TrainConfig  # noqa: E402
from specengine.speculative.training.harvest import HiddenBuffer, harvest  # noqa: E402
from specengine.speculative.training.online import DrafterTrainer  # noqa: E402

MODEL = "smollm2-135m-instruct"
# backend -> (speculative_config, whether its EAGLE drafter trains online between steps)
SPEC = {"trl": (None, False), "specengine": (None, False),
        "specengine+eagle": ({"method": "eagle", "policy": "auto"}, True),
        "specengine+eagle-frozen": ({"method": "eagle", "policy": "auto"}, False),
        "specengine+suffix+eagle": ({"method": ["suffix", "eagle"], "policy": "auto"}, True)}
BACKENDS = tuple(SPEC)


class Recorder:
    """A rollout_func around ``RolloutFunc`` that keeps each step's completion ids and
    the EAGLE drafter version its generation used (None without EAGLE)."""

    def __init__(self, rollout: RolloutFunc, eagle=None):
        self.rollout, self.eagle = rollout, eagle
        self.completions, self.drafter_versions = [], []

    def __call__(self, prompts, trainer):
        out = self.rollout(prompts, trainer)
        self.completions.append(out["completion_ids"])
        self.drafter_versions.append(self.eagle.version if self.eagle is not None else None)
        return out


def eagle_of(llm: LLM):
    """The engine's ``EagleDrafter`` (the ``eagle`` part of a merged drafter); None without."""
    d = llm.engine.drafter
    if isinstance(d, MergedDrafter):
        return d.part("eagle")
    return d if getattr(d, "name", None) == "eagle" else None


class OnlineDrafter(TrainerCallback):
    """Trains the engine's EAGLE drafter between GRPO steps on the rollouts it generated.

    ``harvest`` wraps the engine's drafter so that every finished sequence's token ids and the
    target's features (recorded during decoding: no extra forward) go into a ``HiddenBuffer``
    of the newest ``window`` rollouts. After each optimizer step but the last (TRL calls
    ``on_step_end`` after the step's generation and update, before the next generation),
    ``DrafterTrainer.train_now(steps)`` fits the drafter on that buffer and publishes a new
    version, swapped in at once (the engine is idle), so step i+1 drafts with version i+1.
    Training seconds are wall seconds of ``train_now`` and the swap, kept out of generation
    and TRL's step time. The loss is ``training.fit``'s (EAGLE arXiv 2401.15077, EAGLE-3's
    training-time test arXiv 2503.01840), unrolled 2 steps here.
    """

    def __init__(self, llm: LLM, eagle, steps: int, rounds: int, window: int,
                 batch_tokens: int, lr: float, seed: int):
        self.eagle, self.steps = eagle, steps
        self.buffer = HiddenBuffer(max_items=window, max_bytes=1 << 30)
        harvest(llm, self.buffer)
        total = max(1, steps * rounds)  # the learning-rate schedule spans every round
        cfg = TrainConfig(steps=total, batch_tokens=batch_tokens, lr=lr,
                          warmup=max(1, min(10, total // 10)), unroll=2, max_len=384, seed=seed)
        self.trainer = DrafterTrainer(eagle, self.buffer, cfg, min_rollouts=1)
        self.rounds: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:  # no later generation would use it
            return control
        t0 = time.perf_counter()
        done = self.trainer.train_now(self.steps)
        version = self.eagle.swap()
        self.rounds.append({"after_step": state.global_step - 1, "train_steps": done,
                            "train_seconds": time.perf_counter() - t0,
                            "loss": self.trainer.last.get("loss"),
                            "rollouts": len(self.buffer), "drafter_version": version})
        return control


def run(backend: str, a, model_dir, rows, steps: int, greedy: bool, log) -> dict:
    """One GRPO run; returns its per-step rows, completions and engine metrics."""
    llm = rollout = recorder = online = None
    spec, train = SPEC[backend]
    if backend != "trl":
        llm = LLM(str(model_dir), dtype=a.engine_dtype, logprobs_mode="processed_logprobs",
                  max_model_len=1024, kv_cache_memory_bytes=256 << 20, seed=a.seed,
                  speculative_config=spec)
        eagle = eagle_of(llm)
        if train and a.train_steps:
            online = OnlineDrafter(llm, eagle, a.train_steps, steps - 1, a.train_window,
                                   a.train_batch_tokens, a.train_lr, a.seed)
        rollout = RolloutFunc(llm, seed=a.seed)
        recorder = Recorder(rollout, eagle)
    gen_kwargs = None
    if greedy:
        gen_kwargs = {"do_sample": False} if backend == "trl" else {"temperature": 0.0}
    trainer = build_trainer(
        model_dir, rows, a.output_dir, steps=steps, prompts_per_step=a.prompts,
        generations=a.generations, max_completion_length=a.max_completion_length,
        learning_rate=a.learning_rate, seed=a.seed, rollout_func=recorder,
        generation_kwargs=gen_kwargs, callbacks=[online] if online else None,
        micro_batch=a.train_micro_batch)
    rollout_seconds, hf_generate_seconds = [], []
    timed_method(trainer, "_generate", rollout_seconds)
    if backend == "trl":
        timed_method(trainer.model, "generate", hf_generate_seconds)
    t0 = time.perf_counter()
    trainer.train()
    trained = (f"; drafter trained {sum(r['train_steps'] for r in online.rounds)} steps in "
               f"{sum(r['train_seconds'] for r in online.rounds):.0f} s") if online else ""
    log(f"{backend}{' (T=0)' if greedy else ''}: {steps} steps in "
        f"{time.perf_counter() - t0:.0f} s{trained}")
    logs = [h for h in trainer.state.log_history if "reward" in h]
    out_rows = []
    rounds = {r["after_step"]: r for r in online.rounds} if online else {}
    for i in range(steps):
        row = {"step": i, "reward": logs[i]["reward"] if i < len(logs) else None,
               "step_time": logs[i].get("step_time") if i < len(logs) else None,
               "rollout_seconds": rollout_seconds[i]}
        if backend == "trl":
            row.update(generate_seconds=hf_generate_seconds[i], sync_seconds=None, tau=None,
                       generated_tokens=None, drafter_version=None)
        else:
            h = rollout.history[i]
            row.update(generate_seconds=h.generate_seconds, sync_seconds=h.sync_seconds,
                       tau=h.tau, generated_tokens=h.generated_tokens,
                       tokens_per_forward=h.tokens_per_forward,
                       spec_steps=h.spec_steps, accepted_tokens=h.accepted_tokens,
                       drafter_version=recorder.drafter_versions[i])
        r = rounds.get(i, {})  # the drafter training that followed this step
        row.update(train_seconds=r.get("train_seconds"), train_steps=r.get("train_steps"),
                   train_loss=r.get("loss"), train_rollouts=r.get("rollouts"))
        out_rows.append(row)
    result = {"backend": backend, "greedy": greedy, "rows": out_rows,
              "completions": recorder.completions if recorder else None}
    if llm is not None:
        m = llm.get_metrics()
        result["engine"] = {k: m.get(k) for k in (
            "generated_tokens", "acceptance_length", "spec_steps", "prefix_cache_hit_rate",
            "policy_strategies", "drafter_version", "tau_per_version",
            "merged_nodes_kept") if k in m}
    result["online_training"] = online is not None
    del trainer, llm, rollout, recorder, online
    gc.collect()
    return result


def tau_by_version(rows: list[dict]) -> dict | None:
    """Drafter version -> tau pooled over the steps that drafted with it, from the engine's
    counters: ``(accepted + spec_steps) / spec_steps`` (None without an EAGLE drafter)."""
    pooled: dict = {}
    for x in rows:
        if x.get("drafter_version") is not None and x.get("spec_steps"):
            c = pooled.setdefault(x["drafter_version"], [0, 0])
            c[0] += x["spec_steps"]
            c[1] += x["accepted_tokens"]
    return {v: (acc + n) / n for v, (n, acc) in pooled.items()} or None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    mode = [i for i, x in enumerate(argv) if x.split("=", 1)[0] == "--rollout-epochs"]
    if mode:  # the multi-epoch rollout mode (rl_epochs.py), wherever the flag stands
        import rl_epochs

        i = mode[0]
        flag = argv.pop(i)
        if "=" in flag:
            epochs = flag.split("=", 1)[1]
        elif i < len(argv) and not argv[i].startswith("--"):
            epochs = argv.pop(i)
        else:
            raise SystemExit("bench_rl.py: --rollout-epochs needs a number of epochs (>= 1)")
        return rl_epochs.main(["--epochs", epochs, *argv])
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="--rollout-epochs N [options]: multi-epoch RL rollouts instead (bench/rl_epochs.py;"
               " `python bench/rl_epochs.py --help` lists its options)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step")
    ap.add_argument("--generations", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-completion-length", type=int, default=64)
    ap.add_argument("--t0-steps", type=int, default=1,
                    help="greedy steps of the specengine backends for the T=0 equality check "
                         "(0: skip)")
    ap.add_argument("--train-steps", type=int, default=20,
                    help="drafter optimizer steps after each GRPO step for the online-trained "
                         "backends (0: they stay frozen)")
    ap.add_argument("--train-window", type=int, default=256,
                    help="the drafter trains on the newest this many harvested rollouts")
    ap.add_argument("--train-batch-tokens", type=int, default=1024)
    ap.add_argument("--train-lr", type=float, default=5e-4)
    ap.add_argument("--learning-rate", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-micro-batch", type=int, default=None,
                    help="samples per loss forward/backward (gradient accumulation; one "
                         "generation and optimizer step per batch still); default: the batch")
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
    for name in ("steps", "prompts", "generations", "max_completion_length", "train_window",
                 "train_batch_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("threads", "train_steps", "t0_steps"):
        if getattr(a, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
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
             "step_time": mean(x["step_time"] for x in r["rows"]),
             "online_training": r["online_training"],
             "train_seconds_per_step": mean(x.get("train_seconds") for x in r["rows"]),
             "drafter_versions": [x.get("drafter_version") for x in r["rows"]],
             "tau_by_drafter_version": tau_by_version(r["rows"]),
             "tau_per_version": (r.get("engine") or {}).get("tau_per_version")}
        summary[r["backend"]] = s
        table.append([r["backend"], gen, s["rollout_seconds_per_step"], s["speedup_vs_trl"],
                      " ".join("-" if x["tau"] is None else f"{x['tau']:.2f}"
                               for x in r["rows"]),
                      " ".join("-" if v is None else str(v) for v in s["drafter_versions"]),
                      s["train_seconds_per_step"],
                      " ".join(f"{x:.3f}" for x in s["rewards"] if x is not None),
                      s["sync_seconds"], s["step_time"]])
    checks = {}
    spec_names = [b for b in by_name if b not in ("trl", "specengine")]
    if "specengine" in by_name and spec_names:
        # lossless speculation: every drafter (frozen or retrained) gives plain decoding's tokens
        checks["sampled_identical"] = {b: by_name[b]["completions"]
                                       == by_name["specengine"]["completions"]
                                       for b in spec_names}
        g = {r["backend"]: r for r in greedy_runs}
        if g:
            checks["t0_identical"] = {b: g[b]["completions"] == g["specengine"]["completions"]
                                      for b in spec_names}
            checks["t0_tau"] = {b: [x["tau"] for x in g[b]["rows"]] for b in spec_names}
    doc = {"settings": vars(a), "machine": machine_info(), "summary": summary,
           "checks": checks, "runs": runs, "greedy_runs": greedy_runs}
    if a.out:
        write_json(a.out, doc)
    print(markdown_table(["backend", "generation s/step", "rollout s/step", "vs TRL",
                          "tau per step", "drafter version per step", "train s/step",
                          "reward per step", "sync s", "step s"], table))
    print()
    for k, v in checks.items():
        print(f"{k}: {v}")
    for b, s in summary.items():
        if s["tau_by_drafter_version"]:
            print(f"{b}: tau by drafter version (engine counters) "
                  f"{ {v: round(t, 3) for v, t in s['tau_by_drafter_version'].items()} }; "
                  f"EagleDrafter.stats tau_per_version {s['tau_per_version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
