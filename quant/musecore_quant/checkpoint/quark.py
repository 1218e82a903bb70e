"""AMD Quark checkpoints: MXFP4 (OCP microscaling) as Quark's HF export writes it.

Quark keeps each Linear's name and stores ``X.weight`` (uint8, two E2M1 codes per byte) and
``X.weight_scale`` (uint8 E8M0, one per 32 inputs); ``config.json``'s ``quantization_config``
has ``quant_method: quark``, a ``global_quant_config`` describing weights (static, EVEN scale,
half-even rounding) and activations (dynamic MXFP4), and an ``exclude`` list of the modules kept
in BF16 (exact names, or ``re:`` regexes). vLLM and aiter read exactly these keys, so the writer
reproduces Quark's config field for field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from ..qtensor import QTensor
from .errors import CheckpointError
from .fields import get_object, get_patterns
from .layout import WeightEntry
from .modelopt import module_matches

# Quark weight dtype -> musecore format
DTYPE_FORMATS = {"fp4": "mxfp4", "fp8_e4m3": "fp8"}


def _mx_spec(dynamic: bool) -> dict[str, Any]:
    return {"dtype": "fp4", "is_dynamic": dynamic, "qscheme": "per_group", "ch_axis": -1,
            "group_size": 32, "block_size": None, "symmetric": None, "round_method": "half_even",
            "scale_type": "float", "scale_format": "e8m0", "scale_calculation_mode": "even",
            "mx_element_dtype": None, "observer_cls": "PerBlockMXObserver", "is_scale_quant": False}


def quantization_config(unquantized: list[str], overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``quantization_config`` as Quark writes it for MXFP4 weights and dynamic MXFP4 activations."""
    qc: dict[str, Any] = {
        "algo_config": None,
        "exclude": sorted(unquantized),
        "export": {"kv_cache_group": [], "min_kv_scale": 0.0, "pack_method": "reorder",
                   "weight_format": "real_quantized", "weight_merge_groups": None},
        "global_quant_config": {"bias": None, "input_tensors": _mx_spec(True), "output_tensors": None,
                                "target_device": None, "weight": _mx_spec(False)},
        "kv_cache_post_rope": False, "kv_cache_quant_config": {}, "layer_quant_config": {},
        "layer_type_quant_config": {}, "quant_method": "quark", "quant_mode": "eager_mode",
        "softmax_quant_spec": None,
    }
    qc.update(overrides or {})
    return qc


def declared_quantization(qc: Mapping[str, Any], source: Path) -> dict[str, Any]:
    glob = get_object(qc, "global_quant_config", source, "quantization_config.global_quant_config") or {}
    weight = get_object(glob, "weight", source, "quantization_config.global_quant_config.weight") or {}
    dtype = weight.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_FORMATS:
        raise CheckpointError(
            f"{source}: Quark global_quant_config.weight.dtype is {dtype!r}; supported: "
            f"{sorted(DTYPE_FORMATS)}. Export with MXFP4 (fp4, e8m0, group 32) or use the BF16 checkpoint",
            path=source)
    if dtype == "fp4" and (weight.get("group_size", 32) != 32 or weight.get("scale_format", "e8m0") != "e8m0"):
        raise CheckpointError(
            f"{source}: Quark fp4 weights with group_size={weight.get('group_size')!r}, "
            f"scale_format={weight.get('scale_format')!r} are not MXFP4 (group 32, e8m0); only MXFP4 is read",
            path=source)
    return {"format": DTYPE_FORMATS[dtype],
            "exclude": get_patterns(qc, "exclude", source, "quantization_config.exclude"),
            "per_layer": bool(qc.get("layer_quant_config") or qc.get("layer_type_quant_config"))}


def cross_check(entries: Mapping[str, WeightEntry], declared: Mapping[str, Any], source: Path) -> None:
    for name, e in entries.items():
        if not e.quantized or not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        problem = None
        if module_matches(module, declared["exclude"]):
            problem = "its exclude list says it is not quantized"
        elif not declared["per_layer"] and e.format != declared["format"]:
            problem = f"global_quant_config says {declared['format']}"
        if problem:
            h = next(iter(e.parts.values()))
            raise CheckpointError(
                f"{h.file}: weight {name!r} is stored as {e.format} but {source.name} {problem}; the "
                "config and the shards disagree: re-export the checkpoint", path=h.file, tensor=name)


def encode(name: str, qt: QTensor) -> dict[str, torch.Tensor]:
    """Quark tensors for one MXFP4 weight named ``X.weight``."""
    if qt.format != "mxfp4":
        raise CheckpointError(f"weight {name!r} is {qt.format}; the Quark MXFP4 writer stores only "
                              "mxfp4: requantize it or dequantize it to BF16", tensor=name)
    if len(qt.shape) != 2:
        raise CheckpointError(f"weight {name!r} is a stacked QTensor {list(qt.shape)}; Quark stores one "
                              "[out, in] tensor per expert: add each expert separately", tensor=name)
    module = name[: -len(".weight")]
    return {f"{module}.weight": qt.data, f"{module}.weight_scale": qt.scale}
