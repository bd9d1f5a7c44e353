"""``speculative_config``: which drafter, and the draft tree shape (vLLM-style keys)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from specengine.speculative.strategy import Strategy

METHODS = ("ngram", "draft_model", "eagle", "suffix")
DEFAULT_SUFFIX_MEMORY_BYTES = 256 << 20  # 256 MiB of rollout memory
POLICIES = ("auto", "static", "bandit")


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings.

    Attributes:
        method: ``"ngram"`` (prompt lookup), ``"draft_model"`` (an independent small model with
            the target's tokenizer), ``"eagle"`` (EAGLE-style feature drafter) or ``"suffix"``
            (SuffixDecoding over the rollout memory of the prompt group:
            ``drafters/suffix.py``); or a list of distinct methods, e.g. ``["suffix", "eagle"]``:
            each drafts for every sequence and their trees are merged into one token tree under
            one verify budget (``drafters.merged.MergedDrafter``). A one-element list is that
            method alone. ``"draft_model"`` and ``"eagle"`` cannot be combined: both read
            ``model``.
        model: the draft model (alias, directory or .gguf) for ``draft_model``; the drafter
            checkpoint directory for ``eagle`` (None: the drafter shipped for the target;
            ``"random"``: random weights, for tests).
        num_speculative_tokens: draft depth d (>= 1).
        topk: branching k per node (1 = chain).
        num_verify_tokens: verify budget m, the most draft nodes per sequence (>= d; default
            d * k).
        prompt_lookup_min, prompt_lookup_max: n-gram sizes matched by ``ngram``.
        draft_dtype: dtype of the draft model (default: the target's).
        policy: how each step's strategy is chosen: ``"auto"`` (cost model fitted online; the
            default), ``"static"`` (always the configured tree) or ``"bandit"`` (TLT's
            BEG-MAB); ``auto`` and ``bandit`` choose among no speculation, chains of depth
            1..``num_speculative_tokens`` and ``candidate_trees`` (``spec/policy.py``).
        candidate_trees: trees for ``auto``/``bandit`` as ``[depth, topk, budget]`` lists
            (None: defaults, see ``spec.policy.candidate_strategies``).
        policy_max_loss: ``auto``: the share of no speculation's speed that speculation may
            risk in each batch-size bucket, in [0, 1) (default 0.02: never below 0.98x of no
            speculation; ``policy.guard.LossGuard``, which budgets ``AutoPolicy.GUARD_SHARE``
            of it); None: no guard, the cost model alone
            decides (it then speculates from the first step).
        suffix_decoding_max_tree_depth: ``suffix``: most draft tokens on a path, whatever the
            strategy's depth (>= 1; vLLM's key, default 24).
        suffix_decoding_min_token_prob: ``suffix``: least path probability (continuation
            count over all matched continuations) of a drafted node, in [0, 1] (vLLM's key,
            default 0.1).
        suffix_memory_bytes: ``suffix``: cap of the rollout memory in bytes (>= 1; default
            256 MiB); least-recently-used prompt groups are evicted beyond it.
        suffix_history_decay: ``suffix``: weight of a finished response per weight version of
            age, in (0, 1] (default 0.5: one update halves its counts).
        suffix_history_max_age: ``suffix``: finished responses more than this many weight
            versions old are dropped (>= 0; default 4).
        suffix_max_matches: ``suffix``: most earlier occurrences whose continuations one
            lookup merges (>= 1; default 32).
        suffix_backoff: ``suffix``: weight factor per level of the occurrences of shorter
            n-grams merged after the longest match's, in [0, 1] (default 0.5; 0: the longest
            match only).

    Raises:
        ValueError: unknown method or key, out-of-range sizes (message names the key); a
            method list that is empty, repeats a method or combines ``draft_model`` with
            ``eagle``.
    """

    method: str | list[str]
    model: str | None = None
    num_speculative_tokens: int = 4
    topk: int = 1
    num_verify_tokens: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    draft_dtype: str | None = None
    policy: str = "auto"
    candidate_trees: list | None = None
    policy_max_loss: float | None = 0.02
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_min_token_prob: float = 0.1
    suffix_memory_bytes: int = DEFAULT_SUFFIX_MEMORY_BYTES
    suffix_history_decay: float = 0.5
    suffix_history_max_age: int = 4
    suffix_max_matches: int = 32
    suffix_backoff: float = 0.5

    def __post_init__(self) -> None:
        self.method = check_method(self.method)
        try:
            self.strategy = Strategy(self.num_speculative_tokens, self.topk,
                                     self.num_verify_tokens)
        except ValueError as e:
            names = {"depth": "num_speculative_tokens", "topk": "topk",
                     "budget": "num_verify_tokens"}
            msg = str(e)
            for k, v in names.items():
                msg = msg.replace(f"Strategy.{k}", f"speculative_config {v}")
            raise ValueError(msg.replace("depth=", "num_speculative_tokens=")) from None
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min={self.prompt_lookup_min} and "
                             f"prompt_lookup_max={self.prompt_lookup_max}: need 1 <= min <= max")
        if self.policy not in POLICIES:
            raise ValueError(f"speculative_config policy={self.policy!r}: use one of {POLICIES}")
        loss = self.policy_max_loss
        if loss is not None and (not isinstance(loss, (int, float)) or isinstance(loss, bool)
                                 or not 0.0 <= loss < 1.0):
            raise ValueError(f"speculative_config policy_max_loss={loss!r}: must be a number in "
                             "[0, 1) or None")
        if self.candidate_trees is not None:
            try:
                self.candidate_trees = [t if isinstance(t, Strategy) else Strategy(*t)
                                        for t in self.candidate_trees]
            except (TypeError, ValueError) as e:
                raise ValueError(f"speculative_config candidate_trees: {e}") from None
        self._check_suffix()
        if "draft_model" in self.methods and not self.model:
            raise ValueError("speculative_config method='draft_model' needs 'model'")

    def _check_suffix(self) -> None:
        """Range checks of the ``suffix_*`` keys (ValueError naming the key)."""
        def number(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        checks = [
            ("suffix_decoding_max_tree_depth", integer, 1, None, "an int >= 1"),
            ("suffix_decoding_min_token_prob", number, 0.0, 1.0, "a number in [0, 1]"),
            ("suffix_memory_bytes", integer, 1, None, "an int >= 1 (bytes)"),
            ("suffix_history_decay", number, 0.0, 1.0, "a number in (0, 1]"),
            ("suffix_history_max_age", integer, 0, None, "an int >= 0 (weight versions)"),
            ("suffix_max_matches", integer, 1, None, "an int >= 1"),
            ("suffix_backoff", number, 0.0, 1.0, "a number in [0, 1]"),
        ]
        for key, kind, lo, hi, what in checks:
            v = getattr(self, key)
            bad = not kind(v) or v < lo or (hi is not None and v > hi)
            if key == "suffix_history_decay" and kind(v) and v == 0:
                bad = True
            if bad:
                raise ValueError(f"speculative_config {key}={v!r}: must be {what}")
    @property
    def methods(self) -> tuple[str, ...]:
        """The drafters to build, in order (one for a single method)."""
        return (self.method,) if isinstance(self.method, str) else tuple(self.method)

    @classmethod
    def from_dict(cls, d: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Parse a user dict; unknown keys raise ValueError naming them."""
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: "
                             f"{sorted(known)}")
        if "method" not in d:
            raise ValueError(f"speculative_config needs 'method' (one of {METHODS})")
        return cls(**d)


def check_method(method) -> str | list[str]:
    """``method`` checked: a name of ``METHODS`` or a list (tuple) of two or more distinct ones
    (returned as a list; a one-element list gives its name).

    Raises:
        ValueError: an unknown name, a non-string, an empty list, a repeated method, or
            ``draft_model`` with ``eagle`` (both would read ``model``).
    """
    if isinstance(method, str):
        if method not in METHODS:
            raise ValueError(f"speculative_config method={method!r}: use one of {METHODS}")
        return method
    if not isinstance(method, (list, tuple)):
        raise ValueError(f"speculative_config method={method!r}: use one of {METHODS} or a list "
                         "of them")
    if not method:
        raise ValueError(f"speculative_config method=[]: list at least one of {METHODS}")
    bad = [m for m in method if not isinstance(m, str) or m not in METHODS]
    if bad:
        raise ValueError(f"speculative_config method={list(method)!r}: unknown method(s) {bad}; "
                         f"use {METHODS}")
    repeated = sorted({m for m in method if method.count(m) > 1})
    if repeated:
        raise ValueError(f"speculative_config method={list(method)!r}: {repeated} listed more "
                         "than once")
    if "draft_model" in method and "eagle" in method:
        raise ValueError(f"speculative_config method={list(method)!r}: 'draft_model' and "
                         "'eagle' cannot be combined (both read 'model': the draft model and the "
                         "EAGLE checkpoint)")
    return method[0] if len(method) == 1 else list(method)
