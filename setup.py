"""Build specengine and its C++ extension ``specengine._C``.

    pip install --no-build-isolation -e .

CPU kernels are compiled for the portable x86-64 baseline; AVX-512 code paths carry
function-level ``target`` attributes and are chosen at run time, so the wheel runs anywhere.
The CUDA kernels in ``csrc/cuda/`` are added when torch has CUDA and ``nvcc`` is found
(set ``SPECENGINE_NO_CUDA=1`` to skip them).
"""

import glob
import os
import shutil

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def extension_modules():
    """The ``specengine._C`` extension, CUDA-enabled when the toolchain allows it."""
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = sorted(glob.glob("csrc/*.cpp"))
    cxx = ["-O3", "-fopenmp", "-Wno-psabi"]
    link = ["-fopenmp"]
    with_cuda = (torch.version.cuda is not None and shutil.which("nvcc") is not None
                 and not os.environ.get("SPECENGINE_NO_CUDA"))
    if with_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        return [CUDAExtension(
            "specengine._C", sources, define_macros=[("SPECENGINE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--use_fast_math"]},
            extra_link_args=link)]
    return [CppExtension("specengine._C", sources, extra_compile_args={"cxx": cxx},
                         extra_link_args=link)]


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension
    return {"build_ext": BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)}


setup(
    name="specengine",
    version="0.1.0",
    description="Lossless adaptive speculative decoding for LLM RL rollouts",
    packages=find_packages(include=["specengine", "specengine.*"]),
    package_data={"specengine": ["**/*.json", "**/*.safetensors"]},
    python_requires=">=3.10",
    install_requires=["torch", "transformers", "safetensors", "gguf", "tqdm", "numpy"],
    extras_require={"test": ["pytest", "pytest-benchmark", "ruff"], "ray": ["ray"],
                    "serve": ["fastapi==0.165.0", "uvicorn==0.54.0"],
                    "trl": ["trl==1.16.0", "datasets==5.2.0"]},
    entry_points={"console_scripts": ["specengine = specengine.cli:main"]},
    ext_modules=extension_modules(),
    cmdclass=cmdclass(),
    zip_safe=False,
)
