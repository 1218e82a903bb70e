"""INT4 weight-only checkpoints: AutoRound, GPTQ and AWQ (``qweight``/``qzeros``/``scales``).

AutoRound exports in the GPTQ v1 layout (``packing_format: auto_round:auto_gptq``: ``qweight``
int32 ``[in/8, out]``, ``qzeros`` storing ``z - 1``, fp16 ``scales``, ``g_idx``); its asymmetric
``auto_round`` packing and GPTQ v2 store the true zero; AWQ GEMM packs ``qweight`` along the
output dimension with its own nibble order. Which layout a checkpoint uses is only knowable from
its ``quantization_config``, so ``int4_options`` turns that config into reader options, and the
bit shuffling itself lives in ``musecore_quant.formats.int4``. The writer side produces exactly
what AutoRound writes (GPTQ v1 tensors, ``extra_config`` marking the layers kept in 16 bits).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

import torch

from ..qtensor import QTensor
from .errors import CheckpointError
from .fields import bad_field, get_int, get_object, get_str
from .layout import GroupingRule, WeightEntry, expect_dtype, expect_shape, fail, require
from .safetensors_io import TensorHeader

GPTQ = GroupingRule("gptq", ".qweight", (".qzeros", ".scales", ".g_idx"), ".weight")

AUTOROUND_PACKING = "auto_round:auto_gptq"
# packing_format -> (int4 layout, zeros stored minus one)
_AUTOROUND_PACKINGS = {
    "auto_round:auto_gptq": ("gptq", True), "auto_round:gptq": ("gptq", True),
    "auto_gptq": ("gptq", True), "auto_round": ("gptq", False),
    "auto_round:auto_awq": ("awq", False), "auto_awq": ("awq", False),
}


def int4_options(producer: str, qc: Mapping[str, Any], config_path) -> dict[str, Any]:
    """Reader options (layout, zero convention) for an AutoRound/GPTQ/AWQ quantization_config."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{config_path}: quantization_config {what}", path=config_path)

    bits = qc.get("bits", qc.get("w_bit", 4))
    if bits != 4:
        raise bad(f"has bits={bits!r}; only 4-bit {producer} checkpoints are read: "
                  "requantize with the producer to 4 bits or use the BF16 checkpoint")
    groups = _declared_group_sizes(producer, qc, config_path)
    if producer == "auto-round":
        data_type = qc.get("data_type", "int")
        packing = get_str(qc, "packing_format", config_path, "quantization_config.packing_format", AUTOROUND_PACKING)
        if data_type != "int" or packing not in _AUTOROUND_PACKINGS:
            raise bad(f"has data_type={data_type!r}, packing_format={packing!r}; supported AutoRound "
                      f"exports are data_type 'int' with packing {sorted(_AUTOROUND_PACKINGS)}")
        layout, minus_one = _AUTOROUND_PACKINGS[packing]
        return {"int4_layout": layout, "zero_minus_one": minus_one, "group_sizes": groups}
    if producer == "gptq":
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise bad(f"has checkpoint_format={fmt!r}; supported: 'gptq' (v1) and 'gptq_v2'")
        return {"int4_layout": "gptq", "zero_minus_one": fmt == "gptq", "group_sizes": groups}
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise bad(f"has AWQ version={version!r}; only the GEMM packing is read")
    return {"int4_layout": "awq", "zero_minus_one": False, "group_sizes": groups}


def _declared_group_sizes(producer: str, qc: Mapping[str, Any], config_path) -> dict[str, Any]:
    """``{"": default, module: size}`` as the config declares them (-1: one group per row); {} when unknown.

    GPTQ's ``dynamic`` per-module overrides are regexes this reader does not evaluate: no check then.
    """
    if qc.get("dynamic"):
        return {}
    key = "q_group_size" if producer == "awq" and "group_size" not in qc else "group_size"
    default = get_int(qc, key, config_path, f"quantization_config.{key}", 128 if producer == "auto-round" else None)
    sizes: dict[str, Any] = {} if default is None else {"": default}
    extra = get_object(qc, "extra_config", config_path, "quantization_config.extra_config") or {}
    for module, spec in extra.items():
        if not isinstance(spec, dict):
            raise bad_field(config_path, f"quantization_config.extra_config[{module!r}]", spec, "an object")
        g = get_int(spec, "group_size", config_path, f"quantization_config.extra_config[{module!r}].group_size")
        if g is not None:
            sizes[module] = g
    return sizes


def cross_check(entries: Mapping[str, WeightEntry], options: Mapping[str, Any], config_path) -> None:
    """Each INT4 weight's group size (from its tensors) must be the one the config declares for it."""
    sizes = options.get("group_sizes") or {}
    for name, e in entries.items():
        if e.format != "int4":
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        declared = sizes.get(module, sizes.get(""))
        if declared is None or module not in sizes and any(set(k) & set("*[](|\\^$+?") for k in sizes if k):
            continue  # no declaration, or per-module patterns this reader does not evaluate
        in_features = e.shape[-1]
        expected = in_features if declared == -1 else declared
        if expected != e.group_size:
            h = e.parts["scales"]
            raise CheckpointError(
                f"{h.file}: weight {name!r} has scales {list(h.shape)}, i.e. group size {e.group_size} over "
                f"{in_features} inputs, but {config_path} declares group_size {declared} for it; the config "
                "and the tensors disagree (a wrong config would dequantize with the wrong groups elsewhere): "
                "fix group_size (or extra_config) or re-export the checkpoint", path=h.file, tensor=h.key)


def classify_int4(name: str, parts: dict[str, TensorHeader], options: Mapping[str, Any]) -> WeightEntry:
    layout = options.get("int4_layout")
    qweight = parts["qweight"]
    if layout is None:
        raise fail(name, qweight, "is a GPTQ/AWQ tensor but the config names no AutoRound, GPTQ or "
                                  "AWQ quantization; fix config.json's quantization_config")
    why = "INT4 needs zero points and scales beside qweight"
    qzeros = require(name, parts, "qzeros", ".qzeros", why)
    scales = require(name, parts, "scales", ".scales", why)
    for h in (qweight, qzeros):
        expect_dtype(name, h, ("I32",), "int32 packs of eight 4-bit values")
        if len(h.shape) != 2:
            raise fail(name, h, f"has shape {list(h.shape)}, expected 2-D")
    expect_dtype(name, scales, ("F16", "BF16", "F32"), "INT4 group scales")
    if len(scales.shape) != 2:
        raise fail(name, scales, f"has shape {list(scales.shape)}, expected [in/group, out]")
    groups, out = scales.shape
    if layout == "gptq":
        k = qweight.shape[0] * 8
        expect_shape(name, qweight, (k // 8, out), "GPTQ qweight is [in/8, out]")
    else:
        k = qweight.shape[0]
        expect_shape(name, qweight, (k, out // 8), "AWQ qweight is [in, out/8]")
    if groups == 0 or k % groups:
        raise fail(name, scales, f"has {groups} groups for {k} inputs; the group size must divide the inputs")
    expect_shape(name, qzeros, (groups, out // 8), "qzeros is [in/group, out/8]")
    allowed = {"qweight", "qzeros", "scales", "g_idx"}
    if "g_idx" in parts:
        if layout == "awq":
            raise fail(name, parts["g_idx"], "AWQ checkpoints carry no g_idx; the config says AWQ "
                                             "but the tensors look like GPTQ: fix quantization_config")
        expect_dtype(name, parts["g_idx"], ("I32", "I64"), "g_idx maps each input to its group")
        expect_shape(name, parts["g_idx"], (k,), "one group index per input")
    extra = sorted(set(parts) - allowed)
    if extra:
        raise fail(name, parts[extra[0]], f"is not an INT4 companion (expected {sorted(allowed)})")
    return WeightEntry(name, f"int4-{layout}", "int4", (out, k), parts, k // groups,
                       {"zero_minus_one": bool(options.get("zero_minus_one", layout == "gptq"))})


def decode_gptq(entry: WeightEntry, t: dict[str, torch.Tensor]) -> QTensor:
    from ..formats.int4 import int4_from_gptq
    return int4_from_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"),
                          zero_minus_one=entry.options["zero_minus_one"])


def decode_awq(entry: WeightEntry, t: dict[str, torch.Tensor]) -> QTensor:
    from ..formats.int4 import int4_from_awq
    return int4_from_awq(t["qweight"], t["qzeros"], t["scales"])


DECODERS = {"int4-gptq": decode_gptq, "int4-awq": decode_awq}


def encode_int4(name: str, qt: QTensor) -> dict[str, torch.Tensor]:
    """The AutoRound (GPTQ v1) tensors of one INT4 weight named ``X.weight``."""
    from ..formats.int4 import int4_to_gptq
    if len(qt.shape) != 2:
        raise CheckpointError(f"weight {name!r} is a stacked INT4 QTensor {list(qt.shape)}; AutoRound "
                              "stores one [out, in] tensor per expert: add each expert separately",
                              tensor=name)
    module = name[: -len(".weight")]
    packed = int4_to_gptq(qt)
    return {f"{module}.{k}": packed[k] for k in ("qweight", "qzeros", "scales", "g_idx")}


def autoround_quantization_config(quantized: Mapping[str, tuple[int, bool]], unquantized: list[str],
                                  overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``quantization_config`` as AutoRound writes it for ``auto_round:auto_gptq`` INT4.

    ``quantized`` maps module name -> (group_size, sym); the most common pair becomes the
    default and any other module gets an ``extra_config`` entry, as do the ``unquantized``
    modules (``{"bits": 16, "data_type": "float"}``: AutoRound's way to say "kept in 16 bits").
    """
    (group_size, sym), _ = Counter(quantized.values()).most_common(1)[0]
    qc: dict[str, Any] = {"quant_method": "auto-round", "packing_format": AUTOROUND_PACKING, "bits": 4,
                          "group_size": group_size, "sym": sym, "data_type": "int", "iters": 0}
    extra: dict[str, Any] = {}
    for module, (g, s) in quantized.items():
        if (g, s) != (group_size, sym):
            extra[module] = {"bits": 4, "group_size": g, "sym": s, "data_type": "int"}
    for module in unquantized:
        extra[module] = {"bits": 16, "data_type": "float"}
    if extra:
        qc["extra_config"] = extra
    qc.update(overrides or {})
    return qc
