"""musecore's AMD backend: MXFP4 through Triton ``tl.dot_scaled`` (W4A4 on gfx950, W4A16 on gfx942),
the shared Triton kernels, FP8 with the e4m3fnuz conversion on MI300X.

Registered under the ``musecore.backends`` entry point as ``rocm``::

    from musecore_rocm import RocmBackend
    be = RocmBackend("cuda")
    print(be.probe(), be.supports("linear", OpSpec("linear", weight_format="mxfp4", act_format="mxfp4")))
"""

import torch

from musecore_rocm import triton_hooks
from musecore_rocm.backend import RocmBackend

if torch.version.hip is not None:  # a ROCm torch: the shared Triton kernels take the ROCm hooks
    triton_hooks.install()

__all__ = ["RocmBackend"]
