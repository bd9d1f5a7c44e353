"""The engine loop (``AsyncEngine``): one thread owns the ``LLM``'s engine; the HTTP server
(``specengine.server``) and the integrations (verl) serve requests through it.

Handlers on the asyncio event loop ``submit`` requests to a thread-safe queue and iterate the
returned ``RequestHandle`` for results; the engine thread admits whatever has arrived before each
``Engine.step()``, so concurrent requests are continuously batched together in the same steps.
After each step it pushes, per request, the tokens new since the last step (streaming) or the
finished ``RequestOutput`` onto the handle's asyncio queue.

Other work on the engine goes through the same thread: ``call`` runs a function between two
steps (metrics), ``call_exclusive`` runs it once no request is in flight (weight updates,
prefix-cache reset): requests submitted after it wait until it has run, so no request ever
mixes two sets of weights. A step that raises fails only the request that caused it
(``failed_steps.FailedSteps``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from specengine.async_llm.failed_steps import FailedSteps
from specengine.async_llm.messages import (
    EngineDeadError,
    EngineNotReadyError,
    RequestAborted,
    RequestHandle,
    ServerStats,
    Tracked,
    Update,
    deltas,
)
from specengine.engine.outputs import RequestOutput
from specengine.sampling.params import SamplingParams

logger = logging.getLogger("specengine.server")


class AsyncEngine:
    """Runs ``llm.engine`` in a background thread and serves requests from the event loop.

    Args:
        llm: a ``specengine.LLM``; from ``start()`` on, only this object's thread may touch
            ``llm.engine`` (use ``call`` / ``call_exclusive`` for anything else).
    """

    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.engine
        self.stats = ServerStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self.tracked: dict[str, Tracked] = {}
        self._deferred: deque = deque()  # adds waiting for an exclusive call to run
        self._exclusive: deque = deque()  # (fn, future) waiting for the engine to drain
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.failed_steps = FailedSteps(self)  # a step that raised: find the request at fault

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specengine-engine",
                                            daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests still in flight fail with ``EngineDeadError``."""
        if self._thread is not None:
            self._put(("stop",))
            self._thread.join(timeout)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- event-loop side ------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None = None, stream: bool = False) -> RequestHandle:
        """Queue one prompt for generation; call from the event loop. Validation errors of
        ``Engine.add_request`` (a ``ValueError``) come back from the handle.

        Raises:
            EngineDeadError: the engine thread is not running.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        rid = f"srv-{next(self._ids)}"
        handle = RequestHandle(self, rid, stream, asyncio.get_running_loop())
        self._put(("add", Tracked(handle, list(prompt_token_ids), params, prompt)))
        return handle

    async def call(self, fn: Callable, *args, exclusive: bool = False):
        """Run ``fn(*args)`` on the engine thread and return its result (or raise its error):
        between two steps, or with ``exclusive=True`` once no request is in flight (requests
        submitted meanwhile wait for it)."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("exclusive" if exclusive else "call", fn, args, fut))
        return await asyncio.wrap_future(fut)

    async def abort_all(self) -> list[str]:
        """Abort every request submitted so far that has not finished (in flight, or waiting
        for an exclusive call); their handles raise ``RequestAborted``. Returns their ids."""
        return await self.call(self._abort_all)

    def request_abort(self, request_id: str) -> None:
        """Abort ``request_id`` from any thread (the engine thread applies it between steps;
        ``RequestHandle.abort`` calls this)."""
        self._put(("abort", request_id))

    def _put(self, cmd: tuple) -> None:
        self._commands.put(cmd)

    # ---- engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                idle = not self._busy() and not self._exclusive
                if not self._handle(self._commands.get() if idle else None):
                    return
                while True:  # everything that arrived meanwhile joins this step
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(cmd):
                        return
                if self._exclusive and (not self.engine.has_unfinished() or self.engine.paused):
                    self._run_exclusive()  # paused: weights may change under running samples
                if self._busy():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - keep callers from waiting forever
            logger.exception("engine loop crashed")
            self._fail_all(EngineDeadError(f"the engine loop crashed: {e!r}"))
        finally:
            self._fail_all(EngineDeadError("the server is shutting down"))

    def _busy(self) -> bool:
        """Whether a step has work: unfinished requests while not paused (``pause``), or
        finished outputs not returned yet."""
        eng = self.engine
        return bool(eng.outputs_ready) or (eng.has_unfinished() and not eng.paused)

    async def pause(self, mode: str) -> dict:
        """``Engine.pause(mode)`` between two steps: generation stops until ``resume``; with
        ``"abort"`` every request in flight finishes with its partial output
        (``finish_reason="abort"``); exclusive calls (weight updates) then run at once, with
        samples kept (``"keep"``) or retracted (``"retract"``). Returns the engine's report
        with ``aborted`` as a count. Raises ValueError for an unknown mode."""
        return await self.call(self._pause, mode)

    async def resume(self) -> None:
        """Generate again after ``pause``."""
        await self.call(self.engine.resume)

    def _pause(self, mode: str) -> dict:
        report = self.engine.pause(mode)
        for out in report["aborted"]:
            t = self.tracked.pop(out.request_id, None)
            if t is None:
                continue
            self.stats.requests_aborted += 1
            t.handle.push(Update(deltas=deltas(t) if t.handle.stream else [],
                                  output=out))
        return {**report, "aborted": len(report["aborted"])}

    def _handle(self, cmd: tuple | None) -> bool:
        """Apply one command; False means stop."""
        if cmd is None:
            return True
        kind = cmd[0]
        if kind == "stop":
            return False
        if kind == "add":
            if self._exclusive:
                self._deferred.append(cmd[1])
            else:
                self._add(cmd[1])
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "call":
            self._run_call(cmd[1], cmd[2], cmd[3])
        elif kind == "exclusive":
            self._exclusive.append(cmd[1:])
        return True

    @staticmethod
    def _run_call(fn, args, fut: concurrent.futures.Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)

    def _run_exclusive(self) -> None:
        while self._exclusive:
            self._run_call(*self._exclusive.popleft())
        while self._deferred:
            self._add(self._deferred.popleft())

    def _add(self, t: Tracked) -> None:
        rid = t.handle.request_id
        check = self.engine.ready_check
        try:
            if check is not None:
                check()
        except RuntimeError as e:  # asleep: a clear error of its own kind (the server: 503)
            self.stats.requests_failed += 1
            t.handle.push(Update(error=EngineNotReadyError(str(e))))
            return
        try:
            self.engine.add_request(t.prompt_token_ids, t.params, prompt=t.prompt, request_id=rid)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            self.stats.requests_failed += 1
            t.handle.push(Update(error=e))
            return
        t.request = self.engine.requests[rid]
        t.seqs = list(t.request.seqs)
        t.sent = [0] * len(t.seqs)
        t.ended = [False] * len(t.seqs)
        self.tracked[rid] = t

    def _abort(self, rid: str) -> None:
        t = self.tracked.pop(rid, None)
        if t is not None:
            self.engine.abort_request(rid)
        else:
            t = next((d for d in self._deferred if d.handle.request_id == rid), None)
            if t is not None:
                self._deferred.remove(t)
        if t is not None:
            self.stats.requests_aborted += 1
            t.handle.push(Update(error=RequestAborted(f"request {rid} was aborted")))

    def _abort_all(self) -> list[str]:
        rids = list(self.tracked) + [d.handle.request_id for d in self._deferred]
        for rid in rids:
            self._abort(rid)
        return rids

    def _step(self) -> None:
        # outputs queued before the step (detached samples) are taken now: a step that raises
        # would drop them
        self.deliver(self.engine.take_ready_outputs())
        t0 = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception as e:  # noqa: BLE001 - only the request that caused it fails
            error = e
        else:
            self.failed_steps.unexplained = 0
            self.after_step(finished, t0)
            return
        self.failed_steps.recover(error)  # (outside the except block: no chained tracebacks)

    def after_step(self, finished: list[RequestOutput], t0: float) -> None:
        """Count a step that returned ``finished`` (started at ``t0``) and push its updates."""
        st = self.stats
        st.step_time += time.perf_counter() - t0
        st.steps += 1
        # every sequence still running after the step was part of its batch
        st.max_batch_seqs = max(st.max_batch_seqs, self.engine.num_running()
                                + sum(len(o.outputs) for o in finished))
        self.deliver(finished)

    def deliver(self, finished: list[RequestOutput]) -> None:
        """Push to each tracked request its streaming deltas and, if it is among
        ``finished``, its output."""
        done = {o.request_id: o for o in finished}
        for rid, t in list(self.tracked.items()):
            out = done.get(rid)
            if out is None and not t.handle.stream:
                continue
            update = Update(deltas=deltas(t) if t.handle.stream else [], output=out)
            if out is not None:
                del self.tracked[rid]
                self.stats.requests_finished += 1
            if update.deltas or out is not None:
                t.handle.push(update)

    def _fail_all(self, error: BaseException) -> None:
        for t in list(self.tracked.values()) + list(self._deferred):
            self.stats.requests_failed += 1
            t.handle.push(Update(error=error))
        self.tracked.clear()
        self._deferred.clear()
        while self._exclusive:
            fn, args, fut = self._exclusive.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
        while True:  # anything still queued (after a stop)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                cmd[1].handle.push(Update(error=error))
            elif cmd[0] in ("call", "exclusive") and cmd[3].set_running_or_notify_cancel():
                cmd[3].set_exception(error)
