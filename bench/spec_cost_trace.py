"""What an ``auto`` engine's speculative steps cost, apart from how fast the engine runs.

One process holds a plain engine, an engine with ``--method`` under ``auto`` and a second
plain engine built last (the control); they run the same groups of ``--batch`` HumanEval
prompts in lockstep (shuffled order, 2 rounds; greedy, 128 tokens). Every step's seconds are
recorded with whether it drafted. Per run it prints each engine's wall against plain, the
median step of each engine, and for the ``auto`` engine the seconds its speculative steps
(probes included) took beyond its own median non-speculative step: what speculation cost or
saved there. The rest of the gap to plain is how fast that engine's plain steps run: two
plain engines of one process differ by a few percent (the control shows how much).

    python bench/spec_cost_trace.py --batch 4 --runs 4 [--method eagle] [--out F]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench_decode import MODEL, engine_llm
from common import machine_info, quiet_transformers, write_json
from transformers import AutoTokenizer

import specengine.engine.phases as phases
from specengine import SamplingParams
from specengine.data.prompt_sets import humaneval_prompts
from specengine.models.loader import resolve_model


def one_run(method: str, groups: list[list[list[int]]], seed: int, drafted: dict) -> dict:
    """Build plain, ``method`` and control engines, run them in lockstep, return the run's
    walls and step statistics."""
    names = ["plain", method, "control"]
    llms = {n: engine_llm("bfloat16", groups[0], 128, {"method": n} if n == method else None)
            for n in names}
    steps = {n: [] for n in names}
    for n, llm in llms.items():
        def step(orig=llm.engine.step, n=n):
            drafted["built"] = None
            t0 = time.perf_counter()
            out = orig()
            steps[n].append((time.perf_counter() - t0, drafted["built"] is not None))
            return out
        llm.engine.step = step
    params = SamplingParams(temperature=0.0, max_tokens=128, min_tokens=128)
    rng, wall = random.Random(seed), dict.fromkeys(names, 0.0)
    for _ in range(2):
        for group in groups:
            order = names[:]
            rng.shuffle(order)
            for n in order:
                t0 = time.perf_counter()
                llms[n].generate([{"prompt_token_ids": p} for p in group], params,
                                 use_tqdm=False)
                wall[n] += time.perf_counter() - t0
    off = [d for d, spec in steps[method] if not spec]
    spec = [d for d, s in steps[method] if s]
    median_off = statistics.median(off)
    return {"vs_plain": {n: wall["plain"] / wall[n] for n in names},
            "median_step_ms": {n: 1e3 * statistics.median(d for d, _ in steps[n])
                               for n in names},
            "speculative_steps": len(spec), "steps": len(steps[method]),
            "speculation_excess_s": sum(spec) - median_off * len(spec),
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="eagle")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--out", default=None, help="JSON path for the results")
    args = ap.parse_args()
    if args.batch < 1 or args.runs < 1:
        ap.error("--batch and --runs must be >= 1")
    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    prompts = [tok(p["prompt"]).input_ids for p in humaneval_prompts(2 * args.batch)]
    groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    drafted = {"built": None}
    draft = phases.draft

    def draft_recorded(*a, **k):
        out = draft(*a, **k)
        drafted["built"] = out[0]
        return out

    phases.draft = draft_recorded
    runs = []
    for r in range(args.runs):
        run = one_run(args.method, groups, r, drafted)
        runs.append(run)
        print(f"run {r}: wall vs plain " + ", ".join(f"{n} {v:.3f}x"
                                                     for n, v in run["vs_plain"].items())
              + "; median step ms " + ", ".join(f"{n} {v:.2f}"
                                                for n, v in run["median_step_ms"].items())
              + f"; {run['speculative_steps']} speculative steps of {run['steps']} cost "
              f"{run['speculation_excess_s']:.3f} s beyond its median plain step "
              f"({run['speculation_excess_s'] / run['wall_s'][args.method]:.1%} of its wall)")
    if args.out:
        write_json(args.out, {"machine": machine_info(), "model": MODEL, "method": args.method,
                              "batch": args.batch, "runs": runs})


if __name__ == "__main__":
    main()
