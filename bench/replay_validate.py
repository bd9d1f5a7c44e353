"""Validate the replay projection on this machine: the same small RL-shaped rollout (GSM-style
prompts through the chat template, ``n`` samples each, T = 1, seeded) run under no
speculation, a static chain and the ``auto`` policy, each traced and timed; then each run's
wall time predicted with a cost table measured on this machine, and the errors reported
(issue 16's target: within 10% for off, static and auto).

Predictions (``specengine.replay.projection``):

- ``off``: the plain run's trace replayed under ``off`` (its output lengths, one token a step);
- ``static``: the plain run's trace under ``static:d=D`` with the acceptance statistics of the
  static run's trace (so the batch shrinking, the step count and the tokens per forward are
  all predicted, not replayed); the static trace's own ``static`` and ``as-logged`` replays
  are reported too;
- ``auto``: the auto run's trace replayed ``as-logged`` (which strategy ran when is the
  policy's choice; the replay prices it).

Also reports each prediction's forward seconds against the forward seconds the trace logged,
and the H200-class roofline PROJECTION of the same policies (not a measurement).

    python bench/replay_validate.py [--table cpu_table.json] [--prompts 4 --n 4
        --max-tokens 128 --drafter eagle --depth 4] [--out bench/results/replay_validate.json]

Without ``--table`` a quick table is measured first (``bench/step_costs.py --quick``) and
saved next to the output. Traces go to ``<out stem>_traces/``. ``--repeats N`` runs each policy
N times, interleaved, and compares the median run (the others' traces are deleted). On a busy
machine the measured times move by more than the target; rerun it alone. The table is timed at
the kernels' full thread count; the engine's adaptive thread count
(``SPECENGINE_ADAPTIVE_THREADS``, default on) may pick fewer threads for some steps, which the
table does not model: on a quiet machine it keeps the full count, else set it to 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from common import machine_info, quiet_transformers, write_json
from step_costs import QUICK, gpu_table, measure_table

from specengine import LLM, SamplingParams
from specengine.data.prompt_sets import gsm_questions
from specengine.models.registry import DEFAULT_MODEL
from specengine.replay.cost_table import CostTable
from specengine.replay.projection import AcceptanceStats, replay

EVAL_GSM_SEED = 1234  # prompts the shipped drafter never saw (as bench_adaptive.py)


def rollout(model: str, dtype: str, spec: dict | None, cfg: dict, trace_path: Path) -> dict:
    """Run the rollout once with ``spec`` (None: no speculation), traced; returns the trace,
    the measured seconds of ``chat`` and the output token ids."""
    llm = LLM(model, dtype=dtype, speculative_config=spec)
    qs = gsm_questions(cfg["prompts"], seed=EVAL_GSM_SEED)
    convs = [[{"role": "user", "content": q["question"] + "\nThink step by step."}] for q in qs]
    params = [SamplingParams(n=cfg["n"], temperature=1.0, seed=i, max_tokens=cfg["max_tokens"])
              for i in range(len(convs))]
    llm.chat(convs[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    llm.start_trace()
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    trace = llm.stop_trace()
    trace.save(trace_path)
    return {"trace": trace, "seconds": seconds, "path": str(trace_path),
            "outputs": [list(o.token_ids) for r in outs for o in r.outputs]}


def compare(result, measured: float, logged_forward: float) -> dict:
    """A prediction against the measured seconds: absolute and relative errors."""
    return {"predicted_s": result.seconds, "measured_s": measured,
            "abs_error_s": result.seconds - measured,
            "rel_error": (result.seconds - measured) / measured,
            "predicted_forward_s": result.forward_s, "logged_forward_s": logged_forward,
            "predicted_steps": result.steps, "warnings": result.warnings}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--table", default=None, help="a measured cost table (default: measure)")
    ap.add_argument("--gpu-table", default=None,
                    help="cost table of the GPU projection, made for --model (default: the "
                         "H200-class roofline of --model, a projection, not a measurement)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--drafter", default="eagle", help="ngram | eagle")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each policy, interleaved; the median run is compared")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "replay_validate.json"))
    args = ap.parse_args(argv)
    quiet_transformers()
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"# [{time.perf_counter() - start:5.0f}s] {msg}", file=sys.stderr, flush=True)

    out = Path(args.out)
    traces = out.parent / f"{out.stem}_traces"
    traces.mkdir(parents=True, exist_ok=True)
    if args.table:
        table = CostTable.load(args.table)
    else:
        log("measuring a quick cost table")
        doc = measure_table(args.model, args.dtype, QUICK, [args.drafter], log)
        table = CostTable(doc)
        table.save(out.parent / f"{out.stem}_table.json")
    gpu = gpu_table(args.gpu_table, args.model)
    cfg = {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens}
    d = args.depth
    specs = {"off": None,
             "static": {"method": args.drafter, "num_speculative_tokens": d, "policy": "static"},
             "auto": {"method": args.drafter, "num_speculative_tokens": d, "policy": "auto"}}
    all_runs: dict[str, list] = {k: [] for k in specs}
    for rep in range(args.repeats):  # interleaved, so a change of load hits every policy
        for name, spec in specs.items():
            r = rollout(args.model, args.dtype, spec, cfg, traces / f"{name}_{rep}.json")
            all_runs[name].append(r)
            log(f"{name}: {r['seconds']:.2f} s, {r['trace'].output_tokens} tokens, "
                f"{len(r['trace'].steps)} steps")
    # the median run (the faster of the middle two for an even count)
    runs = {k: sorted(v, key=lambda r: r["seconds"])[(len(v) - 1) // 2]
            for k, v in all_runs.items()}
    for k, v in all_runs.items():  # keep only the compared runs' traces
        for r in v:
            if r is not runs[k]:
                Path(r["path"]).unlink()
    off_t, static_t, auto_t = (runs[k]["trace"] for k in ("off", "static", "auto"))
    accept = AcceptanceStats(static_t)
    static_policy = f"static:d={d},source={args.drafter}"

    def fwd(name: str) -> float:
        return sum(st["forward_s"] for st in runs[name]["trace"].steps)

    predictions = {
        "off": compare(replay(off_t, table, "off"), runs["off"]["seconds"], fwd("off")),
        "static": compare(replay(off_t, table, static_policy, accept),
                          runs["static"]["seconds"], fwd("static")),
        "auto": compare(replay(auto_t, table, "as-logged"), runs["auto"]["seconds"],
                        fwd("auto"))}
    extra = {
        "off_as_logged": compare(replay(off_t, table, "as-logged"), runs["off"]["seconds"],
                                 fwd("off")),
        "static_from_static_trace": compare(replay(static_t, table, static_policy),
                                            runs["static"]["seconds"], fwd("static")),
        "static_as_logged": compare(replay(static_t, table, "as-logged"),
                                    runs["static"]["seconds"], fwd("static"))}
    gpu_off = replay(off_t, gpu, "off").seconds
    projection = {}
    for name, (tr, pol, st) in {"off": (off_t, "off", None),
                                "static": (off_t, static_policy, accept),
                                "auto": (auto_t, "as-logged", None)}.items():
        s = replay(tr, gpu, pol, st).seconds
        projection[name] = {"projected_s": s, "speedup_vs_off": gpu_off / s}
    same = runs["off"]["outputs"] == runs["static"]["outputs"] == runs["auto"]["outputs"]
    doc = {"config": dict(cfg, model=args.model, dtype=args.dtype, drafter=args.drafter,
                          depth=d, temperature=1.0, table=table.label, gpu_table=gpu.label),
           "machine": machine_info(), "outputs_identical": same,
           "measured_s": {k: r["seconds"] for k, r in runs.items()},
           "measured_s_all_runs": {k: [r["seconds"] for r in v] for k, v in all_runs.items()},
           "measured_speedup_vs_off": {k: runs["off"]["seconds"] / r["seconds"]
                                       for k, r in runs.items()},
           "predictions": predictions, "extra_predictions": extra,
           "within_10pct": {k: abs(v["rel_error"]) <= 0.10 for k, v in predictions.items()},
           "gpu_projection": {"note": "H200-class roofline PROJECTION, not a measurement",
                              **projection},
           "traces": {k: os.path.relpath(r["path"], out.parent) for k, r in runs.items()}}
    write_json(str(out), doc)
    print("| policy | measured s | predicted s | abs error s | rel error | "
          "H200 projection s (speedup) |")
    print("|---|---|---|---|---|---|")
    for k, v in predictions.items():
        p = projection[k]
        print(f"| {k} | {v['measured_s']:.3f} | {v['predicted_s']:.3f} | "
              f"{v['abs_error_s']:+.3f} | {v['rel_error']:+.1%} | "
              f"{p['projected_s']:.4f} ({p['speedup_vs_off']:.2f}x) |")
    print(f"outputs identical across policies: {same}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
