"""Vendor launch details of the portable Triton kernels, as hooks a GPU backend installs.

The kernels of :mod:`musecore_triton.kernels` are written once for every GPU Triton targets. What
only one vendor has enters here, with a portable default that changes nothing:

* **dependent launch** (NVIDIA PDL): every kernel takes a ``PDL`` constexpr and calls
  :func:`pdl_wait` before it reads what an earlier kernel wrote; the early-signalling GEMVs call
  :func:`pdl_launch_dependents`. By default both are no-ops and :func:`launch_options` returns
  ``{"PDL": False}``, so the kernel carries no wait at all;
* **launch features**: :func:`launch_features` gives the constexprs that pick vendor code paths
  (``HW_FP8``: hardware e4m3 conversion; ``PACKED_UPCAST``: the :func:`fp4x2_bf16_scaled` hook for
  the bf16 FP4 upcast). Default: both off, the integer-op paths that run anywhere (and in the
  CPU interpreter);
* **SM count**: :func:`num_sms` sizes split-K and flash-decoding grids;
* **L2 warming**: where :func:`l2_warm` says so (a kernel's ``WARM`` constexpr), the decode GEMVs whose last program
  runs a row op (``dense_gemv``'s epilogues, the router's choice) call :func:`prefetch_l2` on their slice of that row
  op's constant operands, so that the launch's serial tail finds them in L2 instead of memory. Default: off, and
  ``prefetch_l2`` does nothing;
* **eager first attention step**: where :func:`eager_first_step` says so, the one-token decode attention loads its
  first step's k and v together with that step's key positions (its ``EAGER`` constexpr): one memory round trip
  fewer per call, for more registers. Default: off (on AMD it costs the windowed program its second wave);
* **row-op cuts**: :func:`row_op_cut` gives the rows x warps per program of the decode launches whose last program
  runs a row op over the whole row (``dense_gemv``'s residual norm, the router + pooler launch, the q/k/v/gate GEMV's
  heads), where a backend has timed them. Default: None, the kernels' own cut (``dense_gemv.BLOCK_N`` x
  ``NUM_WARPS``);
* **router columns**: :func:`router_block_k` gives the hidden columns per program of the one-token router launches
  (``router_topk_one_launch``, the router + pooler launch). Default: None, the kernel's own (32).

A backend installs its versions once, at import, before any kernel is compiled::

    from musecore_triton import hooks
    hooks.install("cuda", launch_options=..., pdl_wait=..., ...)

A second backend may not replace them (``install`` raises naming both); a backend installs only
where its torch build is the one running (the CUDA backend: ``torch.version.hip is None``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _no_pdl_wait(PDL: tl.constexpr):
    pass


@triton.jit
def _no_pdl_launch_dependents(EARLY: tl.constexpr):
    pass


@triton.jit
def _no_prefetch_l2(ptrs, mask):
    pass


@triton.jit
def _fp4_bf16(c):
    """E2M1 codes (int32) -> bf16 holding value * 2**-126 exactly."""
    return (((c & 7) << 6) | ((c & 8) << 12)).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp4x2_bf16_scaled_portable(b, m_lo, m_hi):
    """Packed E2M1 bytes -> (low-nibble, high-nibble) bf16 values times their multipliers."""
    c = b.to(tl.int32)
    return _fp4_bf16(c & 15) * m_lo, _fp4_bf16(c >> 4) * m_hi


# Triton functions the kernels call (resolved when a kernel is compiled; install() replaces them).
pdl_wait = _no_pdl_wait
pdl_launch_dependents = _no_pdl_launch_dependents
fp4x2_bf16_scaled = _fp4x2_bf16_scaled_portable
prefetch_l2 = _no_prefetch_l2


def _default_launch_options(device: torch.device, kernel: str) -> dict:
    return {"PDL": False}


def _default_early_trigger(device: torch.device, kernel: str) -> bool:
    return False


def _default_launch_features(device: torch.device) -> dict:
    return {"HW_FP8": False, "PACKED_UPCAST": False}


def _default_l2_warm(device: torch.device) -> bool:
    return False


def _default_eager_first_step(device: torch.device) -> bool:
    return False


def _default_row_op_cut(device: torch.device, kernel: str) -> Optional[tuple[int, int]]:
    return None


def _default_router_block_k(device: torch.device) -> Optional[int]:
    return None


def _default_num_sms(device: torch.device) -> int:
    if device.type == "cuda":  # torch's name for any GPU device, NVIDIA or AMD
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: keep grids small


_launch_options: Callable[[torch.device, str], dict] = _default_launch_options
_early_trigger: Callable[[torch.device, str], bool] = _default_early_trigger
_launch_features: Callable[[torch.device], dict] = _default_launch_features
_num_sms: Callable[[torch.device], int] = _default_num_sms
_l2_warm: Callable[[torch.device], bool] = _default_l2_warm
_eager_first_step: Callable[[torch.device], bool] = _default_eager_first_step
_row_op_cut: Callable[[torch.device, str], Optional[tuple[int, int]]] = _default_row_op_cut
_router_block_k: Callable[[torch.device], Optional[int]] = _default_router_block_k
_owner: Optional[str] = None


def launch_options(device: torch.device, kernel: str) -> dict:
    """Keywords for launching ``kernel`` on ``device``: at least the ``PDL`` constexpr (and whatever
    launch attribute goes with it)."""
    return _launch_options(device, kernel)


def early_trigger(device: torch.device, kernel: str) -> bool:
    """Whether ``kernel`` lets the next one start from its top (the ``EARLY`` constexpr of the GEMVs)."""
    return _early_trigger(device, kernel)


def launch_features(device: torch.device) -> dict:
    """The vendor-path constexprs (``HW_FP8``, ``PACKED_UPCAST``) for kernels launched on ``device``."""
    return _launch_features(device)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (compute units) of ``device``; 4 in the CPU interpreter."""
    return _num_sms(device)


def l2_warm(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` call :func:`prefetch_l2` (their ``WARM`` constexpr)."""
    return _l2_warm(device)


def eager_first_step(device: torch.device) -> bool:
    """Whether the one-token decode attention on ``device`` loads its first step's k and v with the step's key
    positions (the ``EAGER`` constexpr; ``attention.EAGER_FIRST_STEP`` overrides it when not None)."""
    return _eager_first_step(device)


def row_op_cut(device: torch.device, kernel: str) -> Optional[tuple[int, int]]:
    """``(rows, warps)`` per program for the row-op launch ``kernel`` on ``device`` (``"residual_norm"``: a
    ``dense_gemv`` with the residual norm in its last program; ``"router_pooler"``; ``"qkv"``: the q/k/v/gate GEMV
    with its heads' norms; ``"qkv_deferred"``: that GEMV running the residual norm before it in every program), or
    None: the kernel's own cut."""
    return _row_op_cut(device, kernel)


def router_block_k(device: torch.device) -> Optional[int]:
    """Hidden columns per program of the one-token router launches on ``device``, or None: the kernel's own."""
    return _router_block_k(device)


def owner() -> Optional[str]:
    """The backend whose hooks are installed, or None (the portable defaults)."""
    return _owner


def install(backend: str, *, launch_options: Optional[Callable[[torch.device, str], dict]] = None,
            early_trigger: Optional[Callable[[torch.device, str], bool]] = None,
            launch_features: Optional[Callable[[torch.device], dict]] = None,
            num_sms: Optional[Callable[[torch.device], int]] = None,
            l2_warm: Optional[Callable[[torch.device], bool]] = None,
            eager_first_step: Optional[Callable[[torch.device], bool]] = None,
            row_op_cut: Optional[Callable[[torch.device, str], Optional[tuple[int, int]]]] = None,
            router_block_k: Optional[Callable[[torch.device], Optional[int]]] = None,
            pdl_wait: Any = None, pdl_launch_dependents: Any = None, fp4x2_bf16_scaled: Any = None,
            prefetch_l2: Any = None) -> None:
    """Install ``backend``'s hooks (those not given keep the portable default). Call once, at import,
    before any kernel is compiled: Triton resolves the jit hooks when it compiles a kernel."""
    global _launch_options, _early_trigger, _launch_features, _num_sms, _l2_warm, _eager_first_step, _row_op_cut
    global _router_block_k, _owner
    if _owner is not None and _owner != backend:
        raise RuntimeError(f"musecore_triton hooks are already installed by backend {_owner!r}; {backend!r} cannot "
                           "replace them (install a backend's hooks only where its torch build runs)")
    jit = {"pdl_wait": pdl_wait, "pdl_launch_dependents": pdl_launch_dependents,
           "fp4x2_bf16_scaled": fp4x2_bf16_scaled, "prefetch_l2": prefetch_l2}
    for name, fn in jit.items():
        if fn is not None and not isinstance(fn, triton.runtime.jit.KernelInterface):  # jit or interpreted
            raise TypeError(f"hook {name} must be a @triton.jit function; got {type(fn).__name__}")
    _owner = backend
    _launch_options = launch_options or _launch_options
    _early_trigger = early_trigger or _early_trigger
    _launch_features = launch_features or _launch_features
    _num_sms = num_sms or _num_sms
    _l2_warm = l2_warm or _l2_warm
    _eager_first_step = eager_first_step or _eager_first_step
    _row_op_cut = row_op_cut or _row_op_cut
    _router_block_k = router_block_k or _router_block_k
    module = globals()
    for name, fn in jit.items():
        if fn is not None:
            module[name] = fn
