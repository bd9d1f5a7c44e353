"""``RolloutWorker``: the body of one pool actor, an ``LLM`` behind Ray.

``RolloutPool`` runs it as ``ray.remote(RolloutWorker)``; ``OpenRLHFRolloutActor`` extends it.
It holds one ``LLM`` (own speculative config, own KV cache) and exposes its calls; weights arrive
as a Ray ``ObjectRef`` inside a list (so Ray hands the actor the reference, not a copy made per
call) and are fetched from the object store here. Every call holds ``self.lock``: a threaded
actor (``max_concurrency > 1``) never runs two engine calls at once.

Spare-instance drafter training (``distributed.training``, TLT): ``enable_harvest`` makes the
EAGLE drafter's engine record finished sequences' target features, ``take_harvest`` hands them
to the pool, ``train_drafter`` runs one training round (under ``self.train_lock``, not the engine
lock), ``stop_training`` ends it early, ``set_drafter`` swaps in a published version. A
``rollout`` call that arrives stops a round in progress before its next optimizer step and waits
for it (a threaded actor is needed for that: ``RolloutPool`` gives its actors ``max_concurrency``
4 when training is on). Code that hands an actor work by another method (e.g. migrated
sequences) calls ``notify_work`` first.
"""

from __future__ import annotations

import os
import threading

import ray
import torch

from specengine.api import LLM
from specengine.distributed.training import SpareTrainer, SpareTraining
from specengine.sampling import SamplingParams
from specengine.speculative.drafters.eagle import EagleDrafter
from specengine.speculative.training.harvest import Harvester, HiddenBuffer, harvest


class RolloutWorker:
    """One engine of a rollout pool.

    Args:
        llm_kwargs: keyword arguments of ``LLM`` (model, dtype, speculative_config, seed, vLLM
            engine arguments ...).
        num_threads: torch threads (the CPUs Ray gave the actor); None leaves torch's default.

    Raises:
        ValueError: from ``LLM`` (bad arguments).
    """

    def __init__(self, llm_kwargs: dict, num_threads: int | None = None):
        if num_threads is not None:
            torch.set_num_threads(max(1, int(num_threads)))
        self.lock = threading.RLock()
        self.llm = LLM(**llm_kwargs)
        self.objects_received: list[str] = []  # hex ids of the ObjectRefs fetched here
        self.train_lock = threading.Lock()  # held while a training round runs
        self._work = threading.Lock()
        self.work_received = 0  # notify_work calls (each rollout call makes one)
        self.active_rollouts = 0  # rollout calls arrived and not finished
        self.stop_round = 0  # training rounds with an id <= this stop (stop_training)
        self.harvest_buffer: HiddenBuffer | None = None
        self.trainer: SpareTrainer | None = None

    def info(self) -> dict:
        """Where the actor runs: ``pid``, ``node_id`` (Ray node), ``num_threads`` (torch)."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "num_threads": torch.get_num_threads()}

    def rollout(self, items: list[tuple[int, object, SamplingParams]]):
        """Generate ``items`` (``(index, prompt, params)``) in one batch; yields
        ``(index, RequestOutput)`` as each request finishes (a Ray streaming generator, so the
        pool keeps what finished if this actor dies later).

        Raises:
            ValueError: a bad prompt or params (from ``LLM.generate_iter``); nothing runs then.
        """
        self.notify_work()
        with self._work:
            self.active_rollouts += 1
        try:
            with self.train_lock:  # a training round stops before its next step
                pass
            with self.lock:
                index = [i for i, _, _ in items]
                it = self.llm.generate_iter([p for _, p, _ in items], [s for _, _, s in items],
                                            use_tqdm=False)
                for k, out in it:
                    yield index[k], out
        finally:
            with self._work:
                self.active_rollouts -= 1

    def _fetch(self, refs: list):
        self.objects_received.append(refs[0].hex())
        return ray.get(refs[0])

    def update_weights(self, refs: list) -> list[str]:
        """``LLM.update_weights`` with the weights at ``refs[0]`` (an ObjectRef)."""
        weights = self._fetch(refs)
        with self.lock:
            return self.llm.update_weights(weights)

    def begin_weight_update(self) -> None:
        """``LLM.begin_weight_update``."""
        with self.lock:
            self.llm.begin_weight_update()

    def load_weights(self, source) -> list[str]:
        """``LLM.load_weights`` with a chunk at ``source[0]`` (a list holding an ObjectRef), or
        a checkpoint path (str, read on this actor's node)."""
        chunk = source if isinstance(source, str) else self._fetch(source)
        with self.lock:
            return self.llm.load_weights(chunk)

    def finish_weight_update(self, weight_version: int | None = None) -> list[str]:
        """``LLM.finish_weight_update``."""
        with self.lock:
            return self.llm.finish_weight_update(weight_version)

    def abort_weight_update(self) -> bool:
        """``LLM.abort_weight_update``."""
        with self.lock:
            return self.llm.abort_weight_update()

    def sleep(self, level: int = 1) -> dict[str, int]:
        """``LLM.sleep``: bytes released."""
        with self.lock:
            return self.llm.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """``LLM.wake_up``."""
        with self.lock:
            self.llm.wake_up(tags)

    def reset_prefix_cache(self) -> bool:
        """``LLM.reset_prefix_cache``."""
        with self.lock:
            return self.llm.reset_prefix_cache()

    def get_metrics(self) -> dict:
        """``LLM.get_metrics``."""
        with self.lock:
            return self.llm.get_metrics()

    def received_objects(self) -> list[str]:
        """Hex ids of the object-store references this actor fetched, oldest first."""
        return list(self.objects_received)

    def weight_version(self) -> int:
        """``LLM.weight_version``."""
        return self.llm.weight_version

    # ---- spare-instance drafter training (distributed.training) -------------------------------
    def notify_work(self) -> None:
        """New work arrived for this actor: a training round in progress stops before its next
        optimizer step (``rollout`` calls it on arrival)."""
        with self._work:
            self.work_received += 1

    def _eagle(self) -> EagleDrafter | None:
        d = self.llm.engine.drafter
        d = d.inner if isinstance(d, Harvester) else d
        return d if isinstance(d, EagleDrafter) else None

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
        "nbytes"}, list[Rollout])`` (call with ``num_returns=2``: the list stays in the object
        store, the caller reads the counts)."""
        items = self.harvest_buffer.drain() if self.harvest_buffer is not None else []
        return {"count": len(items), "nbytes": sum(r.nbytes for r in items)}, items

    def train_drafter(self, refs: list, cfg: SpareTraining, round_id: int) -> tuple[dict, dict]:
        """One spare-instance training round of this actor's EAGLE drafter on the rollouts at
        ``refs`` (ObjectRefs of ``list[Rollout]``); see ``SpareTrainer.run`` for when it stops
        (new work here, ``stop_training(round_id)``, ``cfg.seconds``, ``cfg.max_steps``). The
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
