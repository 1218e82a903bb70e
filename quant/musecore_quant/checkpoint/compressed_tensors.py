"""compressed-tensors checkpoints (llm-compressor): NVFP4 ``nvfp4-pack-quantized`` and FP8.

compressed-tensors stores the same NVFP4 bytes as ModelOpt under other names: ``X.weight_packed``
(uint8 codes), ``X.weight_scale`` (E4M3 per 16 inputs) and the INVERSE global scale
``X.weight_global_scale = 1 / weight_scale_2`` (``X.input_global_scale = 1 / input_scale``).
FP8 (``float-quantized``) keeps ``X.weight`` + ``X.weight_scale`` (per tensor or 128x128
blocks) and is read by the shared dense rules. Integer ``pack-quantized`` checkpoints are
refused with a clear error rather than misread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from ..qtensor import QTensor
from .dense import NVFP4_GROUP
from .errors import CheckpointError
from .fields import bad_field, get_int, get_object, get_str
from .layout import (GroupingRule, WeightEntry, expect_dtype, expect_scalar, expect_shape, fail,
                     require)
from .safetensors_io import TensorHeader

CT_PACKED = GroupingRule("compressed-tensors", ".weight_packed",
                         (".weight_global_scale", ".input_global_scale", ".weight_scale",
                          ".weight_shape", ".weight_zero_point"), ".weight")
SUPPORTED_FORMATS = ("nvfp4-pack-quantized", "float-quantized", "mixed-precision", "dense")


def check_config(qc: Mapping[str, Any], source: Path) -> None:
    """Refuse compressed-tensors formats this reader does not decode, before reading tensors."""
    groups = get_object(qc, "config_groups", source, "quantization_config.config_groups") or {}
    formats = {get_str(qc, "format", source, "quantization_config.format")}
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise bad_field(source, f"quantization_config.config_groups[{name!r}]", g, "an object")
        formats.add(get_str(g, "format", source, f"quantization_config.config_groups[{name!r}].format"))
        weights = get_object(g, "weights", source, f"config_groups[{name!r}].weights") or {}
        group_size = get_int(weights, "group_size", source, f"config_groups[{name!r}].weights.group_size")
        bits, kind = weights.get("num_bits"), weights.get("type")
        if bits == 4 and kind == "float" and group_size is not None and group_size != NVFP4_GROUP:
            raise CheckpointError(
                f"{source}: config_groups[{name!r}].weights.group_size is {group_size} but NVFP4 has one scale per "
                f"{NVFP4_GROUP} inputs; the config contradicts the format: fix group_size or re-export", path=source)
    formats.discard(None)
    unsupported = sorted(f for f in formats if f not in SUPPORTED_FORMATS)
    if unsupported:
        raise CheckpointError(
            f"{source}: compressed-tensors format {unsupported} is not supported; supported: "
            f"{list(SUPPORTED_FORMATS)}. Use the BF16 checkpoint or export NVFP4/FP8", path=source)


def classify_packed(name: str, parts: dict[str, TensorHeader], options: Mapping[str, Any]) -> WeightEntry:
    w = parts["weight_packed"]
    if w.dtype != "U8":
        raise fail(name, w, f"has dtype {w.dtype}: integer pack-quantized compressed-tensors weights are "
                            "not supported (only nvfp4-pack-quantized); use the BF16 checkpoint")
    if len(w.shape) != 2:
        raise fail(name, w, f"has shape {list(w.shape)}; NVFP4 codes are [out, in/2]")
    out, k = w.shape[0], 2 * w.shape[1]
    why = "nvfp4-pack-quantized needs block scales and the inverse global scale"
    scale = require(name, parts, "weight_scale", ".weight_scale", why)
    expect_dtype(name, scale, ("F8_E4M3",), "NVFP4 block scales")
    expect_shape(name, scale, (out, k // NVFP4_GROUP), "one E4M3 scale per 16 inputs")
    expect_scalar(name, require(name, parts, "weight_global_scale", ".weight_global_scale", why),
                  "inverse global scale")
    if "input_global_scale" in parts:
        expect_scalar(name, parts["input_global_scale"], "inverse activation global scale")
    extra = sorted(set(parts) - {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"})
    if extra:
        raise fail(name, parts[extra[0]], "is not an NVFP4 companion; only nvfp4-pack-quantized is read")
    return WeightEntry(name, "ct-nvfp4", "nvfp4", (out, k), parts, NVFP4_GROUP)


def decode_packed(entry: WeightEntry, t: dict[str, torch.Tensor]) -> QTensor:
    inverse = lambda x: (1.0 / x.reshape(()).to(torch.float32))  # noqa: E731
    return QTensor("nvfp4", data=t["weight_packed"], scale=t["weight_scale"], shape=entry.shape,
                   group_size=NVFP4_GROUP, global_scale=inverse(t["weight_global_scale"]),
                   input_scale=inverse(t["input_global_scale"]) if "input_global_scale" in t else None)


DECODERS = {"ct-nvfp4": decode_packed}
