"""Speculation policies: which strategy (tree shape, or none) a step runs.

``make_policy(cfg)`` builds the policy a ``SpeculativeConfig`` names; the policy classes and
``StepRecord`` (what one step did and cost, handed to ``Policy.record``) are exported here.
``base.py`` holds the ``Policy`` interface, ``StepRecord`` and the fixed policies, ``bandit.py``
TLT's bandit, ``policies.py`` ``AutoPolicy`` and ``make_policy``.
"""

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
from specengine.speculative.policy.policies import AutoPolicy, candidate_strategies, make_policy

__all__ = ["AutoPolicy", "BanditPolicy", "BucketPolicy", "Policy", "StaticPolicy", "StepRecord",
           "batch_bucket", "bucket_label", "candidate_strategies", "make_policy",
           "strategy_name"]
