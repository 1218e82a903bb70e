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
- ``"mse"`` (no producer; what musecore loads with unless asked for producer parity): per block,
  EVEN's exponent or the one below (FLOOR is always one of them), whichever E2M1 rounding has
  the least squared error against the block's own values. EVEN wins
  ties, so no block is ever worse than under EVEN (:func:`search_shared_exponent`). It matters
  most when the values are already on a coarser grid, e.g. NVFP4 requantized to MXFP4.

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

from typing import Optional

import torch

from ..qtensor import QTensor
from ._common import SearchError, divide, require_divisible, require_float_tensor, require_weight, row_chunks
from .fp4 import check_rounding, fp4_decode, fp4_encode, pack_nibbles, unpack_nibbles

MXFP4_BLOCK_SIZE = 32
E8M0_BIAS = 127
SCALE_MODES = ("even", "floor", "ceil", "mse")
PRODUCER_SCALE_MODES = ("even", "floor", "ceil")  # the rules a producer writes; "mse" searches
_LABEL = "MXFP4"
_FP4_EMAX = 2                       # the largest E2M1 binade: 4 and 6 are 2^2 * (1, 1.5)
_F32_MANTISSA_BITS = 23
_F32_EXPONENT_MASK = 0x7F800000
# Adding half of the mantissa range below the one E2M1 mantissa bit carries into the exponent
# exactly when the fp32 mantissa is >= 1.75, which is EVEN's "round amax up" test.
_EVEN_ROUND_UP = 1 << (_F32_MANTISSA_BITS - 1 - 1)
# "mse" tries EVEN's exponent and EVEN-1 (FLOOR is always one of the two). EVEN+1 (a coarser grid;
# CEIL is EVEN or EVEN+1) won no block of muse-tiny's NVFP4 experts requantized (221,184 blocks:
# EVEN kept 214,433, EVEN-1 won 6,751), so it is not worth a third pass.
SEARCH_OFFSETS = (-1,)
# A neighbour must beat EVEN by this relative margin: the fp32 block sums carry ~1e-6 relative
# rounding, so a win smaller than that could be a loss in exact arithmetic.
_SEARCH_MARGIN = 1e-5


def _check_scale_mode(scale_mode: str) -> None:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES} ('even': Quark/aiter/vLLM, "
                         f"'floor': OCP/torchao, 'ceil': ModelOpt, 'mse': least error per block); got {scale_mode!r}")


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) of positive normal fp32 ``x`` from its exponent bits (subnormals read as -127)."""
    return ((x.view(torch.int32) & _F32_EXPONENT_MASK) >> _F32_MANTISSA_BITS) - E8M0_BIAS


def shared_exponent(block_amax: torch.Tensor, scale_mode: str = "even") -> torch.Tensor:
    """Unbiased E8M0 exponent (int32, in [-127, 127]) for blocks with fp32 ``block_amax`` >= 0.

    The producer rules only (``"mse"`` needs the blocks' values: :func:`search_shared_exponent`)."""
    if scale_mode == "mse":
        raise ValueError("scale_mode 'mse' chooses an exponent from a block's values, not its amax; "
                         "call search_shared_exponent(blocks) or pass one of " + str(PRODUCER_SCALE_MODES))
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


def fp4_round(y: torch.Tensor, rounding: str = "rne") -> torch.Tensor:
    """``y`` rounded to the nearest E2M1 value (saturating at +-6), as fp32 values: equal to
    ``fp4_decode(fp4_encode(y, rounding))`` up to the sign of zero, without the code lookup.

    The E2M1 grid is uniform within [0, 2), [2, 4) and [4, 6] (steps 0.5, 1, 2), so RNE is
    ``torch.round`` (half to even) of ``|y| / step``: every tie lands on the even code."""
    if rounding != "rne":
        return fp4_decode(fp4_encode(y, rounding))
    magnitude = y.abs()
    step = torch.where(magnitude < 2.0, 0.5, torch.where(magnitude < 4.0, 1.0, 2.0))
    return torch.copysign((torch.round(magnitude / step) * step).clamp_max(6.0), y)


# E2M1 magnitude code of twice a grid value (0, 1, 2, 3, 4, 6, 8, 12 -> codes 0..7).
_CODE_OF_TWICE = (0, 1, 2, 3, 4, -1, 5, -1, 6, -1, -1, -1, 7)


def _codes_of_rounded(rounded: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of values already on the grid (``fp4_round``'s), with ``fp4_encode``'s sign rule."""
    table = torch.tensor(_CODE_OF_TWICE, dtype=torch.int32, device=rounded.device)
    magnitude = table[(rounded.abs() * 2).to(torch.int64)]
    return ((negative.to(torch.int32) << 3) | magnitude).to(torch.uint8)


def _search(blocks: torch.Tensor, rounding: str
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exponent, chosen error, EVEN's error, codes [..., n, 32]) of :func:`search_shared_exponent`."""
    check_rounding(rounding)
    even = shared_exponent(blocks.abs().amax(dim=-1), "even")                # [..., n]

    def rounded(exponent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        y = blocks / e8m0_to_float((exponent + E8M0_BIAS).to(torch.uint8)).unsqueeze(-1)
        r = fp4_round(y, rounding)
        return r, y < 0, (r - y).square().sum(dim=-1)                       # error in units of 2^(2*exponent)

    values, negative, even_err = rounded(even)
    best, best_err = even, even_err
    for offset in SEARCH_OFFSETS:
        candidate = (even + offset).clamp(-E8M0_BIAS, E8M0_BIAS)
        relative = (candidate - even).float()                                 # the offset, or 0 at the range's end
        r, neg, err = rounded(candidate)
        err = err * torch.exp2(2 * relative)                                  # in EVEN's units
        better = err < best_err * (1 - _SEARCH_MARGIN)
        best, best_err = torch.where(better, candidate, best), torch.where(better, err, best_err)
        values = torch.where(better.unsqueeze(-1), r, values)
        negative = torch.where(better.unsqueeze(-1), neg, negative)
    unit = torch.exp2(2 * even.double())
    return best, best_err.double() * unit, even_err.double() * unit, _codes_of_rounded(values, negative)


def search_shared_exponent(blocks: torch.Tensor, rounding: str = "rne"
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per block of fp32 ``blocks`` ``[..., 32]``: the unbiased exponent (int32), EVEN's or one of
    :data:`SEARCH_OFFSETS` from it, with the least squared error, and the squared errors (float64,
    in the blocks' units) of the chosen exponent and of EVEN's.

    EVEN keeps a block unless a neighbour beats it by more than fp32 summation noise, so the
    chosen error never exceeds EVEN's. Errors are compared in units of EVEN's scale squared
    (exact powers of two apart), which neither underflows nor overflows for tiny or huge blocks.

    Example::

        exponent, err, err_even = search_shared_exponent(w.unflatten(-1, (-1, 32)))
        assert bool((err <= err_even).all())
    """
    exponent, err, even_err, _ = _search(blocks, rounding)
    return exponent, err, even_err


def _encode_blocks(x: torch.Tensor, scale_mode: str, rounding: str,
                   errors: Optional[list] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[..., K]`` and E8M0 bytes ``[..., K/32]`` of fp32 ``x`` ``[..., K]``; with ``"mse"``,
    the summed squared errors (chosen, EVEN) are appended to ``errors`` when given."""
    blocks = x.unflatten(-1, (-1, MXFP4_BLOCK_SIZE))                       # [..., K/32, 32]
    if scale_mode == "mse":
        exponent, err, err_even, codes = _search(blocks, rounding)
        if errors is not None:
            errors.append((float(err.sum()), float(err_even.sum())))
        return codes.flatten(-2), (exponent + E8M0_BIAS).to(torch.uint8)
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
    reproduces torchao, ``rounding="away"`` aiter's element rounding; ``scale_mode="mse"`` picks
    each block's exponent for the least error (no producer writes it; readers need nothing new).

    Example::

        qt = mxfp4_quantize(torch.randn(256, 512), scale_mode="floor")
        qt.data.shape, qt.scale.shape          # [256, 256] uint8, [256, 16] uint8 (E8M0)
    """
    return _quantize(w, scale_mode, rounding, None)


def mxfp4_quantize_min_error(w: torch.Tensor, rounding: str = "rne") -> tuple[QTensor, SearchError]:
    """``mxfp4_quantize(w, scale_mode="mse", rounding=rounding)`` and its :class:`SearchError`.

    Example::

        qt, err = mxfp4_quantize_min_error(nvfp4_dequantize(nv))   # NVFP4 -> MXFP4, least error
        assert err.squared_error <= err.producer_squared_error   # EVEN's
    """
    errors: list[tuple[float, float]] = []
    qt = _quantize(w, "mse", rounding, errors)
    return qt, SearchError(sum(e for e, _ in errors), sum(e for _, e in errors))


def _quantize(w: torch.Tensor, scale_mode: str, rounding: str, errors: Optional[list]) -> QTensor:
    w = require_weight(w, _LABEL)
    require_divisible(w.shape, MXFP4_BLOCK_SIZE, _LABEL)
    _check_scale_mode(scale_mode)
    check_rounding(rounding)
    in_features = w.shape[-1]
    rows = w.reshape(-1, in_features)                                      # [R, K]
    data = torch.empty(rows.shape[0], in_features // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(rows.shape[0], in_features // MXFP4_BLOCK_SIZE, dtype=torch.uint8, device=w.device)
    for chunk in row_chunks(rows.shape[0], in_features):
        codes, scale[chunk] = _encode_blocks(rows[chunk].float(), scale_mode, rounding, errors)
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
