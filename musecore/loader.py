"""Loading a checkpoint into a :class:`MuseModel`: stream tensors, convert, prepare, place.

Tensors arrive one shard at a time from ``musecore_quant``'s validated checkpoint reader; each is
checked against the config's expected shape, converted per the plan (e.g. NVFP4 -> MXFP4 on
mi355x), handed to the backend's ``prepare_weight`` and placed in its slot, and the source is
dropped. Experts are collected per layer and stacked once all of a layer's experts have arrived,
so host memory stays near one shard plus one layer's experts.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch

from musecore.model import FusedLinear, MuseModel, Slot, checkpoint_shapes

class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match what the config says the model has."""


def logical_shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape)  # a QTensor's shape is its logical (unpacked) shape


class ExpertCollector:
    """Holds one layer's per-expert tensors until all ``E`` have arrived, then stacks them."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "output_norm")

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.parts: dict[int, dict[str, dict[int, Any]]] = defaultdict(lambda: defaultdict(dict))

    def add(self, layer: int, name: str, value: Any) -> Optional[dict[str, list[Any]]]:
        expert = int(name.split(".experts.")[1].split(".")[0])
        proj = name.rsplit(".", 2)[-2]
        self.parts[layer][proj][expert] = value
        got = self.parts[layer]
        if all(len(got[p]) == self.num_experts for p in self.PROJECTIONS):
            done = self.parts.pop(layer)
            return {p: [done[p][e] for e in range(self.num_experts)] for p in self.PROJECTIONS}
        return None


def stack(values: list[Any]) -> Any:
    if isinstance(values[0], torch.Tensor):
        return torch.stack(values)
    from musecore_quant import stack_qtensors
    return stack_qtensors(values)


class GroupCollector:
    """Holds the ``INPUT_PROJECTIONS`` of one attention or MoE block until all have arrived."""

    def __init__(self) -> None:
        self.parts: dict[int, dict[str, tuple[str, Any]]] = defaultdict(dict)

    def add(self, slot: Slot, name: str, value: Any) -> Optional[list[tuple[str, Any]]]:
        got = self.parts[id(slot.owner)]
        got[slot.attr] = (name, value)
        if len(got) < len(slot.owner.INPUT_PROJECTIONS):
            return None
        del self.parts[id(slot.owner)]
        return [got[attr] for attr in slot.owner.INPUT_PROJECTIONS]


def fuse_group(owner: Any, members: list[tuple[str, Any]], placer: "Placer") -> None:
    """Place one block's input projections: stacked into one :class:`FusedLinear` when one backend
    prepares them all for the same activation format and they can be joined row-wise without
    changing a value (plain tensors of one dtype, or MXFP4/INT4 QTensors alike: every scale per row
    block), else one by one. NVFP4 members stay apart: each has its own per-tensor global scale."""
    names = [name for name, _ in members]
    values = [value for _, value in members]
    stacked = None
    if placer.fuse_projections and len({placer.route("linear", name) for name in names}) == 1:
        if all(isinstance(v, torch.Tensor) and v.dtype == values[0].dtype for v in values):
            stacked = torch.cat(values)
        elif all(not isinstance(v, torch.Tensor) for v in values):
            from musecore_quant import concat_problem, concat_qtensors
            if concat_problem(values) is None:
                stacked = concat_qtensors(values)
    if stacked is not None:
        owner.in_proj = FusedLinear(placer.prepare(names[0], "linear", stacked), tuple(v.shape[0] for v in values))
        return
    for attr, name, value in zip(owner.INPUT_PROJECTIONS, names, values):
        setattr(owner, attr, placer.prepare(name, "linear", value))


def fill_model(model: MuseModel, tensors: Iterable[tuple[str, Any]], placer: "Placer", *,
               source: str = "checkpoint") -> None:
    """Place every tensor of ``tensors`` into ``model``, converted and prepared by ``placer``."""
    slots = model.weight_slots()
    expected = checkpoint_shapes(model.config)
    collector = ExpertCollector(model.config.num_experts)
    groups = GroupCollector()
    seen: set[str] = set()
    for name, value in tensors:
        slot = slots.get(name)
        if slot is None:
            raise CheckpointMismatch(f"{source}: unexpected tensor {name!r}; it is not part of a Muse model with this "
                                     "config (check that config.json matches the weights)")
        if name in seen:
            raise CheckpointMismatch(f"{source}: tensor {name!r} appears twice")
        shape = logical_shape(value)
        if shape != expected[name]:
            raise CheckpointMismatch(f"{source}: tensor {name!r} has shape {list(shape)} but config.json implies "
                                     f"{list(expected[name])}")
        seen.add(name)
        value = placer.convert(name, value)
        if slot.role == "vector":
            setattr(slot.owner, slot.attr, placer.place_vector(value))
        elif slot.fused:
            members = groups.add(slot, name, value)
            if members is not None:
                fuse_group(slot.owner, members, placer)
        elif slot.role in ("linear", "embedding"):
            setattr(slot.owner, slot.attr, placer.prepare(name, slot.role, value))
        else:
            done = collector.add(slot.layer, name, value)
            if done is not None:
                mlp = slot.owner
                mlp.experts = placer.prepare_experts(name, stack(done["gate_proj"]), stack(done["up_proj"]),
                                                     stack(done["down_proj"]))
                mlp.output_norm = placer.place_vector(torch.stack(done["output_norm"]))
    missing = sorted(set(slots) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointMismatch(f"{source}: missing {len(missing)} tensor(s): {shown}")


@dataclass
class ConversionRecord:
    name: str
    source: str
    target: str
    sqnr_db: float
    max_abs_error: float


class Placer:
    """Executes a plan's weight decisions: converts each tensor, then has the right backend prepare it."""

    fuse_projections = True  # stack each block's input projections when they allow it (:func:`fuse_group`)

    def __init__(self, plan: Any, backends: dict[str, Any], dtype: torch.dtype) -> None:
        self.plan, self.backends, self.dtype = plan, backends, dtype
        self.device = next(iter(backends.values())).device
        self.report: list[ConversionRecord] = []

    def stream(self, reader: Any, progress: bool) -> Iterator[tuple[str, Any]]:
        from tqdm import tqdm
        names = reader.weight_names()
        with tqdm(total=len(names), desc="loading", unit="tensor", disable=not progress, file=sys.stderr) as bar:
            for _shard, weights in reader.iter_shards():
                for name, value in weights.items():
                    yield name, value
                    bar.update(1)

    def convert(self, name: str, value: Any) -> Any:
        target, _act = self.plan.weight_targets[name]
        if isinstance(value, torch.Tensor):
            if target in ("bf16", "fp16", "fp32"):
                return value
            return self._record(name, value, quantize_for_target(value, target), "bf16")
        if value.format == target:
            return value
        from musecore_quant import dequantize, requantize
        if target in ("bf16", "fp16", "fp32"):
            return dequantize(value, torch.float32)
        return self._record(name, dequantize(value, torch.float32), requantize(value, target, **DEFAULT_OPTIONS.get(target, {})),
                            value.format)

    def _record(self, name: str, before: torch.Tensor, after: Any, source: str) -> Any:
        from musecore_quant import dequantize, quant_error
        err = quant_error(before.float(), dequantize(after, torch.float32))
        self.report.append(ConversionRecord(name, source, after.format, err.sqnr_db, err.max_abs_error))
        return after

    def place_vector(self, value: torch.Tensor) -> torch.Tensor:
        return value.to(self.dtype).to(self.device)

    def route(self, op: str, name: str) -> tuple[str, str, Optional[str]]:
        """(backend, weight format, activation format) that ``op`` on weight ``name`` runs with."""
        fmt, act = self.plan.weight_targets[name]
        return self.plan.implementation(op, fmt, act), fmt, act

    def _backend(self, op: str, name: str) -> Any:
        backend, _fmt, act = self.route(op, name)
        return self.backends[backend], act

    def prepare(self, name: str, role: str, value: Any) -> Any:
        backend, act = self._backend("linear" if role == "linear" else "embedding", name)
        return backend.prepare_weight(value, role, act_format=act, dtype=self.dtype)

    def prepare_experts(self, name: str, gate: Any, up: Any, down: Any) -> Any:
        backend, act = self._backend("moe", name.rsplit(".", 2)[0] + ".gate_proj.weight")
        return backend.prepare_experts(gate, up, down, act_format=act, dtype=self.dtype)


# The quantizer settings a device's own producer uses (FORMATS.md): INT4 g128 symmetric like the
# AutoRound export, MXFP4 with EVEN scales and RNE like Quark, FP8 per tensor like ModelOpt.
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {"int4": {"group_size": 128, "sym": True},
                                             "mxfp4": {"scale_mode": "even", "rounding": "rne"}, "fp8": {}}


def quantize_for_target(value: torch.Tensor, target: str) -> Any:
    from musecore_quant import quantize
    return quantize(value.float(), target, **DEFAULT_OPTIONS.get(target, {}))
