"""Small helpers shared by the test modules."""

import torch


def rand_prompts(n, lo=4, hi=40, vocab=512, seed=0):
    """``n`` random token-id prompts with lengths in ``[lo, hi)`` (deterministic for a seed)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]
