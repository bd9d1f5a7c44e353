"""A step that raised: bring the engine back to a consistent state
(``recover_from_failed_step``), run one request alone to find the one that makes steps fail
(``isolate`` / ``end_isolation``), and drop it (``fail_request``). The server's engine loop
drives them (``specengine.async_llm``) through the engine's ``recovery``
(``StepRecovery``).
"""

from __future__ import annotations

import logging
import time

from specengine.engine.output_processor import OutputProcessor
from specengine.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger("specengine.engine.engine")


class StepRecovery:
    """Recovery from a failed step and the isolation of one request, for one ``Engine``
    (its ``recovery`` attribute).

    Args:
        engine: the engine.
    """

    def __init__(self, engine):
        self.engine = engine

    def recover_from_failed_step(self) -> list[str]:
        """Bring the engine back to a consistent state after ``step`` raised, so that every
        unfinished request continues token for token (and logprob for logprob) as if the
        failed step had never run; returns the ids of the unfinished requests, the most
        recently added first (the likeliest culprits: ``isolate`` runs them one at a time).

        The step may have failed in any phase, leaving sequences scheduled with KV reserved,
        draft trees built, KV written past ``num_cached`` or tokens appended for some of them.
        None of that is undone; instead, every running sequence is preempted (its KV blocks
        freed, full blocks of committed tokens kept in the prefix cache, and queued first for
        recompute from the tokens it has: tokens appended by the failed step are genuine
        samples and stay), as are sequences the failed admission left neither running nor
        waiting. Their drafter state is dropped (``Drafter.discard``; rebuilt when they run
        again) and their penalty counts are rebuilt from their tokens. Exact because the
        engine is batch-invariant and recompute after preemption gives the same logits bit
        for bit (README, "Exactness"). A sample the failed step finished is released; a
        request whose samples have all finished is queued in ``outputs_ready`` (the next
        ``step`` returns it).

        Requests the failed step had already turned into outputs (and dropped from
        ``requests``) are not known here any more: the caller keeps their ``Request`` if it
        wants to rebuild them (``specengine.async_llm`` does).

        Raises:
            Whatever releasing a finished sample raises (the drafter or the policy): the
            engine is then not consistent; ``abort_all`` is the way out.
        """
        sched = self.engine.scheduler
        for req in list(self.engine.requests.values()):
            for s in req.seqs:
                if s.finish_reason is not None and not s.is_finished:
                    self.engine.finish_sample(s)  # finished in the failed step, but not released
                elif not s.is_finished:
                    trim_partial_append(s, self.engine.output)
        requeued = list(sched.running)
        for s in reversed(requeued):  # appendleft: the queue's head keeps admission order
            sched.preempt(s)
        queued = {id(s) for g in [*sched.waiting, *(self.engine.held or [])] for s in g}
        for req in self.engine.requests.values():  # left out by an admission that raised
            for s in req.seqs:
                if not s.is_finished and id(s) not in queued:
                    self.engine.blocks.free(s)
                    s.status = SequenceStatus.WAITING
                    sched.waiting.append([s])
                    requeued.append(s)
        for s in requeued:
            s.penalty_counts = None
            if self.engine.drafter is not None:
                self.engine.drafter.discard(s)
        now = time.perf_counter()
        for req in list(self.engine.requests.values()):
            if req.seqs and all(s.is_finished for s in req.seqs):
                self.engine.outputs_ready.append(self.engine.finish_request(req, now=now))
        suspects = [rid for rid, req in reversed(self.engine.requests.items())
                    if any(not s.is_finished for s in req.seqs)]
        logger.warning("a step failed: %d sequences requeued for recompute, %d requests in "
                       "flight", len(requeued), len(suspects))
        return suspects

    def isolate(self, request_id: str) -> None:
        """Hold every waiting group of the other requests out of the queue (in ``held``), so
        that the next steps run ``request_id`` alone (to find the request that makes steps
        fail, after ``recover_from_failed_step``, which leaves held groups held);
        ``end_isolation`` puts them back.

        Raises:
            ValueError: already isolating, or a sequence of another request is running
                (recover first).
        """
        sched = self.engine.scheduler
        if self.engine.held is not None:
            raise ValueError("already isolating a request: call end_isolation first")
        others = [s for s in sched.running if s.request_id != request_id]
        if others:
            raise ValueError(f"cannot isolate request {request_id!r}: {len(others)} sequences "
                             "of other requests are running")
        self.engine.held = [g for g in sched.waiting if g[0].request_id != request_id]
        kept = [g for g in sched.waiting if g[0].request_id == request_id]
        sched.waiting.clear()
        sched.waiting.extend(kept)

    def end_isolation(self) -> None:
        """End ``isolate``: the isolated request's running sequences are preempted (recomputed
        later from their tokens, exactly) and the held groups go back to the front of the
        queue, ahead of it; normal batching resumes with the next ``step``. No-op when not
        isolating."""
        if self.engine.held is None:
            return
        sched = self.engine.scheduler
        for s in reversed(list(sched.running)):
            sched.preempt(s)
        rest = list(sched.waiting)
        sched.waiting.clear()
        sched.waiting.extend(self.engine.held + rest)
        self.engine.held = None

    def fail_request(self, request_id: str) -> bool:
        """Drop the unfinished request ``request_id`` because running it failed: like
        ``abort_request`` (``finish_reason`` ``"abort"``, KV blocks back to the pool, out of
        the waiting queue), but a drafter or policy that raises while forgetting a sample is
        logged and passed over, so the pool always gets its blocks back. Returns False if the
        id is unknown."""
        req = self.engine.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.seqs:
            if s.is_finished:
                continue
            s.finish_reason = "abort"
            try:  # as Engine.finish_sample: the drafter first, while the blocks are held
                if self.engine.drafter is not None:
                    self.engine.drafter.release(s)
            except Exception:  # noqa: BLE001 - the request is gone either way
                logger.exception("drafter forgetting sample %s#%d of failed request",
                                 request_id, s.index)
            self.engine.scheduler.finish(s)
            try:
                self.engine.policy.finished(s)
            except Exception:  # noqa: BLE001 - the request is gone either way
                logger.exception("policy forgetting sample %s#%d of failed request",
                                 request_id, s.index)
        waiting = self.engine.scheduler.waiting
        kept = [g for g in waiting if g[0].request_id != request_id]
        waiting.clear()
        waiting.extend(kept)
        if self.engine.held is not None:
            self.engine.held = [g for g in self.engine.held if g[0].request_id != request_id]
        return True


def trim_partial_append(seq: Sequence, output: OutputProcessor) -> None:
    """Cut ``seq``'s output back to the tokens whose per-token records are all complete
    (a step that failed while appending one of its tokens): token ids, logprob entries,
    weight versions and hidden-state rows; the cut tokens are sampled again, identically.
    ``cumulative_logprob`` is summed again in append order (the same float additions)."""
    n = seq.num_output_tokens
    keep = min(n, len(seq.weight_versions))
    if seq.logprobs is not None:
        keep = min(keep, len(seq.logprobs))
    if seq.hidden_states is not None:
        keep = min(keep, sum(h.shape[0] for h in seq.hidden_states))
    if keep == n and len(seq.weight_versions) == n and (
            seq.logprobs is None or len(seq.logprobs) == n):
        return
    del seq.token_ids[seq.num_prompt_tokens + keep:]
    del seq.weight_versions[keep:]
    if seq.logprobs is not None:
        del seq.logprobs[keep:]
        total = 0.0
        for t, lp in zip(seq.output_token_ids, seq.logprobs):
            total += lp[t].logprob
        seq.cumulative_logprob = total
    if seq.params.stop_strings:
        seq.text = output.decode(seq)
    logger.warning("sample %s#%d: output cut from %d to %d tokens after a step failed "
                   "while appending", seq.request_id, seq.index, n, keep)
