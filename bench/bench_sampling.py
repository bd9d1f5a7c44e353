"""Sampling's share of a batch-128, T = 1 decode step: batched (``specengine.sampling.batched``)
vs the per-row code it replaced (``tests/reference_sampling.py``), one run.

- micro: ``Sampler.sample`` on ``[128, 49152]`` float32 logits (the default model's vocabulary),
  fresh positions each call (no cached noise), best of ``--repeats``; before = the per-row
  ``Sampler.sample`` (per-row processing, one noise call and one softmax / divide / argmax per
  row).
- engine: the default model (bfloat16) decoding 128 raw HumanEval prompts at T = 1
  (``ignore_eos``, a seed per request), each decode step timed around ``Engine.step``; its
  sampling phase is the engine metrics' ``sample_time`` delta (forward end to sampled /
  verified / KV committed, what ``get_metrics()`` sums). Before: the same run with
  ``Sampler.sample`` swapped for the per-row one; ``--rounds`` runs of each, alternated.
  Medians over the decode steps with all 128 sequences running (the share: median of the
  per-step ratios). Target (issue 15): sampling <= 5% of the step.

Both runs give the same tokens (checked). The load average is recorded: on a shared machine
the per-row code suffers most (each small torch op waits on OpenMP's barrier).

    python bench/bench_sampling.py [--batch 128] [--max-tokens 12] [--repeats 5] [--rounds 2]
                                   [--out results.json]

With ``--softmax``: only the softmax of a sampled step, per rows R and vocabulary V
(``--softmax-rows``, ``--softmax-vocabs``; 151936 is Qwen2.5's), inside a step's thread setting
(``kernels.kernel_threads``: torch on one thread, the kernel pool on all): ``torch.softmax`` and
``softmax_rows`` (the extension's), and the draw after it, ``race(softmax_rows(x))`` against
``softmax_race(x)`` (one call, no probabilities written; the same tokens), in turns, fewest
seconds of ``--repeats`` rounds; freed buffers kept in the heap as an engine keeps them
(``ops.heap``).

    python bench/bench_sampling.py --softmax [--softmax-rows 16,32,64] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from common import best_time, machine_info

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # this checkout's specengine, the reference
import reference_sampling as ref  # noqa: E402
from bench_decode import engine_llm  # noqa: E402

from specengine import LLM, SamplingParams  # noqa: E402
from specengine.data.prompt_sets import humaneval_prompts  # noqa: E402
from specengine.engine.sequence import Sequence  # noqa: E402
from specengine.sampling.params import SampleNoise  # noqa: E402
from specengine.sampling.sampler import Sampler  # noqa: E402

MODEL = "smollm2-135m-instruct"
VOCAB = 49152


def micro(batch: int, repeats: int, params: SamplingParams) -> dict:
    """Seconds per ``Sampler.sample`` call on ``[batch, VOCAB]`` logits, batched and per row."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, VOCAB, generator=g) * 3
    sampler = Sampler(None, "raw_logprobs", lambda s: [])
    seqs = [Sequence("b", i, [1], params, SampleNoise(7, i)) for i in range(batch)]
    out = {}
    for name, fn in (("batched", Sampler.sample), ("per_row", ref.sampler_sample)):
        def call(fn=fn):
            for s in seqs:
                s.token_ids.append(1)  # a new position: its noise is drawn, not cached
            return fn(sampler, logits, seqs)
        call()
        out[name] = best_time(call, repeats)
    for s in seqs:
        s.token_ids = s.token_ids[:1]
    assert Sampler.sample(sampler, logits, seqs) == ref.sampler_sample(sampler, logits, seqs)
    return out


def softmax_rows_bench(rows: list[int], vocabs: list[int], repeats: int) -> list[dict]:
    """Per (R, V): fewest seconds of ``torch.softmax``, of ``softmax_rows``, of the draw as two
    calls (``race(softmax_rows(x))``) and as one (``softmax_race``) on ``[R, V]`` float32
    logits (four arrays in turn, so each call reads logits not just written), timed in
    alternation inside ``kernel_threads``."""
    from specengine.ops import heap, kernels
    from specengine.sampling.batched import NoiseStreams, race, softmax_race, softmax_rows

    heap.tune_malloc()
    g, out = torch.Generator().manual_seed(0), []
    for V in vocabs:
        for R in rows:
            xs = [torch.randn(R, V, generator=g) * 3 for _ in range(4)]
            streams = NoiseStreams(list(range(R)), [7] * R)
            fns = {"torch": lambda x: torch.softmax(x, -1), "softmax_rows": softmax_rows,
                   "race_of_softmax_rows": lambda x, s=streams: race(softmax_rows(x), s),
                   "softmax_race": lambda x, s=streams: softmax_race(x, s)}
            best = dict.fromkeys(fns, float("inf"))
            with kernels.kernel_threads(True):
                for i in range(repeats * 4):
                    for name, fn in (fns.items() if i % 2 else reversed(fns.items())):
                        t0 = time.perf_counter()
                        fn(xs[i % 4])
                        best[name] = min(best[name], time.perf_counter() - t0)
            assert torch.equal(fns["race_of_softmax_rows"](xs[0]), fns["softmax_race"](xs[0]))
            out.append({"rows": R, "vocab": V, **{f"{k}_s": v for k, v in best.items()}})
            ms = {k: 1e3 * v for k, v in best.items()}
            print(f"softmax [{R}, {V}]: torch (one thread) {ms['torch']:.2f} ms, "
                  f"softmax_rows {ms['softmax_rows']:.2f} ms "
                  f"({best['torch'] / best['softmax_rows']:.2f}x); draw: race(softmax_rows) "
                  f"{ms['race_of_softmax_rows']:.2f} ms, softmax_race {ms['softmax_race']:.2f} "
                  f"ms ({best['race_of_softmax_rows'] / best['softmax_race']:.2f}x)")
    return out


def engine_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    """Decode steps of one batch: ``steps`` (wall seconds, sampling-phase seconds) of each
    decode step with every sequence running, and the output ``tokens``."""
    eng = llm.engine
    rids = [eng.add_request(list(p), SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                                    ignore_eos=True))
            for i, p in enumerate(prompts)]
    steps, outs = [], {}
    while eng.has_unfinished():
        m = eng.metrics
        full = len(eng.scheduler.running) == len(prompts)
        s0, d0, t0 = m.sample_time, m.decode_steps, time.perf_counter()
        for o in eng.step():
            outs[o.request_id] = o.outputs[0].token_ids
        dt = time.perf_counter() - t0
        if full and m.decode_steps > d0:
            steps.append((dt, m.sample_time - s0))
    return {"steps": steps, "tokens": [outs[r] for r in rids]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="engine runs per sampler, alternated")
    ap.add_argument("--out")
    ap.add_argument("--softmax", action="store_true", help="time only the softmax (see above)")
    ap.add_argument("--softmax-rows", default="16,32,64")
    ap.add_argument("--softmax-vocabs", default=f"{VOCAB},151936")
    args = ap.parse_args()
    if args.softmax:
        res = softmax_rows_bench([int(r) for r in args.softmax_rows.split(",")],
                                 [int(v) for v in args.softmax_vocabs.split(",")], args.repeats)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"machine": machine_info(), "softmax": res}, f, indent=2)
        return
    load0 = os.getloadavg()[0]
    print(f"# sampling benchmark: batch {args.batch}, T = 1, vocab {VOCAB}, torch threads "
          f"{torch.get_num_threads()}, load average {load0:.2f}")
    mic = micro(args.batch, args.repeats, SamplingParams(temperature=1.0))
    print(f"Sampler.sample [{args.batch}, {VOCAB}]: batched {1e3 * mic['batched']:.1f} ms, "
          f"per row {1e3 * mic['per_row']:.1f} ms ({mic['per_row'] / mic['batched']:.1f}x)")

    from transformers import AutoTokenizer

    from specengine.models.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    texts = [p["prompt"] for p in humaneval_prompts(args.batch)]
    prompts = [tok(t).input_ids for t in texts]
    prompts = (prompts * -(-args.batch // len(prompts)))[:args.batch]
    llm = engine_llm("bfloat16", prompts, args.max_tokens)  # one prefill step, no preemption
    engine_run(llm, prompts[:8], 4)  # warm up
    runs = {"batched": [], "per_row": []}
    tokens = {}
    original = Sampler.sample
    for _ in range(args.rounds):  # alternate, so a neighbour's burst hits both alike
        for name in runs:
            Sampler.sample = original if name == "batched" else ref.sampler_sample
            try:
                r = engine_run(llm, prompts, args.max_tokens)
            finally:
                Sampler.sample = original
            runs[name] += r["steps"]
            tokens.setdefault(name, r["tokens"])
    same = tokens["batched"] == tokens["per_row"]
    rows = []
    for name, steps in runs.items():
        step_s = statistics.median(t for t, _ in steps)
        sample_s = statistics.median(s for _, s in steps)
        share = statistics.median(s / t for t, s in steps)
        rows.append({"sampler": name, "step_s": step_s, "sample_s": sample_s, "share": share,
                     "decode_steps": len(steps)})
        print(f"engine {name:8s}: step {1e3 * step_s:.1f} ms, sampling {1e3 * sample_s:.1f} ms"
              f", {100 * share:.1f}% of the step (medians of {len(steps)} decode steps)")
    ok = rows[0]["share"] <= 0.05
    print(f"same tokens: {same}; target sampling <= 5% of the step: "
          f"{'PASS' if ok else 'FAIL'}; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine_info(), "batch": args.batch, "vocab": VOCAB,
                       "max_tokens": args.max_tokens, "rounds": args.rounds,
                       "micro_s": mic, "engine": rows,
                       "same_tokens": same, "target_pass": ok,
                       "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)]},
                      f, indent=2)


if __name__ == "__main__":
    main()
