"""Recording a rollout trace of an engine's steps (``LLM.start_trace`` / ``stop_trace``; the
trace itself: ``specengine.replay.trace``)."""

from __future__ import annotations

from specengine.replay.trace import RolloutTrace, TraceRecorder
from specengine.speculative.training.harvest import Harvester


def start_recording(engine, model_name: str) -> int:
    """Set a ``TraceRecorder`` on ``engine`` whose metadata names the model, dtype, device,
    drafter (the one that drafts: not a training ``Harvester`` around it), policy and batch
    limits. Returns the engine's preemption count now (``stop_recording`` takes it).

    Raises:
        RuntimeError: a trace is already being recorded.
    """
    if engine.trace is not None:
        raise RuntimeError("a rollout trace is already being recorded; stop_trace() first")
    drafter = engine.drafter
    if isinstance(drafter, Harvester):  # the training wrapper drafts nothing itself
        drafter = next(iter(drafter.wrapped()), None)
    cfg = engine.config
    meta = {"model": model_name, "dtype": str(engine.model.dtype).split(".")[-1],
            "device": str(engine.model.device),
            "drafter": drafter.name if drafter is not None else None,
            "policy": engine.policy.name if drafter is not None else None,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens}
    engine.trace = TraceRecorder(meta, meta["drafter"], engine.policy.decision_time)
    return engine.num_preemptions


def stop_recording(engine, preemptions_at_start: int) -> RolloutTrace:
    """Take ``engine``'s recorder off and finish its ``RolloutTrace`` (with the preemptions
    since ``start_recording``).

    Raises:
        RuntimeError: no trace is being recorded.
    """
    rec = engine.trace
    if rec is None:
        raise RuntimeError("no rollout trace is being recorded; call start_trace() first")
    engine.trace = None
    return rec.finish(engine.num_preemptions - preemptions_at_start)
