"""Packed weights in 2 MiB pages or in 4 KiB pages: the same rollout on engines of both kinds,
in lockstep in one process (``rl_epochs.rollout``: the rows see the same machine at the same
moments), no speculation. Engines are built alternately (4k, hp, 4k, hp, ...) so the order
they were built in does not favour one kind; the KV cache is advised for huge pages in both.

    python bench/bench_huge_pages.py [--engines 2] [--rounds 3] [--prompts 4] [--n 4]
                                     [--max-tokens 256] [--model smollm2-135m-instruct]
                                     [--out bench/results/huge_pages.json]

Prints per round each engine's seconds (its own steps only) and the ratio of the 4 KiB
engines' total to the huge-page engines' total (> 1: huge pages faster). Needs THP mode
``madvise`` or ``always`` (``/sys/kernel/mm/transparent_hugepage/enabled``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_info, quiet_transformers, write_json  # noqa: E402
from rl_epochs import rollout  # noqa: E402

from specengine import LLM, SamplingParams  # noqa: E402
from specengine.data.prompt_sets import gsm_questions  # noqa: E402
from specengine.ops import heap, kernels  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2, help="engines of each kind")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.engines < 1 or a.rounds < 1:
        ap.error("--engines and --rounds must be >= 1")
    if not heap.huge_pages_available():
        print("transparent huge pages are not available here (THP never or "
              "SPECENGINE_HUGE_PAGES=0)")
        return 1
    quiet_transformers()
    llms, keep = {}, kernels.in_huge_pages
    try:
        for i in range(a.engines):
            for kind in ("4k", "hp"):
                kernels.in_huge_pages = keep if kind == "hp" else (lambda t: t)
                llms[f"{kind}{i}"] = LLM(a.model, dtype="bfloat16", seed=0)
    finally:
        kernels.in_huge_pages = keep
    tok = next(iter(llms.values())).get_tokenizer()
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q["question"]}],
                                           tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False).input_ids
               for q in gsm_questions(a.prompts, seed=0)]
    rounds = []
    for r in range(a.rounds):
        params = [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens,
                                 seed=10_000 * r + i) for i in range(len(prompts))]
        runs = rollout(llms, prompts, params)
        outs = {tuple(map(tuple, sum(run["outputs"], []))) for run in runs.values()}
        seconds = {k: run["wall_s"] for k, run in runs.items()}
        small = sum(v for k, v in seconds.items() if k.startswith("4k"))
        huge = sum(v for k, v in seconds.items() if k.startswith("hp"))
        rounds.append({"seconds": seconds, "ratio_4k_over_hp": small / huge,
                       "identical_samples": len(outs) == 1})
        print(f"round {r}: " + ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items())
              + f"; 4 KiB / huge pages = {small / huge:.3f}; samples identical: {len(outs) == 1}")
    if a.out:
        write_json(a.out, {"bench": "huge_pages", "machine": machine_info(), "args": vars(a),
                           "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
