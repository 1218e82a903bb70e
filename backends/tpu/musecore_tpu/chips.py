"""The TPU generations this backend serves: catalog name, the device kinds that report it, and the per-chip facts
the tiling and the plan use.

Numbers are jax 0.10.2's own table (``jax.experimental.pallas.tpu.get_tpu_info_for_chip``, source
``jax/_src/pallas/mosaic/tpu_info.py``), which Pallas uses to size VMEM: per TensorCore VMEM 128 MiB on v6e and
64 MiB on v7; HBM 34.4 GB per v6e chip (one TensorCore) and 206 GB per v7 chip (two TensorCores, which jax
shows as two devices of 103 GB each: v7 has no megacore); HBM bandwidth 1.64 TB/s (v6e) and 7.4 TB/s per v7
chip; v6e's MXU runs int8 at 2x and int4 at 4x its bf16 rate and fp8 at the bf16 rate; v7 runs fp8 at 2x bf16
and has no int8/int4 MXU path. The device-kind strings are those jax and torch_tpu report
(``chip_version_from_device_kind``; torch_tpu 0.2.0 ``_internal/distributed/device_utils.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MiB = 1 << 20


@dataclass(frozen=True)
class Chip:
    name: str                      # catalog device (musecore/devices.py)
    device_kinds: tuple[str, ...]  # what jax / torch_tpu report as device_kind
    tensorcores: int               # per chip
    vmem_bytes: int                # per TensorCore
    hbm_bytes: int                 # per chip
    hbm_bytes_per_s: float         # per chip
    bf16_flops: float              # per chip
    mxu_formats: tuple[str, ...]   # operand formats the MXU multiplies faster than bf16


CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("tpu-v6e", ("TPU v6e", "TPU v6 lite"), 1, 128 * MiB, 34_400_000_000, 1.64e12, 9.20e14, ("int8", "int4")),
    Chip("tpu-v7", ("TPU7x", "TPU7"), 2, 64 * MiB, 206_000_000_000, 7.40e12, 2.31e15, ("fp8",)),
)}


def chip_for_device_kind(kind: str) -> Optional[Chip]:
    """The catalog chip of a jax/torch_tpu ``device_kind`` string, or None (another generation)."""
    for chip in CHIPS.values():
        if kind in chip.device_kinds:
            return chip
    return None


def smallest_vmem() -> int:
    """The VMEM budget a kernel config must fit to run on every chip here (v7's 64 MiB)."""
    return min(c.vmem_bytes for c in CHIPS.values())
