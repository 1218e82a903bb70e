"""MXFP4 (OCP Microscaling v1.0): E2M1 elements, one power-of-two E8M0 scale per 32 inputs.

AMD MI350X/MI355X run MXFP4 natively; Quark exports it and GPT-OSS ships it. The producers agree on
the element codes and packing (fp4.py) and on the scale byte (``2^(byte-127)``, 0xFF = NaN, no
zero) but not on how the shared exponent is chosen from a block's amax (FORMATS.md):

- ``"floor"`` (OCP spec, torchao default): ``floor(log2(amax)) - 2``; the block max lands in
  [4, 8) and values above 6 saturate.
- ``"even"`` (Quark default, aiter, compressed-tensors, vLLM; our default): first round ``amax``
  up to the next power of two when its mantissa is >= 1.75, then floor. This is torchao's EVEN,
  implemented the same way, by adding ``2^21`` to the fp32 bits and masking off the mantissa.
- ``"ceil"`` (ModelOpt): ``ceil(log2(amax / 6))``, never saturating. Computed exactly (frexp),
  where ModelOpt uses ``ceil(log2(.))`` in fp32, which can differ one ulp above a power of two.

An all-zero block gets byte 0, exponents clamp to the E8M0 range [-127, 127]. Elements are
divided by the exact power of two, so only the E2M1 rounding loses information.

GPT-OSS stores the same bytes as ``*_blocks`` ``[E, rows, in/32, 16]`` and ``*_scales``
``[E, rows, in/32]`` (rows are output features; GPT-OSS interleaves gate and up rows, which is
the model's business, not the codec's); ``mxfp4_from_gpt_oss`` / ``mxfp4_to_gpt_oss`` reshape.

Example::

    qt = mxfp4_quantize(w)                    # w: [out, in] or [E, out, in], in divisible by 32
    w_hat = mxfp4_dequantize(qt)              # fp32
"""

from __future__ import annotations

import torch

from ..qtensor import QTensor
from ._common import divide, require_divisible, require_float_tensor, require_weight, row_chunks
from .fp4 import check_rounding, fp4_decode, fp4_encode, pack_nibbles, unpack_nibbles

MXFP4_BLOCK_SIZE = 32
E8M0_BIAS = 127
SCALE_MODES = ("even", "floor", "ceil")
_LABEL = "MXFP4"
_FP4_EMAX = 2                       # the largest E2M1 binade: 4 and 6 are 2^2 * (1, 1.5)
_F32_MANTISSA_BITS = 23
_F32_EXPONENT_MASK = 0x7F800000
# Adding half of the mantissa range below the one E2M1 mantissa bit carries into the exponent
# exactly when the fp32 mantissa is >= 1.75, which is EVEN's "round amax up" test.
_EVEN_ROUND_UP = 1 << (_F32_MANTISSA_BITS - 1 - 1)


def _check_scale_mode(scale_mode: str) -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES} ('even': Quark/aiter/vLLM, "
                         f"'floor': OCP/torchao, 'ceil': ModelOpt); got {scale_mode!r}")


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) of positive normal fp32 ``x`` from its exponent bits (subnormals read as -127)."""
    return ((x.view(torch.int32) & _F32_EXPONENT_MASK) >> _F32_MANTISSA_BITS) - E8M0_BIAS


def shared_exponent(block_amax: torch.Tensor, scale_mode: str = "even") -> torch.Tensor:
    """Unbiased E8M0 exponent (int32, in [-127, 127]) for blocks with fp32 ``block_amax`` >= 0."""
    _check_scale_mode(scale_mode)
    amax = block_amax.float().contiguous()
    if scale_mode == "ceil":
        mantissa, exponent = torch.frexp(divide(amax, 6.0))  # y = m * 2^e, m in [0.5, 1)
        exp = torch.where(mantissa == 0.5, exponent - 1, exponent)
    else:
        if scale_mode == "even":
            bits = (amax.view(torch.int32) + _EVEN_ROUND_UP) & _F32_EXPONENT_MASK
            amax = bits.view(torch.float32)
        exp = _floor_log2(amax) - _FP4_EMAX
    exp = torch.where(block_amax == 0, -E8M0_BIAS, exp)
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """fp32 value ``2^(byte-127)`` of E8M0 bytes (uint8); byte 0 is 2^-127, 0xFF is NaN."""
    if scale.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales are stored as uint8; got dtype {scale.dtype}")
    as_int = scale.to(torch.int32)
    values = (as_int << _F32_MANTISSA_BITS).view(torch.float32)            # exact for bytes 1..254
    values = torch.where(as_int == 0, 2.0 ** -127, values)                # fp32 subnormal, exact
    return torch.where(as_int == 0xFF, float("nan"), values)


def _encode_blocks(x: torch.Tensor, scale_mode: str, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[..., K]`` and E8M0 bytes ``[..., K/32]`` of fp32 ``x`` ``[..., K]``."""
    blocks = x.unflatten(-1, (-1, MXFP4_BLOCK_SIZE))                       # [..., K/32, 32]
    exponent = shared_exponent(blocks.abs().amax(dim=-1), scale_mode)      # [..., K/32]
    scale = (exponent + E8M0_BIAS).to(torch.uint8)
    codes = fp4_encode(blocks / e8m0_to_float(scale).unsqueeze(-1), rounding).flatten(-2)
    return codes, scale


def _decode_blocks(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    values = fp4_decode(codes).unflatten(-1, (-1, MXFP4_BLOCK_SIZE))
    return (values * e8m0_to_float(scale).unsqueeze(-1)).flatten(-2)


def mxfp4_quantize(w: torch.Tensor, scale_mode: str = "even", rounding: str = "rne") -> QTensor:
    """Quantize ``w`` (``[..., out, in]``, in divisible by 32) to MXFP4.

    Defaults (EVEN scales, round-half-even elements) reproduce Quark; ``scale_mode="floor"``
    reproduces torchao, ``rounding="away"`` aiter's element rounding.

    Example::

        qt = mxfp4_quantize(torch.randn(256, 512), scale_mode="floor")
        qt.data.shape, qt.scale.shape          # [256, 256] uint8, [256, 16] uint8 (E8M0)
    """
    w = require_weight(w, _LABEL)
    require_divisible(w.shape, MXFP4_BLOCK_SIZE, _LABEL)
    _check_scale_mode(scale_mode)
    check_rounding(rounding)
    in_features = w.shape[-1]
    rows = w.reshape(-1, in_features)                                      # [R, K]
    data = torch.empty(rows.shape[0], in_features // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(rows.shape[0], in_features // MXFP4_BLOCK_SIZE, dtype=torch.uint8, device=w.device)
    for chunk in row_chunks(rows.shape[0], in_features):
        codes, scale[chunk] = _encode_blocks(rows[chunk].float(), scale_mode, rounding)
        data[chunk] = pack_nibbles(codes)
    return QTensor(format="mxfp4", data=data.reshape(*w.shape[:-1], -1), scale=scale.reshape(*w.shape[:-1], -1),
                   shape=tuple(w.shape), group_size=MXFP4_BLOCK_SIZE)


def mxfp4_dequantize(qt: QTensor) -> torch.Tensor:
    """fp32 weights ``[..., out, in]`` of an MXFP4 QTensor: ``E2M1(code) * 2^(scale-127)``."""
    if qt.format != "mxfp4":
        raise ValueError(f"expected an mxfp4 QTensor; got format {qt.format!r}")
    if qt.layout != "canonical":
        raise ValueError(f"cannot decode a QTensor in backend layout {qt.layout!r}; "
                         "decode the canonical QTensor the checkpoint reader returned")
    return _decode_blocks(unpack_nibbles(qt.data), qt.scale).reshape(qt.shape)


def mxfp4_fake_quantize_activation(x: torch.Tensor, scale_mode: str = "even",
                                   rounding: str = "rne") -> torch.Tensor:
    """MXFP4 round trip of activations ``x`` ``[..., K]`` with dynamic per-32 scales, in ``x.dtype``.

    This is what MI355X's W4A4 path does to activations (scales computed on the fly, nothing
    calibrated). NaN/Inf are not checked (no device sync per call); they poison their block.

    Example::

        x_hat = mxfp4_fake_quantize_activation(x)          # EVEN scales, RNE, as Quark/aiter
    """
    x = require_float_tensor(x, _LABEL, "activation")
    if x.dim() < 1:
        raise ValueError(f"{_LABEL} activation fake-quant expects [..., K]; got a 0-dim tensor")
    require_divisible(x.shape, MXFP4_BLOCK_SIZE, _LABEL, what="the activation's last dim (in_features)")
    _check_scale_mode(scale_mode)
    check_rounding(rounding)
    codes, scale = _encode_blocks(x.float(), scale_mode, rounding)
    return _decode_blocks(codes, scale).to(x.dtype)


def mxfp4_from_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor) -> QTensor:
    """QTensor from GPT-OSS ``*_blocks`` uint8 ``[..., rows, in/32, 16]`` and ``*_scales`` ``[..., rows, in/32]``.

    GPT-OSS packs nibbles like everyone else (element ``2i`` low), so this is a reshape.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"GPT-OSS MXFP4 blocks and scales are uint8; got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != MXFP4_BLOCK_SIZE // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"GPT-OSS MXFP4 expects *_blocks [..., rows, in/32, 16] and *_scales [..., rows, in/32]; "
                         f"got blocks {list(blocks.shape)} and scales {list(scales.shape)}")
    shape = (*blocks.shape[:-2], blocks.shape[-2] * MXFP4_BLOCK_SIZE)
    return QTensor(format="mxfp4", data=blocks.reshape(*blocks.shape[:-2], -1), scale=scales,
                   shape=shape, group_size=MXFP4_BLOCK_SIZE)


def mxfp4_to_gpt_oss(qt: QTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS ``(blocks [..., rows, in/32, 16], scales [..., rows, in/32])`` of an MXFP4 QTensor."""
    if qt.format != "mxfp4" or qt.layout != "canonical":
        raise ValueError(f"mxfp4_to_gpt_oss expects a canonical mxfp4 QTensor; got format {qt.format!r}, "
                         f"layout {qt.layout!r}")
    blocks = qt.data.reshape(*qt.data.shape[:-1], -1, MXFP4_BLOCK_SIZE // 2)
    return blocks, qt.scale
