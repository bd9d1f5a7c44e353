"""Loads the C++ extension ``specengine._C``; warns once and returns None when it is missing."""

from __future__ import annotations

import warnings

_C = None
_tried = False


def ext():
    """The compiled extension module, or None (torch fallbacks are used then)."""
    global _C, _tried
    if not _tried:
        _tried = True
        try:
            from specengine import _C as mod  # type: ignore[attr-defined]
            _C = mod
        except ImportError as e:
            warnings.warn(f"specengine._C is not built ({e}); using slow torch fallbacks. "
                          "Build it with `pip install --no-build-isolation -e .`.", stacklevel=2)
    return _C
