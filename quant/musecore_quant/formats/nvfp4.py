"""NVFP4 (NVIDIA): E2M1 elements, one E4M3 scale per 16 inputs, one fp32 scale per tensor.

Blackwell runs NVFP4 natively, and the Muse Spark Open checkpoint ships in it, so this codec must
write what nvidia-modelopt writes, byte for byte, and read it back exactly. The rules (FORMATS.md):

- ``weight_scale_2 = amax(|W|) / (6 * 448)`` per matrix (per expert when experts are stacked);
  fused siblings (q/k/v, an expert's gate/up) share the largest one (``nvfp4_shared_global_amax``);
- block scale ``s = e4m3_rne(clamp(block_amax / (6 * weight_scale_2), 2^-9, 448))``, an all-zero
  block gets 1.0. The clamp is ModelOpt 0.47's: a block far below the tensor's amax gets the
  smallest E4M3 subnormal instead of underflowing to a zero scale;
- codes ``fp4(W / (fp32(s) * weight_scale_2))``: division by the *rounded* scale, so a block's
  largest element can land above 6 and saturate;
- dequantization ``E2M1(code) * (fp32(s) * weight_scale_2)``, in that order (as ModelOpt).

The order of every fp32 operation follows ModelOpt's ``NVFP4QTensor``, because a different order
(``W / s / weight_scale_2``) rounds differently and changes bytes. Divisions are correctly rounded
on every device (``_common.divide``), so CPU and CUDA write the same bytes; ModelOpt run on CUDA
can differ from its own CPU result in the last bit of ``weight_scale_2``.

One deliberate departure, where ModelOpt writes NaN scales: an all-zero matrix (or one whose
``amax / 2688`` underflows fp32) gets ``weight_scale_2 = 1/2688``, as if its amax were 1.

Example::

    qt = nvfp4_quantize(w)                    # w: [out, in] or stacked experts [E, out, in]
    w_hat = nvfp4_dequantize(qt)              # fp32, same shape
    g = nvfp4_shared_global_amax(gate, up)    # one weight_scale_2 for a fused gate/up
    qg, qu = nvfp4_quantize(gate, global_amax=g), nvfp4_quantize(up, global_amax=g)
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..qtensor import QTensor
from ._common import (divide, leading_shape, require_divisible, require_finite, require_float_tensor, require_weight,
                      row_chunks)
from .fp4 import FP4_MAX, check_rounding, fp4_decode, fp4_encode, pack_nibbles, unpack_nibbles

NVFP4_BLOCK_SIZE = 16
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
_LABEL = "NVFP4"


def nvfp4_global_amax(w: torch.Tensor) -> torch.Tensor:
    """amax(|W|) per matrix as fp32: a scalar for ``[out, in]``, ``[E]`` for stacked ``[E, out, in]``."""
    w = require_weight(w, _LABEL)
    return _matrix_amax(w)


def _matrix_amax(w: torch.Tensor) -> torch.Tensor:
    low, high = w.flatten(-2).aminmax(dim=-1)          # no full-size |w| temporary
    return torch.maximum(-low, high).float()


def nvfp4_shared_global_amax(*tensors: torch.Tensor) -> torch.Tensor:
    """The amax that fused siblings share (the max of theirs), per expert when stacked.

    Pass the result as ``global_amax`` to ``nvfp4_quantize`` for each sibling so that they get one
    ``weight_scale_2``, as ModelOpt exports q/k/v and an expert's gate/up for fused GEMMs.
    """
    if not tensors:
        raise ValueError("nvfp4_shared_global_amax needs at least one tensor")
    leads = {leading_shape(require_weight(t, _LABEL)) for t in tensors}
    if len(leads) != 1:
        raise ValueError("nvfp4_shared_global_amax needs siblings with the same stacking dims before "
                         f"[out, in]; got {[list(t.shape) for t in tensors]}")
    amaxes = torch.stack([_matrix_amax(t).to(tensors[0].device) for t in tensors])
    return amaxes.amax(dim=0)


def _encode_blocks(x: torch.Tensor, global_scale: torch.Tensor,
                   rounding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``[..., K]``, E4M3 block scales ``[..., K/16]`` and fp32 divisors of ``x`` (fp32 ``[..., K]``).

    ``global_scale`` broadcasts against the block scales ``[..., K/16]`` and must be > 0.
    """
    blocks = x.unflatten(-1, (-1, NVFP4_BLOCK_SIZE))                     # [..., K/16, 16]
    block_amax = blocks.abs().amax(dim=-1)                                # [..., K/16]
    scale = block_amax / (6.0 * global_scale)
    scale = torch.where(scale == 0, 1.0, scale)
    # As ModelOpt: never underflow to a zero scale, never overflow E4M3 to NaN (a static activation
    # scale meets blocks beyond the calibrated amax).
    scale = scale.clamp(min=E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
    divisor = (scale.float() * global_scale).unsqueeze(-1)                # [..., K/16, 1]
    codes = fp4_encode(blocks / divisor, rounding).flatten(-2)
    return codes, scale, divisor


def _as_global_tensor(value: Union[float, torch.Tensor], lead: tuple[int, ...], device: torch.device,
                      what: str) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    try:
        t = t.expand(lead) if t.dim() <= len(lead) else t.reshape(lead)
    except RuntimeError as err:
        raise ValueError(f"{what} must be a scalar or have the stacking shape {list(lead)}; "
                         f"got shape {list(t.shape)}") from err
    require_finite(t, _LABEL, what)
    if bool((t < 0).any()):
        raise ValueError(f"{what} must be >= 0; got {t.tolist()}")
    return t.contiguous()


def nvfp4_quantize(w: torch.Tensor, global_amax: Optional[Union[float, torch.Tensor]] = None,
                   rounding: str = "rne") -> QTensor:
    """Quantize ``w`` (``[..., out, in]``, in divisible by 16) to NVFP4 exactly as ModelOpt exports it.

    ``global_amax`` (a scalar, or ``[E]`` for stacked experts) replaces the tensor's own amax so
    that fused siblings share one ``weight_scale_2``; it must be at least the tensor's amax.
    ``rounding="away"`` rounds element ties away from zero instead of to even.

    Example::

        qt = nvfp4_quantize(torch.randn(256, 512, dtype=torch.bfloat16))
        qt.data.shape, qt.scale.shape, qt.global_scale.shape   # [256, 256], [256, 32], []
    """
    w = require_weight(w, _LABEL)
    require_divisible(w.shape, NVFP4_BLOCK_SIZE, _LABEL)
    check_rounding(rounding)
    lead, (out_features, in_features) = leading_shape(w), w.shape[-2:]
    own_amax = _matrix_amax(w)
    if global_amax is None:
        amax = own_amax
    else:
        amax = _as_global_tensor(global_amax, lead, w.device, "global_amax")
        if bool((amax < own_amax).any()):
            raise ValueError(f"global_amax {amax.tolist()} is below the tensor's own amax {own_amax.tolist()}: "
                             "a shared global amax must be the max over all siblings "
                             "(use nvfp4_shared_global_amax).")
    # An all-zero matrix (or one so tiny that amax/2688 underflows) would get weight_scale_2 = 0
    # and NaN block scales; pretend its amax is 1.
    amax = torch.where(divide(amax, 6.0 * E4M3_MAX) == 0, 1.0, amax)
    weight_scale_2 = divide(amax, 6.0 * E4M3_MAX)                          # [...]
    rows = w.reshape(-1, in_features)                                      # [R, K], R = prod(lead) * out
    row_scale_2 = weight_scale_2.unsqueeze(-1).expand(*lead, out_features).reshape(-1, 1)
    data = torch.empty(rows.shape[0], in_features // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(rows.shape[0], in_features // NVFP4_BLOCK_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    for chunk in row_chunks(rows.shape[0], in_features):
        codes, scale[chunk], _ = _encode_blocks(rows[chunk].float(), row_scale_2[chunk], rounding)
        data[chunk] = pack_nibbles(codes)
    return QTensor(format="nvfp4", data=data.reshape(*lead, out_features, -1),
                   scale=scale.reshape(*lead, out_features, -1), shape=tuple(w.shape),
                   group_size=NVFP4_BLOCK_SIZE, global_scale=weight_scale_2)


def _check_qtensor(qt: QTensor, fmt: str) -> None:
    if qt.format != fmt:
        raise ValueError(f"expected a {fmt} QTensor; got format {qt.format!r}")
    if qt.layout != "canonical":
        raise ValueError(f"cannot decode a QTensor in backend layout {qt.layout!r}; "
                         "decode the canonical QTensor the checkpoint reader returned")


def nvfp4_dequantize(qt: QTensor) -> torch.Tensor:
    """fp32 weights ``[..., out, in]`` of an NVFP4 QTensor: ``E2M1(code) * (fp32(scale) * weight_scale_2)``."""
    _check_qtensor(qt, "nvfp4")
    if qt.global_scale is None:
        raise ValueError("an NVFP4 QTensor needs global_scale (weight_scale_2); got None")
    values = fp4_decode(unpack_nibbles(qt.data)).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))   # [..., out, in/16, 16]
    block_scale = qt.scale.float() * qt.global_scale.float()[..., None, None]           # [..., out, in/16]
    return (values * block_scale.unsqueeze(-1)).flatten(-2).reshape(qt.shape)


def nvfp4_input_scale(activation_amax: Union[float, torch.Tensor]) -> torch.Tensor:
    """The static activation global scale ModelOpt calibrates: ``amax / (6 * 448)`` (fp32)."""
    return divide(torch.as_tensor(activation_amax, dtype=torch.float32), FP4_MAX * E4M3_MAX)


def nvfp4_fake_quantize_activation(x: torch.Tensor, input_scale: Union[float, torch.Tensor],
                                   rounding: str = "rne") -> torch.Tensor:
    """NVFP4 round trip of activations ``x`` ``[..., K]`` as W4A4 hardware sees them, in ``x.dtype``.

    Blocks of 16 along the last dim get dynamic E4M3 scales against the static global
    ``input_scale`` (``amax / (6*448)`` from calibration; a scalar or broadcastable to
    ``x.shape[:-1]``); block scales clamp at 448 when a block exceeds the calibrated range.
    Activations are not checked for NaN/Inf (that would sync the device every call): a
    non-finite value poisons its block, as on hardware.

    Example::

        x_hat = nvfp4_fake_quantize_activation(x, input_scale=qt.input_scale)
    """
    x = require_float_tensor(x, _LABEL, "activation")
    if x.dim() < 1:
        raise ValueError(f"{_LABEL} activation fake-quant expects [..., K]; got a 0-dim tensor")
    require_divisible(x.shape, NVFP4_BLOCK_SIZE, _LABEL, what="the activation's last dim (in_features)")
    check_rounding(rounding)
    global_scale = torch.as_tensor(input_scale, dtype=torch.float32, device=x.device)
    if not bool(torch.isfinite(global_scale).all()) or bool((global_scale <= 0).any()):
        raise ValueError(f"input_scale must be finite and > 0 (amax / (6*448)); got {global_scale.tolist()}")
    if global_scale.dim() > 0:
        global_scale = global_scale.unsqueeze(-1)                          # broadcast over the K/16 blocks
    codes, _, divisor = _encode_blocks(x.float(), global_scale, rounding)
    values = fp4_decode(codes).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))
    return (values * divisor).flatten(-2).to(x.dtype)
