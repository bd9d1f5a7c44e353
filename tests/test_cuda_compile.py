"""Every CUDA source in csrc/cuda/ compiles with nvcc for sm_80 (A100) and sm_90 (H100/H200).

The kernels are self-contained (no torch headers), so each compile takes seconds. Skipped when
nvcc is not installed.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "csrc" / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")


def test_cuda_sources_exist():
    assert [p.name for p in SOURCES] == ["paged_attention.cu"]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(source, arch, tmp_path):
    cmd = [NVCC, "-c", "-O3", "-std=c++17", f"-arch={arch}", "-I", str(CUDA_DIR), str(source),
           "-o", str(tmp_path / f"{source.stem}_{arch}.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    assert (tmp_path / f"{source.stem}_{arch}.o").stat().st_size > 0
