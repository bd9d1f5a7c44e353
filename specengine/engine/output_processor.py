"""Appends sampled tokens to sequences one at a time and applies the stop rules exactly as
vLLM does: ``min_tokens``, EOS (unless ``ignore_eos``), stop token ids, stop strings (text cut
before the match unless ``include_stop_str_in_output``), ``max_tokens`` and ``max_model_len``."""

from __future__ import annotations

from specengine.engine.sequence import Logprob, Sequence


class OutputProcessor:
    """Token-by-token stop checks and detokenization.

    Args:
        tokenizer: a transformers tokenizer, or None (then ``text`` stays empty and stop
            strings are not supported).
        eos_token_ids: ids that end a sample unless ``ignore_eos``.
        max_model_len: a sample stops with ``"length"`` when it reaches this many tokens.
    """

    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len

    def stop_ids(self, seq: Sequence) -> list[int]:
        """Token ids that would end ``seq`` (masked while ``min_tokens`` is not reached)."""
        p = seq.params
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids |= self.eos_token_ids
        return sorted(ids)

    def append(self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None) -> bool:
        """Append ``token`` to ``seq``; returns True when ``seq`` is finished (its
        ``finish_reason``, ``stop_reason`` and final ``text`` are set then)."""
        p = seq.params
        seq.token_ids.append(token)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        n_out = seq.num_output_tokens
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return self._finish(seq, "stop", None, drop_last=not p.include_stop_str_in_output)
            if token in p.stop_token_ids:
                return self._finish(seq, "stop", token, drop_last=not p.include_stop_str_in_output)
            if p.stop_strings and self.tokenizer is not None and self._check_stop_strings(seq):
                return True
        if n_out >= p.max_tokens or len(seq) >= self.max_model_len:
            return self._finish(seq, "length", None)
        return False

    def decode(self, seq: Sequence) -> str:
        """The text of ``seq``'s output tokens so far (e.g. of a sample cut short)."""
        return self._decode(seq)

    def _decode(self, seq: Sequence, drop_last: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        ids = seq.output_token_ids
        if drop_last:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _check_stop_strings(self, seq: Sequence) -> bool:
        old_len = len(seq.text)
        seq.text = self._decode(seq)
        new_chars = max(len(seq.text) - old_len, 0)
        for stop in seq.params.stop_strings:
            i = seq.text.find(stop, max(0, len(seq.text) - new_chars - len(stop) + 1))
            if i != -1:
                end = i + len(stop) if seq.params.include_stop_str_in_output else i
                seq.text = seq.text[:end]
                seq.finish_reason, seq.stop_reason = "stop", stop
                return True
        return False

    def _finish(self, seq: Sequence, reason: str, stop_reason, drop_last: bool = False) -> bool:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        seq.text = self._decode(seq, drop_last=drop_last)
        return True
