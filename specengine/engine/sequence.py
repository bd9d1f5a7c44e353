"""One generated sample (``Sequence``: its tokens, KV block table, noise, stop state and outputs
so far) and the request that groups a prompt's samples (``Request``)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

from specengine.sampling.params import SampleNoise, SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    """Log-probability of one token (vLLM's ``Logprob``): value, 1-based rank, decoded text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


_seq_ids = itertools.count()


class Sequence:
    """Sample ``index`` of request ``request_id``.

    ``num_cached`` counts the leading tokens whose K/V are in the cache; the tokens after it
    go through the model at the next step (the whole prompt at prefill, the last sampled token
    at decode). ``block_table`` lists KV block ids in position order. ``block_hashes`` holds
    the prefix-cache chain hashes of the leading full blocks computed so far, and
    ``num_registered_blocks`` how many leading blocks the prefix cache has already seen.
    """

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, noise: SampleNoise):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.noise = noise
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached = 0
        self.block_hashes: list[bytes] = []
        self.cache_salt = b""  # the prefix-cache namespace of its blocks (BlockManager.salt)
        self.num_registered_blocks = 0
        self.num_preemptions = 0  # times the scheduler freed its KV for recomputation
        # the prefill needs every prompt position's logits (prompt logprobs, LLM.score): the
        # scheduler gives it no prefix-cache hit and no shared prefill with other requests
        self.full_prefill = False
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.weight_versions: list[int] = []  # per output token: the weights that sampled it
        # target hidden states [r, H] per step that appended r tokens (return_hidden_states)
        self.hidden_states: list | None = [] if params.return_hidden_states else None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.penalty_counts = None  # specengine.sampling.penalties.PenaltyCounts, made on first use
        # statistics: target forwards, and per verify step drafted / accepted draft tokens
        self.num_forwards = 0
        self.num_spec_steps = 0
        self.num_drafted = 0
        self.num_accepted = 0
        self.accepted_per_depth: list[int] = []  # [d]: verify steps that accepted depth d+1
        # its length after the last step that drafted for it: the drafter has seen it through
        # there, so a draft now catches up on ``len(self) - drafted_through`` tokens
        self.drafted_through = 0
        # scored draft nodes verified: accepted, and predicted by the global calibration
        self.calib_accepted = 0
        self.calib_predicted = 0.0

    @property
    def catch_up(self) -> int:
        """Tokens committed in steps that did not draft for it, since the last that did (all
        of them before the first): what a drafter that keeps state per sequence (EAGLE's KV,
        a draft model's) must process before it can draft for it again."""
        return len(self.token_ids) - self.drafted_through

    def spec_stats(self, drafted: int, accepted: int) -> None:
        """Record one verify step of this sequence."""
        self.num_spec_steps += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.accepted_per_depth += [0] * (accepted - len(self.accepted_per_depth))
        for d in range(accepted):
            self.accepted_per_depth[d] += 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}#{self.index}, "
                f"len={len(self)}, cached={self.num_cached}, {self.status.value})")


@dataclass
class Request:
    """One prompt and its ``n`` samples, with the times its metrics report
    (``time.perf_counter`` seconds; ``first_token_time`` is None until a token was appended)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (None for the first), filled
    # by the prefill
    prompt_logprobs: list | None = None
    # LLM.score: the completion scored (the prompt holds all its tokens but the last), the
    # params it was sampled with, the top-k entries wanted, and the result
    score: ScoreSpec | None = None


@dataclass
class PartialSample:
    """A sample cut short (``finish_reason="abort"``) to continue: ``token_ids`` generated
    so far after the prompt, as sample ``index`` of its request (its noise stream: with the
    same seed and unchanged weights the continued sample equals one never interrupted), and
    the weight version of each of those tokens (None: unknown, recorded as -1)."""

    token_ids: list[int]
    index: int = 0
    weight_versions: list[int] | None = None


@dataclass
class ScoreSpec:
    """What ``LLM.score`` asks of a request: the teacher-forced logprobs of ``completion``
    as sampled with ``params`` after the prompt (``Sampler.score_rows``)."""

    prompt_len: int
    completion: list[int]
    params: SamplingParams
    logprobs: int | None = None
    into_sample: bool = False  # a continued sample: the entries become its logprobs
    raw: list[float] | None = None
    processed: list[float] | None = None
    entries: list | None = None
