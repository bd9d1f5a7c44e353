"""The C++ extension ``specengine._C``; everything else about the package is in pyproject.toml.

    pip install --no-build-isolation -e .

The extension is compiled against the torch already installed (hence --no-build-isolation).
CPU kernels are compiled for the portable x86-64 baseline; AVX-512 code paths carry
function-level ``target`` attributes and are chosen at run time, so the wheel runs anywhere.
The CUDA kernels in ``csrc/cuda/`` are added when torch has CUDA and ``nvcc`` is found
(set ``SPECENGINE_NO_CUDA=1`` to skip them).
"""

import glob
import os
import shutil

from setuptools import setup


def extension_modules():
    """The ``specengine._C`` extension, CUDA-enabled when the toolchain allows it."""
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = sorted(glob.glob("csrc/*.cpp"))
    # -g0: Python's CFLAGS ask for debug info, which costs build time and ~9 MB of .so
    cxx = ["-O3", "-g0", "-fopenmp", "-Wno-psabi"]
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


setup(ext_modules=extension_modules(), cmdclass=cmdclass())
