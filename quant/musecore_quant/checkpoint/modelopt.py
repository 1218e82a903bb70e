"""NVIDIA ModelOpt checkpoints: NVFP4, FP8 per-tensor and MIXED_PRECISION.

ModelOpt's unified HF export keeps each Linear's name and stores ``X.weight`` (packed codes),
``X.weight_scale``, ``X.weight_scale_2`` (NVFP4 global) and ``X.input_scale`` (static activation
scale), and describes the checkpoint twice: ``hf_quant_config.json`` (``producer``,
``quantization.quant_algo``, ``exclude_modules`` or, with several formats, ``MIXED_PRECISION``
and ``quantized_layers``) and ``config.json``'s ``quantization_config`` (``quant_method:
modelopt``). The reader checks that what the config declares is what the tensors hold; the
writer emits both files the way ModelOpt does, listing every BF16 Linear in ``exclude_modules``
(single format) or leaving it out of ``quantized_layers`` (mixed).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ..qtensor import QTensor
from .errors import CheckpointError
from .fields import get_int, get_object, get_patterns
from .layout import WeightEntry

PRODUCER = {"name": "modelopt", "version": "0.1.0+musecore-quant"}
# quant_algo -> musecore format
ALGO_FORMATS = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8", "FP8_PB_WO": "fp8"}
QUANT_METHODS = ("modelopt", "modelopt_fp4", "modelopt_mixed")


NVFP4_GROUP = 16


def declared_quantization(config_qc: Mapping[str, Any] | None, hf_quant: Mapping[str, Any] | None,
                          source: Path) -> dict[str, Any]:
    """The quantization ModelOpt declares: quant_algo, quantized_layers, exclude_modules.

    With both files, ``config.json``'s ``ignore`` must not have been emptied while
    ``hf_quant_config.json`` excludes modules: runtimes that read only config.json would take the
    BF16 modules for quantized ones.
    """
    section = dict(get_object(hf_quant or {}, "quantization", source, "quantization") or {})
    config_path = source.parent / "config.json"
    ignore = None
    if config_qc:
        ignore = get_patterns(config_qc, "ignore", config_path, "quantization_config.ignore") \
            if "ignore" in config_qc else None
    if not section and config_qc:
        # config.json holds either the flattened form or a copy of hf_quant_config.json
        section = dict(get_object(config_qc, "quantization", source, "quantization_config.quantization") or config_qc)
    # whether the files state which modules stay unquantized at all (hand-written configs may not)
    listed = "exclude_modules" in section or ignore is not None
    if ignore is not None:
        section.setdefault("exclude_modules", ignore)
    exclude = get_patterns(section, "exclude_modules", source, "exclude_modules")
    if exclude and ignore is not None and not ignore:
        raise CheckpointError(
            f"{config_path}: quantization_config.ignore is empty but {source.name} excludes {len(exclude)} modules "
            f"(e.g. {exclude[0]!r}); runtimes reading config.json would treat them as quantized: restore the "
            "ignore list (the same modules as exclude_modules) or re-export the checkpoint", path=config_path)
    algo = section.get("quant_algo")
    if not isinstance(algo, str) or (algo not in ALGO_FORMATS and algo != "MIXED_PRECISION"):
        raise CheckpointError(
            f"{source}: ModelOpt quant_algo {algo!r} is not supported; supported: "
            f"{sorted(ALGO_FORMATS) + ['MIXED_PRECISION']}. Export with one of them or use the BF16 "
            "checkpoint", path=source)
    layers = section.get("quantized_layers")
    group_sizes: dict[str, int] = {}  # module ('' = every module) -> declared NVFP4 group size
    if algo == "MIXED_PRECISION":
        if not isinstance(layers, dict):
            raise CheckpointError(f"{source}: ModelOpt MIXED_PRECISION needs a quantized_layers object "
                                  "naming each quantized module; fix or regenerate the file", path=source)
        for module, spec in layers.items():
            if not isinstance(spec, dict) or not isinstance(spec.get("quant_algo"), str) \
                    or spec["quant_algo"] not in ALGO_FORMATS:
                raise CheckpointError(
                    f"{source}: quantized_layers[{module!r}] = {str(spec)[:80]}; expected "
                    f"{{'quant_algo': one of {sorted(ALGO_FORMATS)}}}", path=source)
            g = get_int(spec, "group_size", source, f"quantized_layers[{module!r}].group_size")
            if g is not None and ALGO_FORMATS[spec["quant_algo"]] == "nvfp4":
                group_sizes[module] = g
    else:
        g = get_int(section, "group_size", source, "quantization.group_size")
        if g is not None and ALGO_FORMATS[algo] == "nvfp4":
            group_sizes[""] = g
    for module, g in group_sizes.items():
        if g != NVFP4_GROUP:
            where = f"quantized_layers[{module!r}].group_size" if module else "group_size"
            raise CheckpointError(
                f"{source}: {where} is {g} but NVFP4 has one scale per {NVFP4_GROUP} inputs (the tensors' "
                "weight_scale shape says so too); the config contradicts the format: fix group_size or re-export",
                path=source)
    return {"quant_algo": algo, "quantized_layers": layers, "exclude_modules": exclude, "exclude_listed": listed}


def module_matches(module: str, patterns: Iterable[str]) -> bool:
    """ModelOpt/Quark exclusion patterns: exact names, fnmatch wildcards, or ``re:`` regexes."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif module == p or fnmatch.fnmatchcase(module, p):
            return True
    return False


def cross_check(entries: Mapping[str, WeightEntry], declared: Mapping[str, Any], source: Path) -> None:
    """The tensors must hold what the config declares, module by module."""
    quantized = {n[: -len(".weight")]: e for n, e in entries.items() if e.quantized and n.endswith(".weight")}
    algo = declared["quant_algo"]
    if algo == "MIXED_PRECISION":
        layers = declared["quantized_layers"]
        for module, spec in layers.items():
            fmt = ALGO_FORMATS[spec["quant_algo"]]
            e = quantized.get(module)
            if e is None:
                raise CheckpointError(
                    f"{source}: quantized_layers lists {module!r} as {spec['quant_algo']} but the "
                    f"checkpoint has no quantized {module}.weight; the config and the shards disagree: "
                    "re-export the checkpoint", path=source, tensor=module + ".weight")
            if e.format != fmt:
                raise _mismatch(source, e, f"quantized_layers says {spec['quant_algo']}")
        for module, e in quantized.items():
            if module not in layers:
                raise _mismatch(source, e, "quantized_layers does not list it")
        return
    fmt = ALGO_FORMATS[algo]
    for module, e in quantized.items():
        if e.format != fmt:
            raise _mismatch(source, e, f"quant_algo is {algo}")
        if module_matches(module, declared["exclude_modules"]):
            raise _mismatch(source, e, "exclude_modules says it is not quantized")
    # A single quant_algo covers every Linear the exclude list does not name: a BF16 Linear missing
    # from it (an emptied or truncated list) would be read by runtimes as quantized. (A config
    # without any exclude list, as hand-written ones are, makes no claim to check.)
    if not declared.get("exclude_listed"):
        return
    for name, e in entries.items():
        if e.quantized or len(e.shape) != 2 or not name.endswith(".weight") or _not_a_linear(name):
            continue
        module = name[: -len(".weight")]
        if not module_matches(module, declared["exclude_modules"]):
            h = next(iter(e.parts.values()))
            raise CheckpointError(
                f"{h.file}: weight {name!r} is stored as {e.format} but {source.name} declares quant_algo {algo} "
                f"for every Linear and its exclude list does not name {module!r}; runtimes would read it as "
                f"{algo}: add it to exclude_modules (and config.json's ignore) or re-export the checkpoint",
                path=h.file, tensor=name)


def _not_a_linear(name: str) -> bool:
    """Embeddings and norms hold 2-D ``.weight``s that no quantizer targets (ModelOpt targets Linears)."""
    leaf = name.lower()
    return "embed" in leaf or "norm" in leaf or "wte" in leaf or "wpe" in leaf


def _mismatch(source: Path, e: WeightEntry, declared: str) -> CheckpointError:
    h = next(iter(e.parts.values()))
    return CheckpointError(
        f"{h.file}: weight {e.name!r} is stored as {e.format} but {source.name} {declared}; the config "
        "and the shards disagree: re-export the checkpoint", path=h.file, tensor=e.name)


def quant_algo(qt: QTensor) -> str:
    """ModelOpt's name for the format of one QTensor."""
    if qt.format == "nvfp4":
        return "NVFP4" if qt.input_scale is not None else "W4A16_NVFP4"
    if qt.format == "fp8":
        return "FP8"
    raise CheckpointError(f"ModelOpt checkpoints store NVFP4 or FP8, not {qt.format}; write "
                          f"{qt.format} with its own producer layout or dequantize it")


def encode(name: str, qt: QTensor) -> dict[str, torch.Tensor]:
    """ModelOpt tensors for one NVFP4 or per-tensor FP8 weight named ``X.weight``."""
    if len(qt.shape) != 2:
        raise CheckpointError(f"weight {name!r} is a stacked QTensor {list(qt.shape)}; ModelOpt stores "
                              "one [out, in] tensor per expert: add each expert separately", tensor=name)
    module = name[: -len(".weight")]
    out = {f"{module}.weight": qt.data}
    if qt.format == "nvfp4":
        out[f"{module}.weight_scale"] = qt.scale
        out[f"{module}.weight_scale_2"] = qt.global_scale.reshape(()).to(torch.float32)
    elif qt.format == "fp8":
        if qt.scale.numel() != 1:
            raise CheckpointError(
                f"weight {name!r} is block-scaled FP8 (scale {list(qt.scale.shape)}); ModelOpt FP8 is "
                "per-tensor: requantize with block_size=None", tensor=name)
        out[f"{module}.weight_scale"] = qt.scale.reshape(()).to(torch.float32)
    else:
        quant_algo(qt)
    if qt.input_scale is not None:
        out[f"{module}.input_scale"] = qt.input_scale.reshape(()).to(torch.float32)
    return out


def _config_group(algo: str) -> dict[str, Any]:
    if algo == "FP8":
        spec = {"dynamic": False, "num_bits": 8, "type": "float"}
        return {"input_activations": dict(spec), "weights": spec, "targets": ["Linear"]}
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
    group: dict[str, Any] = {"weights": weights, "targets": ["Linear"]}
    if algo == "NVFP4":
        group["input_activations"] = dict(weights)
    return group


def quantization_configs(quantized: Mapping[str, str], unquantized: list[str],
                         overrides: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json ``quantization_config``, ``hf_quant_config.json``) as ModelOpt writes them.

    ``quantized`` maps module name -> quant_algo (``NVFP4``, ``W4A16_NVFP4``, ``FP8``);
    ``unquantized`` lists the Linear modules kept in BF16.
    """
    overrides = dict(overrides or {})
    producer = {**PRODUCER, **overrides.pop("producer", {})}
    algos = sorted(set(quantized.values()))
    exclude = sorted(unquantized)
    if len(algos) == 1:
        algo = algos[0]
        section: dict[str, Any] = {"quant_algo": algo, "kv_cache_quant_algo": None}
        if algo != "FP8":
            section["group_size"] = 16
        section["exclude_modules"] = exclude
        config_qc = {"config_groups": {"group_0": _config_group(algo)}, "ignore": exclude,
                     "quant_algo": algo, "producer": producer, "quant_method": "modelopt"}
    else:
        layers = {m: ({"quant_algo": a} if a == "FP8" else {"quant_algo": a, "group_size": 16})
                  for m, a in sorted(quantized.items())}
        section = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                   "quantized_layers": layers, "exclude_modules": exclude}
        config_qc = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
                     "kv_cache_quant_algo": None, "quantized_layers": layers,
                     "exclude_modules": exclude, "ignore": exclude, "producer": producer}
    config_qc.update(overrides)
    return config_qc, {"producer": producer, "quantization": section}
