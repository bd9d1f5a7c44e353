"""What the engine loop (``loop.AsyncEngine``) and its callers exchange: a request's handle
(``RequestHandle``), the updates pushed onto it (``Update`` of ``SampleDelta``s), the loop's
counters (``ServerStats``) and the errors a request can end with."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specengine.engine.outputs import RequestOutput
from specengine.engine.sequence import Logprob, Request, Sequence
from specengine.sampling.params import SamplingParams

if TYPE_CHECKING:
    from specengine.async_llm.loop import AsyncEngine


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
class Tracked:
    """A submitted request as the engine thread follows it: its handle, what it asked for,
    its samples and what of them was pushed already."""

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

    def push(self, update: Update) -> None:  # engine thread
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
            self._engine.request_abort(self.request_id)


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


def deltas(t: Tracked) -> list[SampleDelta]:
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
