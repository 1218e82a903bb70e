"""What this CPU can do, read once from ``/proc/cpuinfo`` and PyTorch, and the thread setting
(musecore's rule: the cores free now, see ``musecore.threads``).

The Xeon backend picks its devices and its dense fallback from these facts: AMX (``amx_bf16``)
is what makes a machine a ``xeon6`` target; AVX-512 BF16 or AMX is what makes oneDNN's BF16 GEMM
fast, and without it PyTorch's BF16 matmul runs a scalar-ish path several times slower than fp32
SGEMM, so dense tiles are computed in fp32 there instead. Reading features never raises: a probe must be cheap and total.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Optional

import torch

# Flags the backend reports and decides on; everything else in /proc/cpuinfo is ignored.
REPORTED_FLAGS: tuple[str, ...] = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512f",
                                   "avx512_vnni", "avx512vl", "avx_vnni", "avx2", "fma", "f16c")

NUM_THREADS_ENV = "MUSECORE_NUM_THREADS"  # read by musecore.threads


@dataclass(frozen=True)
class CpuInfo:
    """CPU facts the backend decides on. ``error`` is set when /proc/cpuinfo could not be read."""

    vendor: str
    model_name: str
    arch: str
    logical_cores: int
    flags: frozenset[str] = field(default_factory=frozenset)
    torch_capability: str = "unknown"
    error: Optional[str] = None

    def has(self, flag: str) -> bool:
        return flag in self.flags

    @property
    def is_x86_64(self) -> bool:
        return self.arch in ("x86_64", "amd64", "AMD64")

    @property
    def has_amx(self) -> bool:
        return self.has("amx_bf16")

    @property
    def native_bf16_dot(self) -> bool:
        """True when oneDNN has a hardware BF16 dot product (AMX or AVX-512 BF16)."""
        return self.has("amx_bf16") or self.has("avx512_bf16")

    @property
    def isa_tier(self) -> str:
        """The best matmul ISA: ``amx`` > ``avx512_bf16`` > ``avx512`` > ``avx2`` > ``none``."""
        if self.has("amx_bf16"):
            return "amx"
        if self.has("avx512_bf16"):
            return "avx512_bf16"
        if self.has("avx512f"):
            return "avx512"
        if self.has("avx2"):
            return "avx2"
        return "none"

    def summary(self) -> str:
        present = [f for f in REPORTED_FLAGS if self.has(f)]
        return (f"{self.vendor} {self.model_name!r}, {self.logical_cores} logical cores, ISA tier {self.isa_tier}, "
                f"flags ({' '.join(present) or 'none of interest'}), torch CPU capability {self.torch_capability}")


def _parse_cpuinfo(text: str) -> tuple[str, str, frozenset[str]]:
    vendor, model, flags = "unknown", "unknown", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and vendor == "unknown":
            vendor = value.strip()
        elif key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return vendor, model, flags


def read_cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    """Read CPU features; on any failure return what is known with ``error`` set (never raises)."""
    arch = platform.machine()
    cores = os.cpu_count() or 1
    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except Exception as exc:  # a probe must not raise; the reason is kept and shown
        capability = f"unknown ({type(exc).__name__}: {exc})"
    try:
        with open(cpuinfo_path, encoding="utf-8", errors="replace") as f:
            vendor, model, flags = _parse_cpuinfo(f.read())
    except OSError as exc:
        return CpuInfo("unknown", "unknown", arch, cores, frozenset(), capability,
                       error=f"cannot read {cpuinfo_path}: {exc}")
    return CpuInfo(vendor, model, arch, cores, flags, capability)


def configure_threads(num_threads: Optional[int] = None) -> int:
    """Set PyTorch's intra-op threads (also the native kernels' OpenMP pool) and return the count:
    ``num_threads``, else ``MUSECORE_NUM_THREADS`` (a number or ``all``), else the cores free now.

    Not every core by default: on a shared CPU a parallel region waits for a thread whose core another
    process holds, and decode collapses (musecore/threads.py has the measurements and the rule).

    Example::

        configure_threads(4)              # or: MUSECORE_NUM_THREADS=4 python ...
    """
    from musecore.threads import configure_threads as configure

    return configure(num_threads)
