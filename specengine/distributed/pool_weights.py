"""``PoolWeightUpdates``: a ``RolloutPool``'s weight updates, all or nothing across its actors.

The tensors go into Ray's object store once (``ray.put``); every actor receives the same
reference. Two phases: every live actor stages the update (``RolloutWorker.stage_weight_update``:
checked and copied, the old weights still serving); only when every actor staged it does any
actor apply it (``finish_weight_update``, all with the same ``weight_version``). A refusal in
phase one aborts the session on every actor (nothing applied); an actor failing phase two while
others applied is retired (killed) so every actor left serves the new weights (``pool.py``'s
module docstring, Weights).

``RolloutPool`` inherits these methods; they use its actor set: ``actors`` (actor id -> Ray
actor handle), ``alive`` (live actor ids), ``mark_dead``, ``require_alive``, ``broadcast``, and
the counters ``num_objects_put`` and ``_session`` (a streamed update is open on every actor).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError


class PoolWeightUpdates:
    """``update_weights`` / ``begin_weight_update`` / ``load_weights`` /
    ``finish_weight_update`` / ``abort_weight_update`` over a pool's actors (the module
    docstring); the base of ``RolloutPool``."""

    actors: dict
    alive: list[int]
    num_objects_put: int
    _session: bool

    def _put(self, obj) -> list:
        """``obj`` into the object store once; returns ``[ref]`` (a list, so each actor receives
        the reference itself and fetches the one stored copy)."""
        self.num_objects_put += 1
        return [ray.put(obj)]

    @staticmethod
    def _payload(weights: Mapping | Iterable) -> list:
        """``(name, tensor)`` pairs, tensors detached (an ``nn.Parameter`` pickles with its
        autograd flag; the engine needs the values only). No copy is made here."""
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        return [(name, t.detach() if isinstance(t, torch.Tensor) else t) for name, t in pairs]

    # ---- weight updates: all or nothing across the actors ----------------------------------
    def update_weights(self, weights: Mapping | Iterable) -> list[str]:
        """``LLM.update_weights`` on every actor, all or nothing (the module docstring,
        Weights): the tensors are put in the object store once, every actor stages them
        (checked and copied: each actor holds one staged copy of the tensors sent until it
        applies them), then every actor applies them with the same ``weight_version`` (the
        actors' current one + 1). Returns the names applied (the same on every actor).

        Raises:
            ValueError / TypeError / RuntimeError: as ``LLM.update_weights``, from the first
                actor that refused; the message names it and says that nothing was applied
                (every actor keeps its weights and ``weight_version``). RuntimeError: an actor
                died while staging (nothing applied either), a weight update session is open,
                or no actor is left.
        """
        if self._session:
            raise RuntimeError("update_weights: a weight update session is open on the pool; "
                               "finish_weight_update() or abort_weight_update() first")
        staged = self._stage_all("update_weights", self._put(self._payload(weights)), True)
        return self._finish_all("update_weights", None, staged)

    def begin_weight_update(self) -> None:
        """``LLM.begin_weight_update`` on every actor; if one fails, the sessions that opened
        are aborted (the error names the actor).

        Raises:
            RuntimeError: a session is open (on the pool or an actor); an actor died; no actor
                is left.
        """
        if self._session:
            raise RuntimeError("begin_weight_update: a weight update session is already open "
                               "on the pool; finish or abort it first")
        self._stage_all("begin_weight_update", None, True, idle=False)
        self._session = True

    def load_weights(self, weights) -> list[str]:
        """``LLM.load_weights`` on every actor: a chunk (put in the object store once) or a
        checkpoint path (read by each actor on its own node). Within a session (after
        ``begin_weight_update``) it is staged on every actor; a checkpoint with no session open
        is one update (staged everywhere, then applied everywhere). Returns the names staged
        (or applied).

        Raises:
            ValueError / TypeError / FileNotFoundError / RuntimeError: as ``LLM.load_weights``,
                from the first actor that refused: the session is then aborted on every actor,
                nothing of it is applied (the message names the actor). RuntimeError: a chunk
                with no session open; an actor died; no actor is left.
        """
        if isinstance(weights, (str, os.PathLike)):
            source = str(weights)
        else:
            if isinstance(weights, tuple) and len(weights) == 2 and isinstance(weights[0], str):
                weights = [weights]
            if not self._session:
                raise RuntimeError("load_weights: no weight update session is open on the "
                                   "pool; call begin_weight_update() first, or "
                                   "update_weights() for a one-call update")
            source = self._put(self._payload(weights))
        if not self._session:  # a checkpoint as one update
            staged = self._stage_all("load_weights", source, True)
            return self._finish_all("load_weights", None, staged)
        return self._stage_all("load_weights", source, False, idle=False)[self.alive[0]]["names"]

    def finish_weight_update(self, weight_version: int | None = None) -> list[str]:
        """``LLM.finish_weight_update`` on every actor, all with the same ``weight_version``
        (given, or the actors' current one + 1). Returns the names applied.

        Raises:
            RuntimeError: no session is open on the pool; requests are in flight on an actor
                or an actor cannot apply the update (the session is aborted on every actor:
                nothing applied; the message names the actor); no actor is left.
            ValueError: ``weight_version`` not an int >= 0 (the session stays open).
        """
        if not self._session:
            raise RuntimeError("finish_weight_update: no weight update session is open on the "
                               "pool")
        if weight_version is not None and (not isinstance(weight_version, int)
                                           or isinstance(weight_version, bool)
                                           or weight_version < 0):
            raise ValueError(f"weight_version must be an int >= 0, got {weight_version!r}")
        staged = self._stage_all("finish_weight_update", None, False)  # ready: idle, versions
        return self._finish_all("finish_weight_update", weight_version, staged)

    def abort_weight_update(self) -> bool:
        """``LLM.abort_weight_update`` on every actor; True if any had a session open."""
        self._session = False
        return any(self.broadcast("abort_weight_update"))

    def _stage_all(self, what: str, source, begin: bool, idle: bool = True) -> dict[int, dict]:
        """Phase one on every live actor: ``RolloutWorker.stage_weight_update(source, begin,
        idle)``. Returns actor id -> its ``{"names", "weight_version"}``.

        Raises:
            the first refusal, renamed by ``_refused`` (after aborting every actor's session).
        """
        self.require_alive()
        actors = list(self.alive)
        refs = [(a, self.actors[a].stage_weight_update.remote(source, begin, idle))
                for a in actors]
        out, failed = {}, None
        for a, ref in refs:
            try:
                out[a] = ray.get(ref)
            except RayActorError as e:
                self.mark_dead(a, e)
                failed = failed or (a, e)
            except Exception as e:  # noqa: BLE001 - every refusal aborts everywhere
                failed = failed or (a, e)
        if failed is not None:
            raise self._refused(what, *failed)
        return out

    def _finish_all(self, what: str, version: int | None, staged: dict[int, dict]
                    ) -> list[str]:
        """Phase two: apply the staged sessions on every live actor with one weight version
        (``version``, or the highest current one + 1). An actor that fails while others
        applied is retired (killed, with a warning): every actor left serves the new weights.

        Raises:
            RuntimeError (or the actors' error type): every actor failed to apply it (the
                sessions are aborted: nothing applied); no actor is left.
        """
        if version is None:
            version = max(st["weight_version"] for st in staged.values()) + 1
        refs = [(a, self.actors[a].finish_weight_update.remote(version)) for a in self.alive]
        done, failed = {}, {}
        for a, ref in refs:
            try:
                done[a] = ray.get(ref)
            except RayActorError as e:  # died: it serves nothing, the others stay consistent
                self.mark_dead(a, e)
            except Exception as e:  # noqa: BLE001 - handled below
                failed[a] = e
        self._session = False
        if failed and not done:
            a, e = next(iter(failed.items()))
            raise self._refused(what, a, e)
        for a, e in failed.items():
            why = f"retired: it failed to apply weight version {version} ({_cause(e)})"
            ray.kill(self.actors[a], no_restart=True)
            self.mark_dead(a, RuntimeError(why))
            warnings.warn(f"RolloutPool.{what}: actor {a} {why}; the {len(done)} actors left "
                          f"serve weight version {version}", RuntimeWarning, stacklevel=3)
        self.require_alive()
        return next(iter(done.values()))

    def _refused(self, what: str, actor_id: int, error: Exception) -> Exception:
        """Abort the weight update session on every live actor and return the error to raise:
        the cause's type (ValueError, TypeError, FileNotFoundError, else RuntimeError), naming
        ``actor_id`` and saying that nothing was applied, with the weight versions after."""
        self._session = False
        refs = [(a, self.actors[a].abort_weight_update.remote()) for a in self.alive]
        for a, ref in refs:
            try:
                ray.get(ref)
            except RayActorError as e:
                self.mark_dead(a, e)
            except Exception:  # noqa: BLE001 - best effort: it had no session to abort
                pass
        versions = {}
        for a in list(self.alive):
            try:
                versions[a] = ray.get(self.actors[a].weight_version.remote())
            except RayActorError as e:
                self.mark_dead(a, e)
        cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None \
            else error
        died = isinstance(error, RayActorError)
        kept = sorted(set(versions.values()))
        msg = (f"RolloutPool.{what} failed on actor {actor_id}"
               f"{' (it died)' if died else ''}: {_cause(error)}; the update was aborted on "
               f"every actor: nothing was applied, the {len(versions)} live actors keep their "
               f"weights (weight_version {kept[0] if len(kept) == 1 else kept})")
        kind = type(cause) if type(cause) in (ValueError, TypeError, FileNotFoundError,
                                              RuntimeError) else RuntimeError
        err = kind(msg)
        err.__cause__ = error
        return err


def _cause(error: Exception) -> str:
    """One line for an actor call's error: the remote exception's type and first line (a
    ``RayTaskError`` is unwrapped)."""
    cause = error.cause if isinstance(error, RayTaskError) and error.cause is not None else error
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0] if text else ''}"
