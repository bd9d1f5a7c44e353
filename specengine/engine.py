"""The step loop: schedule -> run the model -> sample -> append tokens and check stops.

One ``Engine.step()`` advances every running sequence by one token and admits waiting
requests; finished requests come back as ``RequestOutput``s.
"""

from __future__ import annotations

import time

import torch

from specengine import ops
from specengine.attention import make_backend
from specengine.batch import BatchEntry
from specengine.config import EngineConfig
from specengine.kv.block_manager import BlockManager
from specengine.metrics import EngineMetrics, request_metrics
from specengine.model_runner import ModelRunner
from specengine.output_processor import OutputProcessor
from specengine.outputs import RequestOutput, request_output
from specengine.sampler import Sampler
from specengine.sampling import SampleNoise, SamplingParams
from specengine.scheduler import Scheduler
from specengine.sequence import Request, Sequence
from specengine.speculative.drafters.base import Drafter, prune_tree
from specengine.speculative.policy import StaticPolicy, StepRecord
from specengine.speculative.strategy import Strategy


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
                                   self.runner.copy_block)
        self.scheduler = Scheduler(config, self.blocks)
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
        self.metrics.record_request(len(prompt_token_ids))
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

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step loop --------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished in it.

        schedule -> draft (speculation) -> one target forward -> sample / verify -> KV commit
        -> append tokens one at a time with the stop rules.
        """
        strategy = None
        if self.drafter is not None:
            strategy = self.policy.choose(len(self.scheduler.running))
        entries = self.scheduler.schedule(lookahead=strategy.budget if strategy else 0)
        rows = sum(e.num_new + (strategy.budget if strategy and not e.is_prefill else 0)
                   for e in entries)
        with ops.kernel_threads(ops.packed_covers(rows)):  # decode-sized: kernels' threads only
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
            tokens, lps = self.sampler.sample(logits[rows], seqs)
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
            feats = hidden[rows]
            for s in e.samplers or [e.seq]:
                self.drafter.observe(s, s.num_cached - len(rows), feats)

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
        seq, tree = e.seq, e.tree
        accepted, tokens, lps = self.sampler.verify(seq, tree, logits)
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
        return seq, tokens, lps, accepted

    def _request_output(self, req: Request, now: float) -> RequestOutput:
        """The finished ``req``'s output (dropped from the engine's requests)."""
        del self.requests[req.request_id]
        return request_output(req, request_metrics(req, now))
