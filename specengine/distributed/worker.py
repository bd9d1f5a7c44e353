"""``RolloutWorker``: the body of one pool actor, an ``LLM`` behind Ray.

``RolloutPool`` runs it as ``ray.remote(RolloutWorker)``; ``OpenRLHFRolloutActor`` extends it.
It holds one ``LLM`` (own speculative config, own KV cache) and exposes its calls; weights arrive
as a Ray ``ObjectRef`` inside a list (so Ray hands the actor the reference, not a copy made per
call) and are fetched from the object store here. Every call holds ``self.lock``: a threaded
actor (``max_concurrency > 1``) never runs two engine calls at once.

Rollout streams and migration: ``rollout`` steps the engine one step per lock hold, so a threaded
actor serves ``migration_status`` / ``export_prefixes`` / ``export_sequences`` /
``import_sequences`` (``worker_migration.WorkerMigration``) between two steps of a running
rollout (those calls announce themselves and the stepping loop waits for them before its next
step). Several streams may run on one actor
(a re-run after a fault, samples imported while none ran): whichever holds the lock steps the
engine for all; each finished ``RequestOutput`` goes to the stream owning its request id. A
stream owns the requests it added and adopts requests nobody owns (samples imported here);
it ends when none of its requests is left on this engine (finished, or every sample moved away).

Weight updates: ``stage_weight_update`` is phase one of the pool's all-or-nothing update (begin
and stage a chunk or checkpoint, nothing applied); ``finish_weight_update`` /
``abort_weight_update`` end it on every actor (``RolloutPool``, module docstring).

Spare-instance drafter training: the methods of ``spare_training.SpareTrainingActor`` (harvest,
train a round, publish); ``rollout`` announces itself there (``rollout_begins`` / ``_ends``), and
``import_sequences`` calls ``notify_work`` (samples arriving stop a round).
"""

from __future__ import annotations

import itertools
import os
import threading
from contextlib import contextmanager

import ray
import torch

from specengine.api import LLM
from specengine.distributed.spare_training import SpareTrainingActor
from specengine.distributed.worker_migration import WorkerMigration
from specengine.lifecycle.migration import KVChunk
from specengine.sampling.params import SamplingParams


class RolloutWorker(SpareTrainingActor, WorkerMigration):
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
        self._turn = threading.Condition()  # callers waiting for the lock between steps
        self._callers = 0
        self._stream_ids = itertools.count()
        self._owner: dict[str, int] = {}  # request id -> the stream that returns it
        self._live: set[int] = set()  # streams running
        self._outbox: dict[str, list] = {}  # finished outputs not yet taken by their stream
        self._staged_in: dict[tuple[str, int], KVChunk] = {}  # stage-one chunks received
        self.objects_received: list[str] = []  # hex ids of the ObjectRefs fetched here
        self.init_spare_training()

    def info(self) -> dict:
        """Where the actor runs: ``pid``, ``node_id`` (Ray node), ``num_threads`` (torch)."""
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "num_threads": torch.get_num_threads()}

    def rollout(self, items: list[tuple[str, object, SamplingParams]]):
        """Generate ``items`` (``(request_id, prompt, params)``), one engine step per lock
        hold; yields each finished ``RequestOutput`` of the requests this stream owns (its
        items, and requests imported here that no stream owned) as a Ray streaming generator,
        so the pool keeps what finished if this actor dies later. A request some of whose
        samples moved to another engine comes back in parts (each engine returns the samples
        that finished there; ``migration.merge_outputs`` joins them). Ends when none of its
        requests is left here.

        Raises:
            ValueError: a bad prompt or params, a request id in use; nothing is added then.
            RuntimeError: an engine step failed (every request of this engine is dropped).
        """
        self.rollout_begins()  # a spare-instance training round here stops first
        try:
            for out in self._stream(items):  # noqa: UP028 - Ray's streaming send()s into it
                yield out
        finally:
            self.rollout_ends()

    def _stream(self, items: list[tuple[str, object, SamplingParams]]):
        """``rollout``'s body: add ``items``, step, yield this stream's outputs."""
        eng = self.llm.engine
        with self.lock:
            sid = next(self._stream_ids)
            added = []
            try:
                for rid, prompt, params in items:
                    added.append(self.llm.add_request(prompt, params, request_id=rid))
            except BaseException:
                for rid in added:
                    eng.abort_request(rid)
                raise
            for rid in added:
                self._owner[rid] = sid
            self._live.add(sid)
        try:
            while True:
                self._wait_for_callers()
                with self.lock:
                    ready, left = self._step_for(sid)
                for out in ready:  # noqa: UP028 - Ray's streaming send()s into the generator
                    yield out
                if not left:
                    return
        finally:  # ended, failed or closed: what it still owned may be adopted by another
            with self.lock:
                for r in [r for r, s in self._owner.items() if s == sid]:
                    del self._owner[r]
                self._live.discard(sid)

    def _step_for(self, sid: int) -> tuple[list, list]:
        """One engine step (lock held) for every stream; returns stream ``sid``'s finished
        outputs and its request ids still here."""
        eng = self.llm.engine
        if eng.has_unfinished():
            try:
                outs = self.llm.step()
            except BaseException:
                eng.abort_all()
                self._outbox.clear()
                raise
            for out in outs:
                self._outbox.setdefault(out.request_id, []).append(out)
        for rid in self._unowned():  # samples imported while no stream ran
            self._owner[rid] = sid
        mine = [r for r, s in self._owner.items() if s == sid]
        ready = [o for r in mine for o in self._outbox.pop(r, [])]
        ready_now = {o.request_id for o in eng.outputs_ready}
        left = [r for r in mine if r in eng.requests or r in ready_now]
        for r in set(mine) - set(left):
            del self._owner[r]
        if not left:
            self._live.discard(sid)
        return ready, left

    def _unowned(self) -> list[str]:
        eng = self.llm.engine
        held = set(eng.requests) | {o.request_id for o in eng.outputs_ready} | set(self._outbox)
        return [r for r in held if r not in self._owner]

    def _wait_for_callers(self) -> None:
        """Before a step: let calls waiting for the lock (status, export, import) go first."""
        with self._turn:
            self._turn.wait_for(lambda: self._callers == 0, timeout=1.0)

    @contextmanager
    def _between_steps(self):
        """Hold the engine between two steps of any running rollout."""
        with self._turn:
            self._callers += 1
        try:
            with self.lock:
                yield
        finally:
            with self._turn:
                self._callers -= 1
                self._turn.notify_all()

    def abort_requests(self, request_ids: list[str], keep_partial: bool = False) -> int:
        """Stop these requests here (unknown ids are skipped); the streams owning them end.
        ``keep_partial``: each one's output so far (``finish_reason="abort"`` on the samples
        cut short, ``Engine.abort_request``) is what its stream returns for it; otherwise it
        and any output not yet returned are dropped. Returns how many were stopped."""
        with self._between_steps():
            eng = self.llm.engine
            outs = [o for r in request_ids if (o := eng.abort_request(r)) is not None]
            if keep_partial:
                for o in outs:
                    self._outbox.setdefault(o.request_id, []).append(o)
                return len(outs)
            drop = set(request_ids)
            for r in request_ids:
                self._outbox.pop(r, None)
            # the others' finished outputs not returned yet go where ``step`` would put them
            kept = [o for o in eng.take_ready_outputs() if o.request_id not in drop]
            self.llm.migration.observe(kept)
            for o in kept:
                self._outbox.setdefault(o.request_id, []).append(o)
            return len(outs)

    # ---- weights (phase one and two of RolloutPool's all-or-nothing update) ----------------
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

    def stage_weight_update(self, source=None, begin: bool = True, idle: bool = True) -> dict:
        """Phase one of the pool's all-or-nothing weight update (``RolloutPool``): with
        ``begin``, ``LLM.begin_weight_update``; then, with a ``source`` (a list holding an
        ObjectRef of a chunk, or a checkpoint path), ``LLM.load_weights`` into the session.
        Nothing is applied: the old weights keep serving until ``finish_weight_update``.
        With neither, it checks that the session can be finished. Every step runs under one
        hold of the engine.

        Args:
            source: None, ``[ObjectRef]`` of a chunk, or a checkpoint path (str).
            begin: open the session first.
            idle: refuse first when requests are in flight here (``finish`` would refuse).

        Returns:
            ``names``: the names staged (empty without ``source``); ``weight_version``: the
            version serving now.

        Raises:
            RuntimeError: requests are in flight (with ``idle``), a session is open already
                (with ``begin``) or none is (without). ValueError / TypeError /
                FileNotFoundError: as ``LLM.load_weights`` (a refused chunk aborts the
                session here; the pool aborts it everywhere).
        """
        chunk = source if source is None or isinstance(source, str) else self._fetch(source)
        with self.lock:
            if idle and self.llm.engine.has_unfinished():
                raise RuntimeError("requests are in flight on this actor; a weight update "
                                   "is applied between generate calls")
            if begin:
                self.llm.begin_weight_update()
            elif not self.llm.weights.in_session:
                raise RuntimeError("no weight update session is open on this actor")
            names = [] if chunk is None else self.llm.load_weights(chunk)
            return {"names": names, "weight_version": self.llm.weight_version}

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
