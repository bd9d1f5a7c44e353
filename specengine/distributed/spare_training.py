"""Spare-instance drafter training (TLT, arXiv 2511.16665): during a rollout's long tail, a pool
actor whose share is finished trains the EAGLE drafter on the target hidden states harvested
across the pool and publishes a new drafter version that every actor swaps in between steps.

The parts:

- ``SpareTraining``: the configuration (``RolloutPool(spare_training=...)``).
- ``SpareTrainer`` (actor side): a float32 copy of the actor's ``EagleDrafter`` weights, its
  optimizer (``training.fit.Fitter``) and the pool's rollouts fetched from Ray's object store;
  ``run`` trains one round and returns the new weights. ``SpareTrainingActor``: the methods
  ``RolloutWorker`` gets for it (harvest, train a round, stop, publish).
- ``SpareScheduler`` (pool side, driven by ``RolloutPool.generate``): collects every actor's
  harvested rollouts into a bounded ``HarvestStore`` of object-store references (each chunk is
  stored once and never passes through the driver), starts a training round on an actor that has
  nothing left to decode while others still do, and publishes the round's weights to every actor
  (one stored object, every actor reads it; versions numbered by the pool, so monotonic).

Rules. One round runs at a time in the pool. A round trains for ``seconds`` (or ``max_steps``)
and stops early, between optimizer steps, as soon as new work reaches its actor (a ``rollout``
call arrives: no step starts after that) or the pool's ``generate`` is about to return (the step
in progress and at least one step complete, so a started round always yields a version). While
the actor stays spare, the next round starts after the publish. Outputs never change:
verification is lossless whatever the drafter's weights.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
import torch
from ray.exceptions import RayActorError

from specengine.speculative.drafters.eagle import EagleDrafter, load_state
from specengine.speculative.training.fit import Fitter, TrainConfig, trainable_copy
from specengine.speculative.training.harvest import (
    HiddenBuffer,
    SequenceFeatures,
    harvest,
)


def _default_train() -> TrainConfig:
    return TrainConfig(steps=1000, warmup=10, lr=5e-4, batch_tokens=2048)


@dataclass
class SpareTraining:
    """Configuration of spare-instance drafter training.

    Attributes:
        seconds: time budget of one training round (seconds, > 0); the round's weights are
            published when it ends.
        max_steps: optimizer steps per round at most (None: only ``seconds`` bounds a round).
        min_rollouts: harvested rollouts the pool must hold before a round starts.
        max_rollouts, max_bytes: bounds of the pool's harvest store (and of each actor's
            harvest buffer); the oldest chunks are dropped first.
        train: optimizer hyper-parameters (``TrainConfig``: lr, batch_tokens, unroll, ...).

    Raises:
        ValueError: a bound that is not positive.
    """

    seconds: float = 2.0
    max_steps: int | None = None
    min_rollouts: int = 4
    max_rollouts: int = 512
    max_bytes: int = 256 << 20
    train: TrainConfig = field(default_factory=_default_train)

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"SpareTraining.seconds={self.seconds!r}: must be > 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"SpareTraining.max_steps={self.max_steps!r}: must be >= 1 or None")
        for name in ("min_rollouts", "max_rollouts", "max_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"SpareTraining.{name}={getattr(self, name)!r}: must be >= 1")


class HarvestStore:
    """The pool's harvested rollouts: chunks ``(ref, count, nbytes)`` of
    ``list[SequenceFeatures]`` objects in Ray's object store (the driver holds references only).
    At most ``max_rollouts`` rollouts and ``max_bytes`` bytes; the oldest chunks are dropped
    first (the newest is kept even when alone over the bounds)."""

    def __init__(self, max_rollouts: int, max_bytes: int):
        self.max_rollouts, self.max_bytes = max_rollouts, max_bytes
        self.chunks: deque[tuple[ray.ObjectRef, int, int]] = deque()
        self.num_rollouts = self.nbytes = self.total_added = 0

    def add(self, ref: ray.ObjectRef, count: int, nbytes: int) -> None:
        """Hold the chunk at ``ref`` (``count`` rollouts, ``nbytes`` bytes; an empty one is
        ignored), then drop the oldest chunks while over the bounds."""
        if count <= 0:
            return
        self.chunks.append((ref, count, nbytes))
        self.num_rollouts += count
        self.nbytes += nbytes
        self.total_added += count
        while len(self.chunks) > 1 and (self.num_rollouts > self.max_rollouts
                                        or self.nbytes > self.max_bytes):
            _, c, b = self.chunks.popleft()
            self.num_rollouts -= c
            self.nbytes -= b

    def refs(self) -> list[ray.ObjectRef]:
        """The chunks' references, oldest first."""
        return [r for r, _, _ in self.chunks]


class SpareTrainer:
    """One actor's side of spare-instance training: a trainable float32 copy of the drafter
    (``trainable_copy``), its ``Fitter`` and the pool's rollouts.

    Args:
        drafter: the actor's ``EagleDrafter`` (its weights are the starting point).
        cfg: ``SpareTraining``.

    Attributes:
        version: the drafter version the trainable weights descend from (the last one this
            trainer produced, or one it reloaded).
        data: object id (hex) -> rollouts of that chunk, for the chunks the pool still holds.
    """

    def __init__(self, drafter: EagleDrafter, cfg: SpareTraining):
        self.drafter, self.cfg = drafter, cfg
        self.model = trainable_copy(drafter.model)
        self.fitter = Fitter(self.model, cfg.train)
        self.version = drafter.version
        self.last_round: int | None = None  # pool round id of the weights last returned
        self.data: dict[str, list[SequenceFeatures]] = {}
        self.rng = random.Random(cfg.train.seed)

    def sync(self) -> None:
        """Continue from the drafter's weights when it runs a newer version than this trainer
        produced (another actor published since); the optimizer state is kept."""
        if self.drafter.version > self.version:
            load_state(self.model, {k: v.float() for k, v in
                                    self.drafter.model.state_dict().items()}, "sync")
            self.version = self.drafter.version

    def load(self, refs: list[ray.ObjectRef]) -> int:
        """Keep the chunks at ``refs`` (fetching those not held yet), drop the others; returns
        the rollouts held."""
        keep = {r.hex(): r for r in refs}
        self.data = {h: rs for h, rs in self.data.items() if h in keep}
        new = [h for h in keep if h not in self.data]
        for h, rs in zip(new, ray.get([keep[h] for h in new])):
            self.data[h] = rs
        return sum(len(rs) for rs in self.data.values())

    def batch(self) -> list[SequenceFeatures]:
        """Random rollouts packed up to ``train.batch_tokens`` (padded size; at least one)."""
        pool = [r for rs in self.data.values() for r in rs]
        self.rng.shuffle(pool)
        batch, longest = [], 0
        for r in pool:
            n = min(len(r.token_ids), self.cfg.train.max_len)
            if batch and (len(batch) + 1) * max(longest, n) > self.cfg.train.batch_tokens:
                break
            batch.append(r)
            longest = max(longest, n)
        return batch

    def run(self, work_arrived: Callable[[], bool], stopped: Callable[[], bool],
            clock: Callable[[], float] = time.perf_counter
            ) -> tuple[dict, dict[str, torch.Tensor] | None]:
        """One training round.

        Before every step: ``work_arrived()`` ends the round at once; after at least one step,
        ``stopped()``, ``max_steps``, or the ``seconds`` budget end it: the next step is not
        started when the time spent (read from ``clock``, seconds) plus the mean step time so
        far would pass the budget.

        Returns:
            ``(stats, weights)``: stats ``steps``, ``seconds``, ``rollouts``, ``stop`` (why it
            ended: ``work``, ``pool``, ``budget``, ``steps``, ``data``), ``loss`` and ``top1``
            (of the last step); weights in the drafter's dtype (names as ``named_parameters``),
            None when no step ran.
        """
        cfg = self.cfg
        t0 = now = clock()
        held = sum(len(rs) for rs in self.data.values())
        steps, stop, last = 0, "data", {}
        while True:
            if work_arrived():
                stop = "work"
                break
            if steps and stopped():
                stop = "pool"
                break
            if steps and (now - t0) * (steps + 1) / steps > cfg.seconds:
                stop = "budget"
                break
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                stop = "steps"
                break
            if held < 1:
                break
            last = self.fitter.step(self.batch())
            steps += 1
            now = clock()
        stats = {"steps": steps, "seconds": now - t0, "rollouts": held, "stop": stop,
                 "loss": last.get("loss"), "top1": last.get("top1")}
        if not steps:
            return stats, None
        dtype = self.drafter.model.fc.dtype
        return stats, {k: v.detach().to(dtype).clone() for k, v in
                       self.model.state_dict().items()}


class SpareScheduler:
    """The pool's side: harvest collection, when a round starts, publishing its weights.

    Wiring (the whole contract with the pool's dispatch loop; ``events`` is the loop's queue,
    ``busy`` the set of actors with a call in flight): ``begin(events, busy)`` once after the
    first dispatch; ``on_idle(actor, busy, events)`` when an actor's call ends (``busy`` without
    it); ``on_trained(round_id, busy, events)`` for each ``("trained", None, round_id)`` event
    the round threads put on ``events``; ``finish()`` before ``generate`` returns or raises (it
    stops the round in flight after its current step, publishes what it produced and swaps
    queued versions in on every idle actor). Work placed on an actor later (re-runs, migrated
    samples) needs nothing here: the actor's ``rollout_begins`` / ``notify_work`` stops its
    round, and ``on_trained`` does not start another on a busy actor.

    Args:
        pool: the ``RolloutPool`` (its ``actors`` and ``alive``).
        cfg: ``SpareTraining``, or None to harvest only (no training).
        max_rollouts, max_bytes: the harvest store's bounds.
        trainable: the actors with an EAGLE drafter (only they train).
    """

    def __init__(self, pool, cfg: SpareTraining | None, max_rollouts: int, max_bytes: int,
                 trainable: set[int]):
        self.pool, self.cfg, self.trainable = pool, cfg, set(trainable)
        self.store = HarvestStore(max_rollouts, max_bytes)
        self.version = 0  # the newest drafter version published in the pool
        self.round = None  # (round id, actor id, thread, [result]) of the round in flight
        self.round_ids = 0
        self.num_rounds = self.num_steps = self.num_published = 0
        self.train_seconds = 0.0
        self.finish_wait_seconds = 0.0  # generate's wait for the round in flight at its end
        self.rounds: list[dict] = []  # per round: actor, stats, version published (or None)

    # ---- harvest ---------------------------------------------------------------------------
    def collect(self) -> None:
        """Move every live actor's newly harvested rollouts into the store (each actor puts
        its chunk in the object store; the driver keeps the reference)."""
        calls = []
        for a in list(self.pool.alive):
            meta, data = self.pool.actors[a].take_harvest.options(num_returns=2).remote()
            calls.append((meta, data))
        for meta, data in calls:
            try:
                m = ray.get(meta)
            except RayActorError:
                continue  # the pool notices the death through its own calls
            self.store.add(data, m["count"], m["nbytes"])

    # ---- rounds -----------------------------------------------------------------------------
    def begin(self, events, busy: set[int]) -> None:
        """A ``generate`` was dispatched: actors without work are spare from the start."""
        for a in list(self.pool.alive):
            if a not in busy:
                self.on_idle(a, busy, events)

    def on_idle(self, actor_id: int, busy: set[int], events) -> None:
        """``actor_id`` has nothing left to decode; ``busy``: actors still decoding. Starts a
        round there when training is on, it has an EAGLE drafter, no round is in flight,
        another actor is still busy, and the store holds ``min_rollouts``."""
        if self.cfg is None or self.round is not None or not busy or actor_id in busy \
                or actor_id not in self.trainable:
            return
        self.collect()
        if self.store.num_rollouts < self.cfg.min_rollouts:
            return
        self.round_ids += 1
        rid, holder = self.round_ids, []
        actor = self.pool.actors[actor_id]

        def body():
            try:
                stats, weights = actor.train_drafter.options(num_returns=2).remote(
                    self.store.refs(), self.cfg, rid)
                holder.append((ray.get(stats), weights))
            except Exception as e:  # noqa: BLE001 - a failed round publishes nothing
                holder.append(({"error": f"{type(e).__name__}: {e}"}, None))
            events.put(("trained", None, rid))

        thread = threading.Thread(target=body, daemon=True)
        self.round = (rid, actor_id, thread, holder)
        thread.start()

    def on_trained(self, rid: int, busy: set[int], events) -> None:
        """The round ``rid`` ended: publish its weights; start the next round if its actor is
        still spare."""
        if self.round is None or self.round[0] != rid:
            return
        actor_id = self._end_round()
        if actor_id in self.pool.alive:
            self.on_idle(actor_id, busy, events)

    def finish(self) -> None:
        """Before ``generate`` returns: stop the round in flight (after its current step), wait
        for it, publish its weights; then collect the last rollouts."""
        if self.round is not None:
            t0 = time.perf_counter()
            rid, actor_id, thread, _ = self.round
            try:
                ray.get(self.pool.actors[actor_id].stop_training.remote(rid))
            except RayActorError:
                pass
            thread.join()
            self.finish_wait_seconds += time.perf_counter() - t0
            self._end_round()
        refs = [self.pool.actors[a].swap_drafter.remote() for a in list(self.pool.alive)]
        for ref in refs:  # a version published while an actor decoded its last step
            try:
                ray.get(ref)
            except RayActorError:
                pass
        self.collect()

    def _end_round(self) -> int:
        rid, actor_id, thread, holder = self.round
        thread.join()
        self.round = None
        stats, weights = holder[0]
        self.num_rounds += 1
        self.num_steps += stats.get("steps", 0)
        self.train_seconds += stats.get("seconds", 0.0)
        published = self._publish(weights, rid) if stats.get("steps") else None
        self.rounds.append({"actor": actor_id, "version": published, **stats})
        return actor_id

    def _publish(self, weights: ray.ObjectRef, rid: int) -> int:
        """Every live actor swaps in the weights at ``weights`` (one stored object, from round
        ``rid``) as the next version; returns it."""
        self.version += 1
        refs = [(a, self.pool.actors[a].set_drafter.remote([weights], self.version, rid))
                for a in list(self.pool.alive)]
        for _, ref in refs:
            try:
                ray.get(ref)
            except RayActorError:
                pass
        self.num_published += 1
        return self.version

    def stats(self) -> dict:
        """``train_seconds`` (seconds training, summed over rounds), ``train_steps``,
        ``train_rounds``, ``versions_published``, ``drafter_version`` (newest published),
        ``harvested_rollouts`` / ``harvested_bytes`` (held in the store now),
        ``harvested_total`` (ever collected), ``finish_wait_seconds`` (time ``generate`` waited
        at its end for a round's last step: the overhead training adds to a rollout)."""
        return {"train_seconds": round(self.train_seconds, 4), "train_steps": self.num_steps,
                "finish_wait_seconds": round(self.finish_wait_seconds, 4),
                "train_rounds": self.num_rounds, "versions_published": self.num_published,
                "drafter_version": self.version, "harvested_rollouts": self.store.num_rollouts,
                "harvested_bytes": self.store.nbytes, "harvested_total": self.store.total_added}


class SpareTrainingActor:
    """The actor side of spare-instance training, mixed into ``RolloutWorker`` (it uses the
    worker's ``llm``, engine ``lock`` and ``_fetch``).

    ``enable_harvest`` makes the EAGLE drafter's engine record finished sequences' target
    features, ``take_harvest`` hands them to the pool, ``train_drafter`` runs one round (under
    ``train_lock``, not the engine lock), ``stop_training`` ends it early, ``set_drafter`` swaps
    in a published version. Work arriving (``rollout_begins``, called first by ``rollout``)
    stops a round before its next optimizer step and waits for it, so a threaded actor is needed
    (``RolloutPool``'s actors are threaded, ``max_concurrency`` 8). Code that hands
    the actor work by another method (e.g. migrated sequences) calls ``notify_work`` first.
    """

    def init_spare_training(self) -> None:
        """Set up the state (call in ``__init__``)."""
        self.train_lock = threading.Lock()  # held while a training round runs
        self._work = threading.Lock()
        self.work_received = 0  # notify_work calls (each rollout call makes one)
        self.active_rollouts = 0  # rollout calls arrived and not finished
        self.stop_round = 0  # training rounds with an id <= this stop (stop_training)
        self.harvest_buffer: HiddenBuffer | None = None
        self.trainer: SpareTrainer | None = None

    def rollout_begins(self) -> None:
        """A rollout call arrived: stop a round in progress (``notify_work``), count the call
        as active (no round starts while one is), wait until the round has stopped."""
        self.notify_work()
        with self._work:
            self.active_rollouts += 1
        with self.train_lock:
            pass

    def rollout_ends(self) -> None:
        """A rollout call ended (pairs with ``rollout_begins``)."""
        with self._work:
            self.active_rollouts -= 1

    def notify_work(self) -> None:
        """New work arrived for this actor: a training round in progress stops before its next
        optimizer step (``rollout`` calls it on arrival)."""
        with self._work:
            self.work_received += 1

    def _eagle(self) -> EagleDrafter | None:
        """The engine's EAGLE drafter: itself, inside a ``Harvester`` or a part of a merged
        drafter (``"method": ["suffix", "eagle"]``); None without one."""
        d = self.llm.engine.drafter
        return None if d is None else d.find(EagleDrafter)

    def enable_harvest(self, max_rollouts: int = 512, max_bytes: int = 256 << 20) -> bool:
        """With an EAGLE drafter: record every finished sequence's token ids and target
        features (``speculative.training.harvest``) into a buffer of at most ``max_rollouts``
        rollouts and ``max_bytes`` bytes (oldest dropped first). Returns False (and harvests
        nothing) without an EAGLE drafter."""
        if self._eagle() is None:
            return False
        with self.lock:
            self.harvest_buffer = HiddenBuffer(max_rollouts, max_bytes)
            harvest(self.llm, self.harvest_buffer)
        return True

    def take_harvest(self) -> tuple[dict, list]:
        """The rollouts harvested since the last call, taken out of the buffer: ``({"count",
        "nbytes"}, list[SequenceFeatures])`` (call with ``num_returns=2``: the list stays in the
        object store, the caller reads the counts)."""
        items = self.harvest_buffer.drain() if self.harvest_buffer is not None else []
        return {"count": len(items), "nbytes": sum(r.nbytes for r in items)}, items

    def train_drafter(self, refs: list, cfg: SpareTraining, round_id: int) -> tuple[dict, dict]:
        """One spare-instance training round of this actor's EAGLE drafter on the rollouts at
        ``refs`` (ObjectRefs of ``list[SequenceFeatures]``); see ``SpareTrainer.run`` for when it
        stops (new work here, ``stop_training(round_id)``, ``cfg.seconds``, ``cfg.max_steps``). The
        weights are not applied here: the pool publishes them (``set_drafter``).

        Returns:
            ``(stats, weights)`` as ``SpareTrainer.run`` (call with ``num_returns=2``).

        Raises:
            ValueError: the actor has no EAGLE drafter.
        """
        with self.train_lock:
            with self._work:
                if self.active_rollouts:
                    return {"steps": 0, "seconds": 0.0, "rollouts": 0, "stop": "work"}, None
                seen = self.work_received
            drafter = self._eagle()
            if drafter is None:
                raise ValueError("train_drafter: this actor has no EAGLE drafter")
            with self.lock:  # idle: the drafter's weights are read between engine steps
                drafter.swap()
                if self.trainer is None:
                    self.trainer = SpareTrainer(drafter, cfg)
                self.trainer.cfg = cfg
                self.trainer.sync()
            self.trainer.load(refs)
            stats, weights = self.trainer.run(lambda: self.work_received != seen,
                                              lambda: self.stop_round >= round_id)
            if weights is not None:
                self.trainer.last_round = round_id
            return stats, weights

    def stop_training(self, round_id: int) -> None:
        """End training round ``round_id`` (and earlier ones) after its current optimizer step
        (a round runs at least one step)."""
        self.stop_round = max(self.stop_round, round_id)

    def set_drafter(self, refs: list, version: int, round_id: int | None = None) -> int | None:
        """Publish the EAGLE drafter weights at ``refs[0]`` (an ObjectRef) as ``version``
        (``EagleDrafter.publish``): swapped in now if the engine is idle, else between its
        next steps. ``round_id``: the pool round that trained them (this actor's trainer then
        continues from them). Returns the version in use now, None without an EAGLE drafter."""
        drafter = self._eagle()
        if drafter is None:
            return None
        weights = self._fetch(refs)
        if self.trainer is not None and round_id is not None \
                and self.trainer.last_round == round_id:
            self.trainer.version = version
        drafter.publish(weights, version)
        if self.lock.acquire(blocking=False):
            try:
                drafter.swap()
            finally:
                self.lock.release()
        return drafter.version

    def swap_drafter(self) -> int | None:
        """Swap in a published drafter version still queued (call when the engine is idle);
        returns the version in use, None without an EAGLE drafter."""
        drafter = self._eagle()
        if drafter is None:
            return None
        with self.lock:
            return drafter.swap()

    def drafter_counts(self) -> dict[int, list[int]] | None:
        """The EAGLE drafter's ``{version: [verify steps, tokens committed]}`` (None without
        one)."""
        drafter = self._eagle()
        return None if drafter is None else {v: list(c) for v, c in drafter.per_version.items()}


def merge_tau(per_actor: list[dict[int, list[int]]]) -> dict[int, float]:
    """Pool-wide tau per drafter version from each actor's ``{version: [verify steps, tokens
    committed]}``: tokens committed / verify steps, summed over actors."""
    tot: dict[int, list[int]] = {}
    for d in per_actor:
        for v, (steps, tokens) in d.items():
            c = tot.setdefault(int(v), [0, 0])
            c[0] += steps
            c[1] += tokens
    return {v: round(c[1] / c[0], 3) for v, c in sorted(tot.items()) if c[0]}
