"""Adapters that let RL training frameworks drive specengine as their rollout engine.

One small module per framework, each importing its framework only when imported itself
(``import specengine.integrations`` imports none of them):

- ``specengine.integrations.trl``: ``RolloutFunc``, a ``rollout_func`` for TRL's ``GRPOTrainer``;
- ``specengine.integrations.verl``: a rollout with verl's ``BaseRollout`` contract and its
  server's ``generate``.
"""
