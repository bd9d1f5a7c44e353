"""Forward costs and row invariance of the target model on a CUDA GPU, or on the CPU with
``--device cpu`` (random weights; for machines without the real model's package, such as the
GPU machine's host).

For each ``--models`` shape (the public configs of SmolLM2-135M and Qwen2.5-0.5B; random
weights: costs do not depend on the values), in ``--dtype``, with batch invariance on (linear
layers and norms in fixed ``kernels.CUDA_ROWS``-row calls) and off (torch's kernels at the
call's own shape):

1. ``verify``: model forward + logits of ``T`` tokens of one sequence after ``--context``
   tokens (a chain verify of ``T - 1`` drafts), T = 1 ... 256: milliseconds, median of
   ``--repeats`` CUDA-event timings after warm-up;
2. ``decode``: one token for each of ``B`` sequences, each after ``--context`` tokens:
   milliseconds per step and tokens per second;
3. ``rows``: whether every row of a 64-sequence decode step's logits equals, bit for bit, the
   same row computed alone (count of rows that differ), and the same for ``kernels.linear``
   over a 77-row call.

    python bench/bench_gpu.py [--models smollm2-135m,qwen2.5-0.5b] [--out gpu.json]
    taskset -c 0,1 python bench/bench_gpu.py --device cpu --threads 2 --models smollm2-135m

On the CPU each forward runs as the engine's decode steps do (``kernels.kernel_threads`` when
the packed kernels cover it) and is timed by the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from common import cpu_model

from specengine.attention import make_backend
from specengine.attention.base import AttentionMetadata
from specengine.models.config import ModelConfig
from specengine.models.llama import LlamaForCausalLM
from specengine.models.loader import random_hf_state_dict
from specengine.ops import kernels

# Public hyper-parameters (their config.json files); weights are random.
CONFIGS = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True},
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True},
}
BS = 16  # KV block size (tokens)


class Bench:
    """One model on ``device`` with a KV cache for ``seqs`` sequences of ``ctx + extra``
    tokens each (sequence ``s`` owns its own blocks); its first ``ctx`` positions hold random
    K/V."""

    def __init__(self, name: str, dtype: torch.dtype, seqs: int, ctx: int, extra: int,
                 device: str = "cuda"):
        hf = CONFIGS[name]
        self.config = c = ModelConfig.from_hf(hf)
        self.device = dev = torch.device(device)
        self.model = LlamaForCausalLM(c, dtype)
        self.model.load_weights(random_hf_state_dict(c, seed=0).items())
        self.model.to(dev)
        self.ctx, per = ctx, -(-(ctx + extra) // BS)
        shape = (seqs * per, BS, c.num_key_value_heads, c.head_dim)
        g = torch.Generator(device=dev).manual_seed(0)
        self.kv = [(torch.randn(shape, generator=g, device=dev).to(dtype),
                    torch.randn(shape, generator=g, device=dev).to(dtype))
                   for _ in range(c.num_hidden_layers)]
        self.table = torch.arange(seqs * per, dtype=torch.int32, device=dev).view(seqs, per)
        self.backend = make_backend("auto", dev)

    def forward(self, seq: list[int], pos: list[int], ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, vocab]`` float32 of tokens ``ids`` of sequences ``seq`` at ``pos``."""
        per, dev = self.table.shape[1], self.device
        p = torch.tensor(pos, device=dev)
        s = torch.tensor(seq, dtype=torch.int32, device=dev)
        slots = (s.long() * per + p // BS) * BS + p % BS
        meta = AttentionMetadata(slot_mapping=slots, block_tables=self.table, query_seq=s,
                                 kv_lens=(p + 1).to(torch.int32), max_kv_len=max(pos) + 1)
        on_cpu = dev.type == "cpu"
        with kernels.kernel_threads(on_cpu and kernels.packed_covers(len(seq))):
            return self.model.compute_logits(self.model(ids, p, self.kv, meta, self.backend))

    def time_ms(self, seq: list[int], pos: list[int], repeats: int) -> float:
        ids = torch.randint(self.config.vocab_size, (len(seq),), device=self.device)
        for _ in range(3):
            self.forward(seq, pos, ids)
        times = []
        for _ in range(repeats):
            if self.device.type == "cpu":
                t0 = time.perf_counter()
                self.forward(seq, pos, ids)
                times.append((time.perf_counter() - t0) * 1e3)
                continue
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.forward(seq, pos, ids)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)


def rows_differing(bench: Bench, batch: int) -> int:
    """Rows of a ``batch``-sequence decode step whose logits differ from the row alone."""
    dev = bench.device
    ids = torch.randint(bench.config.vocab_size, (batch,), device=dev,
                        generator=torch.Generator(device=dev).manual_seed(1))
    pos = [bench.ctx - 1 - 7 * i for i in range(batch)]
    together = bench.forward(list(range(batch)), pos, ids)
    return sum(not torch.equal(together[i], bench.forward([i], [pos[i]], ids[i:i + 1])[0])
               for i in range(batch))


def linear_rows_differing(dtype: torch.dtype, device: str, rows: int = 77) -> int:
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(rows, 896, generator=g, device=device).to(dtype)
    w = torch.randn(4864, 896, generator=g, device=device).to(dtype)
    y = kernels.linear(x, w)
    return sum(not torch.equal(y[i], kernels.linear(x[i:i + 1], w)[0]) for i in range(rows))


def profile_step(bench: Bench, context: int, batch: int = 64) -> None:
    """Print torch.profiler's ops of one ``batch``-row decode step by host time."""
    from torch.profiler import ProfilerActivity, profile

    seq, pos = list(range(batch)), [context] * batch
    ids = torch.randint(bench.config.vocab_size, (batch,), device="cuda")
    bench.forward(seq, pos, ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        bench.forward(seq, pos, ids)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                    max_name_column_width=40), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-0.5b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--context", type=int, default=512, help="tokens before the timed ones")
    ap.add_argument("--ts", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's top host ops of one 64-row decode step")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (--device cpu)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device (or --device cpu)")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ts = [int(t) for t in args.ts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    on_cpu = args.device == "cpu"
    result = {"device": cpu_model() if on_cpu else torch.cuda.get_device_name(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "isa": kernels.active_isa() if on_cpu else None,
              "dtype": args.dtype, "context": args.context, "cuda_rows": kernels.CUDA_ROWS,
              "models": {}}
    for name in args.models.split(","):
        bench = Bench(name, dtype, max(batches + [64]), args.context, max(ts), args.device)
        print(f"{name} ({args.dtype}, attention {bench.backend.name}, context {args.context})",
              flush=True)
        row = result["models"][name] = {"attention": bench.backend.name}
        for inv in (True, False):
            kernels.set_batch_invariant(inv)
            tag = "invariant" if inv else "torch_shapes"
            verify = {t: bench.time_ms([0] * t, list(range(args.context, args.context + t)),
                                       args.repeats) for t in ts}
            decode = {b: bench.time_ms(list(range(b)), [args.context] * b, args.repeats)
                      for b in batches}
            row[tag] = {
                "verify_ms": verify,
                "decode_ms": decode,
                "decode_tok_s": {b: b / (ms / 1e3) for b, ms in decode.items()},
                "rows_differing_of_64": rows_differing(bench, 64),
                "linear_rows_differing_of_77": linear_rows_differing(dtype, args.device),
            }
            print(f"  {tag}: verify ms " + " ".join(f"T{t}={ms:.2f}" for t, ms in verify.items()))
            print(f"  {tag}: decode ms " + " ".join(f"B{b}={ms:.2f}" for b, ms in decode.items()))
            print(f"  {tag}: rows differing from alone: logits {row[tag]['rows_differing_of_64']}"
                  f"/64, linear {row[tag]['linear_rows_differing_of_77']}/77", flush=True)
        kernels.set_batch_invariant(True)
        if args.profile and not on_cpu:
            profile_step(bench, args.context)
        del bench
        if not on_cpu:
            torch.cuda.empty_cache()
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
