"""Seconds to push the whole default model into a running engine (issue 14: target <= 1 s).

Rows (each the best of ``--repeats``, wall and process CPU seconds):

- ``one call, HF fp32``: ``llm.update_weights(hf.named_parameters())`` from a transformers copy
  in float32 (a trainer's master weights; cast to the engine's dtype while applied);
- ``one call, HF bf16``: the same from a bfloat16 transformers copy;
- ``one call, own state``: the engine's own weights (HF names, engine dtype) pushed back;
- ``streamed 1 MB, HF fp32`` / ``HF bf16``: ``begin_weight_update``, ``load_weights(bucket)``
  per bucket of at most ``--bucket-mb`` (a larger tensor travels alone, as verl does),
  ``finish_weight_update``.

Every push also checks every tensor for NaN/inf and rebuilds the kernels' packed copies. The
load average is printed: on a shared 2-core machine other processes change the numbers
several-fold.

    python bench/bench_weight_sync.py [--model smollm2-135m-instruct] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def buckets(named, limit: int):
    """Lists of (name, tensor) of at most ``limit`` bytes each (a larger tensor alone)."""
    cur, size = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and size + n > limit:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def timed(fn, repeats: int) -> tuple[float, float]:
    """Best (wall, CPU) seconds of ``fn()`` over ``repeats`` runs."""
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        best = min(best, (time.perf_counter() - w0, time.process_time() - c0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from specengine import LLM

    llm = LLM(args.model, dtype=args.dtype)
    hf32 = AutoModelForCausalLM.from_pretrained(str(llm.model_dir), dtype=torch.float32)
    hf16 = AutoModelForCausalLM.from_pretrained(str(llm.model_dir), dtype=torch.bfloat16)
    own = {n: t.detach().clone() for n, t in llm.engine.runner.model.hf_parameters().items()}
    n_params = sum(t.numel() for t in own.values())
    limit = int(args.bucket_mb * (1 << 20))

    def streamed(hf):
        def run():
            llm.begin_weight_update()
            for b in buckets(hf.named_parameters(), limit):
                llm.load_weights(b)
            llm.finish_weight_update()
        return run

    rows = []
    cases = [("one call, HF fp32", lambda: llm.update_weights(hf32.named_parameters())),
             ("one call, HF bf16", lambda: llm.update_weights(hf16.named_parameters())),
             ("one call, own state", lambda: llm.update_weights(own)),
             (f"streamed {args.bucket_mb:g} MB, HF fp32", streamed(hf32)),
             (f"streamed {args.bucket_mb:g} MB, HF bf16", streamed(hf16))]
    load0 = os.getloadavg()[0]
    print(f"{args.model} ({n_params / 1e6:.1f}M params, engine {args.dtype}), torch threads "
          f"{torch.get_num_threads()}, load average {load0:.2f}")
    for name, fn in cases:
        fn()  # warm-up (first-touch pages, packed buffers)
        wall, cpu = timed(fn, args.repeats)
        rows.append({"case": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)})
        print(f"  {name:28s} {wall:6.3f} s wall  {cpu:6.3f} s CPU")
    n_buckets = sum(1 for _ in buckets(hf32.named_parameters(), limit))
    print(f"  ({n_buckets} buckets of <= {args.bucket_mb:g} MB for fp32; load average "
          f"{os.getloadavg()[0]:.2f})")
    assert llm.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids  # still serves
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "params": n_params,
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "load_average": [round(load0, 2), round(os.getloadavg()[0], 2)],
                       "buckets": n_buckets, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
