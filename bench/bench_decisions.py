"""Host-side cost of the per-step speculation decisions, per call: ``AutoPolicy.choose`` and
``NgramIndex.propose`` on long sequences. The unit tests check the work these calls do
(one vectorised scoring per decision, only new tokens converted, at most ``max_matches``
matches walked); this script times it.

Rows:

- **choose (11 candidates)**: ``AutoPolicy.choose`` with chains 1..8 and two trees, fitted
  models, a new batch size each call (1..199), so every call is a full re-scoring: median
  seconds per decision. Target < 1 ms.
- **propose, 8000 tokens, keyed**: ``NgramIndex.propose`` (depth 5, topk 3, budget 12) on a
  random 8000-token sequence over 50 tokens growing by one token per call, with a key (its
  numpy copy kept between calls): mean seconds per call over 50 calls. Target < 20 ms
  (catches work quadratic in the sequence length).
- **propose, 8000 repeats**: the same on one token repeated 8000 times, no key (every
  position matches; ``max_matches`` bounds the Python work): seconds per call. Target < 50 ms.

    python bench/bench_decisions.py [--repeats 5] [--out decisions.json]

Prints a markdown table with PASS/FAIL against the targets (never an exit status): best of
``--repeats`` runs of each row. Run it on a quiet machine; the bounds are loose (shared CI
machines), an order of magnitude above a quiet machine's times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from common import machine_info, markdown_table, write_json

from specengine.speculative.drafters.ngram import NgramIndex
from specengine.speculative.policy import AutoPolicy
from specengine.speculative.policy.acceptance import AcceptanceModel
from specengine.speculative.policy.latency import LatencyModel
from specengine.speculative.strategy import Strategy

CANDIDATES = [Strategy(d) for d in range(1, 9)] + [Strategy(8, 2, 16), Strategy(8, 4, 32)]


def fitted_policy(rng: np.random.Generator) -> AutoPolicy:
    """An ``AutoPolicy`` over ``CANDIDATES`` with models fitted on synthetic steps: forwards
    flat up to 256 tokens then linear, a free drafter, acceptance 0.7 per depth (chains) and
    0.85 (trees); no probes."""
    lm = LatencyModel()
    for _ in range(600):
        batch = int(2 ** rng.uniform(0, 8))
        per_seq = 1 + int(rng.integers(0, 33))
        tokens, ctx = batch * per_seq, batch * int(rng.integers(16, 512))
        lm.add_forward(tokens, ctx, batch, 0.01 + 1e-4 * max(0, tokens - 256))
        lm.add_draft(batch, per_seq - 1 or 1, tokens - batch, 1e-5)
        lm.add_other(batch, tokens - batch, batch, 1e-4)
    am = AcceptanceModel(max_depth=8)
    for _ in range(100):
        for s, rate in [(Strategy(8), 0.7)] + [(t, 0.85) for t in CANDIDATES[8:]]:
            acc = [int(min(rng.geometric(1 - rate) - 1, s.depth)) for _ in range(16)]
            am.observe(s, acc, 16, 16 * s.num_nodes)
    return AutoPolicy(CANDIDATES, latency=lm, acceptance=am, probe_every=0)


def time_choose(rng: np.random.Generator) -> float:
    """Median seconds per ``choose``, each for a new batch size (a full re-scoring)."""
    pol = fitted_policy(rng)
    times = []
    for b in range(1, 200):
        t0 = time.perf_counter()
        pol.choose(b)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_propose_growing(rng: np.random.Generator) -> float:
    """Mean seconds per keyed ``propose`` on an 8000-token sequence growing by one token."""
    seq = rng.integers(0, 50, 8000).tolist()
    p = NgramIndex()
    p.propose(seq, Strategy(5, 3, 12), key=0)
    t0 = time.perf_counter()
    for i in range(50):
        seq.append(i % 50)
        p.propose(seq, Strategy(5, 3, 12), key=0)
    return (time.perf_counter() - t0) / 50


def time_propose_repeats() -> float:
    """Seconds of one ``propose`` on a token repeated 8000 times."""
    t0 = time.perf_counter()
    NgramIndex().propose([7] * 8000, Strategy(5, 3, 12))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs per row (best kept)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = [("choose (11 candidates)", lambda: time_choose(rng), 1e-3),
            ("propose, 8000 tokens, keyed", lambda: time_propose_growing(rng), 0.02),
            ("propose, 8000 repeats", time_propose_repeats, 0.05)]
    table, doc = [], {"machine": machine_info(), "repeats": args.repeats, "rows": []}
    for name, fn, target in rows:
        best = min(fn() for _ in range(args.repeats))
        table.append([name, best * 1e3, target * 1e3, "PASS" if best < target else "FAIL"])
        doc["rows"].append({"row": name, "seconds": best, "target_seconds": target})
    print(markdown_table(["call", "ms per call", "target ms", ""], table))
    if args.out:
        write_json(args.out, doc)


if __name__ == "__main__":
    main()
