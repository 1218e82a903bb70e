"""Triton kernels of the CUDA backend (each also runs under ``TRITON_INTERPRET=1`` on CPU)."""
