"""Request intake: the checks ``Engine.add_request`` runs before admitting a request
(``RequestValidator``), its id (``RequestIds``) and the samples it makes of it
(``new_samples``)."""

from __future__ import annotations

import numbers

from specengine.engine.config import EngineConfig
from specengine.engine.sequence import PartialSample, ScoreSpec, Sequence
from specengine.kv.block_manager import cdiv
from specengine.sampling.params import SampleNoise, SamplingParams


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


class RequestIds:
    """Request ids of one engine: the ones callers give, or numbers ``"0"``, ``"1"``, ..."""

    def __init__(self):
        self.next = 0

    def take(self, request_id: str | None, in_use) -> str:
        """``request_id``, or the next number not ``in_use`` (a container of ids) when None.

        Raises:
            InvalidRequestError: ``request_id`` is ``in_use``.
        """
        if request_id is None:
            while str(self.next) in in_use:  # an id taken by a migrated request
                self.next += 1
            request_id = str(self.next)
            self.next += 1
        elif request_id in in_use:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use",
                                      "request_id")
        return request_id


class RequestValidator:
    """What a request may ask of one engine.

    Args:
        config: the engine's sizes (``max_model_len``, ``max_num_seqs``, ``block_size``).
        vocab_size: the target's vocabulary size V.
        num_blocks: KV blocks in the pool.
    """

    def __init__(self, config: EngineConfig, vocab_size: int, num_blocks: int):
        self.config = config
        self.vocab_size = vocab_size
        self.num_blocks = num_blocks

    def partial(self, partial: PartialSample, prompt: list[int], params: SamplingParams,
                what: str) -> None:
        """Raise ``InvalidRequestError`` unless ``partial`` can be continued after
        ``prompt``: token ids in the vocabulary, one weight version per token, fewer tokens
        than ``max_tokens`` and a sequence shorter than ``max_model_len``."""
        what = f"{what}: partial"
        ids = partial.token_ids
        if not isinstance(partial.index, int) or isinstance(partial.index, bool) \
                or partial.index < 0:
            raise InvalidRequestError(f"{what} index {partial.index!r} must be an int >= 0",
                                      "partial.index")
        vocab = self.vocab_size
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

    def prompt(self, ids: list[int], what: str, params: SamplingParams | None = None) -> None:
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
        vocab = self.vocab_size
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
        bs, pool = self.config.block_size, self.num_blocks
        total = min(len(ids) + params.max_tokens, limit)
        need = cdiv(total, bs)
        if need > pool:
            field = "prompt" if cdiv(len(ids), bs) > pool else "max_tokens"
            raise InvalidRequestError(
                f"{what}: {total} tokens (prompt + max_tokens) need {need} KV blocks but the "
                f"pool has {pool}; send a shorter prompt or a smaller max_tokens", field)


def new_samples(request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                partial: PartialSample | None, score: ScoreSpec | None
                ) -> tuple[list[Sequence], ScoreSpec | None]:
    """The samples of a new request: ``params.n`` of them, or the one ``partial`` continues
    (its tokens and weight versions appended; with ``logprobs``, a ``ScoreSpec`` that has the
    prefill recompute the partial output's logprobs into the sample). Each is flagged for a
    prefill of every prompt position when its logits are needed (prompt logprobs or a score:
    no prefix-cache hit).

    Returns:
        ``(samples, score)``: ``score`` is the given one, or the partial output's.
    """
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
    return seqs, score
