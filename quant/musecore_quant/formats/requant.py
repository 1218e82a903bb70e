"""Conversions between the two FP4 block formats, done while a checkpoint loads.

MI355X reads the NVFP4 checkpoint by requantizing it to MXFP4, and a Blackwell user may be handed
an MXFP4 checkpoint. The two directions are not symmetric (FORMATS.md):

- NVFP4 -> MXFP4 is lossy double rounding: dequantize to fp32 (``E2M1 * e4m3 * weight_scale_2``),
  then quantize to MXFP4 (EVEN scales by default, as Quark/aiter; ``rounding="away"`` matches
  aiter's elements). Within a 32-block the 16-half with the smaller NVFP4 scale is re-rounded on
  the coarser grid of the other half. ``input_scale`` is dropped: MXFP4 activations are dynamic.
  Report ``metrics.quant_error`` per tensor.
- MXFP4 -> NVFP4 can be exact. With ``weight_scale_2 = 2^(k_max - 8)``, where ``k_max`` is the
  largest block exponent of the matrix, a 32-block with exponent ``k`` gets the E4M3 scale
  ``2^(k - k_max + 8)`` on both of its 16-halves. That is a power of two in [2^-9, 2^8], which
  E4M3 holds exactly (2^8 = 256 <= 448; 2^-9 is its smallest subnormal), and
  ``fp32(s) * weight_scale_2 = 2^k`` exactly, so the element codes, and the packed bytes, are
  unchanged and every dequantized value is bit-identical. Only blocks more than 17 binades below
  the largest (values under ``6 * 2^(k_max - 18)``, i.e. < 2^-15 of the tensor's range) cannot be
  expressed; those 16-blocks are re-rounded with the ModelOpt rule, a negligible change.
  Siblings that a runtime fuses must share ``weight_scale_2``: compute it once with
  ``nvfp4_exact_weight_scale_2(*siblings)`` and pass it to each.

Least error instead of producer parity (:func:`quantize_min_error`): a device that quantizes at
load owes no producer its bytes, so it may choose each block's scale for the least error against
the values it replaces: MXFP4 searches each 32-block's E8M0 exponent around EVEN's (``scale_mode
="mse"``), INT4 shrinks each group's scale over a small grid. Both keep the producer's choice on
ties, so they are never worse per block, and report the producer rule's error beside their own.
What they cannot undo (measured on muse-tiny's experts): NVFP4 -> MXFP4 error is the NVFP4 noise
(20.4 dB) plus an independent MXFP4 re-rounding of it (19.05 dB under EVEN, 19.07 searched),
16.7 dB in all, against 19.0 dB for MXFP4 straight from BF16; the search moves it by 0.03 dB.

Example::

    mx = requantize_nvfp4_to_mxfp4(nv)                     # lossy, EVEN scales
    nv2 = requantize_mxfp4_to_nvfp4(mx)                    # exact: same data bytes
    assert torch.equal(nvfp4_dequantize(nv2), mxfp4_dequantize(mx))
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..qtensor import QTensor
from ._common import divide
from .fp4 import pack_nibbles, unpack_nibbles
from ._common import SearchError
from .int4 import DEFAULT_GROUP_SIZE as INT4_GROUP_SIZE
from .int4 import int4_quantize_min_error
from .mxfp4 import E8M0_BIAS, MXFP4_BLOCK_SIZE, mxfp4_dequantize, mxfp4_quantize, mxfp4_quantize_min_error
from .nvfp4 import NVFP4_BLOCK_SIZE, _encode_blocks, nvfp4_dequantize

# Formats whose quantization at load can search for the least error (others: the producer's rule).
MIN_ERROR_FORMATS = ("mxfp4", "int4")

# E4M3 holds the powers of two 2^-9 (smallest subnormal) .. 2^8 (largest below 448) exactly.
_E4M3_MIN_POW2 = -9
_E4M3_MAX_POW2 = 8


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2^exponent`` for integer exponents in [-149, 127], built from float64 bits."""
    bits = (exponent.to(torch.int64) + 1023) << 52
    return bits.view(torch.float64).float()


def requantize_nvfp4_to_mxfp4(qt: QTensor, scale_mode: str = "even", rounding: str = "rne") -> QTensor:
    """MXFP4 QTensor of an NVFP4 one (dequantize to fp32, quantize again); lossy, input_scale dropped."""
    if qt.format != "nvfp4":
        raise ValueError(f"requantize_nvfp4_to_mxfp4 expects an nvfp4 QTensor; got {qt.format!r}")
    return mxfp4_quantize(nvfp4_dequantize(qt), scale_mode=scale_mode, rounding=rounding)


def quantize_min_error(w: torch.Tensor, fmt: str) -> tuple[QTensor, SearchError]:
    """``w`` (float ``[..., out, in]``, e.g. a dequantized NVFP4 tensor) in ``fmt`` with the least
    squared error per block (MXFP4: E8M0 exponent searched around EVEN, RNE elements; INT4: g128
    symmetric, scale shrink searched), and the errors of that and of the producer rule.

    Example::

        mx, err = quantize_min_error(nvfp4_dequantize(nv), "mxfp4")
        10 * math.log10(err.producer_squared_error / err.squared_error)   # dB gained over EVEN
    """
    if fmt == "mxfp4":
        return mxfp4_quantize_min_error(w.float(), rounding="rne")
    if fmt == "int4":
        return int4_quantize_min_error(w.float(), group_size=INT4_GROUP_SIZE)
    raise ValueError(f"no least-error search for {fmt!r}; formats with one: {list(MIN_ERROR_FORMATS)} "
                     "(quantize others with musecore_quant.quantize and the producer's options)")


def _block_exponents(qt: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unbiased exponents ``[..., out, in/32]`` and a mask of 32-blocks with any nonzero code."""
    codes = unpack_nibbles(qt.data).unflatten(-1, (-1, MXFP4_BLOCK_SIZE))       # [..., out, in/32, 32]
    nonzero = ((codes & 0x7) != 0).any(dim=-1)
    return qt.scale.to(torch.int32) - E8M0_BIAS, nonzero


def nvfp4_exact_weight_scale_2(*qts: QTensor) -> torch.Tensor:
    """``2^(k_max - 8)`` (fp32, per matrix / per expert) over MXFP4 siblings, for an exact NVFP4 copy.

    ``k_max`` is the largest exponent among blocks holding a nonzero code; an all-zero matrix
    gets 1/2688, what ``nvfp4_quantize`` gives an all-zero matrix.
    """
    if not qts:
        raise ValueError("nvfp4_exact_weight_scale_2 needs at least one MXFP4 QTensor")
    k_max = None
    for qt in qts:
        if qt.format != "mxfp4" or qt.layout != "canonical":
            raise ValueError(f"expected canonical mxfp4 QTensors; got format {qt.format!r}, layout {qt.layout!r}")
        exponent, nonzero = _block_exponents(qt)
        masked = torch.where(nonzero, exponent, torch.iinfo(torch.int32).min)
        this = masked.amax(dim=(-2, -1))                                          # [...]
        if k_max is not None and this.shape != k_max.shape:
            raise ValueError("siblings must share their stacking dims; got "
                             f"{[list(q.shape) for q in qts]}")
        k_max = this if k_max is None else torch.maximum(k_max, this)
    empty = k_max == torch.iinfo(torch.int32).min
    scale = _pow2(k_max.clamp(min=-E8M0_BIAS) - _E4M3_MAX_POW2)
    return torch.where(empty, divide(torch.ones_like(scale), 2688.0), scale)


def requantize_mxfp4_to_nvfp4(qt: QTensor,
                              weight_scale_2: Optional[Union[float, torch.Tensor]] = None) -> QTensor:
    """Exact NVFP4 copy of an MXFP4 QTensor: same data bytes, ``weight_scale_2 = 2^(k_max-8)``.

    ``weight_scale_2`` (from ``nvfp4_exact_weight_scale_2`` over fused siblings) must be a power of
    two no smaller than this tensor's own ``2^(k_max-8)``.
    """
    if qt.format != "mxfp4" or qt.layout != "canonical":
        raise ValueError(f"requantize_mxfp4_to_nvfp4 expects a canonical mxfp4 QTensor; got format "
                         f"{qt.format!r}, layout {qt.layout!r}")
    own = nvfp4_exact_weight_scale_2(qt)
    if weight_scale_2 is None:
        ws2 = own
    else:
        ws2 = torch.as_tensor(weight_scale_2, dtype=torch.float32, device=qt.data.device).expand(own.shape)
        mantissa, _ = torch.frexp(ws2)
        if not bool((mantissa == 0.5).all()) or bool((ws2 < own).any()):
            raise ValueError(f"weight_scale_2 {ws2.tolist()} must be a power of two >= this tensor's own "
                             f"2^(k_max-8) = {own.tolist()} for an exact conversion; compute it with "
                             "nvfp4_exact_weight_scale_2(*siblings).")
    ws2 = ws2.contiguous()
    _, ws2_exponent = torch.frexp(ws2)
    k_ref = (ws2_exponent - 1)[..., None, None]                                   # log2(ws2), [..., 1, 1]
    exponent, _ = _block_exponents(qt)
    relative = exponent - k_ref                                                   # [..., out, in/32]
    codes = unpack_nibbles(qt.data).unflatten(-1, (-1, NVFP4_BLOCK_SIZE))         # [..., out, in/16, 16]
    half_nonzero = ((codes & 0x7) != 0).any(dim=-1)                               # [..., out, in/16]
    relative = relative.repeat_interleave(MXFP4_BLOCK_SIZE // NVFP4_BLOCK_SIZE, dim=-1)
    exact = relative >= _E4M3_MIN_POW2
    scale_f32 = _pow2(relative.clamp(_E4M3_MIN_POW2, _E4M3_MAX_POW2))
    # An all-zero 16-block gets 1.0 as ModelOpt gives it; its value is 0 whatever the scale.
    scale_f32 = torch.where(half_nonzero, scale_f32, 1.0)
    scale = scale_f32.to(torch.float8_e4m3fn)
    data = qt.data
    tiny = half_nonzero & ~exact
    if bool(tiny.any()):
        # Blocks too small for an exact E4M3 scale next to this weight_scale_2: re-round them.
        values = mxfp4_dequantize(qt)
        new_codes, new_scale, _ = _encode_blocks(values, ws2[..., None, None], "rne")
        scale = torch.where(tiny, new_scale.float(), scale.float()).to(torch.float8_e4m3fn)
        merged = torch.where(tiny.unsqueeze(-1), new_codes.unflatten(-1, (-1, NVFP4_BLOCK_SIZE)), codes)
        data = pack_nibbles(merged.flatten(-2))
    return QTensor(format="nvfp4", data=data, scale=scale, shape=qt.shape, group_size=NVFP4_BLOCK_SIZE,
                   global_scale=ws2)
