"""Linear layers of SmolLM2-135M at decode-sized token counts: torch vs specengine's C++ kernel.

Prints, per shape and M (tokens), the time per call and the weight bandwidth (weight bytes /
time, GB/s), then the total over one decode step of the 30-layer model (+ LM head).

    python bench/bench_kernels.py [--dtype bfloat16|float32] [--ms 1,4,8,16] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specengine._ext import ext

# (name, out_features, in_features, count per decode step) for SmolLM2-135M.
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30),
          ("down", 576, 1536, 30), ("lm_head", 49152, 576, 1)]


def time_call(fn, min_time: float = 0.2) -> float:
    """Median seconds per call over enough repeats to fill ~``min_time`` seconds."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    reps = max(5, int(min_time / once))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[len(samples) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--ms", default="1,4,8,16", help="token counts, comma-separated")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    mod = ext()
    if mod is None:
        raise SystemExit("specengine._C is not built: pip install --no-build-isolation -e .")
    dtype = getattr(torch, args.dtype)
    ms = [int(m) for m in args.ms.split(",")]
    print(f"dtype={args.dtype} threads={torch.get_num_threads()} isa={mod.cpu_isa()}")
    print(f"{'shape':>8} {'N x K':>12} {'M':>3} {'torch us':>9} {'ours us':>9} "
          f"{'torch GB/s':>10} {'ours GB/s':>10} {'speedup':>7}")
    step = {m: [0.0, 0.0] for m in ms}
    for name, n, k, count in SHAPES:
        w = torch.randn(n, k).to(dtype)
        nbytes = w.numel() * w.element_size()
        for m in ms:
            x = torch.randn(m, k).to(dtype)
            t_torch = time_call(lambda x=x, w=w: F.linear(x, w))
            t_ours = time_call(lambda x=x, w=w: mod.linear(x, w, None))
            step[m][0] += count * t_torch
            step[m][1] += count * t_ours
            print(f"{name:>8} {n:>5} x {k:<5} {m:>3} {t_torch * 1e6:>9.1f} {t_ours * 1e6:>9.1f} "
                  f"{nbytes / t_torch / 1e9:>10.1f} {nbytes / t_ours / 1e9:>10.1f} "
                  f"{t_torch / t_ours:>6.2f}x")
    print("\nlinear layers per decode step (30 layers + LM head):")
    for m in ms:
        print(f"  M={m:>2}: torch {step[m][0] * 1e3:6.2f} ms   ours {step[m][1] * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
