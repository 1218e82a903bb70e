"""The FlyDSL MoE candidate (AMD's layout-algebra DSL, PyPI ``flydsl``, which aiter's MXFP4 MoE kernels
use): status only. No FlyDSL kernel has been written yet, so the Triton ``dot_scaled`` MoE of
``musecore_triton`` is the only MoE that runs; the plan shows this reason beside it.
"""

from __future__ import annotations

import importlib.util


def flydsl_status() -> tuple[bool, str]:
    """``(usable, reason)``: never raises, imports nothing."""
    installed = importlib.util.find_spec("flydsl") is not None
    where = "flydsl is installed" if installed else "flydsl is not installed (optional)"
    return False, f"not implemented ({where}; the Triton dot_scaled MoE is the kernel that runs)"
