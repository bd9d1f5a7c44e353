"""The ``specengine`` command: ``generate`` (below), ``serve`` (``specengine.server``) and
``train-drafter`` (its arguments here, the job in ``specengine.speculative.training.distill``).

``specengine generate``: offline batch generation from a JSONL file.

Each input line is a JSON object with ``prompt`` (text) or ``messages`` (a chat). Each output
line keeps every input field and adds ``outputs`` (one per sample: ``text``, ``token_ids``,
``finish_reason``, ``stop_reason``). A bad line is reported, written with an ``error`` field, and
skipped; the rest completes. Finished lines are streamed to ``<output>.part``; the final file is
written in input order and moved into place atomically, so a crash never leaves a half-written
output and never loses what was already generated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from specengine.jsonl import read_records, write_jsonl_atomic
from specengine.models.registry import DEFAULT_MODEL
from specengine.sampling import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="specengine", description="Offline batch generation (generate), an OpenAI- and "
        "TRL-compatible HTTP server (serve) and EAGLE drafter training (train-drafter), with "
        "lossless speculative decoding.",
        epilog="generate exits with 0 when the job finished, also if some input lines failed "
        "(each is in the output with an 'error' field and listed in the summary), and with 2 "
        "for bad arguments.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for a JSONL file of prompts")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="known alias, Hugging Face directory or .gguf file")
    g.add_argument("--input", required=True, help="JSONL with 'prompt' or 'messages' per line")
    g.add_argument("--output", required=True, help="JSONL to write")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the chat template to 'prompt' lines too")
    g.add_argument("--no-chat", dest="chat", action="store_false",
                   help="never apply the chat template ('messages' lines then fail)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_train_drafter(sub)
    from specengine.server.cli import add_serve_cli
    add_serve_cli(sub)
    return ap.parse_args(argv)


def add_train_drafter(sub) -> None:
    """Register ``specengine train-drafter`` (run by ``training.distill.train_drafter``) on
    an argparse subparsers object."""
    t = sub.add_parser("train-drafter", help="train an EAGLE drafter by self-distillation")
    t.add_argument("--model", default="smollm2-135m-instruct", help="target model")
    t.add_argument("--data", required=True,
                   help="JSONL: 'prompt' or 'messages' per line, optional 'response'")
    t.add_argument("--out", required=True, help="checkpoint directory to write")
    t.add_argument("--max-tokens", type=int, default=256, help="response length when generating")
    t.add_argument("--temperatures", default="0,1",
                   help="sampling temperatures used round-robin over prompts when generating")
    t.add_argument("--draft-vocab", type=int, default=8192, help="FR-Spec draft vocabulary size")
    t.add_argument("--val-frac", type=float, default=0.05)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-tokens", type=int, default=2048)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--unroll", type=int, default=3)
    t.add_argument("--warm-unroll-frac", type=float, default=0.0,
                   help="fraction of the steps trained with unroll 1 before unrolling")
    t.add_argument("--noise", type=float, default=0.1)
    t.add_argument("--reg-weight", type=float, default=0.5)
    t.add_argument("--max-len", type=int, default=768)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="target dtype for generation and features")
    t.add_argument("--init", default=None, help="start from this drafter checkpoint")
    t.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps")
    t.add_argument("--max-num-seqs", type=int, default=96,
                   help="sequences decoded at once while generating responses")
    t.add_argument("--no-progress", action="store_true")


def encode_record(llm, rec: dict, no: int, chat: bool | None) -> dict:
    """The ``generate`` prompt for one input record. Raises ValueError naming the line."""
    what = f"line {no}"
    if "messages" in rec:
        if chat is False:
            raise ValueError(f"{what}: has 'messages' but --no-chat was given")
        text, ids = llm.encode_chat(rec["messages"], f"{what}: 'messages'")
    elif "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise ValueError(f"{what}: 'prompt' must be a string")
        if chat:
            text, ids = llm.encode_chat([{"role": "user", "content": rec["prompt"]}], what)
        else:
            text, ids = rec["prompt"], llm.get_tokenizer()(rec["prompt"]).input_ids
    else:
        raise ValueError(f"{what}: needs a 'prompt' or 'messages' field")
    llm.engine.validate_prompt(ids, what)
    return {"prompt": text, "prompt_token_ids": ids}


def result_record(rec: dict, out) -> dict:
    return {**rec, "outputs": [
        {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
         "stop_reason": o.stop_reason} for o in out.outputs]}


def generate(args: argparse.Namespace) -> int:
    from specengine.api import LLM

    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, seed=args.seed, max_tokens=args.max_tokens,
            min_tokens=args.min_tokens, stop=args.stop)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        print(f"error: --output {args.output!r}: folder {out_dir!r} does not exist",
              file=sys.stderr)
        return 2
    if not os.path.isfile(args.input):
        why = "is a folder, not a file" if os.path.isdir(args.input) else "does not exist"
        print(f"error: --input {args.input!r} {why}", file=sys.stderr)
        return 2
    try:
        spec = speculative_config_arg(args.speculative_config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    records = read_records(args.input)
    try:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                  kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=args.seed,
                  speculative_config=spec)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results: dict[int, dict] = {}
    errors: dict[int, str] = {}
    prompts, lines = [], []
    for no, rec, err in records:
        if err is None:
            try:
                prompts.append(encode_record(llm, rec, no, args.chat))
                lines.append(no)
                continue
            except ValueError as e:
                err = str(e)
        errors[no] = err
        results[no] = {**(rec or {}), "line": no, "error": err}
        print(f"skipped {err}", file=sys.stderr)
    t0 = time.perf_counter()
    part = f"{args.output}.part"
    by_line = {no: rec for no, rec, _ in records}
    outs = []
    with open(part, "w", encoding="utf-8") as f:
        for i, out in llm.generate_iter(prompts, params, use_tqdm=not args.no_progress):
            no = lines[i]
            results[no] = result_record(by_line[no], out)
            f.write(json.dumps(results[no], ensure_ascii=False) + "\n")
            f.flush()
            outs.append(out)
    wall = time.perf_counter() - t0
    write_jsonl_atomic(args.output, [results[no] for no, _, _ in records])
    os.remove(part)
    n_prompt = sum(len(p["prompt_token_ids"]) for p in prompts)
    n_gen = sum(len(o.token_ids) for out in outs for o in out.outputs)
    print(f"requests: {len(prompts)} ok, {len(errors)} failed | prompt tokens: {n_prompt} | "
          f"generated tokens: {n_gen} | {n_gen / max(wall, 1e-9):.1f} tokens/s | "
          f"wall time: {wall:.1f} s")
    m = llm.get_metrics()
    if spec:
        print(f"speculation: acceptance length {m.get('acceptance_length', 1.0):.2f} tokens/"
              f"forward | drafted {m['drafted_tokens']} accepted {m['accepted_tokens']} | "
              f"draft {m['draft_time']:.1f} s, target forward "
              f"{m['decode_time'] + m['prefill_time']:.1f} s, sample/verify "
              f"{m['sample_time']:.1f} s")
        ran = m.get("policy_strategies", {})
        if ran:
            def rate(x):
                return "-" if x is None else f"{x:.1f}"

            print(f"policy {m['policy']}: " + ", ".join(
                f"{name} {s['steps']} steps (predicted {rate(s['predicted_tok_s'])}, observed "
                f"{rate(s['observed_tok_s'])} tokens/s)" for name, s in ran.items())
                + (f"; {100 * m['policy_nodes_cut_frac']:.0f}% of draft nodes cut as not worth "
                   "verifying" if m.get("policy_nodes_cut_frac") else ""))
    for err in (errors[no] for no in sorted(errors)):
        print(f"  failed {err}")
    return 0


def speculative_config_arg(text: str | None) -> dict | None:
    """The ``--speculative-config`` JSON text as a dict (None when not given).

    Raises:
        ValueError: not valid JSON, naming the flag.
    """
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON ({e})") from None


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specengine`` command."""
    args = parse_args(argv)
    if args.command == "generate":
        return generate(args)
    if args.command == "train-drafter":
        from specengine.speculative.training.distill import train_drafter
        return train_drafter(args)
    if args.command == "serve":
        from specengine.server.cli import serve_main
        return serve_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
