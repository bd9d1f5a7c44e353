"""Asynchronous RL rollouts: a GRPO-shaped workload with a weight update after every step,
run synchronously and with the engine's pause modes, one after another on one engine config.

Workload: ``--steps`` RL steps, each consuming ``--batch`` prompt groups of ``--n`` samples
(held-out GSM questions through the chat template, T=1, seeded, up to ``--max-tokens``
tokens: long-tailed lengths). After each step the trainer pushes weights
(``LLM.update_weights`` with the model's own tensors: the full cost of a push, the same
numbers, so every mode samples from the same distribution). Training itself is not simulated:
the comparison is of the rollout side alone (on a real cluster the trainer runs on other
devices meanwhile).

Modes:
    sync: ``generate`` the step's groups to the end, push, repeat (the batch drains to the
        longest sample each step).
    keep: ``--over`` x batch groups in flight; once ``batch`` groups have finished the step
        ends: ``pause_generation("keep")``, push, resume; unfinished samples continue on the
        new weights with their KV (PipelineRL, AReaL); new groups top the pool up.
    retract: the same with ``pause_generation("retract")``: the unfinished samples'
        KV is dropped and recomputed under the new weights (SGLang's retract).
    abort: the same with ``pause_generation("abort")``: the unfinished groups' tokens are
        wasted and their prompts submitted again.
    april: ``abort``, but the partial samples are recycled (APRIL, arXiv 2509.18521):
        ``continuation_prompts`` of each aborted group continue it after the push, on the new
        weights (prefix recomputed), nothing wasted.

Reported per mode: wall seconds, tokens in consumed groups (the rest is in flight at the end
or wasted by aborts), consumed tokens per second and its ratio to ``sync``, all tokens the
engine generated per second (in-flight and wasted ones included), tokens per weight version,
and the staleness of consumed samples (how many versions behind the newest the oldest token
of a sample is).

    python bench/bench_async.py --out results/async.json
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

from common import machine_info, markdown_table, quiet_transformers

from specengine import LLM, SamplingParams, continuation_prompts
from specengine.data.jsonl import write_json_atomic
from specengine.data.prompt_sets import gsm_questions

MODEL = "smollm2-135m-instruct"
MODES = ("sync", "keep", "retract", "abort", "april")


def prompts_for(llm: LLM, count: int) -> list[list[int]]:
    """``count`` held-out GSM questions as chat-template token ids."""
    qs = gsm_questions(count, seed=4321)
    return [llm.encode_chat([{"role": "user", "content": q["question"]}])[1] for q in qs]


def push(llm: LLM, weights: dict) -> None:
    """One weight push of the model's own tensors (a new weight version)."""
    llm.update_weights(weights)


def run_sync(llm: LLM, prompts: list[list[int]], a, weights: dict) -> tuple[list, float]:
    outs, t0 = [], time.perf_counter()
    for step in range(a.steps):
        group = prompts[step * a.batch:(step + 1) * a.batch]
        outs += llm.generate([{"prompt_token_ids": p} for p in group], params(a, step),
                             use_tqdm=False)
        push(llm, weights)
    return outs, time.perf_counter() - t0


def params(a, seed: int) -> SamplingParams:
    return SamplingParams(n=a.n, temperature=1.0, seed=seed, max_tokens=a.max_tokens)


def run_paused(llm: LLM, prompts: list[list[int]], a, weights: dict, mode: str
               ) -> tuple[list, float, int]:
    """The pool loop of ``keep`` / ``retract`` / ``abort`` / ``april``; returns the consumed
    outputs (one per group), the wall seconds and the tokens of aborted samples not
    recycled (wasted)."""
    queue = collections.deque(enumerate(prompts))
    inflight: dict[str, tuple[int, list[int]]] = {}  # request id -> (group, prompt)
    parts: dict[int, dict[int, object]] = {}  # april: group -> sample index -> output so far
    consumed, ready, wasted = [], [], 0
    t0 = time.perf_counter()

    def top_up():
        while len({i for i, _ in inflight.values()}) < a.over * a.batch and queue:
            i, p = queue.popleft()
            inflight[llm.add_request(p, params(a, i))] = (i, p)

    def finished(out):  # a group whose samples may come back in pieces (april)
        i, _ = inflight.pop(out.request_id)
        if i not in parts:
            return out
        parts[i].update({c.index: c for c in out.outputs})
        if len(parts[i]) < a.n:
            return None
        got = parts.pop(i)
        out.outputs = [got[k] for k in range(a.n)]
        return out

    top_up()
    while len(consumed) < a.steps * a.batch and (inflight or queue or ready):
        for out in llm.step():
            if (out := finished(out)) is not None:
                ready.append(out)
        if len(ready) >= a.batch or not llm.has_unfinished_requests():
            take, ready = ready[:a.batch], ready[a.batch:]
            consumed += take
            report = llm.pause_generation("abort" if mode == "april" else mode)
            recycle = []
            for out in report["aborted"]:
                i, p = inflight.pop(out.request_id)
                if mode == "april":
                    parts.setdefault(i, {}).update(
                        {c.index: c for c in out.outputs if c.finish_reason != "abort"})
                    recycle += [(i, c) for c in continuation_prompts(out)]
                else:
                    wasted += sum(len(c.token_ids) for c in out.outputs)
                    queue.appendleft((i, p))
            push(llm, weights)
            llm.resume_generation()
            for i, c in recycle:
                inflight[llm.add_request(c, params(a, i))] = (i, c["prompt_token_ids"])
        top_up()
    for rid in list(inflight):
        llm.abort_request(rid)
    return consumed, time.perf_counter() - t0, wasted


def summarize(mode: str, outs: list, wall: float, wasted: int, generated: int) -> dict:
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    per_version = collections.Counter(v for o in outs for c in o.outputs
                                      for v in c.weight_versions)
    stale = collections.Counter(o.weight_version - min(c.weight_versions, default=0)
                                for o in outs for c in o.outputs)
    return {"mode": mode, "wall_s": wall, "groups": len(outs), "consumed_tokens": tokens,
            "wasted_tokens": wasted, "tok_s": tokens / wall, "generated_tokens": generated,
            "generated_tok_s": generated / wall,
            "tokens_per_version": dict(sorted(per_version.items())),
            "staleness": dict(sorted(stale.items()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="prompt groups per RL step")
    ap.add_argument("--n", type=int, default=4, help="samples per group")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--over", type=float, default=1.5,
                    help="groups in flight / groups per step in the paused modes (>= 1)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if any(m not in MODES for m in modes):
        ap.error(f"--modes: use names from {MODES}")
    for name in ("steps", "batch", "n", "max_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.over < 1:
        ap.error("--over must be >= 1")
    quiet_transformers()
    info = machine_info()
    print(f"# {MODEL} {a.dtype}, {a.steps} steps x {a.batch} groups x n={a.n}, up to "
          f"{a.max_tokens} tokens, cpu: {info['cpu']}", file=sys.stderr)
    rows = []
    for mode in modes:
        llm = LLM(MODEL, dtype=a.dtype, max_model_len=1024, max_num_seqs=256)
        weights = {k: v.detach().clone() for k, v in llm.engine.runner.model.hf_parameters()
                   .items()}
        prompts = prompts_for(llm, int(a.steps * a.batch * a.over) + a.batch)
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4),
                     use_tqdm=False)  # warm up
        g0 = llm.get_metrics()["generated_tokens"]
        if mode == "sync":
            outs, wall = run_sync(llm, prompts, a, weights)
            wasted = 0
        else:
            outs, wall, wasted = run_paused(llm, prompts, a, weights, mode)
        generated = llm.get_metrics()["generated_tokens"] - g0
        rows.append(summarize(mode, outs, wall, wasted, generated))
        print(f"# {mode}: {rows[-1]['tok_s']:.1f} consumed tok/s", file=sys.stderr)
    base = next((r["tok_s"] for r in rows if r["mode"] == "sync"), None)
    for r in rows:
        r["vs_sync"] = r["tok_s"] / base if base else None
    print(markdown_table(
        ["mode", "wall s", "groups", "consumed tokens", "wasted", "consumed tok/s", "vs sync",
         "generated tok/s", "tokens per version", "staleness (versions: samples)"],
        [[r["mode"], r["wall_s"], r["groups"], r["consumed_tokens"], r["wasted_tokens"],
          r["tok_s"], r["vs_sync"], r["generated_tok_s"], r["tokens_per_version"],
          r["staleness"]] for r in rows]))
    if a.out:
        write_json_atomic(a.out, {"machine": info, "args": vars(a), "rows": rows})


if __name__ == "__main__":
    main()
