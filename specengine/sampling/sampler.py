"""The ``Sampler``: from the target's logits to committed tokens and their logprob entries, for
plain rows and verified token trees alike.

Every row goes through the same pieces: the ``min_tokens`` masking of stop ids
(``mask_stop_ids``), the processing (``process``: temperature, top-k, top-p, min-p), then a
draw (greedy argmax, or the exponential race with the sequence's noise: ``batched.draw`` for
plain rows; for a token tree the race of every row, then ``sampling.verify.walk`` along the
tree), then the logprob entries vLLM returns (``logprob_entries``). Every step is batched over
the rows (``specengine.sampling.batched``), with the per-row definitions' results bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from specengine.engine.sequence import Logprob, Sequence
from specengine.sampling.batched import (
    NoiseStreams,
    argmax_rows,
    draw,
    is_plain,
    process_rows,
    softmax_race,
)
from specengine.sampling.params import SamplingParams
from specengine.sampling.penalties import penalize, tree_paths
from specengine.sampling.verify import check_tree_logits, committed_tokens, walk
from specengine.speculative.tree import DraftTree

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
        stop_ids: the token ids that would end a sequence (``OutputProcessor.stop_ids``); they
            are masked out while the sequence has fewer than ``min_tokens`` output tokens.

    Every row's logits are penalised right after the ``min_tokens`` mask with the repetition /
    presence / frequency penalties of the row's own context (``penalties.penalize``): a tree
    row's context is the committed tokens plus the draft tokens on its root-to-node path
    (``penalties.tree_paths``), so verification stays exact.

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
        ``seqs[i]``'s, at its next output position): all rows processed together, the noise
        of every sampled row raced in one extension call (``specengine.sampling.batched``).

        Returns:
            ``(tokens, entries)``: one token id and one logprob entry (None when the sequence
            asks for no logprobs) per row.
        """
        positions = [s.num_output_tokens for s in seqs]
        params = [s.params for s in seqs]
        if all(p.logprobs is None for p in params):  # nothing reads the raw logits but the draw
            with self.stop_ids_masked(logits, seqs, positions) as masked:
                processed = self.process(penalize(masked, seqs), params)
                return self._draw(processed, seqs, positions), [None] * len(seqs)
        masked = penalize(self.mask_stop_ids(logits, seqs, positions), seqs)
        processed = self.process(masked, params)
        tokens = self._draw(processed, seqs, positions)
        return tokens, self.logprob_entries(logits, masked, params, list(range(len(seqs))),
                                            tokens, processed)

    @staticmethod
    def _draw(processed: torch.Tensor, seqs: list[Sequence], positions: list[int]) -> list[int]:
        """``batched.draw`` of every row: greedy rows' argmax, the others' race against the
        noise of their sequence at its output position."""
        params = [s.params for s in seqs]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        noise = NoiseStreams([seqs[i].noise.key for i in sampled],
                             [positions[i] for i in sampled]) if sampled else None
        return draw(processed, params, noise).tolist()

    def verify_trees(self, seqs: list[Sequence], trees: list[DraftTree],
                     logits: list[torch.Tensor]
                     ) -> list[tuple[list[int], list[int], list[LogprobEntry | None]]]:
        """Verify every token tree of a step (each drafted after its sequence's last token)
        against the target's logits: the committed tokens are exactly what ``sample`` would
        have drawn one position at a time. Sampled trees are walked depth by depth
        (``race_walk``): per depth, the rows the walks reach, of all trees together, are
        processed and their softmax raced against each row's noise (its sequence's stream at
        the row's depth) in one extension call (``argmax(softmax(process(rows)) / E_depth)``);
        rows no walk reaches are never computed (their draws could not change a commit).
        Greedy trees take each row's argmax; then each tree's ``sampling.verify.walk``.

        Args:
            seqs, trees: the sequence of each tree and the tree.
            logits: per tree ``[1 + m, V]`` float32 target logits (row 0 follows the root,
                row ``1 + i`` follows node ``i``).

        Returns:
            Per tree ``(accepted, tokens, entries)``: the accepted node indices (root
            excluded), the tokens to commit (accepted nodes' tokens, then the bonus token) and
            one logprob entry (or None) per token.

        Raises:
            ValueError: the three lists differ in length, a tree's logits are not
                ``[1 + m, V]``, or a draft token is outside the vocabulary.
        """
        check_tree_logits(len(seqs), trees, logits)
        masked = [self.mask_tree(s, t, lg) for s, t, lg in zip(seqs, trees, logits)]
        depths = [[0] + t.depths for t in trees]
        best: list[list[int] | None] = [None] * len(trees)  # the target's token of each row
        sampled = [t for t, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            for t, b in zip(sampled, self.race_walk([seqs[t] for t in sampled],
                                                    [trees[t] for t in sampled],
                                                    [masked[t] for t in sampled])):
                best[t] = b
        out = []
        for t, (seq, tree) in enumerate(zip(seqs, trees)):
            if best[t] is None:
                best[t] = argmax_rows(masked[t]).tolist()
            accepted, bonus = walk(tree, best[t])
            tokens = committed_tokens(tree, accepted, bonus)
            rows = [0] + [1 + a for a in accepted]
            out.append((accepted, tokens, self.logprob_entries(
                logits[t], masked[t], [seq.params] * len(depths[t]), rows, tokens)))
        return out

    def race_walk(self, seqs: list[Sequence], trees: list[DraftTree],
                  masked: list[torch.Tensor]) -> list[list[int]]:
        """The exponential-race draws of sampled trees' rows, only where ``walk`` reads them.

        A walk reads the row of the root, then of each node it accepts (``verify.walk``), so
        the rows are drawn depth by depth: per depth one ``softmax_race`` over the rows the
        walks reached, of all trees, each row ``process``-ed with its sequence's params and
        raced against its sequence's noise at output position ``num_output_tokens + depth``.
        A row's draw depends on that row alone (the processing and the race are row-wise), so
        the draws equal those of every row computed at once (what the SpecInfer-style verify,
        arXiv 2305.09781, does), in at most ``max depth + 1`` calls over ~``tau`` rows per
        tree instead of one over ``1 + m``.

        Args:
            seqs, trees: sampled sequences and their trees.
            masked: per tree ``[1 + m, V]`` float32 logits after ``mask_tree``.

        Returns:
            Per tree ``1 + m`` token ids: the draw of each row a walk reached, -1 elsewhere.
        """
        best = [[-1] * (1 + t.num_nodes) for t in trees]
        frontier = [(t, -1) for t in range(len(trees))]  # (tree, node whose row is next)
        depth = 0
        while frontier:
            rows = [masked[t][node + 1:node + 2] for t, node in frontier]
            params = [seqs[t].params for t, _ in frontier]
            streams = NoiseStreams([seqs[t].noise.key for t, _ in frontier],
                                   [seqs[t].num_output_tokens + depth for t, _ in frontier])
            x, at = shared_rows(rows)
            if at is None or not all(is_plain(p, x.shape[1]) for p in params):
                x, at = self.process(x if at is None else x[at], params), None
            drawn = softmax_race(x, streams, at).tolist()
            reached = []
            for (t, node), token in zip(frontier, drawn):
                best[t][node + 1] = token
                child = trees[t].child_with(node, token)
                if child is not None:
                    reached.append((t, child))
            frontier, depth = reached, depth + 1
        return best

    def mask_tree(self, seq: Sequence, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
        """A tree's ``logits`` ``[1 + m, V]`` after ``mask_stop_ids`` (row r at the output
        position of its depth) and the request's penalties (row r's context: the committed
        tokens plus the draft path to its node); a clone when changed, else ``logits``."""
        n_out, depths = seq.num_output_tokens, [0] + tree.depths
        masked = self.mask_stop_ids(logits, [seq] * len(depths), [n_out + d for d in depths])
        return penalize(masked, [seq] * len(depths), paths=tree_paths(tree))

    def mask_stop_ids(self, logits: torch.Tensor, seqs: list[Sequence],
                      positions: list[int]) -> torch.Tensor:
        """``logits`` ``[R, V]`` with the stop ids of ``seqs[r]`` set to ``-inf`` in every row
        ``r`` whose token lands at output position ``positions[r]`` < ``min_tokens``; a clone
        when any row is masked, else ``logits`` itself."""
        where = self._stop_entries(seqs, positions)
        if where is None:
            return logits
        masked = logits.clone()
        masked[where] = float("-inf")  # one scatter
        return masked

    @contextmanager
    def stop_ids_masked(self, logits: torch.Tensor, seqs: list[Sequence],
                        positions: list[int]) -> Iterator[torch.Tensor]:
        """``mask_stop_ids`` without the copy: the stop ids are set to ``-inf`` in ``logits``
        itself for the ``with`` block and their values put back when it ends (also on an
        error), for callers that read no raw logit inside it. At 64 rows of a 49,152-token
        vocabulary the clone took 3-5 ms of a 47 ms decode step (2-core Intel Xeon), every step
        of a request with ``min_tokens``."""
        where = self._stop_entries(seqs, positions)
        if where is None:
            yield logits
            return
        with torch.inference_mode():  # the forward's logits are inference tensors
            kept = logits[where]
            logits[where] = float("-inf")
        try:
            yield logits
        finally:
            with torch.inference_mode():
                logits[where] = kept

    def _stop_entries(self, seqs: list[Sequence], positions: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (rows, columns) ``mask_stop_ids`` sets to ``-inf``, or None when none."""
        rows, cols = [], []
        for r, (s, pos) in enumerate(zip(seqs, positions)):
            if pos < s.params.min_tokens and (ids := self.stop_ids(s)):
                rows += [r] * len(ids)
                cols += ids
        return (torch.tensor(rows), torch.tensor(cols)) if rows else None

    @staticmethod
    def process(masked: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The logits sampled from: ``batched.process_rows`` (temperature, top-k, top-p,
        min-p) of ``masked`` ``[R, V]``, one SamplingParams per row, batched; ``masked`` itself
        when no row changes (every row greedy, or at temperature 1 with no filter)."""
        return process_rows(masked, params, copy=False)

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

    def prompt_rows(self, logits: torch.Tensor, params: SamplingParams, tokens: list[int]
                    ) -> list[LogprobEntry]:
        """vLLM's ``prompt_logprobs``: one entry per prompt token, from the row that precedes
        it. ``logits`` ``[R, V]`` float32 rows of the prompt's positions, ``tokens`` the ``R``
        tokens that follow them; ``params.prompt_logprobs`` top tokens per entry. The
        engine's ``logprobs_mode`` applies (processed: temperature / top-k / top-p / min-p, no
        output-dependent masks or penalties: no output exists yet)."""
        if self.logprobs_mode == "raw_logprobs":
            src = logits
        else:
            src = self.process(logits, [params] * len(tokens))
        lps = torch.log_softmax(src.float(), dim=-1)
        return [self.logprob_entry(lps[j], t, params.prompt_logprobs)
                for j, t in enumerate(tokens)]

    def score_rows(self, logits: torch.Tensor, seq: Sequence, completion: list[int],
                   first: int, k: int | None) -> tuple[list[float], list[float],
                                                       list[LogprobEntry | None]]:
        """Teacher-forced logprobs of ``completion[first:first + R]`` (a sample of ``seq``'s
        prompt drawn with ``seq.params``), from ``logits`` ``[R, V]`` float32, row ``j``
        preceding ``completion[first + j]``: exactly what generation returned for those tokens.

        Each row goes through generation's own pieces (``mask_stop_ids`` at its output
        position, ``penalize`` with the completion so far as the row's context, ``process``)
        so the values equal, bit for bit, the generation-time logprobs of a batch-invariant
        engine.

        Returns:
            ``(raw, processed, entries)``: per token the raw log-probability
            (``log_softmax(logits)``), the processed one (of the distribution sampled from),
            and a logprob entry with the top ``k`` tokens in the engine's ``logprobs_mode``
            (None entries when ``k`` is None).
        """
        R = logits.shape[0]
        positions = list(range(first, first + R))
        tokens = completion[first:first + R]
        params = [seq.params] * R
        masked = self.mask_stop_ids(logits, [seq] * R, positions)
        masked = penalize(masked, [seq] * R, paths=[completion[:o] for o in positions])
        processed = self.process(masked, params)
        raw_lp = torch.log_softmax(logits.float(), dim=-1)
        proc_lp = torch.log_softmax(processed.float(), dim=-1)
        idx = torch.tensor(tokens, dtype=torch.int64).unsqueeze(1)
        raw = raw_lp.gather(1, idx).squeeze(1).tolist()
        proc = proc_lp.gather(1, idx).squeeze(1).tolist()
        src = raw_lp if self.logprobs_mode == "raw_logprobs" else proc_lp
        entries = [None] * R if k is None else [
            self.logprob_entry(src[j], t, k) for j, t in enumerate(tokens)]
        return raw, proc, entries

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


def shared_rows(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int] | None]:
    """``parts`` (``[1, V]`` rows) as ``(x, rows)`` with ``x[rows]`` equal to
    ``torch.cat(parts)``: when every part is a contiguous row of one storage, at whole-row
    offsets (the rows of a step's trees whose logits no mask changed: rows of the forward's
    ``[R, V]`` logits), ``x`` is a view of the rows from the first to the last of them and
    ``rows`` their indices in it, nothing copied; else ``(torch.cat(parts), None)``. Callers
    must not modify ``x``."""
    first = parts[0]
    V = first.shape[-1]
    storage = first.untyped_storage().data_ptr()
    if not all(p.dim() == 2 and p.shape == (1, V) and p.is_contiguous() and p.dtype == first.dtype
               and p.untyped_storage().data_ptr() == storage for p in parts):
        return torch.cat(parts), None
    offsets = [p.storage_offset() for p in parts]
    low = min(offsets)
    if any((o - low) % V for o in offsets):
        return torch.cat(parts), None
    rows = [(o - low) // V for o in offsets]
    return first.as_strided((max(rows) + 1, V), (V, 1), low), rows
