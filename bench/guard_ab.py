"""The loss guard of this tree against the one of a git revision, in lockstep.

One process holds the plain engine (no drafter) and, per method, two ``auto`` engines: one
with this tree's ``LossGuard``, one with ``LossGuard`` as ``git show REV:...guard.py`` has it
(everything else in both is this tree's). Every prompt is run by each engine in a shuffled
order, ``--rounds`` times, so the machine's drift falls on all alike; ``--runs`` fresh
sets of engines are built in turn, the two arms in alternating order (a guard's outcome
depends on its first steps, so one run is one sample). Per run and engine: wall seconds,
speed over plain, the speculative steps taken and the guard's state; every engine's tokens
must equal plain's.

    python bench/guard_ab.py --base b5ac5bd --methods eagle,ngram --runs 10

SmolLM2-135M-Instruct (bf16, greedy), 128 tokens, HumanEval prompts: ``--prompts`` generate
calls per round of ``--batch`` prompts each (batch 1 by default; the running batch shrinks
only if a request ends early, and none does: EOS is masked until ``max_tokens``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile

from bench_decode import MODEL, engine_llm, policy_state, run_lockstep
from common import machine_info, quiet_transformers, write_json
from transformers import AutoTokenizer

from specengine.data.prompt_sets import humaneval_prompts
from specengine.models.loader import resolve_model

GUARD = "specengine/speculative/policy/guard.py"


def base_guard_class(rev: str):
    """``LossGuard`` as revision ``rev`` of the repository has it (a module loaded from
    ``git show``). Raises subprocess.CalledProcessError: no such revision or file."""
    src = subprocess.run(["git", "show", f"{rev}:{GUARD}"], check=True, capture_output=True,
                         text=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("base_guard", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.LossGuard


def one_run(methods: list[str], base_cls, groups: list[list[list[int]]], max_tokens: int,
            rounds: int, seed: int, control: bool = False,
            base_alpha: float | None = None) -> dict:
    """Build the engines, run them in lockstep (one ``generate`` call per group of prompts:
    the batch), return their walls, speeds and policies. ``control``: a second plain engine,
    ``plain/control``, built last (how much of an arm's speed over plain is the order the
    engines were built in). ``base_alpha``: the base arm's guard gets this ``alpha`` (the
    share of plain's speed it may risk) instead of the engine's ``policy_max_loss``."""
    arms = ("this", "base") if seed % 2 == 0 else ("base", "this")  # built in turn
    names = ["plain"] + [f"{m}/{arm}" for m in methods for arm in arms]
    names += ["plain/control"] if control else []
    llms = {}
    for n in names:
        method = None if n.startswith("plain") else n.split("/")[0]
        llms[n] = engine_llm("bfloat16", max(groups, key=len), max_tokens,
                             {"method": method} if method else None)
        pol = llms[n].engine.policy
        if n.endswith("/base"):
            pol.guard = base_cls(pol.guard.alpha if base_alpha is None else base_alpha)
    wall, outs = run_lockstep(llms, groups, max_tokens, rounds, seed)
    run = {"wall_s": wall, "vs_plain": {n: wall["plain"] / wall[n] for n in names},
           "same_tokens_as_plain": all(outs[n] == outs["plain"] for n in names), "policy": {}}
    for n in names[1:]:
        if n == "plain/control":
            continue
        state = policy_state(llms[n])
        run["policy"][n] = {"speculative_steps": sum(
            v for k, v in state["steps"].items() if k != "off"), **state}
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose LossGuard to compare")
    ap.add_argument("--methods", default="eagle,ngram")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6, help="generate calls per round")
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate call")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--base-alpha", type=float, default=None,
                    help="the base arm's guard alpha (default: the engine's policy_max_loss)")
    ap.add_argument("--control", action="store_true",
                    help="also a second plain engine built last (plain/control)")
    ap.add_argument("--out", default=None, help="JSON path for the results")
    args = ap.parse_args()
    quiet_transformers()
    base_cls = base_guard_class(args.base)
    methods = [m for m in args.methods.split(",") if m]
    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    prompts = [tok(p["prompt"]).input_ids for p in humaneval_prompts(args.prompts * args.batch)]
    groups = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    runs = []
    for r in range(args.runs):
        runs.append(one_run(methods, base_cls, groups, args.max_tokens, args.rounds, r,
                            args.control, args.base_alpha))
        print(f"# run {r}: " + ", ".join(f"{n} {v:.3f}x" for n, v in
                                         runs[-1]["vs_plain"].items() if n != "plain"),
              file=sys.stderr)
    summary = {}
    for m in methods:
        for arm in ("this", "base"):
            n = f"{m}/{arm}"
            vs = [run["vs_plain"][n] for run in runs]
            summary[n] = {"mean": statistics.mean(vs), "min": min(vs), "max": max(vs),
                          "runs_under_100_speculative_steps": sum(
                              run["policy"][n]["speculative_steps"] < 100 for run in runs)}
            print(f"{n}: mean {summary[n]['mean']:.3f}x min {summary[n]['min']:.3f}x of plain, "
                  f"{summary[n]['runs_under_100_speculative_steps']}/{len(runs)} runs with "
                  "< 100 speculative steps")
    if args.control:
        vs = [run["vs_plain"]["plain/control"] for run in runs]
        summary["plain/control"] = {"mean": statistics.mean(vs), "min": min(vs),
                                    "max": max(vs)}
        print(f"plain/control: mean {summary['plain/control']['mean']:.3f}x min "
              f"{summary['plain/control']['min']:.3f}x of plain (same engine, built last)")
    print("tokens equal to plain in every run:", all(r["same_tokens_as_plain"] for r in runs))
    if args.out:
        write_json(args.out, {"machine": machine_info(), "model": MODEL, "base": args.base,
                              "methods": methods, "rounds": args.rounds,
                              "prompts": args.prompts, "batch": args.batch,
                              "max_tokens": args.max_tokens, "control": args.control,
                              "base_alpha": args.base_alpha,
                              "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
