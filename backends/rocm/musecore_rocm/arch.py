"""AMD Instinct architectures this backend targets, and the one check of whether one is here.

``gcnArchName`` (``torch.cuda.get_device_properties(i).gcnArchName`` on a ROCm build of torch,
e.g. ``"gfx950:sramecc+:xnack-"``) names the chip; its first field maps to the catalog devices
(``musecore.devices``). What each architecture can do is data (:data:`ARCHES`), which
``RocmBackend.supports`` answers from:

* gfx950 (CDNA4; MI350X, MI355X): scaled MFMA on FP4/FP6/FP8 operands with E8M0 block scales
  (``v_mfma_scale_f32_{16x16x128,32x32x64}_f8f6f4``), so MXFP4 W4A4 is native; FP8 is OCP e4m3fn.
* gfx942 (CDNA3; MI300X): no FP4 matrix cores, so MXFP4 runs as W4A16 (``dot_scaled`` upcasts);
  FP8 is e4m3fnuz (bias 8: the same bits mean half the value of e4m3fn, and 0x80 is NaN), so
  e4m3fn checkpoints are converted at load (:mod:`musecore_rocm.fp8`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class Arch:
    name: str                    # gfx target
    devices: tuple[str, ...]     # catalog names (musecore.devices)
    mxfp4_w4a4: bool             # scaled MFMA on e2m1 x e2m1
    fp8_dtype: str               # the hardware's e4m3 flavour: "e4m3fn" (OCP) or "e4m3fnuz"
    compute_units: int
    hbm_tb_s: float              # peak HBM bandwidth, vendor figure
    mxfp4_dense_pflops: float    # peak dense MXFP4 matrix rate, vendor figure (0: no FP4 matrix cores)
    bf16_dense_pflops: float
    notes: str = ""


ARCHES: dict[str, Arch] = {a.name: a for a in (
    Arch("gfx950", ("mi355x", "mi350x"), True, "e4m3fn", 256, 8.0, 10.1, 2.5,
         "CDNA4: MI355X figures (MI350X: 9.2 PFLOP/s MXFP4, lower clocks)"),
    Arch("gfx942", ("mi300x",), False, "e4m3fnuz", 304, 5.3, 0.0, 1.3, "CDNA3: MI300X"),
)}
DEVICE_ARCH: dict[str, str] = {d: a.name for a in ARCHES.values() for d in a.devices}


def arch_of(gcn_arch_name: str) -> str:
    """``"gfx950:sramecc+:xnack-"`` -> ``"gfx950"``."""
    return gcn_arch_name.split(":")[0].strip()


@dataclass
class RocmDevice:
    """What the probe found: a usable AMD GPU, or why not."""

    available: bool
    reason: str
    arch: Optional[str] = None
    name: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def find_rocm_device(index: int = 0) -> RocmDevice:
    """The one availability check of this backend: a ROCm build of torch, a visible GPU, a known arch.
    Never raises: every failure becomes the reason."""
    try:
        hip = torch.version.hip
        if hip is None:
            return RocmDevice(False, "no ROCm device: torch.version.hip is None (this torch is not a ROCm build; "
                                     "install torch from https://download.pytorch.org/whl/rocm*)")
        if not torch.cuda.is_available():
            return RocmDevice(False, f"no ROCm device: torch {torch.__version__} (hip {hip}) sees no GPU "
                                     "(torch.cuda.is_available() is False; check HIP_VISIBLE_DEVICES and /dev/kfd)")
        props = torch.cuda.get_device_properties(index)
        gcn = getattr(props, "gcnArchName", "") or ""
    except Exception as exc:  # probe never raises
        return RocmDevice(False, f"no ROCm device: probing failed with {type(exc).__name__}: {exc}")
    arch = arch_of(gcn)
    details = {"gcnArchName": gcn, "name": props.name, "hip": hip, "compute_units": props.multi_processor_count}
    if arch not in ARCHES:
        targets = ", ".join(f"{a.name} ({'/'.join(a.devices)})" for a in ARCHES.values())
        return RocmDevice(False, f"{props.name} is {arch or 'an unknown arch'}; this backend targets {targets}",
                          arch=arch or None, name=props.name, details=details)
    return RocmDevice(True, f"{props.name} ({arch}, hip {hip})", arch=arch, name=props.name, details=details)
