"""AMD's aiter (ROCm/aiter; PyPI ``amd-aiter``) as an optional plan candidate: never required, opt-in.

On a gfx950 ROCm host with aiter installed, ``aiter.fused_moe(..., quant_type=QuantType.per_1x32)`` (MXFP4
MoE on weights pre-shuffled with ``shuffle_weight`` / ``e8m0_shuffle``) and ``gemm_a4w4`` (MXFP4 W4A4 GEMM)
are the vendor's tuned kernels beside this backend's Triton ones. **The adapter has never called the real
aiter** (no ROCm host was reachable): its calls are written against aiter's signatures as of
ROCm/aiter@e404860 (``aiter/fused_moe.py``, ``aiter/ops/gemm_op_a4w4.py``, ``aiter/ops/shuffle.py``,
``aiter/utility/fp4_utils.py``) and tested with a stand-in module that checks every argument's shape,
dtype and layout and computes the reference numerics from them. So aiter runs only when asked for
(``MUSECORE_ROCM_AITER=1``) and importable on gfx950; otherwise the plan shows why not.

How the calls map this model onto aiter:

* **MoE.** aiter's ``fused_moe`` sums the weighted expert outputs itself, but Muse Spark normalises each
  expert's output (the shared post-expert RMSNorm, scale first) *before* weighting. So each token-expert
  assignment is passed as its own row with top-1 and weight 1 (``hidden_states`` repeated k times), which
  makes aiter's output the expert outputs rounded to the activation dtype; the shared Triton finalize then
  does the unpermute-free norm, routing weight and fp32 sum. ``w1`` is gate and up stacked ``[E, 2I, h/2]``
  (aiter's separated gate/up layout) with ``ActivationType.Silu`` (``silu(gate) * up``). aiter quantizes the
  activations to MXFP4 with its own rule, so the numerics are not bit-equal to ``emulate=True`` (the Triton
  path's are).
* **Linear (W4A4).** The activation is quantized by this backend's kernel (the emulated plan's rule, so the
  activation bits equal ``emulate=True``'s), its scales shuffled with ``e8m0_shuffle``, then
  ``gemm_a4w4(A, B, A_scale, B_scale, dtype=..., bpreshuffle=True)`` on the preshuffled weight.

The PyPI name ``aiter`` is an unrelated asyncio package: the import alone does not prove AMD's library is
present, so the check looks for the functions the adapter calls.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

ENV = "MUSECORE_ROCM_AITER"
AITER_SYMBOLS = ("fused_moe", "gemm_a4w4")


@dataclass(frozen=True)
class AiterApi:
    """The parts of aiter the adapter calls (a stand-in module provides the same names in tests)."""

    fused_moe: Any
    gemm_a4w4: Any
    shuffle_weight: Any
    e8m0_shuffle: Any
    QuantType: Any
    ActivationType: Any
    fp4x2: torch.dtype
    fp8_e8m0: torch.dtype


def load_aiter() -> AiterApi:
    """Import what the adapter calls from aiter; ImportError/AttributeError with the cause otherwise."""
    aiter = importlib.import_module("aiter")
    missing = [name for name in AITER_SYMBOLS if not hasattr(aiter, name)]
    if missing:
        raise ImportError(f"the installed 'aiter' lacks {missing}: it is not AMD's aiter (PyPI 'aiter' is an "
                          "unrelated asyncio package)")
    fused_moe = importlib.import_module("aiter.fused_moe").fused_moe  # aiter.fused_moe is the module
    shuffle = importlib.import_module("aiter.ops.shuffle")
    fp4_utils = importlib.import_module("aiter.utility.fp4_utils")
    return AiterApi(fused_moe=fused_moe, gemm_a4w4=aiter.gemm_a4w4, shuffle_weight=shuffle.shuffle_weight,
                    e8m0_shuffle=fp4_utils.e8m0_shuffle, QuantType=aiter.QuantType,
                    ActivationType=aiter.ActivationType, fp4x2=aiter.dtypes.fp4x2, fp8_e8m0=aiter.dtypes.fp8_e8m0)


def aiter_status() -> tuple[bool, str]:
    """``(importable, reason)`` for AMD's aiter in this process; never raises, imports nothing when absent."""
    if importlib.util.find_spec("aiter") is None:
        return False, "aiter is not installed (AMD's ROCm/aiter, PyPI amd-aiter; optional)"
    try:
        load_aiter()
    except Exception as exc:  # aiter imports HIP extensions: on a host without ROCm the import fails
        if "not AMD's aiter" in str(exc):
            return False, str(exc)
        return False, f"import aiter failed ({type(exc).__name__}: {exc})"
    return True, "AMD aiter is importable"


def aiter_selected(arch: str | None) -> tuple[bool, str]:
    """Whether the MXFP4 W4A4 linears and MoE go to aiter here, and why (never raises)."""
    ok, reason = aiter_status()
    if not ok:
        return False, reason
    if arch != "gfx950":
        return False, f"{reason}, but its MXFP4 per_1x32 kernels need gfx950 (this is {arch})"
    if os.environ.get(ENV) != "1":
        return False, (f"{reason}; not selected: the adapter has never called the real aiter (set {ENV}=1 to run "
                       "it; numerics then follow aiter's activation rounding, not the emulated plan's)")
    return True, f"{reason}; selected by {ENV}=1 (the adapter has never been run against the real aiter)"


# -- the adapter: weights prepared once at load, then one call per op --------------------------------------

@dataclass
class AiterLinear:
    """An MXFP4 weight in gemm_a4w4's layout: preshuffled fp4x2 ``[N, K/2]``, shuffled E8M0 scales."""

    packed: torch.Tensor
    scales: torch.Tensor
    out_features: int
    in_features: int
    api: AiterApi


@dataclass
class AiterExperts:
    """MXFP4 experts in fused_moe's layout: ``w1`` gate and up stacked ``[E, 2I, h/2]``, ``w2`` ``[E, h, I/2]``
    (fp4x2, preshuffled (16, 16)), their E8M0 scales ``[E*2I, h/32]`` / ``[E*h, I/32]`` shuffled."""

    w1: torch.Tensor
    w2: torch.Tensor
    w1_scale: torch.Tensor
    w2_scale: torch.Tensor
    num_experts: int
    api: AiterApi


def aiter_fits(out_features: int, in_features: int) -> bool:
    """The (16, 16) weight shuffle needs rows % 16 == 0 and packed bytes % 32 == 0 (K % 64 == 0)."""
    return out_features % WEIGHT_TILE_N == 0 and (in_features // 2) % WEIGHT_TILE_K_BYTES == 0


def prepare_aiter_linear(packed: torch.Tensor, scales: torch.Tensor, api: AiterApi) -> AiterLinear:
    """Canonical MXFP4 ``packed [N, K/2]`` uint8 and ``scales [N, K/32]`` uint8 -> :class:`AiterLinear`."""
    n, kb = packed.shape
    w = api.shuffle_weight(packed.contiguous().view(api.fp4x2), layout=(16, 16))
    s = api.e8m0_shuffle(scales.contiguous().view(api.fp8_e8m0))
    return AiterLinear(w, s, n, kb * 2, api)


def aiter_linear(x: torch.Tensor, w: AiterLinear) -> torch.Tensor:
    """W4A4 ``x @ W^T``: activations quantized by this backend's kernel, the GEMM by ``gemm_a4w4``."""
    from musecore_triton.kernels.mx_gemm import mxfp4_quantize_activation
    api, lead = w.api, x.shape[:-1]
    a, a_scales = mxfp4_quantize_activation(x.reshape(-1, w.in_features))
    a_scales = api.e8m0_shuffle(a_scales.view(api.fp8_e8m0))
    y = api.gemm_a4w4(a.view(api.fp4x2), w.packed, a_scales, w.scales, dtype=x.dtype, bpreshuffle=True)
    return y.reshape(*lead, w.out_features)


def prepare_aiter_experts(experts, api: AiterApi) -> AiterExperts:
    """:class:`musecore_triton.kernels.mx_moe.MxExperts` (canonical bytes) -> :class:`AiterExperts`."""
    E, inter, hb = experts.gate.shape
    hidden = hb * 2
    w1 = torch.cat([experts.gate, experts.up], dim=1).view(api.fp4x2)          # [E, 2I, h/2], gate rows first
    w1_scale = torch.cat([experts.gate_scales, experts.up_scales], dim=1).reshape(E * 2 * inter, hidden // 32)
    w2_scale = experts.down_scales.reshape(E * hidden, inter // 32)
    return AiterExperts(w1=api.shuffle_weight(w1, layout=(16, 16)),
                        w2=api.shuffle_weight(experts.down.contiguous().view(api.fp4x2), layout=(16, 16)),
                        w1_scale=api.e8m0_shuffle(w1_scale.contiguous().view(api.fp8_e8m0)),
                        w2_scale=api.e8m0_shuffle(w2_scale.contiguous().view(api.fp8_e8m0)), num_experts=E,
                        api=api)


def aiter_moe(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: AiterExperts,
              post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
    """The ``moe`` op through ``aiter.fused_moe`` (one row per assignment, top-1, weight 1: the expert outputs)
    and the shared Triton finalize (post norm, routing weight, fp32 sum); fp32 ``[T, h]``."""
    from musecore_triton.kernels.moe import finalize
    api, (T, topk) = experts.api, ids.shape
    if T == 0:
        return torch.empty(0, z.shape[-1], dtype=torch.float32, device=z.device)
    rows = z.contiguous().repeat_interleave(topk, dim=0)                     # row t*k + j: token t, slot j
    one_each = torch.ones(T * topk, 1, dtype=torch.float32, device=z.device)
    out = api.fused_moe(rows, experts.w1, experts.w2, one_each, ids.reshape(-1, 1).to(torch.int32),
                        activation=api.ActivationType.Silu, quant_type=api.QuantType.per_1x32,
                        doweight_stage1=False, w1_scale=experts.w1_scale, w2_scale=experts.w2_scale)
    return finalize(out, ids.reshape(-1), ids, weights, post_norm, post_eps, sorted_rows=False, act_dtype=z.dtype)


# -- aiter's preshuffled MXFP4 layouts (what gemm_a4w4 / fused_moe read), as permutations --------------
# Written from aiter's definitions (aiter/ops/shuffle.py: ``shuffle_weight`` with layout (16, 16) on
# uint8, ``shuffle_scale`` for E8M0) so that the adapter can prepare weights once at load; each has
# its inverse, and the tests check both are bijections that undo each other (and equal aiter's own
# functions where aiter is importable).

WEIGHT_TILE_N, WEIGHT_TILE_K_BYTES, WEIGHT_LANE_BYTES = 16, 32, 16


def _weight_view(shape: tuple[int, ...]) -> tuple[int, ...]:
    *lead, n, kb = shape
    if n % WEIGHT_TILE_N or kb % WEIGHT_TILE_K_BYTES:
        raise ValueError(f"aiter's weight shuffle needs rows % {WEIGHT_TILE_N} == 0 and packed bytes % "
                         f"{WEIGHT_TILE_K_BYTES} == 0; got {list(shape)}")
    return (-1, n // WEIGHT_TILE_N, WEIGHT_TILE_N, kb // WEIGHT_TILE_K_BYTES,
            WEIGHT_TILE_K_BYTES // WEIGHT_LANE_BYTES, WEIGHT_LANE_BYTES)


def shuffle_weight(packed):
    """Canonical MXFP4 bytes ``[..., N, K/2]`` -> aiter's (16, 16) preshuffled order (same shape)."""
    return packed.reshape(_weight_view(tuple(packed.shape))).permute(0, 1, 3, 4, 2, 5).contiguous().reshape(packed.shape)


def unshuffle_weight(shuffled):
    """Inverse of :func:`shuffle_weight`."""
    *lead, n, kb = shuffled.shape
    v = _weight_view(tuple(shuffled.shape))
    tiled = shuffled.reshape(v[0], v[1], v[3], v[4], v[2], v[5])
    return tiled.permute(0, 1, 4, 2, 3, 5).contiguous().reshape(shuffled.shape)


def shuffle_scale(scale):
    """E8M0 scales ``[M, K/32]`` -> aiter's shuffled order, padded to ``[ceil(M/256)*256, ceil(K/32 / 8)*8]``."""
    import torch
    m, n = scale.shape
    sm, sn = (m + 255) // 256 * 256, (n + 7) // 8 * 8
    padded = torch.zeros(sm, sn, dtype=scale.dtype, device=scale.device)
    padded[:m, :n] = scale
    return padded.view(sm // 32, 2, 16, sn // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous().view(sm, sn)


def unshuffle_scale(shuffled, rows: int, cols: int):
    """Inverse of :func:`shuffle_scale`: the ``[rows, cols]`` scales back in row-major order."""
    sm, sn = shuffled.shape
    tiled = shuffled.view(sm // 32, sn // 8, 4, 16, 2, 2)  # the permuted axes (0, 3, 5, 2, 4, 1)
    return tiled.permute(0, 5, 3, 1, 4, 2).contiguous().view(sm, sn)[:rows, :cols]
