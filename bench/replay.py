"""Replay projection: predict a logged rollout's wall time under other policies and on other
machines (``specengine.replay.projection``), from a rollout trace (``LLM.start_trace`` /
``LLM.stop_trace``, saved with ``RolloutTrace.save``) and one or more step-cost tables
(``bench/step_costs.py``: measured here, or ``bench/cost_tables/h200_roofline.json``, an
H200-class roofline PROJECTION).

    python bench/replay.py --trace rollout.json --table bench/cost_tables/h200_roofline.json \
        [--table cpu.json] [--policy off --policy as-logged --policy static:d=4] \
        [--acceptance other_trace.json] [--out results.json]

Default policies: ``off``, ``as-logged`` and, for a trace with speculative steps, ``static`` with
the trace's most used strategy. ``static`` takes its per-depth acceptance from ``--acceptance``
(a trace recorded with speculation) or else from ``--trace``. Prints, per table and policy, the
predicted seconds and speedup over ``off``; the trace's measured seconds stand beside
``as-logged`` (the policy it ran).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from specengine.replay.cost_table import CostTable
from specengine.replay.projection import AcceptanceStats, replay
from specengine.replay.trace import RolloutTrace


def default_policies(trace: RolloutTrace) -> list[str]:
    """``off``, ``as-logged`` and the static form of the trace's most used strategy; for a
    trace of several merged drafters (whose statistics are per source), the static form of
    the source that proposed the most nodes at that branching (``,source=NAME``)."""
    used = Counter((st.get("depth", 0), st.get("topk", 0)) for st in trace.steps
                   if st.get("depth") and st["decode"])
    policies = ["off", "as-logged"]
    if used:
        (d, k), _ = used.most_common(1)[0]
        static = f"static:d={d}" + (f",k={k}" if k > 1 else "")
        stats = AcceptanceStats(trace)
        nodes = {src: sum(v) for (src, kk), v in stats.overall.nodes.items() if kk == k}
        if nodes and trace.meta.get("drafter") not in nodes:
            static += f",source={max(nodes, key=nodes.get)}"
        policies.append(static)
    return policies


def project(trace: RolloutTrace, tables: list[CostTable], policies: list[str],
            stats: AcceptanceStats | None = None) -> list[dict]:
    """One row per (table, policy): the ``ReplayResult`` fields plus ``speedup_vs_off``
    (predicted off seconds / predicted seconds, None without an ``off`` row) and ``kind``."""
    rows = []
    for table in tables:
        results = [replay(trace, table, p, stats) for p in policies]
        off = next((r.seconds for r in results if r.policy == "off"), None)
        for r in results:
            row = r.as_dict()
            row.update(kind=table.kind, speedup_vs_off=off / r.seconds if off else None)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="rollout trace JSON (RolloutTrace.save)")
    ap.add_argument("--table", action="append", required=True,
                    help="step-cost table JSON (repeat for several)")
    ap.add_argument("--policy", action="append", default=None,
                    help="off | as-logged | auto | static:d=D[,k=K,m=M][,source=NAME] "
                         "(repeat; default: off, as-logged and the trace's static strategy)")
    ap.add_argument("--acceptance", default=None,
                    help="trace whose acceptance statistics 'static' uses (default: --trace)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        trace = RolloutTrace.load(args.trace)
        tables = [CostTable.load(t) for t in args.table]
        stats = AcceptanceStats(RolloutTrace.load(args.acceptance)) if args.acceptance else None
        rows = project(trace, tables, args.policy or default_policies(trace), stats)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"trace {args.trace}: {len(trace.sequences)} sequences, {trace.output_tokens} tokens, "
          f"{len(trace.steps)} steps, measured {trace.wall_s or 0:.3f} s")
    print("| table | kind | policy | predicted s | steps | speedup vs off | measured s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        measured = f"{r['measured_s']:.3f}" if r["policy"] in ("as-logged", "auto") \
            and r["measured_s"] is not None else "-"
        speed = f"{r['speedup_vs_off']:.2f}x" if r["speedup_vs_off"] else "-"
        print(f"| {r['table']} | {r['kind']} | {r['policy']} | {r['seconds']:.4g} | "
              f"{r['steps']} | {speed} | {measured} |")
        for w in r["warnings"]:
            print(f"  warning: {w}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"trace": args.trace, "tables": args.table, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
