"""Builds the drafter named by a ``SpeculativeConfig``."""

from __future__ import annotations

from specengine.speculative.config import SpeculativeConfig
from specengine.speculative.drafters.base import Drafter


def make_drafter(cfg: SpeculativeConfig, target, num_blocks: int, block_size: int) -> Drafter:
    """The drafter for ``cfg`` serving ``target`` (a ``LoadedModel``); a draft model gets a KV
    pool of ``num_blocks`` blocks of ``block_size`` tokens. A list of methods builds each
    (in order) and merges them (``merged.MergedDrafter``).

    Raises:
        ValueError: a draft model whose tokenizer or vocabulary differs from the target's.
    """
    parts = [make_one(method, cfg, target, num_blocks, block_size) for method in cfg.methods]
    if len(parts) == 1:
        return parts[0]
    from specengine.speculative.drafters.merged import MergedDrafter
    return MergedDrafter(parts, cfg.strategy)


def make_one(method: str, cfg: SpeculativeConfig, target, num_blocks: int,
             block_size: int) -> Drafter:
    """The single drafter ``method`` (one of ``config.METHODS``) with ``cfg``'s settings.

    Raises:
        ValueError: as ``make_drafter``; a method with no drafter here.
    """
    if method == "ngram":
        from specengine.speculative.drafters.ngram import NgramDrafter
        return NgramDrafter(cfg.strategy, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if method == "suffix":
        from specengine.speculative.drafters.suffix import SuffixDrafter
        return SuffixDrafter(cfg.strategy, cfg.suffix_decoding_max_tree_depth,
                             cfg.suffix_decoding_min_token_prob, cfg.suffix_memory_bytes,
                             cfg.suffix_history_decay, cfg.suffix_history_max_age,
                             cfg.suffix_max_matches, cfg.suffix_backoff)
    if method == "draft_model":
        from specengine.engine.config import parse_dtype
        from specengine.models.loader import load_model
        from specengine.speculative.drafters.draft_model import (
            DraftModelDrafter,
            check_same_tokenizer,
        )

        dtype = parse_dtype(cfg.draft_dtype) if cfg.draft_dtype else target.model.dtype
        draft = load_model(cfg.model, dtype=dtype)
        check_same_tokenizer(target.tokenizer, draft.tokenizer, str(target.model_dir), cfg.model)
        if draft.config.vocab_size < target.config.vocab_size:
            raise ValueError(f"draft model {cfg.model!r} has vocab_size "
                             f"{draft.config.vocab_size} < the target's "
                             f"{target.config.vocab_size}")
        return DraftModelDrafter(cfg.strategy, draft.model, num_blocks, block_size,
                                 target.config.vocab_size)
    if method == "eagle":
        from specengine.speculative.drafters.eagle import make_eagle
        return make_eagle(cfg, target, num_blocks, block_size)
    raise ValueError(f"speculative_config method={method!r} is not available yet")
