"""AMD's aiter (ROCm/aiter; PyPI ``amd-aiter``) as an optional plan candidate: never required.

On a ROCm host with aiter installed, ``aiter.fused_moe(..., quant_type=QuantType.per_1x32)`` (MXFP4
MoE, weights pre-shuffled with ``shuffle_weight`` / ``e8m0_shuffle``) and ``gemm_a4w4`` are the
vendor's tuned kernels beside this backend's Triton ones. This module only answers whether they
are usable here and why not: running them needs their weight/scale shuffles at load, which have
not been written or checked against aiter (no ROCm host was reachable). Its absence is a plan
reason, not an error. Note that the PyPI name ``aiter`` is an unrelated asyncio package: the
import alone does not prove AMD's library is present, so the check looks for ``fused_moe``.
"""

from __future__ import annotations

import importlib.util

AITER_SYMBOLS = ("fused_moe", "gemm_a4w4")


def aiter_status() -> tuple[bool, str]:
    """``(usable, reason)`` for AMD's aiter in this process; never raises, imports nothing when absent."""
    if importlib.util.find_spec("aiter") is None:
        return False, "aiter is not installed (AMD's ROCm/aiter, PyPI amd-aiter; optional)"
    try:
        import aiter
    except Exception as exc:  # aiter imports HIP extensions: on a host without ROCm the import fails
        return False, f"import aiter failed ({type(exc).__name__}: {exc})"
    missing = [s for s in AITER_SYMBOLS if not hasattr(aiter, s)]
    if missing:
        return False, (f"the installed 'aiter' lacks {missing}: it is not AMD's aiter (PyPI 'aiter' is an unrelated "
                       "asyncio package)")
    return False, ("AMD aiter is importable, but this backend has no aiter adapter yet (its MXFP4 weight/scale "
                   "shuffles are not implemented or checked); the Triton kernels run")
