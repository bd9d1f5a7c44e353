"""Multi-turn rollouts kept as token ids (token-in/token-out): the history is never re-tokenized.

An agent rollout alternates generated assistant turns and environment turns (tool outputs,
user replies). Re-applying the chat template to the whole conversation and tokenizing it again
can give other ids than those sampled (templates are not append-only, and BPE merges across a
turn boundary), so the trainer would score tokens the policy never produced (verl #6719 /
#6779 "continuous token", prime-rl #1352). ``Conversation`` keeps the exact ids: the prompt's
template once, each response as sampled, and for each new turn the tokens of that turn alone:
the chat template rendered for a fixed stand-in conversation with and without the new
messages, the text difference tokenized on its own. The separator the template writes after an
assistant turn's end token (ChatML's newline after ``<|im_end|>``, which generation stops
before) is added too, so the ids equal the template's own rendering wherever that is
append-only (verl #6921 lost it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MARK = "\u2063stand-in reply\u2063"  # the stand-in assistant turn's content
_STAND_IN = [{"role": "user", "content": "U"}, {"role": "assistant", "content": _MARK}]


@dataclass
class Conversation:
    """A conversation as token ids, grown turn by turn.

    Attributes:
        tokenizer: a transformers tokenizer with a chat template.
        token_ids: every id so far: the prompt, responses as sampled, new turns.
        loss_mask: per id, 1 for tokens the policy sampled (responses), 0 for the rest (the
            mask RL trainers apply to multi-turn samples).
        weight_versions: per id, the weight version that sampled it (None for the rest).

    Build with ``Conversation.start(tokenizer, messages)``.
    """

    tokenizer: object
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    weight_versions: list[int | None] = field(default_factory=list)

    @classmethod
    def start(cls, tokenizer, messages: list[dict], **template_kwargs) -> Conversation:
        """The conversation ``messages`` rendered once with the generation prompt.

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template")
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, **template_kwargs)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return cls(tokenizer, list(ids), [0] * len(ids), [None] * len(ids))

    def add_response(self, token_ids: list[int],
                     weight_versions: list[int] | None = None) -> None:
        """Append a generated turn exactly as sampled (``CompletionOutput.token_ids``, its
        end token included when generation stopped on it)."""
        self.token_ids += list(token_ids)
        self.loss_mask += [1] * len(token_ids)
        versions = list(weight_versions) if weight_versions is not None else [None] * len(
            token_ids)
        if len(versions) != len(token_ids):
            raise ValueError(f"weight_versions has {len(versions)} entries for "
                             f"{len(token_ids)} tokens")
        self.weight_versions += versions

    def add_messages(self, messages: list[dict], add_generation_prompt: bool = True,
                     **template_kwargs) -> list[int]:
        """Append the tokens of new turns (e.g. ``{"role": "tool", "content": "5"}``) after a
        response: the end of the assistant turn (its end token when the response did not
        stop on it, and the template's separator after it), the new messages and the next
        generation prompt. Returns the ids appended.

        Raises:
            ValueError: the conversation does not end with a response, or the template's
                rendering of a conversation with the new messages does not extend the one
                without them (a template that rewrites earlier turns).
        """
        if not self.loss_mask or self.loss_mask[-1] != 1:
            raise ValueError("add_messages follows a response (add_response first)")
        tok = self.tokenizer
        base = tok.apply_chat_template(_STAND_IN, tokenize=False, **template_kwargs)
        grown = tok.apply_chat_template(_STAND_IN + list(messages), tokenize=False,
                                        add_generation_prompt=add_generation_prompt,
                                        **template_kwargs)
        if not grown.startswith(base):
            raise ValueError("the chat template is not append-only for these messages: "
                             "their turn cannot be tokenized on its own")
        end_text, sep = self._end_of_turn(base)
        text = sep + grown[len(base):]
        if self.token_ids[-1] not in self._end_ids():
            text = end_text + text
        ids = tok(text, add_special_tokens=False).input_ids
        self.token_ids += ids
        self.loss_mask += [0] * len(ids)
        self.weight_versions += [None] * len(ids)
        return ids

    def _end_ids(self) -> set[int]:
        tok = self.tokenizer
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        gen = getattr(tok, "generation_config", None)
        if gen is not None and getattr(gen, "eos_token_id", None) is not None:
            e = gen.eos_token_id
            ids |= set(e) if isinstance(e, list) else {e}
        return ids

    def _end_of_turn(self, base: str) -> tuple[str, str]:
        """The stand-in assistant turn's end token text and what the template writes after
        it (``("<|im_end|>", "\\n")`` for ChatML)."""
        tail = base[base.rindex(_MARK) + len(_MARK):]
        eos = self.tokenizer.eos_token or ""
        if eos and tail.startswith(eos):
            return eos, tail[len(eos):]
        return "", tail
