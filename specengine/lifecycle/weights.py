"""Weight updates of a running engine, the way RL trainers push them.

A trainer sends Hugging Face-named tensors, either all at once (``update`` : SGLang's
``update_weights_from_tensor``, TRL's colocated push) or streamed in chunks: one tensor
(OpenRLHF, TRL's server) or a bucket (verl, slime). ``WeightUpdater`` stages the chunks of a
session and applies them together at ``finish``, so the engine never serves a half-updated
model, and rebuilds the kernels' packed copies once:

    begin()  ->  load(chunk) ... load(chunk)  ->  finish()      (or abort(): nothing applied)

Every entry is checked when its chunk arrives: the name (fused ``qkv_proj`` / ``gate_up_proj``
names are split into q/k/v and gate/up), the shape, a floating-point dtype (any: cast to the
engine's dtype) and finite values (a NaN or inf weight is refused, naming the tensor: it would
make the model emit token 0 forever). A bad chunk raises and aborts the session: nothing of it
(nor of earlier chunks) is applied and the old weights keep serving. ``finish`` also invalidates
the prefix cache (``Engine.weights_changed``: reset, or re-keyed by version with
``prefix_cache_policy="keep_versioned"``) and increments the weight version that
``RequestOutput.weight_version`` reports. While generation is paused
(``LLM.pause_generation``), updates are applied with requests in flight.

Applying is all or nothing too: the tensors about to be overwritten are copied aside first, and
if the copy or the repacking of the kernels' packed copies fails (out of memory, an error in a
kernel), they are copied back, so the old weights keep serving, the version does not change,
and ``WeightUpdateFailed`` (a RuntimeError) says so (the original error is its ``__cause__``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from specengine.lifecycle.weight_checks import WeightChecker, one_torch_thread
from specengine.models.loader import iter_safetensors, safetensors_files

ABORTED = ("the weight update session was aborted: nothing of it was applied and the old "
           "weights keep serving")

logger = logging.getLogger("specengine.lifecycle.weights")


class WeightUpdateFailed(RuntimeError):
    """Applying a checked weight update failed (the copy or the repack: out of memory, a
    kernel error); the old weights were restored and keep serving, the version is unchanged.
    ``__cause__`` is the original error. (The server answers 500 ``weight_update_failed``.)"""


class WeightUpdater:
    """One-call and streamed weight updates of ``engine``'s target model.

    Args:
        engine: the ``Engine`` (its ``model`` is a ``LlamaForCausalLM``); it gets
            ``weight_version`` (int) and ``reset_prefix_cache()`` calls.
        memory: a ``memory.MemoryManager`` or None; before applying, asleep weights are made
            resident (``ensure_weights_resident``), after it the names loaded are reported
            (``mark_loaded``), so a level-2 sleep knows when every tensor is back.

    Not thread-safe: call between engine steps (``finish`` and ``update`` refuse while
    requests are in flight; ``begin``/``load``/``abort`` may run between the steps of a
    generation, the old weights keep serving until ``finish``).
    """

    def __init__(self, engine, memory=None):
        self.engine = engine
        self.memory = memory
        self.model = engine.model
        self.checker = WeightChecker(self.model)
        engine.weight_version = 0
        self._staged: dict[str, torch.Tensor] | None = None  # None: no session open
        self._aborted: str | None = None  # why the last session was aborted
        self.updates = 0
        self.update_time = 0.0  # seconds spent in finish / update, all calls
        self.last_update_time = 0.0
        # (weight version, spec_steps, accepted_tokens) when each version came in
        self._marks: list[tuple[int, int, int]] = [(0, 0, 0)]

    @property
    def version(self) -> int:
        """Weight version: 0 for the weights loaded at start, +1 per applied update."""
        return self.engine.weight_version

    @property
    def in_session(self) -> bool:
        return self._staged is not None

    # ---- sessions ---------------------------------------------------------------------------
    def begin(self) -> None:
        """Open a session. Raises RuntimeError if one is open already."""
        if self._staged is not None:
            raise RuntimeError("a weight update session is already open: finish or abort "
                               "it first")
        self._staged, self._aborted = {}, None

    def load(self, chunk, _mode: str = "copy") -> list[str]:
        """Check and stage one chunk into the open session: a ``(name, tensor)`` pair, a dict
        (a bucket) or an iterable of pairs. Tensors are copied (cast to the engine's dtype), so
        the caller may reuse its buffers at once. A name given twice in a session: the last
        value counts.

        Returns:
            the names staged from this chunk (fused names split into their parts; skipped
            names, ``rotary_emb.inv_freq`` and a tied ``lm_head.weight``, left out).

        Raises:
            RuntimeError: no session is open (``begin`` first).
            ValueError: an unknown name, a shape that differs, NaN/inf values (the message
                names the tensor); TypeError: not a tensor, not a floating-point dtype, not a
                chunk. On any of these the session is aborted: nothing is applied.
        """
        if self._staged is None:
            why = f" (the last one was aborted: {self._aborted})" if self._aborted else ""
            raise RuntimeError(f"no weight update session is open{why}; call "
                               "begin_weight_update() first, or update_weights() for a "
                               "one-call update")
        try:
            entries = self.checker.check(chunk, _mode)
        except (ValueError, TypeError) as e:
            self._staged, self._aborted = None, str(e)
            raise type(e)(f"{e}; {ABORTED}") from e
        self._staged.update(entries)
        return [n for n, _ in entries]

    def load_checkpoint(self, path: str | os.PathLike) -> list[str]:
        """Stage every tensor of a checkpoint (a HF directory of safetensors files, sharded
        or not, or one ``.safetensors`` file; HF names) into the open session; with no session
        open, apply it as one update. Returns the names staged / applied.

        Raises:
            FileNotFoundError: no such path, or a directory without safetensors files.
            ValueError: a corrupt file, or a tensor refused as in ``load`` (the session, or the
                one-call update, is aborted: nothing applied).
        """
        p = Path(path).expanduser()
        if p.is_dir():
            files = safetensors_files(p)
        elif p.is_file() and p.suffix == ".safetensors":
            files = [p]
        elif p.exists():
            raise ValueError(f"load_weights: {p} is neither a directory nor a .safetensors file")
        else:
            raise FileNotFoundError(f"load_weights: no such checkpoint: {p}")
        if self._staged is not None:
            return self.load(iter_safetensors(files), "cast")
        self.begin()
        self.load(iter_safetensors(files), "cast")
        return self.finish()

    def abort(self) -> bool:
        """Drop the open session's staged tensors; the old weights keep serving. Returns
        whether a session was open."""
        was_open = self._staged is not None
        self._staged, self._aborted = None, "abort_weight_update() was called" if was_open \
            else self._aborted
        return was_open

    def finish(self, weight_version: int | None = None) -> list[str]:
        """Apply the session's staged tensors at once: copy them into the parameters (in
        place: tensors shared with an EAGLE drafter follow), rebuild the kernels' packed copies
        once, reset the prefix cache, and set the weight version (``weight_version``, or the
        current one + 1). An empty session still counts as an update.

        Returns:
            the names applied (in first-staged order).

        Raises:
            RuntimeError: no session is open, or requests are in flight (the session stays
                open then: finish it after they are done, or abort it).
            ValueError: ``weight_version`` not an int >= 0 (the session stays open).
        """
        if self._staged is None:
            why = f" (the last one was aborted: {self._aborted})" if self._aborted else ""
            raise RuntimeError(f"no weight update session is open{why}")
        if weight_version is not None and (not isinstance(weight_version, int)
                                           or isinstance(weight_version, bool)
                                           or weight_version < 0):
            raise ValueError(f"weight_version must be an int >= 0, got {weight_version!r}")
        if self.engine.has_unfinished() and not self.engine.paused:
            raise RuntimeError("finish_weight_update: requests are in flight; finish or abort "
                               "them, or pause generation (LLM.pause_generation), first (the "
                               "session stays open)")
        staged, self._staged = self._staged, None
        return self._apply(staged, weight_version, time.perf_counter())

    def update(self, weights) -> list[str]:
        """``begin`` + ``load(weights)`` + ``finish`` in one call: all entries are checked
        before any is applied. The tensors are not copied first (they are cast while being
        applied), so they must stay unchanged until this returns (true for a dict, a list,
        ``named_parameters()``, or a generator yielding distinct tensors).

        Raises:
            RuntimeError: a session is open, or requests are in flight.
            ValueError, TypeError: as ``load``; nothing is changed then.
        """
        if self._staged is not None:
            raise RuntimeError("update_weights: a weight update session is open; finish or "
                               "abort it first")
        if self.engine.has_unfinished() and not self.engine.paused:
            raise RuntimeError("update_weights: requests are in flight; finish or abort them, "
                               "or pause generation (LLM.pause_generation), first")
        t0 = time.perf_counter()
        return self._apply(dict(self.checker.check(weights, "defer")), None, t0)

    @staticmethod
    def _backup(dests: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
        """Copies of the tensors ``names`` of ``dests`` (what an update overwrites): on their
        device, or in host memory when the device has no room for them."""
        out = {}
        for n in names:
            t = dests[n]
            try:
                out[n] = t.detach().clone()
            except torch.OutOfMemoryError:
                out[n] = t.detach().to("cpu", copy=True)
        return out

    def _restore(self, dests: dict[str, torch.Tensor], backup: dict[str, torch.Tensor]) -> None:
        """Copy ``backup`` back into the parameters and repack them (a packed copy that fails
        to rebuild now is rebuilt on its next use: each is checked against its weight)."""
        for n, old in backup.items():
            dests[n].copy_(old)
        try:
            self.model.prepack()
        except Exception:  # noqa: BLE001 - rebuilt on use; the weights themselves are back
            logger.exception("repacking the restored weights failed; packed copies are "
                             "rebuilt on use")

    @torch.no_grad()
    def _apply(self, staged: dict[str, torch.Tensor], version: int | None,
               t0: float) -> list[str]:
        """Copy ``staged`` into the parameters, repack, bump the version (``t0``: when the
        update started, for ``update_time``). All or nothing: the tensors it overwrites are
        copied aside first (transiently, an extra copy of them: on their device, or in host
        memory when the device is full) and copied back if the copy or the repack fails.

        Raises:
            WeightUpdateFailed: the copy or the repack failed; the old weights were restored
                (the original error is its ``__cause__``; a KeyboardInterrupt is re-raised as
                is).
        """
        if self.memory is not None:
            self.memory.ensure_weights_resident()
        with one_torch_thread():
            dests = self.model.hf_parameters()
            backup = self._backup(dests, staged)
            try:
                for name, tensor in staged.items():
                    dests[name].copy_(tensor)
                self.model.prepack()
            except BaseException as e:
                self._restore(dests, backup)
                if not isinstance(e, Exception):
                    raise
                raise WeightUpdateFailed(f"applying the weight update failed ({e!r}); the "
                                         "old weights were restored and keep serving") from e
            del backup
        names = list(staged)
        if self.memory is not None:
            self.memory.mark_loaded(names)
        m = self.engine.metrics
        # the engine tells its drafter (Drafter.set_weight_version: the suffix drafter ages its
        # rollout history by it) and resets or re-keys its prefix cache (prefix_cache_policy)
        self.engine.weights_changed(self.version + 1 if version is None else version)
        self._marks.append((self.version, m.spec_steps, m.accepted_tokens))
        self.last_update_time = time.perf_counter() - t0
        self.update_time += self.last_update_time
        self.updates += 1
        return names

    # ---- metrics ----------------------------------------------------------------------------
    def tau_per_weight_version(self) -> dict[int, float]:
        """Weight version -> tau (tokens committed per verify step, the bonus token included)
        over the speculative steps run while that version served; versions without any left
        out. Counts come from the engine's ``spec_steps`` / ``accepted_tokens``."""
        m = self.engine.metrics
        ends = [(s, a) for _, s, a in self._marks[1:]] + [(m.spec_steps, m.accepted_tokens)]
        totals: dict[int, list[int]] = {}
        for (v, s0, a0), (s1, a1) in zip(self._marks, ends):
            t = totals.setdefault(v, [0, 0])
            t[0] += s1 - s0
            t[1] += a1 - a0
        return {v: round((a + s) / s, 3) for v, (s, a) in totals.items() if s}

    def stats(self) -> dict:
        """``weight_version``, ``weight_updates`` (count) and ``weight_update_time`` (seconds
        applying updates, all calls; the last one in ``last_weight_update_time``)."""
        return {"weight_version": self.version, "weight_updates": self.updates,
                "weight_update_time": self.update_time,
                "last_weight_update_time": self.last_update_time}
