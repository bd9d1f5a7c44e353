"""Independent draft model (Leviathan et al. 2023; Chen et al. 2023): a smaller model with the
target's tokenizer drafts with its own paged KV cache.

Per sequence the drafter keeps a shadow sequence whose cached prefix is the longest common
prefix of what it last saw and the target sequence's committed tokens, so accepted draft tokens
keep their draft KV and rejected ones are simply overwritten: the draft state always advances by
exactly the accepted tokens. Trees: the draft's greedy chain, with the top-k alternatives at
each depth as extra leaves, the best ``budget`` nodes by cumulative draft probability kept. For
a sampled sequence "greedy" and "top-k" are taken over the draft scores perturbed by the
sequence's own sampling noise (``drafters.coupling``): the chain is then the draft's
sample coupled to the target's.
"""

from __future__ import annotations

import torch

from specengine.engine.batch import BatchEntry
from specengine.engine.model_runner import ModelRunner
from specengine.engine.sequence import Sequence
from specengine.kv.block_manager import BlockManager
from specengine.speculative.drafters.base import Drafter
from specengine.speculative.drafters.coupling import coupled_topk
from specengine.speculative.drafters.shadow import new_shadow, sync_shadow
from specengine.speculative.strategy import Strategy
from specengine.speculative.tree import DraftTree


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    """Raise ValueError unless both tokenizers map the same strings to the same ids."""
    if target_tok is None or draft_tok is None:
        return
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(f"draft model {draft_name!r} has a different tokenizer than the target "
                         f"{target_name!r} (vocabularies differ); a draft must share the "
                         "target's tokenizer")


class DraftModelDrafter(Drafter):
    """Drafts with ``model`` (a ``LlamaForCausalLM``) over its own KV pool.

    Args:
        strategy: default tree shape.
        model: the draft model.
        num_blocks, block_size: its KV pool.
        vocab_size: the target's vocabulary size (draft logits beyond it are dropped).
    """

    name = "draft_model"
    catches_up = True

    def __init__(self, strategy: Strategy, model, num_blocks: int, block_size: int,
                 vocab_size: int):
        super().__init__(strategy)
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, self.runner.copy_block)
        self.max_len = model.config.max_position_embeddings
        self.vocab_size = vocab_size
        self.shadows: dict[int, Sequence] = {}

    def kv_pools(self) -> list[torch.Tensor]:
        """The draft model's own KV pool (its runner's ``kv_cache``)."""
        return [self.runner.kv_cache]

    def _shadow(self, seq: Sequence) -> Sequence:
        sh = self.shadows.get(seq.seq_id)
        if sh is None:
            sh = self.shadows[seq.seq_id] = new_shadow(seq)
        return sh

    def release(self, seq: Sequence) -> None:
        sh = self.shadows.pop(seq.seq_id, None)
        if sh is not None:
            self.blocks.free(sh)

    def _sync(self, seq: Sequence, depth: int) -> Sequence | None:
        """Point the shadow at ``seq``'s tokens and reserve room for ``depth`` draft tokens;
        None if the draft cannot serve it (context too long, KV pool full)."""
        if len(seq) + depth > self.max_len:
            return None
        sh = self._shadow(seq)
        # shadow row j is keyed by token j; of the depth draft tokens all but the last are fed
        if not sync_shadow(self.blocks, sh, seq, 0, depth - 1):
            self.release(seq)  # its blocks are already free: drops the shadow
            return None
        return sh

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], strategy: Strategy) -> list[DraftTree | None]:
        d, k = strategy.depth, strategy.topk
        shadows = [self._sync(s, d) for s in seqs]
        live = [i for i, sh in enumerate(shadows) if sh is not None]
        out: list[DraftTree | None] = [None] * len(seqs)
        if not live:
            return out
        # per live sequence and depth: the top-k (token, logprob) candidates, chain token first
        cands = {i: [] for i in live}
        live_seqs = [seqs[i] for i in live]
        n_out = [s.num_output_tokens for s in live_seqs]  # output position of depth-1 tokens
        entries = [BatchEntry(shadows[i], len(shadows[i]) - shadows[i].num_cached, [],
                              is_prefill=True) for i in live]
        for step in range(d):
            logits, _ = self.runner.run(entries, self.blocks)
            chains = [shadows[i].token_ids[len(seqs[i]):] for i in live]  # drafted so far
            values, indices = coupled_topk(logits[:, :self.vocab_size].float(), k, live_seqs,
                                           [n + step for n in n_out], self.vocab_size, None,
                                           chains)
            for row, i in enumerate(live):
                sh = shadows[i]
                sh.num_cached = len(sh)
                toks, vals = indices[row].tolist(), values[row].tolist()
                cands[i].append([(t, lp) for t, lp in zip(toks, vals) if lp > -torch.inf])
                sh.token_ids.append(toks[0])
            if step + 1 < d:
                entries = [BatchEntry(shadows[i], 1, [], is_prefill=True) for i in live]
        for i in live:
            out[i] = self._tree(cands[i], strategy)
            sh = shadows[i]  # KV of the last drafted token was never written
            del sh.token_ids[sh.num_cached:]
        return out

    @staticmethod
    def _tree(cands: list[list[tuple[int, float]]], strategy: Strategy) -> DraftTree:
        """The greedy chain plus, at each depth, the top-k alternatives as leaves; the best
        ``budget`` nodes by cumulative draft log-probability. A node never outscores its parent,
        so the best nodes (ties broken by depth) always include their ancestors."""
        nodes = []  # (cumulative logprob, depth, token, on the chain, logprob)
        cum = 0.0
        for depth, options in enumerate(cands):
            nodes += [(cum + lp, depth, tok, j == 0, lp) for j, (tok, lp) in enumerate(options)]
            cum += options[0][1]
        kept = sorted(nodes, key=lambda n: (-n[0], n[1]))[:strategy.budget]
        tokens, parents, logps, chain_at = [], [], [], {-1: -1}
        for _, depth, tok, on_chain, lp in sorted(kept, key=lambda n: (n[1], not n[3])):
            parents.append(chain_at[depth - 1])
            if on_chain:
                chain_at[depth] = len(tokens)
            tokens.append(tok)
            logps.append(lp)
        return DraftTree(tokens, parents, logps, ["draft_model"] * len(tokens))
