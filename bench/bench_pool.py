"""RolloutPool on Ray: the long-tail RL rollout without and with sample migration.

    python bench/bench_pool.py                # 8 GSM prompts x n=8, T=1, up to 768 tokens
    python bench/bench_pool.py --quick        # 2 prompts x n=4, 96 tokens (a smoke run)

Workload: held-out-style GSM questions (``specengine.data.rewards.gsm_task``, seed 1234, the
question plus the answer-format instruction as one user message) through the model's chat
template; each prompt asks ``n`` samples at T = 1 with a fixed seed per prompt, ``max_tokens``
long, EOS ends a sample, so output lengths spread and the rollout has a long tail. A pool of
``--actors`` actors x 1 CPU (local Ray, ``ray.init(num_cpus=actors)``), the default model in
bfloat16. Modes, on the same pool (prefix cache reset before each; first a warm-up of every
prompt for 8 tokens; with ``--repeats`` the modes alternate and each reports its fastest run):

  ``none``: no migration (``PoolController``; groups placed by predicted work, LPT);
  ``migration``: ``MigrationController`` moves samples from the busiest actor to an idle one
      (two-stage K/V transfer, or re-prefill where the cost rule says so);
  ``migration+training``: migration plus spare-instance EAGLE drafter training on actors that
      ran dry (``spare_training=SpareTraining(seconds=--train-seconds)``); needs
      ``--speculation eagle`` (only an EAGLE drafter trains), else the row says "not run".

``--speculation eagle`` gives every actor the shipped EAGLE drafter in all modes (the pool is
built with spare training; the first two modes switch it off, harvest only, and run first, so
no version trained in mode three reaches them); ``none`` (the default) decodes plainly.

Per mode: wall seconds of ``generate``; per actor, when it ran dry (seconds after the start:
its last request came back with none left; an actor that receives samples later runs again) and
when it returned its last output; migration rounds, samples moved with K/V and re-prefilled,
bytes; overhead as a share of the rollout's wall time: ``controller`` (the driver thread's CPU
seconds in the controller: status polls, decisions, rounds; the driver runs beside the actors;
its wall seconds, waits for steps in progress included, are in the JSON) and ``actor`` (seconds
the actors' engines stood still for the controller: status polls and the export / import
calls). The samples of every mode must be the same (every sample's token ids; the
script fails after writing the JSON when they are not). JSON goes to ``--out`` (written
atomically), a markdown table to stdout.
Measured on a shared machine the numbers are noise; the targets (migration >= 1.25x faster than
none, overhead < 2%) are for a quiet machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import machine_info, markdown_table, quiet_transformers, stderr_logger, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from specengine import SamplingParams  # noqa: E402
from specengine.data.rewards import gsm_task  # noqa: E402
from specengine.distributed import PoolController, RolloutPool  # noqa: E402
from specengine.distributed.migration_controller import MigrationController  # noqa: E402
from specengine.distributed.spare_training import SpareTraining  # noqa: E402
from specengine.models.loader import resolve_model  # noqa: E402
from specengine.models.registry import DEFAULT_MODEL  # noqa: E402

MODES = ("none", "migration", "migration+training")
ACTOR_KEYS = ("migration_stage1_seconds", "migration_stage2_seconds",
              "migration_import_seconds")


class Timeline:
    """Mixin recording, per actor, when each request came back and how many were left."""

    def start(self, t0: float) -> None:
        self.t0, self.events = t0, {}

    def on_output(self, pool, actor_id, index, num_left):
        self.events.setdefault(actor_id, []).append(
            (round(time.perf_counter() - self.t0, 3), num_left))
        super().on_output(pool, actor_id, index, num_left)

    def summary(self) -> dict:
        out = {}
        for a, ev in sorted(self.events.items()):
            dry = [t for t, left in ev if left == 0]
            out[a] = {"first_dry_s": dry[0] if dry else None, "last_output_s": ev[-1][0],
                      "events": ev}
        return out


class PlainTimeline(Timeline, PoolController):
    pass


class MigrationTimeline(Timeline, MigrationController):
    pass


def build_prompts(model: str, num_prompts: int) -> list[dict]:
    """GSM rows through the chat template: ``{"prompt": text, "prompt_token_ids": ids}``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    out = []
    for row in gsm_task(num_prompts):
        text = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        out.append({"prompt": text,
                    "prompt_token_ids": tok(text, add_special_tokens=False).input_ids})
    return out


def actor_seconds(metrics: dict) -> float:
    return sum(m.get(k, 0.0) for m in metrics["actors"].values() for k in ACTOR_KEYS)


def run_mode(pool: RolloutPool, mode: str, prompts, params, interval: float, log) -> dict:
    ctl = PlainTimeline() if mode == "none" else MigrationTimeline(interval=interval)
    pool.controller = ctl
    pool.reset_prefix_cache()
    before = actor_seconds(pool.get_metrics())
    t0 = time.perf_counter()
    ctl.start(t0)
    outs = pool.generate(prompts, params)
    wall = time.perf_counter() - t0
    m = pool.get_metrics()
    stats = ctl.metrics()
    act = actor_seconds(m) - before + stats.get("status_seconds", 0.0)
    lens = [len(c.token_ids) for o in outs for c in o.outputs]
    row = {"mode": mode, "wall_s": wall, "timeline": ctl.summary(),
           "output_tokens": sum(lens), "max_len": max(lens), "mean_len": sum(lens) / len(lens),
           "migration_rounds": stats.get("migration_rounds", 0),
           "migrated_samples": stats.get("migrated_samples", 0),
           "reprefilled_samples": stats.get("reprefilled_samples", 0),
           "migration_bytes": stats.get("migration_bytes", 0),
           "migration_seconds": stats.get("migration_seconds", 0.0),
           "controller_seconds": stats.get("controller_seconds", 0.0),
           "controller_cpu_seconds": stats.get("controller_cpu_seconds", 0.0),
           "actor_overhead_seconds": act,
           "controller_share": stats.get("controller_cpu_seconds", 0.0) / wall,
           "actor_overhead_share": act / wall}
    log(f"{mode}: {wall:.1f}s, {sum(lens)} tokens, moved {row['migrated_samples']} + "
        f"re-prefilled {row['reprefilled_samples']}")
    return row, [[c.token_ids for c in o.outputs] for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=768)
    ap.add_argument("--interval", type=float, default=0.5, help="controller poll seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speculation", choices=("none", "eagle"), default="none")
    ap.add_argument("--train-seconds", type=float, default=2.0,
                    help="spare-training round budget (mode three, --speculation eagle)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per mode, alternating the order; the fastest is reported")
    ap.add_argument("--quick", action="store_true", help="2 prompts x n=4, 96 tokens")
    ap.add_argument("--out", default="bench/results/pool.json")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.n, args.max_tokens = 2, 4, 96
    quiet_transformers()
    log = stderr_logger(time.perf_counter())
    prompts = build_prompts(args.model, args.prompts)
    params = [SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens,
                             seed=args.seed + i) for i in range(len(prompts))]
    ray.init(num_cpus=args.actors, include_dashboard=False, log_to_driver=False)
    eagle = args.speculation == "eagle"
    spare = SpareTraining(seconds=args.train_seconds, min_rollouts=1) if eagle else None
    pool = RolloutPool(args.model, args.actors, seed=args.seed, num_cpus_per_actor=1,
                       dtype=args.dtype, speculative_config={"method": "eagle"} if eagle
                       else None, spare_training=spare)
    if eagle:
        pool.spare.cfg = None  # harvest only until mode three
    log(f"pool of {args.actors} actors up; warm-up (every prompt, 8 tokens)")
    pool.generate(prompts, [SamplingParams(n=args.n, temperature=1.0, max_tokens=8, seed=p.seed)
                            for p in params])
    runs, samples = {m: [] for m in MODES[:2]}, {}
    for k in range(args.repeats):  # modes alternate, so drift hits both alike
        for mode in (MODES[:2] if k % 2 == 0 else MODES[1::-1]):
            row, samples[mode] = run_mode(pool, mode, prompts, params, args.interval, log)
            if runs[mode] and samples[mode] != runs[mode][0][1]:
                raise AssertionError(f"{mode}: a repeat gave other samples")
            runs[mode].append((row, samples[mode]))
    rows = []
    for mode in MODES[:2]:
        best = min((r for r, _ in runs[mode]), key=lambda r: r["wall_s"])
        best["wall_s_all"] = [r["wall_s"] for r, _ in runs[mode]]
        rows.append(best)
    differ = sum(a != b for x, y in zip(samples["migration"], samples["none"])
                 for a, b in zip(x, y))
    if eagle:
        pool.spare.cfg = spare
        row, samples[MODES[2]] = run_mode(pool, MODES[2], prompts, params, args.interval, log)
        m = pool.get_metrics()
        row["spare_training"] = m["spare_training"]
        row["tau_per_drafter_version"] = m["tau_per_drafter_version"]
        rows.append(row)
        differ += sum(a != b for x, y in zip(samples[MODES[2]], samples["none"])
                      for a, b in zip(x, y))
    else:
        rows.append({"mode": "migration+training", "wall_s": None,
                     "not_run": "spare-instance training needs --speculation eagle"})
    base = rows[0]["wall_s"]
    for r in rows:
        r["speedup"] = base / r["wall_s"] if r.get("wall_s") else None
    pool.shutdown()
    ray.shutdown()
    doc = {"machine": machine_info(), "args": vars(args), "model": args.model,
           "identical_samples": differ == 0, "samples_differing": differ, "modes": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, doc)
    print(markdown_table(
        ["mode", "wall s", "speedup", "moved (K/V)", "re-prefilled", "MB moved",
         "controller %", "actor overhead %", "actor dry at s"],
        [[r["mode"], r.get("wall_s"), r.get("speedup"), r.get("migrated_samples"),
          r.get("reprefilled_samples"),
          r["migration_bytes"] / 1e6 if "migration_bytes" in r else None,
          100 * r["controller_share"] if "controller_share" in r else None,
          100 * r["actor_overhead_share"] if "actor_overhead_share" in r else None,
          " / ".join(f"{a}:{v['first_dry_s']}" for a, v in r["timeline"].items())
          if "timeline" in r else "not run"] for r in rows]))
    assert differ == 0, f"migration changed {differ} samples (results written to {args.out})"


if __name__ == "__main__":
    main()
