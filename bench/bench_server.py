"""Throughput of ``specengine serve`` under concurrent chat requests vs offline ``LLM.chat``.

The bundled prompts (``examples/prompts.jsonl``, chat ``messages``) are repeated to
``--requests`` conversations (64). Offline: one ``LLM.chat`` call on all of them, in this
process. Server: ``specengine serve`` in a subprocess (same model, dtype and seed), then all
requests sent at once by as many client threads with the ``openai`` client; the time runs from
the first send to the last answer. Both use temperature 0 and ``--max-tokens`` (64), so both
generate the same tokens (checked: the script reports how many answers match). Throughput is
completion tokens per second of wall time; the ratio is server / offline (target >= 0.85).

    python bench/bench_server.py [--requests 64] [--max-tokens 64] [--repeats 2]
        [--dtype bfloat16] [--speculative-config JSON] [--out results.json]

Each side runs ``--repeats`` times after a warm-up (best kept), alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests
from common import machine_info

from specengine import LLM, SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_NAME = "bench"


def load_conversations(n: int) -> list[list[dict]]:
    with open(os.path.join(ROOT, "examples", "prompts.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    convs = [r["messages"] if "messages" in r else [{"role": "user", "content": r["prompt"]}]
             for r in recs]
    return [convs[i % len(convs)] for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specengine", "serve", "--model", args.model, "--port",
           str(port), "--dtype", args.dtype, "--seed", "0", "--log-level", "warning",
           "--served-model-name", MODEL_NAME]
    if args.speculative_config:
        cmd += ["--speculative-config", args.speculative_config]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.time() + 300
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start")
        time.sleep(0.5)


def run_offline(llm: LLM, convs, params: SamplingParams) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, [o.outputs[0].token_ids for o in outs]


def run_server(client, convs, max_tokens: int) -> tuple[float, list[list[int]]]:
    barrier = threading.Barrier(len(convs) + 1)

    def one(conv):
        barrier.wait()
        r = client.chat.completions.create(model=MODEL_NAME, messages=conv, temperature=0,
                                           max_tokens=max_tokens,
                                           extra_body={"return_token_ids": True})
        return r.choices[0].token_ids

    with ThreadPoolExecutor(len(convs)) as pool:
        futures = [pool.submit(one, c) for c in convs]
        barrier.wait()
        t0 = time.perf_counter()
        ids = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    return wall, ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--speculative-config", default=None, metavar="JSON")
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = ap.parse_args()
    import openai

    convs = load_conversations(args.requests)
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    llm = LLM(args.model, dtype=args.dtype, seed=0, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    run_offline(llm, convs[:8], params)  # warm-up
    port = free_port()
    proc = start_server(args, port)
    try:
        client = openai.OpenAI(api_key="none", base_url=f"http://127.0.0.1:{port}/v1",
                               max_retries=0, timeout=600)
        client.chat.completions.create(model=MODEL_NAME, messages=convs[0], max_tokens=4)
        run_server(client, convs[:8], args.max_tokens)  # warm-up
        offline, server = [], []
        for _ in range(args.repeats):
            offline.append(run_offline(llm, convs, params))
            server.append(run_server(client, convs, args.max_tokens))
        m = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).json()
    finally:
        proc.terminate()
        proc.wait(30)
    off_wall, off_ids = min(offline)
    srv_wall, srv_ids = min(server)
    off_tok, srv_tok = sum(map(len, off_ids)), sum(map(len, srv_ids))
    same = sum(a == b for a, b in zip(off_ids, srv_ids))
    res = {"requests": args.requests, "max_tokens": args.max_tokens, "dtype": args.dtype,
           "speculative_config": spec,
           "offline": {"wall_s": off_wall, "tokens": off_tok, "tok_s": off_tok / off_wall,
                       "walls": [w for w, _ in offline]},
           "server": {"wall_s": srv_wall, "tokens": srv_tok, "tok_s": srv_tok / srv_wall,
                      "walls": [w for w, _ in server],
                      "max_batch_seqs": m["server"]["max_batch_seqs"]},
           "ratio": (srv_tok / srv_wall) / (off_tok / off_wall),
           "identical_answers": same, "machine": machine_info()}
    print(f"offline LLM.chat: {off_tok} tokens in {off_wall:.2f} s = "
          f"{res['offline']['tok_s']:.1f} tokens/s")
    print(f"server ({args.requests} concurrent chat requests): {srv_tok} tokens in "
          f"{srv_wall:.2f} s = {res['server']['tok_s']:.1f} tokens/s "
          f"(most sequences in one step: {res['server']['max_batch_seqs']})")
    print(f"server / offline: {res['ratio']:.3f} "
          f"({'PASS' if res['ratio'] >= 0.85 else 'FAIL'} target >= 0.85); "
          f"{same}/{args.requests} answers token-identical")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
