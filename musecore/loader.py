"""Loading a checkpoint into a :class:`MuseModel`: stream tensors, convert, prepare, place.

Tensors arrive one shard at a time from ``musecore_quant``'s validated checkpoint reader; each is
checked against the config's expected shape, converted per the plan (e.g. NVFP4 -> MXFP4 on
mi355x), handed to the backend's ``prepare_weight`` and placed in its slot, and the source is
dropped. Experts are collected per layer and stacked once all of a layer's experts have arrived,
so host memory stays near one shard plus one layer's experts.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from musecore.model import MuseModel, Slot, checkpoint_shapes

Converter = Callable[[str, Any], Any]  # (tensor name, Tensor | QTensor) -> Tensor | QTensor


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match what the config says the model has."""


def logical_shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value.shape)


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


def fill_model(model: MuseModel, tensors: Iterable[tuple[str, Any]], backend: Any, *,
               convert: Optional[Converter] = None, act_format_of: Optional[Callable[[Slot], Optional[str]]] = None,
               source: str = "checkpoint") -> None:
    """Place every tensor of ``tensors`` into ``model``, prepared by ``backend``."""
    slots = model.weight_slots()
    expected = checkpoint_shapes(model.config)
    collector = ExpertCollector(model.config.num_experts)
    seen: set[str] = set()
    dtype = model.dtype
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
        if convert is not None:
            value = convert(name, value)
        act_format = act_format_of(slot) if act_format_of else None
        place(slot, name, value, backend, collector, dtype, act_format)
    missing = sorted(set(slots) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointMismatch(f"{source}: missing {len(missing)} tensor(s): {shown}")


def place(slot: Slot, name: str, value: Any, backend: Any, collector: ExpertCollector,
          dtype: torch.dtype, act_format: Optional[str]) -> None:
    if slot.role == "vector":
        setattr(slot.owner, slot.attr, value.to(dtype).to(backend.device))
    elif slot.role in ("linear", "embedding"):
        setattr(slot.owner, slot.attr, backend.prepare_weight(value, slot.role, act_format=act_format, dtype=dtype))
    elif slot.role == "expert":
        done = collector.add(slot.layer, name, value)
        if done is not None:
            mlp = slot.owner
            mlp.experts = backend.prepare_experts(stack(done["gate_proj"]), stack(done["up_proj"]),
                                                  stack(done["down_proj"]), act_format=act_format, dtype=dtype)
            mlp.output_norm = torch.stack(done["output_norm"]).to(dtype).to(backend.device)
    else:  # pragma: no cover - Slot roles are fixed in model.py
        raise AssertionError(slot.role)


def iter_safetensors(files: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
