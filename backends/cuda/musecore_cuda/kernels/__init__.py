"""The CUDA backend's own kernels: the CUDA C++ FP4 GEMV/GEMM (NVRTC, sources in ``csrc/``), the Gluon NVFP4
GEMM (``fp4_gemm_gluon``, planned by ``fp4_gluon_plan``; imported only where Triton's Gluon runs), the decode
MoE through them, and programmatic dependent launch with the hooks it installs into the portable
Triton kernels of :mod:`musecore_triton` (which hold everything else)."""
