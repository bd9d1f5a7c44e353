"""Stopping requests and generation: ``abort_all``, ``abort_request`` (partial outputs) and
``pause`` (vLLM's ``pause_generation``, SGLang's pause modes). The functions take the
``Engine``, whose methods of the same names call them.
"""

from __future__ import annotations

import time

from specengine.engine.outputs import RequestOutput

PAUSE_MODES = ("abort", "keep", "retract")


def abort_all(engine) -> None:
    """Drop every unfinished request and return its KV blocks to the pool (and any finished
    request ``step`` has not returned yet); an isolation (``isolate``) ends with it."""
    engine.held = None  # an isolation cut short: its held groups are aborted with the rest
    for req in engine.requests.values():
        for s in req.seqs:
            if not s.is_finished:
                engine.finish_sample(s)
    engine.scheduler.waiting.clear()
    engine.requests.clear()
    engine.outputs_ready.clear()


def abort_request(engine, request_id: str) -> RequestOutput | None:
    """Stop one unfinished request (all its samples, running or waiting) and return its KV
    blocks to the pool; the other requests are untouched.

    Returns:
        What it made so far (SkyRL's partial rollouts): a finished ``RequestOutput`` whose
        unfinished samples have ``finish_reason="abort"`` and the tokens, logprobs and
        weight versions generated until now (samples that had finished keep theirs); None
        if ``request_id`` is unknown or already finished.
    """
    req = engine.requests.get(request_id)
    if req is None:
        return None
    for s in req.seqs:
        if not s.is_finished:
            s.finish_reason = "abort"
            engine.finish_sample(s)
            s.text = engine.output.decode(s)
    waiting = engine.scheduler.waiting
    kept = [g for g in waiting if g[0].request_id != request_id]
    waiting.clear()
    waiting.extend(kept)
    return engine.finish_request(req, now=time.perf_counter())


def pause(engine, mode: str = "keep") -> dict:
    """Stop generating until ``resume`` (vLLM's ``pause_generation``, SGLang's pause
    modes); ``step`` does nothing meanwhile and new requests wait.

    Args:
        mode: ``"abort"``: every unfinished request is aborted (``abort_request``: their
            partial outputs are returned). ``"keep"``: running samples keep their state
            and KV; weights may be updated meanwhile and decoding continues with the new
            version (its KV so far stays: PipelineRL's in-flight update). ``"retract"``:
            running samples release their KV and are re-prefilled from their tokens so far
            on resume (with the weights then in place: exact recompute, the forward being
            batch-invariant).

    Returns:
        ``{"mode", "requests" (unfinished before), "running" (samples), "retracted"
        (samples), "aborted" (list of partial ``RequestOutput``s)}``.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r}: use one of {PAUSE_MODES}")
    report = {"mode": mode, "requests": len(engine.requests),
              "running": len(engine.scheduler.running), "retracted": 0, "aborted": []}
    if mode == "abort":
        report["aborted"] = [o for rid in list(engine.requests)
                             if (o := engine.abort_request(rid)) is not None]
    elif mode == "retract":
        for seq in reversed(engine.scheduler.running):  # the first admitted ends up first
            engine.scheduler.preempt(seq)
            report["retracted"] += 1
    engine.paused = mode
    return report
