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
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from musecore_quant.formats.facts import producer_options

from musecore.distributed import MeshError, expert_range, keeps_expert, piece_shape, take, tensor_piece
from musecore.model import FusedLinear, MuseModel, Slot, checkpoint_shapes
from musecore.names import expert_key, fused_expert_name, fused_expert_parts, is_tower_tensor, tower_of
from musecore.towers import tower_shapes

class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match what the config says the model has."""


class ConversionError(ValueError):
    """A tensor the plan converts while loading that cannot be: the quantizer refused it, or the result has
    NaN/Inf scales or values, or lost most of a matrix to zero (one line, naming the tensor)."""


def logical_shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape)  # a QTensor's shape is its logical (unpacked) shape


def stack(values: list[Any]) -> Any:
    if isinstance(values[0], torch.Tensor):
        return torch.stack(values)
    from musecore_quant import stack_qtensors
    return stack_qtensors(values)


def split_rows(value: Any, rows: int) -> tuple[Any, Any]:
    """The two halves of a fused ``gate_up_proj [E, 2I, h]``: rows ``:I`` (gate) and ``I:`` (up), no copy."""
    if isinstance(value, torch.Tensor):
        return value[..., :rows, :], value[..., rows:, :]
    from musecore_quant import slice_rows
    return slice_rows(value, 0, rows), slice_rows(value, rows, 2 * rows)


class ExpertCollector:
    """Holds one layer's routed experts until they are complete, in either layout a checkpoint uses:
    transformers' fused ``experts.gate_up_proj`` + ``experts.down_proj``, or a producer's per-expert
    ``experts.{e}.{gate,up,down}_proj.weight`` (stacked once all ``E`` have arrived)."""

    def __init__(self, num_experts: int, intermediate: int) -> None:
        self.num_experts, self.intermediate = num_experts, intermediate
        self.fused: dict[str, dict[str, Any]] = defaultdict(dict)
        self.parts: dict[str, dict[str, dict[int, Any]]] = defaultdict(lambda: defaultdict(dict))

    def add_fused(self, prefix: str, proj: str, value: Any) -> Optional[tuple[Any, Any, Any]]:
        got = self.fused[prefix]
        if proj != "down_proj":  # gate_up_proj
            got["gate"], got["up"] = split_rows(value, self.intermediate)
        else:
            got["down"] = value
        return self._done(prefix, got)

    def add_expert(self, prefix: str, expert: int, proj: str, value: Any) -> Optional[tuple[Any, Any, Any]]:
        got = self.parts[prefix]
        got[proj][expert] = value
        if all(len(got[p]) == self.num_experts for p in ("gate", "up", "down")):
            del self.parts[prefix]
            done = {p: stack([got[p][e] for e in range(self.num_experts)]) for p in ("gate", "up", "down")}
            return self._done(prefix, done)
        return None

    def _done(self, prefix: str, got: dict[str, Any]) -> Optional[tuple[Any, Any, Any]]:
        merged = {**self.fused.pop(prefix, {}), **got}
        if all(p in merged for p in ("gate", "up", "down")):
            return merged["gate"], merged["up"], merged["down"]
        self.fused[prefix] = merged
        return None


class GroupCollector:
    """Holds the ``INPUT_PROJECTIONS`` of one attention or dense-MLP block until all have arrived."""

    def __init__(self) -> None:
        self.parts: dict[int, dict[str, tuple[str, Any]]] = defaultdict(dict)

    def add(self, slot: Slot, name: str, value: Any) -> Optional[list[tuple[str, Any]]]:
        got = self.parts[id(slot.owner)]
        got[slot.attr] = (name, value)
        if len(got) < len(slot.owner.INPUT_PROJECTIONS):
            return None
        del self.parts[id(slot.owner)]
        return [got[attr] for attr in slot.owner.INPUT_PROJECTIONS]


def fusable_format(fmt: str) -> bool:
    """Whether weights of in-memory format ``fmt`` can be stacked row-wise without changing a value
    (what :func:`fuse_group` needs): 16-bit/fp32 tensors, or QTensors whose every scale is per row
    block (musecore_quant's ``ROW_SCALED``: MXFP4, INT4; not NVFP4 or FP8 with their per-tensor scales)."""
    from musecore_quant.formats.facts import facts
    from musecore_quant.qtensor import ROW_SCALED
    return not facts(fmt).quantized or fmt in ROW_SCALED


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
    config = model.config
    slots = model.weight_slots()
    expected = checkpoint_shapes(config)
    for tower in (model.vision, model.audio):  # the towers the plan loads: their tensors are checked and placed
        if tower is not None:
            expected.update(tower_shapes(config, tower.kind))
    comm = model.comm
    mesh, rank = (comm.mesh, comm.rank) if comm is not None else (None, 0)
    first_expert = expert_range(config, mesh, rank)[0] if mesh is not None else 0
    local_experts = config.num_local_experts // (mesh.ep if mesh is not None else 1)
    experts = ExpertCollector(local_experts, config.moe_intermediate_size)

    def convert(name: str, value: Any) -> Any:  # this rank's piece of the tensor, converted per the plan
        piece = tensor_piece(name, config, mesh, rank) if mesh is not None else None
        if name in placer.presliced:  # the stream read this rank's rows (or experts) only
            piece = replace(piece, experts=None, rows=None)
        value = placer.convert(name, take(value, piece))
        group = getattr(value, "group_size", 0)
        if piece is not None and piece.cols is not None and group and piece.cols[0] % group:
            raise MeshError(f"{name}: tp={mesh.tp} cuts its {expected[name][-1]} input columns at {piece.cols[0]}, "
                            f"inside a {group}-column {value.format} scale block; use a smaller tp or keep this "
                            "group unquantized (quantize_dense=False)")
        return value

    groups = GroupCollector()
    seen: set[str] = set()
    for name, value in tensors:
        if is_tower_tensor(name) and name not in expected:  # a tower not loaded (or an unknown tower tensor,
            continue                                        # which the checkpoint's header check refused)
        per_expert = expert_key(name)
        if per_expert is not None:  # a producer's per-expert key: checked against its fused tensor's shape
            prefix, e, proj = per_expert
            fused_name = fused_expert_name(prefix, proj)
            if fused_name not in slots:
                raise CheckpointMismatch(f"{source}: unexpected tensor {name!r}; layer has no routed experts in "
                                         "this config (check mlp_layer_types / num_hidden_layers in config.json)")
            E, rows, cols = expected[fused_name]
            want = (rows // 2, cols) if proj != "down" else (rows, cols)
            if not 0 <= e < E:
                raise CheckpointMismatch(f"{source}: tensor {name!r} names expert {e}, but config.json has "
                                         f"num_local_experts={E}")
            if name in seen:
                raise CheckpointMismatch(f"{source}: tensor {name!r} appears twice")
            if logical_shape(value) != want:
                raise CheckpointMismatch(f"{source}: tensor {name!r} has shape {list(logical_shape(value))} but "
                                         f"config.json implies {list(want)}")
            if fused_name in seen:
                raise CheckpointMismatch(f"{source}: {fused_name!r} is stored both fused and per expert ({name!r})")
            seen.add(name)
            if mesh is not None and not keeps_expert(name, config, mesh, rank):
                continue  # another rank's expert
            done = experts.add_expert(prefix, e - first_expert, proj, placer.convert(name, value))
            if done is not None:
                seen.update((fused_expert_name(prefix, "gate"), fused_expert_name(prefix, "down")))
                place_experts(slots[fused_name], fused_name, done, placer)
            continue
        slot = slots.get(name)
        if slot is None:
            raise CheckpointMismatch(f"{source}: unexpected tensor {name!r}; it is not part of a Muse Spark model "
                                     "with this config (check that config.json matches the weights)")
        if name in seen:
            raise CheckpointMismatch(f"{source}: tensor {name!r} appears twice")
        shape = logical_shape(value)
        if name in placer.presliced and shape == piece_shape(expected[name], tensor_piece(name, config, mesh, rank)):
            shape = expected[name]  # read already cut to this rank's piece: the whole tensor had the config's shape
        if shape != expected[name]:
            raise CheckpointMismatch(f"{source}: tensor {name!r} has shape {list(shape)} but config.json implies "
                                     f"{list(expected[name])}")
        seen.add(name)
        value = convert(name, value)
        if slot.role == "experts":
            prefix, proj = fused_expert_parts(name)
            done = experts.add_fused(prefix, proj, value)
            if done is not None:
                place_experts(slot, name, done, placer)
        elif slot.fused:
            members = groups.add(slot, name, value)
            if members is not None:
                fuse_group(slot.owner, members, placer)
        elif slot.role in ("linear", "embedding"):
            setattr(slot.owner, slot.attr, placer.prepare(name, slot.role, value))
        elif slot.role == "residual_gate":
            setattr(slot.owner, slot.attr, placer.place_residual_gate(value, config.residual_gate_temperature))
        else:
            setattr(slot.owner, slot.attr, placer.place_vector(slot.role, value))
    missing = sorted(set(slots) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointMismatch(f"{source}: missing {len(missing)} tensor(s): {shown}")


def place_experts(slot: Slot, name: str, parts: tuple[Any, Any, Any], placer: "Placer") -> None:
    slot.owner.experts = placer.prepare_experts(name, *parts)


@dataclass
class ConversionRecord:
    """One tensor converted while loading: ``sqnr_db`` of what was loaded against the values it
    replaced, and ``producer_sqnr_db``, what the target's producer rule (Quark EVEN, AutoRound RTN)
    gives on the same values, when a least-error search was used (``rule``; see quantize_for_target)."""

    name: str
    source: str
    target: str
    sqnr_db: float
    max_abs_error: float
    rule: str = "producer"                   # "producer" | "least error"
    producer_sqnr_db: Optional[float] = None


class Placer:
    """Executes a plan's weight decisions: converts each tensor, then has the right backend prepare it."""

    fuse_projections = True  # stack each block's input projections when they allow it (:func:`fuse_group`)

    def __init__(self, plan: Any, backends: dict[str, Any], dtype: torch.dtype) -> None:
        self.plan, self.backends, self.dtype = plan, backends, dtype
        self.device = next(iter(backends.values())).device
        self.report: list[ConversionRecord] = []
        # Distributed (set by musecore.api.assemble): the tensors this rank reads (``keep``: not other
        # ranks' per-expert tensors) and the ranges of a tensor's first dimension it keeps (``leading``:
        # its experts of a stacked tensor, its rows of a projection); the stream reads only those where
        # the reader can, and lists those names in ``presliced``.
        self.keep: Callable[[str], bool] = lambda name: True
        self.leading: dict[str, tuple[tuple[int, int], ...]] = {}
        self.presliced: frozenset[str] = frozenset()

    def stream(self, reader: Any, progress: bool) -> Iterator[tuple[str, Any]]:
        """The checkpoint's tensors, shard by shard; ``progress``: a bar on a terminal, one line when done
        elsewhere (:func:`musecore.console.progress`)."""
        from musecore.console import progress as stage
        towers = getattr(self.plan, "towers", ())  # a tower the plan does not load is never read
        names = [name for name in reader.weight_names()
                 if (not is_tower_tensor(name) or tower_of(name) in towers) and self.keep(name)]
        with stage("loading", total=len(names), unit="tensor", enabled=progress, stream=sys.stderr) as bar:
            leading = {name: rows for name, rows in self.leading.items() if reader.can_slice(name)}
            self.presliced = frozenset(leading)
            for _shard, weights in reader.iter_shards(names, leading=leading):
                for name, value in weights.items():
                    yield name, value
                    bar.update(1)

    def convert(self, name: str, value: Any) -> Any:
        """``value`` in the plan's format for ``name``; a ValueError naming the tensor when it cannot be
        (a quantizer's refusal, or a result :meth:`_record` refuses)."""
        target, _act = self.plan.weight_targets[name]
        try:
            return self._convert(name, value, target)
        except ConversionError:
            raise
        except ValueError as e:  # the quantizer's refusal (e.g. an INT4 scale over fp16's range)
            source = value.format if not isinstance(value, torch.Tensor) else str(value.dtype).replace("torch.", "")
            raise ConversionError(f"tensor {name!r}: cannot convert it from {source} to {target} while loading: "
                                  f"{e}") from e

    def _convert(self, name: str, value: Any, target: str) -> Any:
        if isinstance(value, torch.Tensor):
            if target in ("bf16", "fp16", "fp32"):
                return value
            return self._record(name, value, *quantize_for_target(value, target), "bf16")
        if value.format == target:
            return value
        from musecore_quant import dequantize, requantize
        from musecore_quant.formats.requant import MIN_ERROR_FORMATS
        if target in ("bf16", "fp16", "fp32"):
            return dequantize(value, torch.float32)
        before = dequantize(value, torch.float32)
        if target in MIN_ERROR_FORMATS:  # the least-error search, or the producer's rule when asked for
            return self._record(name, before, *quantize_for_target(before, target), value.format)
        return self._record(name, before, requantize(value, target, **producer_options(target)), None, value.format)

    def _record(self, name: str, before: torch.Tensor, after: Any, search: Any, source: str) -> Any:
        """Log ``after``'s error against ``before``; ``search`` (a SearchError or None) adds the
        producer rule's SQNR on the same values."""
        import math

        from musecore_quant import dequantize, quant_error
        from musecore_quant.metrics import conversion_problem
        reference, approx = before.float(), dequantize(after, torch.float32)
        problem = conversion_problem(reference, approx, after)
        if problem:  # never placed: a model with NaN/Inf or erased weights computes garbage silently
            raise ConversionError(f"tensor {name!r} converted from {source} to {after.format} while loading: "
                                  f"{problem}; fix the tensor in the checkpoint, or convert the checkpoint offline "
                                  "keeping it in BF16 (musecore-quant convert --exclude REGEX)")
        err = quant_error(reference, approx)
        rule, producer_db = "producer", None
        if search is not None:
            rule = "least error"
            if search.squared_error > 0 and search.producer_squared_error > 0:
                producer_db = err.sqnr_db - 10 * math.log10(search.producer_squared_error / search.squared_error)
            else:
                producer_db = err.sqnr_db if search.producer_squared_error == search.squared_error else math.inf
        self.report.append(ConversionRecord(name, source, after.format, err.sqnr_db, err.max_abs_error, rule,
                                            producer_db))
        return after

    def place_vector(self, role: str, value: torch.Tensor) -> Any:
        """Norm weights and the router, as the ops take them (``musecore.ops``), in memory of their own
        (a checkpoint tensor may be a view into its shard's read buffer, which it would keep alive)."""
        if role in ("router", "router_bias"):  # kept fp32, as transformers keeps them
            return value.to(self.device, torch.float32, copy=True)
        value = value.to(self.dtype)
        if role == "centered":  # stored centred at 0; ``1 + w`` in the model dtype, as transformers rounds it
            return (1.0 + value).to(self.device)
        return value.to(self.device, copy=True)

    def place_residual_gate(self, gate: torch.Tensor, temperature: float) -> Any:
        """The fp32 gate parameter -> its ``(alpha, beta)`` coefficients, computed once."""
        from musecore.model import ResidualGate
        from musecore.ops.reference import residual_gate_coefficients
        alpha, beta = residual_gate_coefficients(gate.float(), temperature)
        return ResidualGate(alpha.to(self.device), beta.to(self.device))

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
        backend, act = self._backend("moe", name)
        return backend.prepare_experts(gate, up, down, act_format=act, dtype=self.dtype)


def quantize_for_target(value: torch.Tensor, target: str) -> tuple[Any, Any]:
    """``value`` (float: a BF16 weight, or a checkpoint's dequantized NVFP4/MXFP4 one) quantized for
    ``target`` while loading, and the search's :class:`~musecore_quant.formats._common.SearchError`
    (None when the producer's rule was used).

    By default MXFP4 and INT4 take the least-error rule (``musecore_quant.formats.requant.
    quantize_min_error``: each MXFP4 32-block's E8M0 exponent searched around Quark's EVEN, each INT4
    group's scale shrunk over a small grid; never worse than the producer per block; same layout,
    any reader takes it). ``MUSECORE_REQUANTIZATION=producer`` in the environment asks for producer
    parity: byte for byte what the format's producer writes (MXFP4 EVEN/RNE like Quark, INT4 g128
    symmetric RTN like AutoRound). Other formats always follow their producer (FP8 per tensor like
    ModelOpt, NVFP4 like ModelOpt)."""
    import os

    from musecore_quant import quantize
    from musecore_quant.formats.requant import MIN_ERROR_FORMATS, quantize_min_error
    rule = os.environ.get("MUSECORE_REQUANTIZATION", "least-error")
    if rule not in ("least-error", "producer"):
        raise ValueError(f"MUSECORE_REQUANTIZATION={rule!r}; choose 'least-error' (the default: each block's scale "
                         "searched for the least error) or 'producer' (byte-exact producer parity, e.g. Quark EVEN)")
    if rule == "least-error" and target in MIN_ERROR_FORMATS:
        return quantize_min_error(value.float(), target)
    return quantize(value.float(), target, **producer_options(target)), None
