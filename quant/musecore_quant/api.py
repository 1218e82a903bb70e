"""The public entry points: quantize, dequantize, requantize and activation fake-quant by format name.

Checkpoint readers, the converter, the loader and the emulation path name a format as a string
(``"nvfp4"``, ``"mxfp4"``, ``"int4"``, ``"fp8"``, the same words as the CLI's ``--to``). This module
turns that name into the format module's function, checks the options against what that producer
offers, and owns the cross-format conversions so that callers never pick a route themselves.

Options per format (defaults reproduce the producer named):

=======  ===========================================  =================================
format   quantize options                             default producer
=======  ===========================================  =================================
nvfp4    ``global_amax``, ``rounding``                ModelOpt, byte for byte
mxfp4    ``scale_mode`` (even/floor/ceil), ``rounding``  Quark (EVEN, RNE)
int4     ``group_size`` (128), ``sym`` (True)          AutoRound RTN
fp8      ``block_size`` (None: per tensor, or 128)     ModelOpt FP8 / DeepSeek-V3 blocks
int8     none (per output channel, symmetric)          none: a load-time target (``formats/int8.py``)
=======  ===========================================  =================================
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch

from .formats.fp8 import fp8_dequantize, fp8_fake_quantize_activation, fp8_quantize
from .formats.int4 import int4_dequantize, int4_quantize
from .formats.int8 import int8_dequantize, int8_fake_quantize_activation, int8_quantize
from .formats.mxfp4 import mxfp4_dequantize, mxfp4_fake_quantize_activation, mxfp4_quantize
from .formats.nvfp4 import nvfp4_dequantize, nvfp4_fake_quantize_activation, nvfp4_quantize
from .formats.requant import requantize_mxfp4_to_nvfp4, requantize_nvfp4_to_mxfp4
from .qtensor import FORMATS, QTensor

_QUANTIZERS: dict[str, tuple[Callable[..., QTensor], tuple[str, ...]]] = {
    "nvfp4": (nvfp4_quantize, ("global_amax", "rounding")),
    "mxfp4": (mxfp4_quantize, ("scale_mode", "rounding")),
    "int4": (int4_quantize, ("group_size", "sym")),
    "fp8": (fp8_quantize, ("block_size",)),
    "int8": (int8_quantize, ()),
}
_DEQUANTIZERS: dict[str, Callable[[QTensor], torch.Tensor]] = {
    "nvfp4": nvfp4_dequantize,
    "mxfp4": mxfp4_dequantize,
    "int4": int4_dequantize,
    "fp8": fp8_dequantize,
    "int8": int8_dequantize,
}
_EXACT_MXFP4_TO_NVFP4_OPTIONS = ("weight_scale_2",)


def _check_format(fmt: object) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    return fmt  # type: ignore[return-value]


def _check_options(fmt: str, opts: dict[str, Any], valid: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(opts) - set(valid))
    if unknown:
        offered = ", ".join(valid) if valid else "none"
        raise ValueError(f"unknown option(s) {unknown} for {what} {fmt}; valid options: {offered}")


def quantize(w: torch.Tensor, fmt: str, **opts: Any) -> QTensor:
    """Quantize a float weight ``[..., out, in]`` (leading dims stack experts) to ``fmt``.

    Raises on NaN/Inf, on a dimension the format's block does not divide (saying to exclude the
    layer) and on options the format does not offer.

    Example::

        qt = musecore_quant.quantize(w, "nvfp4")                    # ModelOpt bytes
        qt = musecore_quant.quantize(w, "int4", group_size=128, sym=True)
        qt = musecore_quant.quantize(w, "mxfp4", scale_mode="floor")  # torchao's scales
    """
    fn, valid = _QUANTIZERS[_check_format(fmt)]
    _check_options(fmt, opts, valid, "quantizing to")
    return fn(w, **opts)


def dequantize(qt: QTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights a QTensor stands for, ``[..., out, in]`` in ``dtype`` (computed in fp32).

    Example::

        w_hat = musecore_quant.dequantize(qt, dtype=torch.bfloat16)
    """
    if not isinstance(qt, QTensor):
        raise TypeError(f"dequantize expects a musecore_quant.QTensor; got {type(qt).__name__}")
    return _DEQUANTIZERS[_check_format(qt.format)](qt).to(dtype)


def requantize(qt: QTensor, fmt: str, **opts: Any) -> QTensor:
    """Convert a QTensor to another format (or the same format with other options).

    - NVFP4 -> MXFP4: dequantize to fp32, quantize with EVEN scales unless ``scale_mode`` says
      otherwise; ``input_scale`` is dropped (MXFP4 activations are dynamic). Lossy.
    - MXFP4 -> NVFP4: exact by default (same data bytes, ``weight_scale_2 = 2^(k_max-8)``; see
      ``formats/requant.py``); pass ``weight_scale_2`` shared by fused siblings
      (``nvfp4_exact_weight_scale_2``). Passing ``global_amax`` or ``rounding`` instead asks for
      the plain ModelOpt rule on the dequantized values, which is not exact.
    - anything else: dequantize to fp32, then ``quantize(w, fmt, **opts)``. NVFP4 -> NVFP4 keeps
      ``input_scale``.

    Example::

        mx = musecore_quant.requantize(nv, "mxfp4")             # what MI355X loads
        err = metrics.quant_error(musecore_quant.dequantize(nv), musecore_quant.dequantize(mx))
    """
    if not isinstance(qt, QTensor):
        raise TypeError(f"requantize expects a musecore_quant.QTensor; got {type(qt).__name__}")
    source, target = _check_format(qt.format), _check_format(fmt)
    if source == "nvfp4" and target == "mxfp4":
        _check_options(target, opts, _QUANTIZERS["mxfp4"][1], "requantizing nvfp4 to")
        return requantize_nvfp4_to_mxfp4(qt, **opts)
    if source == "mxfp4" and target == "nvfp4" and set(opts) <= set(_EXACT_MXFP4_TO_NVFP4_OPTIONS):
        return requantize_mxfp4_to_nvfp4(qt, **opts)
    if "weight_scale_2" in opts:
        raise ValueError("weight_scale_2 is an option of the exact mxfp4 -> nvfp4 conversion only, and cannot "
                         f"be combined with {sorted(set(opts) - {'weight_scale_2'})}; got {source} -> {target}")
    result = quantize(dequantize(qt), target, **opts)
    if source == target == "nvfp4" and qt.input_scale is not None:
        result.input_scale = qt.input_scale
    return result


def fake_quantize_activation(x: torch.Tensor, fmt: str, input_scale: Optional[Union[float, torch.Tensor]] = None,
                             **opts: Any) -> torch.Tensor:
    """Round-trip activations ``x`` ``[..., K]`` through the activation quantization of ``fmt``.

    This is how emulation reproduces a W4A4/W8A8 target's numerics on other hardware:

    - ``nvfp4``: dynamic per-16 E4M3 scales under the static ``input_scale`` (required; the
      checkpoint's ``input_scale``, ``amax / (6*448)``); option ``rounding``.
    - ``mxfp4``: dynamic per-32 E8M0 scales; no ``input_scale``; options ``scale_mode``, ``rounding``.
    - ``fp8``: per-tensor E4M3 with the static ``input_scale``, or dynamic when it is None.
    - ``int8``: symmetric INT8 with ``input_scale`` (any shape that broadcasts: a per-row ``[..., 1]`` scale
      is the ``int8-token`` rule), or dynamic per tensor (``amax / 127``) when it is None.
    - ``int4`` is weight-only: asking for its activation quantization is an error.

    Example::

        x_hat = musecore_quant.fake_quantize_activation(x, "nvfp4", input_scale=qt.input_scale)
    """
    fmt = _check_format(fmt)
    if fmt == "nvfp4":
        _check_options(fmt, opts, ("rounding",), "activation fake-quant in")
        if input_scale is None:
            raise ValueError("NVFP4 activation fake-quant needs input_scale, the static global scale "
                             "(amax / (6*448)) the checkpoint stores as input_scale; got None. For a dynamic "
                             "per-tensor scale pass input_scale=nvfp4_input_scale(x.abs().amax()).")
        return nvfp4_fake_quantize_activation(x, input_scale, **opts)
    if fmt == "mxfp4":
        _check_options(fmt, opts, ("scale_mode", "rounding"), "activation fake-quant in")
        if input_scale is not None:
            raise ValueError("MXFP4 activations are scaled dynamically per 32 values; input_scale is not used "
                             "and must be None")
        return mxfp4_fake_quantize_activation(x, **opts)
    if fmt == "fp8":
        _check_options(fmt, opts, (), "activation fake-quant in")
        return fp8_fake_quantize_activation(x, input_scale)
    if fmt == "int8":
        _check_options(fmt, opts, (), "activation fake-quant in")
        return int8_fake_quantize_activation(x, input_scale)
    raise ValueError("INT4 is weight-only (W4A16): activations stay in bf16, so there is no activation "
                     "quantization to emulate; call the linear with unquantized activations")
