"""``BatchEntry``: what one sequence puts through the target model in one step.

The scheduler makes the entries, the drafters attach token trees to them, the model runner
packs them into one forward, and the engine samples or verifies from their logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specengine.engine.sequence import Sequence
from specengine.speculative.tree import DraftTree


@dataclass
class BatchEntry:
    """Tokens of one sequence that go through the model this step.

    ``seq`` owns the KV written at positions ``seq.num_cached ..`` for ``num_new`` tokens;
    each sequence in ``samplers`` draws its next token from the logits of the last of them
    (one sequence at decode; all samples of a prompt at its prefill).
    """

    seq: Sequence
    num_new: int
    samplers: list[Sequence] = field(default_factory=list)
    is_prefill: bool = False
    tree: DraftTree | None = None  # draft tokens verified after the decode token (speculation)
    drafted: bool = False  # the drafter was asked for a tree this step (it saw the sequence)
