"""Normalizing a pool's ``generate`` arguments and drawing the seeds of unseeded requests.

The pool accepts exactly what ``LLM.generate`` accepts (a string, a list of token ids, a
``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` dict, or a list of these; one
``SamplingParams`` or one per prompt) and turns it into ``PoolRequest``s. Seeds: an ``Engine``
gives a request without ``SamplingParams.seed`` the next draw of ``torch.randint(0, 2**62)``
from a generator seeded with ``LLM(seed=...)`` (``engine.py::add_request``), in the order the
requests are added. ``SeedSource`` makes those same draws centrally, in input order, so a pool
built with ``seed=s`` samples what one ``LLM(seed=s)`` samples for the same sequence of
``generate`` calls, whichever actor runs a request.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from specengine.sampling.params import SamplingParams, per_prompt


@dataclass
class PoolRequest:
    """One prompt of a pool ``generate`` call.

    Attributes:
        index: position in the call's input (outputs come back in this order).
        prompt: the prompt as given (str, list of token ids, or dict), sent to an actor as is.
        params: its sampling parameters, with ``seed`` always set (drawn by ``SeedSource``
            when the caller left it None).
        key: identical prompts have equal keys (they are kept on one actor).
        prompt_len: prompt length in tokens (for text, an estimate: characters / 4).
    """

    index: int
    prompt: object
    params: SamplingParams
    key: tuple
    prompt_len: int


def _key_and_len(prompt, i: int) -> tuple[tuple, int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"prompt {i}: the prompt is empty")
        return ("text", prompt), max(1, len(prompt) // 4)
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown:
            raise ValueError(f"prompt {i}: unknown keys {sorted(unknown)}")
        if "prompt_token_ids" in prompt:
            return _key_and_len([int(t) for t in prompt["prompt_token_ids"]], i)
        if "prompt" in prompt:
            return _key_and_len(prompt["prompt"], i)
        raise ValueError(f"prompt {i}: a dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        if not prompt:
            raise ValueError(f"prompt {i}: the prompt is empty")
        return ("ids", tuple(prompt)), len(prompt)
    raise ValueError(f"prompt {i} has type {type(prompt).__name__}; expected str, list of "
                     "token ids or a dict with 'prompt' / 'prompt_token_ids'")


class SeedSource:
    """The seeds an ``Engine`` built with ``seed`` would give unseeded requests, in order.

    ``draw()`` returns ``int(torch.randint(0, 2**62, (1,), generator=g))`` for a
    ``torch.Generator().manual_seed(seed)`` ``g``, as ``Engine.add_request`` does.
    ``state()`` / ``restore()`` undo draws of a call that failed before anything ran (as one
    ``LLM`` draws nothing when its validation fails).
    """

    def __init__(self, seed: int = 0):
        self.rng = torch.Generator().manual_seed(seed)

    def draw(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self.rng))

    def state(self) -> torch.Tensor:
        return self.rng.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.rng.set_state(state)


def prepare(prompts, sampling_params, seeds: SeedSource) -> list[PoolRequest]:
    """``generate``'s arguments as ``PoolRequest``s in input order, unseeded requests seeded
    from ``seeds`` (the params object is copied first; the caller's is never changed).

    Raises:
        ValueError: a prompt of the wrong type or empty, a params list of the wrong length,
            a params entry that is not ``SamplingParams``; no seed is drawn then.
    """
    prompts, params = per_prompt(prompts, sampling_params)
    keyed = [_key_and_len(p, i) for i, p in enumerate(prompts)]
    out = []
    for i, (prompt, p, (key, n)) in enumerate(zip(prompts, params, keyed)):
        if p.seed is None:
            p = copy.copy(p)
            p.seed = seeds.draw()
        out.append(PoolRequest(i, prompt, p, key, n))
    return out
