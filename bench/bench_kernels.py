"""Linear layers of SmolLM2-135M at decode-sized token counts: torch vs specengine's C++ kernels.

Prints, per shape and M (tokens), the time per call and the weight bandwidth (weight bytes /
time, GB/s), then the total over one decode step of the 30-layer model (+ LM head). Columns:
torch (``F.linear``), ours (``kernels.linear`` on the prepacked weight: AMX tiles for bfloat16
on AMX CPUs, else the plain C++ kernel; ``-`` where kernels.linear would hand the rows to torch) and
plain (the C++ kernel on the unpacked weight, M <= 8).

With ``--attention``: the paged attention kernel over the 30 layers, per batch, context and
query tokens per sequence (decode: 1; verifying a draft chain: more).

With ``--draft``: the EAGLE draft loop (``EagleDrafter.propose`` with the drafter shipped for
SmolLM2-135M, 8192-token draft vocabulary) for B sequences of 160 cached tokens, depth d, top-k
k, greedy and T = 1: ms per call and per depth (the prefix feed counts as one), timed in turns
in one run: a step's drafting (prefix feed and the loop over depths) in one extension call
(``eagle_draft``); the Python loop (``_feed_prefix``, ``_grow``) with
the one-call coupled top-k (``coupled_topk``); and the Python loop with torch's coupled
log-probabilities and top-k (the drafting before either, noise rows drawn into memory; each
call's noise cache emptied first, as a new step's positions are not cached). ``--catch-up N``:
each call first catches the drafter up on each sequence's last N tokens (as after N steps it sat
out) and a fourth column runs the Python loop with the whole drafter layer over those rows (the
prefix feed before catch-up rows only wrote their K/V); ``--draft-model`` another target's
shipped drafter (e.g. qwen2.5-coder-0.5b-instruct).

With ``--cold`` (and no ``--attention``): all linear layers of one decode step with a weight
per layer, as an engine step reads them from memory (the table above reuses one weight, which
the CPU caches keep), ours vs torch per M.

With ``--argmax``: a greedy step's argmax over M rows (``--ms``) of 49152 float32 logits (the
vocabulary of SmolLM2): torch's ``max(-1).indices`` vs the extension's ``argmax_rows``.

With ``--forward``: the whole model (SmolLM2-135M, real weights) per forward of T tokens at
batch 1 after a 200-token context: T=1 is a decode step, T=9 a 1+8 token verify (ms, median).

    python bench/bench_kernels.py [--dtype bfloat16|float32] [--ms 1,4,8,16,32] [--threads N]
                                  [--isa generic|avx2|avx512] [--forward [--ts 1,9,17]]
                                  [--attention] [--draft [--shapes 32x4x1,...] [--out F]
                                                         [--catch-up N] [--draft-model M]]
                                  [--peak] [--argmax [--ms 1,4,64]] [--cold]

``--isa avx2`` caps both sides at AVX2 + FMA, as on a CPU without AVX-512: specengine's dispatch
(``SPECENGINE_ISA``) and torch's (``ATEN_CPU_CAPABILITY``, oneDNN's ``ONEDNN_MAX_CPU_ISA``, MKL's
``MKL_ENABLE_INSTRUCTIONS``, set before torch is imported). The "ours" column then times the
AVX2 kernel on every M (``kernels.AVX2_MAX_M`` is where the dispatch hands rows to torch).

Measured (``--isa avx2 --threads 1 --ms 1,2,4,8,16``, AMD EPYC Zen 5, machine shared with other
jobs at load ~5 on 2 cores, so +-20%), us per call torch / ours:
  float32  qkv 960x576: M=1 31/23, M=8 134/129, M=16 226/257; gate_up 3072x576: M=1 130/69,
           M=16 854/849; lm_head: M=1 15459/7268. Step total M=1 22.3/11.4 ms, M=16 87.9/82.2.
  bfloat16 qkv: M=1 50/14, M=16 804/186; gate_up: M=1 158/48, M=16 6813/629; lm_head M=1
           6667/1792. Step total M=1 15.9/4.7 ms, M=16 345/53.
  bfloat16 (``--ms 32,64,200``): o 576x576 M=32 1060/298, M=200 7844/1892; gate_up M=64
           23842/2772, M=200 62429/10439; down M=200 28316/5511.
Hence ``kernels.AVX2_MAX_M``: bfloat16 4096 (as AVX-512), float32 8 (torch's MKL wins at 16 on
the small layers). Since the 6-row tile (session 11, AMD EPYC Zen 4, 2 threads, step totals
torch / ours): float32 M=16 66.5/40.8 and 63.6/39.9 ms, M=64 170/138 and 161/133, M=256
569/605 and 514/483; float32 hence 64.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if "--isa" in sys.argv[:-1]:  # before torch loads: its kernels pick their ISA at import
    _isa = sys.argv[sys.argv.index("--isa") + 1]
    os.environ["SPECENGINE_ISA"] = _isa
    if _isa != "avx512":
        _torch_isa = {"avx2": ("avx2", "AVX2", "AVX2"), "generic": ("default", "SSE41", "SSE4_2")}
        cap, onednn, mkl = _torch_isa.get(_isa, ("default", "SSE41", "SSE4_2"))
        os.environ.setdefault("ATEN_CPU_CAPABILITY", cap)
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", onednn)
        os.environ.setdefault("MKL_ENABLE_INSTRUCTIONS", mkl)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specengine.ops import kernels  # noqa: E402
from specengine.ops.extension import ext  # noqa: E402

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
    ap.add_argument("--ms", default="1,4,8,16,32", help="token counts, comma-separated")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--isa", default=None, choices=list(kernels.ISAS),
                    help="cap specengine's and torch's instruction set (see the docstring)")
    ap.add_argument("--forward", action="store_true", help="time whole-model forwards")
    ap.add_argument("--ts", default="1,9,17", help="tokens per forward for --forward")
    ap.add_argument("--attention", action="store_true",
                    help="time paged attention per batch, context and query tokens (always "
                         "bf16, whatever --dtype)")
    ap.add_argument("--shapes", default="1x768,8x768,16x768,24x512",
                    help="--attention: BxC pairs (batch x cached tokens), comma-separated")
    ap.add_argument("--queries", default="1,2,3,5",
                    help="--attention: query tokens per sequence, comma-separated")
    ap.add_argument("--draft", action="store_true",
                    help="time the EAGLE draft loop; --shapes BxDxK (batch x depth x top-k)")
    ap.add_argument("--out", default=None, help="--draft: also write the rows to this JSON")
    ap.add_argument("--catch-up", type=int, default=0,
                    help="--draft: tokens per sequence the drafter catches up on each call")
    ap.add_argument("--draft-model", default="smollm2-135m-instruct",
                    help="--draft: the target whose shipped drafter is timed")
    ap.add_argument("--peak", action="store_true",
                    help="what the AMX tile unit computes per second by operand data and "
                         "alignment (bench/amx_peak.cpp, built with g++) beside the packed AMX "
                         "linear")
    ap.add_argument("--argmax", action="store_true",
                    help="time the greedy argmax over --ms rows of 49152 logits")
    ap.add_argument("--cold", action="store_true",
                    help="--attention: one cache per layer (30), as an engine step reads them, "
                         "instead of one cache read 30 times (kept in the CPU caches); without "
                         "--attention: all linear layers of a step with a weight per layer")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    mod = ext()
    if mod is None:
        raise SystemExit("specengine._C is not built: pip install --no-build-isolation -e .")
    dtype = getattr(torch, args.dtype)
    ms = [int(m) for m in args.ms.split(",")]
    print(f"dtype={args.dtype} threads={torch.get_num_threads()} cpu={mod.cpu_isa()} "
          f"active_isa={kernels.active_isa()} amx={kernels.amx_available()} "
          f"torch_capability={torch.backends.cpu.get_cpu_capability()}")
    if args.peak:
        return bench_peak()
    if args.argmax:
        return bench_argmax(ms)
    if args.forward:
        return bench_forward(dtype, [int(t) for t in args.ts.split(",")])
    if args.draft:
        shapes = (args.shapes if "--shapes" in sys.argv else "8x4x1,32x4x1,32x4x2,32x6x2")
        return bench_draft([tuple(int(v) for v in s.split("x")) for s in shapes.split(",")],
                           args.out, max(160, args.catch_up + 16), args.catch_up,
                           args.draft_model)
    if args.attention:
        shapes = [tuple(int(v) for v in bc.split("x")) for bc in args.shapes.split(",")]
        return bench_attention(shapes, [int(q) for q in args.queries.split(",")], args.cold)
    if args.cold:
        return bench_linears_cold(dtype, ms)
    print(f"{'shape':>8} {'N x K':>12} {'M':>3} {'torch us':>9} {'ours us':>9} {'plain us':>9} "
          f"{'torch GB/s':>10} {'ours GB/s':>10} {'speedup':>7}")
    step = {m: [0.0, 0.0] for m in ms}
    for name, n, k, count in SHAPES:
        w = torch.randn(n, k).to(dtype)
        pw = kernels.prepack(w)
        nbytes = w.numel() * w.element_size()
        for m in ms:
            x = torch.randn(m, k).to(dtype)
            t_torch = time_call(lambda x=x, w=w: F.linear(x, w))
            if pw.kind == "avx2":  # the AVX2 kernel on every M, whatever AVX2_MAX_M says
                runs = True
                t_ours = time_call(lambda x=x, pw=pw, n=n: mod.linear_avx2(x, pw.packed, n))
            else:
                runs = pw.rows_for(x) > 0 or m <= kernels.LINEAR_MAX_M[dtype]
                t_ours = (time_call(lambda x=x, pw=pw: kernels.linear(x, pw)) if runs
                          else t_torch)  # kernels.linear hands these rows to torch
            t_plain = (time_call(lambda x=x, w=w: mod.linear(x, w, None)) if m <= 8
                       else float("nan"))
            step[m][0] += count * t_torch
            step[m][1] += count * t_ours
            ours = f"{t_ours * 1e6:>9.1f}" if runs else f"{'-':>9}"
            print(f"{name:>8} {n:>5} x {k:<5} {m:>3} {t_torch * 1e6:>9.1f} {ours} "
                  f"{t_plain * 1e6:>9.1f} {nbytes / t_torch / 1e9:>10.1f} "
                  f"{nbytes / t_ours / 1e9:>10.1f} {t_torch / t_ours:>6.2f}x")
    print("\nlinear layers per decode step (30 layers + LM head):")
    for m in ms:
        print(f"  M={m:>2}: torch {step[m][0] * 1e3:6.2f} ms   ours {step[m][1] * 1e3:6.2f} ms")


def bench_linears_cold(dtype: torch.dtype, ms: list[int], repeats: int = 7) -> None:
    """Per M: ms for all linear layers of one SmolLM2-135M decode step with a weight per layer
    (30 x qkv, o, fused gate_up + SwiGLU, down, then the LM head, 269 MB in bfloat16, 538 in
    float32), as an engine step reads them: the weights come from memory, not the CPU caches
    the table above reuses one weight from. Ours (``kernels.linear`` / ``linear_glu`` on the
    prepacked weights, inside ``kernel_threads`` as the engine's decode steps run) and torch
    (``F.linear``, then ``silu_and_mul``); median of ``repeats`` steps each (torch's first, then
    ours after a pause: torch's OpenMP workers spin on for a while after its ops);
    GB/s is weight bytes over time, GFLOP/s 2 x M x weights over time."""
    layers = []
    for name, n, k, count in SHAPES:
        glu = name == "gate_up"
        for _ in range(count):
            w = (torch.randn(n, k) * 0.05).to(dtype)
            layers.append((w, kernels.prepack(w, glu=glu), glu))
    nbytes = sum(w.numel() * w.element_size() for w, _, _ in layers)
    params = sum(w.numel() for w, _, _ in layers)

    def ours(xs) -> None:
        with kernels.kernel_threads():
            for (_, pw, glu), x in zip(layers, xs):
                kernels.linear_glu(x, pw) if glu else kernels.linear(x, pw)

    def torch_step(xs) -> None:
        for (w, _, glu), x in zip(layers, xs):
            y = F.linear(x, w)
            if glu:
                kernels.silu_and_mul_torch(y)

    print(f"all linear layers of a step, a weight per layer ({nbytes / 1e6:.0f} MB)")
    print(f"{'M':>4} {'torch ms':>9} {'ours ms':>9} {'ours GB/s':>10} {'ours GFLOP/s':>12} "
          f"{'speedup':>7}")
    for m in ms:
        xs = [torch.randn(m, w.shape[1]).to(dtype) for w, _, _ in layers]
        times = {"torch": [], "ours": []}
        for label, fn in (("torch", torch_step), ("ours", ours)):
            time.sleep(0.5)  # torch's OpenMP workers spin on after its ops, taking the cores
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn(xs)
                times[label].append(time.perf_counter() - t0)
        t_ours, t_torch = (sorted(times[k])[repeats // 2] for k in ("ours", "torch"))
        print(f"{m:>4} {t_torch * 1e3:>9.2f} {t_ours * 1e3:>9.2f} {nbytes / t_ours / 1e9:>10.1f} "
              f"{2 * m * params / t_ours / 1e9:>12.1f} {t_torch / t_ours:>6.2f}x")


def bench_argmax(ms: list[int], vocab: int = 49152) -> None:
    """Per row count M: ms per greedy argmax of ``[M, vocab]`` float32 random logits, torch's
    ``max(-1).indices`` and ``argmax_rows`` (``specengine.sampling.batched``: the extension's
    kernel), and that both give the same indices."""
    from specengine.sampling.batched import argmax_rows

    print(f"{'M':>4} {'torch ms':>9} {'ours ms':>9} {'speedup':>7}")
    for m in ms:
        x = torch.randn(m, vocab)
        if not torch.equal(argmax_rows(x), x.max(-1).indices):
            raise SystemExit(f"argmax_rows differs from torch at M={m}")
        t_torch = time_call(lambda x=x: x.max(-1).indices)
        t_ours = time_call(lambda x=x: argmax_rows(x))
        print(f"{m:>4} {t_torch * 1e3:>9.4f} {t_ours * 1e3:>9.4f} {t_torch / t_ours:>6.1f}x")


def bench_peak(m: int = 512, n: int = 1536, k: int = 576) -> None:
    """TFLOP/s of the tile unit on L1-resident operands (``bench/amx_peak.cpp``, per thread,
    1 and all threads; zero, constant (1.0) and random normal operands 64-byte aligned, and
    random normal ones 16 bytes off) and of the packed AMX linear on an L2-resident ``[n, k]``
    weight at ``m`` rows (all threads; zero, constant and random normal operands)."""
    import shutil
    import subprocess
    import tempfile

    if not kernels.amx_available():
        raise SystemExit("no AMX on this CPU (or capped by SPECENGINE_ISA)")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "amx_peak.cpp")
    if shutil.which("g++"):
        with tempfile.TemporaryDirectory() as tmp:
            exe = os.path.join(tmp, "amx_peak")
            subprocess.run(["g++", "-O2", "-pthread", src, "-o", exe], check=True)
            for threads in sorted({1, torch.get_num_threads()}):
                print(subprocess.run([exe, str(threads)], check=True, capture_output=True,
                                     text=True).stdout, end="")
    else:
        print("g++ not found: skipping the tile-unit loop (bench/amx_peak.cpp)")
    g = torch.Generator().manual_seed(0)
    data = {"zeros": (torch.zeros(m, k), torch.zeros(n, k)),
            "ones": (torch.ones(m, k), torch.ones(n, k)),
            "random normal": (torch.randn(m, k, generator=g), torch.randn(n, k, generator=g))}
    print(f"packed AMX linear, {m} x {k} @ [{n}, {k}] bfloat16, "
          f"{torch.get_num_threads()} threads:")
    with kernels.kernel_threads(True):
        for name, (x, w) in data.items():
            x, pw = x.to(torch.bfloat16), kernels.prepack(w.to(torch.bfloat16))
            sec = time_call(lambda x=x, pw=pw: kernels.linear(x, pw), min_time=0.5)
            print(f"  {name:<14} {sec * 1e6:7.0f} us  {2 * m * n * k / sec / 1e12:.2f} TFLOP/s")


def bench_forward(dtype: torch.dtype, ts: list[int], context: int = 200) -> None:
    """Median ms of model forward + logits of T tokens at batch 1 after ``context`` tokens."""
    from specengine.attention.base import AttentionMetadata
    from specengine.attention.cpu import CpuAttention
    from specengine.models.loader import load_model, resolve_model

    model = load_model(resolve_model("smollm2-135m-instruct"), dtype=dtype).model
    c, bs = model.config, 16
    blocks = (context + max(ts)) // bs + 2
    shape = (blocks, bs, c.num_key_value_heads, c.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
          for _ in range(c.num_hidden_layers)]
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    backend = CpuAttention()

    def forward(start: int, n: int):
        pos = torch.arange(start, start + n)
        meta = AttentionMetadata(slot_mapping=pos, block_tables=table,
                                 query_seq=torch.zeros(n, dtype=torch.int32),
                                 kv_lens=(pos + 1).to(torch.int32), max_kv_len=start + n)
        ids = torch.randint(c.vocab_size, (n,))
        with kernels.kernel_threads(kernels.packed_covers(n)):  # as the engine's decode steps
            return model.compute_logits(model(ids, pos, kv, meta, backend))

    forward(0, context)
    print(f"model forward + logits at batch 1 after {context} tokens ({dtype}):")
    for t in ts:
        sec = time_call(lambda t=t: forward(context, t), min_time=1.0)
        print(f"  T={t:>2}: {sec * 1e3:7.2f} ms")


def bench_draft(shapes: list[tuple[int, int, int]], out: str | None, context: int = 160,
                catch_up: int = 0, model: str = "smollm2-135m-instruct") -> None:
    """EAGLE ``propose`` per (batch, depth, top-k), greedy and T = 1: the extension loop vs the
    Python loop (``_grow``), medians of interleaved calls; each after catching the drafter up on
    ``catch_up`` tokens per sequence (then also the Python loop with the whole layer over the
    catch-up rows)."""
    import json

    from common import machine_info

    from specengine import LLM, SamplingParams
    from specengine.engine.sequence import Sequence
    from specengine.sampling.params import SampleNoise
    from specengine.speculative.drafters import coupling
    from specengine.speculative.strategy import Strategy

    # name -> (loop in the extension, coupled_topk's one-call kernel)
    VARIANTS = {"extension": (True, True), "python_loop": (False, True),
                "torch_topk_loop": (False, False)}
    if catch_up:
        VARIANTS["python_whole_layer"] = (False, True)
    llm = LLM(model, dtype="bfloat16", kv_cache_memory_bytes=1 << 29, speculative_config={
        "method": "eagle", "num_speculative_tokens": 4, "policy": "static"})
    drafter = llm.engine.drafter
    em = drafter.model
    forward = em.forward

    def whole_layer(ids, feats, pos, kv, meta, backend, out_rows=None):
        f = forward(ids, feats, pos, kv, meta, backend)
        return f if out_rows is None else f[out_rows]
    hidden = llm.engine.runner.model.config.hidden_size
    draft = drafter._draft_in_extension
    rows = []
    print(f"EAGLE draft loop ({model}), {context} cached tokens per sequence (bfloat16), "
          f"catching up on {catch_up}, ms per call [per depth]:")
    print(f"{'B':>3} {'d':>2} {'k':>2} {'T':>3} {'extension':>17} {'python loop':>17} "
          f"{'torch top-k loop':>17} " + (f"{'whole layer':>17} " if catch_up else "")
          + f"{'speedup':>7}")
    for b, d, k in shapes:
        for temp in (0.0, 1.0):
            g = torch.Generator().manual_seed(0)
            seqs = []
            for i in range(b):
                s = Sequence("bench", i, torch.randint(100, 5000, (context + 1,),
                                                       generator=g).tolist(),
                             SamplingParams(temperature=temp, seed=i), SampleNoise(i, 0))
                s.num_cached = context
                f = torch.randn(context + 1, hidden, generator=g)
                drafter.observe(s, 0, (f / f.norm(dim=-1, keepdim=True) * hidden ** 0.5)
                                .to(torch.bfloat16))
                seqs.append(s)
            strategy = Strategy(d, topk=k, budget=d * k)
            times = {name: [] for name in VARIANTS}
            with kernels.kernel_threads(kernels.packed_covers(b * (1 + d * k))):
                for rep in range(12):
                    for name, (in_ext, fused) in VARIANTS.items():
                        drafter._draft_in_extension = draft if in_ext else (lambda *a: None)
                        coupling.ext = ext if fused else (lambda: None)
                        em.forward = whole_layer if name == "python_whole_layer" else forward
                        for s in seqs:
                            s.noise._cache.clear()
                            if catch_up:
                                drafter.states[s.seq_id].shadow.num_cached = context - catch_up
                        t0 = time.perf_counter()
                        drafter.propose(seqs, strategy)
                        if rep:  # the first call of each fills the drafter KV
                            times[name].append(time.perf_counter() - t0)
            drafter._draft_in_extension, coupling.ext, em.forward = draft, ext, forward
            for s in seqs:
                drafter.release(s)
            ms = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
            rows.append({"batch": b, "depth": d, "topk": k, "temperature": temp,
                         **{f"{name}_ms": round(v, 3) for name, v in ms.items()},
                         **{f"{name}_ms_per_depth": round(v / d, 3) for name, v in ms.items()}})
            print(f"{b:>3} {d:>2} {k:>2} {temp:>3.0f} "
                  + " ".join(f"{v:>8.2f} [{v / d:>5.2f}]" for v in ms.values())
                  + f" {ms['torch_topk_loop'] / ms['extension'] :>6.2f}x")
    if out:
        with open(out + ".tmp", "w") as fh:
            json.dump({"machine": machine_info(), "threads": torch.get_num_threads(),
                       "model": model, "context": context, "catch_up": catch_up,
                       "rows": rows}, fh, indent=1)
        os.replace(out + ".tmp", out)


def bench_attention(shapes=((1, 768), (8, 768), (16, 768), (24, 512)),
                    queries=(1, 2, 3, 5), cold: bool = False) -> None:
    """Paged attention of SmolLM2-135M's shape (9 query heads, 3 KV heads, head_dim 64, bf16,
    block size 16) over its 30 layers: ms per forward for ``B`` sequences of ``C`` cached
    tokens, each with ``q`` query tokens (1: a decode step; more: a draft chain being
    verified), on the kernels' threads as the engine runs a decode step; the median of
    repeats, and each ``q``'s time over ``q = 1``'s. ``cold``: each of the 30 layers reads its
    own cache, blocks in a shuffled order, so a forward reads every K/V row from memory as an
    engine step does (otherwise the one cache read 30 times may stay in the CPU caches)."""
    mod = ext()
    heads, kv_heads, dim, bs, layers = 9, 3, 64, 16, 30
    print(f"paged attention x {layers} layers, bf16, {'cold' if cold else 'warm'} caches "
          "(ms per forward; ratio to q=1):")
    for batch, ctx in shapes:
        row = []
        for q in queries:
            per = (ctx + q) // bs + 2
            caches = [(torch.randn(batch * per, bs, kv_heads, dim).to(torch.bfloat16),
                        torch.randn(batch * per, bs, kv_heads, dim).to(torch.bfloat16))
                       for _ in range(layers if cold else 1)]
            order = torch.randperm(batch * per) if cold else torch.arange(batch * per)
            table = order.to(torch.int32).view(batch, per)
            query = torch.randn(batch * q, heads, dim).to(torch.bfloat16)
            qseq = torch.arange(batch, dtype=torch.int32).repeat_interleave(q)
            lens = torch.tensor([ctx + 1 + j for _ in range(batch) for j in range(q)],
                                dtype=torch.int32)

            def forward(query=query, table=table, qseq=qseq, lens=lens, caches=caches):
                for i in range(layers):
                    k, v = caches[i % len(caches)]
                    mod.paged_attention(query, k, v, table, qseq, lens, dim ** -0.5, None, None)

            with kernels.kernel_threads(True):
                sec = time_call(forward)
            row.append(sec * 1e3)
        print(f"  B={batch:>2} C={ctx:>4}: " + "  ".join(
            f"q={q} {t:6.2f} ({t / row[0]:.2f})" for q, t in zip(queries, row)))


if __name__ == "__main__":
    main()
