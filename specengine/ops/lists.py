"""Tensors from the Python lists a step builds (slots, positions, block tables, tree masks).

``torch.tensor(list)`` converts element by element through Python objects: ~24 us for 352 ints
on a 2-core Intel Xeon, where numpy's conversion plus ``torch.from_numpy`` takes ~7 us. A step
builds several such tensors (the target's inputs and attention metadata, the drafter's), so the
engine builds them here.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}


def int_tensor(values, dtype: torch.dtype = torch.int64,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)``, faster for long lists.

    Args:
        values: a list (or nested list of equal-length lists) of Python ints / bools.
        dtype: ``torch.int64``, ``torch.int32`` or ``torch.bool``.
        device: where the tensor goes (built on the CPU, then copied).

    Raises:
        KeyError: another dtype.
        OverflowError: a value that does not fit ``dtype``.
    """
    t = torch.from_numpy(np.asarray(values, dtype=_NUMPY[dtype]))
    return t if torch.device(device).type == "cpu" else t.to(device)


def padded_tensor(rows: list[list[int]], dtype: torch.dtype = torch.int32,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(rows), W]`` of ``dtype``: each row zero-padded to the longest (W), as block
    tables are passed to the attention kernels; built like ``int_tensor``.

    Raises:
        ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError("padded_tensor: no rows")
    width = max(len(r) for r in rows)
    flat: list[int] = []
    for r in rows:
        flat += r
        flat += [0] * (width - len(r))
    return int_tensor(flat, dtype, device).view(len(rows), width)


def ancestor_mask(trees_at: list[tuple[int, list[int]]], rows: int, width: int) -> torch.Tensor:
    """Tree attention mask of a flat batch: ``mask[r0 + i, j]`` True iff node j of the tree
    whose node 0 is at row ``r0`` is node i or one of its ancestors (``DraftTree.tree_mask``
    rows, placed at their rows); every other entry False.

    Args:
        trees_at: ``(r0, parents)`` per tree, parents as in ``DraftTree.parents``.
        rows: R, the rows of the batch.
        width: W, at least the largest tree's node count.

    Returns:
        ``[R, W]`` bool.
    """
    r_idx: list[int] = []
    c_idx: list[int] = []
    for r0, parents in trees_at:
        path: list[list[int]] = []
        for i, par in enumerate(parents):
            p = path[par] + [i] if par >= 0 else [i]
            path.append(p)
            r_idx += [r0 + i] * len(p)
            c_idx += p
    mask = np.zeros((rows, width), dtype=np.bool_)
    mask[r_idx, c_idx] = True
    return torch.from_numpy(mask)
