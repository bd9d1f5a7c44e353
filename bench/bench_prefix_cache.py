"""Prefix caching on verl-style rollouts: each prompt sent as ``n`` separate requests.

``--prompts`` GSM-style questions (``prompt_sets.gsm_questions``) in the chat template of the
default model, each repeated ``--n`` times (verl's ``batch.repeat(n, interleave=True)``: n
separate ``n=1`` requests), generated with ``--steps`` calls (a later call sends the same
prompts again, as the next GRPO step would before a weight update clears the cache). Run once
with prefix caching and once without; reports per call the prefix-cache hit rate (hit tokens /
queried prompt tokens; at most (n-1)/n in the first call, 1 in later ones), the hit tokens run
again for their logits (the last token of a prompt found whole), the prefill tokens computed,
prefill seconds, and whether the outputs are identical.

    python bench/bench_prefix_cache.py [--prompts 8] [--n 4] [--steps 2] [--max-tokens 32]
        [--temperature 1.0] [--dtype bfloat16] [--speculative-config JSON] [--out results.json]
"""

from __future__ import annotations

import argparse
import json

from specengine import LLM, SamplingParams
from specengine.data.prompt_sets import gsm_questions


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, steps: int):
    rows, outs = [], []
    for _ in range(steps):
        m0 = llm.get_metrics()
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        m1 = llm.get_metrics()
        d = {k: m1[k] - m0[k] for k in ("prefix_cache_hit_tokens", "prefix_cache_queried_tokens",
                                         "prefix_cache_rerun_tokens", "prefill_tokens",
                                         "prefill_time", "prompt_tokens",
                                         "accepted_tokens", "spec_steps")}
        d["hit_rate"] = (d["prefix_cache_hit_tokens"] / d["prefix_cache_queried_tokens"]
                         if d["prefix_cache_queried_tokens"] else 0.0)
        rows.append(d)
        outs.append([o.outputs[0].token_ids for o in got])
    return rows, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--speculative-config", type=json.loads, default=None,
                    help='e.g. \'{"method": "eagle"}\' (default: no speculation)')
    ap.add_argument("--out")
    a = ap.parse_args()
    res = {}
    outs = {}
    for caching in (True, False):
        llm = LLM(dtype=a.dtype, enable_prefix_caching=caching, seed=0,
                  speculative_config=a.speculative_config)
        qs = [q["question"] for q in gsm_questions(a.prompts, seed=0)]
        prompts = [llm.encode_chat([{"role": "user", "content": q}])[1] for q in qs]
        reqs = [p for p in prompts for _ in range(a.n)]
        # no per-request seed (as verl): the engine draws them from LLM(seed=0), same on and off
        params = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens)
        rows, outs[caching] = run(llm, reqs, params, a.steps)
        res["caching_on" if caching else "caching_off"] = rows
        res["max_first_call_hit_rate"] = (a.n - 1) / a.n
        res["prompt_tokens_per_request"] = [len(p) for p in prompts]
    res["identical_outputs"] = outs[True] == outs[False]
    res["config"] = vars(a)
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
