"""Speculation policies: which strategy (tree shape, or none) each step runs.

``make_policy(cfg)`` builds the policy a ``SpeculativeConfig`` names, over the candidates
``candidate_strategies(cfg)`` lists; the policy classes and ``StepRecord`` are exported here.
What lives where:

- ``base.py``: ``StepRecord`` (what one step did and cost, handed to ``Policy.record``), the
  ``Policy`` interface the engine calls (``choose``, ``select``, ``refine``, ``record``,
  ``warm_start``, ``stats``), ``StaticPolicy``, ``BucketPolicy`` and the batch-size buckets;
- ``auto.py``: ``AutoPolicy``, RLHFSpec's criterion (arXiv 2512.04752): the strategy with the
  most expected committed tokens per second for the batch, with hysteresis;
- ``parts.py``: the mechanisms ``AutoPolicy`` is wired from (``ProbeSchedule``,
  ``RescoreBudget``, ``CorrectionTable``, ``TreeCutter``);
- ``latency.py``, ``acceptance.py``, ``calibration.py``: its online models of step time,
  accepted tokens and per-node acceptance probability; ``profiling.py``: the start-up profile
  that warm-starts the latency model;
- ``remaining.py``: expected remaining output per running sequence from its prompt group's
  finished lengths (``RemainingLength``) and the weights it gives (``length_weights``);
  ``budget.py``: the step's draft nodes spread over sequences by weighted value
  (``allocate``) and the tally of that spread (``BudgetSpread``);
- ``bandit.py``: ``BanditPolicy``, TLT's BEG-MAB (arXiv 2511.16665), the baseline to beat.
"""

from specengine.speculative.config import POLICIES
from specengine.speculative.policy.auto import AutoPolicy
from specengine.speculative.policy.bandit import BanditPolicy
from specengine.speculative.policy.base import (
    BucketPolicy,
    Policy,
    StaticPolicy,
    StepRecord,
    batch_bucket,
    bucket_label,
    strategy_name,
)
from specengine.speculative.strategy import Strategy

__all__ = ["AutoPolicy", "BanditPolicy", "BucketPolicy", "Policy", "StaticPolicy", "StepRecord",
           "batch_bucket", "bucket_label", "candidate_strategies", "make_policy",
           "strategy_name"]


def candidate_strategies(cfg) -> list[Strategy]:
    """Candidates of a ``SpeculativeConfig``: chains of depth 1..``num_speculative_tokens`` and
    the trees of ``candidate_trees`` (default: the configured tree if ``topk > 1``, plus
    ``(D, 2, 2D)`` and ``(D, 4, 4D)`` for D = ``num_speculative_tokens``)."""
    depth = cfg.strategy.depth
    chains = [Strategy(d) for d in range(1, depth + 1)]
    trees = cfg.candidate_trees
    if trees is None:
        trees = [(depth, 2, 2 * depth), (depth, 4, 4 * depth)]
        if not cfg.strategy.is_chain:
            trees = [cfg.strategy, *trees]
    out = chains + [t if isinstance(t, Strategy) else Strategy(*t) for t in trees]
    return list(dict.fromkeys(out))


def make_policy(cfg, seed: int = 0) -> Policy:
    """The policy named by ``cfg.policy`` (a ``SpeculativeConfig``; ``seed`` seeds the bandit's
    exploration). Raises ValueError for a name not in ``config.POLICIES``."""
    if cfg.policy == "static":
        return StaticPolicy(cfg.strategy)
    if cfg.policy == "bandit":
        return BanditPolicy(candidate_strategies(cfg), seed=seed)
    if cfg.policy == "auto":
        policy = AutoPolicy(candidate_strategies(cfg))
        if isinstance(cfg.method, str):  # a single drafter: its trees' source by default
            policy.cutter.sources.default = cfg.method
        return policy
    raise ValueError(f"speculative_config policy={cfg.policy!r}: use one of {POLICIES}")
