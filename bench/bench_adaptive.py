"""Adaptive speculation (issue 5): no speculation vs each static strategy vs the bandit vs the
cost-model policy vs an oracle, in one run, on the default model.

Workloads:

- ``rl``: an RL-like rollout: GSM-style questions (``specengine.data.prompt_sets.gsm_questions``)
  through the chat template, ``n`` samples each at T = 1 with a ``max_tokens`` cap; natural,
  long-tailed output lengths, so the batch shrinks from ``prompts * n`` to a few sequences.
- ``steady-B``: ``B`` ShareGPT chat prompts (``chat_prompts``), T = 1, EOS ignored, so the batch
  stays at B for ``max_tokens`` tokens.

Every run uses the same engine (one model load) with the policy swapped in, fresh: ``off``
(no speculation), ``static:<strategy>`` for each candidate, ``bandit`` (TLT's BEG-MAB),
``auto`` (the cost model; its start-up profile is done before the clock starts, as at engine
start) and ``oracle``: per batch-size bucket the static strategy (or off) with the most committed
tokens per second in that bucket over the static runs of the same workload, chosen in
hindsight and then run. Throughput = generated tokens / wall seconds of ``generate``. Every
request is seeded and speculation is lossless, so every run generates exactly the same tokens
and the throughput ratios are wall-time ratios. Prompts: GSM-style questions of generator seed
1234 and ShareGPT records from 10,000 (the shipped EAGLE drafter trained on other ones).

    python bench/bench_adaptive.py [--quick] [--drafter ngram|eagle] [--repeats 3]
                                   [--workloads rl,steady-1] [--out results.json]

Runs of 1-3 s on a shared CPU vary by +-10%, more than the 2% the targets resolve, so the
compared policies (off, bandit, auto, oracle) run ``--repeats`` times, interleaved, and the run
with the median throughput is reported (all throughputs are kept in the JSON); static
strategies run once (they only pick the oracle's table and the best static). Per batch bucket,
auto's committed tokens/s over its decode-only steps there is compared with off's (the median
runs'), against the target that auto is never below 0.98x of off in any bucket.

Writes ``bench/plots/adaptive_<workload>.png`` (strategy, batch size and throughput over time)
and prints a markdown table with PASS/FAIL against the issue's targets.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from common import machine_info, markdown_table, write_json

from specengine import LLM, SamplingParams
from specengine.data.prompt_sets import chat_prompts, gsm_questions
from specengine.speculative.policy import (
    AutoPolicy,
    BanditPolicy,
    BucketPolicy,
    StaticPolicy,
    batch_bucket,
    bucket_label,
    candidate_strategies,
)

MODEL = "smollm2-135m-instruct"
PLOTS = Path(__file__).parent / "plots"

QUICK = {"prompts": 4, "n": 2, "rl_max_tokens": 160, "steady": [1, 4, 16], "steady_tokens": 16,
         "depth": 3, "trees": [[3, 2, 6]]}
FULL = {"prompts": 16, "n": 8, "rl_max_tokens": 512, "steady": [1, 4, 16, 64],
        "steady_tokens": 128, "depth": 6, "trees": [[6, 2, 12], [6, 4, 24]]}


EVAL_GSM_SEED, EVAL_SHAREGPT_START = 1234, 10_000  # prompts the shipped drafter never saw


def workloads(llm: LLM, cfg: dict, seed: int = 0) -> dict[str, tuple[list, list[SamplingParams]]]:
    """name -> (chat conversations, one SamplingParams each)."""
    qs = gsm_questions(cfg["prompts"], seed=EVAL_GSM_SEED)
    rl = [[{"role": "user", "content": q["question"] + "\nThink step by step."}] for q in qs]
    out = {"rl": (rl, [SamplingParams(n=cfg["n"], temperature=1.0, seed=seed + i,
                                      max_tokens=cfg["rl_max_tokens"]) for i in range(len(rl))])}
    chats = chat_prompts(max(cfg["steady"]), start=EVAL_SHAREGPT_START)
    for b in cfg["steady"]:
        out[f"steady-{b}"] = (chats[:b], [SamplingParams(
            temperature=1.0, seed=seed + i, max_tokens=cfg["steady_tokens"], ignore_eos=True)
            for i in range(b)])
    return out


def run(llm: LLM, policy, convs: list, params: list[SamplingParams]) -> dict:
    """Generate ``convs`` with ``policy`` driving the engine; wall time, tokens, trace."""
    policy.keep_trace = True
    llm.engine.policy = policy
    m0 = llm.get_metrics()
    t0 = time.perf_counter()
    llm.chat(convs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    m1 = llm.get_metrics()
    tokens = m1["generated_tokens"] - m0["generated_tokens"]
    stats = policy.stats()
    print(f"  {policy.name}: {tokens} tokens in {wall:.1f} s", file=sys.stderr)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "steps": m1["steps"] - m0["steps"],
            "decision_frac": stats["policy_decision_frac"],
            "strategies": stats["policy_strategies"], "trace": policy.trace,
            **({"guard": stats["policy_guard"]} if "policy_guard" in stats else {})}


def oracle_table(static_runs: dict[str, dict]) -> dict[int, str]:
    """Per batch bucket, the name of the static run with the most committed tokens/s there."""
    per = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))  # bucket -> run -> [tok, s]
    for name, r in static_runs.items():
        for _, batch, _, committed, seconds in r["trace"]:
            acc = per[batch_bucket(batch)][name]
            acc[0] += committed
            acc[1] += seconds
    return {b: max(runs, key=lambda n: runs[n][0] / max(runs[n][1], 1e-9))
            for b, runs in per.items()}


def per_bucket(trace: list) -> dict[int, tuple[int, float]]:
    """Per batch bucket, (committed tokens, seconds) of a run's decode-only steps."""
    out = defaultdict(lambda: [0, 0.0])
    for _, batch, _, committed, seconds in trace:
        acc = out[batch_bucket(batch)]
        acc[0] += committed
        acc[1] += seconds
    return {b: (t, sec) for b, (t, sec) in out.items()}


def bucket_ratios(auto: dict, off: dict) -> dict[str, dict]:
    """Per batch bucket label: off's and auto's committed tokens/s over their decode-only
    steps there, and auto / off."""
    a, o = per_bucket(auto["trace"]), per_bucket(off["trace"])
    out = {}
    for b in sorted(set(a) & set(o)):
        ra, ro = a[b][0] / max(a[b][1], 1e-9), o[b][0] / max(o[b][1], 1e-9)
        out[bucket_label(b)] = {"off_tok_s": ro, "auto_tok_s": ra, "ratio": ra / ro,
                                "off_s": o[b][1], "auto_s": a[b][1]}
    return out


def compared_policy(name: str, candidates: list, oracle: dict, llm: LLM,
                    max_loss: float | None = 0.02):
    """A fresh policy of the compared kind ``name`` (off, bandit, auto, oracle); ``auto``
    with the loss guard's ``max_loss`` (None: without the guard)."""
    if name == "off":
        return StaticPolicy(None)
    if name == "bandit":
        return BanditPolicy(candidates)
    if name == "oracle":
        return BucketPolicy(oracle)
    auto = AutoPolicy(candidates, max_loss=max_loss)
    auto.warm_start(llm.engine)  # the start-up profile, before the clock starts
    return auto


def plot(name: str, results: dict[str, dict], path: Path) -> None:
    """Strategy, batch size and committed tokens/s over time for off, bandit, auto, oracle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    names = sorted({s for r in results.values() for _, _, s, _, _ in r["trace"]},
                   key=lambda s: (s != "off", s))
    ypos = {s: i for i, s in enumerate(names)}
    for label in ("off", "bandit", "auto", "oracle"):
        r = results.get(label)
        if r is None or not r["trace"]:
            continue
        t = [row[0] for row in r["trace"]]
        axes[0].plot(t, [ypos[row[2]] for row in r["trace"]], ".", ms=3, label=label)
        axes[1].plot(t, [row[1] for row in r["trace"]], label=label)
        window = 8
        rate = []
        for i in range(len(r["trace"])):
            rows = r["trace"][max(0, i - window + 1):i + 1]
            rate.append(sum(x[3] for x in rows) / max(sum(x[4] for x in rows), 1e-9))
        axes[2].plot(t, rate, label=label)
    axes[0].set_yticks(range(len(names)), names)
    axes[0].set_ylabel("strategy")
    axes[1].set_ylabel("batch (sequences)")
    axes[2].set_ylabel("committed tok/s (8-step mean)")
    axes[2].set_xlabel("decode step time since start (s)")
    axes[0].legend(loc="upper right")
    axes[0].set_title(f"adaptive speculation, {name}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small workloads (< 3 min)")
    ap.add_argument("--drafter", default="ngram", choices=["ngram", "eagle"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", help="write all numbers (JSON) here")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each compared policy on the steady workloads (median kept)")
    ap.add_argument("--workloads", help="only these workloads, comma-separated (default: all)")
    ap.add_argument("--prompts", type=int, help="rl: questions (default: 4 quick, 16 full)")
    ap.add_argument("--n", type=int, help="rl: samples per question (default: 2 quick, 8 full)")
    ap.add_argument("--max-tokens", type=int, help="rl: max_tokens (default: 160 quick, 512 full)")
    ap.add_argument("--steady-tokens", type=int,
                    help="steady-B: tokens per request (default: 16 quick, 128 full)")
    ap.add_argument("--max-loss", type=float, default=0.02,
                    help="auto's policy_max_loss (a negative value: auto without the guard)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = dict(QUICK if args.quick else FULL)
    for key, val in (("prompts", args.prompts), ("n", args.n), ("rl_max_tokens", args.max_tokens),
                     ("steady_tokens", args.steady_tokens)):
        if val is not None:
            cfg[key] = val
    max_loss = None if args.max_loss < 0 else args.max_loss
    spec = {"method": args.drafter, "num_speculative_tokens": cfg["depth"],
            "candidate_trees": cfg["trees"], "policy": "static"}
    t_start = time.perf_counter()
    llm = LLM(MODEL, dtype=args.dtype, max_num_seqs=256, speculative_config=spec,
              enable_prefix_caching=False)  # each strategy's run pays its own prefill
    candidates = candidate_strategies(llm.speculative_config)
    loads = workloads(llm, cfg)
    warm_load = loads[f"steady-{cfg['steady'][1]}"]
    if args.workloads:
        keep = args.workloads.split(",")
        if unknown := [w for w in keep if w not in loads]:
            ap.error(f"--workloads: unknown {unknown}; choose from {sorted(loads)}")
        loads = {w: v for w, v in loads.items() if w in keep}
    for warm in (None, candidates[-1]):  # warm-up: allocator, kernels, both paths
        run(llm, StaticPolicy(warm), *warm_load)
    print(json.dumps(machine_info()), file=sys.stderr)

    all_results, rows = {}, []
    for wname, (convs, params) in loads.items():
        res = {"off": run(llm, StaticPolicy(None), convs, params)}
        for s in candidates:
            res[f"static:{s}"] = run(llm, StaticPolicy(s), convs, params)
        statics = {k: v for k, v in res.items() if k == "off" or k.startswith("static:")}
        table = oracle_table(statics)
        by_name = {"off": None, **{f"static:{s}": s for s in candidates}}
        oracle = {b: by_name[n] for b, n in table.items()}

        compared = ("off", "bandit", "auto", "oracle")
        runs = {k: [res["off"]] if k == "off" else [] for k in compared}
        for i in range(args.repeats):
            for k in compared:
                if not (k == "off" and i == 0):
                    runs[k].append(run(llm, compared_policy(k, candidates, oracle, llm,
                                                            max_loss), convs, params))
        for k, rs in runs.items():
            res[k] = dict(sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2])  # median run
            res[k]["tok_s_runs"] = [r["tok_s"] for r in rs]
        res["oracle"]["table"] = {bucket_label(b): n for b, n in sorted(table.items())}
        res["auto"]["buckets"] = bucket_ratios(res["auto"], res["off"])
        all_results[wname] = res
        best_static = max((k for k in statics if k != "off"), key=lambda k: res[k]["tok_s"])
        a = res["auto"]["tok_s"]
        rows.append([wname, res["off"]["tok_s"], res[best_static]["tok_s"],
                     best_static.removeprefix("static:"), res["bandit"]["tok_s"], a,
                     res["oracle"]["tok_s"], a / res["oracle"]["tok_s"],
                     a / res["off"]["tok_s"], a / res[best_static]["tok_s"],
                     100 * res["auto"]["decision_frac"]])
        plot(wname, res, PLOTS / f"adaptive_{wname}.png")
        print(f"{wname}: done at {time.perf_counter() - t_start:.0f} s", file=sys.stderr)

    print(markdown_table(
        ["workload", "off tok/s", "best static tok/s", "best static", "bandit tok/s",
         "auto tok/s", "oracle tok/s", "auto/oracle", "auto/off", "auto/best static",
         "decision % of step"], rows))
    print()
    checks = []
    for r in rows:
        checks.append((f"{r[0]}: auto >= 95% of oracle", r[7] >= 0.95))
        checks.append((f"{r[0]}: auto no more than 2% slower than off", r[8] >= 0.98))
        for label, br in all_results[r[0]]["auto"]["buckets"].items():
            checks.append((f"{r[0]}: auto >= 0.98x off in bucket {label} "
                           f"({br['ratio']:.2f}x over {br['off_s']:.1f} s)", br["ratio"] >= 0.98))
        checks.append((f"{r[0]}: decision < 2% of step time", r[10] < 2))
    for rl in (r for r in rows if r[0] == "rl"):
        checks += [("rl: auto >= 1.2x best static", rl[9] >= 1.2),
                   ("rl: auto >= 1.6x off", rl[8] >= 1.6)]
    checks += [(f"{r[0]}: auto beats bandit", r[5] > r[4]) for r in rows]
    print(markdown_table(["target", "result"], [[c, "PASS" if ok else "FAIL"] for c, ok in checks]))
    print()
    for wname, res in all_results.items():
        ran = {k: v["steps"] for k, v in res["auto"]["strategies"].items()}
        print(f"{wname}: auto ran {ran}; oracle table {res['oracle']['table']}")
        print(f"{wname}: auto guard {res['auto'].get('guard')}")
    if args.out:
        slim = {w: {k: {kk: vv for kk, vv in v.items() if kk != "trace"} for k, v in res.items()}
                for w, res in all_results.items()}
        write_json(args.out, {"machine": machine_info(), "config": cfg,
                              "drafter": args.drafter, "results": slim})
    print(f"total {time.perf_counter() - t_start:.0f} s, torch threads "
          f"{torch.get_num_threads()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
