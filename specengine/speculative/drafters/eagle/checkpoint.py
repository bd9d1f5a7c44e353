"""EAGLE drafter checkpoints: writing and reading them (``save_drafter``, ``read_config``,
``load_drafter``, ``load_state``) and finding the drafter shipped for a target
(``shipped_drafter``, by the target's identity: see ``eagle.identity``).

A checkpoint is a directory with ``model.safetensors`` (fc, the layer, and ``vocab_map`` if
reduced) and ``config.json`` (``EagleConfig`` plus the target identity, ``target_identity``).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

import torch

from specengine.speculative.drafters.eagle.identity import match_target, target_identity
from specengine.speculative.drafters.eagle.model import EagleConfig, EagleModel

FORMAT = "specengine-eagle"
# The shipped drafters (package data): specengine/data/drafters/<target>/.
DRAFTERS_DIR = Path(str(resources.files("specengine.data") / "drafters"))


def save_drafter(model: EagleModel, out_dir: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` into ``out_dir`` (created)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = {}
    for name, p in model.named_parameters():
        sd[name] = p.detach().to(dtype or p.dtype).contiguous()
    if model.vocab_map is not None:
        sd["vocab_map"] = model.vocab_map.to(torch.int64).contiguous()
    cfg = {"format": FORMAT, "version": 1, **dataclasses.asdict(model.config)}
    tmp = out / "model.safetensors.tmp"
    save_file(sd, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return out


def read_config(ckpt_dir: str | Path) -> EagleConfig:
    """``EagleConfig`` of a checkpoint directory.

    Raises:
        FileNotFoundError: no such directory / config.json. ValueError: not an EAGLE drafter
            config or a corrupt one.
    """
    path = Path(ckpt_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"EAGLE drafter {str(ckpt_dir)!r}: no config.json")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"EAGLE drafter {str(ckpt_dir)!r}: corrupt config.json ({e})") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ValueError(f"EAGLE drafter {str(ckpt_dir)!r}: config.json is not a {FORMAT!r} "
                         "config")
    names = {f.name for f in dataclasses.fields(EagleConfig)}
    try:
        return EagleConfig(**{k: v for k, v in raw.items() if k in names})
    except TypeError as e:
        raise ValueError(f"EAGLE drafter {str(ckpt_dir)!r}: config.json lacks fields ({e})") \
            from e


def load_drafter(ckpt_dir: str | Path, target, dtype: torch.dtype | None = None) -> EagleModel:
    """Load a checkpoint for ``target`` (a ``LoadedModel``).

    Raises:
        FileNotFoundError: missing directory or files.
        ValueError: a drafter for another target (hidden size, vocabulary, tokenizer), a
            corrupt or incomplete checkpoint; the message names the directory.
    """
    from specengine.models.loader import iter_safetensors

    ckpt_dir = Path(ckpt_dir)
    cfg = read_config(ckpt_dir)
    cfg.check_target(target, repr(str(ckpt_dir)))
    wfile = ckpt_dir / "model.safetensors"
    if not wfile.is_file():
        raise FileNotFoundError(f"EAGLE drafter {str(ckpt_dir)!r}: no model.safetensors")
    sd = dict(iter_safetensors([wfile]))
    vmap = sd.pop("vocab_map", None)
    if vmap is not None and (vmap.dim() != 1 or vmap.numel() != cfg.draft_vocab_size
                             or int(vmap.max()) >= cfg.vocab_size or int(vmap.min()) < 0):
        raise ValueError(f"EAGLE drafter {str(ckpt_dir)!r}: vocab_map does not match "
                         f"draft_vocab_size={cfg.draft_vocab_size} / vocab_size="
                         f"{cfg.vocab_size}")
    model = EagleModel(cfg, target.model, dtype, vmap)
    load_state(model, sd, str(ckpt_dir))
    return model.eval()


def load_state(model: EagleModel, sd: dict[str, torch.Tensor], where: str = "state") -> None:
    """Copy ``sd`` (names as ``named_parameters``) into ``model``; ValueError on a missing,
    unexpected or misshaped tensor."""
    params = dict(model.named_parameters())
    if missing := sorted(set(params) - set(sd)):
        raise ValueError(f"EAGLE drafter {where}: missing weights {missing[:4]}")
    if extra := sorted(set(sd) - set(params)):
        raise ValueError(f"EAGLE drafter {where}: unexpected weights {extra[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(sd[name].shape) != tuple(p.shape):
                raise ValueError(f"EAGLE drafter {where}: weight {name!r} has shape "
                                 f"{tuple(sd[name].shape)}, expected {tuple(p.shape)}")
            p.copy_(sd[name])


def shipped_drafter(target) -> Path | None:
    """The drafter shipped in ``specengine/data/drafters/*/`` for ``target`` (a ``LoadedModel``), or
    None. Found by what the target is, not by its path: the recorded target identity must
    match (``identity.match_target``: tokenizer, architecture config, weight sketch), so the
    alias, the HF directory and the GGUF file of one model all find it."""
    return shipped_drafters(target)[0]


def shipped_drafters(target) -> tuple[Path | None, dict[str, str]]:
    """``(the matching shipped drafter or None, {drafter name: why it does not match})``."""
    current = target_identity(target)
    why = {}
    for cfg_file in sorted(DRAFTERS_DIR.glob("*/config.json")):
        try:
            recorded = json.loads(cfg_file.read_text()).get("target", {})
        except (json.JSONDecodeError, UnicodeDecodeError):
            why[cfg_file.parent.name] = "corrupt config.json"
            continue
        reason = match_target(recorded, current)
        if reason is None:
            return cfg_file.parent, why
        why[cfg_file.parent.name] = reason
    return None, why
