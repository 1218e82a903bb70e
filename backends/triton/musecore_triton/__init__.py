"""musecore's portable Triton kernels, shared by the GPU backends (CUDA now, ROCm next).

No vendor import lives here: what only one vendor has (NVIDIA's programmatic dependent launch, a
PTX upcast, hardware FP8 conversion) enters through :mod:`musecore_triton.hooks`, which a backend
installs at import; without it every kernel runs its portable path. Triton itself comes with
PyTorch's GPU builds (this package does not pull it, so it never replaces a vendor's torch)::

    from musecore_triton.kernels.norms import rms_norm
    y = rms_norm(x, w, 1e-6)
"""
