"""Step-cost tables for the replay projection (``specengine.replay.cost_table``,
``bench/replay.py``).

Measured (the default): on this machine, for ``--model`` in ``--dtype``,

1. the forward grid: dummy decode forwards of ``T`` sequences, one token each, each reading
   ``C / T`` KV positions (at least one), threaded as the engine threads such a step, timed
   once after a warm-up in each of ``repeats`` passes over the grid, the fewest seconds kept;
   then made non-decreasing along both axes;
2. ``pair_s``: chains of 3-8 tokens per sequence, each timed beside a one-token-per-sequence
   forward of the same tokens and context; the seconds beyond it fitted per extra (query,
   position) pair (least squares through 0);
3. ``step_s``, ``sequence_s``, ``node_s``: a short traced rollout of ShareGPT chat prompts
   (not the GSM prompts ``bench/replay_validate.py`` checks against), plain and with each
   ``--drafters`` drafter (static chain of depth 4): step period minus logged forward and
   draft seconds, fitted to ``[1, rows, nodes]`` (non-negative least squares);
4. ``draft``: each drafter timed on dummy sequences (batch 1-16, depth 1-6), fitted to
   ``[1, depth, batch x depth, nodes]``; then ``sequence_s`` from its traced rollout: the
   logged draft seconds beyond that fit, per sequence drafted for (what a real step adds:
   an EAGLE head catching up on the tokens committed since its last draft);
5. ``policy.auto``: the ``auto`` policy's own seconds per step (logged ``policy_s``) in a
   traced rollout with the first drafter, fitted to ``[1, rows]``.

Projection (``--roofline``): ``bench/cost_tables/h200_roofline.json``, an H200-class GPU
(4.8 TB/s HBM, ~790 TFLOP/s dense bf16) for the model from a roofline; NOT a measurement (the
file says so in ``kind``, ``label`` and ``notes``).

    python bench/step_costs.py [--quick] [--drafters eagle,ngram] [--out table.json]
    python bench/step_costs.py --roofline [--out bench/cost_tables/h200_roofline.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import machine_info, quiet_transformers

from specengine import LLM, SamplingParams
from specengine.data.prompt_sets import chat_prompts
from specengine.engine.batch import BatchEntry
from specengine.engine.sequence import Sequence
from specengine.models.registry import DEFAULT_MODEL
from specengine.ops import kernels
from specengine.replay.cost_table import TABLE_FORMAT, TABLE_VERSION, CostTable, roofline_table
from specengine.speculative.policy.latency import nonnegative_solve
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree

TABLES = Path(__file__).parent / "cost_tables"
QUICK = {"tokens": [1, 2, 4, 8, 16, 32, 64, 128, 256], "context": [64, 512, 2048, 8192, 16384],
         "repeats": 3}
FULL = {"tokens": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        "context": [64, 256, 1024, 4096, 16384, 32768], "repeats": 5}
# (sequences, tokens per sequence, cached context): the shapes of chains d = 1..7 at the batch
# sizes and contexts of RL rollouts on this CPU
CHAINS = [(1, 5, 512), (4, 3, 256), (4, 5, 512), (8, 5, 128), (16, 2, 256), (16, 3, 128),
          (16, 5, 256), (32, 5, 128), (4, 8, 1024)]


def _forward(llm: LLM, batch: int, per_seq: int, ctx: int, repeats: int) -> float:
    """Fewest seconds of ``repeats`` dummy forwards (other jobs on the machine only add
    time): ``batch`` sequences of ``ctx`` cached tokens, each feeding its root and a chain of
    ``per_seq - 1`` nodes, threaded as the engine threads a step of that many tokens
    (``kernels.kernel_threads``)."""
    runner, blocks = llm.engine.runner, llm.engine.blocks
    params = SamplingParams(temperature=0.0)
    seqs, entries = [], []
    m = per_seq - 1
    try:
        for _ in range(batch):
            s = Sequence("cost", 0, [1] * (ctx + 1), params, torch.Generator())
            blocks.grow(s, ctx + 1 + m)
            s.num_cached = ctx
            seqs.append(s)
            entries.append(BatchEntry(s, 1, [s], tree=DraftTree([1] * m, list(
                range(-1, m - 1))) if m else None))
        times = []
        with kernels.kernel_threads(kernels.packed_covers(batch * per_seq)):
            runner.run(entries, blocks)[0].cpu()  # warm-up
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.run(entries, blocks)[0].cpu()
                times.append(time.perf_counter() - t0)
        return min(times)
    finally:
        for s in seqs:
            blocks.free(s)


def monotone(grid: list[list[float]]) -> list[list[float]]:
    """``grid`` made non-decreasing along both axes (a running maximum over rows, then over
    columns): more tokens or more context never take less time, so a dip is noise."""
    out = [list(r) for r in grid]
    for i in range(len(out)):
        for j in range(len(out[i])):
            out[i][j] = max(out[i][j], out[i - 1][j] if i else 0.0, out[i][j - 1] if j else 0.0)
    return out


def measure_forward(llm: LLM, tokens: list[int], context: list[int], repeats: int,
                    log) -> tuple[list[list[float]], list]:
    """The forward grid (seconds ``[len(tokens)][len(context)]``, made ``monotone``) and the
    shapes measured. ``repeats`` passes over the whole grid, each timing every cell once after
    a warm-up, the fewest seconds kept per cell: a burst of load from other jobs, which lasts
    seconds, then spoils one pass of a cell, not all its timings."""
    limit = llm.engine_config.max_model_len
    shapes = [[(t, min(max(c // t, 1), limit - 1) - 1) for c in context] for t in tokens]
    grid = [[float("inf")] * len(context) for _ in tokens]
    for p in range(repeats):
        for i, row in enumerate(shapes):
            for j, (t, ctx) in enumerate(row):  # ctx cached tokens; + the root = C / T
                grid[i][j] = min(grid[i][j], _forward(llm, t, 1, ctx, 1))
        log(f"forward grid pass {p + 1}/{repeats}")
    for t, row in zip(tokens, grid):
        log(f"forward T={t}: " + " ".join(f"{s * 1e3:.1f}" for s in row) + " ms")
    return monotone(grid), [[t, t * (ctx + 1)] for row in shapes for t, ctx in row]


def measure_pairs(llm: LLM, table: CostTable, repeats: int) -> float:
    """``pair_s``: least squares through 0 of the seconds a chain forward of ``CHAINS`` takes
    beyond a one-token-per-sequence forward of the same tokens and context, on the extra
    pairs. Each chain is timed right beside its reference (fewest seconds of each), so a change
    of load between the grid and this step does not land in the difference; the reference's
    context, rounded to whole tokens per sequence, is corrected along the grid."""
    xs, ys = [], []
    for b, q, ctx in CHAINS:
        t, c = b * q, b * (ctx + 1)
        per = max(round(c / t), 1)
        chain, ref = [], []
        for _ in range(repeats):
            chain.append(_forward(llm, b, q, ctx, 1))
            ref.append(_forward(llm, t, 1, per - 1, 1))
        ref_s = min(ref) + table.forward_seconds(t, c) - table.forward_seconds(t, t * per)
        pairs = b * (q * (ctx + 1) + q * (q - 1) // 2)
        xs.append(pairs - c)
        ys.append(min(chain) - ref_s)
    xs, ys = np.array(xs, dtype=float), np.array(ys, dtype=float)
    return max(float(xs @ ys / (xs @ xs)), 0.0)


def measure_draft(llm: LLM, grid=((1, 1), (1, 4), (4, 2), (4, 6), (16, 1), (16, 4), (1, 6),
                                   (16, 6)), repeats: int = 3) -> dict:
    """Draft coefficients of ``llm``'s drafter from dummy sequences (48 cached tokens, zero
    features for a drafter that reads them; threaded as the engine threads the step), fitted
    non-negatively to ``[1, depth, batch x depth, nodes]`` on relative error."""
    drafter = llm.engine.drafter
    hidden = llm.engine.runner.model.config.hidden_size
    feature = torch.zeros(1, hidden, dtype=llm.engine.runner.dtype,
                          device=llm.engine.runner.device)
    params = SamplingParams(temperature=0.0)
    rows, ys, ctx = [], [], 48
    for b, d in grid:
        strategy = Strategy(d)
        seqs = [Sequence("cost", 0, [1 + (i % 7) for i in range(ctx + 1)], params,
                         torch.Generator()) for _ in range(b)]
        try:
            for s in seqs:
                s.num_cached = ctx
                if drafter.wants_hidden:
                    drafter.observe(s, 0, feature.expand(ctx + 1, -1))
            times = []
            with kernels.kernel_threads(kernels.packed_covers(b * (1 + strategy.budget))):
                drafter.propose(seqs, strategy)
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    trees = drafter.propose(seqs, strategy)
                    times.append(time.perf_counter() - t0)
            nodes = sum(t.num_nodes for t in trees if t is not None)
            rows.append([1.0, d, b * d, nodes])
            ys.append(min(times))
        finally:
            for s in seqs:
                drafter.release(s)
    x, y = np.array(rows), np.array(ys)
    w = 1.0 / np.maximum(y, 1e-6) ** 2  # relative error
    theta = nonnegative_solve((x * w[:, None]).T @ x + 1e-12 * np.eye(4), (x * w[:, None]).T @ y)
    return dict(zip(("step_s", "depth_s", "sequence_depth_s", "node_s"),
                    (float(v) for v in theta)))


def rollout_trace(llm: LLM, prompts: int, max_tokens: int):
    """A short traced rollout of ShareGPT chat prompts (T = 1, seeded)."""
    convs = chat_prompts(prompts, max_chars=600, start=2000)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens)
              for i in range(len(convs))]
    llm.chat(convs[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    llm.start_trace()
    llm.chat(convs, params, use_tqdm=False)
    return llm.stop_trace()


def fit_draft_sequence(trace, coef: dict, source: str) -> float:
    """``sequence_s`` of ``source``: the trace's logged draft seconds beyond ``coef``'s
    prediction, per sequence drafted for (least squares through 0, non-negative)."""
    from specengine.replay.projection import logged_shape

    doc = {"format": TABLE_FORMAT, "version": TABLE_VERSION, "kind": "measured",
           "forward": {"tokens": [1], "context": [1], "seconds": [[0.0]]},
           "draft": {source: coef}}
    table = CostTable(doc)
    xs, ys = [], []
    for st in trace.steps:
        shape = logged_shape(st, source)
        for src, (b, d, n) in shape.drafts.items():
            xs.append(b)
            ys.append(st["draft_s"] - table.draft_seconds(src, b, d, n))
    xs, ys = np.array(xs, dtype=float), np.array(ys, dtype=float)
    return max(float(xs @ ys / (xs @ xs)), 0.0) if len(xs) and xs @ xs > 0 else 0.0


def fit_policy(trace) -> dict:
    """``{"step_s", "sequence_s"}`` of the trace's policy: its logged ``policy_s`` per step
    fitted non-negatively to ``[1, rows sampled]``."""
    from specengine.replay.projection import logged_shape

    x = np.array([[1.0, logged_shape(st).rows] for st in trace.steps])
    y = np.array([st.get("policy_s", 0.0) for st in trace.steps])
    theta = nonnegative_solve(x.T @ x + 1e-12 * np.eye(2), x.T @ y)
    return {"step_s": float(theta[0]), "sequence_s": float(theta[1])}


def fit_overheads(traces) -> dict:
    """``step_s``, ``sequence_s``, ``node_s`` from traced steps: the step period (end to end,
    the first step of each trace skipped) minus its logged forward and draft seconds, fitted
    non-negatively to ``[1, rows, nodes]`` on absolute error. The traces must come from
    policies that cost nothing to run (no speculation, ``static``)."""
    from specengine.replay.projection import logged_shape

    rows, ys = [], []
    for tr in traces:
        for prev, st in zip(tr.steps, tr.steps[1:]):
            shape = logged_shape(st)
            rows.append([1.0, shape.rows, shape.nodes])
            ys.append(st["end"] - prev["end"] - st["forward_s"] - st["draft_s"])
    x, y = np.array(rows), np.array(ys)
    theta = nonnegative_solve(x.T @ x + 1e-12 * np.eye(3), x.T @ y)
    return dict(zip(("step_s", "sequence_s", "node_s"), (float(v) for v in theta)))


def measure_table(model: str, dtype: str, cfg: dict, drafters: list[str], log) -> dict:
    """Measure a whole table on this machine (see the module docstring)."""
    llm = LLM(model, dtype=dtype)
    grid, shapes = measure_forward(llm, cfg["tokens"], cfg["context"], cfg["repeats"], log)
    doc = {"format": TABLE_FORMAT, "version": TABLE_VERSION, "kind": "measured",
           "label": f"measured: {model} {dtype} on this machine",
           "device": machine_info()["cpu"], "model": model, "dtype": dtype,
           "machine": machine_info(),
           "notes": "forward grid measured with one query token per sequence (T sequences of "
                    "C/T positions; measured_at lists the exact shapes); pair_s, step_s, "
                    "sequence_s, node_s and draft fitted as bench/step_costs.py says",
           "forward": {"tokens": cfg["tokens"], "context": cfg["context"], "seconds": grid,
                       "measured_at": shapes}}
    doc["pair_s"] = measure_pairs(llm, CostTable(doc), cfg["repeats"])
    log(f"pair_s = {doc['pair_s']:.3g}")
    traces = [rollout_trace(llm, 12, 32)]
    del llm
    doc["draft"] = {}
    for name in drafters:
        spec = LLM(model, dtype=dtype, speculative_config={
            "method": name, "num_speculative_tokens": 4, "policy": "static"})
        coef = measure_draft(spec)
        traces.append(rollout_trace(spec, 12, 32))
        coef["sequence_s"] = fit_draft_sequence(traces[-1], coef, name)
        doc["draft"][name] = coef
        log(f"draft {name}: {coef}")
        del spec
    doc.update(fit_overheads(traces))
    if drafters:
        auto = LLM(model, dtype=dtype, speculative_config={
            "method": drafters[0], "num_speculative_tokens": 4, "policy": "auto"})
        doc["policy"] = {"auto": fit_policy(rollout_trace(auto, 12, 32))}
        log(f"policy auto: {doc['policy']['auto']}")
        del auto
    log(f"step_s = {doc['step_s']:.3g}, sequence_s = {doc['sequence_s']:.3g}, "
        f"node_s = {doc['node_s']:.3g}")
    CostTable(doc)  # check
    return doc


def h200_roofline(model: str) -> dict:
    """The H200-class projection for ``model`` (EAGLE drafting priced by its own roofline: one
    drafter layer, its fc and its reduced LM head per depth, plus 30 us of launches)."""
    from specengine.models.loader import load_config, resolve_model

    cfg = load_config(resolve_model(model))
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    eagle_params = (2 * h * h + h * q + 2 * h * kv + q * h + 3 * h * inter + 8192 * h)
    draft = {"eagle": {"depth_s": 3e-5 + 2 * eagle_params / 4.8e12,
                       "sequence_depth_s": 2 * eagle_params / 790e12},
             "ngram": {"node_s": 2e-6}}
    return roofline_table(cfg, model=model, draft=draft)


def gpu_table(path: str | None, model: str) -> CostTable:
    """The table a GPU projection of ``model``'s rollouts is priced with: the one at ``path``,
    or without a path the H200-class roofline for ``model`` built from its config
    (``h200_roofline``; a projection, not a measurement).

    Raises:
        ValueError: the table at ``path`` prices another model (its ``model`` field; the
            shipped ``cost_tables/h200_roofline.json`` is SmolLM2-135M's).
        FileNotFoundError: no file at ``path``.
    """
    if path is None:
        return CostTable(h200_roofline(model), f"H200-class roofline for {model}")
    table = CostTable.load(path)
    if not table.prices(model):
        raise ValueError(f"--gpu-table {path}: prices {table.model!r}, not {model!r}; leave it "
                         f"out for the roofline of {model!r}, or make one with `python "
                         f"bench/step_costs.py --roofline --model {model} --out FILE`")
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="a smaller grid, fewer repeats")
    ap.add_argument("--drafters", default="eagle,ngram",
                    help="comma-separated speculative methods to price ('' for none)")
    ap.add_argument("--roofline", action="store_true",
                    help="write the H200-class roofline projection instead of measuring")
    ap.add_argument("--out", default=None, help="output JSON (default under bench/cost_tables)")
    args = ap.parse_args(argv)
    quiet_transformers()
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"# [{time.perf_counter() - start:5.0f}s] {msg}", file=sys.stderr, flush=True)

    if args.roofline:
        doc = h200_roofline(args.model)
        out = args.out or str(TABLES / "h200_roofline.json")
    else:
        drafters = [d for d in args.drafters.split(",") if d]
        doc = measure_table(args.model, args.dtype, QUICK if args.quick else FULL, drafters,
                            log)
        out = args.out or str(TABLES / "cpu_measured.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    CostTable(doc).save(out)
    print(f"wrote {out} ({doc['kind']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
