"""Train-inference logprob mismatch: the engine's logprobs of its own samples vs a trainer's.

    python bench/bench_mismatch.py --out bench/results/mismatch.json   # 8 prompts x 4, 128 tokens
    python bench/bench_mismatch.py --quick                             # 2 prompts x 2, 32 tokens

An RL trainer (PPO/GRPO with importance ratios, TRL, verl, slime) takes the rollout engine's
per-token logprobs as the behaviour policy's and recomputes them with its own forward; the gap is
the train-inference mismatch. This script measures it for ``specengine`` against Hugging Face
transformers over the same weights, the way TRL computes per-token logps:
``AutoModelForCausalLM.from_pretrained(dir, dtype=...)``, one forward over prompt + completion
(one sequence per forward, no padding), ``log_softmax(logits.float())`` gathered at the
completion tokens.

Workload: ``--prompts`` held-out GSM-style questions (``gsm_questions(seed=1234)``; the shipped
EAGLE drafter trained on seed 0) through the chat template, ``--n`` samples each at T = 1
(``SamplingParams(seed=--seed + prompt index)``), up to ``--max-tokens``, EOS ends a sample (the
EOS token is scored too), ``logprobs=0``: the sampled token's raw logprob (the engine's default
``logprobs_mode``, before temperature; at T = 1 that is what the forward gives).

Rows, one run covers all:

- ``bf16``: engine ``dtype="bfloat16"``; trainer: the transformers model in bfloat16, whose LM
  head gives bfloat16 logits (cast to float32 before the log-softmax, as above).
- ``bf16 + fp32 head``: engine ``head_dtype="float32"`` (logits from a float32 copy of the LM
  head over the float32-cast final hidden state); trainer: the same bfloat16 transformers
  model, but its final hidden state (after the final norm, bfloat16) cast to float32 and
  multiplied by the float32 copy of the LM head weight. That is what an fp32 LM head means in
  a trainer too: the decoder stays bfloat16, only the vocabulary projection and softmax are
  float32.
- ``fp32``: both sides in float32.

Each dtype row runs with speculation off, with ``ngram`` (chain of 4) and with the bundled
EAGLE drafter (chain of 4), both under ``policy: "static"`` so that every decode step is a
speculative verify step (the default ``auto`` policy mostly picks no speculation at batch 32
on 2 cores, which would make the check empty); a drafter that fails to load is a note, not a
crash.

Per row: completion tokens; mean and max ``|logp_hf - logp_engine|`` over tokens; the mean of
Schulman's k3 estimator of KL(engine || trainer) (J. Schulman, "Approximating KL divergence",
http://joschu.net/blog/kl-approx.html, 2020): with ``r = logp_hf - logp_engine`` per token
(samples drawn from the engine), ``k3 = exp(r) - 1 - r`` (unbiased, always >= 0), averaged
over tokens. For the bfloat16 rows, where the mismatch comes from: the mean |Δ| of the
engine's logprobs and of the transformers ones from the float32 transformers forward over the
same tokens (``engine vs fp32 fwd``, ``HF vs fp32 fwd``). For the speculative rows: whether
they gave exactly the same tokens and the same logprobs (float equality) as speculation off in
the same dtype row; the engine is lossless and batch-invariant, so they must; mismatches are
reported (count, first position), not asserted.

Published references, as context only (another model, GPU, Megatron trainer): in vLLM's vime
issue #64 (https://github.com/vllm-project/vime/issues/64, Qwen3-4B GRPO, Megatron recompute vs
rollout logprobs, ``train_rollout_logprob_abs_diff`` = mean |Δlogprob|), vime + vLLM stays at
about 0.011 over 30 steps, slime + SGLang rises from about 0.011 to 0.036.

JSON (``--out``, written atomically): settings, machine, the references, every row's numbers
(also the signed mean, quantiles of |Δ|, the worst tokens and per-sample means) and the
spec-vs-off checks; ``--save-samples`` adds every sample's token ids and engine logprobs.
"""

from __future__ import annotations

import argparse
import gc
import math
import time

import torch
from common import machine_info, markdown_table, quiet_transformers, stderr_logger, write_json

from specengine import LLM, SamplingParams
from specengine.data.prompt_sets import gsm_questions
from specengine.models.loader import resolve_model

MODEL = "smollm2-135m-instruct"
EVAL_GSM_SEED = 1234  # the shipped drafter trains on seed 0 (examples/train_drafter.py)
# row name -> (engine dtype, engine head_dtype)
DTYPE_ROWS = {"bf16": ("bfloat16", None), "bf16 + fp32 head": ("bfloat16", "float32"),
              "fp32": ("float32", None)}
# speculation name -> speculative_config
SPEC_ROWS = {"off": None,
             "ngram": {"method": "ngram", "num_speculative_tokens": 4, "policy": "static"},
             "eagle": {"method": "eagle", "num_speculative_tokens": 4, "policy": "static"}}
REFERENCES = {
    "source": "https://github.com/vllm-project/vime/issues/64",
    "setup": "Qwen3-4B GRPO, Megatron recomputed logprobs vs rollout engine logprobs, "
             "train_rollout_logprob_abs_diff = mean |old_log_probs - rollout_log_probs|, "
             "30 rollout steps",
    "vllm_mean_abs_diff": 0.011,
    "sglang_mean_abs_diff": 0.036,
    "note": "context only: vLLM (vime) flat at about 0.011; SGLang (slime) rises from about "
            "0.011 at step 0 to about 0.036 after 30 steps; another model, GPU, trainer",
}


def build_prompts(tok, n: int) -> list[list[int]]:
    """Token ids of the first ``n`` held-out GSM-style questions through the chat template."""
    out = []
    for q in gsm_questions(n, seed=EVAL_GSM_SEED):
        text = tok.apply_chat_template([{"role": "user", "content": q["question"]}],
                                       tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False).input_ids)
    return out


def run_engine(dtype: str, head_dtype: str | None, spec: dict | None,
               prompts: list[list[int]], a) -> dict:
    """Sample ``a.n`` completions of every prompt with one fresh engine; returns the samples
    (``[prompt][sample] -> (token ids, logprobs)``) and the engine's speculation counters.
    Raises whatever ``LLM`` raises (a drafter that does not load)."""
    llm = LLM(MODEL, dtype=dtype, head_dtype=head_dtype, speculative_config=spec, seed=a.seed)
    params = [SamplingParams(n=a.n, temperature=1.0, seed=a.seed + i, max_tokens=a.max_tokens,
                             logprobs=0) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    samples = []
    for o in outs:
        row = []
        for c in sorted(o.outputs, key=lambda c: c.index):
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)]
            row.append((list(c.token_ids), lps))
        samples.append(row)
    m = llm.get_metrics()
    info = {"wall_seconds": wall, "generated_tokens": m.get("generated_tokens"),
            "spec_steps": m.get("spec_steps"), "drafted_tokens": m.get("drafted_tokens"),
            "accepted_tokens": m.get("accepted_tokens"),
            "acceptance_length": m.get("acceptance_length") if spec else None}
    del llm, outs
    gc.collect()
    return {"samples": samples, "engine": info}


class Trainer:
    """Per-token logprobs of completions as a trainer computes them with transformers."""

    def __init__(self, model_dir, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.cache: dict[tuple, list[float]] = {}

    @torch.no_grad()
    def logprobs(self, prompt: list[int], completion: list[int], fp32_head: bool) -> list[float]:
        """``log_softmax`` of the logits at the positions before each completion token,
        gathered at that token (TRL's per-token logps at T = 1). ``fp32_head``: the logits are
        the final hidden state cast to float32 times the float32 LM head weight."""
        key = (fp32_head, tuple(prompt), tuple(completion))
        if key not in self.cache:
            ids = torch.tensor([prompt + completion])
            start, end = len(prompt) - 1, len(prompt) + len(completion) - 1
            if fp32_head:
                hidden = self.model.model(input_ids=ids).last_hidden_state[0, start:end]
                w = self.model.get_output_embeddings().weight
                logits = hidden.float() @ w.float().t()
            else:
                logits = self.model(input_ids=ids).logits[0, start:end]
            lp = torch.log_softmax(logits.float(), dim=-1)
            self.cache[key] = lp.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()
        return self.cache[key]


def mismatch_stats(prompts, samples, trainer: Trainer, fp32_head: bool,
                   reference: Trainer | None = None) -> dict:
    """Mean / max |Δlogprob|, mean k3 and more over every completion token of ``samples``.
    With ``reference`` (the float32 transformers model), also each side's mean |Δ| from the
    float32 forward's logprobs: which side the mismatch comes from."""
    diffs, worst, ref_engine, ref_hf, per_sample = [], [], [], [], []
    for i, (p, row) in enumerate(zip(prompts, samples)):
        for s, (toks, lps) in enumerate(row):
            hf = trainer.logprobs(p, toks, fp32_head)
            d = [abs(x - y) for x, y in zip(hf, lps)]
            per_sample.append({"prompt": i, "sample": s, "tokens": len(toks),
                               "mean_abs_diff": sum(d) / max(len(d), 1),
                               "max_abs_diff": max(d, default=0.0)})
            if reference is not None:
                ref = reference.logprobs(p, toks, False)
                ref_engine += [abs(x - y) for x, y in zip(lps, ref)]
                ref_hf += [abs(x - y) for x, y in zip(hf, ref)]
            for j, (t, le, lh) in enumerate(zip(toks, lps, hf)):
                diffs.append(lh - le)
                worst.append((abs(lh - le), len(worst),
                              {"prompt": i, "sample": s, "token": t, "position": j,
                               "logp_engine": le, "logp_hf": lh}))
    if not diffs:
        return {"tokens": 0}
    r = torch.tensor(diffs, dtype=torch.float64)
    ab = r.abs()
    k3 = torch.expm1(r) - r
    worst.sort(key=lambda x: (-x[0], x[1]))
    return {"tokens": len(diffs), "mean_abs_diff": float(ab.mean()),
            "max_abs_diff": float(ab.max()), "mean_diff": float(r.mean()),
            "mean_k3": float(k3.mean()),
            "abs_diff_p50": float(ab.quantile(0.5)), "abs_diff_p99": float(ab.quantile(0.99)),
            "share_abs_diff_over_0.1": float((ab > 0.1).double().mean()),
            "engine_vs_fp32_mean_abs_diff": sum(ref_engine) / len(ref_engine)
            if ref_engine else None,
            "hf_vs_fp32_mean_abs_diff": sum(ref_hf) / len(ref_hf) if ref_hf else None,
            "worst_tokens": [w[2] for w in worst[:5]], "per_sample": per_sample}


def compare(base, other) -> dict:
    """Samples of ``other`` vs ``base`` (same prompts, n and seeds): how many differ in tokens,
    how many have a logprob that is not exactly equal on the tokens they share before the
    first difference, the largest such logprob difference and the first divergences."""
    tok_diff = lp_diff = 0
    max_lp = 0.0
    first = []
    for i, (rb, ro) in enumerate(zip(base, other)):
        for s, ((tb, lb), (to, lo)) in enumerate(zip(rb, ro)):
            common = 0
            while common < min(len(tb), len(to)) and tb[common] == to[common]:
                common += 1
            if tb != to:
                tok_diff += 1
                first.append({"prompt": i, "sample": s, "position": common,
                              "off_len": len(tb), "spec_len": len(to)})
            d = [abs(x - y) for x, y in zip(lb[:common], lo[:common])]
            if any(x != 0 for x in d):
                lp_diff += 1
            max_lp = max([max_lp, *d])
    n = sum(len(r) for r in base)
    return {"samples": n, "token_mismatches": tok_diff, "logprob_mismatches": lp_diff,
            "max_logprob_diff_vs_off": max_lp, "first_divergences": first[:10],
            "identical": tok_diff == 0 and lp_diff == 0}


def fmt_same(c: dict | None) -> str:
    """The 'same as off' cell: ``yes`` or what differed."""
    if c is None:
        return "-"
    if c["identical"]:
        return f"yes ({c['samples']}/{c['samples']})"
    parts = []
    if c["token_mismatches"]:
        parts.append(f"{c['token_mismatches']}/{c['samples']} samples' tokens differ")
    if c["logprob_mismatches"]:
        parts.append(f"{c['logprob_mismatches']}/{c['samples']} logprobs differ "
                     f"(max {c['max_logprob_diff_vs_off']:.2g})")
    return "NO: " + "; ".join(parts)


def main(argv=None) -> None:
    """Run every row, print the table, write ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="held-out GSM prompts (>= 1)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (>= 1)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0, help="prompt i is sampled with seed + i")
    ap.add_argument("--dtypes", default=",".join(DTYPE_ROWS),
                    help=f"comma-separated subset of {list(DTYPE_ROWS)}")
    ap.add_argument("--spec", default=",".join(SPEC_ROWS),
                    help=f"comma-separated subset of {list(SPEC_ROWS)} ('off' always runs)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="2 prompts x 2 samples, 32 tokens")
    ap.add_argument("--save-samples", action="store_true",
                    help="also store every sample's token ids and engine logprobs in the JSON")
    ap.add_argument("--out", help="JSON results file")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.n, a.max_tokens = 2, 2, 32
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    specs = ["off"] + [s.strip() for s in a.spec.split(",") if s.strip() and s.strip() != "off"]
    if not dtypes or any(d not in DTYPE_ROWS for d in dtypes):
        ap.error(f"--dtypes: use names from {list(DTYPE_ROWS)}")
    if any(s not in SPEC_ROWS for s in specs):
        ap.error(f"--spec: use names from {list(SPEC_ROWS)}")
    for name in ("prompts", "n", "max_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    quiet_transformers()
    from transformers import AutoTokenizer

    log = stderr_logger(time.perf_counter())
    model_dir = resolve_model(MODEL)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = build_prompts(tok, a.prompts)
    log("loading transformers model in float32")
    trainers = {"float32": Trainer(model_dir, torch.float32)}  # also the reference forward
    rows, table, notes = [], [], []
    for dname in dtypes:
        dtype, head = DTYPE_ROWS[dname]
        if dtype not in trainers:
            log(f"loading transformers model in {dtype}")
            trainers[dtype] = Trainer(model_dir, getattr(torch, dtype))
        off = None
        for sname in specs:
            log(f"{dname}, speculation {sname}")
            try:
                res = run_engine(dtype, head, SPEC_ROWS[sname], prompts, a)
            except Exception as e:  # a drafter that does not load is a note, not a crash
                notes.append(f"{dname}, {sname}: engine failed: {type(e).__name__}: {e}")
                log(notes[-1])
                continue
            ref = trainers["float32"] if dtype != "float32" else None
            stats = mismatch_stats(prompts, res["samples"], trainers[dtype], head == "float32",
                                   ref)
            same = None
            if sname == "off":
                off = res["samples"]
            elif off is not None:
                same = compare(off, res["samples"])
            row = {"row": dname, "dtype": dtype, "head_dtype": head or dtype,
                   "speculation": sname, "speculative_config": SPEC_ROWS[sname],
                   **stats, "same_as_off": same, "engine": res["engine"]}
            if a.save_samples:
                row["samples"] = [[{"token_ids": t, "logprobs": lp} for t, lp in r]
                                  for r in res["samples"]]
            rows.append(row)
            tau = res["engine"]["acceptance_length"]
            table.append([dname, sname, stats["tokens"], stats.get("mean_abs_diff"),
                          stats.get("max_abs_diff"), stats.get("mean_k3"),
                          stats.get("engine_vs_fp32_mean_abs_diff"),
                          stats.get("hf_vs_fp32_mean_abs_diff"),
                          None if tau is None else round(tau, 2), fmt_same(same)])
            log(f"  tokens {stats['tokens']}, mean |d| {stats.get('mean_abs_diff', 0):.4g}, "
                f"max |d| {stats.get('max_abs_diff', 0):.4g}, k3 {stats.get('mean_k3', 0):.3g}")
    doc = {"settings": vars(a), "machine": machine_info(), "model": MODEL,
           "prompt_lengths": [len(p) for p in prompts], "references": REFERENCES,
           "rows": rows, "notes": notes}
    if a.out:
        write_json(a.out, doc)
    print(f"{MODEL}: {a.prompts} held-out GSM prompts x n = {a.n}, T = 1, seeded, "
          f"up to {a.max_tokens} tokens; Δ = logp(transformers forward) - logp(engine)\n")
    print(markdown_table(["row", "speculation", "tokens", "mean |Δlogprob|", "max |Δlogprob|",
                          "mean k3 KL", "engine vs fp32 fwd", "HF vs fp32 fwd", "tau",
                          "same tokens and logprobs as off"], table))
    print(f"\nreference (context only, {REFERENCES['source']}, {REFERENCES['setup']}): "
          f"vLLM ~{REFERENCES['vllm_mean_abs_diff']}, SGLang ~"
          f"{REFERENCES['sglang_mean_abs_diff']} mean |Δlogprob| ({REFERENCES['note']})")
    for n in notes:
        print(f"note: {n}")
    if not math.isfinite(sum(r.get("mean_abs_diff", 0.0) for r in rows)):
        print("WARNING: a non-finite logprob difference")


if __name__ == "__main__":
    main()
