"""Rollout traces, step-cost tables and the replay projection of a trace."""
