"""A failed engine step fails only the request that caused it (``FailedSteps``): the engine is
brought back to a consistent state (``StepRecovery.recover_from_failed_step``), then the
requests in flight run one at a time, each alone in its steps (``StepRecovery.isolate``), until
the one whose steps fail alone is found; it alone gets ``EngineStepError``."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from specengine.async_llm.messages import EngineStepError, Update
from specengine.engine.metrics import request_metrics
from specengine.engine.outputs import request_output

if TYPE_CHECKING:
    from specengine.async_llm.loop import AsyncEngine

logger = logging.getLogger("specengine.server")

PROBE_MAX_STEPS = 16  # steps one suspect runs alone at most when a failed step is isolated


class FailedSteps:
    """The failed-step handling of one engine loop.

    Args:
        loop: the ``AsyncEngine`` (its ``engine``, ``stats``, ``tracked`` requests,
            ``deliver`` and ``after_step``).
    """

    def __init__(self, loop: AsyncEngine):
        self.loop = loop
        self.unexplained = 0  # failed steps in a row that no request was found guilty of

    def recover(self, error: BaseException) -> None:
        """``Engine.step`` raised ``error``. Recover the engine (``recover_from_failed_step``),
        deliver what the failed step finished, then run the requests in flight one at a time
        (``_probe``, most recently added first) until one fails alone: it alone is failed
        (``EngineStepError``) and batching resumes. If none fails alone, batching resumes
        anyway; a second such failure in a row fails every request in flight (no request can
        be blamed, and the loop must make progress). If recovery itself fails, every request
        in flight fails and the engine is cleared (``Engine.abort_all``)."""
        self.loop.stats.step_failures += 1
        logger.error("engine step failed (%r); finding the request that caused it", error,
                     exc_info=error)
        try:
            suspects = self._recover_engine()
            culprit = None
            for rid in suspects:
                if rid not in self.loop.engine.requests:
                    continue  # failed meanwhile (its output could not be rebuilt)
                err = self._probe(rid)
                if err is not None:
                    culprit = rid
                    self.fail_culprit(rid, err)
                    break
        except Exception as e:  # noqa: BLE001 - the engine cannot be trusted: start clean
            logger.exception("recovering from a failed step failed; failing every request "
                             "in flight")
            self.fail_in_flight(RuntimeError(f"engine step failed: {error!r}; recovery "
                                              f"failed: {e!r}"))
            return
        if culprit is not None or not suspects:  # found, or nothing left in flight
            self.unexplained = 0
            return
        self.loop.stats.unexplained_step_failures += 1
        self.unexplained += 1
        if self.unexplained >= 2:
            logger.error("engine steps keep failing (%r) and no request fails alone; failing "
                         "every request in flight", error)
            self.unexplained = 0
            self.fail_in_flight(RuntimeError(f"engine step failed: {error!r}"))
        else:
            logger.warning("no request in flight fails alone after the failed step (%r); "
                           "resuming", error)

    def _recover_engine(self) -> list[str]:
        """``StepRecovery.recover_from_failed_step``, then deliver the outputs of requests the
        failed step finished: those the engine queued (``outputs_ready``) and those it had already
        dropped (rebuilt from the tracked ``Request``; one whose output cannot be built is
        failed alone). Returns the suspects, most recently added first."""
        suspects = self.loop.engine.recovery.recover_from_failed_step()
        ready = self.loop.engine.take_ready_outputs()
        done = {o.request_id for o in ready}
        now = time.perf_counter()
        for rid, t in list(self.loop.tracked.items()):
            if rid in self.loop.engine.requests or rid in done:
                continue
            try:  # the failed step turned it into an output that never came back
                if t.request is None or not all(s.is_finished for s in t.request.seqs):
                    raise RuntimeError("the request left the engine unfinished")
                ready.append(request_output(t.request, request_metrics(t.request, now),
                                            self.loop.engine.weight_version))
                logger.warning("request %s: output rebuilt after the failed step", rid)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self.fail_culprit(rid, e)
        self.loop.deliver(ready)
        return suspects

    def _probe(self, rid: str) -> BaseException | None:
        """Run request ``rid`` alone (``StepRecovery.isolate``) until it has run a step in which
        none of its samples was being admitted, after at least two steps (a prefill, then a
        decode with its draft tree), or it finished, or ``PROBE_MAX_STEPS`` steps; its
        updates are pushed as usual. Then ``StepRecovery.end_isolation``. Returns the exception of
        a step that failed (the engine recovered already), else None."""
        engine = self.loop.engine
        engine.recovery.isolate(rid)
        failed = None
        try:
            for n in range(1, PROBE_MAX_STEPS + 1):
                if rid not in engine.requests:
                    break  # finished
                admitting = engine.num_waiting() > 0  # only rid's samples are queued
                self.loop.stats.probe_steps += 1
                t0 = time.perf_counter()
                try:
                    finished = engine.step()
                except Exception as e:  # noqa: BLE001 - rid fails alone: the culprit
                    failed = e
                    break
                self.loop.after_step(finished, t0)
                if n >= 2 and not admitting:
                    break
            if failed is not None:
                self.loop.stats.step_failures += 1
                self._recover_engine()
        finally:
            engine.recovery.end_isolation()
        return failed

    def fail_culprit(self, rid: str, error: BaseException) -> None:
        """Fail request ``rid`` alone: out of the engine (``StepRecovery.fail_request``) and its
        handle gets an ``EngineStepError`` caused by ``error``."""
        known = self.loop.engine.recovery.fail_request(rid)
        t = self.loop.tracked.pop(rid, None)
        if not known and t is None:
            return  # failed already
        logger.error("request %s failed alone in an engine step; failing only it: %r", rid,
                     error, exc_info=error)
        self.loop.stats.requests_failed += 1
        self.loop.stats.requests_failed_in_step += 1
        if t is not None:
            err = EngineStepError(f"engine step failed on this request: {error!r}")
            err.__cause__ = error
            t.handle.push(Update(error=err))

    def fail_in_flight(self, error: BaseException) -> None:
        """Fail every tracked request with ``error`` and clear the engine (requests waiting
        for an exclusive call are not in flight and stay)."""
        try:
            self.loop.engine.abort_all()
        except Exception:  # noqa: BLE001 - nothing more can be done for them
            logger.exception("abort_all failed after a failed step")
        for t in list(self.loop.tracked.values()):
            self.loop.stats.requests_failed += 1
            t.handle.push(Update(error=error))
        self.loop.tracked.clear()
