"""Samples leaving and joining an engine (``specengine.lifecycle.migration`` moves them between
engines): their K/V and target features read out of the pool, written into fresh blocks, and
the sample taken out of (``detach``) or put into (``attach``) the engine's requests.

``SampleTransfer`` is the engine's ``transfer`` attribute.
"""

from __future__ import annotations

import time

import torch

from specengine.engine.sequence import Request, Sequence, SequenceStatus
from specengine.kv.block_manager import cdiv


class SampleTransfer:
    """Samples leaving and joining one ``Engine`` (its ``transfer`` attribute): what
    ``specengine.lifecycle.migration`` uses to move them between engines.

    Args:
        engine: the engine.
    """

    def __init__(self, engine):
        self.engine = engine

    def keeps_features(self) -> bool:
        """Whether the engine keeps target features of committed positions (a feature-reading
        drafter such as EAGLE, or features tracked in the KV blocks)."""
        eng = self.engine
        return eng.blocks.features is not None or (eng.drafter is not None
                                                   and eng.drafter.wants_hidden)

    def kv_bytes_per_token(self) -> int:
        """Bytes one position's K/V takes over every layer, plus its target features when the
        engine keeps them (``keeps_features``)."""
        eng = self.engine
        c = eng.runner.kv_cache
        per = c.shape[0] * 2 * c.shape[4] * c.shape[5] * c.element_size()
        if self.keeps_features():
            per += eng.runner.model.config.hidden_size * c.element_size()
        return per

    def export_kv(self, seq: Sequence, start: int, end: int
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A copy of the K/V and target features of ``seq``'s committed positions
        ``start .. end-1`` (``end <= seq.num_cached``).

        Returns:
            ``(kv, features)``: ``kv`` ``[layers, 2, end-start, kv_heads, head_dim]`` in the
            engine's dtype on the CPU; ``features`` ``[end-start, hidden_size]`` on the CPU, from
            the KV blocks' feature store or the drafter (``Drafter.features``), or None when the
            engine keeps none for those positions (an empty ``[0, hidden_size]`` for an empty span
            of an engine that keeps features).
        """
        eng = self.engine
        slots = eng.blocks.slots(seq, start, end)
        feats = None
        bf = eng.blocks.features
        if bf is not None and (not slots or bool(bf.valid[slots].all())):
            feats = bf.read(slots).cpu() if slots else None
        if feats is None and eng.drafter is not None:
            have = eng.drafter.features(seq)
            if have is not None and have.shape[0] >= end:
                feats = have[start:end].clone().cpu()
        if feats is None and not slots and self.keeps_features():
            h = eng.runner.model.config.hidden_size
            feats = torch.empty(0, h, dtype=eng.runner.dtype)
        return eng.runner.read_kv(slots), feats

    def import_kv(self, seq: Sequence, num_cached: int,
                  pieces: list[tuple[int, int, torch.Tensor]], features: torch.Tensor | None,
                  what: str) -> None:
        """Give the new sample ``seq`` (not in the engine yet) fresh KV blocks for its first
        ``num_cached`` positions and write into them ``pieces``, ``(start, end, kv)`` each with
        ``kv`` ``[layers, 2, end-start, kv_heads, head_dim]`` (any device; in the engine's
        dtype), and ``features`` ``[num_cached, hidden_size]`` where the engine keeps them.
        ``attach`` then puts it in the running set.

        Raises:
            RuntimeError: too few free KV blocks, or ``max_num_seqs`` samples running already
                (nothing changed). ValueError: K/V whose dtype or shape does not fit this cache.
        """
        eng = self.engine
        blocks, runner, cfg = eng.blocks, eng.runner, eng.config
        need = cdiv(num_cached, blocks.block_size)
        if need > blocks.num_free:
            raise RuntimeError(f"{what}: {need} KV blocks needed, {blocks.num_free} free")
        if len(eng.scheduler.running) >= cfg.max_num_seqs:
            raise RuntimeError(f"{what}: max_num_seqs={cfg.max_num_seqs} samples are "
                               "running already")
        c = runner.kv_cache
        kv0 = pieces[0][2]
        if kv0.dtype != c.dtype or tuple(kv0.shape[:2]) + tuple(kv0.shape[3:]) != \
                (c.shape[0], 2, *c.shape[4:]):
            raise ValueError(f"{what}: K/V of shape {tuple(kv0.shape)} {kv0.dtype} does not fit "
                             f"this cache ({c.shape[0]} layers, {tuple(c.shape[4:])}, {c.dtype})")
        if eng.drafter is not None and eng.drafter.wants_hidden:  # as Engine.step's scheduling
            blocks.track_features(runner.model.config.hidden_size, runner.dtype, runner.device)
        blocks.grow(seq, num_cached)
        for start, end, kv in pieces:
            slots = blocks.slots(seq, start, end)
            if slots:
                runner.write_kv(slots, kv)
        if features is not None and blocks.features is not None and num_cached:
            blocks.features.write(blocks.slots(seq, 0, num_cached), features)
        seq.num_cached = num_cached

    def unfinished_samples(self) -> list[Sequence]:
        """Every unfinished sample: the running ones in admission order, then the waiting ones in
        queue order."""
        eng = self.engine
        sched = eng.scheduler
        return list(sched.running) + [s for g in sched.waiting for s in g]

    def find_sample(self, request_id: str, index: int) -> Sequence:
        """The unfinished sample ``index`` of request ``request_id``.

        Raises:
            ValueError: the engine has no such unfinished sample.
        """
        eng = self.engine
        req = eng.requests.get(request_id)
        seq = next((s for s in req.seqs if s.index == index), None) if req else None
        if seq is None or seq.is_finished:
            raise ValueError(f"request {request_id!r} has no unfinished sample {index} here")
        return seq

    def detach(self, seq: Sequence) -> None:
        """Take the unfinished sample ``seq`` out of this engine (it continues on another):
        it leaves the running set or the waiting queue, its KV blocks go back to the pool (full
        blocks stay in the prefix cache), its drafter state is dropped (``Drafter.discard``),
        the policy is told (``Policy.finished``; ``finish_reason`` stays None) and it leaves
        its request. A request left without samples is forgotten; one whose other samples have all
        finished is queued in ``outputs_ready`` (the next ``step`` returns it).

        Raises:
            ValueError: ``seq`` is finished or not one of this engine's samples.
        """
        eng = self.engine
        req = eng.requests.get(seq.request_id)
        if req is None or not any(s is seq for s in req.seqs) or seq.is_finished:
            raise ValueError(f"sample {seq.request_id}#{seq.index} is not an unfinished "
                             "sample of this engine")
        waiting = eng.scheduler.waiting
        kept = [[s for s in g if s is not seq] for g in waiting]
        waiting.clear()
        waiting.extend(g for g in kept if g)
        eng.scheduler.finish(seq)
        if eng.drafter is not None:
            eng.drafter.discard(seq)
        eng.policy.finished(seq)  # no finish_reason: no output length is learnt from it
        req.seqs = [s for s in req.seqs if s is not seq]
        if not req.seqs:
            del eng.requests[req.request_id]
        elif all(s.is_finished for s in req.seqs):
            eng.outputs_ready.append(eng.finish_request(req, now=time.perf_counter()))

    def attach(self, seq: Sequence, req: Request, features: torch.Tensor | None = None) -> None:
        """Add the sample ``seq`` that arrived from another engine to request ``req`` (this
        engine's request of that id, or a new ``Request`` holding only arriving samples, made
        known here). A ``seq`` with ``num_cached`` > 0 holds its KV blocks already (written by
        ``import_kv``) and joins the running set: the next step decodes it; else it is queued
        for a prefill of all its tokens (as a preempted sample is). ``features``
        ``[num_cached, hidden_size]``: the target features of its cached positions, handed to
        a drafter that reads them (``Drafter.observe``).

        Raises:
            ValueError: ``req`` already has a sample of ``seq.index``, or another request of
                this engine has ``req``'s id.
        """
        eng = self.engine
        known = eng.requests.get(req.request_id)
        if known is not None and known is not req:
            raise ValueError(f"request_id {req.request_id!r} is in use by another request")
        if any(s.index == seq.index for s in req.seqs):
            raise ValueError(f"request {req.request_id!r} already has sample {seq.index}")
        eng.requests[req.request_id] = req
        req.seqs = sorted([*req.seqs, seq], key=lambda s: s.index)
        if seq.num_cached > 0:
            seq.status = SequenceStatus.RUNNING
            eng.scheduler.running.append(seq)
        else:
            seq.status = SequenceStatus.WAITING
            eng.scheduler.add([seq])
        if features is not None and eng.drafter is not None and eng.drafter.wants_hidden:
            eng.drafter.observe(seq, 0, features.to(eng.runner.device))
