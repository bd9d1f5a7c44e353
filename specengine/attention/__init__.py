"""Attention backends over the paged KV cache."""

from specengine.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]
