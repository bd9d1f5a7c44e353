"""Sampling parameters (vLLM's names, ``SamplingParams``) and the sampling noise
(``noise_rows``, ``SampleNoise``). The processing of logits (temperature, top-k, top-p (nucleus,
Holtzman et al. 2019), min-p) and the draw (greedy argmax at temperature 0, else the exponential
race) are ``specengine.sampling.batched``'s; ``specengine.sampling.sampler.Sampler`` puts them
together, after the ``min_tokens`` masking of stop tokens.

Draws use the exponential race (the Gumbel-max trick): the token at output position ``j`` of a
sample is ``argmax(p_j / E_j)`` with ``E_j ~ Exp(1)^V`` counter-based on
``(seed, sample index, j)`` (``noise_rows``). That is an exact draw from ``p_j``, and since the
noise depends on the position only, the token is the same whatever else is in the batch,
whether or not the sample was preempted, and whether it was drafted and verified speculatively
or decoded plainly: speculative sampling gives token for token the plain sampling output of the
same seed.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specengine.ops.extension import ext

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's convention)


@dataclass
class SamplingParams:
    """How to sample one request (vLLM-compatible names).

    Attributes:
        n: samples per prompt (>= 1); they share the prompt's KV blocks.
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0).
        top_p: nucleus mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 or -1 disables.
        min_p: drop tokens with probability < min_p * max probability; in [0, 1].
        seed: per-request seed; None draws one from the engine's seeded generator.
        stop: stop strings; the text is cut before the first match (vLLM semantics).
        stop_token_ids: token ids that end the request (kept in ``token_ids``).
        include_stop_str_in_output: keep the stop string / stop token's text in ``text``.
        max_tokens: maximum generated tokens (>= 1).
        min_tokens: EOS and stop tokens are masked out until this many tokens were generated.
        ignore_eos: keep generating after EOS.
        logprobs: number of top log-probabilities to return per token (the sampled token's is
            always included); None returns none.
        prompt_logprobs: number of top log-probabilities to return per prompt token (the
            prompt token's is always included; the first token has none: ``None``), from a
            prefill of the whole prompt (a request asking for them takes no prefix-cache
            hit); None returns none (vLLM's name; ``RequestOutput.prompt_logprobs``).
        skip_special_tokens: drop special tokens from ``text``.
        repetition_penalty: > 0 (1 disables): the logit of every token that occurs in the
            prompt or the output so far is divided by it when positive, multiplied by it
            otherwise (HF / vLLM; ``specengine.sampling.penalties``).
        presence_penalty: in [-2, 2] (0 disables): subtracted from the logit of every token
            that occurs in the output so far (OpenAI / vLLM; the prompt does not count).
        frequency_penalty: in [-2, 2] (0 disables): times a token's count in the output so
            far, subtracted from its logit.
        return_hidden_states: also return, per sample, the target's last hidden state (after
            the final norm) that produced each generated token (SGLang's name;
            ``CompletionOutput.hidden_states``).

    Raises:
        ValueError: a value outside its range, naming the parameter.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    return_hidden_states: bool = False
    _stop: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            if not is_real(getattr(self, name)):
                raise bad(name, "must be a finite number")
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            if not is_int(getattr(self, name)):
                raise bad(name, "must be an integer")
        if self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be an integer: -1 or 0 to disable, or >= 1")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise bad(name, "must be in [-2, 2] (0 disables it)")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.logprobs is not None and (not is_int(self.logprobs) or self.logprobs < 0):
            raise bad("logprobs", "must be None or an integer >= 0")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", "must be None or an integer >= 0")
        if not isinstance(self.return_hidden_states, bool):
            raise bad("return_hidden_states", "must be True or False")
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        self._stop = stop
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition / presence / frequency penalties is on."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def stop_strings(self) -> list[str]:
        return self._stop

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Build from a dict, rejecting unknown keys with a ValueError that names them."""
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


def per_prompt(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
    """``generate``'s arguments as a list of prompts and one ``SamplingParams`` each.

    Args:
        prompts: one prompt (a string, a list of token ids, a dict) or a list of them.
        sampling_params: one ``SamplingParams`` for all, a list with one per prompt, or None
            (the defaults).

    Raises:
        ValueError: a params list of the wrong length, or an entry that is not
            ``SamplingParams``.
    """
    if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts
            and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    prompts = list(prompts)
    params = sampling_params if sampling_params is not None else SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] is a {type(p).__name__}, not SamplingParams")
    return prompts, params


def noise_rows(key: int, positions: list[int], vocab: int) -> torch.Tensor:
    """``[len(positions), vocab]`` float32 ``Exp(1)`` noise of output ``positions`` of the noise
    stream ``key`` (a 62-bit int). Counter-based (``csrc/noise.cpp``: SplitMix64 of (key,
    position, token), then ``-log1p(-u)``): a row depends on nothing else, so any subset of rows
    can be drawn in any order. Without the C++ extension, torch's generator seeded by (key,
    position) gives noise of the same distribution but other values (consistent within a
    process, which is all losslessness needs)."""
    mod = ext()
    if mod is not None:
        return mod.exponential_noise(key, torch.tensor(positions, dtype=torch.int64), vocab)
    gen = torch.Generator()
    out = torch.empty(len(positions), vocab)
    for r, pos in enumerate(positions):
        gen.manual_seed(hash((key, pos)) & ((1 << 63) - 1))
        out[r].exponential_(generator=gen)
    return out


class SampleNoise:
    """The sampling noise of one sample: ``E_j ~ Exp(1)^V`` per output position ``j``
    (``noise_rows`` of this sample's stream).

    The last ``CACHE_SIZE`` draws are kept (keyed by position and vocabulary size): drafting
    and verification ask for the same few positions every step.

    Args:
        seed: the request's seed. sample_index: which of its ``n`` samples.
    """

    CACHE_SIZE = 10  # positions: a draft of depth <= 9 and its verification

    def __init__(self, seed: int, sample_index: int):
        self.key = hash((seed, sample_index)) & ((1 << 62) - 1)
        self._cache: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()

    @classmethod
    def from_key(cls, key: int) -> SampleNoise:
        """The stream of ``key`` (another stream's ``key``: a sample moved to another engine
        draws the same noise at every position).

        Raises:
            ValueError: ``key`` not an int in ``[0, 2**62)``.
        """
        if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < 1 << 62:
            raise ValueError(f"SampleNoise key={key!r}: must be an int in [0, 2**62)")
        noise = cls.__new__(cls)
        noise.key = key
        noise._cache = OrderedDict()
        return noise

    def __call__(self, position: int, vocab: int) -> torch.Tensor:
        """``[vocab]`` float32 noise of output position ``position`` (0 = first output token);
        shared with the cache, so callers must not modify it."""
        e = self.cached(position, vocab)
        if e is None:
            e = noise_rows(self.key, [position], vocab)[0]
            self.store(position, vocab, e)
        return e

    def cached(self, position: int, vocab: int) -> torch.Tensor | None:
        """The cached row of ``position`` (now the most recent), or None."""
        e = self._cache.get((position, vocab))
        if e is not None:
            self._cache.move_to_end((position, vocab))
        return e

    def store(self, position: int, vocab: int, row: torch.Tensor) -> None:
        """Cache ``row`` ``[vocab]`` (this stream's noise at ``position``, e.g. drawn in a batch
        by ``batched.gather_noise``), dropping the least recent beyond ``CACHE_SIZE``."""
        self._cache[(position, vocab)] = row
        self._cache.move_to_end((position, vocab))
        if len(self._cache) > self.CACHE_SIZE:
            self._cache.popitem(last=False)
