"""Moving an unfinished sample from one engine to another with a two-stage KV transfer
(RLHFSpec, arXiv 2512.04752: samples move from busy to idle instances in the long tail of a
rollout), or as tokens only with a re-prefill at the destination.

Stage one (``Migrator.export_prefix``) copies the K/V of the sample's full blocks while the
source keeps decoding it (committed positions never change). Stage two
(``Migrator.export_sequence``), between two steps, takes the sample out of the source (its KV
blocks and drafter state are released): it copies the positions written since stage one and
the whole sampling state. ``Migrator.import_sequence`` on the destination writes the K/V into
fresh blocks and puts the sample in its running set; the next step decodes it. A tokens-only
export (or an import whose K/V cannot serve) queues the sample for a prefill of all its tokens
at the destination, as a preempted sample is recomputed. ``MigrationCost`` picks between the
two: KV bytes over a bandwidth against the destination's predicted prefill seconds.

Both paths are exact: the next token at output position ``j`` depends on the committed tokens'
K/V, the sampling parameters, the penalty counts (rebuilt from the token ids) and the noise row
``j`` of the sample's stream (``SampleNoise``: a function of its key and ``j`` only), all of
which move, so a moved sample's output is token for token the unmoved one's.

Payloads (``KVChunk``, ``MigratedSequence``, ``SequenceInfo``) are plain dataclasses of CPU
tensors, lists and numbers: picklable, for a pool of engines in other processes.

What a sample takes along (``MigratedSequence``): request id, sample index, prompt text and
ids, token ids, ``SamplingParams``, the noise key, logprobs and their sum, the detokenized text
(stop strings are checked on it), its per-sample statistics (forwards, drafted / accepted
tokens), the request's age and first-token age (seconds), the weight version, and the K/V plus
target features (``[n, H]``, for EAGLE) of its committed positions. Not taken: the penalty
counts (rebuilt from the tokens at the next step) and the drafter's own KV (EAGLE's shadow KV
is recomputed at the destination from the moved features at its first draft; n-gram and draft
models keep nothing that cannot be rebuilt from the tokens).

Requests split across engines: the destination holds the arriving samples under the same
request id, in a request of their own (or with samples of that request that arrived before).
Each engine returns a ``RequestOutput`` with the ``CompletionOutput``s of the samples that
finished there (``index``: the sample's index in ``0 .. n-1``); ``merge_outputs`` joins them.
A source whose remaining samples had all finished returns its part at its next ``step``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specengine.engine.outputs import RequestOutput
from specengine.engine.sequence import Request, Sequence, SequenceStatus
from specengine.sampling.params import SampleNoise, SamplingParams
from specengine.speculative.policy.remaining import FINISHED, RemainingLength

STATS = ("num_forwards", "num_spec_steps", "num_drafted", "num_accepted", "accepted_per_depth",
         "calib_accepted", "calib_predicted",
         "weight_versions")  # per-sample statistics (and per-token weight versions) that move


@dataclass
class KVChunk:
    """K/V (and target features) of positions ``start .. end-1`` of one sample.

    Attributes:
        start, end: positions (tokens), ``end >= start``.
        kv: ``[layers, 2, end-start, kv_heads, head_dim]`` in the engine's dtype, CPU.
        features: ``[end-start, hidden_size]`` target features of those positions (kept for
            EAGLE), or None when the source keeps none.
    """

    start: int
    end: int
    kv: torch.Tensor
    features: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of ``kv`` and ``features``."""
        f = self.features
        return _nbytes(self.kv) + (_nbytes(f) if f is not None else 0)


@dataclass
class MigratedSequence:
    """One sample's complete state, from ``Migrator.export_sequence`` (see the module
    docstring). ``tail``: the K/V of positions ``tail.start .. num_cached-1`` (``tail.start``
    is the end of the stage-one ``KVChunk``, or 0 when stage one is missing or stale); None:
    tokens only, the destination re-prefills. ``age`` / ``first_token_age``: seconds since the
    request arrived / since its first token (None before one) at export."""

    request_id: str
    index: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    params: SamplingParams
    noise_key: int
    weight_version: int
    num_cached: int
    tail: KVChunk | None
    logprobs: list | None
    cumulative_logprob: float
    text: str
    stats: dict = field(default_factory=dict)
    age: float = 0.0
    first_token_age: float | None = None

    @property
    def nbytes(self) -> int:
        """Bytes moved in stage two: the tail's K/V and features plus 8 per token id."""
        return (self.tail.nbytes if self.tail is not None else 0) + 8 * len(self.token_ids)


@dataclass
class SequenceInfo:
    """What a pool reads to pick samples to move (``Migrator.running_sequences``).

    Attributes:
        request_id, index: the sample. running: it holds KV (else it waits for a (re)prefill).
        num_prompt_tokens, num_output_tokens, max_tokens: tokens.
        num_cached: positions whose K/V a KV transfer moves.
        kv_bytes: bytes a KV transfer moves (both stages, features included).
        predicted_remaining_tokens: expected output tokens still to come
            (``Migrator.predict_remaining``).
        acceptance_length: tokens committed per step so far (tau; 1.0 without speculation),
            so remaining steps ~ ``predicted_remaining_tokens / acceptance_length``.
    """

    request_id: str
    index: int
    running: bool
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    num_cached: int
    kv_bytes: int
    predicted_remaining_tokens: float
    acceptance_length: float


@dataclass
class MigrationCost:
    """The rule choosing between moving K/V and re-prefilling at the destination.

    Moving K/V costs ``2 * latency + kv_bytes / bandwidth`` seconds (two transfers); a
    re-prefill costs the destination's prefill of all the sample's tokens
    (``Migrator.prefill_seconds``, from its latency model or its measured prefill rate). The
    cheaper one is chosen; both give the same output.

    Args:
        bandwidth: bytes per second between the engines (> 0).
        latency: seconds per transfer (>= 0).

    Raises:
        ValueError: a value out of range.
    """

    bandwidth: float = 1e9
    latency: float = 1e-3

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"MigrationCost.bandwidth={self.bandwidth}: must be > 0 bytes/s")
        if not self.latency >= 0:
            raise ValueError(f"MigrationCost.latency={self.latency}: must be >= 0 seconds")

    def transfer_seconds(self, kv_bytes: int) -> float:
        """Seconds to move ``kv_bytes`` in two transfers."""
        return 2 * self.latency + kv_bytes / self.bandwidth

    def choose(self, kv_bytes: int, prefill_seconds: float) -> str:
        """``"kv"`` when moving ``kv_bytes`` takes no longer than ``prefill_seconds``, else
        ``"reprefill"``."""
        return "kv" if self.transfer_seconds(kv_bytes) <= prefill_seconds else "reprefill"


def merge_outputs(parts: list[RequestOutput]) -> RequestOutput:
    """One ``RequestOutput`` from the parts of a request split across engines: outputs in
    sample index order; metrics: token and step counters summed, ``arrival_time`` /
    ``first_token_time`` the earliest, ``finished_time`` the latest (each engine's clock),
    acceptance recomputed.

    Raises:
        ValueError: no parts, parts of different requests, or a sample index twice.
    """
    if not parts:
        raise ValueError("merge_outputs: no parts")
    first = parts[0]
    if any(p.request_id != first.request_id for p in parts):
        raise ValueError("merge_outputs: parts of different requests "
                         f"{sorted({p.request_id for p in parts})}")
    outs = sorted((o for p in parts for o in p.outputs), key=lambda o: o.index)
    if len({o.index for o in outs}) != len(outs):
        raise ValueError(f"merge_outputs: request {first.request_id!r} has a sample index twice")
    metrics: dict = {}
    for key in ("num_generated_tokens", "target_forwards", "spec_steps", "drafted_tokens",
                "accepted_tokens"):
        metrics[key] = sum(p.metrics.get(key, 0) for p in parts)
    for key, pick in (("arrival_time", min), ("first_token_time", min), ("finished_time", max)):
        vals = [p.metrics[key] for p in parts if p.metrics.get(key) is not None]
        metrics[key] = pick(vals) if vals else None
    metrics["num_prompt_tokens"] = len(first.prompt_token_ids)
    if metrics["spec_steps"]:
        metrics["acceptance_length"] = ((metrics["accepted_tokens"] + metrics["spec_steps"])
                                        / metrics["spec_steps"])
    return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, outs, True,
                         metrics, weight_version=first.weight_version)


class Migrator:
    """Export and import of unfinished samples for one ``Engine`` (the module docstring).

    Args:
        engine: the engine.
        clock: seconds (``time.perf_counter``); the migration metrics' time source.
        remaining: output lengths learnt from finished requests (``observe``), for
            ``predict_remaining`` when the engine's policy keeps none (default: a new one).

    Metrics (in ``engine.metrics.extra``, so in ``LLM.get_metrics()``):
    ``migration_stage1_seconds`` / ``_bytes`` (exports of stage one), ``migration_stage2_
    seconds`` / ``_bytes`` (stage two, release included), ``migration_import_seconds`` /
    ``_bytes``, ``migrated_out`` / ``migrated_in`` (samples moved with K/V), ``reprefilled_out``
    / ``reprefilled_in`` (samples moved as tokens).
    """

    def __init__(self, engine, clock=time.perf_counter,
                 remaining: RemainingLength | None = None):
        self.engine = engine
        self.clock = clock
        self.remaining = remaining or RemainingLength()
        self._staged: dict[tuple[str, int], tuple[int, int, int]] = {}
        for key in ("migration_stage1_seconds", "migration_stage1_bytes",
                    "migration_stage2_seconds", "migration_stage2_bytes",
                    "migration_import_seconds", "migration_import_bytes", "migrated_out",
                    "migrated_in", "reprefilled_out", "reprefilled_in"):
            engine.metrics.extra.setdefault(key, 0)

    def _count(self, **values) -> None:
        extra = self.engine.metrics.extra
        for k, v in values.items():
            extra[k] += v

    # ---- what is running -------------------------------------------------------------------
    def observe(self, outputs: list[RequestOutput]) -> None:
        """Learn the output lengths of finished requests (``predict_remaining``), per prompt
        group; aborted samples do not count."""
        for out in outputs:
            key = RemainingLength.group_key(out.prompt_token_ids)
            for o in out.outputs:
                if o.finish_reason in FINISHED:
                    self.remaining.add(key, len(o.token_ids))

    def predict_remaining(self, seq: Sequence) -> float:
        """Expected output tokens ``seq`` still generates: ``E[L - c | L > c]`` over its
        prompt group's finished lengths with the lengths of all groups as prior
        (``RemainingLength``: Seer arXiv 2511.14617 predicts from finished siblings), from the
        engine policy's record when it keeps one (``AutoPolicy``, which sees every finished
        sample), else from ``observe``'s; with nothing learnt yet, all it may still generate
        (long-tail pessimism). At most its room (``max_tokens``, ``max_model_len``)."""
        c = seq.num_output_tokens
        room = max(1, min(seq.params.max_tokens - c,
                          self.engine.config.max_model_len - len(seq)))
        policy = self.engine.remaining_lengths()
        if isinstance(policy, RemainingLength) and policy.prior.recent:
            e = policy.expected(seq)
        else:
            e = self.remaining.estimate(RemainingLength.group_key(seq.prompt_token_ids), c,
                                        room)
        return float(room) if e is None else min(float(room), e)

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes a KV transfer moves for ``num_tokens`` positions (K/V of every layer, plus the
        target features when this engine keeps them)."""
        return num_tokens * self.engine.transfer.kv_bytes_per_token()

    def running_sequences(self) -> list[SequenceInfo]:
        """Every unfinished sample (running ones first, in admission order, then waiting ones)
        with its predicted remaining work."""
        out = []
        for s in self.engine.transfer.unfinished_samples():
            steps = s.num_spec_steps
            tau = (s.num_accepted + steps) / steps if steps else 1.0
            running = s.status == SequenceStatus.RUNNING
            out.append(SequenceInfo(
                s.request_id, s.index, running, s.num_prompt_tokens, s.num_output_tokens,
                s.params.max_tokens, s.num_cached if running else 0,
                self.kv_bytes(s.num_cached) if running else 0,
                self.predict_remaining(s), tau))
        return out

    def prefill_seconds(self, num_tokens: int) -> float:
        """Predicted seconds of a prefill of ``num_tokens`` tokens here: the speculation
        policy's fitted latency model when it has one with data, else the prefill seconds per
        token measured so far, else 1 ms per token."""
        lat = self.engine.latency_model()
        if lat is not None and getattr(lat, "num_forward", 0):
            return float(lat.forward_time(num_tokens, 0, 1))
        m = self.engine.metrics
        if m.prefill_tokens and m.prefill_time > 0:
            return m.prefill_time / m.prefill_tokens * num_tokens
        return 1e-3 * num_tokens

    # ---- source ----------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, start: int, end: int) -> KVChunk:
        """K/V and features of ``seq``'s positions ``start .. end-1`` (``Engine.transfer``)."""
        kv, feats = self.engine.transfer.export_kv(seq, start, end)
        return KVChunk(start, end, kv, feats)

    def export_prefix(self, request_id: str, index: int) -> KVChunk:
        """Stage one: a copy of the K/V (and features) of the sample's full blocks of
        committed tokens, positions ``0 .. (num_cached // block_size) * block_size - 1``. The
        sample keeps running here; ``export_sequence`` sends the rest.

        Raises:
            ValueError: no such unfinished sample, or it is not running (no KV here).
        """
        t0 = self.clock()
        seq = self.engine.transfer.find_sample(request_id, index)
        if seq.status != SequenceStatus.RUNNING:
            raise ValueError(f"sample {request_id}#{index} is not running: it has no KV to copy")
        live = self.engine.requests
        self._staged = {k: v for k, v in self._staged.items() if k[0] in live}
        bs = self.engine.config.block_size
        end = seq.num_cached // bs * bs
        chunk = self._chunk(seq, 0, end)
        self._staged[(request_id, index)] = (seq.seq_id, seq.num_preemptions, end)
        self._count(migration_stage1_seconds=self.clock() - t0,
                    migration_stage1_bytes=chunk.nbytes)
        return chunk

    def cancel_export(self, request_id: str, index: int) -> bool:
        """Forget a stage one whose stage two will not come; returns whether one was kept."""
        return self._staged.pop((request_id, index), None) is not None

    def export_sequence(self, request_id: str, index: int, with_kv: bool = True
                        ) -> MigratedSequence:
        """Stage two: take the sample out of this engine (between steps) with its whole state
        and, with ``with_kv`` and the sample running, the K/V of the positions after its
        stage-one chunk (all of them when there was none, or the sample was preempted since:
        then ``tail.start`` is 0). Its KV blocks and drafter state are released here; a
        request whose other samples all finished is returned by the next ``step``.

        Raises:
            ValueError: no such unfinished sample.
        """
        t0 = self.clock()
        eng = self.engine
        seq = self.engine.transfer.find_sample(request_id, index)
        staged = self._staged.pop((request_id, index), None)
        running = seq.status == SequenceStatus.RUNNING
        tail, num_cached = None, 0
        if with_kv and running:
            start = 0
            if staged is not None and staged[:2] == (seq.seq_id, seq.num_preemptions) \
                    and staged[2] <= seq.num_cached:
                start = staged[2]
            num_cached = seq.num_cached
            tail = self._chunk(seq, start, num_cached)
        req = eng.requests[request_id]
        now = time.perf_counter()  # the request's own times are perf_counter seconds
        state = MigratedSequence(
            request_id=request_id, index=index, prompt=req.prompt,
            prompt_token_ids=list(seq.prompt_token_ids), token_ids=list(seq.token_ids),
            params=seq.params, noise_key=seq.noise.key, weight_version=eng.weight_version,
            num_cached=num_cached, tail=tail,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            cumulative_logprob=seq.cumulative_logprob, text=seq.text,
            stats={k: _copy(getattr(seq, k)) for k in STATS}, age=now - req.arrival_time,
            first_token_age=(now - req.first_token_time) if req.first_token_time else None)
        eng.transfer.detach(seq)
        if tail is not None:
            self._count(migrated_out=1)
        else:
            self._count(reprefilled_out=1)
        self._count(migration_stage2_seconds=self.clock() - t0,
                    migration_stage2_bytes=state.nbytes)
        return state

    # ---- destination -----------------------------------------------------------------------
    def import_sequence(self, state: MigratedSequence, prefix: KVChunk | None = None) -> str:
        """Continue a sample exported by another engine holding the same weights. With K/V
        (``state.tail``, and ``prefix`` unless ``tail.start`` is 0) it joins the running set
        with its K/V written into fresh blocks; as tokens only, or when this engine's drafter
        needs target features the payload lacks, it is queued for a prefill of all its
        tokens. Its request is this engine's request of that id if one holds other samples of
        it, else a new one (module docstring).

        Returns:
            ``"kv"`` or ``"reprefill"``: how it continues.

        Raises:
            ValueError: another weight version, a prompt or token this engine refuses, a sample
                index the request has here already, a request id in use by another prompt,
                K/V chunks that do not join up or do not fit this cache.
            RuntimeError: the KV pool or ``max_num_seqs`` has no room for it (nothing changed).
        """
        t0 = self.clock()
        eng = self.engine
        what = f"sample {state.request_id}#{state.index}"
        req = self._check_import(state, what)
        chunks = self._chunks(state, prefix, what)
        feats = None
        if chunks is not None and chunks and all(c.features is not None for c in chunks):
            feats = torch.cat([c.features for c in chunks])
        if eng.drafter is not None and eng.drafter.wants_hidden and feats is None:
            chunks = None  # the drafter could not draft for it: recompute the features
        seq = _sequence(state)
        if chunks is not None:
            eng.transfer.import_kv(seq, state.num_cached,
                                   [(c.start, c.end, c.kv) for c in chunks], feats, what)
        if req is None:
            now = time.perf_counter()
            req = Request(state.request_id, state.prompt, list(state.prompt_token_ids),
                          state.params, [], now - state.age,
                          now - state.first_token_age if state.first_token_age is not None
                          else None)
        eng.transfer.attach(seq, req, feats if chunks is not None else None)
        how = "kv" if chunks is not None else "reprefill"
        self._count(migration_import_seconds=self.clock() - t0,
                    migration_import_bytes=state.nbytes + (prefix.nbytes if prefix else 0),
                    **{"migrated_in" if how == "kv" else "reprefilled_in": 1})
        return how

    def _check_import(self, state: MigratedSequence, what: str) -> Request | None:
        """Raise ValueError unless ``state`` can continue here (import_sequence's list);
        returns this engine's request of its id, if any."""
        eng = self.engine
        if state.weight_version != eng.weight_version:
            raise ValueError(f"{what}: exported at weight version {state.weight_version}, this "
                             f"engine serves version {eng.weight_version}")
        eng.validate_prompt(state.prompt_token_ids, what)
        if len(state.token_ids) >= eng.config.max_model_len:
            raise ValueError(f"{what}: {len(state.token_ids)} tokens reach max_model_len="
                             f"{eng.config.max_model_len}")
        vocab = eng.model.config.vocab_size
        if any(not 0 <= t < vocab for t in state.token_ids):
            raise ValueError(f"{what}: a token id is outside the vocabulary [0, {vocab})")
        req = eng.requests.get(state.request_id)
        if req is not None and (req.prompt_token_ids != state.prompt_token_ids
                                or any(s.index == state.index for s in req.seqs)):
            raise ValueError(f"{what}: request id {state.request_id!r} is in use here by "
                             "another prompt or already has that sample")
        return req

    def _chunks(self, state: MigratedSequence, prefix: KVChunk | None,
                what: str) -> list[KVChunk] | None:
        """The chunks covering positions ``0 .. num_cached-1`` in order (None: tokens only).

        Raises:
            ValueError: they do not join up, or do not cover what the sample needs.
        """
        tail = state.tail
        if tail is None:
            return None
        chunks = [tail] if tail.start == 0 else [prefix, tail]
        if tail.start and (prefix is None or prefix.start != 0 or prefix.end != tail.start):
            raise ValueError(f"{what}: its K/V starts at position {tail.start}; the stage-one "
                             "chunk of positions 0 .. that is missing or does not join it")
        if tail.end != state.num_cached or state.num_cached != len(state.token_ids) - 1:
            raise ValueError(f"{what}: K/V of {tail.end} positions for a running sample of "
                             f"{len(state.token_ids)} tokens (expected {state.num_cached} = "
                             "tokens - 1)")
        for c in chunks:
            if c.kv.ndim != 5 or c.kv.shape[2] != c.end - c.start:
                raise ValueError(f"{what}: K/V chunk {c.start}..{c.end} has shape "
                                 f"{tuple(c.kv.shape)}")
        return chunks



def _sequence(state: MigratedSequence) -> Sequence:
    """A new ``Sequence`` holding ``state``'s tokens, sampling state and statistics."""
    seq = Sequence(state.request_id, state.index, list(state.prompt_token_ids),
                   state.params, SampleNoise.from_key(state.noise_key))
    seq.token_ids = list(state.token_ids)
    if state.params.logprobs is not None:
        seq.logprobs = list(state.logprobs or [])
    seq.cumulative_logprob, seq.text = state.cumulative_logprob, state.text
    for k, v in state.stats.items():
        if k in STATS:
            setattr(seq, k, _copy(v))
    return seq


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy(v):
    return list(v) if isinstance(v, list) else v
