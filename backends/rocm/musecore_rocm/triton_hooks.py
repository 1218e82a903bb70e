"""The ROCm hooks of the shared Triton kernels (:mod:`musecore_triton.hooks`), installed at import
on a ROCm build of torch only.

AMD has no programmatic dependent launch and no PTX, so the launch options and the jit hooks keep
their portable defaults: no ``PDL`` wait, the integer-op FP4 upcast, integer e4m3 decoding
(``HW_FP8`` off: the hardware e4m3 conversion differs between gfx942's fnuz and gfx950's OCP FP8,
and neither has been checked). The compute-unit count comes from torch's device properties (the
default). Installing marks ``rocm`` as the owner, so a CUDA backend cannot install NVIDIA hooks
into the same process.
"""

from __future__ import annotations

import torch

from musecore_triton import hooks


def _launch_options(device: torch.device, kernel: str) -> dict:
    return {"PDL": False}


def install() -> None:
    hooks.install("rocm", launch_options=_launch_options)
