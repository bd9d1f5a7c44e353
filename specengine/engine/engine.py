"""The step loop: schedule -> draft -> one target forward -> sample / verify -> commit ->
account.

One ``Engine.step()`` advances every running sequence (by one token, or by the accepted part of
its token tree plus the bonus token) and admits waiting requests; finished requests come back as
``RequestOutput``s. The phases are methods of ``Engine``; what they hand each other is in
``specengine.engine.step``, the drawing in ``specengine.sampling.sampler``, the counters in
``specengine.engine.metrics``.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import time

import torch

from specengine.attention import make_backend
from specengine.engine.batch import BatchEntry
from specengine.engine.config import EngineConfig
from specengine.engine.metrics import (
    EngineMetrics,
    StepTimes,
    record_sequences,
    request_metrics,
    step_record,
)
from specengine.engine.model_runner import ModelRunner
from specengine.engine.output_processor import OutputProcessor
from specengine.engine.outputs import RequestOutput, request_output
from specengine.engine.scheduler import Scheduler
from specengine.engine.sequence import PartialSample, Request, ScoreSpec, Sequence, SequenceStatus
from specengine.engine.step import Commit, ForwardLayout
from specengine.kv.block_manager import BlockManager, cdiv
from specengine.ops.threads import ThreadTuner, adaptive_from_env
from specengine.sampling.params import SampleNoise, SamplingParams
from specengine.sampling.sampler import Sampler
from specengine.speculative.drafters.base import Drafter, prune_tree
from specengine.speculative.policy import StaticPolicy
from specengine.speculative.strategy import Strategy

PAUSE_MODES = ("abort", "keep", "retract")
PROMPT_ROWS = 256  # logits rows computed at once for prompt logprobs and scores

logger = logging.getLogger("specengine.engine.engine")


class InvalidRequestError(ValueError):
    """A request ``Engine.add_request`` refuses before admitting it (a ``ValueError``: the
    server answers 400). ``param`` names the field at fault: ``"prompt"``, ``"n"``,
    ``"stop_token_ids"``, ``"logprobs"``, ``"prompt_logprobs"``, ``"max_tokens"``, ``"stop"``
    or ``"request_id"``."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


class Engine:
    """Continuous-batching engine over one model.

    Args:
        model: ``LlamaForCausalLM`` with loaded weights.
        tokenizer: transformers tokenizer or None.
        config: sizes (``num_kv_blocks`` must be set).
        seed: seeds the generator that draws seeds for requests without one.
        logprobs_mode: ``"raw_logprobs"`` (log-softmax of the model's logits, before
            temperature/top-k/top-p/min-p; vLLM's default) or ``"processed_logprobs"`` (of the
            distribution actually sampled from, after them); see ``Sampler``.
        eos_token_ids: ids that end a sample (default: from the model config and tokenizer).
        drafter: drafter for speculative decoding (None: plain decoding).
        policy: picks the strategy per step (default: the drafter's strategy, always).
        attention_backend: ``"auto"``, ``"torch"``, ``"cpu"``, ``"cuda"`` or ``"triton"``.
        adaptive_threads: let ``self.threads`` (``specengine.ops.threads.ThreadTuner``) pick the
            kernels' thread count of steps run in them from measured step times (None: the
            environment variable ``SPECENGINE_ADAPTIVE_THREADS``, default on).
    """

    def __init__(self, model, tokenizer, config: EngineConfig, seed: int = 0,
                 logprobs_mode: str = "raw_logprobs", eos_token_ids: set[int] | None = None,
                 drafter: Drafter | None = None, policy=None,
                 attention_backend: str = "auto", adaptive_threads: bool | None = None):
        self.config = config
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = set(model.config.eos_token_ids)
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                eos_token_ids.add(tokenizer.eos_token_id)
        self.output = OutputProcessor(tokenizer, eos_token_ids, config.max_model_len)
        self.sampler = Sampler(tokenizer, logprobs_mode, self.output.stop_ids)
        device = next(model.parameters()).device
        self.runner = ModelRunner(model, config.num_kv_blocks, config.block_size,
                                  make_backend(attention_backend, device))
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size,
                                   self.runner.copy_block, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.seed_rng = torch.Generator().manual_seed(seed)
        self.requests: dict[str, Request] = {}
        self.metrics = EngineMetrics()
        self.threads = ThreadTuner(
            torch.get_num_threads(),
            enabled=adaptive_from_env() if adaptive_threads is None else adaptive_threads)
        self.drafter = drafter
        self.policy = policy or StaticPolicy(drafter.strategy if drafter else None)
        self._next_id = 0
        self._weight_version = 0
        self.weight_version = 0  # stamped on outputs; weights.WeightUpdater advances it
        self.ready_check = None  # callable raising when requests cannot run (memory.py)
        self.trace = None  # specengine.replay.trace.TraceRecorder while a rollout trace is recorded
        # finished requests not returned by a step yet: the last unfinished sample of a request
        # left the engine (``detach``), the others had finished; the next ``step`` returns them
        self.outputs_ready: list[RequestOutput] = []
        self.paused: str | None = None  # the pause mode while paused (``pause``)
        # waiting groups of other requests held out of the queue while one request runs
        # alone (``isolate``; None when not isolating)
        self.held: list[list[Sequence]] | None = None

    @property
    def weight_version(self) -> int:
        """Version of the target's weights (``weights.WeightUpdater`` advances it); setting it
        tells the drafter (``Drafter.set_weight_version``)."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self._weight_version = version
        self.blocks.set_weight_version(version)  # new requests: this version's cached blocks
        if self.drafter is not None:
            self.drafter.set_weight_version(version)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, request_id: str | None = None,
                    score: ScoreSpec | None = None, partial: PartialSample | None = None
                    ) -> str:
        """Queue a prompt; returns its request id. ``score`` (``LLM.score``): the prefill
        also fills it with the teacher-forced logprobs of its completion. ``partial``:
        continue that sample (one sample, whatever ``params.n``): its tokens count as output
        (``max_tokens``, ``min_tokens``, penalties, noise positions), its logprobs are
        recomputed in the prefill (equal to those generated), and the output returns them
        with the new tokens; with the same seed and weights the result equals the sample
        never interrupted.

        Everything the request carries is checked first (``validate_prompt`` with
        ``params``), so that nothing it asks for can make a later ``step`` fail or leave it
        unschedulable; nothing is queued when a check fails.

        Raises:
            ValueError (``InvalidRequestError``, ``param`` naming the field): empty prompt,
                prompt not shorter than ``max_model_len``, a prompt token or stop token id
                that is not an integer in the vocabulary, ``n`` above ``max_num_seqs``,
                ``logprobs`` / ``prompt_logprobs`` above the vocabulary size, a sample that
                could not fit the KV pool at its longest, a stop string without a tokenizer,
                or a ``request_id`` that an unfinished request already has.
            RuntimeError: from ``ready_check`` (the engine is asleep, see ``memory.py``).
        """
        if self.ready_check is not None:
            self.ready_check()
        if request_id is None:
            while str(self._next_id) in self.requests:  # an id taken by a migrated request
                self._next_id += 1
            request_id = str(self._next_id)
            self._next_id += 1
        elif request_id in self.requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      "request_id")
        if partial is not None:
            params = dataclasses.replace(params, n=1)
            self.check_partial(partial, prompt_token_ids, params, f"request {request_id}")
        self.validate_prompt(prompt_token_ids, f"request {request_id}", params)
        if params.stop_strings and self.tokenizer is None:
            raise InvalidRequestError(f"request {request_id}: stop strings need a tokenizer",
                                      "stop")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.seed_rng))
        indices = range(params.n) if partial is None else [partial.index]
        seqs = [Sequence(request_id, i, list(prompt_token_ids), params, SampleNoise(seed, i))
                for i in indices]
        if partial is not None and partial.token_ids:
            s = seqs[0]
            s.token_ids += partial.token_ids
            s.weight_versions = list(partial.weight_versions or [-1] * len(partial.token_ids))
            if params.logprobs is not None:
                score = ScoreSpec(len(prompt_token_ids), list(partial.token_ids), params,
                                  params.logprobs, into_sample=True)
        for s in seqs:  # every prompt position's logits are needed: no prefix-cache hit
            s.full_prefill = params.prompt_logprobs is not None or score is not None
        self.requests[request_id] = Request(request_id, prompt, list(prompt_token_ids), params,
                                            seqs, time.perf_counter(), score=score)
        self.scheduler.add(seqs)
        self.metrics.record_request(len(prompt_token_ids))
        return request_id

    def check_partial(self, partial: PartialSample, prompt: list[int],
                      params: SamplingParams, what: str) -> None:
        """Raise ``InvalidRequestError`` unless ``partial`` can be continued after
        ``prompt``: token ids in the vocabulary, one weight version per token, fewer tokens
        than ``max_tokens`` and a sequence shorter than ``max_model_len``."""
        what = f"{what}: partial"
        ids = partial.token_ids
        if not isinstance(partial.index, int) or isinstance(partial.index, bool) \
                or partial.index < 0:
            raise InvalidRequestError(f"{what} index {partial.index!r} must be an int >= 0",
                                      "partial.index")
        vocab = self.runner.model.config.vocab_size
        if not all(_is_int(t) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"{what} token ids must be integers in the vocabulary "
                                      f"[0, {vocab})",
                                      "partial.token_ids")
        if partial.weight_versions is not None and len(partial.weight_versions) != len(ids):
            raise InvalidRequestError(f"{what} has {len(partial.weight_versions)} weight "
                                      f"versions for {len(ids)} tokens",
                                      "partial.weight_versions")
        if len(ids) >= params.max_tokens or len(prompt) + len(ids) >= self.config.max_model_len:
            raise InvalidRequestError(
                f"{what} has {len(ids)} tokens: nothing is left to generate (max_tokens="
                f"{params.max_tokens}, max_model_len={self.config.max_model_len})",
                "partial.token_ids")

    def validate_prompt(self, ids: list[int], what: str,
                        params: SamplingParams | None = None) -> None:
        """Raise ``InvalidRequestError`` (a ValueError) naming ``what`` and the field if
        ``ids`` cannot be generated from: empty, not shorter than ``max_model_len``, or a
        token id that is not an integer in ``[0, V)`` (V: the model's ``vocab_size``).

        With ``params``, also everything else a request carries that could make a ``step``
        fail or could never be scheduled:

        - ``n`` above ``max_num_seqs`` (a prompt's samples are admitted together);
        - ``stop_token_ids`` not integers in ``[0, V)`` (the ``min_tokens`` mask indexes the
          logits with them);
        - ``logprobs`` / ``prompt_logprobs`` above V (the top-k of a row of V);
        - one sample at its longest (``min(len(ids) + max_tokens, max_model_len)`` tokens)
          needing more KV blocks than the pool has (it could never finish).
        """
        if len(ids) == 0:
            raise InvalidRequestError(f"{what}: the prompt is empty", "prompt")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(f"{what}: the prompt has {len(ids)} tokens; it must be "
                                      f"shorter than max_model_len={limit}", "prompt")
        vocab = self.runner.model.config.vocab_size
        bad = [t for t in ids if not _is_int(t)]
        if bad:
            raise InvalidRequestError(f"{what}: token ids {bad[:5]!r} are not integers",
                                      "prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{what}: token ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {vocab})", "prompt")
        if params is None:
            return
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"{what}: the sampling params are a "
                                      f"{type(params).__name__}, not SamplingParams", "params")
        cap = self.config.max_num_seqs
        if params.n > cap:
            raise InvalidRequestError(
                f"{what}: n={params.n} samples can never be scheduled: the engine runs at most "
                f"max_num_seqs={cap} sequences at once", "n")
        stops = params.stop_token_ids
        bad = [t for t in stops if not _is_int(t) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{what}: stop_token_ids {bad[:5]!r} are outside the "
                                      f"vocabulary [0, {vocab})", "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise InvalidRequestError(f"{what}: {name}={k} is more than the vocabulary "
                                          f"size {vocab}", name)
        bs, pool = self.config.block_size, self.blocks.num_blocks
        total = min(len(ids) + params.max_tokens, limit)
        need = cdiv(total, bs)
        if need > pool:
            field = "prompt" if cdiv(len(ids), bs) > pool else "max_tokens"
            raise InvalidRequestError(
                f"{what}: {total} tokens (prompt + max_tokens) need {need} KV blocks but the "
                f"pool has {pool}; send a shorter prompt or a smaller max_tokens", field)

    def abort_all(self) -> None:
        """Drop every unfinished request and return its KV blocks to the pool (and any finished
        request ``step`` has not returned yet)."""
        for req in self.requests.values():
            for s in req.seqs:
                if not s.is_finished:
                    self._release(s)
        self.scheduler.waiting.clear()
        self.requests.clear()
        self.outputs_ready.clear()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop one unfinished request (all its samples, running or waiting) and return its KV
        blocks to the pool; the other requests are untouched.

        Returns:
            What it made so far (SkyRL's partial rollouts): a finished ``RequestOutput`` whose
            unfinished samples have ``finish_reason="abort"`` and the tokens, logprobs and
            weight versions generated until now (samples that had finished keep theirs); None
            if ``request_id`` is unknown or already finished.
        """
        req = self.requests.get(request_id)
        if req is None:
            return None
        for s in req.seqs:
            if not s.is_finished:
                s.finish_reason = "abort"
                self._release(s)
                s.text = self.output.decode(s)
        waiting = self.scheduler.waiting
        kept = [g for g in waiting if g[0].request_id != request_id]
        waiting.clear()
        waiting.extend(kept)
        return self._request_output(req, now=time.perf_counter())

    def pause(self, mode: str = "keep") -> dict:
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
        report = {"mode": mode, "requests": len(self.requests),
                  "running": len(self.scheduler.running), "retracted": 0, "aborted": []}
        if mode == "abort":
            report["aborted"] = [o for rid in list(self.requests)
                                 if (o := self.abort_request(rid)) is not None]
        elif mode == "retract":
            for seq in reversed(self.scheduler.running):  # the first admitted ends up first
                self.scheduler.preempt(seq)
                report["retracted"] += 1
        self.paused = mode
        return report

    def resume(self) -> None:
        """Generate again after ``pause`` (no-op when not paused)."""
        self.paused = None

    def has_unfinished(self) -> bool:
        """Whether a sample is waiting or running, or a finished request was not returned by
        ``step`` yet (``outputs_ready``)."""
        return self.scheduler.has_work() or bool(self.outputs_ready)

    # ---- a step that raised: recovery and isolation ---------------------------------------
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
        wants to rebuild them (``server.async_engine`` does).

        Raises:
            Whatever releasing a finished sample raises (the drafter or the policy): the
            engine is then not consistent; ``abort_all`` is the way out.
        """
        sched = self.scheduler
        for req in list(self.requests.values()):
            for s in req.seqs:
                if s.finish_reason is not None and not s.is_finished:
                    self._release(s)  # finished in the failed step, but not released
                elif not s.is_finished:
                    self._trim_partial_append(s)
        requeued = list(sched.running)
        for s in reversed(requeued):  # appendleft: the queue's head keeps admission order
            sched.preempt(s)
        queued = {id(s) for g in [*sched.waiting, *(self.held or [])] for s in g}
        for req in self.requests.values():  # left out by an admission that raised
            for s in req.seqs:
                if not s.is_finished and id(s) not in queued:
                    self.blocks.free(s)
                    s.status = SequenceStatus.WAITING
                    sched.waiting.append([s])
                    requeued.append(s)
        for s in requeued:
            s.penalty_counts = None
            if self.drafter is not None:
                self.drafter.discard(s)
        now = time.perf_counter()
        for req in list(self.requests.values()):
            if req.seqs and all(s.is_finished for s in req.seqs):
                self.outputs_ready.append(self._request_output(req, now=now))
        suspects = [rid for rid, req in reversed(self.requests.items())
                    if any(not s.is_finished for s in req.seqs)]
        logger.warning("a step failed: %d sequences requeued for recompute, %d requests in "
                       "flight", len(requeued), len(suspects))
        return suspects

    def _trim_partial_append(self, seq: Sequence) -> None:
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
            seq.text = self.output._decode(seq)
        logger.warning("sample %s#%d: output cut from %d to %d tokens after a step failed "
                       "while appending", seq.request_id, seq.index, n, keep)

    def isolate(self, request_id: str) -> None:
        """Hold every waiting group of the other requests out of the queue (in ``held``), so
        that the next steps run ``request_id`` alone (to find the request that makes steps
        fail, after ``recover_from_failed_step``, which leaves held groups held);
        ``end_isolation`` puts them back.

        Raises:
            ValueError: already isolating, or a sequence of another request is running
                (recover first).
        """
        sched = self.scheduler
        if self.held is not None:
            raise ValueError("already isolating a request: call end_isolation first")
        others = [s for s in sched.running if s.request_id != request_id]
        if others:
            raise ValueError(f"cannot isolate request {request_id!r}: {len(others)} sequences "
                             "of other requests are running")
        self.held = [g for g in sched.waiting if g[0].request_id != request_id]
        kept = [g for g in sched.waiting if g[0].request_id == request_id]
        sched.waiting.clear()
        sched.waiting.extend(kept)

    def end_isolation(self) -> None:
        """End ``isolate``: the isolated request's running sequences are preempted (recomputed
        later from their tokens, exactly) and the held groups go back to the front of the
        queue, ahead of it; normal batching resumes with the next ``step``. No-op when not
        isolating."""
        if self.held is None:
            return
        sched = self.scheduler
        for s in reversed(list(sched.running)):
            sched.preempt(s)
        rest = list(sched.waiting)
        sched.waiting.clear()
        sched.waiting.extend(self.held + rest)
        self.held = None

    def fail_request(self, request_id: str) -> bool:
        """Drop the unfinished request ``request_id`` because running it failed: like
        ``abort_request`` (``finish_reason`` ``"abort"``, KV blocks back to the pool, out of
        the waiting queue), but a drafter or policy that raises while forgetting a sample is
        logged and passed over, so the pool always gets its blocks back. Returns False if the
        id is unknown."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.seqs:
            if s.is_finished:
                continue
            s.finish_reason = "abort"
            self.scheduler.finish(s)
            try:
                if self.drafter is not None:
                    self.drafter.release(s)
                self.policy.finished(s)
            except Exception:  # noqa: BLE001 - the request is gone either way
                logger.exception("forgetting sample %s#%d of failed request", request_id,
                                 s.index)
        waiting = self.scheduler.waiting
        kept = [g for g in waiting if g[0].request_id != request_id]
        waiting.clear()
        waiting.extend(kept)
        if self.held is not None:
            self.held = [g for g in self.held if g[0].request_id != request_id]
        return True

    # ---- samples moving between engines (specengine.lifecycle.migration) ------------------------
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
        req = self.requests.get(seq.request_id)
        if req is None or not any(s is seq for s in req.seqs) or seq.is_finished:
            raise ValueError(f"sample {seq.request_id}#{seq.index} is not an unfinished "
                             "sample of this engine")
        waiting = self.scheduler.waiting
        kept = [[s for s in g if s is not seq] for g in waiting]
        waiting.clear()
        waiting.extend(g for g in kept if g)
        self.scheduler.finish(seq)
        if self.drafter is not None:
            self.drafter.discard(seq)
        self.policy.finished(seq)  # no finish_reason: no output length is learnt from it
        req.seqs = [s for s in req.seqs if s is not seq]
        if not req.seqs:
            del self.requests[req.request_id]
        elif all(s.is_finished for s in req.seqs):
            self.outputs_ready.append(self._request_output(req, now=time.perf_counter()))

    def attach(self, seq: Sequence, req: Request) -> None:
        """Add the sample ``seq`` that arrived from another engine to request ``req`` (this
        engine's request of that id, or a new ``Request`` holding only arriving samples, made
        known here). A ``seq`` with ``num_cached`` > 0 holds its KV blocks already (written by
        the caller) and joins the running set: the next step decodes it; else it is queued
        for a prefill of all its tokens (as a preempted sample is).

        Raises:
            ValueError: ``req`` already has a sample of ``seq.index``, or another request of
                this engine has ``req``'s id.
        """
        known = self.requests.get(req.request_id)
        if known is not None and known is not req:
            raise ValueError(f"request_id {req.request_id!r} is in use by another request")
        if any(s.index == seq.index for s in req.seqs):
            raise ValueError(f"request {req.request_id!r} already has sample {seq.index}")
        self.requests[req.request_id] = req
        req.seqs = sorted([*req.seqs, seq], key=lambda s: s.index)
        if seq.num_cached > 0:
            seq.status = SequenceStatus.RUNNING
            self.scheduler.running.append(seq)
        else:
            seq.status = SequenceStatus.WAITING
            self.scheduler.add([seq])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's ``reset_prefix_cache``), also while requests
        run: running samples keep their blocks, and the blocks they fill later are never found
        by requests admitted after the reset (``BlockManager.reset_prefix_cache``). Returns
        True (also without caching)."""
        self.blocks.reset_prefix_cache()
        return True

    def weights_changed(self, version: int) -> None:
        """The target's weights changed (``weights.WeightUpdater``): outputs carry
        ``version`` from now on, the drafter is told, and the prefix cache follows
        ``EngineConfig.prefix_cache_policy``: ``"reset"`` forgets every cached block,
        ``"keep_versioned"`` keeps them for the requests of their own version (new requests
        look up only blocks of ``version``; old ones are evicted least recently used)."""
        self.weight_version = version
        if self.config.prefix_cache_policy == "reset":
            self.blocks.reset_prefix_cache()

    # ---- the step loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished in it.

        schedule -> draft -> one target forward -> sample / verify -> commit (KV commit, the
        drafter observes the committed positions, then the tokens are appended one at a time
        with the stop rules) -> account (counters, the policy's StepRecord). Requests in
        ``outputs_ready`` come first; with nothing waiting or running, only they come back.
        """
        ready, self.outputs_ready = self.outputs_ready, []
        if not self.scheduler.has_work() or self.paused:
            return ready
        strategy, entries = self._schedule()
        if self.trace is not None:
            self.trace.begin_step(entries)
        with self.threads.step(self._max_forward_tokens(entries, strategy)):
            times = StepTimes()
            num_proposed = self._draft(entries, strategy)
            times.mark("drafted")
            layout = ForwardLayout.of(entries)
            logits, hidden = self._forward(entries)
            self._prompt_logprobs(layout, hidden)
            times.mark("forwarded")
            commits = self._sample(layout, logits)
            self._commit_kv(layout, commits)
            self._observe(layout, hidden, commits)
            times.mark("sampled")
            num_appended, finished = self._append(layout, commits, hidden, now=times.sampled)
            self._account(layout, commits, strategy, times, num_proposed, num_appended)
            return ready + [self._request_output(req, now=times.sampled) for req in finished]

    def _schedule(self) -> tuple[Strategy | None, list[BatchEntry]]:
        """The policy's strategy for this step (None without a drafter, or to decode plainly)
        and the scheduler's entries, with KV room for the strategy's draft tokens."""
        strategy = None
        if self.drafter is not None:
            strategy = self.policy.choose(len(self.scheduler.running))
            if self.drafter.wants_hidden:  # prefix hits must bring their features along
                self.blocks.track_features(self.runner.model.config.hidden_size,
                                           self.runner.dtype, self.runner.device)
        return strategy, self.scheduler.schedule(lookahead=strategy.budget if strategy else 0)

    @staticmethod
    def _max_forward_tokens(entries: list[BatchEntry], strategy: Strategy | None) -> int:
        """Tokens the forward holds at most (every decode drafting the full budget): sizes the
        kernels' threads (decode-sized steps use the kernels' threads only)."""
        lookahead = strategy.budget if strategy else 0
        return sum(e.num_new + (lookahead if not e.is_prefill else 0) for e in entries)

    def _draft(self, entries: list[BatchEntry], strategy: Strategy | None) -> int | None:
        """Attach a draft tree to each decode entry, pruned to what the sequence may still
        commit (``max_tokens``, ``max_model_len``), then cut by the policy's ``refine``.
        Returns the draft nodes built (before the policy's cuts); None without a strategy."""
        if strategy is None:
            return None
        decodes = [e for e in entries if not e.is_prefill]
        if not decodes:
            return 0
        keep = self.policy.select([e.seq for e in decodes], strategy)  # may skip some
        decodes = [e for e, k in zip(decodes, keep) if k]
        trees = self.drafter.propose([e.seq for e in decodes], strategy) if decodes else []
        for e, tree in zip(decodes, trees):
            s = e.seq
            room = min(s.params.max_tokens - s.num_output_tokens,
                       self.config.max_model_len - len(s)) - 1
            e.tree = prune_tree(tree, max_depth=room, max_nodes=self.config.max_model_len -
                                len(s)) if tree is not None else None
        built = sum(e.tree.num_nodes for e in decodes if e.tree is not None)
        if decodes:  # the policy may cut trees further
            base = sum(e.num_new for e in entries)
            cut = self.policy.refine([e.seq for e in decodes], [e.tree for e in decodes], base)
            for e, tree in zip(decodes, cut):
                e.tree = tree
        return built

    def _forward(self, entries: list[BatchEntry]) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over every entry's tokens (prompts, decode roots, tree nodes),
        writing their K/V into the cache.

        Returns:
            ``(logits, hidden)``: logits ``[R, V]`` float32 on the CPU (sampling and
            verification run there), rows as ``ForwardLayout.logits_rows`` says; the last
            hidden states ``[T, H]`` on the model's device.
        """
        logits, hidden = self.runner.run(entries, self.blocks)
        return logits.cpu(), hidden

    def _prompt_logprobs(self, layout: ForwardLayout, hidden: torch.Tensor) -> None:
        """The first prefill of a request that asks for them computes the logits of every
        prompt position, ``PROMPT_ROWS`` rows at a time (bounded memory; the rows of a
        batch-invariant forward do not depend on the grouping): ``prompt_logprobs``
        entries (``Sampler.prompt_rows``), and the completion logprobs of an ``LLM.score``
        request or of a continued sample's partial output (``Sampler.score_rows``; the
        latter become the sample's own logprobs)."""
        for i, e in enumerate(layout.entries):
            req = self.requests.get(e.seq.request_id)
            if (not e.is_prefill or req is None or e.seq.num_cached
                    or (req.params.prompt_logprobs is None and req.score is None)
                    or req.prompt_logprobs is not None):
                continue
            ids, off, spec = e.seq.token_ids, layout.token_offsets[i], req.score
            prompt_rows = len(req.prompt_token_ids) - 1 if req.params.prompt_logprobs is not None \
                else 0
            entries: list = [None]
            first, end = prompt_rows, prompt_rows  # rows scored: [first, end)
            if spec is not None:
                spec.raw, spec.processed, spec.entries = [], [], []
                context = Sequence(req.request_id, 0, ids[:spec.prompt_len], spec.params, None)
                first = spec.prompt_len - 1
                end = first + len(spec.completion)
            for a in range(0, max(prompt_rows, end), PROMPT_ROWS):
                b = min(a + PROMPT_ROWS, max(prompt_rows, end))
                logits = self.runner.model.compute_logits(hidden[off + a:off + b]).cpu()
                if a < prompt_rows:
                    rows = min(b, prompt_rows) - a
                    entries += self.sampler.prompt_rows(logits[:rows], req.params,
                                                        ids[a + 1:a + 1 + rows])
                if spec is not None and b > first:
                    j0 = max(a, first)
                    raw, proc, ents = self.sampler.score_rows(
                        logits[j0 - a:], context, spec.completion, j0 - first, spec.logprobs)
                    spec.raw += raw
                    spec.processed += proc
                    spec.entries += ents
            req.prompt_logprobs = entries if req.params.prompt_logprobs is not None else []
            if spec is not None and spec.into_sample and e.seq.logprobs is not None:
                e.seq.logprobs = list(spec.entries)  # a continued sample's partial output
                e.seq.cumulative_logprob = sum(lp[t].logprob for lp, t in
                                               zip(spec.entries, spec.completion))

    def _sample(self, layout: ForwardLayout, logits: torch.Tensor) -> list[Commit]:
        """Draw every plain row in one ``Sampler.sample`` (each of a prefill's samples from the
        prompt's last row) and verify every token tree in one ``Sampler.verify_trees``.

        Returns:
            The commits: the plain rows' first, then the trees', in entry order.
        """
        plain = [(e, s, r) for e, r in layout.plain() for s in e.samplers]
        commits = []
        if plain:
            rows = [r for _, _, r in plain]  # all rows in order (plain decoding): no copy
            tokens, lps = self.sampler.sample(
                logits if rows == list(range(len(logits))) else logits[rows],
                [s for _, s, _ in plain])
            commits += [Commit(e, s, [t], [lp]) for (e, s, _), t, lp in zip(plain, tokens, lps)]
        trees = layout.trees()
        verified = self.sampler.verify_trees(
            [e.seq for e, _ in trees], [e.tree for e, _ in trees],
            [logits[r:r + 1 + e.tree.num_nodes] for e, r in trees])
        for (e, _), (accepted, tokens, lps) in zip(trees, verified):
            commits.append(Commit(e, e.seq, tokens, lps, accepted))
        return commits

    def _commit_kv(self, layout: ForwardLayout, commits: list[Commit]) -> None:
        """KV commit: an entry without a tree has its tokens cached now (for each of its
        samples); a verified tree's accepted nodes move to the contiguous positions after the
        root, the rest of its slots are dropped."""
        for e, _ in layout.plain():
            cached = e.seq.num_cached + e.num_new
            for s in e.samplers:
                s.num_cached = cached
        for c in commits:
            if not c.is_verified:
                continue
            seq = c.seq
            ctx = seq.num_cached + 1  # committed tokens including the root
            src = [ctx + a for a in c.accepted]
            dst = [ctx + j for j in range(len(c.accepted))]
            if src != dst:
                self.runner.move_kv(self.blocks, seq, src, dst)
            seq.num_cached = ctx + len(c.accepted)

    def _observe(self, layout: ForwardLayout, hidden: torch.Tensor,
                 commits: list[Commit]) -> None:
        """Hand a drafter that reads the target's features (EAGLE) the hidden states of the
        positions committed this step: a prefill's tokens, a decode's root, and the accepted
        tree nodes after it."""
        if self.drafter is None or not self.drafter.wants_hidden:
            return
        accepted = {id(c.entry): c.accepted for c in commits if c.is_verified}
        rows, spans = [], []
        for i, e in enumerate(layout.entries):
            r = layout.committed_token_rows(i, accepted.get(id(e)))
            rows += r
            spans.append((e.seq, e.seq.num_cached - len(r), len(r)))
        observed = self.blocks.observe_features(  # + the cached prefix after a hit
            spans, hidden[rows], [e.is_prefill for e in layout.entries])
        for e, (start, feats) in zip(layout.entries, observed):
            for s in e.samplers or [e.seq]:
                self.drafter.observe(s, start, feats)

    def _append(self, layout: ForwardLayout, commits: list[Commit], hidden: torch.Tensor,
                now: float) -> tuple[int, list[Request]]:
        """Append each commit's tokens one at a time with the stop rules (``OutputProcessor``);
        a sequence that stops releases its KV blocks and drops the rest of its tokens. A
        sequence with ``return_hidden_states`` keeps the rows of ``hidden`` ``[T, H]`` that
        produced the tokens it appended. Then the decodes still running give back their unused
        draft slots.

        Returns:
            ``(tokens appended, requests whose samples have all finished)``.
        """
        num_appended, finished = 0, []
        index = None
        for c in commits:
            req = self.requests[c.seq.request_id]
            req.first_token_time = req.first_token_time or now
            n = 0
            for tok, lp in zip(c.tokens, c.logprobs):
                num_appended += 1
                c.seq.weight_versions.append(self._weight_version)
                n += 1
                if self.output.append(c.seq, tok, lp):
                    self._release(c.seq)
                    if all(s.is_finished for s in req.seqs):
                        finished.append(req)
                    break
            if c.seq.hidden_states is not None:
                index = index or {id(e): i for i, e in enumerate(layout.entries)}
                rows = layout.sampling_rows(index[id(c.entry)], c.accepted)[:n]
                c.seq.hidden_states.append(hidden[rows].cpu())
        for e in layout.decodes:
            if not e.seq.is_finished:  # give back the draft slots
                self.blocks.shrink(e.seq, e.seq.num_cached)
        return num_appended, finished

    def _release(self, seq: Sequence) -> None:
        """Finish ``seq``: its KV blocks go back to the pool, its drafter state is dropped, the
        policy is told (``Policy.finished``: output lengths per prompt group)."""
        self.scheduler.finish(seq)
        if self.drafter is not None:
            self.drafter.release(seq)
        self.policy.finished(seq)

    def _account(self, layout: ForwardLayout, commits: list[Commit], strategy: Strategy | None,
                 times: StepTimes, num_proposed: int | None, num_appended: int) -> None:
        """Count the step on the sequences and the engine (``EngineMetrics``), hand the
        policy its ``StepRecord`` (with speculation) and the trace recorder the step (when
        tracing, ``specengine.replay.trace``)."""
        record_sequences(layout, commits)
        self.metrics.record_step(layout, commits, times, num_appended,
                                 self.scheduler.num_preemptions)
        if self.drafter is not None:
            self.policy.record(step_record(layout, commits, strategy, times, num_proposed))
        if self.trace is not None:
            self.trace.record(layout, commits, strategy, times, num_proposed,
                              self.policy.decision_time)

    def _request_output(self, req: Request, now: float) -> RequestOutput:
        """The finished ``req``'s output (dropped from the engine's requests)."""
        del self.requests[req.request_id]
        return request_output(req, request_metrics(req, now), self.weight_version)
