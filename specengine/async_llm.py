"""The engine loop behind the HTTP server: one thread owns the ``LLM``'s engine.

HTTP handlers run on the asyncio event loop. They ``submit`` requests to a thread-safe queue
and iterate the returned ``RequestHandle`` for results; the engine thread admits whatever has
arrived before each ``Engine.step()``, so concurrent HTTP requests are continuously batched
together in the same steps. After each step it pushes, per request, the tokens new since the
last step (streaming) or the finished ``RequestOutput`` onto the handle's asyncio queue.

Other work on the engine goes through the same thread: ``call`` runs a function between two
steps (metrics), ``call_exclusive`` runs it once no request is in flight (weight updates,
prefix-cache reset): requests submitted after it wait until it has run, so no request ever
mixes two sets of weights.

A step that raises fails only the request that caused it (``_recover``): the engine is brought
back to a consistent state (``StepRecovery.recover_from_failed_step``, the engine's
``recovery``: every running sequence is requeued for an exact recompute), then the requests in
flight run one at a time, each alone in its steps with the others held in the queue
(``StepRecovery.isolate``), until the one whose steps
fail alone is found; it alone gets the error (``EngineStepError``, a 500), and batching
resumes. The engine is batch-invariant, so every other request's tokens and logprobs are the
ones a run without the bad request gives.
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
from dataclasses import dataclass, field

from specengine.engine.metrics import request_metrics
from specengine.engine.outputs import RequestOutput, request_output
from specengine.engine.sequence import Logprob, Request, Sequence
from specengine.sampling.params import SamplingParams

logger = logging.getLogger("specengine.server")


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (server shutdown); no request can be served."""


class RequestAborted(RuntimeError):
    """The request was aborted (client disconnect or server shutdown)."""


class EngineStepError(RuntimeError):
    """An engine step failed because of this request (it failed again when run alone); the
    other requests were not affected. An engine bug, not the client's fault (the server: 500).
    ``__cause__`` is the step's exception."""


class EngineNotReadyError(RuntimeError):
    """The engine cannot run requests now: it is asleep, or its weights were discarded by a
    level-2 sleep and not loaded since (the message says which and what to call)."""


@dataclass
class SampleDelta:
    """What one sample gained in one step.

    Attributes:
        index: sample index in ``0 .. n-1``.
        token_ids: token ids appended this step (a finishing EOS / stop token included).
        logprobs: their logprob entries (``{token_id: Logprob}`` each), or None without logprobs.
        finish_reason: ``"stop"`` / ``"length"`` once the sample finished, else None.
        stop_reason: the stop string or stop token id that ended it, if any.
        text: the sample's final text once it finished (stop strings cut), else None.
    """

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None


@dataclass
class Update:
    """One message from the engine thread to a request's handle: the samples' deltas of a step
    (streaming requests only), and ``output`` on the last one (the request finished), or
    ``error`` (the request failed or was aborted; nothing follows)."""

    deltas: list[SampleDelta] = field(default_factory=list)
    output: RequestOutput | None = None
    error: BaseException | None = None


@dataclass
class _Tracked:
    handle: RequestHandle
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    seqs: list[Sequence] = field(default_factory=list)
    request: Request | None = None  # the engine's Request (an output lost by a failed step)
    sent: list[int] = field(default_factory=list)  # output tokens already pushed, per sample
    ended: list[bool] = field(default_factory=list)  # its end already pushed, per sample


class RequestHandle:
    """The caller's end of one submitted request; ``async for update in handle`` yields
    ``Update``s until the one with ``output`` (or raises the request's error).

    Attributes:
        request_id: the engine's id of the request.
        stream: whether per-step deltas are pushed (else only the final update).
    """

    def __init__(self, engine: AsyncEngine, request_id: str, stream: bool,
                 loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.stream = stream
        self.finished = False
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[Update] = asyncio.Queue()

    def _push(self, update: Update) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self.finished:
            raise StopAsyncIteration
        update = await self._queue.get()
        if update.error is not None:
            self.finished = True
            raise update.error
        if update.output is not None:
            self.finished = True
        return update

    async def result(self) -> RequestOutput:
        """Wait for the finished ``RequestOutput`` (raises the request's error)."""
        async for update in self:
            if update.output is not None:
                return update.output
        raise RequestAborted(f"request {self.request_id} ended without output")

    def abort(self) -> None:
        """Abort the request if it has not finished (idempotent; frees its KV blocks)."""
        if not self.finished:
            self.finished = True
            self._engine._put(("abort", self.request_id))


@dataclass
class ServerStats:
    """Counters of the engine loop: steps it ran, the most sequences in one step's batch,
    requests finished / aborted / failed (refused at admission, or failed in a step), and
    seconds spent in ``Engine.step``. Failed steps: ``step_failures`` (``Engine.step``
    raised, isolation probes included), ``requests_failed_in_step`` (requests found to make
    steps fail alone and failed; also in ``requests_failed``), ``probe_steps`` (steps run with
    one request alone to find it) and ``unexplained_step_failures`` (failed steps no request
    was found guilty of)."""

    steps: int = 0
    max_batch_seqs: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    step_time: float = 0.0
    step_failures: int = 0
    requests_failed_in_step: int = 0
    probe_steps: int = 0
    unexplained_step_failures: int = 0


class AsyncEngine:
    """Runs ``llm.engine`` in a background thread and serves requests from the event loop.

    Args:
        llm: a ``specengine.LLM``; from ``start()`` on, only this object's thread may touch
            ``llm.engine`` (use ``call`` / ``call_exclusive`` for anything else).
    """

    PROBE_MAX_STEPS = 16  # steps one suspect runs alone at most when a failed step is isolated

    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.engine
        self.stats = ServerStats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._deferred: deque = deque()  # adds waiting for an exclusive call to run
        self._exclusive: deque = deque()  # (fn, future) waiting for the engine to drain
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._unexplained = 0  # failed steps in a row that no request was found guilty of

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
        self._put(("add", _Tracked(handle, list(prompt_token_ids), params, prompt)))
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
            t = self._tracked.pop(out.request_id, None)
            if t is None:
                continue
            self.stats.requests_aborted += 1
            t.handle._push(Update(deltas=self._deltas(t) if t.handle.stream else [],
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

    def _add(self, t: _Tracked) -> None:
        rid = t.handle.request_id
        check = self.engine.ready_check
        try:
            if check is not None:
                check()
        except RuntimeError as e:  # asleep: a clear error of its own kind (the server: 503)
            self.stats.requests_failed += 1
            t.handle._push(Update(error=EngineNotReadyError(str(e))))
            return
        try:
            self.engine.add_request(t.prompt_token_ids, t.params, prompt=t.prompt, request_id=rid)
        except Exception as e:  # noqa: BLE001 - this request fails alone
            self.stats.requests_failed += 1
            t.handle._push(Update(error=e))
            return
        t.request = self.engine.requests[rid]
        t.seqs = list(t.request.seqs)
        t.sent = [0] * len(t.seqs)
        t.ended = [False] * len(t.seqs)
        self._tracked[rid] = t

    def _abort(self, rid: str) -> None:
        t = self._tracked.pop(rid, None)
        if t is not None:
            self.engine.abort_request(rid)
        else:
            t = next((d for d in self._deferred if d.handle.request_id == rid), None)
            if t is not None:
                self._deferred.remove(t)
        if t is not None:
            self.stats.requests_aborted += 1
            t.handle._push(Update(error=RequestAborted(f"request {rid} was aborted")))

    def _abort_all(self) -> list[str]:
        rids = list(self._tracked) + [d.handle.request_id for d in self._deferred]
        for rid in rids:
            self._abort(rid)
        return rids

    def _step(self) -> None:
        # outputs queued before the step (detached samples) are taken now: a step that raises
        # would drop them
        self._deliver(self.engine.take_ready_outputs())
        t0 = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception as e:  # noqa: BLE001 - only the request that caused it fails
            error = e
        else:
            self._unexplained = 0
            self._after_step(finished, t0)
            return
        self._recover(error)  # (outside the except block: no chained tracebacks)

    def _after_step(self, finished: list[RequestOutput], t0: float) -> None:
        """Count a step that returned ``finished`` (started at ``t0``) and push its updates."""
        st = self.stats
        st.step_time += time.perf_counter() - t0
        st.steps += 1
        # every sequence still running after the step was part of its batch
        st.max_batch_seqs = max(st.max_batch_seqs, self.engine.num_running()
                                + sum(len(o.outputs) for o in finished))
        self._deliver(finished)

    def _deliver(self, finished: list[RequestOutput]) -> None:
        """Push to each tracked request its streaming deltas and, if it is among
        ``finished``, its output."""
        done = {o.request_id: o for o in finished}
        for rid, t in list(self._tracked.items()):
            out = done.get(rid)
            if out is None and not t.handle.stream:
                continue
            update = Update(deltas=self._deltas(t) if t.handle.stream else [], output=out)
            if out is not None:
                del self._tracked[rid]
                self.stats.requests_finished += 1
            if update.deltas or out is not None:
                t.handle._push(update)

    # ---- a failed step: fail only the request that caused it ------------------------------
    def _recover(self, error: BaseException) -> None:
        """``Engine.step`` raised ``error``. Recover the engine (``recover_from_failed_step``),
        deliver what the failed step finished, then run the requests in flight one at a time
        (``_probe``, most recently added first) until one fails alone: it alone is failed
        (``EngineStepError``) and batching resumes. If none fails alone, batching resumes
        anyway; a second such failure in a row fails every request in flight (no request can
        be blamed, and the loop must make progress). If recovery itself fails, every request
        in flight fails and the engine is cleared (``Engine.abort_all``)."""
        self.stats.step_failures += 1
        logger.error("engine step failed (%r); finding the request that caused it", error,
                     exc_info=error)
        try:
            suspects = self._recover_engine()
            culprit = None
            for rid in suspects:
                if rid not in self.engine.requests:
                    continue  # failed meanwhile (its output could not be rebuilt)
                err = self._probe(rid)
                if err is not None:
                    culprit = rid
                    self._fail_culprit(rid, err)
                    break
        except Exception as e:  # noqa: BLE001 - the engine cannot be trusted: start clean
            logger.exception("recovering from a failed step failed; failing every request "
                             "in flight")
            self._fail_in_flight(RuntimeError(f"engine step failed: {error!r}; recovery "
                                              f"failed: {e!r}"))
            return
        if culprit is not None or not suspects:  # found, or nothing left in flight
            self._unexplained = 0
            return
        self.stats.unexplained_step_failures += 1
        self._unexplained += 1
        if self._unexplained >= 2:
            logger.error("engine steps keep failing (%r) and no request fails alone; failing "
                         "every request in flight", error)
            self._unexplained = 0
            self._fail_in_flight(RuntimeError(f"engine step failed: {error!r}"))
        else:
            logger.warning("no request in flight fails alone after the failed step (%r); "
                           "resuming", error)

    def _recover_engine(self) -> list[str]:
        """``StepRecovery.recover_from_failed_step``, then deliver the outputs of requests the
        failed step finished: those the engine queued (``outputs_ready``) and those it had already
        dropped (rebuilt from the tracked ``Request``; one whose output cannot be built is
        failed alone). Returns the suspects, most recently added first."""
        suspects = self.engine.recovery.recover_from_failed_step()
        ready = self.engine.take_ready_outputs()
        done = {o.request_id for o in ready}
        now = time.perf_counter()
        for rid, t in list(self._tracked.items()):
            if rid in self.engine.requests or rid in done:
                continue
            try:  # the failed step turned it into an output that never came back
                if t.request is None or not all(s.is_finished for s in t.request.seqs):
                    raise RuntimeError("the request left the engine unfinished")
                ready.append(request_output(t.request, request_metrics(t.request, now),
                                            self.engine.weight_version))
                logger.warning("request %s: output rebuilt after the failed step", rid)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self._fail_culprit(rid, e)
        self._deliver(ready)
        return suspects

    def _probe(self, rid: str) -> BaseException | None:
        """Run request ``rid`` alone (``StepRecovery.isolate``) until it has run a step in which
        none of its samples was being admitted, after at least two steps (a prefill, then a
        decode with its draft tree), or it finished, or ``PROBE_MAX_STEPS`` steps; its
        updates are pushed as usual. Then ``StepRecovery.end_isolation``. Returns the exception of
        a step that failed (the engine recovered already), else None."""
        engine = self.engine
        engine.recovery.isolate(rid)
        failed = None
        try:
            for n in range(1, self.PROBE_MAX_STEPS + 1):
                if rid not in engine.requests:
                    break  # finished
                admitting = engine.num_waiting() > 0  # only rid's samples are queued
                self.stats.probe_steps += 1
                t0 = time.perf_counter()
                try:
                    finished = engine.step()
                except Exception as e:  # noqa: BLE001 - rid fails alone: the culprit
                    failed = e
                    break
                self._after_step(finished, t0)
                if n >= 2 and not admitting:
                    break
            if failed is not None:
                self.stats.step_failures += 1
                self._recover_engine()
        finally:
            engine.recovery.end_isolation()
        return failed

    def _fail_culprit(self, rid: str, error: BaseException) -> None:
        """Fail request ``rid`` alone: out of the engine (``StepRecovery.fail_request``) and its
        handle gets an ``EngineStepError`` caused by ``error``."""
        known = self.engine.recovery.fail_request(rid)
        t = self._tracked.pop(rid, None)
        if not known and t is None:
            return  # failed already
        logger.error("request %s failed alone in an engine step; failing only it: %r", rid,
                     error, exc_info=error)
        self.stats.requests_failed += 1
        self.stats.requests_failed_in_step += 1
        if t is not None:
            err = EngineStepError(f"engine step failed on this request: {error!r}")
            err.__cause__ = error
            t.handle._push(Update(error=err))

    def _fail_in_flight(self, error: BaseException) -> None:
        """Fail every tracked request with ``error`` and clear the engine (requests waiting
        for an exclusive call are not in flight and stay)."""
        try:
            self.engine.abort_all()
        except Exception:  # noqa: BLE001 - nothing more can be done for them
            logger.exception("abort_all failed after a failed step")
        for t in list(self._tracked.values()):
            self.stats.requests_failed += 1
            t.handle._push(Update(error=error))
        self._tracked.clear()

    @staticmethod
    def _deltas(t: _Tracked) -> list[SampleDelta]:
        """Tokens each sample of ``t`` gained since the last push (and its end, if it ended)."""
        out = []
        base = len(t.prompt_token_ids)
        for i, s in enumerate(t.seqs):
            if t.ended[i]:
                continue
            n = len(s.token_ids) - base
            if n == t.sent[i] and not s.is_finished:
                continue
            lps = s.logprobs[t.sent[i]:n] if s.logprobs is not None else None
            d = SampleDelta(i, s.token_ids[base + t.sent[i]:], lps)
            if s.is_finished:
                d.finish_reason, d.stop_reason, d.text = s.finish_reason, s.stop_reason, s.text
                t.ended[i] = True
            t.sent[i] = n
            out.append(d)
        return out

    def _fail_all(self, error: BaseException) -> None:
        for t in list(self._tracked.values()) + list(self._deferred):
            self.stats.requests_failed += 1
            t.handle._push(Update(error=error))
        self._tracked.clear()
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
                cmd[1].handle._push(Update(error=error))
            elif cmd[0] in ("call", "exclusive") and cmd[3].set_running_or_notify_cancel():
                cmd[3].set_exception(error)
