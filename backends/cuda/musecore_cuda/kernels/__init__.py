"""The CUDA backend's own kernels: the CUDA C++ FP4 GEMV/GEMM (NVRTC, sources in ``csrc/``), the decode
MoE through them, and programmatic dependent launch with the hooks it installs into the portable
Triton kernels of :mod:`musecore_triton` (which hold everything else)."""
