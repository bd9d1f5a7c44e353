"""Where a decode step's time goes: ms per step in each phase of ``Engine.step`` and of the
target forward, for one batch of greedy requests (no speculation).

Each phase function is wrapped with a timer (``time.perf_counter``, ~1 us per call), so the
phases add up to about the step: ``run`` (the target forward and logits) holds
``model.forward`` (in it ``_decoder_weights``, the check that the kept argument list of
``decoder_forward`` still holds) and ``compute_logits`` (the LM head); ``sample`` the greedy
argmax and the stop-id masking (``min_tokens``); the rest is scheduling and bookkeeping.
Means per step include the prefill step; medians per call leave it out.

    python bench/step_phases.py --batch 1 --runs 3 [--dtype bfloat16] [--out F]

SmolLM2-135M-Instruct, HumanEval prompts, ``--max-tokens`` tokens each (EOS masked until then).
"""

from __future__ import annotations

import argparse
import statistics

from bench_decode import MODEL, engine_llm
from common import machine_info, quiet_transformers, timed_method, write_json
from transformers import AutoTokenizer

import specengine.engine.phases as phases
from specengine import SamplingParams
from specengine.data.prompt_sets import humaneval_prompts
from specengine.models.loader import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--out", default=None, help="JSON path for the results")
    args = ap.parse_args()
    if args.batch < 1 or args.max_tokens < 1 or args.runs < 1:
        ap.error("--batch, --max-tokens and --runs must be >= 1")
    quiet_transformers()
    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    prompts = [tok(p["prompt"]).input_ids for p in humaneval_prompts(args.batch)]
    llm = engine_llm(args.dtype, prompts, args.max_tokens)
    engine = llm.engine
    calls: dict[str, list[float]] = {}  # label -> seconds of each call

    def timed(obj, name: str, label: str) -> None:
        timed_method(obj, name, calls.setdefault(label, []))

    for name in ("schedule", "sample", "commit_kv", "append"):
        timed(phases, name, name)
    timed(engine, "step", "step")
    timed(engine, "_account", "account")
    timed(engine.runner, "run", "run")
    timed(engine.runner, "prepare", "run.prepare")
    model = engine.runner.model
    timed(model, "forward", "run.model.forward")
    timed(model, "compute_logits", "run.compute_logits")
    if hasattr(model, "_decoder_weights"):
        timed(model, "_decoder_weights", "run.model.forward._decoder_weights")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            min_tokens=args.max_tokens)
    runs = []
    for r in range(args.runs):
        for sink in calls.values():
            sink.clear()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        steps = len(calls["step"])
        seconds = {k: sum(v) for k, v in calls.items()}
        ms = {k: 1e3 * v / steps for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
        # medians per call leave out the one prefill step (and a few slow outliers)
        med = {k: 1e3 * statistics.median(v) for k, v in calls.items() if v}
        runs.append({"steps": steps, "ms_per_step": ms, "median_ms_per_call": med})
        print(f"run {r}: {steps} steps, ms/step " + ", ".join(f"{k} {v:.3f}"
                                                               for k, v in ms.items()))
        print("  median ms per call: " + ", ".join(f"{k} {med[k]:.3f}" for k in ms if k in med))
    if args.out:
        write_json(args.out, {"machine": machine_info(), "model": MODEL, "dtype": args.dtype,
                              "batch": args.batch, "max_tokens": args.max_tokens,
                              "runs": runs})


if __name__ == "__main__":
    main()
