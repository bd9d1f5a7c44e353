"""Speculation policies: which strategy (tree shape, or none) each step runs.

``make_policy(cfg)`` builds the policy a ``SpeculativeConfig`` names, over the candidates
``candidate_strategies(cfg)`` lists; the policy classes and ``StepRecord`` are exported here.
What lives where:

- ``base.py``: ``StepRecord`` (what one step did and cost, handed to ``Policy.record``), the
  ``Policy`` interface the engine calls (``choose``, ``select``, ``refine``, ``record``,
  ``warm_start``, ``stats``), ``StaticPolicy``, ``BucketPolicy`` and the batch-size buckets;
- ``auto.py``: ``AutoPolicy``, RLHFSpec's criterion (arXiv 2512.04752): the strategy with the
  most expected committed tokens per second for the batch, with hysteresis;
- the mechanisms ``AutoPolicy`` is wired from, one module each: ``probe.py``
  (``ProbeSchedule``), ``rescore.py`` (``RescoreBudget``), ``correction.py``
  (``CorrectionTable``), ``cutter.py`` (``TreeCutter``);
- ``latency.py``, ``acceptance.py``, ``calibration.py``: its online models of step time,
  accepted tokens and per-node acceptance probability; ``profiling.py``: the start-up profile
  that warm-starts the latency model;
- ``remaining.py``: expected remaining output per running sequence from its prompt group's
  finished lengths (``RemainingLength``) and the weights it gives (``length_weights``);
  ``budget.py``: the step's draft nodes spread over sequences by weighted value
  (``allocate``) and the tally of that spread (``BudgetSpread``);
- ``guard.py``: ``LossGuard``, the per-bucket loss budget that keeps ``AutoPolicy`` never
  slower than no speculation (the conservative bandit's rule);
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
from specengine.speculative.policy.cutter import TreeCutter
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


def make_policy(cfg, seed: int = 0, drafter=None) -> Policy:
    """The policy named by ``cfg.policy`` (a ``SpeculativeConfig``; ``seed`` seeds the bandit's
    exploration) for ``drafter`` (the engine's ``Drafter``, or None).

    A ``MergedDrafter`` in ``drafter`` (also inside a training ``Harvester``) is given per-source
    calibrators the policy trains on the verified nodes (``wire_calibration``).

    Raises:
        ValueError: a policy name not in ``config.POLICIES``.
    """
    if cfg.policy == "static":
        policy = StaticPolicy(cfg.strategy)
    elif cfg.policy == "bandit":
        policy = BanditPolicy(candidate_strategies(cfg), seed=seed)
    elif cfg.policy == "auto":
        policy = AutoPolicy(candidate_strategies(cfg), max_loss=cfg.policy_max_loss)
        if isinstance(cfg.method, str):  # a single drafter: its trees' source by default
            policy.cutter.sources.default = cfg.method
    else:
        raise ValueError(f"speculative_config policy={cfg.policy!r}: use one of {POLICIES}")
    if drafter is not None:
        wire_calibration(drafter, policy)
    return policy


def wire_calibration(drafter, policy: Policy) -> None:
    """Let the ``MergedDrafter`` in ``drafter`` (``Drafter.find``) fill its budget with
    per-source calibrators ``policy`` trains on the verified nodes: an ``AutoPolicy``'s own
    (``TreeCutter.sources``, which also cut the trees); for another policy a ``TreeCutter``
    that only learns (set as ``Policy.calibration_learner``). Nothing happens without one."""
    from specengine.speculative.drafters.merged import MergedDrafter

    merged = drafter.find(MergedDrafter)
    if merged is None:
        return
    if isinstance(policy, AutoPolicy):
        cutter = policy.cutter
    else:
        cutter = policy.calibration_learner = TreeCutter()
    merged.use_scorer(cutter.sources)
