"""musecore-xeon: the Intel/x86-64 CPU backend of musecore (INT4 weight-only GEMM and MoE).

Registered under the ``musecore.backends`` entry point as ``xeon``.
"""

from musecore_xeon.backend import XeonBackend

__all__ = ["XeonBackend"]
__version__ = "0.1.0"
