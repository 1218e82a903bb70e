"""musecore's NVIDIA backend: Triton W4A16 FP4 GEMM and MoE on Hopper, flash attention, fused norms.

Registered under the ``musecore.backends`` entry point as ``cuda``::

    from musecore_cuda import CudaBackend
    be = CudaBackend("cuda")
    print(be.probe(), be.supports("linear", OpSpec("linear", weight_format="nvfp4")))
"""

from musecore_cuda.backend import CudaBackend

__all__ = ["CudaBackend"]
