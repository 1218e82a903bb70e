"""musecore's NVIDIA backend: Triton W4A16 FP4 GEMM and MoE on Hopper, flash attention, fused norms.

Registered under the ``musecore.backends`` entry point as ``cuda``::

    from musecore_cuda import CudaBackend
    be = CudaBackend("cuda")
    print(be.probe(), be.supports("linear", OpSpec("linear", weight_format="nvfp4")))
"""

import torch

from musecore_cuda.backend import CudaBackend
from musecore_cuda.kernels import triton_hooks

if torch.version.hip is None:  # a CUDA (or CPU) torch: the shared Triton kernels take the NVIDIA hooks
    triton_hooks.install()

__all__ = ["CudaBackend"]
