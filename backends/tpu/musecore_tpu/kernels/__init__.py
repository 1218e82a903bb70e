"""The Pallas TPU kernels of musecore-tpu (JAX), each with a plain-``jnp`` reference beside it.

``matmul`` (BF16 and W4A16 INT4/MXFP4/NVFP4), ``moe`` (grouped experts over the routed rows with the
finalize), ``attention`` (GQA, sliding window, KV cache; prefill and decode), ``norms`` (rms_norm,
residual_norm). ``tiling`` holds every block shape and its VMEM footprint (no jax needed). All of them run in
the TPU interpreter on a CPU; none has run on a TPU yet.
"""
