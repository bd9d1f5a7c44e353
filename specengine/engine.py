"""The step loop: schedule -> run the model -> sample -> append tokens and check stops.

One ``Engine.step()`` advances every running sequence by one token and admits waiting
requests; finished requests come back as ``RequestOutput``s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specengine import kernels
from specengine.attention import make_backend
from specengine.batch import BatchEntry
from specengine.config import EngineConfig
from specengine.kv.block_manager import BlockManager
from specengine.model_runner import ModelRunner
from specengine.output_processor import OutputProcessor
from specengine.outputs import CompletionOutput, RequestOutput
from specengine.sampling import SampleNoise, SamplingParams, process_logits, sample
from specengine.scheduler import Scheduler
from specengine.sequence import Logprob, Sequence
from specengine.speculative.drafters.base import Drafter, prune_tree
from specengine.speculative.policy import StaticPolicy, StepRecord
from specengine.speculative.strategy import Strategy
from specengine.speculative.verify import verify

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None


@dataclass
class EngineMetrics:
    """Counters since the engine started (tokens, steps, seconds)."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    sample_time: float = 0.0
    preemptions: int = 0
    decode_steps: int = 0
    draft_time: float = 0.0
    spec_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_depth: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Counters plus derived ``acceptance_length`` (tau: tokens committed per verify
        forward, the bonus token included) and ``acceptance_rate_per_depth``."""
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        if self.spec_steps:
            d["acceptance_length"] = (self.accepted_tokens + self.spec_steps) / self.spec_steps
            d["acceptance_rate_per_depth"] = [
                self.accepted_per_depth.get(i, 0) / self.spec_steps
                for i in range(max(self.accepted_per_depth, default=-1) + 1)]
        d.update(self.extra)
        return d


class Engine:
    """Continuous-batching engine over one model.

    Args:
        model: ``LlamaForCausalLM`` with loaded weights.
        tokenizer: transformers tokenizer or None.
        config: sizes (``num_kv_blocks`` must be set).
        seed: seeds the generator that draws seeds for requests without one.
        logprobs_mode: ``"raw_logprobs"`` (log-softmax of the model's logits, before
            temperature/top-k/top-p/min-p; vLLM's default) or ``"processed_logprobs"`` (of the
            distribution actually sampled from, after them).
        eos_token_ids: ids that end a sample (default: from the model config and tokenizer).
        drafter: drafter for speculative decoding (None: plain decoding).
        policy: picks the strategy per step (default: the drafter's strategy, always).
        attention_backend: ``"auto"``, ``"torch"``, ``"cpu"``, ``"cuda"`` or ``"triton"``.
    """

    def __init__(self, model, tokenizer, config: EngineConfig, seed: int = 0,
                 logprobs_mode: str = "raw_logprobs", eos_token_ids: set[int] | None = None,
                 drafter: Drafter | None = None, policy=None,
                 attention_backend: str = "auto"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r}: use one of {LOGPROBS_MODES}")
        self.config = config
        self.tokenizer = tokenizer
        self.logprobs_mode = logprobs_mode
        device = next(model.parameters()).device
        self.runner = ModelRunner(model, config.num_kv_blocks, config.block_size,
                                  make_backend(attention_backend, device))
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size,
                                   self.runner.copy_block, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        if eos_token_ids is None:
            eos_token_ids = set(model.config.eos_token_ids)
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                eos_token_ids.add(tokenizer.eos_token_id)
        self.output = OutputProcessor(tokenizer, eos_token_ids, config.max_model_len)
        self.seed_rng = torch.Generator().manual_seed(seed)
        self.requests: dict[str, Request] = {}
        self.metrics = EngineMetrics()
        self.drafter = drafter
        self.policy = policy or StaticPolicy(drafter.strategy if drafter else None)
        self._next_id = 0

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, request_id: str | None = None) -> str:
        """Queue a prompt; returns its request id.

        Raises:
            ValueError: empty prompt, prompt not shorter than ``max_model_len``, a token id
                outside the vocabulary, or a stop string without a tokenizer.
        """
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        self.validate_prompt(prompt_token_ids, f"request {request_id}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError(f"request {request_id}: stop strings need a tokenizer")
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.seed_rng))
        seqs = [Sequence(request_id, i, list(prompt_token_ids), params, SampleNoise(seed, i))
                for i in range(params.n)]
        self.requests[request_id] = Request(request_id, prompt, list(prompt_token_ids), params,
                                            seqs, time.perf_counter())
        self.scheduler.add(seqs)
        self.metrics.requests += 1
        self.metrics.prompt_tokens += len(prompt_token_ids)
        return request_id

    def validate_prompt(self, ids: list[int], what: str) -> None:
        """Raise ValueError naming ``what`` if ``ids`` cannot be generated from."""
        if len(ids) == 0:
            raise ValueError(f"{what}: the prompt is empty")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"{what}: the prompt has {len(ids)} tokens; it must be shorter "
                             f"than max_model_len={limit}")
        vocab = self.runner.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def abort_all(self) -> None:
        """Drop every unfinished request and return its KV blocks to the pool."""
        for req in self.requests.values():
            for s in req.seqs:
                if not s.is_finished:
                    self.scheduler.finish(s)
                    if self.drafter is not None:
                        self.drafter.release(s)
        self.scheduler.waiting.clear()
        self.requests.clear()

    def abort_request(self, request_id: str) -> bool:
        """Drop one unfinished request (all its samples, running or waiting) and return its KV
        blocks to the pool; the other requests are untouched. Returns False if ``request_id``
        is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.seqs:
            if not s.is_finished:
                s.finish_reason = "abort"
                self.scheduler.finish(s)
                if self.drafter is not None:
                    self.drafter.release(s)
        waiting = self.scheduler.waiting
        kept = [g for g in waiting if g[0].request_id != request_id]
        waiting.clear()
        waiting.extend(kept)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's ``reset_prefix_cache``). Returns False, and
        changes nothing, while requests are in flight; True otherwise (also without caching)."""
        if self.has_unfinished():
            return False
        self.blocks.reset_prefix_cache()
        return True

    # ---- the step loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished in it.

        schedule -> draft (speculation) -> one target forward -> sample / verify -> KV commit
        -> append tokens one at a time with the stop rules.
        """
        strategy = None
        if self.drafter is not None:
            strategy = self.policy.choose(len(self.scheduler.running))
            if self.drafter.wants_hidden:  # prefix hits must bring their features along
                self.blocks.track_features(self.runner.model.config.hidden_size,
                                           self.runner.dtype, self.runner.device)
        entries = self.scheduler.schedule(lookahead=strategy.budget if strategy else 0)
        rows = sum(e.num_new + (strategy.budget if strategy and not e.is_prefill else 0)
                   for e in entries)
        with kernels.kernel_threads(kernels.packed_covers(rows)):  # decode-sized: kernel pool only
            return self._step(entries, strategy)

    def _step(self, entries: list[BatchEntry], strategy: Strategy | None) -> list[RequestOutput]:
        m = self.metrics
        t0 = time.perf_counter()
        # draft nodes built this step, before the policy's cuts
        num_proposed = self._draft(entries, strategy) if strategy is not None else None
        t1 = time.perf_counter()
        logits, hidden = self.runner.run(entries, self.blocks)
        logits = logits.cpu()  # sampling and verification run on the CPU
        t2 = time.perf_counter()
        for e in entries:
            for s in e.samplers:
                s.num_forwards += 1

        plain, trees, row, tok = [], [], 0, 0
        offsets = []  # first token of each entry in the forward's layout
        for e in entries:
            n = 1 + (e.tree.num_nodes if e.tree is not None else 0)
            (plain if e.tree is None else trees).append((e, row))
            offsets.append(tok)
            row += n
            tok += e.num_new + n - 1
        commits: list[tuple[Sequence, list[int], list]] = []
        seqs = [s for e, _ in plain for s in e.samplers]
        if seqs:
            rows = [r for e, r in plain for _ in e.samplers]
            tokens, lps = self.sample(logits[rows], seqs)
            commits += [(s, [t], [lp]) for s, t, lp in zip(seqs, tokens, lps)]
            for e, _ in plain:
                cached = e.seq.num_cached + e.num_new
                for s in e.samplers:
                    s.num_cached = cached
        accepted = {}
        for e, r in trees:
            seq, toks, lps, accepted[id(e)] = self._verify(e, logits[r:r + 1 + e.tree.num_nodes])
            commits.append((seq, toks, lps))
        if self.drafter is not None and self.drafter.wants_hidden:
            self._observe(entries, offsets, hidden, accepted)
        t3 = time.perf_counter()

        finished: list[RequestOutput] = []
        now = time.perf_counter()
        for seq, toks, lps in commits:
            req = self.requests[seq.request_id]
            req.first_token_time = req.first_token_time or now
            for tok, lp in zip(toks, lps):
                m.generated_tokens += 1
                if self.output.append(seq, tok, lp):
                    self.scheduler.finish(seq)
                    if self.drafter is not None:
                        self.drafter.release(seq)
                    if all(s.is_finished for s in req.seqs):
                        finished.append(self._request_output(req, now))
                    break
        for e in entries:
            if not e.is_prefill and not e.seq.is_finished:  # give back the draft slots
                self.blocks.shrink(e.seq, e.seq.num_cached)
        m.steps += 1
        num_prefill = sum(e.num_new for e in entries if e.is_prefill)
        m.prefill_tokens += num_prefill
        if num_prefill:
            m.prefill_time += t2 - t1
        else:
            m.decode_time += t2 - t1
            m.decode_steps += 1
        m.draft_time += t1 - t0
        m.sample_time += t3 - t2
        m.preemptions = self.scheduler.num_preemptions
        if self.drafter is not None:
            decodes = [e for e in entries if not e.is_prefill]
            self.policy.record(StepRecord(
                strategy=strategy, num_decode=len(decodes), num_prefill_tokens=num_prefill,
                num_forward_tokens=len(hidden),
                context_tokens=sum(e.seq.num_cached for e in decodes),
                num_drafted=sum(e.tree.num_nodes for e in decodes if e.tree is not None),
                num_committed=len(decodes) + sum(len(a) for a in accepted.values()),
                accepted_per_seq=[len(a) for a in accepted.values()],
                draft_time=t1 - t0, forward_time=t2 - t1,
                other_time=time.perf_counter() - t2,
                verified=[(e.seq, e.tree, accepted[id(e)]) for e, _ in trees],
                num_proposed=num_proposed))
        return finished

    def _observe(self, entries, offsets, hidden, accepted) -> None:
        """Hand the drafter the target's hidden states of the positions committed this step:
        a prefill's tokens, a decode's root, and the accepted tree nodes after it."""
        for e, off in zip(entries, offsets):
            if e.tree is None:
                rows = list(range(off, off + e.num_new))
            else:
                rows = [off] + [off + 1 + a for a in accepted[id(e)]]
            start, feats = self.blocks.observe_features(  # + cached prefix after a hit
                e.seq, e.seq.num_cached - len(rows), hidden[rows], e.is_prefill)
            for s in e.samplers or [e.seq]:
                self.drafter.observe(s, start, feats)

    def _draft(self, entries: list[BatchEntry], strategy: Strategy) -> int:
        """Attach a draft tree to each decode entry, pruned to what the sequence may still
        commit (``max_tokens``, ``max_model_len``), then cut by the policy's ``refine``.
        Returns the draft nodes built (before the policy's cuts)."""
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

    def _verify(self, e: BatchEntry, logits: torch.Tensor):
        """Verify ``e.tree`` against the target's ``logits`` ``[1 + m, V]`` (root first), commit
        the accepted path's KV and return ``(seq, tokens, logprob entries)`` to append."""
        seq, tree, p = e.seq, e.tree, e.seq.params
        n_out = seq.num_output_tokens
        masked = logits
        if n_out < p.min_tokens and (ids := self.output.stop_ids(seq)):
            masked = logits.clone()
            for j, d in enumerate([0] + tree.depths):
                if n_out + d < p.min_tokens:
                    masked[j, ids] = float("-inf")
        noise = None if p.greedy else torch.stack(
            [seq.noise(n_out + d, masked.shape[1]) for d in range(tree.max_depth + 1)])
        accepted, bonus = verify(tree, masked, p, noise)
        tokens = [tree.tokens[a] for a in accepted] + [bonus]
        # KV commit: the accepted nodes move to contiguous positions after the root
        ctx = seq.num_cached + 1  # committed tokens including the root
        src = [ctx + a for a in accepted]
        dst = [ctx + j for j in range(len(accepted))]
        if src != dst:
            self.runner.move_kv(self.blocks, seq, src, dst)
        seq.num_cached = ctx + len(accepted)
        # statistics
        m = self.metrics
        m.spec_steps += 1
        m.drafted_tokens += tree.num_nodes
        m.accepted_tokens += len(accepted)
        for d in range(len(accepted)):
            m.accepted_per_depth[d] = m.accepted_per_depth.get(d, 0) + 1
        seq.spec_stats(tree.num_nodes, len(accepted))
        lps: list = [None] * len(tokens)
        if p.logprobs is not None:
            rows = [0] + [1 + a for a in accepted]
            src_rows = logits if self.logprobs_mode == "raw_logprobs" else (
                masked if p.greedy else process_logits(masked, [p] * masked.shape[0]))
            lp = torch.log_softmax(src_rows[rows].float(), dim=-1)
            lps = [self._logprob_entry(lp[j], t, p.logprobs) for j, t in enumerate(tokens)]
        return seq, tokens, lps, accepted

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]):
        """Next token (and logprobs entry) for each row of ``logits`` ``[B, V]`` float32."""
        params = [s.params for s in seqs]
        raw = logits
        masked = None
        for i, s in enumerate(seqs):
            if s.num_output_tokens < s.params.min_tokens and (ids := self.output.stop_ids(s)):
                masked = raw.clone() if masked is None else masked
                masked[i, ids] = float("-inf")
        masked = raw if masked is None else masked
        if all(p.greedy for p in params):
            processed = masked
            tokens = torch.argmax(masked, dim=-1)
        else:
            processed = process_logits(masked, params)
            vocab = logits.shape[1]
            tokens = sample(processed, params, [None if s.params.greedy else
                                                s.noise(s.num_output_tokens, vocab) for s in seqs])
        tokens = tokens.tolist()
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        entries: list[dict[int, Logprob] | None] = [None] * len(seqs)
        if want:
            src = raw if self.logprobs_mode == "raw_logprobs" else processed
            lps = torch.log_softmax(src[want].float(), dim=-1)
            for j, i in enumerate(want):
                entries[i] = self._logprob_entry(lps[j], tokens[i], params[i].logprobs)
        return tokens, entries

    def _logprob_entry(self, lp: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
        def decoded(t: int) -> str | None:
            return self.tokenizer.decode([t]) if self.tokenizer is not None else None

        value = float(lp[token])
        out = {token: Logprob(value, int((lp > value).sum()) + 1, decoded(token))}
        if k:
            top = torch.topk(lp, k)
            for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                if t not in out:
                    out[t] = Logprob(v, rank, decoded(t))
        return out

    def _request_output(self, req: Request, now: float) -> RequestOutput:
        del self.requests[req.request_id]
        outs = [CompletionOutput(
            index=s.index, text=s.text, token_ids=s.output_token_ids, logprobs=s.logprobs,
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in req.seqs]
        seqs = req.seqs
        spec_steps = sum(s.num_spec_steps for s in seqs)
        depth = max((len(s.accepted_per_depth) for s in seqs), default=0)
        metrics = {
            "arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
            "finished_time": now, "num_prompt_tokens": len(req.prompt_token_ids),
            "num_generated_tokens": sum(len(o.token_ids) for o in outs),
            "target_forwards": sum(s.num_forwards for s in seqs),
            "spec_steps": spec_steps,
            "drafted_tokens": sum(s.num_drafted for s in seqs),
            "accepted_tokens": sum(s.num_accepted for s in seqs)}
        if spec_steps:
            metrics["acceptance_length"] = (metrics["accepted_tokens"] + spec_steps) / spec_steps
            metrics["acceptance_rate_per_depth"] = [
                sum(s.accepted_per_depth[d] for s in seqs if d < len(s.accepted_per_depth))
                / spec_steps for d in range(depth)]
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, True, metrics)
