"""Step-cost tables: seconds an engine step takes, as a function of the tokens in its target
forward and the context they attend, for replaying a rollout trace
(``specengine.replay.projection``).

A table is JSON (``"format": "specengine-step-costs"``, ``"version": 1``):

- ``kind``: ``"measured"`` (timed on a machine, ``bench/step_costs.py``) or ``"projection"``
  (derived from a model, e.g. a roofline; not a measurement). ``label``, ``device``, ``model``,
  ``dtype``, ``notes``: free text, carried into replay reports.
- ``forward``: ``{"tokens": [T ...], "context": [C ...], "seconds": [[s ...] per T]}``: target
  forward seconds on a grid of ``T`` (tokens in the forward: prompt tokens, decode roots, draft
  nodes) by ``C`` (KV positions the step's sequences read: for a decode, its committed tokens
  including the root; for a prefill, its cached and new tokens), both ascending. Measured with
  one query token per sequence. Between grid points the seconds are interpolated bilinearly;
  outside, extrapolated linearly from the edge cells (never below 0).
- ``pair_s``: seconds per extra (query token, KV position) pair: a step whose tokens attend
  ``A`` pairs in all (a tree node at depth ``d`` of a sequence with ``L`` committed tokens
  attends ``L + d``; prompt token ``i`` of a prefill attends ``cached + i``) adds
  ``pair_s * (A - C)`` to the grid's seconds (attention beyond one query per sequence).
- ``step_s``, ``sequence_s``, ``node_s``: the rest of a step (scheduling, sampling, verifying,
  appending and stop checks, Python): ``step_s + sequence_s * rows + node_s * nodes`` with
  ``rows`` the sequences sampled (decode sequences and prefill samples) and ``nodes`` the draft
  nodes verified.
- ``draft``: per drafter source name, ``{"step_s", "depth_s", "sequence_depth_s", "node_s",
  "sequence_s"}``: drafting ``nodes`` nodes ``depth`` deep for ``B`` sequences costs ``step_s +
  depth_s * depth + sequence_depth_s * B * depth + node_s * nodes + sequence_s * B``
  (``sequence_s``: per sequence whatever does not grow with depth, e.g. an EAGLE head catching
  up on the tokens committed since its last draft). A source missing here drafts for free.
- ``policy`` (optional): per policy name, ``{"step_s", "sequence_s"}``: the policy's own
  deciding and learning per step (``AutoPolicy``: choose, select, refine, record) for ``rows``
  sequences sampled: ``step_s + sequence_s * rows``. A policy missing here decides for free
  (``static``).

So one step costs ``forward(T, C) + pair_s * (A - C) + other + draft + policy`` seconds.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path

from specengine.data.jsonl import read_json, write_json_atomic

TABLE_FORMAT = "specengine-step-costs"
TABLE_VERSION = 1
KINDS = ("measured", "projection")
DRAFT_KEYS = ("step_s", "depth_s", "sequence_depth_s", "node_s", "sequence_s")
POLICY_KEYS = ("step_s", "sequence_s")


@dataclass
class StepShape:
    """The work of one step, as a cost table prices it.

    Attributes:
        tokens: ``T``, tokens in the target forward.
        context: ``C``, KV positions read, one query per sequence (see the module docstring).
        pairs: ``A``, (query token, KV position) pairs attended in all (``>= C``).
        rows: sequences sampled (decode sequences and prefill samples).
        nodes: draft nodes verified.
        drafts: per source, ``(sequences drafted for, depth, nodes)``.
        policy: the policy deciding the step (priced by the table's ``policy``; None: free).
    """

    tokens: int
    context: int
    pairs: int
    rows: int
    nodes: int = 0
    drafts: dict = field(default_factory=dict)
    policy: str | None = None


def _interp_index(axis: list[float], x: float) -> tuple[int, float]:
    """Cell ``i`` (between ``axis[i]`` and ``axis[i+1]``) and weight of the upper point for
    ``x``; outside the axis the edge cell, with a weight below 0 or above 1 (linear
    extrapolation). A one-point axis gives ``(0, 0.0)``."""
    if len(axis) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(axis, x) - 1, 0), len(axis) - 2)
    return i, (x - axis[i]) / (axis[i + 1] - axis[i])


class CostTable:
    """A step-cost table (see the module docstring for the JSON fields).

    Args:
        doc: the parsed JSON document.
        what: names the table in error messages (e.g. its path).

    Raises:
        ValueError: wrong format or version, an unknown ``kind``, axes not strictly ascending
            or not positive, a ``seconds`` grid of the wrong shape or with a negative or
            non-finite entry, a negative coefficient; the message names ``what`` and the
            field.
    """

    def __init__(self, doc: dict, what: str = "cost table"):
        def bad(msg: str) -> ValueError:
            return ValueError(f"{what}: {msg}")

        if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT:
            raise bad(f"not a step-cost table (needs \"format\": {TABLE_FORMAT!r})")
        if doc.get("version") != TABLE_VERSION:
            raise bad(f"version {doc.get('version')!r} is not supported (this reader knows "
                      f"{TABLE_VERSION})")
        if doc.get("kind") not in KINDS:
            raise bad(f"kind={doc.get('kind')!r}: use one of {KINDS}")
        fwd = doc.get("forward")
        if not isinstance(fwd, dict):
            raise bad("missing 'forward' grid")
        axes = {}
        for name in ("tokens", "context"):
            ax = fwd.get(name)
            if (not isinstance(ax, list) or not ax
                    or not all(isinstance(v, (int, float)) and v > 0 for v in ax)):
                raise bad(f"forward.{name} must be a non-empty list of positive numbers")
            if any(b <= a for a, b in zip(ax, ax[1:])):
                raise bad(f"forward.{name} must be strictly ascending")
            axes[name] = [float(v) for v in ax]
        grid = fwd.get("seconds")
        nt, nc = len(axes["tokens"]), len(axes["context"])
        if (not isinstance(grid, list) or len(grid) != nt
                or not all(isinstance(r, list) and len(r) == nc for r in grid)):
            raise bad(f"forward.seconds must be {nt} rows (tokens) of {nc} values (context)")
        for r in grid:
            for v in r:
                if not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                    raise bad(f"forward.seconds holds {v!r}: seconds must be finite and >= 0")
        self.doc = doc
        self.what = what
        self.tokens, self.context = axes["tokens"], axes["context"]
        self.seconds = [[float(v) for v in r] for r in grid]
        coef = {}
        for key in ("pair_s", "step_s", "sequence_s", "node_s"):
            coef[key] = self._coefficient(doc.get(key, 0.0), key, bad)
        self.pair_s, self.step_s = coef["pair_s"], coef["step_s"]
        self.sequence_s, self.node_s = coef["sequence_s"], coef["node_s"]
        self.draft = self._coefficient_maps(doc, "draft", "source", DRAFT_KEYS, bad)
        self.policy = self._coefficient_maps(doc, "policy", "policy", POLICY_KEYS, bad)

    @classmethod
    def _coefficient_maps(cls, doc: dict, field: str, what: str, keys: tuple, bad
                          ) -> dict[str, dict[str, float]]:
        """``doc[field]``: names -> ``{key: coefficient}`` with keys among ``keys`` (missing
        ones 0), checked like the top-level coefficients."""
        maps = doc.get(field, {})
        if not isinstance(maps, dict):
            raise bad(f"'{field}' must map {what} names to coefficient objects")
        out = {}
        for name, c in maps.items():
            if not isinstance(c, dict) or set(c) - set(keys):
                raise bad(f"{field}.{name} must be an object with keys among {keys}")
            out[name] = {k: cls._coefficient(c.get(k, 0.0), f"{field}.{name}.{k}", bad)
                         for k in keys}
        return out

    @staticmethod
    def _coefficient(v, key: str, bad) -> float:
        if not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise bad(f"{key}={v!r}: must be a finite number >= 0 (seconds)")
        return float(v)

    @property
    def kind(self) -> str:
        return self.doc["kind"]

    @property
    def label(self) -> str:
        return self.doc.get("label", self.what)

    @property
    def model(self) -> str | None:
        """The model the table prices (its ``model`` field), None when it names none."""
        return self.doc.get("model")

    def prices(self, model: str | os.PathLike | None) -> bool:
        """False when the table names a model and ``model`` (an alias or a directory) is
        another one: the two names differ and so do their last path components (a table made
        for the alias ``qwen2.5-coder-0.5b-instruct`` prices its directory too); True when
        either names none."""
        if not self.model or not model:
            return True
        a, b = str(self.model), os.fspath(model)
        return a == b or Path(a).name == Path(b).name

    @classmethod
    def load(cls, path: str | os.PathLike) -> CostTable:
        """Read a table from JSON.

        Raises:
            FileNotFoundError: no such file. ValueError: not JSON, or an invalid table.
        """
        return cls(read_json(path, "cost table"), f"cost table {os.fspath(path)}")

    def save(self, path: str | os.PathLike) -> None:
        """Write the table as indented JSON, atomically."""
        write_json_atomic(path, self.doc, indent=1)

    def forward_seconds(self, tokens: float, context: float, pairs: float | None = None) -> float:
        """Target forward seconds for ``tokens`` tokens reading ``context`` KV positions (one
        query per sequence), plus ``pair_s`` per pair of ``pairs`` beyond ``context``."""
        i, u = _interp_index(self.tokens, tokens)
        j, v = _interp_index(self.context, context)
        g = self.seconds
        i1 = min(i + 1, len(self.tokens) - 1)
        j1 = min(j + 1, len(self.context) - 1)
        lo = g[i][j] + v * (g[i][j1] - g[i][j])
        hi = g[i1][j] + v * (g[i1][j1] - g[i1][j])
        s = max(lo + u * (hi - lo), 0.0)
        if pairs is not None:
            s += self.pair_s * max(pairs - context, 0.0)
        return s

    def draft_seconds(self, source: str, sequences: int, depth: int, nodes: int) -> float:
        """Seconds ``source`` takes to draft ``nodes`` nodes ``depth`` deep for ``sequences``
        sequences (0 for a source the table does not price, or nothing drafted)."""
        c = self.draft.get(source)
        if c is None or sequences <= 0 or nodes <= 0:
            return 0.0
        return (c["step_s"] + c["depth_s"] * depth + c["sequence_depth_s"] * sequences * depth
                + c["node_s"] * nodes + c["sequence_s"] * sequences)

    def step_seconds(self, shape: StepShape) -> dict:
        """Seconds of one step of ``shape``: ``{"forward", "draft", "other", "policy",
        "total"}``."""
        fwd = self.forward_seconds(shape.tokens, shape.context, shape.pairs)
        draft = sum(self.draft_seconds(src, b, d, n) for src, (b, d, n) in shape.drafts.items())
        other = self.step_s + self.sequence_s * shape.rows + self.node_s * shape.nodes
        pol = self.policy.get(shape.policy) if shape.policy else None
        policy = pol["step_s"] + pol["sequence_s"] * shape.rows if pol else 0.0
        return {"forward": fwd, "draft": draft, "other": other, "policy": policy,
                "total": fwd + draft + other + policy}


def model_sizes(cfg) -> dict:
    """Sizes a roofline needs from a ``ModelConfig``: ``linear_params`` (weights multiplied per
    token: every decoder linear and the LM head), ``weight_params`` (weights read per step: the
    linears, norms, and the embedding only as the tied LM head), ``kv_values_per_token`` (K and V
    values one position stores, all layers) and ``attention_flops_per_pair`` (QK and PV
    multiply-adds x 2 for one query attending one position, all layers)."""
    h, L, hd = cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    head = cfg.vocab_size * h
    linear = L * layer + head
    return {"linear_params": linear, "weight_params": linear + (2 * L + 1) * h,
            "kv_values_per_token": 2 * L * kv, "attention_flops_per_pair": 4 * L * q}


def roofline_table(cfg, *, model: str, device: str = "H200-class GPU",
                   bytes_per_s: float = 4.8e12, flops_per_s: float = 790e12,
                   dtype_bytes: int = 2, step_s: float = 1e-4, sequence_s: float = 2e-6,
                   node_s: float = 0.0, draft: dict | None = None,
                   tokens: list[int] | None = None, context: list[int] | None = None) -> dict:
    """A projected step-cost table (``kind: "projection"``) for ``cfg`` (a ``ModelConfig``)
    from a roofline: forward seconds = max(bytes / ``bytes_per_s``, FLOPs / ``flops_per_s``)
    with bytes = the weights (``dtype_bytes`` each) + the KV read for the context + the KV
    written for the new tokens, and FLOPs = 2 x linear params x tokens + attention
    (``model_sizes``); ``pair_s`` = attention FLOPs per extra pair / ``flops_per_s`` (a tree's
    extra queries re-read no KV). ``step_s`` (a fixed per-step launch and host overhead,
    seconds), ``sequence_s``, ``node_s`` and ``draft`` (per source, ``DRAFT_KEYS``) are stated
    assumptions, not derived. The default grid spans 1..16384 tokens and 16..4M positions.

    Returns:
        The table document (``CostTable(doc)`` reads it).
    """
    sizes = model_sizes(cfg)
    tokens = tokens or [2 ** i for i in range(15)]
    context = context or [16 * 4 ** i for i in range(10)]
    kv_bytes = sizes["kv_values_per_token"] * dtype_bytes
    w_bytes = sizes["weight_params"] * dtype_bytes
    grid = []
    for t in tokens:
        row = []
        for c in context:
            moved = w_bytes + kv_bytes * (c + t)
            flops = 2 * sizes["linear_params"] * t + sizes["attention_flops_per_pair"] * c
            row.append(max(moved / bytes_per_s, flops / flops_per_s))
        grid.append(row)
    return {
        "format": TABLE_FORMAT, "version": TABLE_VERSION, "kind": "projection",
        "label": f"{device} roofline projection for {model} (NOT a measurement)",
        "device": device, "model": model, "dtype": f"{8 * dtype_bytes}-bit weights and KV",
        "notes": (f"PROJECTION, not a measurement: forward = max(bytes / {bytes_per_s:.3g} B/s, "
                  f"FLOPs / {flops_per_s:.3g} FLOP/s); bytes = {w_bytes} weight bytes + "
                  f"{kv_bytes} KV bytes per position read or written; FLOPs = 2 x "
                  f"{sizes['linear_params']} params x tokens + "
                  f"{sizes['attention_flops_per_pair']} per (query, position) pair. Assumed, "
                  f"not derived: step_s = {step_s:g} s fixed launch + host overhead per step "
                  f"(CUDA graphs), sequence_s = {sequence_s:g} s per sampled sequence, node_s "
                  f"= {node_s:g} s per verified node, draft costs per source as given; a "
                  f"policy's own deciding (host-side) is not priced."),
        "roofline": {"bytes_per_s": bytes_per_s, "flops_per_s": flops_per_s,
                     "dtype_bytes": dtype_bytes, **sizes},
        "forward": {"tokens": tokens, "context": context, "seconds": grid},
        "pair_s": sizes["attention_flops_per_pair"] / flops_per_s,
        "step_s": step_s, "sequence_s": sequence_s, "node_s": node_s,
        "draft": draft or {}}
