"""Train the EAGLE drafter shipped for ``smollm2-135m-instruct`` (CPU, well under an hour).

    python examples/train_drafter.py --out specengine/drafters/smollm2-135m-instruct

This writes the training JSONL (``--work``/train_data.jsonl, outside the repo: it holds
ShareGPT text), runs

    specengine train-drafter --model smollm2-135m-instruct --data DATA --out WORK/ckpt \\
        --steps 150 --batch-tokens 1024 --unroll 2 --draft-vocab 4096 --max-len 384 \\
        --max-tokens 160 --lr 1e-3 --seed 0 --save-every 20

and copies ``model.safetensors`` and ``config.json`` from ``WORK/ckpt`` into ``--out``.

Training data (all fetchable by the project; ShareGPT text is read at run time, never stored
in the repo):

- ``--gen-gsm`` GSM-style questions (seed 0) and ``--gen-chat`` ShareGPT first user turns
  without a response: the target's own answers are generated (temperatures 0 and 1, in turn)
  and their features harvested while decoding (self-distillation proper);
- ``--gsm`` more GSM-style questions (seed 0, after those) with the generators' ``answer_cot``
  as response, all 164 HumanEval prompts with their canonical solution, and ``--sharegpt``
  ShareGPT conversations (record index < 10,000; 10,000..11,999 stay held out for evaluation)
  with their first assistant reply: teacher-forced (one target forward; cheap on a CPU).

Either way the loss is against the *target's* distribution (soft labels from its LM head), so
human-written responses still teach the drafter what the target would say next.

Evaluate with ``--eval`` (held-out GSM seed 1234 and ShareGPT from index 10,000; T=0 and T=1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

EVAL_SHAREGPT_START = 10_000


def write_data(path: Path, n_gen_gsm: int, n_gen_chat: int, n_gsm: int, n_humaneval: int,
               n_sharegpt: int) -> int:
    from specengine.data import gsm_questions, humaneval_prompts, sharegpt_conversations

    recs = []
    qs = gsm_questions(n_gen_gsm + n_gsm, seed=0)
    for q in qs[:n_gen_gsm]:
        recs.append({"messages": [{"role": "user", "content": q["question"]}]})
    for q in qs[n_gen_gsm:]:
        recs.append({"messages": [{"role": "user", "content": q["question"]}],
                     "response": q["answer_cot"]})
    for p in humaneval_prompts(n_humaneval):
        recs.append({"prompt": p["prompt"], "response": p["canonical_solution"]})
    convs = sharegpt_conversations(n_gen_chat + n_sharegpt, start=0)
    assert all(c["index"] < EVAL_SHAREGPT_START for c in convs), "training data reached eval"
    for i, c in enumerate(convs):
        msgs = c["messages"]
        user = next(m for m in msgs if m["role"] == "user")
        if not user["content"].strip() or len(user["content"]) > 2000:
            continue
        rec = {"messages": [{"role": "user", "content": user["content"]}]}
        if i >= n_gen_chat:
            reply = next((m["content"] for m in msgs[msgs.index(user) + 1:]
                          if m["role"] == "assistant"), "")
            if not reply.strip():
                continue
            rec["response"] = reply[:2000]
        recs.append(rec)
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return len(recs)


def evaluate(drafter: str | None, n: int, max_tokens: int) -> None:
    """tau and wall-clock speedup at batch 1 on held-out prompts, T=0 and T=1."""
    from specengine import LLM, SamplingParams
    from specengine.data import gsm_questions, sharegpt_conversations

    sets = {"gsm": [[{"role": "user", "content": q["question"]}]
                    for q in gsm_questions(n, seed=1234)],
            "chat": [[m for m in c["messages"] if m["role"] == "user"][:1]
                     for c in sharegpt_conversations(n, start=EVAL_SHAREGPT_START)]}
    plain = LLM(max_model_len=2048, kv_cache_memory_bytes=256 << 20)
    spec = LLM(max_model_len=2048, kv_cache_memory_bytes=256 << 20,
               speculative_config={"method": "eagle", "model": drafter,
                                   "num_speculative_tokens": 5, "topk": 3,
                                   "num_verify_tokens": 12, "policy": "static"})
    for name, convs in sets.items():
        for temp in (0.0, 1.0):
            sp = SamplingParams(temperature=temp, max_tokens=max_tokens, seed=0)
            t_plain = t_spec = 0.0
            same = 0
            before = spec.get_metrics()
            before_depth = dict(before.get("accepted_per_depth", {}))
            for conv in convs:  # batch 1
                t0 = time.perf_counter()
                a = plain.chat(conv, sp, use_tqdm=False)[0].outputs[0].token_ids
                t1 = time.perf_counter()
                b = spec.chat(conv, sp, use_tqdm=False)[0].outputs[0].token_ids
                t_spec += time.perf_counter() - t1
                t_plain += t1 - t0
                same += a == b
            m = spec.get_metrics()
            steps = m["spec_steps"] - before.get("spec_steps", 0)
            acc = m["accepted_tokens"] - before.get("accepted_tokens", 0)
            per_depth = [round((v - before_depth.get(d, 0))
                               / max(steps, 1), 3)
                         for d, v in sorted(m["accepted_per_depth"].items())]
            print(json.dumps({"set": name, "T": temp, "n": len(convs),
                              "tau": round((acc + steps) / max(steps, 1), 3),
                              "accept_rate_per_depth": per_depth,
                              "speedup": round(t_plain / t_spec, 3),
                              "identical": f"{same}/{len(convs)}"}), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="specengine/drafters/smollm2-135m-instruct")
    ap.add_argument("--data", default=None)
    ap.add_argument("--work", default=None, help="scratch dir (default: cache_dir()/drafter-train)")
    ap.add_argument("--gen-gsm", type=int, default=0)
    ap.add_argument("--gen-chat", type=int, default=0)
    ap.add_argument("--gsm", type=int, default=100)
    ap.add_argument("--humaneval", type=int, default=60)
    ap.add_argument("--sharegpt", type=int, default=60)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval", action="store_true", help="only evaluate the drafter in --out")
    ap.add_argument("--eval-n", type=int, default=3)
    ap.add_argument("--eval-max-tokens", type=int, default=96)
    args = ap.parse_args()
    if args.eval:
        evaluate(args.out, args.eval_n, args.eval_max_tokens)
        return 0
    import shutil

    from specengine.fetch import cache_dir

    out = Path(args.out)
    work = Path(args.work) if args.work else cache_dir() / "drafter-train" / out.name
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else work / "train_data.jsonl"
    if not data.is_file():
        data.parent.mkdir(parents=True, exist_ok=True)
        n = write_data(data, args.gen_gsm, args.gen_chat, args.gsm, args.humaneval,
                       args.sharegpt)
        print(f"{n} records -> {data}")
    from specengine.cli import main as cli

    rc = cli(["train-drafter", "--model", "smollm2-135m-instruct", "--data", str(data),
              "--out", str(work / "ckpt"), "--steps", str(args.steps), "--batch-tokens", "1024",
              "--unroll", "2", "--draft-vocab", "4096", "--max-len", str(args.max_len),
              "--max-tokens", "160", "--lr", "1e-3", "--seed", "0", "--save-every", "20"])
    if rc == 0:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            shutil.copy(work / "ckpt" / name, out / name)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
