"""Builds the detector._C extension (the detector::giou_loss custom ops) with the package.

CUDA kernels when torch was built with CUDA and nvcc is found (CUDA_HOME), the CPU kernel alone
otherwise. Install with ``pip install --no-build-isolation -e .`` (``make setup``): the build needs the
torch that will import it. CUDA targets: sm_90 code plus compute_80 PTX, or TORCH_CUDA_ARCH_LIST.
"""

import os
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

SOURCES = Path("extensions")


def cuda_buildable() -> bool:
    nvcc = Path(CUDA_HOME or "", "bin", "nvcc")
    return torch.version.cuda is not None and CUDA_HOME is not None and nvcc.exists()


CPU_SOURCES = ["giou_op.cpp", "giou_checks.cpp", "giou_autograd.cpp"]  # schema + CPU kernel, checks, autograd
CUDA_SOURCES = ["giou_cuda.cpp", "giou_kernels.cu"]  # CUDA implementation, plain CUDA kernels


def extension():
    cxx_flags = ["-O3"]  # the C++ standard is the one torch picks for its headers
    if not cuda_buildable():
        print("detector._C: building the CPU kernel only (no CUDA torch or no nvcc)")
        sources = [str(SOURCES / s) for s in CPU_SOURCES]
        return CppExtension("detector._C", sources, extra_compile_args={"cxx": cxx_flags})
    nvcc_flags = ["-O3"]
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):  # otherwise torch adds the listed architectures
        nvcc_flags += ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_80,code=compute_80"]
    return CUDAExtension(
        "detector._C",
        [str(SOURCES / s) for s in CPU_SOURCES + CUDA_SOURCES],
        define_macros=[("WITH_CUDA", None)],
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


setup(ext_modules=[extension()], cmdclass={"build_ext": BuildExtension})
