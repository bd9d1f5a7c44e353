"""``MigrationController``: moving samples from busy to idle pool actors in a rollout's long tail
(RLHFSpec, arXiv 2512.04752), with the engines' two-stage KV transfer
(``specengine.lifecycle.migration``).

Every ``interval`` seconds while a ``RolloutPool.generate`` runs (and at once when an actor's
last request came back), it asks each live actor for its unfinished samples and their predicted
remaining output tokens (``RolloutWorker.migration_status``: ``LLM.running_sequences``, from the
group's finished siblings and the history, see ``Migrator.predict_remaining``), divided by their
acceptance length tau: remaining engine steps per sample. An actor's predicted work is
``step_fixed_cost * max(steps) + sum(steps)`` (a decode step costs a fixed part, reading the
weights, plus a part per sample). When the least loaded actor's work is at most ``ratio`` of the
busiest one's and the busiest holds at least ``min_samples`` samples, samples move from the
busiest to it, longest first, each while the move lowers the larger of the two actors' work
(one sample always stays; samples with fewer than ``min_remaining`` predicted steps stay), at
most ``max_moves`` per round; a sample moves at most once per ``generate``.

One round, source ``S`` and destination ``D``:

1. per sample, ``MigrationCost.choose(kv_bytes, D's prefill seconds for its tokens)`` picks
   moving its K/V or re-prefilling it at ``D`` (a sample not running has no K/V: tokens);
2. stage one, ``S.export_prefixes`` (the K/V samples' full blocks), received by
   ``D.stage_prefixes`` while ``S`` keeps decoding them;
3. stage two, ``S.export_sequences`` between two of ``S``'s steps (the samples leave ``S`` with
   the K/V written since stage one, or as tokens);
4. ``D.import_sequences(stage two)`` with the staged stage one: the payloads go from ``S`` to
   ``D`` through Ray's object store (the controller passes their references, never the
   bytes); ``D``'s running rollout stream adopts them, else the pool starts one there
   (``GenerateRun.stream``).

Both paths give token for token the output of an unmoved run (``specengine.lifecycle.migration``);
the pool joins a split request's parts. Metrics (``metrics()``, in ``RolloutPool.get_metrics()``):
``migration_rounds``, ``migrated_samples`` (with K/V), ``reprefilled_samples``,
``migration_bytes`` (payload bytes received by destinations), ``migration_seconds`` (wall
seconds of the rounds' export/import calls), ``controller_seconds`` (wall seconds in
``on_tick``: status polls, decisions and rounds, waits for the actors' steps in progress
included; the driver's thread, beside the actors), ``controller_cpu_seconds`` (CPU seconds of
that thread: the controller's own work), ``status_seconds`` (seconds the actors' engines were
held answering status polls), ``migration_ticks``. The actors' engines record their side of
each move (``migration_stage1_seconds`` ... in ``LLM.get_metrics()``).
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import RayActorError, RayTaskError

from specengine.distributed.controller import PoolController
from specengine.lifecycle.migration import MigrationCost


class MigrationController(PoolController):
    """Moves unfinished samples between a pool's actors during ``generate`` (module docstring).

    Args:
        interval: seconds between status polls (> 0).
        ratio: a round runs when the least loaded actor's predicted work is at most ``ratio``
            times the busiest one's, in ``[0, 1)``.
        min_samples: the busiest actor must hold at least this many unfinished samples (>= 2).
        max_moves: samples moved per round at most (>= 1).
        min_remaining: a sample moves only with at least this many predicted remaining engine
            steps (>= 0; a move costs about a step at each end).
        step_fixed_cost: a decode step's cost that does not grow with the batch, in units of
            one sample's share (>= 0): a step of ``b`` samples costs ``step_fixed_cost + b``.
            On CPU most of a small batch's step is reading the weights (``bench_decode``,
            bfloat16, 2 threads: 8.3 ms at batch 1, 44.6 ms at 64, so about 13); 0 balances
            the sum of remaining steps only.
        cost: the rule choosing K/V transfer or re-prefill (default ``MigrationCost()``).
        clock: seconds (``time.perf_counter``), for the metrics.

    Attributes:
        moves: the latest ``generate``'s moves, ``(input index, sample index, source actor,
            destination actor, "kv" | "reprefill")``.

    Raises:
        ValueError: a value out of range.
    """

    def __init__(self, interval: float = 0.5, ratio: float = 0.5, min_samples: int = 2,
                 max_moves: int = 64, min_remaining: float = 16, step_fixed_cost: float = 8,
                 cost: MigrationCost | None = None, clock=time.perf_counter):
        if not interval > 0:
            raise ValueError(f"interval={interval}: must be > 0 seconds")
        if not 0 <= ratio < 1:
            raise ValueError(f"ratio={ratio}: must be in [0, 1)")
        if min_samples < 2:
            raise ValueError(f"min_samples={min_samples}: must be >= 2")
        if max_moves < 1:
            raise ValueError(f"max_moves={max_moves}: must be >= 1")
        if not min_remaining >= 0:
            raise ValueError(f"min_remaining={min_remaining}: must be >= 0 steps")
        if not step_fixed_cost >= 0:
            raise ValueError(f"step_fixed_cost={step_fixed_cost}: must be >= 0")
        self.interval, self.ratio = float(interval), float(ratio)
        self.min_samples, self.max_moves = int(min_samples), int(max_moves)
        self.min_remaining = float(min_remaining)
        self.step_fixed_cost = float(step_fixed_cost)
        self.cost = cost or MigrationCost()
        self.clock = clock
        self.stats = dict.fromkeys(
            ("migration_rounds", "migrated_samples", "reprefilled_samples", "migration_bytes",
             "migration_seconds", "controller_seconds", "controller_cpu_seconds",
             "status_seconds", "migration_ticks"), 0)
        self._run = None
        self._done: set[tuple[str, int]] = set()
        self.moves: list = []  # the last generate's moves (``GenerateRun.moved``)

    def metrics(self) -> dict:
        return dict(self.stats)

    def on_output(self, pool, actor_id: int, index: int, num_left: int) -> None:
        if num_left == 0:
            self.due = True  # an actor ran dry: look now

    def on_tick(self, pool, run) -> None:
        t0, c0 = self.clock(), time.thread_time()
        try:
            self._tick(pool, run)
        finally:
            self.stats["migration_ticks"] += 1
            self.stats["controller_seconds"] += self.clock() - t0
            self.stats["controller_cpu_seconds"] += time.thread_time() - c0

    def _tick(self, pool, run) -> None:
        if run is not self._run:
            self._run, self._done, self.moves = run, set(), run.moved
        actors = list(pool.alive)
        if len(actors) < 2:
            return
        try:
            status = dict(zip(actors, ray.get(
                [pool.actors[a].migration_status.remote() for a in actors])))
        except (RayActorError, RayTaskError):
            return  # the pool learns of the death from the actor's stream
        self.stats["status_seconds"] += sum(s["seconds"] for s in status.values())
        plan = self.plan({a: s["sequences"] for a, s in status.items()},
                         lambda q: q.request_id in run.index_of)
        if plan is not None:
            src, dst, picks = plan
            self._move(pool, run, src, dst, picks, status[dst]["prefill_seconds_per_token"])

    def plan(self, sequences: dict[int, list], movable=lambda q: True):
        """The next round from each actor's unfinished samples (``SequenceInfo``s): ``(source,
        destination, samples to move)`` by the rule of the module docstring, or None. Samples
        moved before in this ``generate``, or for which ``movable`` is False, stay."""
        work = {a: self.work([_steps(q) for q in seqs]) for a, seqs in sequences.items()}
        actors = sorted(work)
        if len(actors) < 2:
            return None
        src = max(actors, key=lambda a: (work[a], -a))
        dst = min(actors, key=lambda a: (work[a], a))
        seqs = sequences[src]
        if src == dst or len(seqs) < self.min_samples or work[dst] > self.ratio * work[src]:
            return None
        here = [_steps(q) for q in seqs]
        there = [_steps(q) for q in sequences[dst]]
        picks = []
        for q in sorted(seqs, key=lambda q: (-_steps(q), q.request_id, q.index)):
            if len(picks) >= min(self.max_moves, len(seqs) - 1):
                break
            w = _steps(q)
            if (q.request_id, q.index) in self._done or not movable(q) \
                    or w < self.min_remaining:
                continue
            rest = list(here)
            rest.remove(w)
            if max(self.work(rest), self.work(there + [w])) < max(self.work(here),
                                                                   self.work(there)):
                picks.append(q)
                here, there = rest, there + [w]
        return (src, dst, picks) if picks else None

    def work(self, steps: list[float]) -> float:
        """Predicted cost of an actor's samples with ``steps`` remaining engine steps each, in
        per-sample steps: ``step_fixed_cost * max(steps) + sum(steps)`` (a step costs
        ``fixed + batch`` units)."""
        return self.step_fixed_cost * max(steps, default=0.0) + sum(steps)

    def _move(self, pool, run, src: int, dst: int, picks: list, prefill_rate: float) -> None:
        """One round: ``picks`` (``SequenceInfo``s) from actor ``src`` to ``dst``."""
        t0 = self.clock()
        keys = [(q.request_id, q.index) for q in picks]
        self._done.update(keys)
        with_kv = [q.running and self.cost.choose(
            q.kv_bytes, prefill_rate * (q.num_prompt_tokens + q.num_output_tokens)) == "kv"
            for q in picks]
        s, d = pool.actors[src], pool.actors[dst]
        try:
            staged = [k if kv else ("", -1) for k, kv in zip(keys, with_kv)]
            prefixes = s.export_prefixes.remote(staged)  # stage one
            ray.get(d.stage_prefixes.remote(staged, prefixes))  # S decodes meanwhile
            states = s.export_sequences.remote(keys, with_kv)  # stage two, between steps
            ray.wait([states])
        except (RayActorError, RayTaskError):
            s.cancel_exports.remote(keys)
            return  # S died (its stream reports it), or D could not take stage one
        try:
            got = ray.get(d.import_sequences.remote(states))
        except RayActorError as e:  # D died with the samples: re-run their requests
            run.relocate([(*k, "lost") for k in keys], dst, src)
            run.dead(dst, e)
            return
        except RayTaskError:  # D refused them: they continue on S
            got, dst = ray.get(s.import_sequences.remote(states, prefixes)), src
        if not got["adopted"]:
            run.stream(dst)
        if dst != src:
            run.relocate([tuple(k) for k in got["keys"]], dst, src)
        st = self.stats
        st["migration_rounds"] += 1
        st["migrated_samples"] += got["kv"]
        st["reprefilled_samples"] += got["reprefill"]
        st["migration_bytes"] += got["bytes"]
        st["migration_seconds"] += self.clock() - t0


def _steps(q) -> float:
    """Predicted remaining engine steps of one sample (``SequenceInfo``)."""
    return q.predicted_remaining_tokens / max(q.acceptance_length, 1.0)
