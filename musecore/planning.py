"""The plan: what runs where, in which format, and why, resolved before any weight byte is read.

``musecore.plan(model, device)`` reads ``config.json`` and the safetensors headers, picks the
device profile and its backend, decides per weight group the conversion (keep, requantize,
quantize, dequantize) and the activation format, chooses for every op the implementation and tier
with its reason, asks the backend for every kernel choice it would make on the model's linears
(:meth:`~musecore.backends.base.Backend.kernel_choices`) and the environment overrides in force, and
estimates memory against the device from the bytes each backend really keeps resident
(:meth:`~musecore.backends.base.Backend.resident_bytes`). Policy is strict: an op without a native
implementation is a gap unless ``allow_emulation`` / ``allow_reference`` opt in to a slower path;
all gaps are listed at once. ``musecore.load`` executes a plan that has none. Over a mesh of ranks
(``tp``/``ep``/``sp``) the plan adds each rank's memory and the bytes its collectives move, and
for a model one device cannot hold it proposes a mesh (:mod:`musecore.planning_mesh`).

The vision and audio towers (:func:`plan_towers`) add their ops (``musecore.ops.TOWER_OPS``, plus
``linear`` on model-dtype weights and ``rms_norm``) and their memory only when the plan loads them:
by default each tower the checkpoint has, if its ops can run under the same policy; a tower that
cannot run is left out with the reason in ``plan.towers_skipped`` and the notes, never a gap, so a
text-only run plans alike with or without a backend's tower ops. ``towers=True`` makes it a gap.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Optional, Union

from musecore_quant.formats.facts import FACTS, block_size, weight_bytes

from musecore.backends.base import Backend, KernelChoice, LinearShape, Support, Tier
from musecore.backends.registry import unavailable_reason
from musecore.config import MuseConfig
from musecore.devices import DeviceProfile, get_profile
from musecore.distributed import Mesh, MeshError
from musecore.kv_cache import KV_FORMATS
from musecore.loader import fusable_format
from musecore.model import checkpoint_shapes
from musecore.names import (AUDIO, DENSE_QUANTIZABLE, TOWER_GROUPS, TOWERS, VISION,  # noqa: F401 (re-export)
                            expert_key, fusable_projections, fused_expert_name, is_fp32_tensor, layer_of,
                            op_of_weight, projection_of, tower_of, weight_group)
from musecore.ops import TEXT_OPS, OpSpec
from musecore.planning_mesh import (USABLE, MeshPlan, devices_per_node, kv_bytes_for_heads, mesh_choices, plan_mesh,
                                    propose_mesh)

QUANTIZED = tuple(name for name, f in FACTS.items() if f.quantized)
DENSE = tuple(name for name, f in FACTS.items() if not f.quantized)
REFERENCE = "reference"
DEFAULT_CONTEXT = 8192  # tokens of KV cache counted in the memory estimate (batch 1)


class PlanError(RuntimeError):
    """The plan has gaps: ops with no allowed implementation, or hardware that is not here."""

    def __init__(self, plan: "Plan") -> None:
        self.plan = plan
        lines = [f"cannot run {plan.model!r} on device {plan.device!r}:"] + [f"  - {g}" for g in plan.gaps]
        super().__init__("\n".join(lines))


class FitError(PlanError):
    """The plan has no gaps, but the model (or one rank of its mesh) would not fit the device's memory: refused
    before a weight is read, instead of running out of memory part way through the load."""

    def __init__(self, plan: "Plan", problem: str) -> None:
        self.plan = plan
        RuntimeError.__init__(self, problem)


@dataclass
class GroupPlan:
    """One weight group (e.g. the experts of the quantized layers) and what loading does to it."""

    group: str
    tensors: int
    parameters: int
    source_format: str
    target_format: str
    act_format: Optional[str]
    action: str
    bytes: int
    note: str = ""


@dataclass
class OpChoice:
    op: str
    weight_format: Optional[str]
    act_format: Optional[str]
    implementation: str  # backend name, or "" when there is none
    tier: str
    reason: str
    candidates: list[str] = field(default_factory=list)  # every candidate's answer, for gaps


@dataclass
class Plan:
    model: str
    device: str
    profile: DeviceProfile
    backend: str
    mode: str                    # "native", "emulated" or "reference"
    checkpoint_format: str
    groups: list[GroupPlan]
    ops: list[OpChoice]
    memory_bytes: int
    device_memory_bytes: int
    kv_context: int
    gaps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    weight_targets: dict[str, tuple[str, Optional[str]]] = field(default_factory=dict, repr=False)
    parameters: int = 0         # the text decoder's, from the config (MuseConfig.num_parameters)
    active_parameters: int = 0  # per token (MuseConfig.num_active_parameters)
    kernels: list[KernelChoice] = field(default_factory=list)  # every kernel decision of the backend
    mesh: Optional[MeshPlan] = None           # the ranks asked for (tp/ep/sp); None on one device
    proposed_mesh: Optional[MeshPlan] = None  # without a mesh, for a model one device cannot hold
    towers: tuple[str, ...] = ()              # the towers loaded ("vision", "audio"): plan_towers
    towers_skipped: dict[str, str] = field(default_factory=dict)  # a tower in the checkpoint, not loaded: why

    @property
    def fits(self) -> bool:
        """Every rank of the mesh fits; without a mesh, the whole model on one device."""
        return self.mesh.fits if self.mesh is not None else self.memory_bytes <= USABLE * self.device_memory_bytes

    def fit_problem(self, emulated_on: int = 0) -> Optional[str]:
        """Why loading this plan would run out of memory, with what to do; None when it fits (or the memory is not
        known). ``emulated_on``: the bytes of the host an emulated load runs on (its weights live there, not on the
        device; the plan's bytes, the device's own, are then a lower bound)."""
        gib = 2**30
        if emulated_on:
            if self.memory_bytes <= USABLE * emulated_on:
                return None
            return (f"cannot emulate {self.model!r} on {self.device!r} on this host: it needs more than "
                    f"{self.memory_bytes / gib:.1f} GiB (the {self.device}'s own bytes; the reference keeps quantized "
                    f"weights dequantized, which takes more) and this host has {emulated_on / gib:.1f} GiB, 90% "
                    "usable; emulate a smaller model (muse-small, muse-tiny) or use a host with more memory")
        if self.fits or not self.device_memory_bytes:
            return None
        if self.mesh is not None:
            need, what = self.mesh.rank_bytes, f"a rank of {self.mesh.label} needs"
            fix = "launch more ranks (a larger --tp/--ep)"
        else:
            need, what = self.memory_bytes, "it needs"
            fix = (f"run it on {self.devices_needed} or more {self.device} devices with torchrun and --tp/--ep "
                   f"(`musecore plan` proposes a mesh)" if devices_per_node(self.profile) is not None else
                   "use a host with more memory")
        return (f"cannot load {self.model!r} on {self.device!r}: {what} {need / gib:.1f} GiB (weights and a KV cache "
                f"for {self.kv_context} tokens) and one {self.device} has {self.device_memory_bytes / gib:.1f} GiB, "
                f"90% usable; {fix}, or load a smaller checkpoint format")

    @property
    def devices_needed(self) -> int:
        """Devices the whole model's bytes need at 90% use each (a lower bound: see ``proposed_mesh``)."""
        return max(1, math.ceil(self.memory_bytes / (USABLE * self.device_memory_bytes)))

    def implementation(self, op: str, weight_format: Optional[str] = None, act_format: Optional[str] = None) -> str:
        for c in self.ops:
            if c.op == op and (op not in ("linear", "moe") or (c.weight_format, c.act_format) == (weight_format, act_format)):
                return c.implementation
        raise KeyError(f"plan has no choice for op {op!r} with weight {weight_format!r}, activations {act_format!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "device": self.device, "backend": self.backend, "mode": self.mode,
                "checkpoint_format": self.checkpoint_format, "profile": self.profile.to_dict(),
                "groups": [asdict(g) for g in self.groups], "ops": [asdict(o) for o in self.ops],
                "memory": {"bytes": self.memory_bytes, "device_bytes": self.device_memory_bytes,
                           "kv_context_tokens": self.kv_context, "fits": self.fits,
                           "devices_needed": self.devices_needed},
                "parameters": {"total": self.parameters, "active": self.active_parameters},
                "kernels": [asdict(k) for k in self.kernels],
                "mesh": None if self.mesh is None else self.mesh.to_dict(),
                "proposed_mesh": None if self.proposed_mesh is None else self.proposed_mesh.to_dict(),
                "towers": {"loaded": list(self.towers), "skipped": dict(self.towers_skipped)},
                "gaps": self.gaps, "notes": self.notes, "ok": not self.gaps}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        from musecore.planning_render import render_text
        return render_text(self)


# -- weight groups ---------------------------------------------------------------------------------

@dataclass
class CheckpointSummary:
    """What the plan needs of a checkpoint: its config and every tensor's format and shape."""

    name: str
    config: MuseConfig
    formats: dict[str, str]
    shapes: dict[str, tuple[int, ...]]

    @property
    def format(self) -> str:
        quantized = Counter(f for f in self.formats.values() if f in QUANTIZED)
        return quantized.most_common(1)[0][0] if quantized else "bf16"


def unquantizable(summary: CheckpointSummary, targets: dict[str, tuple[str, Optional[str]]]) -> list[str]:
    """Gaps for tensors converted at load to a format whose block does not divide their width."""
    gaps = []
    for name, (target, _act) in targets.items():
        if name not in summary.shapes:  # a layer's fused expert name standing for its per-expert keys
            continue
        block, shape = block_size(target), summary.shapes[name]
        if block and summary.formats[name] != target and shape[-1] % block:
            gaps.append(f"{name} {list(shape)}: {target} needs in_features divisible by {block}, got {shape[-1]}; "
                        "this device cannot take this checkpoint (use device='cpu' or a checkpoint whose expert "
                        f"widths are multiples of {block})")
    return gaps


DenseGroups = Union[None, bool, str, Collection[str]]


def dense_groups(quantize_dense: DenseGroups, profile: Optional[DeviceProfile] = None) -> tuple[str, ...]:
    """The groups of :data:`DENSE_QUANTIZABLE` that ``quantize_dense`` names: all for True, none for
    False, the device's default (``profile.quantize_dense``) for None, else the given names (a
    collection, or one string, comma-separated)."""
    if quantize_dense is None:
        quantize_dense = profile.quantize_dense if profile else ()
    if isinstance(quantize_dense, bool):
        return DENSE_QUANTIZABLE if quantize_dense else ()
    names = [n.strip() for n in quantize_dense.split(",")] if isinstance(quantize_dense, str) else list(quantize_dense)
    unknown = [n for n in names if n not in DENSE_QUANTIZABLE]
    if unknown:
        raise ValueError(f"quantize_dense: unknown group(s) {unknown}; choose from {list(DENSE_QUANTIZABLE)} "
                         "(or True for all of them)")
    return tuple(g for g in DENSE_QUANTIZABLE if g in names)


def resolve_groups(summary: CheckpointSummary, profile: DeviceProfile, dtype_label: str,
                   quantize_dense: DenseGroups = None, resident: Optional["Resident"] = None
                   ) -> tuple[list[GroupPlan], dict[str, tuple[str, Optional[str]]]]:
    """Per tensor the in-memory format and activation format; per group a summary row.

    Dense tensors take the model dtype (``dtype_label``); quantized tensors, and the routed experts
    of quantized layers whatever their checkpoint format, follow the device profile's conversion.
    The dense groups ``quantize_dense`` names (:func:`dense_groups`) follow it too. Bytes are what
    ``resident`` (the backend's layout) says, else the format's (``musecore_quant``).
    """
    converted_dense = dense_groups(quantize_dense, profile)
    config = summary.config
    targets: dict[str, tuple[str, Optional[str]]] = {}
    rows: dict[tuple, list] = defaultdict(lambda: [0, 0, 0, ""])
    for name, src in summary.formats.items():
        group, quantizable = weight_group(name, config)
        if group == TOWERS:  # the towers' tensors: tower_groups() when the plan loads them
            continue
        quantizable = quantizable or group in converted_dense
        numel = math.prod(summary.shapes[name])
        if is_fp32_tensor(name):  # router, correction bias, residual gates: kept fp32 (transformers)
            target, act, action, note = "fp32", None, ("keep" if src == "fp32" else f"cast {src}->fp32"), ""
        elif len(summary.shapes[name]) in (2, 3) and (src in QUANTIZED or quantizable):
            conv = profile.conversion(src if src in QUANTIZED else "bf16")
            target, act, action, note = conv.target, conv.act_format, conv.action(src), conv.note
            if group in converted_dense:  # at load: no calibration (least-error scales; RTN if MUSECORE_REQUANTIZATION=producer)
                note = (f"quantize_dense: kept as the checkpoint has it ({src}; AutoRound if it was calibrated)" if src == target
                        else f"quantize_dense: converted like the experts ({target}, uncalibrated: least-error scales, "
                        "RTN under MUSECORE_REQUANTIZATION=producer)")
            if conv.target == "bf16":  # dense in memory: the model dtype
                target = dtype_label
                action = "keep" if src == dtype_label else (f"cast {src}->{dtype_label}" if src in DENSE
                                                             else f"dequantize {src}->{dtype_label}")
        else:
            target, act, note = (src if src in QUANTIZED else dtype_label), None, ""
            action = "keep" if target == src else f"cast {src}->{target}"
        targets[name] = (target, act)
        row = rows[(group, src, target, act, action)]
        row[0] += 1
        row[1] += numel
        row[2] += resident.bytes(name, target, summary.shapes[name]) if resident else weight_bytes(target, numel)
        row[3] = note
    for name in list(targets):  # per-expert keys: the layer's experts are prepared under their fused names
        per_expert = expert_key(name)
        if per_expert is not None:
            prefix, _e, proj = per_expert
            targets.setdefault(fused_expert_name(prefix, proj), targets[name])
    groups = [GroupPlan(g, n, p, s, t, a, action, b, note)
              for (g, s, t, a, action), (n, p, b, note) in sorted(rows.items(), key=lambda kv: kv[0][0])]
    return groups, targets


def tower_groups(summary: CheckpointSummary, towers: Collection[str], dtype_label: str
                 ) -> tuple[list[GroupPlan], dict[str, tuple[str, Optional[str]]]]:
    """The loaded towers' tensors: every one in the model dtype (the quantization rule covers routed
    experts only; a quantized tower tensor is dequantized), one group per tower."""
    targets: dict[str, tuple[str, Optional[str]]] = {}
    rows: dict[tuple, list] = defaultdict(lambda: [0, 0, 0])
    for name, src in summary.formats.items():
        tower = tower_of(name)
        if tower not in towers:
            continue
        numel = math.prod(summary.shapes[name])
        action = "keep" if src == dtype_label else (f"cast {src}->{dtype_label}" if src in DENSE
                                                     else f"dequantize {src}->{dtype_label}")
        targets[name] = (dtype_label, None)
        row = rows[(TOWER_GROUPS[tower], src, action)]
        row[0], row[1], row[2] = row[0] + 1, row[1] + numel, row[2] + weight_bytes(dtype_label, numel)
    groups = [GroupPlan(g, n, p, src, dtype_label, None, action, b)
              for (g, src, action), (n, p, b) in sorted(rows.items())]
    return groups, targets


Towers = Union[None, bool, str, Collection[str]]


def requested_towers(towers: Towers, present: list[str]) -> tuple[list[str], bool]:
    """(the towers to consider, whether a tower that cannot run is only skipped (True) or a gap)."""
    if towers is None:
        return present, True
    if isinstance(towers, bool):
        return (present if towers else []), False
    names = [n.strip() for n in towers.split(",")] if isinstance(towers, str) else list(towers)
    unknown = [n for n in names if n not in (VISION, AUDIO)]
    if unknown:
        raise ValueError(f"towers: unknown tower(s) {unknown}; choose from ['vision', 'audio'] (or True/False)")
    return [t for t in (VISION, AUDIO) if t in names], False


def plan_towers(summary: CheckpointSummary, towers: Towers, text_ops: list[OpChoice], pick: Any,
                dtype_label: str, device: str, mesh: Optional[Mesh]) -> tuple[list[str], dict[str, str],
                                                                              list[OpChoice], list[str]]:
    """Which vision/audio towers the plan loads: ``(loaded, skipped {tower: why}, their op choices, gaps)``.

    ``towers=None`` (the default): every tower whose tensors the checkpoint has, when the plan can run
    all of its ops under the same policy as the text decoder's (native, or emulated with
    ``allow_emulation``, or the reference with ``allow_reference``); a tower that cannot run is not
    loaded and the plan says why (a note, not a gap), so a text-only run plans and loads on every
    backend, with or without the tower ops. ``towers=True`` (or ``"vision"``, ``("vision", "audio")``)
    requires them: what keeps one from running is a gap. ``towers=False`` loads none.
    ``pick(spec)`` chooses one op (:func:`choose` with the plan's policy).
    """
    from musecore.config import ConfigError
    from musecore.towers import TOWER_OP_NEEDS
    from musecore.towers.audio import check_audio_config
    from musecore.towers.vision import check_vision_config

    present = [t for t in (VISION, AUDIO) if any(tower_of(n) == t for n in summary.formats)]
    wanted, optional = requested_towers(towers, present)
    loaded, skipped, chosen, gaps = [], {}, [], []
    known = {(c.op, c.weight_format, c.act_format): c for c in text_ops}
    for tower in wanted:
        if tower not in present:
            gaps.append(f"towers={towers!r}: the checkpoint has no {tower} tower tensors (model.{tower}_tower.*)")
            continue
        why = None
        if mesh is not None:
            why = f"the towers run on one device; this plan splits the model over {mesh.world} ranks"
        else:
            try:
                (check_vision_config if tower == VISION else check_audio_config)(summary.config)
            except ConfigError as e:
                why = str(e)
        specs = [OpSpec(op, device=device) for op in TOWER_OP_NEEDS[tower]]
        specs.append(OpSpec("linear", weight_format=dtype_label, device=device))  # BF16 weights, never quantized
        choices = []
        for spec in specs:
            keyed = spec.op in ("linear", "moe")
            key = (spec.op, spec.weight_format if keyed else None, spec.act_format if keyed else None)
            choices.append(known.get(key) or pick(spec))
        missing = [c for c in choices if c.tier == Tier.NO.value]
        if why is None and missing:
            why = "; ".join(f"{c.op}: " + ("; ".join(c.candidates) or c.reason) + f" -> {c.reason}" for c in missing)
            why = f"its ops cannot run here ({why})"
        if why is not None:
            if optional:
                skipped[tower] = f"the {tower} tower was not loaded: {why}"
            else:
                gaps.append(f"{tower} tower (towers={towers!r}): {why}")
            continue
        loaded.append(tower)
        for c in choices:
            key = (c.op, c.weight_format, c.act_format)
            if key not in known:
                known[key] = c
                chosen.append(c)
    if towers is False and present:
        skipped.update({t: f"the {t} tower was not loaded: towers=False" for t in present})
    return loaded, skipped, chosen, gaps


# -- op choices ------------------------------------------------------------------------------------

def needed_specs(targets: dict[str, tuple[str, Optional[str]]], kv_format: str, device: str) -> list[OpSpec]:
    linear, moe = set(), set()
    for name, (fmt, act) in targets.items():
        op = op_of_weight(name)
        if op == "moe":
            moe.add((fmt, act))
        elif op == "linear":
            linear.add((fmt, act))
    specs = [OpSpec(op, device=device) for op in TEXT_OPS if op not in ("linear", "moe", "attention")]
    specs.append(OpSpec("attention", kv_format=kv_format, device=device))
    specs += [OpSpec("linear", weight_format=f, act_format=a, device=device) for f, a in sorted(linear, key=str)]
    specs += [OpSpec("moe", weight_format=f, act_format=a, device=device) for f, a in sorted(moe, key=str)]
    return specs


def choose(spec: OpSpec, backend: Any, backend_name: str, mode: str, allow_emulation: bool,
           allow_reference: bool, hardware_gap: Optional[str]) -> OpChoice:
    keyed = spec.op in ("linear", "moe")
    wf, af = (spec.weight_format, spec.act_format) if keyed else (None, None)
    if mode == "emulated":
        return OpChoice(spec.op, wf, af, REFERENCE, Tier.EMULATED.value,
                        "target numerics (weight conversion, activation quantization) on reference kernels")
    if backend_name == REFERENCE:
        return OpChoice(spec.op, wf, af, REFERENCE, Tier.NATIVE.value, "plain PyTorch reference (fp32 math)")
    if backend is None:
        return OpChoice(spec.op, wf, af, "", Tier.NO.value, f"backend {backend_name!r} unavailable (see gaps)")
    try:
        answer = backend.supports(spec.op, spec)
    except Exception as err:  # a plugin bug: shown in the plan, never hidden
        answer = Support.no(f"supports() raised {type(err).__name__}: {err}")
    candidates = [f"{backend_name}: {answer.tier.value} ({answer.reason})"]
    if hardware_gap:  # what the backend would do on that device, but the device is not here
        return OpChoice(spec.op, wf, af, "", Tier.NO.value if not answer.ok else answer.tier.value,
                        f"would be {answer.tier.value} on {spec.device}: {answer.reason} (device not here)", candidates)
    if answer.ok and answer.tier == Tier.NATIVE:
        return OpChoice(spec.op, wf, af, backend_name, Tier.NATIVE.value, answer.reason, candidates)
    if answer.ok and answer.tier == Tier.EMULATED and allow_emulation:
        return OpChoice(spec.op, wf, af, backend_name, Tier.EMULATED.value, answer.reason, candidates)
    if allow_reference:
        return OpChoice(spec.op, wf, af, REFERENCE, "reference", "allow_reference=True: plain PyTorch reference",
                        candidates + ["reference: native"])
    hint = "pass allow_emulation=True" if answer.tier == Tier.EMULATED else "pass allow_reference=True"
    return OpChoice(spec.op, wf, af, "", Tier.NO.value, f"no allowed implementation ({hint})", candidates)


# -- what the plan asks the backend besides supports(): it never makes the plan fail ------------------

def _asking(backend: Backend, method: str, notes: list[str], default: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return getattr(backend, method)(*args, **kwargs)
    except Exception as err:  # a plugin bug: a note naming the backend, never a failed plan
        notes.append(f"backend {backend.name!r}: {method}() raised {type(err).__name__}: {err}")
        return default


class Resident:
    """Bytes of a weight as the backend keeps it (:meth:`Backend.resident_bytes`), else its format's."""

    def __init__(self, backend: Optional[Backend], notes: list[str]) -> None:
        self.backend, self.notes = backend, notes

    def bytes(self, name: str, fmt: str, shape: tuple[int, ...]) -> int:
        if self.backend is not None and op_of_weight(name) in ("linear", "moe") and len(shape) in (2, 3):
            # a stacked [E, out, in] expert tensor, or one expert of a producer's per-expert keys (kept stacked too)
            experts = shape[0] if len(shape) == 3 else (1 if op_of_weight(name) == "moe" else 0)
            got = _asking(self.backend, "resident_bytes", self.notes, None, fmt, shape[-2], shape[-1], experts=experts)
            if got is not None:
                return int(got)
        return weight_bytes(fmt, math.prod(shape))


def linear_shapes(config: MuseConfig, targets: dict[str, tuple[str, Optional[str]]]) -> list[LinearShape]:
    """Every distinct linear the model runs, as :meth:`Backend.kernel_choices` is asked about it: q/k/v/o
    and the attention gate, the pooler/unpooler, the routed experts (gate/up and down, with their
    count and top-k), the dense MLP, lm_head; a block's input projections as the one stacked linear
    the loader makes of them when their format allows (:func:`musecore.loader.fusable_format`)."""
    found: dict[LinearShape, None] = {}
    blocks: dict[tuple, list] = defaultdict(list)  # (layer, group) -> its fusable projections
    for name, shape in checkpoint_shapes(config).items():
        op = op_of_weight(name)
        if op not in ("linear", "moe") or name not in targets:
            continue
        (fmt, act), group, proj = targets[name], weight_group(name, config)[0], projection_of(name)
        if op == "moe":
            label = "experts gate/up" if proj == "gate_up_proj" else "experts down"
            found[LinearShape(label, shape[1], shape[2], fmt, act, shape[0], config.num_experts_per_tok)] = None
        elif proj in fusable_projections(group):
            blocks[(layer_of(name), group)].append((proj, shape, fmt, act))
        else:
            found[LinearShape(proj if group == proj else f"{group} {proj}", shape[0], shape[1], fmt, act)] = None
    for (_layer, group), members in blocks.items():
        formats = {(fmt, act) for _, _, fmt, act in members}
        fmt, act = next(iter(formats))
        if len(formats) == 1 and fusable_format(fmt):
            label = f"{group} {'/'.join(p for p, *_ in members)} (fused)"
            found[LinearShape(label, sum(s[0] for _, s, *_ in members), members[0][1][1], fmt, act)] = None
        else:
            for proj, shape, fmt, act in members:
                found[LinearShape(f"{group} {proj}", shape[0], shape[1], fmt, act)] = None
    return list(found)


def tower_linear_shapes(config: MuseConfig, towers: Collection[str], dtype_label: str) -> list[LinearShape]:
    """The loaded towers' distinct linears (``"vision_tower.attn.q_proj"``, ``"vision_adapter.fc1"``...),
    in the model dtype."""
    from musecore.towers import tower_linears
    found: dict[LinearShape, None] = {}
    for tower in towers:
        for name, (out_features, in_features) in tower_linears(config, tower).items():
            module = ".".join(p for p in name.split(".")[1:-1] if not p.isdigit() and p != "layers")
            found[LinearShape(module, out_features, in_features, dtype_label)] = None
    return list(found)


def env_notes(backend: Backend, notes: list[str]) -> None:
    for env in _asking(backend, "env_settings", notes, []):
        if env.value is not None:
            notes.append(f"env {env.name}={env.value} in force ({backend.name} backend; default {env.default}): "
                         f"{env.effect}")


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def kv_bytes(config: MuseConfig, context: int, kv_format: str) -> int:
    """The KV cache of every KV head for ``context`` tokens at batch 1 (sliding layers keep their window)."""
    return kv_bytes_for_heads(config, context, kv_format, config.num_key_value_heads)


def make_plan(summary: CheckpointSummary, device: str, *, emulate: bool = False, allow_emulation: bool = False,
              allow_reference: bool = False, dtype_label: str = "bf16", kv_format: str = "bf16",
              kv_context: int = DEFAULT_CONTEXT, records: Optional[dict] = None,
              quantize_dense: DenseGroups = None, mesh: Optional[Mesh] = None, towers: Towers = None) -> Plan:
    """Resolve the plan for ``summary`` on the catalog device ``device`` (no weights read).

    ``quantize_dense``: also convert the attention, pooler/unpooler and lm_head projections (True),
    or the named ones of them (e.g. ``("lm_head",)``), with the device's rule for BF16 weights (INT4
    g128 on ``xeon``; profiles that keep BF16 as BF16 are unchanged): fewer bytes per token, more error.
    None (the default) takes the device's own choice (``DeviceProfile.quantize_dense``: all three on
    ``xeon``/``xeon6``, none elsewhere); False keeps them as the checkpoint has them.

    Natively, the plan asks the device's backend (installed, even when its hardware is not here) for
    its kernel choices, the environment overrides in force and the bytes it keeps per weight; an
    emulated plan counts the target's format bytes (what the device would hold), not the reference
    kernels' fp32 copies.

    ``mesh`` (:class:`~musecore.distributed.Mesh`, checked against the config: a mesh that cannot split
    it raises :class:`~musecore.distributed.MeshError`) plans the model over ``mesh.world`` ranks: the plan's
    ``mesh`` holds each rank's weight and KV bytes, whether a rank fits and the bytes each collective moves
    per token (:mod:`musecore.planning_mesh`). Without one, a model that does not fit gets ``proposed_mesh``.

    ``towers``: which vision/audio towers to load (:func:`plan_towers`; default: those the checkpoint
    has and the plan can run, the others skipped with the reason in ``towers_skipped`` and the notes).
    """
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS} ('bf16': K and V in the model's dtype, 'fp8': E4M3 "
                         f"with per-tensor scales); got {kv_format!r}")
    from musecore.backends.registry import discover

    if mesh is not None:
        try:
            mesh.check(summary.config)
        except MeshError as e:
            raise MeshError(f"{e}; {mesh_choices(summary.config)}") from None
        mesh = mesh if mesh.world > 1 else None
    profile = get_profile(device)
    backend_name = profile.backend
    mode, backend, hardware_gap = ("emulated" if emulate else "native"), None, None
    notes: list[str] = []
    if not emulate and backend_name == REFERENCE:
        from musecore.backends.reference import ReferenceBackend
        backend = ReferenceBackend()  # its resident layout: quantized weights kept dequantized (fp32)
    elif not emulate:
        records = discover() if records is None else records
        record = records.get(backend_name)
        if record is not None and record.loaded:
            try:
                backend = record.backend_class()  # constructing a backend touches no hardware
            except Exception as err:  # a plugin bug: its ops are gaps below, the plan itself still resolves
                notes.append(f"backend {backend_name!r}: constructing it raised {type(err).__name__}: {err}")
        hardware_gap = unavailable_reason(records, backend_name, device)
        if hardware_gap is not None and (record is None or record.loaded):
            hardware_gap += (f"; to predict {device}'s numerics here, pass emulate=True" if record is None else
                             f"; pass emulate=True to run {device}'s numerics on the local reference kernels")
    if emulate:
        notes.append(f"emulating {device}: its weight conversions and activation quantization, bit for bit, "
                     "computed by the reference kernels on this machine")
    converted_dense = dense_groups(quantize_dense, profile)
    if converted_dense:
        why = (f"{device}'s default (quantize_dense=False keeps them as the checkpoint has them)"
               if quantize_dense is None else "quantize_dense")
        notes.append(f"{', '.join(converted_dense)} projections follow the device's expert conversion: {why}; "
                     "see the groups below and the conversion report for the error")
    if backend is not None:
        env_notes(backend, notes)
    resident = Resident(backend, notes)
    groups, targets = resolve_groups(summary, profile, dtype_label, converted_dense, resident)
    def pick(spec: OpSpec) -> OpChoice:
        return choose(spec, backend, backend_name, mode, allow_emulation, allow_reference, hardware_gap)

    ops = [pick(spec) for spec in needed_specs(targets, kv_format, device)]
    loaded, skipped, tower_ops, tower_gaps = plan_towers(summary, towers, ops, pick, dtype_label, device, mesh)
    ops += tower_ops
    if loaded:
        more_groups, more_targets = tower_groups(summary, loaded, dtype_label)
        groups, targets = groups + more_groups, {**targets, **more_targets}
    for tower, why in skipped.items():
        count = sum(1 for name in summary.formats if tower_of(name) == tower)
        notes.append(f"{why}; its {count} tensors are skipped (model.{tower} is None)")
    linears = linear_shapes(summary.config, targets) + tower_linear_shapes(summary.config, loaded, dtype_label)
    kernels = [] if backend is None else _asking(backend, "kernel_choices", notes, [], linears, profile)
    gaps = ([f"{hardware_gap}"] if hardware_gap else []) + unquantizable(summary, targets)
    gaps += [] if hardware_gap else tower_gaps
    for c in ops:
        if c.tier == Tier.NO.value and not hardware_gap:
            what = f"{c.op}" + (f" [{c.weight_format} weights, {c.act_format or '16-bit'} activations]" if c.weight_format else "")
            gaps.append(f"{what}: " + "; ".join(c.candidates) + f" -> {c.reason}")
    if any(c.tier == "reference" for c in ops):
        mode = "reference" if all(c.implementation == REFERENCE for c in ops) else mode
        notes.append("some ops run on the plain PyTorch reference because allow_reference=True (slow)")
    memory = sum(g.bytes for g in groups) + kv_bytes(summary.config, kv_context, kv_format)
    device_memory = int(profile.memory_gib * 2**30) if profile.memory_gib else host_memory_bytes()

    def over(m: Mesh) -> MeshPlan:
        return plan_mesh(summary.config, summary.shapes, targets, m, profile, resident.bytes,
                         kv_format=kv_format, kv_context=kv_context, dtype_label=dtype_label,
                         device_memory_bytes=device_memory)

    mesh_plan = None if mesh is None else over(mesh)
    plan = Plan(summary.name, device, profile, REFERENCE if emulate else backend_name, mode, summary.format,
                groups, ops, memory, device_memory, kv_context, gaps, notes, targets,
                summary.config.num_parameters(), summary.config.num_active_parameters(), list(kernels), mesh_plan,
                towers=tuple(loaded), towers_skipped=skipped)
    if mesh_plan is not None and not mesh_plan.fits:
        plan.notes.append(f"does not fit: a rank of {mesh_plan.label} needs {mesh_plan.rank_bytes / 2**30:.1f} GiB, "
                          f"one {device} has {device_memory / 2**30:.0f} GiB (90% usable)")
    elif mesh_plan is None and not plan.fits:
        plan.notes.append(f"does not fit: needs {memory / 2**30:.1f} GiB, one {device} has "
                          f"{device_memory / 2**30:.0f} GiB (90% usable): needs {plan.devices_needed} devices")
        if devices_per_node(profile) is None:
            plan.notes.append(f"{device}: ranks are processes on one host and share its memory; no mesh makes the "
                              "model fit (use a device with more memory)")
        elif device_memory:
            plan.proposed_mesh, passed_over = propose_mesh(over, summary.config, memory, device_memory)
            plan.notes.extend(f"mesh search: {why}" for why in passed_over)
    return plan
