"""Which producer wrote a checkpoint, decided from its files (never from its path name).

``config.json``'s ``quantization_config.quant_method`` names the producer (``modelopt``,
``quark``, ``auto-round``, ``gptq``, ``awq``, ``compressed-tensors``, GPT-OSS ``mxfp4``, HF
``fp8``); an older ModelOpt export has only ``hf_quant_config.json``; neither means an
unquantized checkpoint. The producer fixes how tensors group (``GroupingRule``s) and what the
tensors must agree with; ``check_entries`` then verifies that the weights really hold the
formats the config declares, so a checkpoint whose config and shards disagree is refused
instead of being misread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from . import autoround, compressed_tensors, modelopt, quark
from .autoround import GPTQ
from .compressed_tensors import CT_PACKED
from .dense import DENSE
from .errors import CheckpointError
from .fields import get_object, get_str
from .gpt_oss import GPT_OSS
from .layout import GroupingRule, WeightEntry

# quant_method (as written by producers, several spellings) -> producer
QUANT_METHODS = {
    "modelopt": "modelopt", "modelopt_fp4": "modelopt", "modelopt_mixed": "modelopt",
    "quark": "quark",
    "auto-round": "auto-round", "auto_round": "auto-round", "intel/auto-round": "auto-round",
    "gptq": "gptq", "awq": "awq",
    "compressed-tensors": "compressed-tensors", "compressed_tensors": "compressed-tensors",
    "mxfp4": "gpt-oss", "fp8": "fp8",
}
PRODUCERS = ("modelopt", "quark", "auto-round", "gptq", "awq", "compressed-tensors", "gpt-oss", "fp8", "none")

_RULES: dict[str, tuple[GroupingRule, ...]] = {
    "auto-round": (GPTQ, DENSE), "gptq": (GPTQ, DENSE), "awq": (GPTQ, DENSE),
    "compressed-tensors": (CT_PACKED, DENSE), "gpt-oss": (GPT_OSS, DENSE),
}
_ALLOWED_FORMATS = {
    "modelopt": {"nvfp4", "fp8"}, "quark": {"mxfp4", "fp8"}, "auto-round": {"int4"}, "gptq": {"int4"},
    "awq": {"int4"}, "compressed-tensors": {"nvfp4", "fp8"}, "gpt-oss": {"mxfp4"}, "fp8": {"fp8"},
}


@dataclass(frozen=True)
class Scheme:
    """A detected producer: grouping rules, reader options and the config cross-check."""

    producer: str
    quant_method: Optional[str]
    rules: tuple[GroupingRule, ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    cross_check: Optional[Callable[[Mapping[str, WeightEntry]], None]] = None


def detect_scheme(folder: Path, config: Mapping[str, Any], hf_quant: Optional[Mapping[str, Any]]) -> Scheme:
    """The producer of the checkpoint in ``folder`` from its config files alone."""
    config_path = folder / "config.json"
    qc = config.get("quantization_config") or config.get("compression_config")
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"{config_path}: quantization_config is a {type(qc).__name__}, expected an "
                              "object; fix config.json", path=config_path)
    if qc is None and hf_quant is not None:
        hf_path = folder / "hf_quant_config.json"
        name = get_str(get_object(hf_quant, "producer", hf_path, "producer") or {}, "name", hf_path,
                       "producer.name", "modelopt")
        if name != "modelopt":
            raise CheckpointError(f"{folder / 'hf_quant_config.json'}: producer {name!r} is not supported "
                                  "(hf_quant_config.json is a ModelOpt file)", path=folder / "hf_quant_config.json")
        qc = {"quant_method": "modelopt"}
    if qc is None:
        return Scheme("none", None, (DENSE,))
    method = qc.get("quant_method")
    producer = QUANT_METHODS.get(str(method).lower()) if isinstance(method, str) else None
    if producer is None:
        raise CheckpointError(
            f"{config_path}: quantization_config.quant_method {method!r} is not supported; supported: "
            f"{sorted(set(QUANT_METHODS))}. Use a checkpoint from one of these producers or the BF16 one",
            path=config_path)
    if producer == "modelopt":
        source = config_path if hf_quant is None else folder / "hf_quant_config.json"
        declared = modelopt.declared_quantization(qc, hf_quant, source)
        return Scheme(producer, method, (DENSE,), {}, lambda e: modelopt.cross_check(e, declared, source))
    if producer == "quark":
        declared = quark.declared_quantization(qc, config_path)
        return Scheme(producer, method, (DENSE,), {}, lambda e: quark.cross_check(e, declared, config_path))
    if producer in ("auto-round", "gptq", "awq"):
        options = autoround.int4_options(producer, qc, config_path)
        return Scheme(producer, method, _RULES[producer], options,
                      lambda e: autoround.cross_check(e, options, config_path))
    if producer == "compressed-tensors":
        compressed_tensors.check_config(qc, config_path)
    return Scheme(producer, method, _RULES.get(producer, (DENSE,)))


def check_entries(scheme: Scheme, entries: Mapping[str, WeightEntry], folder: Path) -> None:
    """The weights must hold what the producer config declares."""
    quantized = [e for e in entries.values() if e.quantized]
    config_path = folder / "config.json"
    if scheme.producer == "none":
        if quantized:
            e = quantized[0]
            h = next(iter(e.parts.values()))
            raise CheckpointError(
                f"{h.file}: weight {e.name!r} is stored quantized ({e.format}, tensors "
                f"{sorted(p.key for p in e.parts.values())}) but {config_path} has no quantization_config "
                "and there is no hf_quant_config.json; the format cannot be known from the files: add the "
                "producer's quantization config", path=h.file, tensor=e.name)
        return
    if not quantized:
        raise CheckpointError(
            f"{config_path}: quantization_config says {scheme.quant_method!r} but no weight is stored "
            "quantized; remove quantization_config (a BF16 checkpoint) or use the quantized shards",
            path=config_path)
    allowed = _ALLOWED_FORMATS[scheme.producer]
    for e in quantized:
        if e.format not in allowed:
            h = next(iter(e.parts.values()))
            raise CheckpointError(
                f"{h.file}: weight {e.name!r} is stored as {e.format}, which {scheme.producer} checkpoints "
                f"do not contain (expected {sorted(allowed)}); the config and the shards disagree",
                path=h.file, tensor=e.name)
    if scheme.cross_check is not None:
        scheme.cross_check(entries)
