"""Decode throughput beside a busy process vs quiet, one run: is the engine sturdy under load?

Sampled decoding (T = 1, seeded, a fixed number of new tokens: ``min_tokens = max_tokens``) of
raw HumanEval prompts on the default model in bfloat16, at batch 1 and batch 64, under:

- ``quiet``: nothing else started by the bench;
- ``spin``: one neighbour process spinning in a Python loop (one core's worth of work);
- ``matmul``: one neighbour multiplying 512x512 float64 matrices with numpy on one thread
  (it also competes for memory bandwidth and caches).

Each neighbour is started before and killed after its run. Conditions take turns (``--rounds``
rounds), each run preceded by a warm-up ``generate`` under the same condition (the engine's
adaptive thread count, ``specengine.ops.threads``, gets to measure it); medians over rounds. Thread
modes (``--modes``): ``adaptive`` (the default engine), ``full`` (always torch's thread count,
adaptation off) and a number ``k`` (always k threads). Per row: decode tok/s = tokens of the
steps after the first (which prefills every prompt) / their wall time, the ratio to ``quiet``
in the same mode (the target under one busy neighbour on 2 cores: >= 0.4; the fair share is
0.5), what the kernels' pool waited for (its counters, decode steps and prefill step apart) and
the kernels' thread count the engine chose (``get_metrics()["kernel_threads"]``).

    python bench/bench_neighbour.py [--quick] [--rounds 3] [--modes adaptive,full,1]
        [--neighbours spin,matmul] [--out bench/results/neighbour.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's specengine

import torch  # noqa: E402
from common import (  # noqa: E402
    machine_info,
    markdown_table,
    quiet_transformers,
    stderr_logger,
    write_json,
)

from specengine import LLM, SamplingParams  # noqa: E402
from specengine.data.prompt_sets import humaneval_prompts  # noqa: E402
from specengine.models.loader import resolve_model  # noqa: E402
from specengine.ops.extension import ext  # noqa: E402

MODEL = "smollm2-135m-instruct"
BLOCK = 16
NEIGHBOURS = {
    "spin": "while True:\n    pass\n",
    "matmul": ("import numpy as np\na = np.random.default_rng(0).random((512, 512))\n"
               "while True:\n    a @ a\n"),
}
ONE_THREAD = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


class Neighbour:
    """A busy process beside the engine (``kind`` in ``NEIGHBOURS``; None: none) for a
    ``with`` block: started on entry, killed on exit."""

    def __init__(self, kind: str | None):
        self.kind, self.proc = kind, None

    def __enter__(self):
        if self.kind is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", NEIGHBOURS[self.kind]],
                                         env={**os.environ, **ONE_THREAD})
            time.sleep(0.3)  # let it start spinning
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def thread_settings() -> dict:
    """What decides the engine's threads in this process."""
    mod = ext()
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                          "SPECENGINE_SPIN_US", "SPECENGINE_ADAPTIVE_THREADS")}
    return {"torch_threads": torch.get_num_threads(), "cores": os.cpu_count(),
            "parallel_backend": "OpenMP" if "OpenMP" in torch.__config__.parallel_info()
            else "other", "extension": mod is not None, "env": env}


def set_mode(llm: LLM, mode: str, full: int) -> None:
    """``adaptive``: the tuner on; ``full``: off (torch's count); ``k``: off, k threads."""
    t = llm.engine.threads
    if mode == "adaptive":
        t.enabled, t.max_threads = True, full
    elif mode == "full":
        t.enabled, t.max_threads = False, full
    else:
        t.enabled, t.max_threads = False, max(1, min(full, int(mode)))


def _pool(reset: bool) -> dict:
    mod = ext()
    return mod.pool_stats(reset) if hasattr(mod, "pool_stats") else {}


def _per(pool: dict, steps: int) -> dict:
    """What the kernels' pool waited for (csrc/pool.h), per step and per job."""
    jobs, steps = max(pool.get("jobs", 0), 1), max(steps, 1)
    return {"pool_jobs_per_step": pool.get("jobs", 0) / steps,
            "pool_waits_per_job": pool.get("waits", 0) / jobs,
            "pool_sleeps_per_job": pool.get("sleeps", 0) / jobs,
            "pool_wait_ms_per_step": 1e-6 * pool.get("wait_ns", 0) / steps,
            "pool_late_helpers_per_step": pool.get("late_helpers", 0) / steps}


def run_once(llm: LLM, prompts: list[list[int]], tokens: int, seed: int) -> dict:
    """``prompts`` stepped to their end, ``tokens`` new tokens each (the engine is sized so
    the first step prefills them all, every later step decodes): decode tok/s over the steps
    after the first, the pool's counters of the prefill step and of the decode steps."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=tokens, min_tokens=tokens)
    for p in prompts:
        llm.add_request({"prompt_token_ids": p}, params)
    _pool(True)
    m0 = llm.get_metrics()
    t0 = time.perf_counter()
    llm.step()  # prefill (+ the first token)
    t1 = time.perf_counter()
    pre, m1 = _pool(True), llm.get_metrics()
    while llm.has_unfinished_requests():
        llm.step()
    t2 = time.perf_counter()
    dec, m2 = _pool(True), llm.get_metrics()
    if m1["prefill_tokens"] - m0["prefill_tokens"] != sum(len(p) for p in prompts):
        raise RuntimeError("the first step did not prefill every prompt: raise "
                           "max_num_batched_tokens / the KV budget")
    steps = m2["steps"] - m1["steps"]
    decode_tokens = m2["generated_tokens"] - m1["generated_tokens"]
    return {"decode_tok_s": decode_tokens / max(t2 - t1, 1e-9),
            "forward_tok_s": decode_tokens / max(m2["decode_time"] - m1["decode_time"], 1e-9),
            "ms_step": 1e3 * (t2 - t1) / max(steps, 1), "prefill_s": t1 - t0,
            "wall_s": t2 - t0, "decode_steps": steps,
            "kernel_threads": m2["kernel_threads"],
            "thread_probes": m2["thread_probes"] - m0["thread_probes"],
            "thread_switches": m2["thread_switches"] - m0["thread_switches"],
            "decode_pool": _per(dec, steps), "prefill_pool": _per(pre, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and rounds (smoke run)")
    ap.add_argument("--rounds", type=int, help="rounds over the conditions (default 3; quick 1)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--modes", default="adaptive,full",
                    help="comma list of adaptive, full, or a thread count")
    ap.add_argument("--neighbours", default="spin,matmul", help=f"of {sorted(NEIGHBOURS)}")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "neighbour.json"))
    args = ap.parse_args()
    quiet_transformers()
    log = stderr_logger(time.perf_counter())
    q = args.quick
    rounds = args.rounds or (1 if q else 3)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    kinds = [k for k in args.neighbours.split(",") if k]
    for k in kinds:
        if k not in NEIGHBOURS:
            raise ValueError(f"--neighbours: unknown kind {k!r}; expected {sorted(NEIGHBOURS)}")
    tokens = {1: 32 if q else 128}
    # warm-up run per condition: longer than the tuner's probe period (128 steps + a probe),
    # so each measured run starts from the count the tuner keeps under that condition
    warm_tokens = 48 if q else 144

    from transformers import AutoConfig, AutoTokenizer
    model_dir = resolve_model(MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(p["prompt"]).input_ids for p in humaneval_prompts(max(batches))]
    cfg = AutoConfig.from_pretrained(model_dir)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    most = max(max(tokens.get(b, 8 if q else 32) for b in batches), warm_tokens)
    blocks = sum(-(-(len(p) + most + 1) // BLOCK) + 1 for p in ids) + 16
    llm = LLM(MODEL, dtype="bfloat16", block_size=BLOCK, max_num_seqs=max(batches),
              kv_cache_memory_bytes=blocks * BLOCK * per_token,
              max_num_batched_tokens=sum(len(p) for p in ids) + len(ids) + 64,
              enable_prefix_caching=False)
    full = torch.get_num_threads()
    run_once(llm, ids[:4], 8, 0)  # load, pack
    settings = thread_settings()
    log(f"threads: {settings}")

    conditions = [None, *kinds]
    results = []
    for b in batches:
        n_tok = tokens.get(b, 8 if q else 32)
        prompts = ids[:b]
        for mode in modes:
            set_mode(llm, mode, full)
            runs: dict[str, list[dict]] = {c or "quiet": [] for c in conditions}
            for r in range(rounds):
                for c in conditions:
                    with Neighbour(c):
                        run_once(llm, prompts, warm_tokens, 1000 + r)
                        res = run_once(llm, prompts, n_tok, r)
                    runs[c or "quiet"].append(res)
                    log(f"b={b} {mode} {c or 'quiet'} round {r}: {res['decode_tok_s']:.1f} tok/s "
                        f"threads {res['kernel_threads']}")
            base = statistics.median(x["decode_tok_s"] for x in runs["quiet"])
            for c, rs in runs.items():
                tps = statistics.median(x["decode_tok_s"] for x in rs)
                results.append({
                    "batch": b, "mode": mode, "neighbour": c, "tokens": n_tok,
                    "decode_tok_s": tps, "ratio_to_quiet": tps / base,
                    "forward_tok_s": statistics.median(x["forward_tok_s"] for x in rs),
                    "ms_step": statistics.median(x["ms_step"] for x in rs),
                    "pool_wait_ms_per_step": statistics.median(
                        x["decode_pool"]["pool_wait_ms_per_step"] for x in rs),
                    "prefill_s": statistics.median(x["prefill_s"] for x in rs),
                    "prefill_pool_wait_ms": statistics.median(
                        x["prefill_pool"]["pool_wait_ms_per_step"] for x in rs),
                    "kernel_threads": rs[-1]["kernel_threads"],
                    "thread_switches": sum(x["thread_switches"] for x in rs), "runs": rs})

    headers = ["batch", "mode", "neighbour", "decode tok/s", "vs quiet", "ms/step",
               "pool wait ms/step", "prefill s", "prefill pool wait ms",
               "kernel threads (last run)"]
    rows = [[r["batch"], r["mode"], r["neighbour"], r["decode_tok_s"], r["ratio_to_quiet"],
             r["ms_step"], r["pool_wait_ms_per_step"], r["prefill_s"], r["prefill_pool_wait_ms"],
             ", ".join(f"{k}: {v}" for k, v in r["kernel_threads"].items())]
            for r in results]
    table = markdown_table(headers, rows)
    print(table)
    doc = {"machine": machine_info(), "threads": settings, "model": MODEL, "dtype": "bfloat16",
           "temperature": 1.0, "rounds": rounds, "warm_tokens": warm_tokens, "quick": q,
           "results": results, "table": table}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_json(args.out, doc)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
