"""The ``X.weight`` + scales family shared by ModelOpt, Quark, compressed-tensors FP8 and HF FP8.

These producers all keep the quantized codes in ``X.weight`` and put the scales beside it; the
dtypes tell the format apart: uint8 codes with E4M3 block scales and a ``weight_scale_2`` are
NVFP4 (ModelOpt), uint8 codes with uint8 E8M0 scales are MXFP4 (Quark), E4M3 codes with a single
``weight_scale`` are per-tensor FP8, E4M3 codes with a 2-D ``weight_scale_inv`` (DeepSeek/HF) or
2-D ``weight_scale`` (compressed-tensors) of ``ceil(out/128) x ceil(in/128)`` are 128x128 block
FP8. This module classifies such a group from headers alone and decodes it into the canonical
``QTensor`` (see ``musecore_quant.qtensor``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ..qtensor import QTensor
from .layout import (GroupingRule, WeightEntry, expect_dtype, expect_scalar, expect_shape, fail,
                     plain_entry, require, to_fp32_scalar)
from .safetensors_io import TensorHeader

DENSE = GroupingRule("dense", ".weight",
                     (".weight_scale_2", ".weight_scale_inv", ".weight_scale", ".input_scale"), ".weight")

NVFP4_GROUP = 16
MXFP4_GROUP = 32
FP8_BLOCK = 128
FP8_PER_TENSOR = 0  # QTensor.group_size for per-tensor FP8 (no blocks)


def classify_dense(name: str, parts: dict[str, TensorHeader], options: Mapping[str, Any]) -> WeightEntry:
    w = parts["weight"]
    if len(parts) == 1:
        if w.dtype in ("F8_E4M3", "F8_E5M2") and len(w.shape) >= 2:  # FP8 codes without a scale mean nothing
            require(name, parts, "weight_scale", ".weight_scale", "FP8 codes need their scale")
        return plain_entry(w.key, w)
    if w.dtype == "U8":
        scale = require(name, parts, "weight_scale", ".weight_scale",
                        "packed uint8 FP4 codes need block scales")
        if scale.dtype == "F8_E4M3":
            return _nvfp4(name, parts, w, scale)
        if scale.dtype == "U8":
            return _mxfp4(name, parts, w, scale)
        raise fail(name, scale, f"has dtype {scale.dtype}; packed FP4 codes need float8_e4m3fn scales "
                                "(NVFP4) or uint8 E8M0 scales (MXFP4)")
    if w.dtype == "F8_E4M3":
        return _fp8(name, parts, w)
    extra = sorted(set(parts) - {"weight"})
    raise fail(name, w, f"is a plain {w.dtype} weight but has quantization companions {extra}; "
                        "a weight is either quantized (uint8 or float8 codes) or plain: re-export it")


def _fp4_shape(name: str, w: TensorHeader, scale: TensorHeader, group: int, label: str) -> tuple[int, ...]:
    """Logical ``[..., out, in]`` of packed FP4 codes ``[..., out, in/2]`` with one scale per ``group``."""
    if len(w.shape) < 2:
        raise fail(name, w, f"has shape {list(w.shape)}; {label} codes are [..., out, in/2]")
    *lead, out, half = w.shape
    k = 2 * half
    if k % group:
        raise fail(name, w, f"stores {k} inputs, not a multiple of the {label} block of {group}")
    expect_shape(name, scale, (*lead, out, k // group), f"one {label} block scale per {group} inputs")
    return (*lead, out, k)


def _nvfp4(name: str, parts: dict[str, TensorHeader], w: TensorHeader, scale: TensorHeader) -> WeightEntry:
    shape = _fp4_shape(name, w, scale, NVFP4_GROUP, "NVFP4")
    gs = require(name, parts, "weight_scale_2", ".weight_scale_2", "NVFP4 needs its per-tensor global scale")
    expect_scalar(name, gs, "NVFP4 weight_scale_2 is one fp32 value")
    if "input_scale" in parts:
        expect_scalar(name, parts["input_scale"], "NVFP4 input_scale is one fp32 value")
    _no_extra(name, parts, {"weight", "weight_scale", "weight_scale_2", "input_scale"})
    return WeightEntry(name, "dense-nvfp4", "nvfp4", shape, parts, NVFP4_GROUP)


def _mxfp4(name: str, parts: dict[str, TensorHeader], w: TensorHeader, scale: TensorHeader) -> WeightEntry:
    shape = _fp4_shape(name, w, scale, MXFP4_GROUP, "MXFP4")
    _no_extra(name, parts, {"weight", "weight_scale"})
    return WeightEntry(name, "dense-mxfp4", "mxfp4", shape, parts, MXFP4_GROUP,
                       {"e8m0_roles": ("weight_scale",)})


def _fp8(name: str, parts: dict[str, TensorHeader], w: TensorHeader) -> WeightEntry:
    if len(w.shape) != 2:
        raise fail(name, w, f"has shape {list(w.shape)}; FP8 weights are read as 2-D [out, in]")
    out, k = w.shape
    blocks = (math.ceil(out / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
    if "input_scale" in parts:
        expect_scalar(name, parts["input_scale"], "FP8 input_scale is one fp32 value")
    if "weight_scale_inv" in parts:
        inv = parts["weight_scale_inv"]
        expect_dtype(name, inv, ("F32", "BF16"), "128x128 block scales")
        expect_shape(name, inv, blocks, "one scale per 128x128 block")
        _no_extra(name, parts, {"weight", "weight_scale_inv", "input_scale"})
        return WeightEntry(name, "dense-fp8-block", "fp8", (out, k), parts, FP8_BLOCK,
                           {"scale_role": "weight_scale_inv"})
    scale = require(name, parts, "weight_scale", ".weight_scale", "FP8 codes need a scale")
    _no_extra(name, parts, {"weight", "weight_scale", "input_scale"})
    if math.prod(scale.shape) == 1:
        expect_scalar(name, scale, "per-tensor FP8 scale")
        return WeightEntry(name, "dense-fp8-tensor", "fp8", (out, k), parts, FP8_PER_TENSOR)
    if tuple(scale.shape) == blocks:
        expect_dtype(name, scale, ("F32", "BF16"), "128x128 block scales")
        return WeightEntry(name, "dense-fp8-block", "fp8", (out, k), parts, FP8_BLOCK,
                           {"scale_role": "weight_scale"})
    raise fail(name, scale, f"has shape {list(scale.shape)}: per-channel FP8 scales are not supported "
                            f"(supported: one per-tensor value, or {list(blocks)} for 128x128 blocks); "
                            "dequantize this checkpoint with its producer or exclude the layer")


def _no_extra(name: str, parts: dict[str, TensorHeader], allowed: set[str]) -> None:
    extra = sorted(set(parts) - allowed)
    if extra:
        h = parts[extra[0]]
        raise fail(name, h, f"is not expected beside this format (allowed: {sorted(allowed)}); "
                            "the checkpoint mixes layouts: re-export it")


def decode_nvfp4(entry: WeightEntry, t: dict[str, torch.Tensor]) -> QTensor:
    return QTensor("nvfp4", data=t["weight"], scale=t["weight_scale"], shape=entry.shape,
                   group_size=NVFP4_GROUP, global_scale=to_fp32_scalar(t["weight_scale_2"]),
                   input_scale=None if "input_scale" not in t else to_fp32_scalar(t["input_scale"]))


def decode_mxfp4(entry: WeightEntry, t: dict[str, torch.Tensor]) -> QTensor:
    return QTensor("mxfp4", data=t["weight"], scale=t["weight_scale"], shape=entry.shape,
                   group_size=MXFP4_GROUP)


def decode_fp8_tensor(entry: WeightEntry, t: dict[str, torch.Tensor]) -> QTensor:
    return QTensor("fp8", data=t["weight"], scale=to_fp32_scalar(t["weight_scale"]), shape=entry.shape,
                   group_size=FP8_PER_TENSOR,
                   input_scale=None if "input_scale" not in t else to_fp32_scalar(t["input_scale"]))


def decode_fp8_block(entry: WeightEntry, t: dict[str, torch.Tensor]) -> QTensor:
    return QTensor("fp8", data=t["weight"], scale=t[entry.options["scale_role"]].to(torch.float32),
                   shape=entry.shape, group_size=FP8_BLOCK,
                   input_scale=None if "input_scale" not in t else to_fp32_scalar(t["input_scale"]))


DECODERS = {"dense-nvfp4": decode_nvfp4, "dense-mxfp4": decode_mxfp4,
            "dense-fp8-tensor": decode_fp8_tensor, "dense-fp8-block": decode_fp8_block}
