"""The streaming checkpoint converter: any supported checkpoint in, one target format out.

One checkpoint should serve every device (DESIGN.md), so checkpoints must convert between
formats without a model graph: BF16 -> NVFP4/MXFP4/INT4/FP8, NVFP4 -> MXFP4 (what MI355X runs),
anything -> BF16. ``convert`` reads the source one shard at a time (peak memory near one shard),
converts the weights the caller selects, keeps everything else, writes the target producer's
layout through ``CheckpointWriter`` (atomic, sha256 per shard, resumable after a crash) and
reports the error of every converted tensor against the source values.

Which weights get quantized is the caller's decision: a weight is selected when it is a 2-D
``*.weight`` or a fused 3-D expert tensor (``*.experts.gate_up_proj`` ``[E, 2I, h]``,
``*.experts.down_proj`` ``[E, h, I]``, transformers 5) matching one of the ``include`` regexes (all,
when None) and none of ``exclude``. ``muse_rule(num_hidden_layers)`` gives the Muse rule (routed
experts of layers 1..L-2, fused or per-expert names); the CLI applies it by default to a Muse
checkpoint and selects every routed expert (``CLI_DEFAULT_INCLUDE``) of other models
(``default_include``). NVFP4 siblings that runtimes fuse (an expert's gate/up; q/k/v) share one
``weight_scale_2``, as ModelOpt exports them; a fused ``gate_up_proj`` is quantized as one stacked
tensor, so each expert gets one ``weight_scale_2`` over its gate and up rows (``[E]``).

A quantized fused expert tensor is written in the target producer's layout, which for ModelOpt,
Quark and AutoRound is per-expert keys (``checkpoint/experts.py`` cites their export code); BF16
ones are copied unchanged. Writing BF16, ``fuse_experts`` stacks per-expert weights back into the
fused tensors transformers 5 loads (by default when the source already holds fused experts).

Example::

    from musecore_quant.convert import convert
    report = convert("Muse-Spark-Open-BF16", "Muse-Spark-Open-MXFP4", to="mxfp4",
                     include=muse_rule(62))
    print(report.summary()["min_sqnr_db"])

``method="autoround"`` tunes weights on calibration data, which needs the model graph; pass
``calibrated_quantizer(name, fp32_weight) -> QTensor`` (musecore provides one) to use it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import math
import re
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch

from .api import dequantize, quantize, requantize
from .checkpoint import CheckpointError, CheckpointWriter, open_checkpoint
from .checkpoint.errors import translate
from .checkpoint.experts import (FUSED_EXPERT, check_fused_shape, check_layer_count, fuse, fuse_groups, muse_rule,
                                 num_hidden_layers)
from .checkpoint.reader import INDEX_NAME, CheckpointReader
from .checkpoint.safetensors_io import dtype_name, require_inside
from .checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, TARGET_PRODUCERS
from .formats.nvfp4 import nvfp4_shared_global_amax
from .formats.requant import nvfp4_exact_weight_scale_2
from .metrics import conversion_problem, quant_error
from .progress import progress as stage
from .qtensor import QTensor

TARGETS = tuple(TARGET_PRODUCERS)  # nvfp4, fp8, mxfp4, int4, bf16
METHODS = ("rtn", "autoround", "gptq")
CALIBRATED_METHODS = ("autoround", "gptq")  # tuned on calibration activations: need a calibrated_quantizer
DEFAULT_EXCLUDE = (r"embed", r"(^|\.)lm_head\.", r"norm")
CLI_DEFAULT_INCLUDE = r".*experts\.(\d+\.(gate|up|down)_proj\.weight|gate_up_proj|down_proj)$"  # every routed expert
MUSE_MODEL_TYPES = ("muse_spark", "muse_spark_text")  # config.json model_type of a Muse checkpoint (transformers)
DEFAULT_SIBLINGS = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"), ("w1", "w3"))
REPORT_NAME = "conversion_report.json"
_NOT_COPIED = {"config.json", "hf_quant_config.json", INDEX_NAME, REPORT_NAME}
_WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".pkl", ".ckpt", ".gguf"}

CalibratedQuantizer = Callable[[str, torch.Tensor], QTensor]
Weight = Union[torch.Tensor, QTensor]


@dataclass
class TensorRecord:
    """What happened to one weight, with its error against the source values when it changed."""

    name: str
    action: str  # quantize | requantize | dequantize | copy | fuse (per-expert BF16 stacked, bit for bit)
    source_format: str
    target_format: str
    shape: list[int]
    sqnr_db: Optional[float] = None
    max_abs_error: Optional[float] = None
    rmse: Optional[float] = None
    nmse: Optional[float] = None


@dataclass
class ConversionReport:
    """The outcome of ``convert``; ``to_dict()`` is what ``conversion_report.json`` holds."""

    src: str
    dst: str
    to: str
    method: str
    include: Optional[list[str]]
    exclude: list[str]
    quantize_options: dict[str, Any]
    tensors: list[TensorRecord] = field(default_factory=list)
    source_bytes_read: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    throughput_mb_s: float = 0.0
    resumed_weights: int = 0
    shards: int = 0
    warnings: list[str] = field(default_factory=list)
    selection: str = ""  # why these weights were quantized (the command line's default rule, or the flags)

    def measured(self) -> list[TensorRecord]:
        return [t for t in self.tensors if t.sqnr_db is not None]

    def worst(self, n: int = 10) -> list[TensorRecord]:
        """The ``n`` converted tensors with the lowest SQNR."""
        return sorted(self.measured(), key=lambda t: t.sqnr_db)[:n]

    def summary(self) -> dict[str, Any]:
        actions: dict[str, int] = {}
        for t in self.tensors:
            actions[t.action] = actions.get(t.action, 0) + 1
        sqnr = [t.sqnr_db for t in self.measured() if t.sqnr_db is not None and math.isfinite(t.sqnr_db)]
        return {"weights": len(self.tensors), "actions": actions,
                "min_sqnr_db": min(sqnr) if sqnr else None,
                "mean_sqnr_db": sum(sqnr) / len(sqnr) if sqnr else None,
                "max_abs_error": max((t.max_abs_error for t in self.measured()), default=None),
                "throughput_mb_s": self.throughput_mb_s, "resumed_weights": self.resumed_weights}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary()
        return _json_safe(d)


def _json_safe(obj: Any) -> Any:
    """inf/NaN are not JSON: exact conversions (SQNR inf) are written as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def select_weight(name: str, shape: Sequence[int], include: Optional[Sequence[re.Pattern]],
                  exclude: Sequence[re.Pattern]) -> bool:
    """The default rule: a 2-D ``*.weight`` or a fused 3-D expert tensor matching an include regex (all if
    None) and no exclude."""
    if FUSED_EXPERT.match(name):
        check_fused_shape(name, shape)
    elif len(shape) != 2 or not name.endswith(".weight"):
        return False
    if include is not None and not any(p.search(name) for p in include):
        return False
    return not any(p.search(name) for p in exclude)


def is_muse_config(config: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's config.json is a Muse model's (its own rule then picks what is quantized)."""
    return config.get("model_type") in MUSE_MODEL_TYPES


def default_include(config: Mapping[str, Any], names: Optional[Iterable[str]] = None,
                    source: Union[str, Path] = "config.json") -> tuple[list[str], str]:
    """The ``include`` regexes musecore-quant uses when none is given, and why: for a Muse checkpoint its
    own rule (the routed experts of layers 1..L-2, as the releases ship; layers 0 and L-1 keep BF16
    experts), for any other model every routed expert (``CLI_DEFAULT_INCLUDE``). ``names``: the
    checkpoint's weight names, against which config.json's layer count is checked (``check_layer_count``);
    ``source``: the config.json path, for that error."""
    if is_muse_config(config):
        layers = num_hidden_layers(config)
        if names is not None:
            check_layer_count(layers, names, source)
        return muse_rule(layers), (f"the Muse rule: routed experts of layers 1..{layers - 2} (config.json model_type "
                                   f"{config.get('model_type')!r}, num_hidden_layers {layers})")
    return [CLI_DEFAULT_INCLUDE], "every routed expert (not a Muse config.json: no model rule applies)"


def unmatched_includes(reader: CheckpointReader, include: Sequence[str]) -> list[str]:
    """The ``include`` regexes that match no quantizable weight of ``reader`` (a typo, or another model's
    names): each is an error on the command line, where a pattern that selects nothing is never meant."""
    names = [(n, reader.weight_shape(n)) for n in reader.weight_names()]
    return [p for p in include if not any(select_weight(n, shape, [_compile(p, "include")], []) for n, shape in names)]


def convert(src: Union[str, Path], dst: Union[str, Path], to: str = "nvfp4", method: str = "rtn",
            exclude: Sequence[str] = DEFAULT_EXCLUDE, include: Optional[Sequence[str]] = None,
            quantize_options: Optional[Mapping[str, Any]] = None, progress: bool = True, resume: bool = True,
            *, calibrated_quantizer: Optional[CalibratedQuantizer] = None,
            siblings: Sequence[Sequence[str]] = DEFAULT_SIBLINGS,
            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
            fuse_experts: Optional[bool] = None) -> ConversionReport:
    """Convert the checkpoint ``src`` into ``dst`` in format ``to``; see the module doc.

    - ``include``/``exclude``: regexes (``re.search``) over logical weight names choosing what
      is quantized; unselected weights are copied (a quantized one the target cannot store is
      dequantized to BF16). ``to="bf16"`` dequantizes every quantized weight.
    - ``quantize_options``: passed to ``quantize``/``requantize`` (e.g. ``{"rounding": "away"}``,
      ``{"group_size": 128, "sym": True}``, ``{"scale_mode": "floor"}``).
    - ``method="autoround"`` or ``"gptq"`` requires ``calibrated_quantizer(name, w_fp32) -> QTensor`` (in format
      ``to``, shape of ``w``), called for every selected weight instead of round-to-nearest.
    - ``resume``: a rerun with the same arguments (and the same code version) continues an interrupted
      conversion from its ``dst.partial-<key>`` folder, keeping the finished shards whose sha256 still
      matches and whose source weights still hash to what they were made from (a changed source tensor
      redoes its shard and every later one). Only one conversion writes a destination at a time.
    - An ``include``/``exclude`` that selects nothing (target other than bf16) is an error; a failing
      conversion leaves its ``.partial`` folder only when it holds finished shards (to resume).
    - A converted weight whose scales or values are NaN/Inf, or a matrix of which most nonzero values
      become 0 (a range the format cannot hold, ``metrics.conversion_problem``), is an error naming it.
    - ``siblings``: groups of module suffixes sharing the NVFP4 global scale under one parent.
    - ``fuse_experts`` (``to="bf16"`` only): stack per-expert ``P.{e}.{gate,up,down}_proj.weight`` into
      ``P.gate_up_proj`` / ``P.down_proj`` (the transformers 5 layout). None: when the source already
      holds a fused expert tensor (a quantized checkpoint whose BF16 layers kept them fused).
    """
    started = time.perf_counter()
    if to not in TARGETS:
        raise CheckpointError(f"unknown target format {to!r}; expected one of {list(TARGETS)}")
    if method not in METHODS:
        raise CheckpointError(f"unknown method {method!r}; expected one of {list(METHODS)}")
    if method in CALIBRATED_METHODS and calibrated_quantizer is None:
        raise NotImplementedError(
            f"method={method!r} tunes rounding on calibration activations, which needs the model graph; "
            "musecore_quant alone cannot run it. Pass calibrated_quantizer=(name, fp32 weight) -> QTensor "
            "(musecore provides one), or use method='rtn'.")
    if method == "rtn" and calibrated_quantizer is not None:
        raise CheckpointError(f"calibrated_quantizer is used only with method in {list(CALIBRATED_METHODS)}; drop it "
                              "or set method")
    if to == "bf16" and calibrated_quantizer is not None:
        raise CheckpointError("to='bf16' dequantizes; a calibrated_quantizer makes no sense there")
    if to == "fp8" and (quantize_options or {}).get("block_size") is not None:
        raise CheckpointError("the fp8 target is ModelOpt FP8, which stores one scale per tensor; drop "
                              "block_size from the quantize options")
    include_res = None if include is None else [_compile(p, "include") for p in include]
    exclude_res = [_compile(p, "exclude") for p in exclude]
    options = dict(quantize_options or {})
    src, dst = Path(src), Path(dst)

    reader = open_checkpoint(src)
    report = ConversionReport(str(src), str(dst), to, method, None if include is None else list(include),
                              list(exclude), options)
    names = reader.weight_names()
    selected = set() if to == "bf16" else {
        n for n in names if select_weight(n, reader.weight_shape(n), include_res, exclude_res)}
    if to != "bf16" and not selected:
        raise CheckpointError(
            f"{src}: no weight matches include {list(include) if include is not None else 'None (all)'} and exclude "
            f"{list(exclude)} (quantizable weights are 2-D '*.weight' or fused expert tensors, e.g. "
            f"{next((n for n in names if n.endswith('.weight') and len(reader.weight_shape(n)) == 2), names[0])!r}); "
            "nothing would be converted: fix the patterns", path=src)
    if calibrated_quantizer is None:  # a calibrated quantizer chooses its own group size: checked as it writes
        _check_storable(reader, selected, to, options)
    if reader.producer == "gpt-oss":  # interleaved gate/up rows: not the gate-then-up split of experts.py
        skipped = sorted(n for n in selected if FUSED_EXPERT.match(n))
        selected -= set(skipped)
        if skipped:
            report.warnings.append(f"GPT-OSS fused experts ({len(skipped)}, e.g. {skipped[0]}) interleave gate and "
                                   "up rows; they were dequantized to BF16, not requantized")
    if fuse_experts and to != "bf16":
        raise CheckpointError("fuse_experts writes the BF16 fused layout; producers of quantized formats write "
                              "per-expert keys (see musecore_quant/checkpoint/experts.py): use to='bf16'")
    if fuse_experts is None:
        fuse_experts = to == "bf16" and any(FUSED_EXPERT.match(n) for n in names)
    files = {n: str(next(iter(reader.entry(n).parts.values())).file) for n in names}
    fused_groups = fuse_groups(names, files) if fuse_experts else {}
    owner = {m: f for f, members in fused_groups.items() for m in members}  # per-expert name -> fused name
    clash = sorted(set(fused_groups) & set(names))
    if clash:
        raise CheckpointError(f"{files[clash[0]]}: {clash[0]!r} exists both fused and as per-expert weights; the "
                              "checkpoint mixes layouts for one layer: re-export it", tensor=clash[0])
    groups = _sibling_groups(selected, siblings) if to == "nvfp4" else {}
    groups.update((m, tuple(fused_groups[f])) for m, f in owner.items())
    sources = _SourceDigests(reader, {**{f: tuple(ms) for f, ms in fused_groups.items()}, **groups})

    side_files = _side_files(src)  # checked before any work: a conversion never fails once the work is done
    key = _resume_key(reader, to, method, include, exclude, options, calibrated_quantizer, siblings, fuse_experts)
    writer = CheckpointWriter(dst, config=reader.config, format=to, max_shard_bytes=max_shard_bytes,
                              resume_key=key, resume=resume, keep_shard=sources.unchanged)
    try:
        _run(reader, writer, report, to, options, calibrated_quantizer, selected, groups, owner, files, names,
             sources, side_files, progress, started)
    except BaseException:
        writer.abort()  # keeps the .partial folder (refused by readers) only when it holds finished shards
        raise
    return report


def _run(reader: CheckpointReader, writer: CheckpointWriter, report: ConversionReport, to: str,
         options: dict[str, Any], calibrated_quantizer: Optional[CalibratedQuantizer], selected: set[str],
         groups: dict[str, tuple[str, ...]], owner: dict[str, str], files: dict[str, str], names: list[str],
         sources: "_SourceDigests", side_files: list[Path], progress: bool, started: float) -> None:
    dst = writer.folder
    for other in sorted(dst.parent.glob(f"{dst.name}.partial-*")):
        if other != writer.partial_folder:
            report.warnings.append(f"{other} is a partial conversion with other arguments; delete it if unneeded")
    done = set(writer.completed) | {m for m, f in owner.items() if f in writer.completed}
    report.resumed_weights = len(done & set(names))
    # a finished weight is read again only when an unfinished sibling needs it for the shared scale
    needed = [n for n in names if any(m not in done for m in groups.get(n, (n,)))]
    converter = _Converter(writer, to, options, calibrated_quantizer, selected, done)

    bar = stage(f"convert -> {to}", total=sum(reader.tensor_nbytes(n) for n in needed), unit="B", unit_scale=True,
                enabled=progress)
    pending: dict[str, Weight] = {}
    with reader, bar:
        for _, weights in reader.iter_shards(needed):
            for name in list(weights):
                pending[name] = weights.pop(name)  # drop the shard's reference as each weight is done
                members = groups.get(name, (name,))
                if not all(m in pending for m in members):
                    continue
                batch = [(m, pending.pop(m)) for m in members]
                converter.source_sha256 = sources.of_batch(batch)
                if name in owner:
                    converter.fuse(owner[name], batch, files)
                else:
                    converter.run(batch)
                nbytes = sum(reader.tensor_nbytes(m) for m, _ in batch)
                report.source_bytes_read += nbytes
                bar.update(nbytes)
                if converter.last_sqnr is not None:
                    bar.set_postfix(last_sqnr_db=f"{converter.last_sqnr:.1f}")
    assert not pending, f"sibling groups never completed: {sorted(pending)[:3]}"

    for path in side_files:
        writer.add_file(path)
    writer.flush()
    records = {n: TensorRecord(**r["meta"]["record"]) for n, r in writer.completed.items() if "record" in r["meta"]}
    ordered = dict.fromkeys(owner.get(n, n) for n in names)
    report.tensors = [records[n] for n in ordered]
    report.output_bytes = writer.tensor_bytes
    report.shards = writer.shard_count
    report.seconds = time.perf_counter() - started
    report.throughput_mb_s = report.source_bytes_read / 1e6 / max(report.seconds, 1e-9)
    writer.close(extra_json={REPORT_NAME: report.to_dict()})


def _side_files(src: Path) -> list[Path]:
    """The files of ``src`` copied beside the converted weights (tokenizer, generation config...). A symlink
    is copied as the file it points to, so one that leads out of ``src`` (``passwd.txt -> /etc/passwd``) is
    refused, naming it, as the reader refuses such a config.json or shard."""
    try:
        paths = sorted(src.iterdir())
    except OSError as e:
        raise translate(e, src, "listing the source folder") from e
    return [require_inside(src, path, "side file " + repr(path.name)) for path in paths
            if path.is_file() and not path.name.startswith(".") and path.name not in _NOT_COPIED
            and path.suffix not in _WEIGHT_SUFFIXES]


class _Converter:
    """Turns one weight, or one group of NVFP4 siblings, into the target and records the error."""

    def __init__(self, writer: CheckpointWriter, to: str, options: dict[str, Any],
                 calibrated: Optional[CalibratedQuantizer], selected: set[str], done: set[str]) -> None:
        self.writer, self.to, self.options, self.calibrated = writer, to, options, calibrated
        self.selected, self.done = selected, done  # done: already in finished shards (resume)
        self.last_sqnr: Optional[float] = None
        self.source_sha256 = ""  # of the batch being converted: journaled with each record it writes

    def run(self, batch: list[tuple[str, Weight]]) -> None:
        requant = []
        for name, value in batch:
            if name in self.selected and not (isinstance(value, QTensor) and value.format == self.to
                                              and self.writer.accepts(value, name)):
                requant.append((name, value))
            elif name not in self.done:
                self._keep(name, value)
        if requant:
            for (name, value), qt in zip(requant, self._quantize(requant)):
                if name not in self.done:
                    action = "quantize" if not isinstance(value, QTensor) else "requantize"
                    self._add(name, value, qt, action)

    def fuse(self, name: str, batch: list[tuple[str, Weight]], files: Mapping[str, str]) -> None:
        """Per-expert weights stacked into the fused tensor ``name`` (BF16 target; quantized ones dequantized)."""
        if name in self.done:
            return
        quantized = any(isinstance(v, QTensor) for _, v in batch)
        plain = [(n, dequantize(v, torch.bfloat16) if isinstance(v, QTensor) else v) for n, v in batch]
        out = fuse(name, plain, files)
        if not quantized:
            self._add(name, out, out, "fuse")
            return
        source = fuse(name, [(n, _fp32(v)) for n, v in batch], files)
        record = TensorRecord(name, "dequantize", _format(batch[0][1]), _format(out), list(out.shape))
        approx = out.to(torch.float32)
        self._refuse_broken(name, batch[0][1], source, approx, out)
        err = quant_error(source, approx)
        record.sqnr_db, record.max_abs_error, record.rmse, record.nmse = (
            err.sqnr_db, err.max_abs_error, err.rmse, err.nmse)
        self.writer.add(name, out, meta={"record": asdict(record), "source_sha256": self.source_sha256})

    def _refuse_broken(self, name: str, source: Weight, reference: torch.Tensor, approx: torch.Tensor,
                       out: Weight) -> None:
        """A converted weight with NaN/Inf scales or values, or whose range the format cannot hold (most of a
        matrix flushed to zero), is never written: ``metrics.conversion_problem`` says why."""
        problem = conversion_problem(reference, approx, out)
        if problem:
            raise CheckpointError(f"cannot convert {name!r} ({_format(source)}{list(source.shape)}) to "
                                  f"{_format(out)}: {problem}; exclude this tensor (--exclude REGEX), fix its values "
                                  "in the source, or choose another format", tensor=name)

    def _keep(self, name: str, value: Weight) -> None:
        if isinstance(value, QTensor) and (self.to == "bf16" or not self.writer.accepts(value, name)):
            self._add(name, value, dequantize(value, torch.bfloat16), "dequantize")
        else:
            self._add(name, value, value, "copy")

    def _quantize(self, items: list[tuple[str, Weight]]) -> list[QTensor]:
        try:
            if self.calibrated is not None:
                return [self._calibrated(name, _fp32(value)) for name, value in items]
            values = [v for _, v in items]
            if self.to == "nvfp4" and len(items) > 1:
                if all(isinstance(v, QTensor) and v.format == "mxfp4" for v in values) and not self.options:
                    ws2 = nvfp4_exact_weight_scale_2(*values)  # exact, as MXFP4 -> NVFP4 allows
                    return [requantize(v, "nvfp4", weight_scale_2=ws2) for v in values]
                refs = [_fp32(v) for v in values]
                amax = nvfp4_shared_global_amax(*refs)
                return [quantize(r, "nvfp4", global_amax=amax, **self.options) for r in refs]
            return [requantize(v, self.to, **self.options) if isinstance(v, QTensor)
                    else quantize(v, self.to, **self.options) for v in values]
        except (ValueError, TypeError) as e:
            names = [n for n, _ in items]
            raise CheckpointError(f"cannot convert {names[0] if len(names) == 1 else names} to {self.to}: {e}",
                                  tensor=names[0]) from e

    def _calibrated(self, name: str, w: torch.Tensor) -> QTensor:
        qt = self.calibrated(name, w)
        if not isinstance(qt, QTensor) or qt.format != self.to or tuple(qt.shape) != tuple(w.shape):
            got = qt if not isinstance(qt, QTensor) else f"{qt.format}{list(qt.shape)}"
            raise CheckpointError(f"calibrated_quantizer returned {got!r} for {name!r}; expected a "
                                  f"{self.to} QTensor of shape {list(w.shape)}", tensor=name)
        return qt

    def _add(self, name: str, source: Weight, out: Weight, action: str) -> None:
        record = TensorRecord(name, action, _format(source), _format(out), list(source.shape))
        if action not in ("copy", "fuse"):
            reference, approx = _fp32(source), _fp32(out)
            self._refuse_broken(name, source, reference, approx, out)
            err = quant_error(reference, approx)
            record.sqnr_db, record.max_abs_error, record.rmse, record.nmse = (
                err.sqnr_db, err.max_abs_error, err.rmse, err.nmse)
            self.last_sqnr = err.sqnr_db if math.isfinite(err.sqnr_db) else self.last_sqnr
        self.writer.add(name, out, meta={"record": asdict(record), "source_sha256": self.source_sha256})


def _check_storable(reader: CheckpointReader, selected: set[str], to: str, options: Mapping[str, Any]) -> None:
    """Refuse, before any work, selected weights the target format (or its producer layout) cannot hold."""
    from .formats.int4 import DEFAULT_GROUP_SIZE
    block = {"nvfp4": 16, "mxfp4": 32}.get(to)
    if to == "int4":
        g = options.get("group_size", DEFAULT_GROUP_SIZE)
        if isinstance(g, bool) or not isinstance(g, int) or not (g > 0 or g == -1):  # True is an int in Python
            raise CheckpointError(f"the int4 group_size option is {g!r}; it must be a positive int or -1 (one group "
                                  "per row): pass e.g. --option group_size=128")
        block = g if g > 0 else None
    bad = []
    for name in sorted(selected):
        *_, out_features, in_features = reader.weight_shape(name)
        why = None
        if block and in_features % block:
            why = f"in_features {in_features} is not divisible by {block}, the {to} block"
        elif to == "int4" and (out_features % 8 or in_features % 8):
            why = "AutoRound's GPTQ packing needs in_features and out_features divisible by 8"
        if why:
            bad.append(f"{name} {list(reader.weight_shape(name))} ({why})")
    if bad:
        raise CheckpointError(f"{reader.folder}: {len(bad)} selected weight(s) cannot be stored as {to}, e.g. {bad[0]}. "
                              "Exclude this layer (--exclude REGEX) or narrow --include", path=reader.folder,
                              tensor=bad[0].split(" ")[0])


def _fp32(value: Weight) -> torch.Tensor:
    return dequantize(value) if isinstance(value, QTensor) else value.to(torch.float32)


def _format(value: Weight) -> str:
    return value.format if isinstance(value, QTensor) else dtype_name(value.dtype)


def _compile(pattern: str, what: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise CheckpointError(f"invalid --{what} pattern {pattern!r}: {e}; pass a Python regular expression") from e


def _sibling_groups(selected: Iterable[str], siblings: Sequence[Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """name -> all selected names of its sibling group (same parent), for groups of two or more."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name in sorted(selected):
        for i, group in enumerate(siblings):
            m = re.fullmatch(rf"(.*)\.({'|'.join(map(re.escape, group))})\.weight", name)
            if m:
                groups.setdefault((m.group(1), i), []).append(name)
    return {n: tuple(members) for members in groups.values() if len(members) > 1 for n in members}


def _resume_key(reader: CheckpointReader, to: str, method: str, include: Optional[Sequence[str]],
                exclude: Sequence[str], options: Mapping[str, Any], calibrated: Optional[Callable],
                siblings: Sequence[Sequence[str]], fuse_experts: Optional[bool] = None) -> str:
    """Identifies a conversion: a rerun with the same inputs and arguments resumes its partial folder."""
    ident = {"src": str(reader.folder.resolve()), "to": to, "method": method,
             "include": None if include is None else list(include), "exclude": list(exclude),
             "options": {k: repr(v) for k, v in sorted(options.items())},
             "quantizer": None if calibrated is None else getattr(calibrated, "__qualname__", repr(type(calibrated))),
             "siblings": [list(s) for s in siblings],
             **({"fuse_experts": fuse_experts} if fuse_experts is not None else {}),
             "shards": [(s.name, s.stat().st_size) for s in reader.shards], "code": code_version()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """The package version plus a hash of its source files: a resumed conversion must be made by the same code."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    try:
        version = importlib.metadata.version("musecore-quant")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return f"{version}+{h.hexdigest()[:12]}"


def weight_sha256(value: Weight) -> str:
    """sha256 of a decoded source weight: every stored tensor's dtype, shape and bytes (and QTensor metadata)."""
    h = hashlib.sha256()
    if isinstance(value, QTensor):
        h.update(repr((value.format, value.shape, value.group_size)).encode())
        parts = [(f, getattr(value, f)) for f in ("data", "scale", "global_scale", "zero", "input_scale")]
    else:
        parts = [("tensor", value)]
    for role, t in parts:
        if t is None:
            h.update(f"{role}:none;".encode())
            continue
        t = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{role}:{t.dtype}:{t.numel()};".encode())
        h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


class _SourceDigests:
    """What each output weight was made from, so a resumed run never keeps an output of stale source values.

    An output's ``source_sha256`` covers every source weight of its batch: NVFP4 siblings share a
    global scale and fused experts stack their members, so a change to one member changes the
    others' outputs too. ``unchanged`` is the writer's ``keep_shard`` check on resume: it re-reads
    the source weights of a journaled shard and compares.
    """

    def __init__(self, reader: CheckpointReader, groups: Mapping[str, tuple[str, ...]]) -> None:
        self.reader, self.groups = reader, groups  # output name -> the source weights it is made from
        self._names = set(reader.weight_names())
        self._cache: dict[str, str] = {}

    def of_batch(self, batch: Sequence[tuple[str, Weight]]) -> str:
        return self._combine({name: self._cache.pop(name, None) or weight_sha256(value) for name, value in batch})

    def unchanged(self, shard: Mapping[str, Any]) -> bool:
        for record in shard.get("weights", []):
            name = record.get("name")
            expected = (record.get("meta") or {}).get("source_sha256")
            members = self.groups.get(name, (name,))
            if not expected or not all(m in self._names for m in members):
                return False
            digests = {}
            for m in members:
                if m not in self._cache:
                    self._cache[m] = weight_sha256(self.reader.read(m))
                digests[m] = self._cache[m]
            if self._combine(digests) != expected:
                return False
        return True

    @staticmethod
    def _combine(digests: Mapping[str, str]) -> str:
        text = json.dumps(sorted(digests.items()))
        return hashlib.sha256(text.encode()).hexdigest()


class _CallableModule(types.ModuleType):
    """``musecore_quant.convert(...)`` keeps working once this submodule is imported.

    The package exposes ``convert`` lazily; importing the submodule binds the package attribute
    ``convert`` to this module, so the module forwards calls to the function.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> ConversionReport:
        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
