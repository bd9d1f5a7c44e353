"""``GenerateRun``: the bookkeeping of one ``RolloutPool.generate`` while it runs.

It knows where every unfinished sample is (``loc``: ``(input index, sample index)`` -> actor),
starts actor calls (``launch`` for requests, ``stream`` for an actor that only continues samples
imported by migration), and turns the calls' events into results: each request's parts (one
per engine it ran on, each with the samples that finished there) are joined with
``migration.merge_outputs`` once all ``n`` samples are back; a sample arriving twice (after a
re-run) is dropped, so every input index is returned exactly once. When an actor dies, the
requests with a sample on it are placed again on the actors left (same seeds, so the same
samples; samples already back are kept).

Actor-side request ids are ``"<run>.<index>"`` (``"<run>.<index>.r<k>"`` for the k-th re-run),
unique across the pool's ``generate`` calls; the pool renames outputs afterwards.

``RetryingRun`` (what ``RolloutPool`` uses) adds per-request retry accounting: a request is
re-placed at most ``max_request_retries`` times, one re-placed request per live actor, and fails
alone after that (``pool.py``'s module docstring, Faults).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading

import ray
from ray.exceptions import RayActorError

from specengine.distributed.balance import assign, group_requests
from specengine.distributed.requests import PoolRequest
from specengine.engine.outputs import RequestOutput
from specengine.lifecycle.migration import merge_outputs


class GenerateRun:
    """State of one ``generate`` (the module docstring).

    Args:
        pool: the ``RolloutPool``.
        reqs: the call's requests (``requests.prepare``).
        results: the output list to fill, by input index.
        run_id: this call's number in the pool (for request ids).

    Attributes:
        rids: input index -> actor-side request id. index_of: request id -> input index.
        loc: unfinished sample -> actor. calls: running actor call -> actor.
        moved: ``(input index, sample index, source, destination, how)`` of every migration.
        events: the calls' ``(kind, call, payload)`` events.
    """

    def __init__(self, pool, reqs: list[PoolRequest], results: list, run_id: int):
        self.pool, self.results = pool, results
        self.reqs = {r.index: r for r in reqs}
        self.rids = {r.index: f"{run_id}.{r.index}" for r in reqs}
        self.index_of = {v: k for k, v in self.rids.items()}
        self.events: queue.Queue = queue.Queue()
        self.calls: dict[int, int] = {}
        self.loc: dict[tuple[int, int], int] = {}
        self.moved: list[tuple[int, int, int, int, str]] = []
        self.parts: dict[int, list[RequestOutput]] = {i: [] for i in self.reqs}
        self.got: dict[int, set[int]] = {i: set() for i in self.reqs}
        self._ids = itertools.count()
        self._reruns = itertools.count(1)
        self.reran = False  # requests were re-run (copies of their samples may still run)
        self._left = len(reqs)

    # ---- calls ------------------------------------------------------------------------------
    def launch(self, plan: dict[int, list[PoolRequest]], rerun: bool = False) -> None:
        """Start one ``rollout`` call per actor of ``plan`` (actor id -> requests)."""
        for actor_id, rs in plan.items():
            items = []
            for r in rs:
                rid = self.rids[r.index]
                if rerun:
                    self.reran = True
                    rid = f"{rid}.r{next(self._reruns)}"
                    self.index_of[rid] = r.index
                items.append((rid, r.prompt, r.params))
                for s in range(r.params.n):
                    if s not in self.got[r.index]:
                        self.loc[(r.index, s)] = actor_id
            self._start(actor_id, items)
            self.pool.controller.on_dispatch(self.pool, actor_id, [r.index for r in rs])

    def stream(self, actor_id: int) -> None:
        """Start an empty ``rollout`` on ``actor_id``: it adopts the samples imported there."""
        self._start(actor_id, [])

    def _start(self, actor_id: int, items: list) -> None:
        cid = next(self._ids)
        self.calls[cid] = actor_id
        threading.Thread(target=self._consume, args=(cid, actor_id, items, self.events),
                         daemon=True).start()

    def _consume(self, cid: int, actor_id: int, items: list, events: queue.Queue) -> None:
        """Thread body: stream one actor call's outputs into ``events``."""
        try:
            actor = self.pool.actors[actor_id]
            stream = actor.rollout.options(num_returns="streaming").remote(items)
            for ref in stream:
                events.put(("out", cid, ray.get(ref)))
            events.put(("done", cid, None))
        except RayActorError as e:
            events.put(("dead", cid, e))
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            events.put(("error", cid, e))

    def relocate(self, keys: list[tuple[str, int, str]], actor_id: int, src: int) -> None:
        """Samples ``(request id, sample index, how)`` moved from ``src`` now continue on
        ``actor_id``."""
        for rid, s, how in keys:
            i = self.index_of[rid]
            if (i, s) in self.loc:
                self.loc[(i, s)] = actor_id
                self.moved.append((i, s, src, actor_id, how))

    def abort(self) -> None:
        """Drop this call's requests on every live actor (after an error, or after re-runs
        left a second copy of some samples running)."""
        rids = list(self.index_of)
        refs = [self.pool.actors[a].abort_requests.remote(rids) for a in self.pool.alive]
        for ref in refs:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - best effort; the actor may be gone
                pass

    # ---- state ------------------------------------------------------------------------------
    def complete(self) -> bool:
        return self._left == 0

    def missing(self) -> list[int]:
        return [i for i, r in enumerate(self.results) if r is None]

    def busy(self) -> set[int]:
        """Actors with a call in flight."""
        return set(self.calls.values())

    def num_left(self, actor_id: int) -> int:
        """Requests with a sample unfinished on ``actor_id``."""
        return len({i for (i, _), a in self.loc.items() if a == actor_id})

    # ---- events -----------------------------------------------------------------------------
    def handle(self, kind: str, cid: int, payload) -> int:
        """Apply one event of call ``cid``; returns the call's actor.

        Raises:
            the call's error (``ValueError`` for a bad request, ...); RuntimeError: every actor
            has died.
        """
        actor_id = self.calls[cid]
        if kind == "out":
            self._output(actor_id, payload)
            return actor_id
        del self.calls[cid]
        if kind == "error":
            raise payload
        if kind == "dead":
            self.dead(actor_id, payload)
        return actor_id

    def _output(self, actor_id: int, out: RequestOutput) -> None:
        i = self.index_of.get(out.request_id)
        if i is None or self.results[i] is not None:
            return
        new = [c for c in out.outputs if c.index not in self.got[i]]
        if not new:
            return
        for c in new:
            self.got[i].add(c.index)
            self.loc.pop((i, c.index), None)
        self.parts[i].append(dataclasses.replace(out, request_id=self.rids[i], outputs=new))
        if len(self.got[i]) == self.reqs[i].params.n:
            parts = self.parts.pop(i)
            self.results[i] = parts[0] if len(parts) == 1 else merge_outputs(parts)
            self._left -= 1
            self.pool.work.observe(self.results[i])
        self.pool.controller.on_output(self.pool, actor_id, i, self.num_left(actor_id))

    def dead(self, actor_id: int, error: Exception) -> None:
        """Actor ``actor_id`` died: mark it, re-place the requests with samples on it."""
        pool = self.pool
        first = actor_id in pool.alive
        pool.mark_dead(actor_id, error)
        rerun = sorted({i for (i, _), a in self.loc.items() if a == actor_id})
        if not first and not rerun:
            return
        pool.num_requests_rerun += len(rerun)
        pool.controller.on_actor_dead(pool, actor_id, error, rerun)
        if rerun:
            pool.require_alive(len(rerun))
            load = {a: 0.0 for a in pool.alive}
            for (i, _), a in self.loc.items():
                if a in load and i not in rerun:
                    load[a] += pool.work.expected_output_len(self.reqs[i].params.max_tokens)
            self.launch(assign(group_requests([self.reqs[i] for i in rerun]), pool.alive,
                               pool.work, load), rerun=True)


class RetryingRun(GenerateRun):
    """``GenerateRun`` with per-request retry accounting (the module docstring, Faults).

    Attributes:
        retries: input index -> times re-placed after an actor holding it died.
        deaths: input index -> the actors that died holding it, with their errors.
        failed: input index -> why it failed (not re-placed again).
        retry_slot: live actor -> the re-placed request running there (at most one each).
        waiting: re-placed requests waiting for an actor with no re-placed request.
    """

    def __init__(self, pool, reqs: list[PoolRequest], results: list, run_id: int):
        super().__init__(pool, reqs, results, run_id)
        self.retries = {i: 0 for i in self.reqs}
        self.deaths: dict[int, list[str]] = {}
        self.failed: dict[int, str] = {}
        self.retry_slot: dict[int, int] = {}
        self.waiting: list[int] = []

    def handle(self, kind: str, cid: int, payload) -> int:
        actor_id = super().handle(kind, cid, payload)
        self.pump()
        return actor_id

    def _output(self, actor_id: int, out: RequestOutput) -> None:
        if self.index_of.get(out.request_id) in self.failed:
            return  # a sample of a failed request that ran on elsewhere (moved by migration)
        super()._output(actor_id, out)

    def dead(self, actor_id: int, error: Exception) -> None:
        """Actor ``actor_id`` died: mark it; fail the requests on it that were re-placed
        ``max_request_retries`` times already; queue the others for re-placement (``pump``).

        Raises:
            RuntimeError: requests are to be re-placed and no actor is left.
        """
        pool = self.pool
        first = actor_id in pool.alive
        pool.mark_dead(actor_id, error)
        self.retry_slot.pop(actor_id, None)
        hit = sorted({i for (i, _), a in self.loc.items() if a == actor_id} - set(self.failed))
        if not first and not hit:
            return
        why = f"actor {actor_id} ({pool.dead.get(actor_id, type(error).__name__)})"
        rerun = []
        for i in hit:
            self.deaths.setdefault(i, []).append(why)
            if self.retries[i] >= pool.max_request_retries:
                self._fail(i)
            else:
                rerun.append(i)
        pool.num_requests_rerun += len(rerun)
        pool.controller.on_actor_dead(pool, actor_id, error, rerun)
        if rerun:
            pool.require_alive(len(rerun))
            for key in [k for k, a in self.loc.items() if a == actor_id]:
                del self.loc[key]  # those samples run nowhere until re-placed
            self.waiting.extend(rerun)
            self.pump()

    def _fail(self, i: int) -> None:
        n, k = self.retries[i], len(self.deaths[i])
        self.failed[i] = (f"input index {i} was on {k} actor{'s' if k != 1 else ''} that "
                          f"died ({'; '.join(self.deaths[i])}) after {n} re-placement"
                          f"{'s' if n != 1 else ''}; not retried again")
        self._left -= 1
        self.parts.pop(i, None)
        for key in [k for k in self.loc if k[0] == i]:
            del self.loc[key]
        self.pool.num_requests_failed += 1

    def pump(self) -> None:
        """Free the retry slots whose request is no longer on their actor, then re-place
        waiting requests on live actors without one (least predicted work first, then the
        lowest actor id)."""
        for a, i in list(self.retry_slot.items()):
            if a not in self.pool.alive or not any(
                    k[0] == i and where == a for k, where in self.loc.items()):
                del self.retry_slot[a]
        while self.waiting:
            free = [a for a in self.pool.alive if a not in self.retry_slot]
            if not free:
                return
            i = self.waiting.pop(0)
            if i in self.failed or self.results[i] is not None:
                continue
            load = dict.fromkeys(free, 0.0)
            for (j, _), a in self.loc.items():
                if a in load:
                    load[a] += self.pool.work.expected_output_len(self.reqs[j].params.max_tokens)
            a = min(free, key=lambda a: (load[a], a))
            self.retries[i] += 1
            self.retry_slot[a] = i
            self.launch({a: [self.reqs[i]]}, rerun=True)
