"""Argument parsing shared by the ``specengine`` subcommands (``generate`` in
``specengine.cli``, ``serve`` in ``specengine.server.cli``): both import it, neither imports
the other for it."""

from __future__ import annotations

import json


def speculative_config_arg(text: str | None) -> dict | None:
    """The ``--speculative-config`` JSON text as a dict (None when not given).

    Raises:
        ValueError: not valid JSON, naming the flag.
    """
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config is not valid JSON ({e})") from None
