"""Adapters that plug specengine into RL frameworks: one small module each, imported lazily
(``import specengine`` imports none of them)."""
