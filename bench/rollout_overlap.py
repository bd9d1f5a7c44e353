"""How much of a T = 1 rollout could the rollout memory have drafted? A ceiling, one run.

    python bench/rollout_overlap.py [--prompts 8 --n 8 --max-tokens 1024 --out FILE]

The suffix drafter (``method: "suffix"``) can only propose what the prompt group's text
continues with after the sequence's last tokens. This bench measures that ceiling on the RL
workload of ``bench/rl_epochs.py`` (held-out GSM prompts, chat template, ``n`` samples at
T = 1, default model, no speculation), replaying the rollouts position by position through
the drafter's own ``RolloutMemory``:

- ``group``: every sample's document is caught up to the same output position ``t`` (the
  siblings in flight, in lockstep), then each sample looks up its last tokens;
- ``group+history``: the same, with a second rollout of the same prompts (other seeds: an
  earlier RL step's responses) added as finished history first.

Per source set and output position: ``matched`` (a continuation was found), ``in_tree`` (the
token the target actually sampled is one of the proposed first tokens: the most any draft of
that lookup could get accepted at depth 1), ``top1`` (it is the heaviest one) and
``chain_len`` (tokens in a row the heaviest continuation would have matched, a chain drafter's
ceiling at this position, capped at 8). The EAGLE drafter's depth-1 acceptance on the same
workload (``bench/results/rl_epochs.json``: ~0.55-0.6 accepted per step) sets the bar.
"""

from __future__ import annotations

import argparse
import statistics

from common import machine_info, quiet_transformers, write_json

from specengine import LLM, SamplingParams
from specengine.speculative.drafters.rollout_memory import INDEX_NS, RolloutMemory

MODEL = "smollm2-135m-instruct"
CHAIN_CAP = 8


def sample(llm: LLM, prompts: list[list[int]], n: int, max_tokens: int, seed: int
           ) -> list[list[list[int]]]:
    """Per prompt, the ``n`` sampled outputs (token ids) at T = 1."""
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def replay(prompts: list[list[int]], rollouts: list[list[list[int]]],
           history: list[list[list[int]]] | None) -> dict:
    """Position-by-position lookups of every sample against its group (see the module
    docstring); returns the rates over all (sample, position) pairs."""
    mem = RolloutMemory()
    tail_len = max(INDEX_NS)
    counts = {"positions": 0, "matched": 0, "in_tree": 0, "top1": 0}
    chain = []
    for p, group in enumerate(rollouts):
        prompt = prompts[p]
        for old in history[p] if history else []:
            mem.add_finished(prompt + old, len(prompt))
        handles = [(p, j) for j in range(len(group))]
        for h in handles:
            mem.start(h, prompt, len(prompt))
        for t in range(max(len(o) for o in group)):
            for h, out in zip(handles, group):
                mem.sync(h, prompt + out[:t])
            for h, out in zip(handles, group):
                if t >= len(out):
                    continue
                seq = prompt + out[:t]
                n, conts = mem.lookup(h, seq[-tail_len:], CHAIN_CAP)
                counts["positions"] += 1
                if not conts:
                    chain.append(0)
                    continue
                counts["matched"] += 1
                first: dict[int, float] = {}
                for w, toks in conts:
                    if toks:
                        first[toks[0]] = first.get(toks[0], 0.0) + w
                counts["in_tree"] += out[t] in first
                best = max(first, key=first.get) if first else None
                counts["top1"] += best == out[t]
                heaviest = max(conts, key=lambda c: c[0])[1]
                k = 0
                while k < len(heaviest) and t + k < len(out) and heaviest[k] == out[t + k]:
                    k += 1
                chain.append(k)
        for h in handles:
            mem.finish(h, keep=False)
    pos = max(counts["positions"], 1)
    return {"positions": counts["positions"], "matched": counts["matched"] / pos,
            "in_tree": counts["in_tree"] / pos, "top1": counts["top1"] / pos,
            "chain_len_mean": statistics.fmean(chain) if chain else 0.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="held-out GSM prompts (>= 1)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt: the group (>= 1)")
    ap.add_argument("--max-tokens", type=int, default=1024, help="output cap per sample (>= 1)")
    ap.add_argument("--out", help="write results as JSON here")
    a = ap.parse_args(argv)
    for name in ("prompts", "n", "max_tokens"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be >= 1")
    quiet_transformers()
    from rl_epochs import EVAL_GSM_SEED
    from transformers import AutoTokenizer

    from specengine.data.prompt_sets import gsm_questions
    from specengine.models.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(MODEL))
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q["question"]}],
                                           tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
               for q in gsm_questions(a.prompts, seed=EVAL_GSM_SEED)]
    llm = LLM(MODEL, dtype="bfloat16", seed=0)
    earlier = sample(llm, prompts, a.n, a.max_tokens, seed=0)
    now = sample(llm, prompts, a.n, a.max_tokens, seed=10_000)
    res = {"group": replay(prompts, now, None), "group+history": replay(prompts, now, earlier)}
    lengths = [len(o) for g in now for o in g]
    res["output_tokens"] = sum(lengths)
    res["at_cap"] = sum(n >= a.max_tokens for n in lengths)
    for k in ("group", "group+history"):
        r = res[k]
        print(f"{k:14s} matched {r['matched']:.3f}  in tree {r['in_tree']:.3f}  "
              f"top-1 {r['top1']:.3f}  heaviest chain {r['chain_len_mean']:.3f} tokens")
    print(f"{res['output_tokens']} output tokens; samples at the cap: {res['at_cap']}")
    if a.out:
        write_json(a.out, {"bench": "rollout_overlap", "machine": machine_info(),
                           "args": vars(a), "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
