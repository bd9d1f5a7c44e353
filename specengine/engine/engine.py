"""The step loop: schedule -> draft -> one target forward -> sample / verify -> commit ->
account.

One ``Engine.step()`` advances every running sequence (by one token, or by the accepted part of
its token tree plus the bonus token) and admits waiting requests; finished requests come back as
``RequestOutput``s. The phases are in ``specengine.engine.phases``, what they
hand each other in ``specengine.engine.step``, the drawing in ``specengine.sampling.sampler``,
the counters in ``specengine.engine.metrics``. Around the loop: request checks
(``engine.intake``), prompt logprobs (``engine.prompt_logprobs``), abort and pause
(``engine.control``), failed-step recovery (``engine.recovery``) and samples moving between
engines (``engine.transfer``).

What code outside the engine may use: ``Engine``'s public methods and attributes (requests,
``step``, abort / pause, ``validate_prompt``; read-only accessors such as ``model``,
``num_free_kv_blocks``, ``prefix_cache_stats``, ``num_running``; what sleep needs:
``releasable_tensors``, ``packed_weights``, ``drop_packed``; ``profile_forward``), its
``recovery`` (``recovery.StepRecovery``) and ``transfer`` (``transfer.SampleTransfer``: K/V
export and import for migration); never ``runner``, ``blocks``, ``scheduler``, ``sampler`` or
``output``.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from specengine.attention import make_backend
from specengine.engine import control, phases
from specengine.engine.config import EngineConfig
from specengine.engine.intake import (
    InvalidRequestError,
    RequestIds,
    RequestValidator,
    new_samples,
)
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
from specengine.engine.prompt_logprobs import fill_prompt_logprobs
from specengine.engine.recovery import StepRecovery
from specengine.engine.scheduler import Scheduler
from specengine.engine.sequence import PartialSample, Request, ScoreSpec, Sequence
from specengine.engine.step import Commit, ForwardLayout
from specengine.engine.transfer import SampleTransfer
from specengine.kv.block_manager import BlockManager
from specengine.ops.threads import ThreadTuner, adaptive_from_env
from specengine.sampling.params import SamplingParams
from specengine.sampling.sampler import Sampler
from specengine.speculative.drafters.base import Drafter
from specengine.speculative.policy import StaticPolicy
from specengine.speculative.policy.profiling import profile_forward
from specengine.speculative.strategy import Strategy

__all__ = ["Engine", "InvalidRequestError"]


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
        self.validator = RequestValidator(config, model.config.vocab_size, config.num_kv_blocks)
        self.seed_rng = torch.Generator().manual_seed(seed)
        self.requests: dict[str, Request] = {}
        self.metrics = EngineMetrics()
        self.threads = ThreadTuner(
            torch.get_num_threads(),
            enabled=adaptive_from_env() if adaptive_threads is None else adaptive_threads)
        self.drafter = drafter
        self.policy = policy or StaticPolicy(drafter.strategy if drafter else None)
        self.ids = RequestIds()
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
        self.recovery = StepRecovery(self)  # a failed step: recover, isolate, fail
        self.transfer = SampleTransfer(self)  # samples leaving / joining (migration)

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
        never interrupted. Everything the request carries is checked first
        (``validate_prompt`` with ``params``): nothing is queued when a check fails.

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
        request_id = self.ids.take(request_id, self.requests)
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
        seqs, score = new_samples(request_id, prompt_token_ids, params, seed, partial, score)
        self.requests[request_id] = Request(request_id, prompt, list(prompt_token_ids), params,
                                            seqs, time.perf_counter(), score=score)
        self.scheduler.add(seqs)
        self.metrics.record_request(len(prompt_token_ids))
        return request_id

    def validate_prompt(self, ids: list[int], what: str,
                        params: SamplingParams | None = None) -> None:
        """``RequestValidator.prompt``: raise ``InvalidRequestError`` if ``ids`` is refused."""
        self.validator.prompt(ids, what, params)

    def check_partial(self, partial: PartialSample, prompt: list[int],
                      params: SamplingParams, what: str) -> None:
        """``RequestValidator.partial``: raise ``InvalidRequestError`` if it is refused."""
        self.validator.partial(partial, prompt, params, what)

    def abort_all(self) -> None:
        """``control.abort_all``: drop every request, free every KV block."""
        control.abort_all(self)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """``control.abort_request``: stop one request; returns its partial output."""
        return control.abort_request(self, request_id)

    def pause(self, mode: str = "keep") -> dict:
        """``control.pause``: ``"abort"``, ``"keep"`` or ``"retract"`` until ``resume``."""
        return control.pause(self, mode)

    def resume(self) -> None:
        """Generate again after ``pause`` (no-op when not paused)."""
        self.paused = None

    def has_unfinished(self) -> bool:
        """Whether a sample is waiting or running, or a finished request was not returned by
        ``step`` yet (``outputs_ready``)."""
        return self.scheduler.has_work() or bool(self.outputs_ready)

    def take_ready_outputs(self) -> list[RequestOutput]:
        """Hand over ``outputs_ready`` now (finished requests the next ``step`` would return)."""
        ready, self.outputs_ready = self.outputs_ready, []
        return ready

    # ---- what the lifecycle and the server read (specengine.lifecycle, async_llm) ----------
    @property
    def model(self):
        """The target (``LlamaForCausalLM``)."""
        return self.runner.model

    @property
    def logprobs_mode(self) -> str:
        """``"raw_logprobs"`` or ``"processed_logprobs"`` (see ``Sampler``)."""
        return self.sampler.logprobs_mode

    @property
    def num_preemptions(self) -> int:
        """Sequences preempted so far (their KV freed, recomputed later)."""
        return self.scheduler.num_preemptions

    def num_free_kv_blocks(self) -> int:
        """KV blocks a request can get now (free, plus cached ones nobody uses)."""
        return self.blocks.num_free

    def prefix_cache_stats(self) -> dict:
        """``BlockManager.prefix_cache_stats``: hit rate, hit / queried / rerun tokens, blocks."""
        return self.blocks.prefix_cache_stats()

    def num_running(self) -> int:
        """Samples in the running set (holding KV)."""
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        """Groups of samples waiting for admission (a request's samples form one group)."""
        return len(self.scheduler.waiting)

    def remaining_lengths(self):
        """The policy's ``RemainingLength`` (output lengths it learnt), or None."""
        return getattr(self.policy, "remaining", None)

    def latency_model(self):
        """The policy's fitted latency model (``forward_time``, ``num_forward``), or None."""
        return getattr(self.policy, "latency", None)

    def releasable_tensors(self) -> list[torch.Tensor]:
        """What sleep may release: the target's KV pool ``[layers, 2, blocks, block_size,
        kv_heads, head_dim]`` and the drafters' own (``Drafter.kv_pools``, ``Drafter.walk``)."""
        return [self.runner.kv_cache] + [t for d in self._drafters() for t in d.kv_pools()]

    def packed_weights(self) -> list:
        """The kernels' packed weight copies held now (``PackedWeight``): the target's and
        the drafters' (EAGLE: its ``fc`` and the shared LM-head rows)."""
        return self.runner.model.packed_weights() + [
            pw for d in self._drafters() for pw in d.packed_weights()]

    def drop_packed(self) -> None:
        """Forget every packed copy of ``packed_weights``; rebuilt on first use."""
        self.runner.model.drop_packed()
        for d in self._drafters():
            d.drop_packed()

    def _drafters(self) -> list[Drafter]:
        return list(self.drafter.walk()) if self.drafter is not None else []

    def profile_forward(self, latency, clock=time.perf_counter) -> int:
        """Time dummy forwards (and drafts) into the policy's ``latency`` model, on KV blocks
        borrowed from the pool (``profiling.profile_forward``); returns the points added."""
        return profile_forward(self.runner, self.blocks, latency, drafter=self.drafter,
                               clock=clock)

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
        ready = self.take_ready_outputs()
        if not self.scheduler.has_work() or self.paused:
            return ready
        strategy, entries = phases.schedule(self.scheduler, self.blocks, self.runner,
                                            self.drafter, self.policy)
        if self.trace is not None:
            self.trace.begin_step(entries)
        with self.threads.step(phases.max_forward_tokens(entries, strategy)):
            times = StepTimes(thread_probe=self.threads.probe_step)
            num_proposed, catch_up = phases.draft(self.drafter, self.policy, self.blocks,
                                                  entries, strategy, self.config.max_model_len)
            times.mark("drafted")
            layout = ForwardLayout.of(entries)
            logits, hidden = self.runner.run(entries, self.blocks)
            logits = logits.cpu()  # [R, V] float32: sampling and verification run on the CPU
            fill_prompt_logprobs(self.requests, layout, hidden, self.runner.model, self.sampler)
            times.mark("forwarded")
            commits = phases.sample(self.sampler, layout, logits)
            phases.commit_kv(self.runner, self.blocks, layout, commits)
            t_observe = time.perf_counter()
            phases.observe(self.drafter, self.blocks, layout, hidden, commits,
                           self.runner.last_slots)
            phases.prefill_drafter(self.drafter, self.blocks, layout)
            times.observe_time = time.perf_counter() - t_observe
            times.mark("sampled")
            num_appended, finished = phases.append(
                self.requests, self.output, self.blocks, self.finish_sample,
                self._weight_version, layout, commits, hidden, now=times.sampled)
            self._account(layout, commits, strategy, times, num_proposed, num_appended, catch_up)
            return ready + [self.finish_request(req, now=times.sampled) for req in finished]

    def _account(self, layout: ForwardLayout, commits: list[Commit], strategy: Strategy | None,
                 times: StepTimes, num_proposed: int | None, num_appended: int,
                 catch_up: int = 0) -> None:
        """Count the step on the sequences and the engine (``EngineMetrics``), hand the
        policy its ``StepRecord`` (with speculation) and the trace recorder the step (when
        tracing, ``specengine.replay.trace``)."""
        record_sequences(layout, commits)
        self.metrics.record_step(layout, commits, times, num_appended,
                                 self.scheduler.num_preemptions)
        if self.drafter is not None:
            self.policy.record(step_record(layout, commits, strategy, times, num_proposed,
                                           catch_up))
        if self.trace is not None:
            self.trace.record(layout, commits, strategy, times, num_proposed,
                              self.policy.decision_time)

    def finish_sample(self, seq: Sequence) -> None:
        """Finish ``seq``: its drafter state is dropped (``Drafter.release``, while its KV
        blocks and their features are still held), its KV blocks go back to the pool, the
        policy is told (``Policy.finished``: output lengths per prompt group)."""
        if self.drafter is not None:
            self.drafter.release(seq)
        self.scheduler.finish(seq)
        self.policy.finished(seq)

    def finish_request(self, req: Request, now: float) -> RequestOutput:
        """The finished ``req``'s output (dropped from the engine's requests)."""
        del self.requests[req.request_id]
        return request_output(req, request_metrics(req, now), self.weight_version)
