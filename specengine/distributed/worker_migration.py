"""``WorkerMigration``: a pool actor's side of moving samples between engines.

The calls ``MigrationController`` (``distributed/migration_controller.py``) makes on a
``RolloutWorker``: ``migration_status`` (unfinished samples and their predicted work),
``export_prefixes`` (stage one: a sample's full K/V blocks, while it keeps decoding),
``stage_prefixes`` (stage one received ahead of stage two), ``export_sequences`` (stage two: the
samples leave), ``import_sequences`` and ``cancel_exports``; the engine side is
``specengine.lifecycle.migration``. Each call holds the engine between two steps of a running
rollout (``RolloutWorker._between_steps``).

``RolloutWorker`` inherits these methods; they use its ``llm``, ``_between_steps``, ``_turn``
(the condition guarding ``_staged_in``: stage-one chunks received), ``_live`` (running
streams) and ``notify_work`` (``SpareTrainingActor``).
"""

from __future__ import annotations

import dataclasses
import time

from specengine.lifecycle.migration import KVChunk, MigratedSequence


class WorkerMigration:
    """Migration calls of one pool actor (the module docstring); a base of ``RolloutWorker``."""

    def migration_status(self) -> dict:
        """``sequences``: ``LLM.running_sequences()`` (unfinished samples, predicted remaining
        tokens, KV bytes); ``prefill_seconds_per_token``: this engine's predicted prefill
        seconds per token (``LLM.prefill_seconds(1024) / 1024``); ``seconds``: time the engine
        was held for it (not the wait for the step in progress)."""
        with self._between_steps():
            t0 = time.perf_counter()
            seqs = self.llm.running_sequences()
            rate = self.llm.prefill_seconds(1024) / 1024
            seconds = time.perf_counter() - t0
        return {"sequences": seqs, "prefill_seconds_per_token": rate, "seconds": seconds}

    def export_prefixes(self, keys: list[tuple[str, int]]) -> list[KVChunk | None]:
        """Stage one for each ``(request_id, sample index)``: ``LLM.export_prefix`` (the sample
        keeps decoding here); None for a sample that finished or is not running."""
        out = []
        with self._between_steps():
            for rid, i in keys:
                try:
                    out.append(self.llm.export_prefix(rid, i))
                except ValueError:
                    out.append(None)
        return out

    def export_sequences(self, keys: list[tuple[str, int]], with_kv: list[bool]
                         ) -> list[MigratedSequence | None]:
        """Stage two for each ``(request_id, sample index)``, all between the same two steps:
        ``LLM.export_sequence`` (the sample leaves this engine); None for a sample that
        finished meanwhile (it comes back from here)."""
        out = []
        with self._between_steps():
            for (rid, i), kv in zip(keys, with_kv):
                try:
                    out.append(self.llm.export_sequence(rid, i, with_kv=kv))
                except ValueError:
                    self.llm.migration.cancel_export(rid, i)
                    out.append(None)
        return out

    def stage_prefixes(self, keys: list[tuple[str, int]], chunks: list[KVChunk | None]) -> int:
        """Receive stage one's chunks ahead of stage two (the pool passes the export call's
        ObjectRef, so they travel from the source while it keeps decoding); kept for the next
        ``import_sequences`` without ``prefixes``. Does not hold the engine. Returns how many."""
        staged = {tuple(k): c for k, c in zip(keys, chunks) if c is not None}
        with self._turn:
            self._staged_in.update(staged)
        return len(staged)

    def cancel_exports(self, keys: list[tuple[str, int]]) -> None:
        """Forget stage ones whose stage two will not come (``Migrator.cancel_export``)."""
        with self._between_steps():
            for rid, i in keys:
                self.llm.migration.cancel_export(rid, i)

    def import_sequences(self, states: list[MigratedSequence | None],
                         prefixes: list[KVChunk | None] | None = None) -> dict:
        """``LLM.import_sequence`` for each exported sample (None entries skipped), with its
        stage-one chunk from ``prefixes`` or, when None, from ``stage_prefixes`` (every staged
        chunk is dropped afterwards). A sample whose K/V finds no room (RuntimeError) is
        queued for a re-prefill instead. Imported requests go to a running stream of this
        actor, or to the next ``rollout`` started here.

        Returns:
            ``kv`` / ``reprefill``: samples continuing each way; ``bytes``: payload bytes
            received; ``adopted``: whether a running stream owns them (else the caller starts
            ``rollout([])`` here); ``keys``: ``(request_id, index, how)`` imported.

        Raises:
            ValueError: a payload this engine refuses (another weight version, ...).
        """
        self.notify_work()  # a spare-instance training round here stops
        with self._turn:
            staged, self._staged_in = self._staged_in, {}
        if prefixes is None:
            prefixes = [staged.get((s.request_id, s.index)) if s is not None else None
                        for s in states]
        got = {"kv": 0, "reprefill": 0, "bytes": 0, "keys": []}
        with self._between_steps():
            for state, prefix in zip(states, prefixes):
                if state is None:
                    continue
                try:
                    how = self.llm.import_sequence(state, prefix)
                except RuntimeError:  # no KV room: recompute it when there is
                    how = self.llm.import_sequence(
                        dataclasses.replace(state, tail=None, num_cached=0), None)
                got[how] += 1
                got["bytes"] += state.nbytes + (prefix.nbytes if prefix is not None and
                                                state.tail is not None and state.tail.start
                                                else 0)
                got["keys"].append((state.request_id, state.index, how))
            got["adopted"] = bool(self._live)
        return got
