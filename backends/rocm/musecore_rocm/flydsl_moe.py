"""The FlyDSL MoE candidate (AMD's layout-algebra DSL, PyPI ``flydsl``, which aiter's MXFP4 MoE kernels
use): status only, for the plan. Its three kernels for gfx950 live in ``backends/rocm/lab/flydsl``: the
expert GEMMs on the scaled MFMA (gate/up with SwiGLU, down; ``mx_expert_gemm.py``) and the finalize
(unpermute + per-expert post norm + routing weight + fp32 sum; ``moe_finalize.py``). They compile in CI,
but have never run (no AMD GPU was reachable and FlyDSL has no CPU interpreter), so they are not
selected: the Triton ``dot_scaled`` MoE of ``musecore_triton`` runs, and the plan says why.
"""

from __future__ import annotations

import importlib.util


def flydsl_status() -> tuple[bool, str]:
    """``(usable, reason)``: never raises, imports nothing."""
    installed = "flydsl is installed" if importlib.util.find_spec("flydsl") is not None else "flydsl is not installed"
    return False, (f"not selected ({installed}): its MXFP4 gate/up+SwiGLU and down GEMMs and its finalize "
                   "(backends/rocm/lab/flydsl) compile to gfx950 (scaled MFMA) but have never executed")
