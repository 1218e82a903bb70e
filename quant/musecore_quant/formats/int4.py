"""INT4 weight-only (W4A16) with per-group fp16 scales: the Xeon and Hopper fallback format.

Canonical layout (qtensor.py): codes ``q`` in 0..15 packed two per byte along K like FP4, scales
fp16 ``[..., out, in/g]``, zeros uint8 ``[..., out, in/g]`` holding the true zero point, or None
for symmetric (zero 8). Dequantization is ``(q - z) * scale``.

Round-to-nearest follows AutoRound (the INT4 producer this project drives, and whose RTN output
GPTQ kernels read), with ``torch.round`` (half to even); divisions and rounding are fp32 except
where noted:

- symmetric, "full range": the group's extreme of larger magnitude (ties: the positive one) maps
  to ``q = 0``, i.e. ``-8``: ``scale = fp16(-extreme / 8)``, so the scale is NEGATIVE when the
  extreme is positive. ``q = clamp(round(w / scale) + 8, 0, 15)``. All 16 levels are used, unlike
  GPTQ's ``2*amax/15`` grid, and a negative scale must be kept: never ``abs()`` a scale.
- asymmetric: with ``min <= 0 <= max`` of the group (so 0 is exact), ``scale = fp16((max-min)/15)``,
  ``zero = clamp(round(-min / scale), 0, 15)``, ``q = clamp(round(w / scale) + zero, 0, 15)``.
  For bf16 and fp16 weights ``max - min`` and ``/ 15`` are each rounded to the weight's dtype
  before the fp16 cast, as AutoRound computes them (below).
- for fp16 weights the quotients ``w / scale`` and ``-min / scale`` are rounded to fp16 before
  ``round`` (AutoRound's fp16 / fp16); for bf16 and fp32 weights they are fp32.
- scale magnitudes are floored at 1e-5 (AutoRound's ``q_scale_thresh``), so an all-zero group is
  representable without dividing by zero.

This equals AutoRound's ``quant_tensor_sym`` / ``quant_tensor_asym`` on fp32, bf16 and fp16
weights (checked in tests/interop). Those functions compute in the weight's dtype, and PyTorch
does each bf16/fp16 op in fp32 and rounds the result to that dtype, so for a bf16 weight
``(wmax - wmin) / 15`` is rounded to bf16 twice before ``.to(float16)``: bf16 keeps 8
significant bits and fp16 11, so the scale can sit several fp16 ulps (up to 8 seen) from the one
rounding of the fp32 quotient, in about a quarter of the groups of a random bf16 weight. The zero
point and codes divide the weight by the fp16 scale: bf16 / fp16 promotes to fp32, but fp16 /
fp16 is rounded to fp16 before ``round``, and that is reproduced too. The symmetric scale needs
no such care (``extreme / 8`` is exact). This is the path AutoRound's model-based RTN takes
(``WrapperLinear`` with ``iters=0`` calls ``quant_tensor_asym`` on the layer's bf16 weight);
its ``ModelFreeCompressor`` (``quantize_weight_rtn``) casts each weight to fp32 first, so for
bf16 checkpoints its asymmetric scales are ``int4_quantize(w.float(), sym=False)``'s.

Producers store other layouts; conversions are pure functions here (FORMATS.md):

- GPTQ v1 (``auto_round:auto_gptq``): ``qweight`` int32 ``[in/8, out]`` (nibble ``k%8`` of word
  ``k//8``), ``qzeros`` int32 ``[in/g, out/8]`` storing ``z-1`` packed along out (symmetric:
  ``0x77777777``), ``scales`` fp16 ``[in/g, out]``, ``g_idx`` int32 ``[in]`` = ``k//g``.
  AutoRound's asymmetric ``auto_round`` packing and GPTQ v2 store the true zero instead.
- AWQ GEMM: ``qweight`` int32 ``[in, out/8]`` with nibble ``p`` holding out column
  ``8c + [0,2,4,6,1,3,5,7][p]``; ``qzeros`` the same order with true zeros; ``scales`` fp16 ``[in/g, out]``.

Example::

    qt = int4_quantize(w, group_size=128)      # symmetric, AutoRound RTN
    tensors = int4_to_gptq(qt)                 # qweight, qzeros, scales, g_idx
    assert torch.equal(int4_dequantize(int4_from_gptq(**tensors)), int4_dequantize(qt))
"""

from __future__ import annotations

from typing import Optional

import torch

from ..qtensor import QTensor
from ._common import SearchError, divide, require_divisible, require_weight, row_chunks
from .fp4 import pack_nibbles, unpack_nibbles

INT4_SYMMETRIC_ZERO = 8
INT4_MAX_CODE = 15
DEFAULT_GROUP_SIZE = 128            # AutoRound's export (auto_round:auto_gptq, group 128)
Q_SCALE_THRESHOLD = 1e-5            # AutoRound's floor on |scale|
AWQ_NIBBLE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_LABEL = "INT4"
_NIBBLES_PER_WORD = 8


def _resolve_group_size(group_size: int, in_features: int) -> int:
    if isinstance(group_size, bool):      # True == 1 in Python, but no config means a group of one by it
        raise ValueError(f"group_size must be a positive int or -1 (per channel); got {group_size!r}")
    if group_size == -1:                  # AutoRound/GPTQ spelling of "one group per row"
        return in_features
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size must be a positive int or -1 (per channel); got {group_size!r}")
    return group_size


def int4_quantize(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, sym: bool = True) -> QTensor:
    """Round-to-nearest INT4 of ``w`` ``[..., out, in]`` with one fp16 scale per ``group_size`` inputs.

    ``sym=True`` is AutoRound's full-range symmetric grid (zero 8, scales may be negative);
    ``sym=False`` stores a uint8 zero point per group. ``group_size=-1`` means one group per row.

    Example::

        qt = int4_quantize(torch.randn(256, 512), group_size=128, sym=True)
        qt.scale.shape, qt.zero                  # [256, 4] fp16, None
    """
    w = require_weight(w, _LABEL)
    g = _resolve_group_size(group_size, w.shape[-1])
    require_divisible(w.shape, g, _LABEL, why="the group size")
    require_divisible(w.shape, 2, _LABEL, why="two codes per byte")
    in_features = w.shape[-1]
    rows = w.reshape(-1, in_features)                                       # [R, K]
    data = torch.empty(rows.shape[0], in_features // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(rows.shape[0], in_features // g, dtype=torch.float16, device=w.device)
    zero = torch.empty(rows.shape[0], in_features // g, dtype=torch.uint8, device=w.device)
    for chunk in row_chunks(rows.shape[0], in_features):
        codes, scale[chunk], zero[chunk] = _round_to_nearest(rows[chunk].float(), g, sym, w.dtype)
        data[chunk] = pack_nibbles(codes)
    lead = w.shape[:-1]
    return QTensor(format="int4", data=data.reshape(*lead, -1), scale=scale.reshape(*lead, -1),
                   shape=tuple(w.shape), group_size=g, zero=None if sym else zero.reshape(*lead, -1))


# Shrink factors of the symmetric scale tried by ``int4_quantize_min_error`` (1.0 is RTN): clipping
# a group's outlier a little refines the grid of its other values. On muse-tiny's attention and
# lm_head weights these five reach 20.37 dB against RTN's 19.84; thirteen (1.0 down to 0.7) 20.40.
MIN_ERROR_SHRINK = (1.0, 0.95, 0.9, 0.85, 0.8)
# A shrunk scale must beat RTN by more than fp32 summation noise (~1e-6 relative), so a choice
# made in fp32 is never worse than RTN in exact arithmetic.
_SEARCH_MARGIN = 1e-5


def int4_quantize_min_error(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> tuple[QTensor, SearchError]:
    """Symmetric INT4 of ``w`` whose per-group scale is RTN's times the factor of
    :data:`MIN_ERROR_SHRINK` with the least squared error, and the :class:`SearchError` against RTN.

    The layout and readers are RTN's (``sym=True``, full range, fp16 scales); only the scale value
    differs. RTN (factor 1) is kept unless another factor beats it, so no group is worse than
    under RTN. Weight-only MSE, no calibration: what a device that quantizes at load can afford.

    Example::

        qt, err = int4_quantize_min_error(w)          # w: [..., out, in], in divisible by 128
        assert err.squared_error <= err.producer_squared_error
    """
    w = require_weight(w, _LABEL)
    g = _resolve_group_size(group_size, w.shape[-1])
    require_divisible(w.shape, g, _LABEL, why="the group size")
    require_divisible(w.shape, 2, _LABEL, why="two codes per byte")
    in_features = w.shape[-1]
    rows = w.reshape(-1, in_features)
    data = torch.empty(rows.shape[0], in_features // 2, dtype=torch.uint8, device=w.device)
    scale = torch.empty(rows.shape[0], in_features // g, dtype=torch.float16, device=w.device)
    total = rtn_total = 0.0
    low, high = -INT4_SYMMETRIC_ZERO, INT4_MAX_CODE - INT4_SYMMETRIC_ZERO
    for chunk in row_chunks(rows.shape[0], in_features):
        block = rows[chunk].float()
        groups = block.unflatten(-1, (-1, g))                                # [R, K/g, g]
        _, rtn_scale, _ = _round_to_nearest(block, g, True, w.dtype)         # [R, K/g] fp16
        best_scale = rtn_scale.float().unsqueeze(-1)                          # [R, K/g, 1]
        best_err = rtn_err = None
        for shrink in MIN_ERROR_SHRINK:  # in place: each candidate costs a few passes over the chunk
            s = best_scale if rtn_err is None else (rtn_scale.float().unsqueeze(-1) * shrink).to(torch.float16).float()
            s = torch.where(s < 0, s.clamp(max=-Q_SCALE_THRESHOLD), s.clamp(min=Q_SCALE_THRESHOLD))
            err = torch.div(groups, s).round_().clamp_(low, high).mul_(s).sub_(groups).square_().sum(dim=-1)
            if rtn_err is None:
                best_scale, best_err, rtn_err = s, err, err
                continue
            better = err < best_err * (1 - _SEARCH_MARGIN)
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better.unsqueeze(-1), s, best_scale)
        q = torch.div(groups, best_scale).round_().clamp_(low, high).add_(INT4_SYMMETRIC_ZERO)
        data[chunk] = pack_nibbles(q.to(torch.uint8).flatten(-2))
        scale[chunk] = best_scale.squeeze(-1).to(torch.float16)
        total += float(best_err.double().sum())
        rtn_total += float(rtn_err.double().sum())
    lead = w.shape[:-1]
    qt = QTensor(format="int4", data=data.reshape(*lead, -1), scale=scale.reshape(*lead, -1),
                 shape=tuple(w.shape), group_size=g, zero=None)
    return qt, SearchError(total, rtn_total)


def _round_to_nearest(rows: torch.Tensor, g: int, sym: bool,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``[R, K]`` uint8, fp16 scales and uint8 zeros ``[R, K/g]`` of fp32 ``rows`` (AutoRound RTN).

    ``dtype`` is the weight's own dtype, in which AutoRound computes: each bf16/fp16 operation is
    the fp32 result rounded to that dtype, reproduced here by rounding the fp32 result with
    ``.to(dtype)`` (a no-op for fp32 weights).
    """
    via = dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32
    # AutoRound divides the weight by the fp16 scale: bf16 / fp16 promotes to fp32, fp16 / fp16 stays fp16.
    quotient_dtype = torch.promote_types(via, torch.float16)

    def quotient(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (x / scale.float()).to(quotient_dtype).float()

    groups = rows.unflatten(-1, (-1, g))                                    # [R, K/g, g]
    group_min = groups.amin(dim=-1).clamp(max=0)
    group_max = groups.amax(dim=-1).clamp(min=0)
    if sym:
        # The extreme of larger magnitude, with its sign; it is sent to q - 8 = -8.
        extreme = torch.where(group_max < -group_min, group_min, group_max)
        scale = (-extreme / INT4_SYMMETRIC_ZERO).to(torch.float16)            # / 8 is exact on every device
        scale = torch.where(scale < 0, scale.clamp(max=-Q_SCALE_THRESHOLD), scale.clamp(min=Q_SCALE_THRESHOLD))
        zero = torch.full_like(scale, INT4_SYMMETRIC_ZERO, dtype=torch.float32)
    else:
        # AutoRound: ((wmax - wmin) / 15).to(float16), both ops in the weight's dtype.
        span = (group_max - group_min).to(via).float()
        scale = divide(span, INT4_MAX_CODE).to(via).to(torch.float16).clamp(min=Q_SCALE_THRESHOLD)
        zero = torch.round(quotient(-group_min, scale)).clamp(0, INT4_MAX_CODE)
    _check_scales_fit(scale, group_min, group_max, sym)
    q = torch.round(quotient(groups, scale.unsqueeze(-1))) + zero.unsqueeze(-1)
    codes = q.clamp(0, INT4_MAX_CODE).to(torch.uint8).flatten(-2)
    return codes, scale, zero.to(torch.uint8)


def _check_scales_fit(scale: torch.Tensor, group_min: torch.Tensor, group_max: torch.Tensor, sym: bool) -> None:
    """INT4 scales are fp16: a group whose extreme (symmetric, / 8) or span (asymmetric, / 15) exceeds fp16's
    65504 gets an infinite scale, and dequantizes to NaN/Inf. Refused here, never written."""
    overflow = torch.isinf(scale)
    if not bool(overflow.any()):
        return
    row, group = overflow.nonzero()[0].tolist()
    extreme = max(-float(group_min[row, group]), float(group_max[row, group]))
    rule = "extreme / 8" if sym else "(max - min) / 15"
    raise ValueError(f"INT4 scale overflows fp16: {int(overflow.sum())} group(s) need a scale over "
                     f"{float(torch.finfo(torch.float16).max):.0f} (the first, row {row} group {group}, has |w| up to "
                     f"{extreme:.4g}; the scale is {rule}). Exclude this tensor (--exclude) or use another format "
                     "(nvfp4, mxfp4 or fp8 keep wider scales)")


def _zero_points(qt: QTensor) -> torch.Tensor:
    """True zero points ``[..., out, in/g]`` as uint8 (8 when the QTensor is symmetric)."""
    if qt.zero is not None:
        return qt.zero
    return torch.full(qt.scale.shape, INT4_SYMMETRIC_ZERO, dtype=torch.uint8, device=qt.scale.device)


def int4_dequantize(qt: QTensor) -> torch.Tensor:
    """fp32 weights ``[..., out, in]`` of an INT4 QTensor: ``(q - z) * scale`` per group."""
    if qt.format != "int4" or qt.layout != "canonical":
        raise ValueError(f"int4_dequantize expects a canonical int4 QTensor; got format {qt.format!r}, "
                         f"layout {qt.layout!r}")
    codes = unpack_nibbles(qt.data).float().unflatten(-1, (-1, qt.group_size))   # [..., out, in/g, g]
    zero = _zero_points(qt).float().unsqueeze(-1)
    return ((codes - zero) * qt.scale.float().unsqueeze(-1)).flatten(-2).reshape(qt.shape)


# ----------------------------------------------------------------------------------------------
# int32 nibble words shared by GPTQ and AWQ


def _pack_words(nibbles: torch.Tensor) -> torch.Tensor:
    """int32 words from ``[..., n, 8]`` nibbles (0..15), nibble ``p`` at bits ``4p``; wraps like C."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=nibbles.device)
    words = (nibbles.to(torch.int64) << shifts).sum(dim=-1)              # bits do not overlap: sum == or
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)      # reinterpret as signed int32
    return words.to(torch.int32)


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """Nibbles ``[..., n, 8]`` (uint8) of int32 words ``[..., n]``; inverse of ``_pack_words``."""
    if words.dtype != torch.int32:
        raise TypeError(f"packed INT4 words are int32; got dtype {words.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    return ((words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _check_packable(qt: QTensor) -> tuple[int, int]:
    if qt.format != "int4" or qt.layout != "canonical":
        raise ValueError(f"expected a canonical int4 QTensor; got format {qt.format!r}, layout {qt.layout!r}")
    out_features, in_features = qt.shape[-2], qt.shape[-1]
    if in_features % _NIBBLES_PER_WORD or out_features % _NIBBLES_PER_WORD:
        raise ValueError(f"GPTQ/AWQ packing needs in_features and out_features divisible by 8; got shape "
                         f"{list(qt.shape)}. Keep this layer in the canonical layout or exclude it (--exclude).")
    return out_features, in_features


def _scales_as_fp16(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.float16:
        return scales
    as_fp16 = scales.to(torch.float16)
    if not torch.equal(as_fp16.to(scales.dtype), scales):
        raise ValueError(f"INT4 scales are kept as fp16; these {scales.dtype} scales do not fit fp16 exactly")
    return as_fp16


def _qtensor_from_codes(codes_out_in: torch.Tensor, zeros_out_groups: torch.Tensor,
                        scales_out_groups: torch.Tensor, group_size: int) -> QTensor:
    # Decided per tensor from its data: an asymmetric checkpoint's tensor whose zero points all happen to
    # be 8 reads as symmetric (zero None), which is the same values; stacking such a tensor with asymmetric
    # ones materialises its zeros again (qtensor.stack_qtensors).
    symmetric = bool((zeros_out_groups == INT4_SYMMETRIC_ZERO).all())
    return QTensor(format="int4", data=pack_nibbles(codes_out_in), scale=scales_out_groups.contiguous(),
                   shape=tuple(codes_out_in.shape), group_size=group_size,
                   zero=None if symmetric else zeros_out_groups.contiguous())


def int4_to_gptq(qt: QTensor) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of an INT4 QTensor: ``qweight``, ``qzeros`` (z-1), ``scales``, ``g_idx``.

    Stacked experts keep their leading dims (``qweight [E, in/8, out]``, ``g_idx [E, in]``).
    """
    out_features, in_features = _check_packable(qt)
    codes = unpack_nibbles(qt.data).transpose(-1, -2)                          # [..., in, out]
    qweight = _pack_words(codes.unflatten(-2, (-1, _NIBBLES_PER_WORD)).transpose(-1, -2))  # [..., in/8, out]
    stored_zeros = (_zero_points(qt).to(torch.int64) - 1) & 0xF                 # GPTQ v1 writes z - 1
    # [..., out, in/g] -> [..., in/g, out/8, 8] -> [..., in/g, out/8]
    qzeros = _pack_words(stored_zeros.transpose(-1, -2).unflatten(-1, (-1, _NIBBLES_PER_WORD)))
    g_idx = (torch.arange(in_features, device=qt.data.device, dtype=torch.int32) // qt.group_size)
    g_idx = g_idx.expand(*qt.shape[:-2], in_features).contiguous()
    return {"qweight": qweight, "qzeros": qzeros, "scales": qt.scale.transpose(-1, -2).contiguous(),
            "g_idx": g_idx}


def int4_from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   g_idx: Optional[torch.Tensor] = None, zero_minus_one: bool = True) -> QTensor:
    """INT4 QTensor from GPTQ ``qweight [.., in/8, out]``, ``qzeros [.., in/g, out/8]``, ``scales [.., in/g, out]``.

    ``zero_minus_one=True`` reads GPTQ v1 / ``auto_round:auto_gptq`` zeros (stored ``z-1``; the
    reader adds 1 back modulo 16); ``False`` reads true zeros (AutoRound's asymmetric
    ``auto_round`` packing, GPTQ v2). A ``g_idx`` other than ``k // g`` (act-order) is refused.
    """
    if qweight.dim() < 2 or qzeros.dim() != qweight.dim() or scales.dim() != qweight.dim():
        raise ValueError(f"GPTQ tensors must share their leading dims: qweight [..., in/8, out], qzeros "
                         f"[..., in/g, out/8], scales [..., in/g, out]; got {list(qweight.shape)}, "
                         f"{list(qzeros.shape)}, {list(scales.shape)}")
    in_features, out_features = qweight.shape[-2] * _NIBBLES_PER_WORD, qweight.shape[-1]
    n_groups = scales.shape[-2]
    if (scales.shape[-1] != out_features or tuple(qzeros.shape[-2:]) != (n_groups, out_features // _NIBBLES_PER_WORD)
            or n_groups == 0 or in_features % n_groups):
        raise ValueError(f"inconsistent GPTQ shapes: qweight {list(qweight.shape)} (in={in_features}, "
                         f"out={out_features}), qzeros {list(qzeros.shape)}, scales {list(scales.shape)}; expected "
                         f"qzeros [..., in/g, out/8] and scales [..., in/g, out] with in divisible by in/g")
    group_size = in_features // n_groups
    if g_idx is not None:
        expected = torch.arange(in_features, device=g_idx.device, dtype=torch.int64) // group_size
        if g_idx.shape[-1] != in_features or not bool((g_idx.to(torch.int64) == expected).all()):
            raise ValueError("act-order GPTQ checkpoints are not supported: g_idx is not k // group_size "
                             f"(group_size {group_size}), so input channels were permuted (desc_act=True). "
                             "Re-quantize with desc_act=False, or use a checkpoint without act-order.")
    # qweight [.., in/8, out] -> nibbles [.., in/8, out, 8] -> [.., in/8, 8, out] -> [.., in, out]
    codes = _unpack_words(qweight).transpose(-1, -2).flatten(-3, -2).transpose(-1, -2)      # [..., out, in]
    stored = _unpack_words(qzeros).flatten(-2)                                              # [..., in/g, out]
    zeros = (stored + 1) & 0xF if zero_minus_one else stored
    return _qtensor_from_codes(codes, zeros.transpose(-1, -2), _scales_as_fp16(scales).transpose(-1, -2),
                               group_size)


def int4_to_awq(qt: QTensor) -> dict[str, torch.Tensor]:
    """AWQ GEMM tensors of an INT4 QTensor: ``qweight [.., in, out/8]``, ``qzeros [.., in/g, out/8]``, ``scales``."""
    _check_packable(qt)
    order = torch.tensor(AWQ_NIBBLE_ORDER, device=qt.data.device)
    codes = unpack_nibbles(qt.data).transpose(-1, -2)                                 # [..., in, out]
    qweight = _pack_words(codes.unflatten(-1, (-1, _NIBBLES_PER_WORD))[..., order])    # [..., in, out/8]
    zeros = _zero_points(qt).transpose(-1, -2)                                          # [..., in/g, out]
    qzeros = _pack_words(zeros.unflatten(-1, (-1, _NIBBLES_PER_WORD))[..., order])
    return {"qweight": qweight, "qzeros": qzeros, "scales": qt.scale.transpose(-1, -2).contiguous()}


def int4_from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> QTensor:
    """INT4 QTensor from AWQ GEMM tensors (true zeros, nibble order [0,2,4,6,1,3,5,7]).

    ``qweight`` int32 ``[.., in, out/8]``, ``qzeros`` int32 ``[.., in/g, out/8]``, ``scales`` ``[.., in/g, out]``.
    """
    if qweight.dim() < 2 or qzeros.dim() != qweight.dim() or scales.dim() != qweight.dim():
        raise ValueError(f"AWQ tensors must share their leading dims: qweight [..., in, out/8], qzeros "
                         f"[..., in/g, out/8], scales [..., in/g, out]; got {list(qweight.shape)}, "
                         f"{list(qzeros.shape)}, {list(scales.shape)}")
    in_features, out_features = qweight.shape[-2], qweight.shape[-1] * _NIBBLES_PER_WORD
    n_groups = scales.shape[-2]
    if (scales.shape[-1] != out_features or tuple(qzeros.shape[-2:]) != (n_groups, qweight.shape[-1])
            or n_groups == 0 or in_features % n_groups):
        raise ValueError(f"inconsistent AWQ shapes: qweight {list(qweight.shape)} (in={in_features}, "
                         f"out={out_features}), qzeros {list(qzeros.shape)}, scales {list(scales.shape)}")
    # Nibble p holds column AWQ_NIBBLE_ORDER[p]; column j is therefore nibble inverse[j].
    inverse = torch.argsort(torch.tensor(AWQ_NIBBLE_ORDER, device=qweight.device))
    codes = _unpack_words(qweight)[..., inverse].flatten(-2).transpose(-1, -2)        # [..., out, in]
    zeros = _unpack_words(qzeros)[..., inverse].flatten(-2).transpose(-1, -2)         # [..., out, in/g]
    return _qtensor_from_codes(codes, zeros, _scales_as_fp16(scales).transpose(-1, -2), in_features // n_groups)
