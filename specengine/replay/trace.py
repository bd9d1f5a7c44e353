"""Rollout traces: what every engine step decoded, drafted, accepted and cost, for replay.

A ``TraceRecorder`` hangs on ``Engine.trace`` (None, the default, costs one attribute check per
step) and is fed twice per step: ``begin_step`` after scheduling (it notes each scheduled
sequence's length before the step) and ``record`` from ``Engine._account``. ``LLM.start_trace``
/ ``LLM.stop_trace`` drive it and hand back a ``RolloutTrace``, which ``save`` writes as JSON
(atomically) and ``RolloutTrace.load`` reads back, checking the format.
``specengine.replay.projection`` predicts the rollout's wall time from it under other policies and
step-cost tables (replay projection; none of the public RL rollout systems ships one).

JSON layout (``"format": "specengine-rollout-trace"``, ``"version": 1``), times in seconds since
``start_trace``, lengths in tokens:

- ``meta``: ``model``, ``dtype``, ``drafter`` (name or null), ``policy``, ``max_num_seqs``,
  ``max_num_batched_tokens``, ``wall_s`` (``start_trace`` to ``stop_trace``), ``preemptions``.
- ``sequences``: ``{seq id: {"request", "index", "group" (hash of the prompt's token ids: the
  samples of one prompt and separate requests with the same prompt share it), "prompt_tokens",
  "max_tokens", "output_tokens" (committed while traced), "finish_reason", "first_step"}}``.
- ``steps``: per step ``{"start", "end" (when it was accounted), "draft_s", "forward_s",
  "sample_s" (``StepTimes``' split), "policy_s" (the policy deciding and learning: inside
  the others and the gaps between steps), "strategy" ("off" or ``str(Strategy)``), "depth",
  "topk" (0, 0 when off), "proposed" (draft nodes built, before the policy's cuts),
  "forward_tokens", "prefill": [{"seqs": [ids], "new", "cached", "commit": [per sample]}],
  "decode": [{"seq", "ctx" (tokens cached before the step: the root is not), "commit" (tokens
  appended, after the stop rules), "accepted" (draft tokens accepted, before them), "nodes"
  ({source: [nodes at depth 1, 2, ...]}; absent without a tree), "path" ([source of each
  accepted node])}]}``. A tree whose ``DraftTree.sources`` is None has one source, the
  drafter's name.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

from specengine.data.jsonl import read_json, write_json_atomic
from specengine.speculative.policy.base import strategy_name

TRACE_FORMAT = "specengine-rollout-trace"
TRACE_VERSION = 1

_STEP_KEYS = ("start", "end", "draft_s", "forward_s", "sample_s", "strategy", "forward_tokens",
              "prefill", "decode")
_SEQ_KEYS = ("prompt_tokens", "output_tokens", "first_step")


def prompt_group(token_ids: list[int]) -> str:
    """The group key of a prompt: 16 hex digits of SHA-1 over its token ids."""
    return hashlib.sha1(json.dumps(list(token_ids)).encode()).hexdigest()[:16]


class RolloutTrace:
    """A recorded rollout (see the module docstring for the fields).

    Args:
        meta: run facts (``wall_s`` among them once stopped).
        sequences: seq id (int) -> its facts.
        steps: one dict per engine step, in order.
    """

    def __init__(self, meta: dict, sequences: dict[int, dict], steps: list[dict]):
        self.meta, self.sequences, self.steps = meta, sequences, steps

    @property
    def wall_s(self) -> float | None:
        """Measured seconds from ``start_trace`` to ``stop_trace`` (None if not recorded)."""
        return self.meta.get("wall_s")

    @property
    def output_tokens(self) -> int:
        """Tokens committed over the trace, all sequences."""
        return sum(s["output_tokens"] for s in self.sequences.values())

    def step_seconds(self) -> float:
        """Seconds from the trace's start to the last step's end (0 without steps)."""
        return self.steps[-1]["end"] if self.steps else 0.0

    def to_dict(self) -> dict:
        """The JSON document."""
        return {"format": TRACE_FORMAT, "version": TRACE_VERSION, "meta": self.meta,
                "sequences": {str(k): v for k, v in self.sequences.items()},
                "steps": self.steps}

    def save(self, path: str | os.PathLike) -> None:
        """Write the trace as JSON to ``path`` atomically (a temporary file renamed into
        place)."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, doc, what: str = "trace") -> RolloutTrace:
        """Parse a trace document.

        Raises:
            ValueError: not a trace (format/version), or a step or sequence missing a field or
                naming an unknown sequence; the message names ``what`` and the entry.
        """
        if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT:
            raise ValueError(f"{what}: not a rollout trace (needs \"format\": {TRACE_FORMAT!r})")
        if doc.get("version") != TRACE_VERSION:
            raise ValueError(f"{what}: trace version {doc.get('version')!r} is not supported "
                             f"(this reader knows version {TRACE_VERSION})")
        for key in ("meta", "sequences", "steps"):
            if key not in doc:
                raise ValueError(f"{what}: missing {key!r}")
        try:
            seqs = {int(k): v for k, v in doc["sequences"].items()}
        except (AttributeError, ValueError):
            raise ValueError(f"{what}: 'sequences' must map integer ids to objects") from None
        for k, s in seqs.items():
            missing = [f for f in _SEQ_KEYS if not isinstance(s, dict) or f not in s]
            if missing:
                raise ValueError(f"{what}: sequence {k} lacks {missing}")
        if not isinstance(doc["steps"], list):
            raise ValueError(f"{what}: 'steps' must be a list")
        for i, st in enumerate(doc["steps"]):
            missing = [f for f in _STEP_KEYS if not isinstance(st, dict) or f not in st]
            if missing:
                raise ValueError(f"{what}: step {i} lacks {missing}")
            for part, keys in (("decode", ("seq", "ctx", "commit")),
                               ("prefill", ("seqs", "new", "cached"))):
                for j, row in enumerate(st[part]):
                    missing = [f for f in keys if not isinstance(row, dict) or f not in row]
                    if missing:
                        raise ValueError(f"{what}: step {i} {part} row {j} lacks {missing}")
            ids = [r["seq"] for r in st["decode"]] + [j for p in st["prefill"] for j in p["seqs"]]
            unknown = [j for j in ids if j not in seqs]
            if unknown:
                raise ValueError(f"{what}: step {i} names unknown sequences {unknown[:5]}")
        return cls(dict(doc["meta"]), seqs, list(doc["steps"]))

    @classmethod
    def load(cls, path: str | os.PathLike) -> RolloutTrace:
        """Read a trace written by ``save``.

        Raises:
            FileNotFoundError: no such file. ValueError: not JSON, or not a valid trace.
        """
        return cls.from_dict(read_json(path, "trace"), f"trace {os.fspath(path)}")


class TraceRecorder:
    """Builds a ``RolloutTrace`` from the engine's steps (``Engine.trace``).

    Args:
        meta: facts stored with the trace (model, dtype, drafter, policy, limits).
        drafter_name: the source name of trees without ``DraftTree.sources``.
        decision_time: the policy's ``decision_time`` now (seconds).
        clock: seconds (``time.perf_counter``); tests pass a fake one.
    """

    def __init__(self, meta: dict, drafter_name: str | None, decision_time: float = 0.0,
                 clock=time.perf_counter):
        self.meta, self.drafter_name, self.clock = dict(meta), drafter_name or "draft", clock
        self.origin = clock()
        self.sequences: dict[int, dict] = {}
        self.steps: list[dict] = []
        self._before: dict[int, int] = {}  # seq id -> length before this step
        self._decision = decision_time  # the policy's decision_time at the last step

    def begin_step(self, entries) -> None:
        """Note the length of every scheduled sequence (``BatchEntry`` list) before the step."""
        self._before = {s.seq_id: len(s) for e in entries for s in e.samplers}

    def record(self, layout, commits, strategy, times, num_proposed: int | None = None,
               decision_time: float | None = None) -> None:
        """Add the step just run: ``layout`` (``ForwardLayout``), ``commits`` (``Commit``s, the
        tokens already appended), ``strategy`` (``Strategy`` or None), ``times``
        (``StepTimes``), ``num_proposed`` (draft nodes built before the policy's cuts) and
        ``decision_time`` (the policy's ``decision_time`` so far, seconds; the step's share is
        the increase since the last step)."""
        step_index = len(self.steps)
        policy_s = 0.0
        if decision_time is not None:
            policy_s, self._decision = decision_time - self._decision, decision_time
        before = self._before
        prefill: dict[int, dict] = {}
        for e in layout.entries:
            if not e.is_prefill:
                continue
            length = before.get(e.seq.seq_id, len(e.seq))
            prefill[id(e)] = {"seqs": [s.seq_id for s in e.samplers], "new": e.num_new,
                              "cached": length - e.num_new}
            for s in e.samplers:
                self._register(s, step_index)
        decode = self._decode_rows(layout, commits, step_index)
        for e in layout.entries:  # tokens appended this step, after the stop rules
            appended = []
            for s in e.samplers:
                n = len(s) - before.get(s.seq_id, len(s))
                appended.append(n)
                info = self.sequences[s.seq_id]
                info["output_tokens"] += n
                if s.is_finished:
                    info["finish_reason"] = s.finish_reason
            if e.is_prefill:
                prefill[id(e)]["commit"] = appended
            else:
                decode[e.seq.seq_id]["commit"] = appended[0]
        self.steps.append({
            "start": times.start - self.origin, "end": self.clock() - self.origin,
            "draft_s": times.draft_time, "forward_s": times.forward_time,
            "sample_s": times.sample_time, "policy_s": policy_s,
            "strategy": strategy_name(strategy),
            "depth": strategy.depth if strategy else 0, "topk": strategy.topk if strategy else 0,
            "proposed": num_proposed or 0,
            "forward_tokens": layout.num_tokens, "prefill": list(prefill.values()),
            "decode": list(decode.values())})

    def _decode_rows(self, layout, commits, step_index: int) -> dict[int, dict]:
        """``record``'s decode rows, by sequence id: context length, and for a verified token
        tree its nodes per source and depth, the accepted count and the accepted path's
        sources (registering each sequence seen)."""
        decode: dict[int, dict] = {}
        verified = {id(c.entry): c for c in commits if c.is_verified}
        for e in layout.decodes:
            s = e.seq
            self._register(s, step_index)
            row = {"seq": s.seq_id, "ctx": self._before.get(s.seq_id, len(s)) - 1}
            c = verified.get(id(e))
            if e.tree is not None and c is not None:
                t = e.tree
                sources = t.sources or [self.drafter_name] * t.num_nodes
                nodes: dict[str, list[int]] = {}
                for src, d in zip(sources, t.depths):
                    per = nodes.setdefault(src, [])
                    per += [0] * (d - len(per))
                    per[d - 1] += 1
                row.update(nodes=nodes, accepted=len(c.accepted),
                           path=[sources[i] for i in c.accepted])
            decode[s.seq_id] = row
        return decode

    def _register(self, s, step_index: int) -> None:
        if s.seq_id not in self.sequences:
            self.sequences[s.seq_id] = {
                "request": s.request_id, "index": s.index,
                "group": prompt_group(s.prompt_token_ids),
                "prompt_tokens": s.num_prompt_tokens, "max_tokens": s.params.max_tokens,
                "output_tokens": 0, "finish_reason": None, "first_step": step_index}

    def finish(self, preemptions: int = 0) -> RolloutTrace:
        """The trace so far, with ``wall_s`` (seconds since the recorder was made) and
        ``preemptions`` (sequences preempted while tracing; the replay assumes none)."""
        meta = dict(self.meta, wall_s=self.clock() - self.origin, preemptions=preemptions)
        return RolloutTrace(meta, self.sequences, self.steps)
