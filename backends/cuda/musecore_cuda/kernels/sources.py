"""The CUDA C++ kernel sources of ``musecore_cuda/csrc``, read as package data for NVRTC.

NVRTC compiles one translation unit per kernel; the files are joined in dependency order (the
PDL helpers, then the decode kernels whose helpers the tiled GEMM reuses) instead of through
``#include``, so no include path has to reach the installed package.
"""

from __future__ import annotations

import functools
from importlib import resources


@functools.lru_cache(maxsize=None)
def read(*names: str) -> str:
    """The files ``names`` of ``csrc/`` joined in order, e.g. ``read("pdl.cuh", "fp4_gemv.cu")``."""
    folder = resources.files("musecore_cuda").joinpath("csrc")
    return "".join(folder.joinpath(name).read_text(encoding="utf-8") for name in names)
