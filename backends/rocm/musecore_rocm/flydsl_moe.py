"""The FlyDSL MoE candidate (AMD's layout-algebra DSL, PyPI ``flydsl``, which aiter's MXFP4 MoE kernels
use): status only, for the plan. Its two expert GEMMs on gfx950's scaled MFMA (gate/up with SwiGLU,
down) live in ``backends/rocm/lab/flydsl`` and compile in CI, but have never run (no AMD GPU was
reachable and FlyDSL has no CPU interpreter), so they are not selected: the Triton ``dot_scaled`` MoE
of ``musecore_triton`` runs, and the plan says why.
"""

from __future__ import annotations

import importlib.util


def flydsl_status() -> tuple[bool, str]:
    """``(usable, reason)``: never raises, imports nothing."""
    installed = "flydsl is installed" if importlib.util.find_spec("flydsl") is not None else "flydsl is not installed"
    return False, (f"not selected ({installed}): its MXFP4 gate/up+SwiGLU and down GEMMs (backends/rocm/lab/flydsl) "
                   "compile to gfx950 scaled MFMA but have never run")
