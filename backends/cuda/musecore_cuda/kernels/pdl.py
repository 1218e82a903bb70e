"""Programmatic dependent launch (PDL): a kernel starts while the one before it finishes.

A decode step is a few hundred dependent kernels of a few microseconds each, so each one's launch,
block scheduling and first weight loads are a large part of its time. With PDL (SM90+) a kernel is
launched with the attribute *programmatic stream serialization*: its blocks may start as soon as
every block of the previous kernel has executed ``griddepcontrol.launch_dependents`` (or exited),
and it must execute ``griddepcontrol.wait`` (which returns once the previous kernel has completed
and its writes are visible) before it reads anything an earlier kernel wrote, or writes anything.
Until that wait a kernel may only read what no kernel of the step writes: its weights.

Every musecore kernel that is launched with PDL follows one contract, so the chain stays ordered:

* before ``wait`` it reads only weights (resident parameters, written once at load);
* every block executes ``wait`` (none returns before it), so a kernel completes only after the
  one before it: kernels further back are ordered through the chain;
* only the kernels named *early* (by default the decode GEMVs, whose long weight streams leave a tail
  worth overlapping: the expert GEMVs on light grids only) signal ``launch_dependents`` at their top,
  and the one-token attention kernel right after its wait; every other kernel
  signals implicitly when its blocks exit, so at most a GEMV and the kernel after it are resident
  at once. Triggering early everywhere broke one long generate sequence (backends/cuda/lab/NOTES.md).

A kernel launched without the attribute (PyTorch's, cuBLAS's) is ordered as usual, and both
instructions are no-ops in a kernel launched without it, so the kernels stay correct whichever
way they are launched. Where PDL is used: the decode step's CUDA graph of up to :data:`MAX_BATCH`
sequences is captured with it (:func:`scope`); everything else launches the ordinary way.
``MUSECORE_CUDA_PDL`` (``1``, ``0`` or kernel names) overrides that, and
``MUSECORE_CUDA_PDL_EARLY`` = ``1`` (the default set), ``0`` (none) or a comma list names the
kernels that trigger early; :meth:`CudaBackend.env_settings` reports both.

The portable Triton kernels (:mod:`musecore_triton`) take a ``PDL`` constexpr and call the hooks
``pdl_wait`` / ``pdl_launch_dependents``, which :mod:`musecore_cuda.kernels.triton_hooks` sets to
:func:`wait` and :func:`trigger` here; they are launched with ``launch_pdl=`` :func:`enabled`. The
NVRTC kernels (CUDA C++) call ``pdl_trigger()`` / ``pdl_wait()`` from ``csrc/pdl.cuh`` and are
launched through :func:`launch` (``cuLaunchKernelEx``), since ``torch.cuda._compile_kernel``'s
launcher takes no launch attributes. The Gluon linear (:mod:`musecore_cuda.kernels.fp4_gemm_gluon`, name
``fp4_gluon``) waits before it loads anything: requesting its first weights ahead of the wait measured slower
(session 64, backends/cuda/lab/NOTES.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
from typing import Any, Iterator, Sequence

import torch
import triton
import triton.language as tl

ENV = "MUSECORE_CUDA_PDL"
# Decode graphs of up to this many sequences are captured with PDL: it won at batch 1 and lost a little at
# 8-32 (backends/cuda/lab/NOTES.md); on an H100 (session 64, benchmarks/results/h200_issue26/ runs 106-108) muse-small
# gained 1.07x at batch 1 and lost ~2% at 2-16, also with the Gluon linear left out.
MAX_BATCH = 1
_scope: contextvars.ContextVar[bool] = contextvars.ContextVar("musecore_cuda_pdl_scope", default=False)


def _triton_has_gdc() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return hasattr(tl.extra.cuda, "gdc_wait") and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    """SM90+ NVIDIA (a ROCm build reports gfx9 as capability 9.x: griddepcontrol is PTX, not for it)."""
    return (torch.version.hip is None and torch.cuda.get_device_capability(index) >= (9, 0) and _triton_has_gdc()
            and hasattr(getattr(torch.cuda, "_utils", None), "_get_gpu_runtime_library"))


@contextlib.contextmanager
def scope(on: bool) -> Iterator[None]:
    """Launch with PDL inside this block (``on``) or not; outside every scope, kernels launch the
    ordinary way. ``make_graphed_decode_step`` opens one around its capture (``batch <= MAX_BATCH``)."""
    token = _scope.set(on)
    try:
        yield
    finally:
        _scope.reset(token)


def supported(device: torch.device) -> bool:
    """Whether ``device`` takes PDL launches at all (:func:`enabled` decides where they are used)."""
    return device.type == "cuda" and _supported(device.index if device.index is not None
                                                else torch.cuda.current_device())


_SYNONYMS = {"1": "1", "on": "1", "true": "1", "yes": "1", "0": "0", "off": "0", "false": "0", "no": "0"}


def env_setting() -> str | None:
    """``MUSECORE_CUDA_PDL`` as ``"1"``, ``"0"`` or a comma list of kernel names (None when unset); ``on`` /
    ``true`` / ``yes`` and ``off`` / ``false`` / ``no`` are ``1`` and ``0``, and anything else must be kernel names
    (a ValueError otherwise: ``on`` used to mean "the kernel named on", so PDL silently off)."""
    raw = os.environ.get(ENV)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _SYNONYMS:
        return _SYNONYMS[value]
    names = [n.strip() for n in value.split(",")]
    if not all(n.isidentifier() for n in names):
        raise ValueError(f"{ENV}={raw!r}: set 1 (on), 0 (off) or a comma list of kernel names (e.g. "
                         "fp4_gemv_mma,dense_gemv)")
    return ",".join(names)


def enabled(device: torch.device, name: str = "") -> bool:
    """Whether kernel ``name`` on ``device`` is launched with PDL: SM90+, a Triton with grid dependency
    control, and either ``MUSECORE_CUDA_PDL`` (``1``, ``0`` or a comma list of kernel names; it overrides
    everything, for A/B runs; :func:`env_setting`) or, when it is unset, the innermost :func:`scope`. Read at
    each launch (a captured CUDA graph keeps how it was captured)."""
    setting = env_setting()
    if setting is None:
        setting = "1" if _scope.get() else "0"
    if device.type != "cuda" or setting == "0" or (setting != "1" and name not in setting.split(",")):
        return False
    return supported(device)


EARLY_ENV = "MUSECORE_CUDA_PDL_EARLY"
# The plain decode GEMVs gain from an early signal. The expert GEMVs do on a light grid (muse-small's) and lost with
# it on the 816B MoE layer's full wave, so they signal early only on grids of a few blocks per SM
# (``fp4_gemv_cuda.EXPERTS_EARLY_BLOCKS_PER_SM``; backends/cuda/lab/NOTES.md, sessions 8 and 77). The one-token
# attention kernel signals right after its own wait, so o_proj's GEMV loads its weights while it attends (session 76,
# run 150, H100: muse-small's decode graph 708.0 -> 672.0 us per replay; cuda_fused_ab.py mode attn_early).
EARLY_DEFAULT = ("fp4_gemv_mma", "fp4_gemv_fma", "dense_gemv", "router_pooler", "attention",
                 "fp4_gemv_mma_experts")


def early(device: torch.device, name: str) -> bool:
    """Whether kernel ``name`` (launched with PDL) signals ``launch_dependents`` at its top rather than
    when its blocks exit: ``MUSECORE_CUDA_PDL_EARLY`` = ``1`` (:data:`EARLY_DEFAULT`), ``0`` or names."""
    setting = os.environ.get(EARLY_ENV, "1")
    names = EARLY_DEFAULT if setting == "1" else () if setting == "0" else tuple(setting.split(","))
    return name in names and enabled(device, name)


def triton_options(device: torch.device, name: str) -> dict:
    """Launch keywords of a Triton kernel that takes ``PDL``: the constexpr, and ``launch_pdl`` when on
    (left out when off, so the CPU interpreter of the tests never sees it)."""
    return {"PDL": True, "launch_pdl": True} if enabled(device, name) else {"PDL": False}


@triton.jit
def trigger(PDL: tl.constexpr):
    """Signal the next kernel now (only the early GEMVs); otherwise it is signalled as this one's blocks exit."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Wait for the kernel before: at the top of a kernel, or after the weight loads that may precede it."""
    if PDL:
        tl.extra.cuda.gdc_wait()


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _c_args(args: Sequence[Any]) -> tuple[list, Any]:
    """The kernel parameters as ``torch.cuda._compile_kernel`` passes them: a tensor as its data
    pointer (None as a null pointer), an int as a C int, a float as a C double (kept alive with the pointer array)."""
    keep = []
    for a in args:
        if a is None or isinstance(a, torch.Tensor):
            keep.append(ctypes.c_void_p(None if a is None else a.data_ptr()))
        elif isinstance(a, bool) or not isinstance(a, (int, float)):
            raise TypeError(f"unsupported kernel argument type {type(a).__name__}")
        else:
            keep.append(ctypes.c_int(a) if isinstance(a, int) else ctypes.c_double(a))
    array = (ctypes.c_void_p * len(keep))(*(ctypes.addressof(v) for v in keep))
    return keep, array


@functools.lru_cache(maxsize=None)
def _driver() -> Any:
    """libcuda through torch's loader, looked up once (torch's kernel launcher looks it up at every launch)."""
    return torch.cuda._utils._get_gpu_runtime_library()


def launch(kernel: Any, grid: Sequence[int], block: Sequence[int], args: Sequence[Any], shared_mem: int = 0,
           device: torch.device | None = None, name: str = "", dependent: bool = False) -> None:
    """Launch an NVRTC kernel (``torch.cuda._compile_kernel``'s result) on the current stream with
    ``cuLaunchKernelEx``, with the PDL attribute where :func:`enabled`, or wherever it is supported with
    ``dependent`` (a kernel that waits for the one before it by its own flags instead of ``griddepcontrol.wait``: the
    decode MoE's down GEMV). (The same launch as the kernel's own launcher, which costs more host time per call: an
    eager decode step makes ~30 of these.)"""
    device = device or torch.device("cuda", torch.cuda.current_device())
    if shared_mem >= 48 * 1024 and shared_mem > getattr(kernel, "_max_shared_mem_bytes", 0):
        raise RuntimeError(f"kernel needs {shared_mem} bytes of shared memory; call set_shared_memory_config first")
    keep, array = _c_args(args)
    attrs, count = None, 0
    if enabled(device, name) or (dependent and env_setting() != "0" and supported(device)):
        attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1
        attrs, count = ctypes.pointer(attr), 1
    config = _Config((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), shared_mem,
                     ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream), attrs, count)
    status = _driver().cuLaunchKernelEx(ctypes.byref(config), kernel.func, array, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
    del keep
