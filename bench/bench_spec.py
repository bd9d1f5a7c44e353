"""Speculative decoding: tokens/s, acceptance length and speedup of each drafter, one run.

specengine without speculation (the baseline of every ratio), with ``ngram`` (a chain, a small
tree, and the default ``auto`` policy), with ``eagle`` (the drafter shipped for the target; the
rows are skipped with a note when there is none) and, with ``--pair qwen``, with ``draft_model``
(qwen2.5-coder-0.5b-instruct drafting for qwen2.5-coder-1.5b-instruct); against HF transformers
``generate`` on the same token ids: plain, prompt lookup (``prompt_lookup_num_tokens``) and, for
the Qwen pair, assisted generation with the same draft model (``assistant_model``), batch 1 only
(HF assisted generation supports batch 1 only). All in bfloat16 (``--dtype``), the same
``max_new_tokens``, EOS respected (``--ignore-eos`` for fixed lengths).

Prompt sets: raw HumanEval prompts, GSM-style questions (generator seed 1234) and ShareGPT first
user turns (records 10,000..11,999), the last two through the chat template. The shipped EAGLE
drafter was trained on other prompts (GSM seed 0, ShareGPT records < 10,000; no HumanEval).
Batch 1 runs the prompts one at a time, batch 8 in groups of 8. Every engine is built first and
the runs are interleaved (for each set and batch, every method in turn), so slow drifts of a
shared machine hit all methods alike.

Per row:

- tok/s: decode tokens per second. Engine: ``(generated - requests) / (wall - prefill_time)``
  from ``get_metrics()`` deltas and the wall time of the ``generate`` calls, so drafting,
  verification, sampling and bookkeeping all count (the first token of each request comes from
  prefill). HF: ``generate(N)`` minus ``generate(1)`` time, per prompt, for the tokens after the
  first. e2e tok/s: all generated tokens / all wall time.
- tau: acceptance length, tokens committed per target forward of a speculative step (the bonus
  token included; ``get_metrics()["acceptance_length"]``); 1 without speculation. HF: generated
  tokens / calls of the target model's forward (counted with a hook).
- speedup: tok/s over specengine without speculation, same set, batch and temperature.
  vs HF plain: tok/s over HF plain ``generate`` (batch 1).
- mismatch: greedy rows, prompts whose token ids differ from specengine without speculation at
  the same batch (``k/n``); bfloat16 can legitimately flip a near-tie, float32 should not.

Targets (PASS/FAIL printed, never an exit status): n-gram >= 1.3x on HumanEval at batch 1
(default model); EAGLE (best row per set and temperature, batch 1): tau >= 3.5 at T = 0 and
>= 3.0 at T = 1 (``--sampled``) on GSM, >= 3.0 at T = 0 on ShareGPT, speedup >= 2.0 at T = 0;
with ``--pair qwen``, draft_model >= 1.4x on HumanEval at batch 1 and >= 2x HF assisted
generation with the same pair.

    python bench/bench_spec.py [--quick] [--out results.json]
    python bench/bench_spec.py --pair qwen [--quick] [--out results_qwen.json]
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback

import torch
from common import machine_info, markdown_table, quiet_transformers, stderr_logger, write_json

from specengine import LLM, SamplingParams
from specengine.data.prompt_sets import chat_prompts, gsm_questions, humaneval_prompts
from specengine.models import loader
from specengine.models.loader import resolve_model

BLOCK = 16
BATCHES = (1, 8)
PAIRS = {"default": ("smollm2-135m-instruct", None),
         "qwen": ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
         "qwen05": ("qwen2.5-coder-0.5b-instruct", None)}
SETS = ("humaneval", "gsm", "sharegpt")
HF_LOOKUP_TOKENS = 10  # transformers' suggested prompt_lookup_num_tokens
EVAL_GSM_SEED = 1234  # the shipped drafter trains on seed 0 (examples/train_drafter.py)
EVAL_SHAREGPT_START = 10_000  # ... and on ShareGPT records below this


def engine_methods(pair: str, draft: str | None, quick: bool) -> list[tuple[str, dict | None]]:
    """(row name, speculative_config) of the specengine rows; None is the baseline. Fixed
    shapes use ``policy: static`` so the row measures exactly that tree."""
    static = {"policy": "static"}
    ngram_chain = ("ngram chain d5", {"method": "ngram", "num_speculative_tokens": 5, **static})
    ngram_tree = ("ngram tree d4 k2 m8", {"method": "ngram", "num_speculative_tokens": 4,
                                          "topk": 2, "num_verify_tokens": 8, **static})
    ngram_auto = ("ngram auto d6", {"method": "ngram", "num_speculative_tokens": 6})
    eagle = {"method": "eagle"}
    eagle_rows = [
        ("eagle chain d5", {**eagle, "num_speculative_tokens": 5, **static}),
        ("eagle tree d5 k2 m10", {**eagle, "num_speculative_tokens": 5, "topk": 2,
                                  "num_verify_tokens": 10, **static}),
        ("eagle tree d6 k3 m16", {**eagle, "num_speculative_tokens": 6, "topk": 3,
                                  "num_verify_tokens": 16, **static}),
        ("eagle tree d8 k4 m32", {**eagle, "num_speculative_tokens": 8, "topk": 4,
                                  "num_verify_tokens": 32, **static}),
        ("eagle auto d6", {**eagle, "num_speculative_tokens": 6})]
    out: list[tuple[str, dict | None]] = [("no spec", None)]
    if draft is None:  # a target alone: n-gram and its EAGLE drafter
        out += [ngram_chain, ngram_tree, ngram_auto] + eagle_rows
        return out
    dm = {"method": "draft_model", "model": draft}
    dm_chain = ("draft chain d4", {**dm, "num_speculative_tokens": 4, **static})
    dm_tree = ("draft tree d4 k2 m8", {**dm, "num_speculative_tokens": 4, "topk": 2,
                                       "num_verify_tokens": 8, **static})
    if quick:
        return out + [dm_chain]
    return out + [ngram_chain, dm_chain, dm_tree, ("draft auto d6", {
        **dm, "num_speculative_tokens": 6})]


def hf_methods(pair: str, quick: bool) -> list[tuple[str, dict]]:
    """(row name, extra ``generate`` kwargs) of the HF rows; ``assistant`` is replaced by the
    HF draft model."""
    out = [("hf plain", {})]
    if pair == "default":
        out.append((f"hf prompt lookup {HF_LOOKUP_TOKENS}",
                    {"prompt_lookup_num_tokens": HF_LOOKUP_TOKENS}))
    else:
        out.append(("hf assisted (draft)", {"assistant": True}))
    return out


# ---------------------------------------------------------------- prompts


def build_prompts(tok, sets: list[str], n: int) -> dict[str, list[list[int]]]:
    """Token ids of ``n`` prompts per set: HumanEval raw, GSM and ShareGPT via the chat
    template (as ``LLM.chat`` encodes them)."""
    def chat(conv: list[dict]) -> list[int]:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False).input_ids

    out = {}
    for s in sets:
        if s == "humaneval":
            out[s] = [tok(p["prompt"]).input_ids for p in humaneval_prompts(n)]
        elif s == "gsm":
            out[s] = [chat([{"role": "user", "content": q["question"]}])
                      for q in gsm_questions(n, seed=EVAL_GSM_SEED)]
        elif s == "sharegpt":
            out[s] = [chat(c) for c in chat_prompts(n, max_chars=1500,
                                                    start=EVAL_SHAREGPT_START)]
        else:
            raise ValueError(f"unknown prompt set {s!r}; known: {SETS}")
    return out


# ---------------------------------------------------------------- specengine


def shared_loader():
    """Make every ``LLM`` of this process share one copy of each model's weights (the engines
    run one at a time and never write weights); returns a function that undoes it."""
    original = loader.load_model
    cache = {}

    def load_model(name_or_path, dtype=torch.bfloat16, device="cpu", **kw):
        key = (str(name_or_path), str(dtype), str(device), tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = original(name_or_path, dtype=dtype, device=device, **kw)
        return cache[key]

    loader.load_model = load_model
    return lambda: setattr(loader, "load_model", original)


def llm_kwargs(model: str, dtype: str, prompts: dict[str, list[list[int]]], max_tokens: int,
               max_budget: int = 16) -> dict:
    """KV pool and token budget so that a batch of 8 of the longest prompts is admitted in one
    prefill step and never preempted, with room for draft trees of ``max_budget`` nodes."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(resolve_model(model))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * elem
    b = max(BATCHES)
    longest = sorted((len(p) for ps in prompts.values() for p in ps), reverse=True)[:b]
    blocks = sum(-(-(n + max_tokens + max_budget + 1) // BLOCK) + 1 for n in longest) + 16
    return {"dtype": dtype, "block_size": BLOCK, "max_num_seqs": b,
            "kv_cache_memory_bytes": blocks * BLOCK * per_token,
            "max_num_batched_tokens": max(2048, sum(longest) + b * (max_budget + 1) + 64),
            "enable_prefix_caching": False}  # repeated runs of a prompt pay its prefill


DELTA_KEYS = ("requests", "generated_tokens", "steps", "decode_steps", "prefill_time",
              "decode_time", "draft_time", "sample_time", "spec_steps", "drafted_tokens",
              "accepted_tokens", "preemptions")


def run_engine(llm: LLM, prompts: list[list[int]], batch: int, params: list[SamplingParams],
               repeats: int) -> dict:
    """Generate for ``prompts`` in groups of ``batch`` (one ``generate`` call each); the repeat
    with the least wall time is kept."""
    best = None
    for _ in range(repeats):
        m0 = llm.get_metrics()
        depth0 = dict(m0.get("accepted_per_depth", {}))  # the engine mutates its dict
        outs, wall = [], 0.0
        for i in range(0, len(prompts), batch):
            chunk = [{"prompt_token_ids": p} for p in prompts[i:i + batch]]
            t0 = time.perf_counter()
            outs += llm.generate(chunk, params[i:i + batch], use_tqdm=False)
            wall += time.perf_counter() - t0
        m1 = llm.get_metrics()
        d = {k: m1.get(k, 0) - m0.get(k, 0) for k in DELTA_KEYS}
        depth1 = m1.get("accepted_per_depth", {})
        per_depth = [(depth1.get(i, 0) - depth0.get(i, 0)) / d["spec_steps"]
                     for i in range(len(depth1))] if d["spec_steps"] else []
        decode_wall = max(wall - d["prefill_time"], 1e-9)
        r = {"tok_s": (d["generated_tokens"] - d["requests"]) / decode_wall,
             "e2e_tok_s": d["generated_tokens"] / wall, "wall_s": wall,
             "tau": (d["accepted_tokens"] + d["spec_steps"]) / d["spec_steps"]
             if d["spec_steps"] else 1.0,
             "tokens_per_forward": (d["generated_tokens"] - d["requests"])
             / max(d["decode_steps"], 1),
             "acceptance_rate_per_depth": per_depth,
             "draft_frac": d["draft_time"] / decode_wall,
             "verify_frac": d["decode_time"] / decode_wall,
             "clean": d["preemptions"] == 0, **d,
             "outputs": [o.outputs[0].token_ids for o in outs]}
        if best is None or r["wall_s"] < best["wall_s"]:
            best = r
    return best


# ---------------------------------------------------------------- HF transformers


class ForwardCounter:
    """Counts calls of a module's forward (the target's forwards in assisted generation)."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        module.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1


def run_hf(model, counter: ForwardCounter, prompts: list[list[int]], max_tokens: int,
           kwargs: dict, eos_ids: list[int], pad_id: int, ignore_eos: bool,
           repeats: int) -> dict:
    """HF ``generate``, greedy, batch 1, each prompt on its own: decode time per prompt is
    best ``generate(max_tokens)`` minus best ``generate(1)``."""
    outs, t_n_sum, t_1_sum, decode_tokens, new_tokens, calls = [], 0.0, 0.0, 0, 0, 0

    def gen(ids: torch.Tensor, n: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=n, min_new_tokens=n if ignore_eos else None,
                                  do_sample=False, temperature=None, top_p=None, top_k=None,
                                  eos_token_id=eos_ids, pad_token_id=pad_id, **kwargs)

    for p in prompts:
        ids = torch.tensor([p])
        best_n = best_1 = float("inf")
        for _ in range(repeats):
            c0 = counter.calls
            t0 = time.perf_counter()
            out = gen(ids, max_tokens)
            t = time.perf_counter() - t0
            if t < best_n:
                best_n, run_calls = t, counter.calls - c0
        for _ in range(repeats):
            t0 = time.perf_counter()
            gen(ids, 1)
            best_1 = min(best_1, time.perf_counter() - t0)
        toks = out[0, ids.shape[1]:].tolist()
        outs.append(toks)
        t_n_sum += best_n
        t_1_sum += best_1
        decode_tokens += len(toks) - 1
        new_tokens += len(toks)
        calls += run_calls
    decode = max(t_n_sum - t_1_sum, 1e-9)
    return {"tok_s": decode_tokens / decode, "e2e_tok_s": new_tokens / t_n_sum,
            "wall_s": t_n_sum, "prefill_s": t_1_sum, "generated_tokens": new_tokens,
            "tau": new_tokens / max(calls, 1), "target_forwards": calls, "outputs": outs}


def load_hf(model: str, dtype: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=getattr(torch, dtype))
    return m.eval()


# ---------------------------------------------------------------- checks


def mismatches(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int | None]]:
    """Prompts whose outputs differ, and per prompt the first differing position (None:
    equal)."""
    first = []
    for x, y in zip(a, b):
        if x == y:
            first.append(None)
        else:
            first.append(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v),
                              min(len(x), len(y))))
    return sum(f is not None for f in first), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 8 prompts per set (2 at batch 1), 32 tokens, one repeat")
    ap.add_argument("--pair", choices=sorted(PAIRS), default="default",
                    help="default: smollm2-135m-instruct; qwen: 0.5B drafting for 1.5B; qwen05: "
                         "qwen2.5-coder-0.5b-instruct alone (its EAGLE drafter, n-gram)")
    ap.add_argument("--out", help="write results as JSON here")
    ap.add_argument("--sets", help=f"prompt sets, comma-separated, from {','.join(SETS)} "
                    "(default: all; humaneval for --pair qwen)")
    ap.add_argument("--num-prompts", type=int,
                    help="prompts per set at batch 8 (default 16; 8 with --quick or --pair qwen)")
    ap.add_argument("--b1-prompts", type=int,
                    help="of those, how many run at batch 1 (default: all; 2 with --quick)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per request (default 128; 32 "
                    "with --quick)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--methods", help="only rows whose name contains one of these "
                    "comma-separated strings (the baseline always runs)")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers rows")
    ap.add_argument("--sampled", action="store_true",
                    help="also run every specengine row at temperature 1 (seeded)")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="fixed lengths: engine ignore_eos, HF min_new_tokens")
    ap.add_argument("--repeats", type=int, default=1, help="runs per row, best kept")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's); 1 on an "
                    "oversubscribed machine, where thread barriers dominate")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    q, qwen = args.quick, args.pair == "qwen"
    target, draft = PAIRS[args.pair]
    sets = (args.sets or ("humaneval" if qwen else ",".join(SETS))).split(",")
    n = args.num_prompts or (8 if q or qwen else 16)
    n_b1 = min(n, args.b1_prompts or (2 if q else n))
    max_tokens = args.max_tokens or (32 if q else 128)
    temps = (0.0, 1.0) if args.sampled else (0.0,)
    from transformers import AutoTokenizer
    quiet_transformers()

    start = time.perf_counter()
    log = stderr_logger(start)
    info = machine_info()
    log(f"spec benchmark: {target}" + (f" <- {draft}" if draft else "") + f", {args.dtype}, "
        f"{max_tokens} new tokens, sets {sets}, {n} prompts (batch 1: {n_b1}), temps {temps}")
    log(f"torch {info['torch']} transformers {info['transformers']} "
        f"threads={info['torch_threads']} cpu: {info['cpu']}")

    tok = AutoTokenizer.from_pretrained(resolve_model(target))
    prompts = build_prompts(tok, sets, n)
    methods = engine_methods(args.pair, draft, q)
    if args.methods:
        keep = args.methods.split(",")
        methods = [m for m in methods if m[1] is None or any(k in m[0] for k in keep)]
    notes: list[str] = []
    repro = f"python bench/bench_spec.py{' --quick' if q else ''}" \
            f"{'' if args.pair == 'default' else ' --pair ' + args.pair}"

    # build every engine first (one shared copy of each model's weights), then interleave
    undo = shared_loader()
    kw = llm_kwargs(target, args.dtype, prompts, max_tokens)
    engines: dict[str, LLM] = {}
    warm = SamplingParams(temperature=0.0, max_tokens=8)
    for name, spec in methods:
        t0 = time.perf_counter()
        try:
            llm = LLM(target, speculative_config=spec, **kw)
            llm.generate([{"prompt_token_ids": prompts[sets[0]][0]}], warm, use_tqdm=False)
        except Exception as e:
            msg = f"{name}: skipped, {type(e).__name__}: {e}"
            if spec and spec["method"] != "eagle":  # a missing EAGLE drafter is expected
                msg += f" (repro: {repro} --methods '{name}')"
                traceback.print_exc()
            notes.append(msg)
            log(msg)
            continue
        engines[name] = llm
        log(f"built {name} in {time.perf_counter() - t0:.1f}s")
    undo()
    eos_ids = sorted(engines["no spec"].engine.output.eos_token_ids)

    hf_models, hf_rows = {}, []
    if not args.no_hf:
        t0 = time.perf_counter()
        hf_models["target"] = load_hf(target, args.dtype)
        counter = ForwardCounter(hf_models["target"])
        if qwen:
            hf_models["draft"] = load_hf(draft, args.dtype)
        hf_rows = hf_methods(args.pair, q)
        log(f"loaded HF model(s) in {time.perf_counter() - t0:.1f}s")
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]

    results = []
    for s in sets:
        for b in BATCHES:
            ps = prompts[s][:n_b1] if b == 1 else prompts[s]
            for temp in temps:
                params = [SamplingParams(temperature=temp, max_tokens=max_tokens,
                                         ignore_eos=args.ignore_eos,
                                         seed=None if temp == 0 else 1000 + i)
                          for i in range(len(ps))]
                for name, llm in engines.items():
                    try:
                        r = run_engine(llm, ps, b, params, args.repeats)
                    except Exception as e:
                        msg = (f"{name} {s} b={b} T={temp}: crashed, {type(e).__name__}: {e} "
                               f"(repro: {repro} --sets {s} --methods '{name}')")
                        traceback.print_exc()
                        notes.append(msg)
                        log(msg)
                        continue
                    r.update(engine="specengine", method=name, set=s, batch=b,
                             temperature=temp, prompts=len(ps))
                    results.append(r)
                    log(f"{s} b={b} T={temp} {name}: {r['tok_s']:.1f} tok/s, "
                        f"tau {r['tau']:.2f}")
            if b != 1:
                continue
            for name, extra in hf_rows:
                kwargs = dict(extra)
                if kwargs.pop("assistant", False):
                    kwargs["assistant_model"] = hf_models["draft"]
                try:
                    r = run_hf(hf_models["target"], counter, ps, max_tokens, kwargs, eos_ids,
                               pad_id, args.ignore_eos, args.repeats)
                except Exception as e:
                    msg = (f"{name} {s}: crashed, {type(e).__name__}: {e} "
                           f"(repro: {repro} --sets {s})")
                    traceback.print_exc()
                    notes.append(msg)
                    log(msg)
                    continue
                r.update(engine="hf", method=name, set=s, batch=1, temperature=0.0,
                         prompts=len(ps))
                results.append(r)
                log(f"{s} b=1 {name}: {r['tok_s']:.1f} tok/s, tau {r['tau']:.2f}")
    del engines, hf_models
    gc.collect()

    # ratios and losslessness checks
    by = {(r["engine"], r["method"], r["set"], r["batch"], r["temperature"]): r
          for r in results}
    checks = {}
    for r in results:
        base = by.get(("specengine", "no spec", r["set"], r["batch"], r["temperature"]))
        hf = by.get(("hf", "hf plain", r["set"], 1, 0.0)) if r["batch"] == 1 else None
        r["speedup"] = r["tok_s"] / base["tok_s"] if base else None
        r["vs_hf_plain"] = r["tok_s"] / hf["tok_s"] if hf and r["temperature"] == 0 else None
        r["mismatch"] = None
        if base and r["temperature"] == 0 and r is not base:
            k, first = mismatches(r["outputs"], base["outputs"])
            r["mismatch"], r["first_mismatch"] = k, first
            if r["engine"] == "specengine":
                checks[(r["method"], r["set"], r["batch"])] = k
    for s in sets:  # informational: batch invariance, agreement with HF
        b1 = by.get(("specengine", "no spec", s, 1, 0.0))
        b8 = by.get(("specengine", "no spec", s, 8, 0.0))
        if b1 and b8:
            k, _ = mismatches(b1["outputs"], b8["outputs"][:len(b1["outputs"])])
            notes.append(f"{s}: no-spec batch 1 vs batch 8 outputs differ on {k}/"
                         f"{len(b1['outputs'])} prompts (bf16 batch variance, not a spec error)"
                         if k else f"{s}: no-spec batch 1 == batch 8 outputs")

    rows = []
    for r in results:
        mm = f"{r['mismatch']}/{r['prompts']}" if r["mismatch"] is not None else None
        rows.append([r["set"], r["batch"], r["temperature"], r["engine"], r["method"],
                     r["tok_s"], r["e2e_tok_s"], r["tau"], r["speedup"], r["vs_hf_plain"], mm])
    print(markdown_table(["set", "batch", "T", "engine", "method", "tok/s", "e2e tok/s", "tau",
                          "speedup", "vs HF plain", "mismatch"], rows) + "\n")
    for r in results:
        if r["engine"] == "specengine" and r["acceptance_rate_per_depth"]:
            print(f"{r['set']} b={r['batch']} T={r['temperature']} {r['method']}: acceptance "
                  f"per depth {[round(a, 2) for a in r['acceptance_rate_per_depth']]}, draft "
                  f"{100 * r['draft_frac']:.0f}% / verify forward {100 * r['verify_frac']:.0f}%"
                  f" of decode wall time")

    total = sum(checks.values())
    seqs = sum(by[("specengine", m, s, b, 0.0)]["prompts"] for m, s, b in checks)
    print(f"\nlossless (greedy): {'PASS' if total == 0 else 'FAIL'}  {total} of {seqs} "
          "speculative outputs differ from no-spec at the same batch")
    for (m, s, b), k in checks.items():
        if k:
            first = by[("specengine", m, s, b, 0.0)]["first_mismatch"]
            print(f"  {m} {s} b={b}: {k} differ, first differing positions "
                  f"{[f for f in first if f is not None]} (repro: {repro} --sets {s} "
                  f"--methods '{m}')")

    targets = {}

    def best_of(prefix: str, s: str = "humaneval", b: int = 1):
        rs = [r for r in results if r["engine"] == "specengine" and r["temperature"] == 0
              and r["method"].startswith(prefix) and r["set"] == s and r["batch"] == b]
        return max(rs, key=lambda r: r["speedup"] or 0, default=None)

    if args.pair == "default" and (r := best_of("ngram")):
        targets[f"ngram>=1.3x humaneval b1 ({r['method']})"] = (r["speedup"], 1.3)

    def best_eagle(s: str, temp: float):
        rs = [r for r in results if r["engine"] == "specengine" and r["set"] == s
              and r["batch"] == 1 and r["temperature"] == temp and r["method"].startswith("eagle")]
        return max(rs, key=lambda r: r["tau"], default=None)

    for s, temp, need in (("gsm", 0.0, 3.5), ("gsm", 1.0, 3.0), ("sharegpt", 0.0, 3.0)):
        if r := best_eagle(s, temp):
            targets[f"eagle tau>={need} {s} b1 T={temp:g} ({r['method']})"] = (r["tau"], need)
    for s in ("gsm", "sharegpt"):
        if r := best_of("eagle", s):
            targets[f"eagle speedup>=2.0 {s} b1 T=0 ({r['method']})"] = (r["speedup"], 2.0)
    if qwen and (r := best_of("draft")):
        targets[f"draft_model>=1.4x humaneval b1 ({r['method']})"] = (r["speedup"], 1.4)
        hf = by.get(("hf", "hf assisted (draft)", "humaneval", 1, 0.0))
        if hf:
            targets[f"draft_model>=2x HF assisted humaneval b1 ({r['method']})"] = (
                r["tok_s"] / hf["tok_s"], 2.0)
    print("\ntargets (noisy on a shared machine; rerun on a quiet one):")
    for name, (value, need) in targets.items():
        print(f"  {'PASS' if value >= need else 'FAIL'}  {name}: {value:.2f}")
    if notes:
        print("\nnotes:\n" + "\n".join(f"  - {x}" for x in notes))
    if args.out:
        for r in results:
            r.pop("outputs", None)
        doc = {"machine": info, "args": vars(args), "target": target, "draft": draft,
               "dtype": args.dtype, "max_tokens": max_tokens, "engine_kwargs": kw,
               "methods": {name: spec for name, spec in methods},
               "hf_methods": {name: {k: v for k, v in e.items() if k != "assistant"}
                              | ({"assistant_model": draft} if e.get("assistant") else {})
                              for name, e in hf_rows},
               "prompt_tokens": {s: [len(p) for p in ps] for s, ps in prompts.items()},
               "results": results,
               "lossless": {"mismatched": total, "compared": seqs,
                            "per_row": {f"{m}|{s}|b{b}": k for (m, s, b), k in checks.items()}},
               "targets": {k: {"value": v, "need": need, "pass": v >= need}
                           for k, (v, need) in targets.items()},
               "notes": notes, "seconds": time.perf_counter() - start}
        write_json(args.out, doc)
        log(f"wrote {args.out}")
    log("done")


if __name__ == "__main__":
    main()
