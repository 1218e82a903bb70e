"""CPU kernels of the xeon backend, built on PyTorch's own operators (no extension modules)."""
