"""A GSM-style RL task: chat prompts with their answers, and an exact-answer reward.

Used by ``examples/grpo_trl.py``, ``bench/bench_rl.py`` and the TRL tests. The reward has
TRL's reward-function signature (``completions`` plus dataset columns as keyword arguments).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from specengine.data.prompt_sets import gsm_questions

INSTRUCTION = "Solve the problem. End your reply with the final number after '####'."
_MARKED = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_answer(text: str) -> str | None:
    """The answer a completion gives: the number after the last ``####``, else the last number
    in the text; commas removed, a trailing ``.`` dropped. None when there is no number.

    Raises:
        TypeError: ``text`` is not a str.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    marked = _MARKED.findall(text)
    found = marked or _NUMBER.findall(text)
    if not found:
        return None
    return found[-1].replace(",", "").rstrip(".")


def answers_equal(given: str | None, expected: str) -> bool:
    """Whether two numbers written as text are equal as decimals (``"15.0" == "15"``);
    False for None or text that is not a number."""
    if given is None:
        return False
    try:
        return Decimal(given.replace(",", "")) == Decimal(str(expected).replace(",", ""))
    except InvalidOperation:
        return False


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))  # TRL's conversational completion
    raise TypeError("a completion must be a str or a list of {'role', 'content'} messages, "
                    f"got {type(completion).__name__}")


def exact_answer_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 where the completion's ``final_answer`` equals the row's ``answer``, else 0.0.

    Args:
        completions: per row, a string or TRL's conversational completion
            (``[{"role": "assistant", "content": ...}]``).
        answer: per row, the expected number as text (the ``answer`` dataset column).
        **kwargs: the other columns TRL passes; ignored.

    Raises:
        ValueError: ``completions`` and ``answer`` differ in length.
        TypeError: a completion of another type.
    """
    if len(completions) != len(answer):
        raise ValueError(f"got {len(completions)} completions for {len(answer)} answers")
    return [1.0 if answers_equal(final_answer(_text(c)), a) else 0.0
            for c, a in zip(completions, answer)]


def gsm_task(n: int, seed: int = 1234) -> list[dict]:
    """``n`` GSM-style rows for a TRL dataset: ``prompt`` (a one-message conversation: the
    question and ``INSTRUCTION``) and ``answer`` (the number as text).

    ``seed`` picks the questions (``specengine.data.prompt_sets.gsm_questions``); the default 1234
    is held out from the shipped EAGLE drafter's training data (seed 0).

    Raises:
        ValueError: as ``gsm_questions`` (``n`` not a non-negative int).
    """
    return [{"prompt": [{"role": "user", "content": f"{q['question']}\n{INSTRUCTION}"}],
             "answer": q["answer"]} for q in gsm_questions(n, seed=seed)]
