"""The ``Sampler``: from the target's logits to committed tokens and their logprob entries, for
plain rows and verified token trees alike.

Every row goes through the same pieces: the ``min_tokens`` masking of stop ids
(``mask_stop_ids``), then a draw (greedy argmax, or the exponential race with the sequence's
noise: ``sampling.sample`` for plain rows, ``speculative.verify.verify`` along a token tree), then
the logprob entries vLLM returns (``logprob_entries``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specengine.penalties import penalize, tree_paths
from specengine.sampling import SamplingParams, process_logits, sample
from specengine.sequence import Logprob, Sequence
from specengine.speculative.tree import DraftTree
from specengine.speculative.verify import committed_tokens, verify

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

LogprobEntry = dict[int, Logprob]  # the sampled token's Logprob and the top-k tokens'


class Sampler:
    """Draws tokens and builds logprob entries.

    Args:
        tokenizer: decodes the tokens of logprob entries (None: ``decoded_token`` is None).
        logprobs_mode: ``"raw_logprobs"`` (log-softmax of the model's logits, before
            temperature/top-k/top-p/min-p; vLLM's default) or ``"processed_logprobs"`` (of the
            distribution actually sampled from, after them and after the ``min_tokens`` mask and
            the penalties).

    Every row's logits are penalised right after the ``min_tokens`` mask with the repetition /
    presence / frequency penalties of the row's own context (``penalties.penalize``): a tree
    row's context is the committed tokens plus the draft tokens on its root-to-node path
    (``penalties.tree_paths``), so verification stays exact.
        stop_ids: the token ids that would end a sequence (``OutputProcessor.stop_ids``); they
            are masked out while the sequence has fewer than ``min_tokens`` output tokens.

    Raises:
        ValueError: an unknown ``logprobs_mode``.
    """

    def __init__(self, tokenizer, logprobs_mode: str,
                 stop_ids: Callable[[Sequence], list[int]]):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r}: use one of {LOGPROBS_MODES}")
        self.tokenizer = tokenizer
        self.logprobs_mode = logprobs_mode
        self.stop_ids = stop_ids

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]
               ) -> tuple[list[int], list[LogprobEntry | None]]:
        """Next token of each sequence from its row of ``logits`` ``[B, V]`` float32 (row i is
        ``seqs[i]``'s, at its next output position).

        Returns:
            ``(tokens, entries)``: one token id and one logprob entry (None when the sequence
            asks for no logprobs) per row.
        """
        masked = self.mask_stop_ids(logits, seqs, [s.num_output_tokens for s in seqs])
        masked = penalize(masked, seqs)
        params = [s.params for s in seqs]
        processed = self.process(masked, params)
        vocab = logits.shape[1]
        noise = [None if p.greedy else s.noise(s.num_output_tokens, vocab)
                 for s, p in zip(seqs, params)]
        tokens = sample(processed, params, noise).tolist()
        return tokens, self.logprob_entries(logits, masked, params, list(range(len(seqs))),
                                            tokens, processed)

    def verify(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor
               ) -> tuple[list[int], list[int], list[LogprobEntry | None]]:
        """Verify ``tree`` (drafted after ``seq``'s last token) against the target's ``logits``
        ``[1 + m, V]`` float32 (row 0 follows the root, row ``1 + i`` follows node ``i``) with
        ``speculative.verify.verify``: the committed tokens are exactly what ``sample`` would
        have drawn one position at a time.

        Returns:
            ``(accepted, tokens, entries)``: the accepted node indices (root excluded), the
            tokens to commit (accepted nodes' tokens, then the bonus token) and one logprob
            entry (or None) per token.
        """
        p, n_out = seq.params, seq.num_output_tokens
        depths = [0] + tree.depths
        masked = self.mask_stop_ids(logits, [seq] * len(depths), [n_out + d for d in depths])
        masked = penalize(masked, [seq] * len(depths), paths=tree_paths(tree))
        noise = None if p.greedy else torch.stack(
            [seq.noise(n_out + d, logits.shape[1]) for d in range(tree.max_depth + 1)])
        accepted, bonus = verify(tree, masked, p, noise)
        tokens = committed_tokens(tree, accepted, bonus)
        rows = [0] + [1 + a for a in accepted]
        return accepted, tokens, self.logprob_entries(logits, masked, [p] * len(depths), rows,
                                                      tokens)

    def mask_stop_ids(self, logits: torch.Tensor, seqs: list[Sequence],
                      positions: list[int]) -> torch.Tensor:
        """``logits`` ``[R, V]`` with the stop ids of ``seqs[r]`` set to ``-inf`` in every row
        ``r`` whose token lands at output position ``positions[r]`` < ``min_tokens``; a clone
        when any row is masked, else ``logits`` itself."""
        masked = None
        for r, (s, pos) in enumerate(zip(seqs, positions)):
            if pos < s.params.min_tokens and (ids := self.stop_ids(s)):
                masked = logits.clone() if masked is None else masked
                masked[r, ids] = float("-inf")
        return logits if masked is None else masked

    @staticmethod
    def process(masked: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The logits sampled from: ``process_logits`` (temperature, top-k, top-p, min-p) of
        ``masked`` ``[R, V]``, one SamplingParams per row; ``masked`` itself when every row is
        greedy."""
        return masked if all(p.greedy for p in params) else process_logits(masked, params)

    def logprob_entries(self, logits: torch.Tensor, masked: torch.Tensor,
                        params: list[SamplingParams], rows: list[int], tokens: list[int],
                        processed: torch.Tensor | None = None) -> list[LogprobEntry | None]:
        """One logprob entry per token: ``tokens[i]`` was drawn from row ``rows[i]``.

        Args:
            logits: ``[R, V]`` float32 raw logits. masked: the same after ``mask_stop_ids``
                and the penalties.
            params: one SamplingParams per row of ``logits``; a row's ``logprobs`` is the
                number of top tokens in its entry (None: no entry).
            processed: ``process(masked, params)`` when already computed (it is computed here
                only in ``processed_logprobs`` mode).

        Returns:
            Per token ``{token_id: Logprob}`` (see ``logprob_entry``), or None.
        """
        want = [i for i, r in enumerate(rows) if params[r].logprobs is not None]
        entries: list[LogprobEntry | None] = [None] * len(tokens)
        if not want:
            return entries
        if self.logprobs_mode == "raw_logprobs":
            src = logits
        else:
            src = processed if processed is not None else self.process(masked, params)
        lps = torch.log_softmax(src[[rows[i] for i in want]].float(), dim=-1)
        for j, i in enumerate(want):
            entries[i] = self.logprob_entry(lps[j], tokens[i], params[rows[i]].logprobs)
        return entries

    def logprob_entry(self, lp: torch.Tensor, token: int, k: int) -> LogprobEntry:
        """``{token_id: Logprob}`` from one row of log-probabilities ``lp`` ``[V]``: the sampled
        ``token`` (rank 1 + the number of tokens strictly more likely) and the ``k`` most likely
        tokens (ranks 1..k), with their decoded text."""
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
