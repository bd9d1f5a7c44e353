"""Sampling: ``SamplingParams``, the engine's sampler and tree verifier, batched row
processing, penalties."""
