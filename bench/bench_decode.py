"""Decode throughput of specengine vs HF transformers ``generate`` vs the memory floor, one run.

Greedy decoding of raw HumanEval prompts with a fixed number of new tokens (EOS masked until
then: the engine's ``min_tokens``, HF's ``min_new_tokens``, so both generate the same tokens),
on the default model in bfloat16 and float32, at several batch sizes. Per row:

- decode tok/s: tokens from decode steps only / time in decode steps. Engine: ``get_metrics()``
  deltas (model forward of decode steps; the first token of each request comes from prefill).
  HF: ``generate(N)`` minus ``generate(1)`` time, for ``N - 1`` tokens per sequence.
- e2e tok/s: all generated tokens / wall time of the whole ``generate`` call.
- ms/step: decode time per decode step (engine: forward only); full ms/step adds everything
  else in the engine's step loop (scheduling, sampling, detokenizing, stop checks).
- vs HF: decode tok/s over HF's at the same dtype and batch; vs floor: ms/step over the floor,
  weight bytes read per step / measured memory read bandwidth.

    python bench/bench_decode.py [--quick] [--out results.json] [--profile] [--llamacpp]

``--llamacpp`` adds llama.cpp rows at batch 1 (``llama-cpp-python`` built from source, not
pinned by the project: see bench/README.md), on the same GGUF: ``Q4_1`` is the shipped file,
``BF16`` that file requantized by llama.cpp's own ``llama_model_quantize`` (the weights the
engine runs: Q4_1 dequantized, rounded to bfloat16), ``BF16+lookup`` llama.cpp's prompt-lookup
decoding (``LlamaPromptLookupDecoding``) on the BF16 file. Same threads as the engine, greedy,
same prompt tokens; decode time = ``generate(N)`` - ``generate(1)`` as for HF. Each llama.cpp
row runs in a process of its own (``run_apart``), so it does not slow the engine's rows.
``--spec ngram,eagle`` adds the engine at batch 1 in bfloat16 with each speculative method
(default ``auto`` policy; EAGLE: the shipped drafter), timed the same way (drafting and the
policy count), beside the plain engine timed so, on the first prompt, with each row's ratio to
the llama.cpp rows and whether its tokens equal the plain engine's.

``--lockstep ROUNDS`` (with ``--spec``) times them instead in lockstep: the plain engine and
one per method in one process, each of the first ``--lockstep-prompts`` prompts run by every
engine in a shuffled order, ``ROUNDS`` times (each engine's wall time, its ratio to plain):

    python bench/bench_decode.py --dtypes bfloat16 --batches 1 --hf-batches 1 \
        --spec ngram,eagle --lockstep 2

``--invariance`` measures instead what batch invariance costs (``kernels.set_batch_invariant``):
the engine alone, each batch run with invariance on and off in alternation on one engine (best
of ``--repeats`` each), decode tok/s and the prefill time of the batch's prompts (one
prefill step of every prompt) side by side:

    python bench/bench_decode.py --invariance --out results/invariance.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import sys
import time

import torch
from common import (
    best_time,
    decode_weight_bytes,
    machine_info,
    markdown_table,
    memory_bandwidth,
    quiet_transformers,
)

from specengine import LLM, SamplingParams
from specengine.data.prompt_sets import humaneval_prompts
from specengine.models.loader import resolve_model

MODEL = "smollm2-135m-instruct"
BLOCK = 16


def engine_llm(dtype: str, prompts: list[list[int]], max_tokens: int,
               speculative_config: dict | None = None) -> LLM:
    """An LLM sized so the largest batch is admitted in one prefill step with no preemption
    (with ``speculative_config``: room for the drafts too)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve_model(MODEL))
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem
    blocks = sum(-(-(len(p) + max_tokens + 1) // BLOCK) + 1 for p in prompts) + 16
    blocks += 8 * len(prompts) if speculative_config else 0
    return LLM(MODEL, dtype=dtype, block_size=BLOCK, max_num_seqs=len(prompts),
               speculative_config=speculative_config,
               kv_cache_memory_bytes=blocks * BLOCK * per_token,
               max_num_batched_tokens=sum(len(p) for p in prompts) + len(prompts) + 64,
               enable_prefix_caching=False)  # every repeat pays its prefill


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
    """Best (least decode time) of ``repeats`` generate calls; metrics from ``get_metrics()``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    best = None
    for _ in range(repeats):
        m0 = llm.get_metrics()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        m1 = llm.get_metrics()
        d = {k: m1[k] - m0[k] for k in ("requests", "generated_tokens", "steps", "prefill_time",
                                        "decode_time", "preemptions")}
        steps = m1.get("decode_steps", 0) - m0.get("decode_steps", 0) or d["steps"] - 1
        tokens = d["generated_tokens"] - d["requests"]  # first tokens come from prefill
        r = {"decode_tok_s": tokens / d["decode_time"], "e2e_tok_s": d["generated_tokens"] / wall,
             "ms_step": 1e3 * d["decode_time"] / steps,
             "full_ms_step": 1e3 * (wall - d["prefill_time"]) / steps,
             "prefill_s": d["prefill_time"], "decode_s": d["decode_time"], "wall_s": wall,
             "decode_steps": steps, "steps": d["steps"], "generated_tokens": d["generated_tokens"],
             "preemptions": d["preemptions"],
             "clean": d["preemptions"] == 0 and d["steps"] == steps + 1
             and all(len(o.outputs[0].token_ids) == max_tokens for o in outs),
             "first_output": outs[0].outputs[0].token_ids}
        if best is None or r["decode_s"] < best["decode_s"]:
            best = r
    return best


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def run_hf(model, prompts: list[list[int]], max_tokens: int, pad_id: int, repeats: int) -> dict:
    """HF ``generate`` (greedy, exactly ``max_tokens`` new tokens, left padding for batch > 1);
    decode time = best ``generate(max_tokens)`` - best ``generate(1)``."""
    ids, mask = left_pad(prompts, pad_id)
    out = {}

    def gen(n: int):
        with torch.inference_mode():
            out[n] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                    min_new_tokens=n, do_sample=False, pad_token_id=pad_id)

    t_n = best_time(lambda: gen(max_tokens), repeats)
    t_1 = best_time(lambda: gen(1), repeats)
    b = len(prompts)
    decode = max(t_n - t_1, 1e-9)
    return {"decode_tok_s": b * (max_tokens - 1) / decode, "e2e_tok_s": b * max_tokens / t_n,
            "ms_step": 1e3 * decode / (max_tokens - 1), "full_ms_step": None,
            "prefill_s": t_1, "decode_s": decode, "wall_s": t_n,
            "padded_tokens": int((mask == 0).sum()), "prompt_width": ids.shape[1],
            "first_output": out[max_tokens][0, ids.shape[1]:].tolist()}


def agree_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two greedy outputs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def llamacpp_files() -> dict[str, str]:
    """The default model's GGUF (Q4_1, hash-checked) and its BF16 requantization by llama.cpp
    (written once beside it, atomically)."""
    import llama_cpp

    from specengine.models.registry import fetch_gguf

    q4 = fetch_gguf(MODEL)
    bf16 = q4.with_name(q4.stem.replace("Q4_1", "BF16") + ".gguf")
    if not bf16.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_BF16
        params.allow_requantize = True
        params.nthread = torch.get_num_threads()
        tmp = bf16.with_suffix(".part")
        if llama_cpp.llama_model_quantize(str(q4).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama_model_quantize {q4} -> BF16 failed")
        os.replace(tmp, bf16)
    return {"Q4_1": str(q4), "BF16": str(bf16)}


def run_llamacpp(path: str, prompt: list[int], max_tokens: int, repeats: int,
                 lookup: bool = False) -> dict:
    """llama.cpp (``llama-cpp-python``) at batch 1: greedy, exactly ``max_tokens`` new tokens
    (``Llama.generate`` does not stop at EOS), the KV cache reset before each run;
    ``lookup``: its prompt-lookup drafting."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = torch.get_num_threads()
    llm = Llama(model_path=path, n_ctx=len(prompt) + max_tokens + 64, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False,
                draft_model=LlamaPromptLookupDecoding() if lookup else None)
    out = {}

    def gen(n: int):
        llm.reset()
        toks = []
        for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                              repeat_penalty=1.0, reset=True):
            toks.append(t)
            if len(toks) == n:
                break
        out[n] = toks

    gen(4)  # warm up
    t_n = best_time(lambda: gen(max_tokens), repeats)
    t_1 = best_time(lambda: gen(1), repeats)
    decode = max(t_n - t_1, 1e-9)
    llm.close()
    return {"decode_tok_s": (max_tokens - 1) / decode, "e2e_tok_s": max_tokens / t_n,
            "ms_step": 1e3 * decode / (max_tokens - 1), "full_ms_step": None,
            "prefill_s": t_1, "decode_s": decode, "wall_s": t_n, "threads": threads,
            "first_output": out[max_tokens]}


def run_apart(fn, *args):
    """``fn(*args)`` in a fresh process (spawned, same threads), its result returned: llama.cpp
    loaded in this process slowed the engine rows timed after it by up to 25% (its thread pool
    stays), so its rows run apart."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=ctx, initializer=torch.set_num_threads,
                             initargs=(torch.get_num_threads(),)) as pool:
        return pool.submit(fn, *args).result()


def run_engine_wall(llm: LLM, prompt: list[int], max_tokens: int, repeats: int) -> dict:
    """The engine at batch 1 timed as llama.cpp and HF are: decode time = best wall time of
    ``generate(max_tokens)`` - best of ``generate(1)``, so drafting and the policy count."""
    out = {}

    def gen(n: int):
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
        out[n] = llm.generate([{"prompt_token_ids": prompt}], params,
                              use_tqdm=False)[0].outputs[0].token_ids

    gen(8)  # warm up
    t_n = best_time(lambda: gen(max_tokens), repeats)
    t_1 = best_time(lambda: gen(1), repeats)
    decode = max(t_n - t_1, 1e-9)
    return {"decode_tok_s": (max_tokens - 1) / decode, "e2e_tok_s": max_tokens / t_n,
            "ms_step": 1e3 * decode / (max_tokens - 1), "full_ms_step": None,
            "prefill_s": t_1, "decode_s": decode, "wall_s": t_n,
            "first_output": out[max_tokens]}


def run_lockstep(llms: dict[str, LLM], groups: list[list[list[int]]], max_tokens: int,
                 rounds: int, seed: int) -> tuple[dict[str, float], dict[str, list]]:
    """Greedy, ``max_tokens`` tokens each: every group of prompts (one ``generate`` call, the
    batch) run by every engine of ``llms`` in a shuffled order (``random.Random(seed)``),
    ``rounds`` times, so the machine's drift falls on all alike. Returns per engine its wall
    seconds in all and its output token ids (every round's, in order)."""
    import random

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    names = list(llms)
    wall, outs, rng = dict.fromkeys(names, 0.0), {n: [] for n in names}, random.Random(seed)
    for _ in range(rounds):
        for group in groups:
            order = names[:]
            rng.shuffle(order)
            for n in order:
                t0 = time.perf_counter()
                out = llms[n].generate([{"prompt_token_ids": p} for p in group], params,
                                       use_tqdm=False)
                wall[n] += time.perf_counter() - t0
                outs[n] += [o.outputs[0].token_ids for o in out]
    return wall, outs


def policy_state(llm: LLM) -> dict:
    """The engine's decode steps per strategy (``steps``) and its loss guard's state
    (``guard``): which mode an ``auto`` policy took."""
    m = llm.get_metrics()
    return {"steps": {k: v["steps"] for k, v in m["policy_strategies"].items()},
            "guard": m.get("policy_guard")}


def lockstep(methods: list[str], prompts: list[list[int]], max_tokens: int,
             rounds: int) -> dict:
    """Batch 1, bf16, greedy: the plain engine and one engine per speculative method (``auto``)
    in one process, each prompt run by every engine in a shuffled order (seeded), ``rounds``
    times; the machine's drift then falls on all alike. Returns each engine's wall seconds,
    its speed over the plain engine's (``vs_plain``), whether its tokens equal plain's and
    each method's steps per strategy and loss-guard state (``policy``)."""
    names = ["plain", *methods]
    llms = {n: engine_llm("bfloat16", prompts[:1], max_tokens,
                          None if n == "plain" else {"method": n}) for n in names}
    wall, outs = run_lockstep(llms, [[p] for p in prompts], max_tokens, rounds, seed=0)
    vs = {n: wall["plain"] / wall[n] for n in names}
    policy = {n: policy_state(llms[n]) for n in methods}
    print("# lockstep, " + ", ".join(f"{n} {v:.3f}x" for n, v in vs.items())
          + f" of plain ({len(prompts)} prompts x {rounds} rounds)", file=sys.stderr)
    return {"engine": "lockstep", "dtype": "bfloat16", "batch": 1, "prompts": len(prompts),
            "rounds": rounds, "wall_s": wall, "vs_plain": vs,
            "same_tokens_as_plain": {n: outs[n] == outs["plain"] for n in names},
            "policy": policy}


def profile_decode_step(llm: LLM, prompt: list[int]) -> str:
    """torch.profiler (top ops by self CPU time) and cProfile (top functions) of one batch-1
    decode step of the engine."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    eng.add_request(list(prompt), params)
    eng.step()  # prefill
    for _ in range(3):
        eng.step()  # warm decode steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step()
    text = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    pr = cProfile.Profile()
    pr.enable()
    eng.step()
    pr.disable()
    eng.abort_all()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(20)
    return text + "\n" + s.getvalue()


def invariance(dtypes: list[str], batches: list[int], all_ids: list[list[int]],
               max_tokens: int, repeats: int, info: dict, out: str | None) -> None:
    """Batch invariance on vs off per dtype and batch (``--invariance``): decode tok/s and
    prefill seconds, each the best of ``repeats`` runs, on and off alternating on one engine."""
    from specengine.ops import kernels

    results = []
    for dtype in dtypes:
        llm = engine_llm(dtype, all_ids[:max(batches)], max_tokens)
        run_engine(llm, all_ids[:min(8, max(batches))], 8, 1)  # warm up
        for b in batches:
            runs = {True: [], False: []}
            for _ in range(repeats):
                for mode in (True, False):
                    with kernels.batch_invariance(mode):
                        runs[mode].append(run_engine(llm, all_ids[:b], max_tokens, 1))
            on, off = ({"decode_tok_s": max(r["decode_tok_s"] for r in runs[m]),
                        "prefill_best_s": min(r["prefill_s"] for r in runs[m]),
                        "first_output": runs[m][0]["first_output"]} for m in (True, False))
            row = {"dtype": dtype, "batch": b,
                   "prefill_tokens": sum(len(p) for p in all_ids[:b]),
                   "decode_tok_s_on": on["decode_tok_s"], "decode_tok_s_off": off["decode_tok_s"],
                   "decode_ratio": on["decode_tok_s"] / off["decode_tok_s"],
                   "prefill_s_on": on["prefill_best_s"], "prefill_s_off": off["prefill_best_s"],
                   "prefill_ratio": off["prefill_best_s"] / on["prefill_best_s"],
                   "same_tokens": on["first_output"] == off["first_output"]}
            results.append(row)
            print(f"# {dtype} b={b}: decode {row['decode_ratio']:.3f}x, prefill "
                  f"{row['prefill_ratio']:.3f}x of invariance off", file=sys.stderr)
    print(markdown_table(
        ["dtype", "batch", "prefill tokens", "decode tok/s on", "off", "on/off",
         "prefill s on", "off", "speed on/off"],
        [[r["dtype"], r["batch"], r["prefill_tokens"], f"{r['decode_tok_s_on']:.1f}",
          f"{r['decode_tok_s_off']:.1f}", f"{r['decode_ratio']:.2f}", f"{r['prefill_s_on']:.3f}",
          f"{r['prefill_s_off']:.3f}", f"{r['prefill_ratio']:.2f}"] for r in results]))
    if out:
        from specengine.data.jsonl import write_json_atomic
        write_json_atomic(out, {"machine": info, "max_tokens": max_tokens, "repeats": repeats,
                                "rows": results})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: batches 1,8, 16 tokens, HF batch 1 only, one repeat")
    ap.add_argument("--out", help="write results as JSON here")
    ap.add_argument("--max-tokens", type=int, help="new tokens per sequence (default 128)")
    ap.add_argument("--batches", help="engine batch sizes, comma-separated (default 1,8,64)")
    ap.add_argument("--hf-batches", help="HF batch sizes (default 1,8)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--repeats", type=int, help="runs per row, best kept (default 2)")
    ap.add_argument("--profile", action="store_true",
                    help="profile one batch-1 decode step (also done when slower than HF)")
    ap.add_argument("--llamacpp", action="store_true",
                    help="add llama.cpp rows at batch 1 (llama-cpp-python must be installed)")
    ap.add_argument("--spec", default="",
                    help="speculative methods for extra bf16 batch-1 rows (e.g. ngram,eagle), "
                         "timed by wall clock as llama.cpp is, beside the plain engine so timed")
    ap.add_argument("--lockstep", type=int, default=0, metavar="ROUNDS",
                    help="with --spec: instead of one prompt each, the plain engine and each "
                         "method in lockstep over --lockstep-prompts prompts, ROUNDS times")
    ap.add_argument("--lockstep-prompts", type=int, default=6)
    ap.add_argument("--invariance", action="store_true",
                    help="batch invariance on vs off, engine only (see the docstring)")
    args = ap.parse_args()
    q = args.quick
    max_tokens = args.max_tokens or (16 if q else 128)
    batches = [int(b) for b in (args.batches or ("1,8" if q else "1,8,64")).split(",")]
    hf_batches = [int(b) for b in (args.hf_batches or ("1" if q else "1,8")).split(",")]
    dtypes = args.dtypes.split(",")
    repeats = args.repeats or (1 if q else 2)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    quiet_transformers()

    info = machine_info()
    print(f"# decode benchmark: {MODEL}, {max_tokens} new tokens, greedy, HumanEval prompts",
          file=sys.stderr)
    print(f"# torch {info['torch']} threads={info['torch_threads']} cpu: {info['cpu']}",
          file=sys.stderr)
    bw = memory_bandwidth(gib=1.0, repeats=3 if q else 5)
    print(f"# memory read {bw['read_gbs']:.1f} GB/s, copy {bw['copy_gbs']:.1f} GB/s",
          file=sys.stderr)

    model_dir = resolve_model(MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    texts = [p["prompt"] for p in humaneval_prompts(
        max(batches + hf_batches + [args.lockstep_prompts if args.lockstep else 0]))]
    all_ids = [tok(t).input_ids for t in texts]

    if args.invariance:
        return invariance(dtypes, batches, all_ids, max_tokens, repeats, info, args.out)
    rows, results, floors, profile_text = [], [], {}, None
    for dtype in dtypes:
        llm = engine_llm(dtype, all_ids[:max(batches)], max_tokens)
        run_engine(llm, all_ids[:min(8, max(batches))], 8, 1)  # warm up
        eng = {}
        for b in batches:
            eng[b] = run_engine(llm, all_ids[:b], max_tokens, repeats)
            print(f"# engine {dtype} b={b}: {eng[b]['decode_tok_s']:.1f} tok/s", file=sys.stderr)
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        hf_model.eval()
        wbytes = decode_weight_bytes(hf_model, getattr(torch, dtype))
        floor_ms = 1e3 * wbytes / (bw["read_gbs"] * 1e9)
        floors[dtype] = {"weight_bytes": wbytes, "floor_ms": floor_ms}
        run_hf(hf_model, all_ids[:1], 4, pad_id, 1)  # warm up
        hf = {}
        for b in hf_batches:
            hf[b] = run_hf(hf_model, all_ids[:b], max_tokens, pad_id, repeats)
            print(f"# hf {dtype} b={b}: {hf[b]['decode_tok_s']:.1f} tok/s", file=sys.stderr)
        # same greedy tokens? (expected in float32; bfloat16 may drift after a near-tie)
        a, h = eng[batches[0]]["first_output"], hf[hf_batches[0]]["first_output"]
        same = agree_prefix(a, h)
        floors[dtype]["agree_prefix_with_hf"] = same
        if same < min(len(a), len(h)):  # HF's own top-2 logit gap where the two part
            with torch.inference_mode():
                logits = hf_model(torch.tensor([all_ids[0] + a[:same]])).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            floors[dtype]["hf_top2_gap_at_divergence"] = float(top[0] - top[1])
        del hf_model
        gc.collect()
        slower = 1 in eng and 1 in hf and eng[1]["decode_tok_s"] < hf[1]["decode_tok_s"]
        if dtype == "bfloat16" and 1 in eng and (args.profile or slower) and profile_text is None:
            profile_text = profile_decode_step(llm, all_ids[0])
        del llm
        gc.collect()
        for name, res in (("specengine", eng), ("hf", hf)):
            for b, r in res.items():
                vs_hf = r["decode_tok_s"] / hf[b]["decode_tok_s"] if b in hf else None
                r.update(engine=name, dtype=dtype, batch=b, vs_hf=vs_hf,
                         vs_floor=r["ms_step"] / floor_ms)
                results.append(r)
                rows.append([name, dtype, b, r["decode_tok_s"], r["e2e_tok_s"], r["ms_step"],
                             r["full_ms_step"], vs_hf if name == "specengine" else None,
                             r["vs_floor"]])

    if args.llamacpp:
        files = llamacpp_files()
        eng1 = next((r for r in results if r["engine"] == "specengine" and r["batch"] == 1
                     and r["dtype"] == "bfloat16"), None)
        for name, path, lookup in (("BF16", files["BF16"], False), ("Q4_1", files["Q4_1"], False),
                                   ("BF16+lookup", files["BF16"], True)):
            r = run_apart(run_llamacpp, path, all_ids[0], max_tokens, repeats, lookup)
            print(f"# llama.cpp {name} b=1: {r['decode_tok_s']:.1f} tok/s", file=sys.stderr)
            r.update(engine="llama.cpp", dtype=name, batch=1, vs_hf=None, vs_floor=(
                r["ms_step"] / floors["bfloat16"]["floor_ms"] if "bfloat16" in floors else None),
                agree_prefix_with_engine=agree_prefix(eng1["first_output"], r["first_output"])
                if eng1 else None)
            results.append(r)
            rows.append(["llama.cpp", name, 1, r["decode_tok_s"], r["e2e_tok_s"], r["ms_step"],
                         None, None, r["vs_floor"]])
            if eng1:
                print(f"# specengine bf16 b=1 / llama.cpp {name}: "
                      f"{eng1['decode_tok_s'] / r['decode_tok_s']:.2f}x", file=sys.stderr)

    spec = [m for m in args.spec.split(",") if m]
    if spec and args.lockstep:
        lock = lockstep(spec, all_ids[:args.lockstep_prompts], max_tokens, args.lockstep)
        results.append(lock)
    elif spec:  # batch 1, bf16, wall-clock decode time: plain first, then each method
        plain = None
        for method in [None] + spec:
            cfg = {"method": method} if method else None
            llm = engine_llm("bfloat16", all_ids[:1], max_tokens, cfg)
            r = run_engine_wall(llm, all_ids[0], max_tokens, repeats)
            del llm
            gc.collect()
            name = f"specengine+{method}" if method else "specengine (wall)"
            plain = plain or r
            r.update(engine=name, dtype="bfloat16", batch=1, vs_hf=None,
                     vs_floor=r["ms_step"] / floors["bfloat16"]["floor_ms"]
                     if "bfloat16" in floors else None,
                     same_tokens_as_plain=r["first_output"] == plain["first_output"])
            for q4 in (x for x in results if x["engine"] == "llama.cpp"):
                r[f"vs_llamacpp_{q4['dtype']}"] = r["decode_tok_s"] / q4["decode_tok_s"]
            print(f"# {name} b=1 (wall): {r['decode_tok_s']:.1f} tok/s, same tokens as plain: "
                  f"{r['same_tokens_as_plain']}, "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in r.items() if k.startswith("vs_llama")),
                  file=sys.stderr)
            results.append(r)
            rows.append([name, "bfloat16", 1, r["decode_tok_s"], r["e2e_tok_s"], r["ms_step"],
                         None, None, r["vs_floor"]])

    print(markdown_table(["engine", "dtype", "batch", "decode tok/s", "e2e tok/s", "ms/step",
                          "full ms/step", "vs HF", "vs floor"], rows) + "\n")
    for dtype, f in floors.items():
        print(f"floor {dtype}: {f['weight_bytes'] / 1e6:.0f} MB / {bw['read_gbs']:.1f} GB/s = "
              f"{f['floor_ms']:.2f} ms/step; greedy tokens equal to HF for the first "
              f"{f['agree_prefix_with_hf']} of {max_tokens}"
              + (f" (HF's top-2 logit gap there: {f['hf_top2_gap_at_divergence']:.3f})"
                 if "hf_top2_gap_at_divergence" in f else ""))
    for r in results:
        if r["engine"] == "specengine" and not r["clean"]:
            print(f"WARNING: {r['dtype']} b={r['batch']}: preemptions or mixed prefill/decode "
                  "steps; decode numbers are approximate")
    by = {(r["engine"], r["dtype"], r["batch"]): r for r in results}
    targets = {}
    e1, h1 = by.get(("specengine", "bfloat16", 1)), by.get(("hf", "bfloat16", 1))
    if e1 and h1:
        targets["b1_bf16_vs_hf>=2"] = (e1["vs_hf"], e1["vs_hf"] >= 2)
    if e1:
        targets["b1_bf16_step/floor<=2"] = (e1["vs_floor"], e1["vs_floor"] <= 2)
        targets["b1_bf16_full_step/floor<=2"] = (e1["full_ms_step"] / floors["bfloat16"]
                                                 ["floor_ms"], e1["full_ms_step"]
                                                 / floors["bfloat16"]["floor_ms"] <= 2)
    e64 = by.get(("specengine", "bfloat16", 64))
    if e1 and e64:
        ratio = e64["decode_tok_s"] / e1["decode_tok_s"]
        targets["b64/b1_bf16_throughput>=8"] = (ratio, ratio >= 8)
    print("\ntargets:")
    for name, (value, ok) in targets.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {value:.2f}")
    if profile_text:
        print("\nprofile of one batch-1 bfloat16 decode step:\n" + profile_text)
    if args.out:
        for r in results:
            r.pop("first_output", None)
        doc = {"machine": info, "bandwidth": bw, "model": MODEL, "max_tokens": max_tokens,
               "prompt_tokens": [len(p) for p in all_ids], "floors": floors,
               "results": results,
               "targets": {k: {"value": v, "pass": ok} for k, (v, ok) in targets.items()},
               "profile": profile_text}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
