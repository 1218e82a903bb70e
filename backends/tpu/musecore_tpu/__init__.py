"""musecore-tpu: the Cloud TPU backend of musecore (Pallas kernels through torch_tpu; verified in JAX's TPU
interpret mode on a CPU, never run on a TPU).

Registered under the ``musecore.backends`` entry point as ``tpu``. Importing it needs neither jax nor torch_tpu.
"""

from musecore_tpu.backend import TpuBackend

__all__ = ["TpuBackend"]
__version__ = "0.1.0"
