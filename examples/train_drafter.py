"""Train an EAGLE drafter shipped with specengine on a CPU in about an hour.

    python examples/train_drafter.py --out specengine/data/drafters/smollm2-135m-instruct
    python examples/train_drafter.py --model qwen2.5-coder-0.5b-instruct \
        --out specengine/data/drafters/qwen2.5-coder-0.5b-instruct --gen-gsm 1800 --gen-chat 600 \
        --sharegpt 450 --steps 6000

It writes the training JSONL (``--work``/train_data.jsonl, outside the repository: it holds
ShareGPT text), runs ``specengine train-drafter`` on it (the exact command is printed and
recorded in the checkpoint's ``config.json``) and copies ``model.safetensors`` and
``config.json`` into ``--out``.

Training data, all fetched by the project (ShareGPT text is read at run time, never stored in
the repository), none of it from the prompts the benchmarks evaluate on:

- self-distillation (the target's own responses, features harvested while it decodes; half at
  T = 0, half at T = 1): ``--gen-gsm`` GSM-style questions (generator seed 0) and
  ``--gen-chat`` ShareGPT first user turns (record index < 10,000);
- teacher-forced (one target forward each, cheap): ``--gsm`` more GSM-style questions with the
  generators' worked solutions and ``--sharegpt`` ShareGPT conversations with their first
  assistant reply (index < 10,000).

Either way the loss is against the *target's* distribution (soft labels from its LM head), so
human-written responses still teach the drafter what the target would say next. Held out for
evaluation: GSM-style questions from seed 1234 and ShareGPT records 10,000..11,999 (the
prompts ``bench/bench_spec.py`` and ``bench/bench_adaptive.py`` measure on).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

EVAL_SHAREGPT_START = 10_000


def write_data(path: Path, n_gen_gsm: int, n_gen_chat: int, n_gsm: int, n_sharegpt: int) -> int:
    """Write the training JSONL; returns the number of records."""
    from specengine.data.prompt_sets import gsm_questions, sharegpt_conversations

    recs = []
    qs = gsm_questions(n_gen_gsm + n_gsm, seed=0)
    for q in qs[:n_gen_gsm]:
        recs.append({"messages": [{"role": "user", "content": q["question"]}]})
    for q in qs[n_gen_gsm:]:
        recs.append({"messages": [{"role": "user", "content": q["question"]}],
                     "response": q["answer_cot"]})
    convs = sharegpt_conversations(n_gen_chat + n_sharegpt, start=0)
    if any(c["index"] >= EVAL_SHAREGPT_START for c in convs):
        raise ValueError(f"training data would reach ShareGPT record {EVAL_SHAREGPT_START}, "
                         "which is held out for evaluation: ask for fewer records")
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
            rec["response"] = reply[:3000]
        recs.append(rec)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return len(recs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="target model")
    ap.add_argument("--out", default=None,
                    help="where the drafter goes (default: specengine/data/drafters/MODEL)")
    ap.add_argument("--work", default=None, help="scratch dir (default: cache_dir()/drafter-train)")
    ap.add_argument("--gen-gsm", type=int, default=1800)
    ap.add_argument("--gen-chat", type=int, default=1200)
    ap.add_argument("--gsm", type=int, default=0)
    ap.add_argument("--sharegpt", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=17000)
    ap.add_argument("--batch-tokens", type=int, default=512)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--warm-unroll-frac", type=float, default=0.6)
    args = ap.parse_args()

    from specengine.data.fetch import cache_dir

    out = Path(args.out or f"specengine/data/drafters/{args.model}")
    work = Path(args.work) if args.work else cache_dir() / "drafter-train" / out.name
    work.mkdir(parents=True, exist_ok=True)
    data = work / "train_data.jsonl"
    if not data.is_file():
        n = write_data(data, args.gen_gsm, args.gen_chat, args.gsm, args.sharegpt)
        print(f"{n} records -> {data}", flush=True)
    cmd = ["train-drafter", "--model", args.model, "--data", str(data),
           "--out", str(work / "ckpt"), "--steps", str(args.steps),
           "--batch-tokens", str(args.batch_tokens), "--unroll", str(args.unroll),
           "--warm-unroll-frac", str(args.warm_unroll_frac),
           "--draft-vocab", str(args.draft_vocab), "--max-len", str(args.max_len),
           "--max-tokens", str(args.max_tokens), "--temperatures", "0,1", "--lr", "1e-3",
           "--seed", "0", "--save-every", "1000"]
    print("specengine " + " ".join(cmd), flush=True)
    from specengine.cli import main as cli

    rc = cli(cmd)
    if rc == 0:
        out.mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "config.json"):
            shutil.copy(work / "ckpt" / name, out / name)
        print(f"drafter -> {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
