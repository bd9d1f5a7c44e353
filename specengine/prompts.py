"""Prompts as ``LLM.generate`` / ``score`` / ``chat`` take them, made into what the engine
runs: token ids (``to_token_ids``), a sample to continue (``partial_of``), a conversation
through the chat template (``encode_chat``, ``chat_prompts``), and the ``max_logprobs`` cap
(``check_logprobs``)."""

from __future__ import annotations

from specengine.engine.sequence import PartialSample
from specengine.sampling.params import SamplingParams


def to_token_ids(prompt, i: int, tokenizer) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of prompt ``i``: a string (tokenized), a list of token ids,
    or a dict with ``"prompt"`` / ``"prompt_token_ids"`` (and optionally ``"partial"``).

    Raises:
        ValueError: text without a ``tokenizer``, a dict with unknown keys or neither key, any
            other type.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt {i} is text but the model has no tokenizer")
        return prompt, tokenizer(prompt).input_ids
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "partial"}
        if unknown:
            raise ValueError(f"prompt {i}: unknown keys {sorted(unknown)}")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return to_token_ids(prompt["prompt"], i, tokenizer)
        raise ValueError(f"prompt {i}: a dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise ValueError(f"prompt {i} has type {type(prompt).__name__}; expected str, list of "
                     "token ids or a dict with 'prompt' / 'prompt_token_ids'")


def partial_of(prompt, i: int) -> PartialSample | None:
    """A dict prompt's ``"partial"`` (a ``PartialSample`` or a dict of its fields
    ``{"token_ids", "index", "weight_versions"}``, see ``continuation_prompts``), else None:
    a sample cut short to continue, one sample, equal with the same seed and weights to the
    sample never interrupted (``Engine.add_request``).

    Raises:
        ValueError: a ``"partial"`` that is neither.
    """
    part = prompt.get("partial") if isinstance(prompt, dict) else None
    if part is None or isinstance(part, PartialSample):
        return part
    if not isinstance(part, dict) or not isinstance(part.get("token_ids"), (list, tuple)) \
            or set(part) - {"token_ids", "index", "weight_versions"}:
        raise ValueError(f"prompt {i}: 'partial' must be a dict with 'token_ids' (list) and "
                         "optionally 'index' and 'weight_versions'")
    return PartialSample(list(part["token_ids"]), part.get("index", 0),
                         part.get("weight_versions"))


def check_logprobs(p: SamplingParams, cap: int, what: str) -> None:
    """Raise ValueError naming ``what`` when ``p.logprobs`` or ``p.prompt_logprobs`` is above
    ``cap`` (``max_logprobs``; -1: no limit)."""
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if cap >= 0 and k is not None and k > cap:
            raise ValueError(f"{what}: {name}={k} is above max_logprobs={cap} (raise it "
                             "with LLM(max_logprobs=...))")


def encode_chat(tokenizer, conv: list[dict], what: str = "conversation",
                add_generation_prompt: bool = True,
                chat_template_kwargs: dict | None = None) -> tuple[str, list[int]]:
    """Apply ``tokenizer``'s chat template to one conversation; returns (text, token ids).

    Raises:
        ValueError: naming ``what``, if ``conv`` is not a non-empty list of role/content dicts.
    """
    if not isinstance(conv, list) or not conv or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in conv):
        raise ValueError(f"{what} must be a non-empty list of "
                         "{'role': str, 'content': str} dicts")
    text = tokenizer.apply_chat_template(
        conv, tokenize=False, add_generation_prompt=add_generation_prompt,
        **(chat_template_kwargs or {}))
    return text, tokenizer(text, add_special_tokens=False).input_ids


def chat_prompts(tokenizer, model_name: str, messages, add_generation_prompt: bool = True,
                 chat_template_kwargs: dict | None = None) -> list[dict]:
    """``generate`` prompts (``{"prompt", "prompt_token_ids"}``) of one conversation (a list
    of ``{"role", "content"}`` dicts) or a list of them.

    Raises:
        ValueError: no tokenizer or no chat template; a malformed conversation.
    """
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {model_name!r} has no chat template")
    if messages and isinstance(messages[0], dict):
        messages = [messages]
    prompts = []
    for i, conv in enumerate(messages):
        text, ids = encode_chat(tokenizer, conv, f"conversation {i}", add_generation_prompt,
                                chat_template_kwargs)
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    return prompts


def prepare_prompts(engine, prompts: list, params: list[SamplingParams], tokenizer,
                    max_logprobs: int) -> tuple[list, list[PartialSample | None]]:
    """``(tokenized, partials)`` of ``generate``'s prompts, every one checked before anything
    runs: ``tokenized`` ``(text or None, token ids)`` per prompt (``to_token_ids``),
    ``partials`` the sample each continues or None (``partial_of``).

    Raises:
        ValueError: a params' logprobs above ``max_logprobs``, a bad prompt, one the engine
            refuses (``Engine.validate_prompt``: empty, too long, ids outside the vocabulary)
            or a partial sample that does not fit it (``Engine.check_partial``).
    """
    for i, p in enumerate(params):
        check_logprobs(p, max_logprobs, f"prompt {i}")
    tokenized = [to_token_ids(p, i, tokenizer) for i, p in enumerate(prompts)]
    partials = [partial_of(p, i) for i, p in enumerate(prompts)]
    for i, ((_, ids), part, p) in enumerate(zip(tokenized, partials, params)):
        engine.validate_prompt(ids, f"prompt {i}")
        if part is not None:
            engine.check_partial(part, ids, p, f"prompt {i}")
    return tokenized, partials
