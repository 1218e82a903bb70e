"""The FlyDSL MoE candidate (AMD's layout-algebra DSL, PyPI ``flydsl``, which aiter's MXFP4 MoE kernels
use): status only, for the plan. Its first kernel, an MXFP4 grouped expert GEMM on gfx950's scaled
MFMA, lives in ``backends/rocm/lab/flydsl`` and compiles in CI, but has never run (no AMD GPU was
reachable and FlyDSL has no CPU interpreter), so it is not selected: the Triton ``dot_scaled`` MoE
of ``musecore_triton`` runs, and the plan says why.
"""

from __future__ import annotations

import importlib.util


def flydsl_status() -> tuple[bool, str]:
    """``(usable, reason)``: never raises, imports nothing."""
    installed = "flydsl is installed" if importlib.util.find_spec("flydsl") is not None else "flydsl is not installed"
    return False, (f"not selected ({installed}): its MXFP4 expert GEMM (backends/rocm/lab/flydsl) compiles to "
                   "gfx950 scaled MFMA but has never run, and the gate/up + finalize kernels are not written")
