"""Speculation policies: which strategy (tree shape, or none) a step runs.

``make_policy(cfg)`` builds the policy a ``SpeculativeConfig`` names; the policy classes and
``StepRecord`` (what one step did and cost, handed to ``Policy.record``) are exported here.
"""

from specengine.speculative.policy.policies import (
    AutoPolicy,
    BanditPolicy,
    BucketPolicy,
    Policy,
    StaticPolicy,
    StepRecord,
    batch_bucket,
    bucket_label,
    candidate_strategies,
    make_policy,
    strategy_name,
)

__all__ = ["AutoPolicy", "BanditPolicy", "BucketPolicy", "Policy", "StaticPolicy", "StepRecord",
           "batch_bucket", "bucket_label", "candidate_strategies", "make_policy",
           "strategy_name"]
