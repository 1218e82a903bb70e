"""``musecore.load`` and ``musecore.plan``: a checkpoint and a device in, a ready model or a plan out.

Example::

    import musecore
    print(musecore.plan("path/to/Muse-NVFP4", device="mi355x", emulate=True))   # no weights read
    model = musecore.load("path/to/Muse-NVFP4", device="mi355x", emulate=True)  # NVFP4 -> MXFP4 on load
"""

from __future__ import annotations

import logging
import sys
import time
from importlib.resources import files
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch

from musecore.backends.reference import ReferenceBackend
from musecore.backends.registry import best_device, discover, unavailable_reason
from musecore.config import MuseConfig
from musecore.devices import CATALOG
from musecore.distributed import (Comm, Mesh, MeshError, Shown, announce_alone, connect, digest, keeps_expert,
                                  leading_ranges, tensor_piece)
from musecore.loader import CheckpointMismatch, Placer, fill_model
from musecore.model import MuseModel, checkpoint_shapes, initial_value
from musecore.names import FUSED_EXPERT_TENSORS, expert_weight, is_fp32_tensor, quantized_expert_layers
from musecore.ops import Ops
from musecore.planning import (DENSE, QUANTIZED, REFERENCE, CheckpointSummary, DenseGroups, FitError, Plan, PlanError,
                               Towers, host_memory_bytes, make_plan)

# Package data (an installed wheel has it too): the bundled models, each a checkpoint folder.
BUNDLED = Path(str(files("musecore") / "data"))
log = logging.getLogger("musecore.load")
TORCH_DEVICE_TYPE = {"cuda": "cuda", "rocm": "cuda", "tpu": "tpu", "xeon": "cpu", REFERENCE: "cpu"}
DTYPE_LABELS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPE_NAMES = {name: dtype for dtype, label in DTYPE_LABELS.items()
               for name in (label, str(dtype).removeprefix("torch."))}  # "bf16", "bfloat16", ...


def model_dtype(dtype: Union[None, str, torch.dtype]) -> torch.dtype:
    """The activation dtype a model runs in: ``dtype`` (a torch dtype or its name), bf16 when None; a ValueError
    naming the choices for anything else."""
    if dtype is None:
        return torch.bfloat16
    found = (DTYPE_NAMES.get(dtype) if isinstance(dtype, str) else
             dtype if isinstance(dtype, torch.dtype) and dtype in DTYPE_LABELS else None)
    if found is None:
        raise ValueError(f"dtype must be torch.bfloat16, torch.float16 or torch.float32 (or one of "
                         f"{sorted(DTYPE_NAMES)}); got {dtype!r}")
    return found


def check_arguments(model: Any = "muse-tiny", device: Any = "auto", *, flags: Optional[dict[str, Any]] = None,
                    optional_flags: Optional[dict[str, Any]] = None, groups: Optional[dict[str, Any]] = None,
                    names: Optional[dict[str, Any]] = None) -> None:
    """A ValueError of one line naming the argument, for the argument types ``load``/``plan`` take: ``model`` a
    str or Path, ``device`` a str, ``flags`` bools (``optional_flags``: bool or None), ``groups`` None, a bool, a
    str or a collection of str (``quantize_dense``, ``towers``), ``names`` a str (``kv_format``,
    ``checkpoint_format``)."""
    if not isinstance(model, (str, Path)):
        raise ValueError(f"model must be a checkpoint folder, a bundled model, a preset or a Hub id (a str or "
                         f"Path); got {type(model).__name__} {model!r}")
    if not isinstance(device, str):
        raise ValueError(f"device must be a str (a catalog name such as 'h200', 'auto', or a torch device string "
                         f"such as 'cpu' or 'cuda:0'); got {type(device).__name__} {device!r}")
    for name, value in (flags or {}).items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False; got {type(value).__name__} {value!r}")
    for name, value in (optional_flags or {}).items():
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} must be True, False or None; got {type(value).__name__} {value!r}")
    for name, value in (groups or {}).items():
        if value is None or isinstance(value, (bool, str)):
            continue
        if not isinstance(value, (list, tuple, set, frozenset)) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{name} must be None, True, False, a name or a list of names (str); got "
                             f"{type(value).__name__} {value!r}")
    for name, value in (names or {}).items():
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a str; got {type(value).__name__} {value!r}")


def resolve_model(model: Union[str, Path], download: bool = False) -> tuple[str, Optional[Path]]:
    """(display name, checkpoint folder or None for a preset without weights).

    ``model`` is a folder, a bundled model, a preset, or a Hugging Face Hub id ``org/name[@revision]``
    found in the local Hugging Face cache (fetched only with ``download=True``; see :mod:`musecore.hub`)."""
    path = Path(model)
    if path.is_dir():
        return str(model), path
    if isinstance(model, str) and (BUNDLED / model / "config.json").is_file():
        return model, BUNDLED / model
    from musecore.config import PRESETS
    if isinstance(model, str) and model in PRESETS:
        return model, None
    from musecore import hub
    if isinstance(model, str) and hub.looks_like_hub_id(model):
        return model, hub.resolve(model, download=download)
    raise FileNotFoundError(f"no checkpoint folder at {str(model)!r} and no preset of that name; pass a folder "
                            f"holding config.json and *.safetensors, a Hub id (org/name), or a preset: "
                            f"{sorted(PRESETS)}")


def summarize(model: Union[str, Path], checkpoint_format: str = "bf16",
              download: bool = False) -> tuple[CheckpointSummary, Any]:
    """The plan's view of a checkpoint (config, formats, shapes) and its reader (None for presets)."""
    name, folder = resolve_model(model, download)
    if folder is None:
        return preset_summary(name, MuseConfig.from_name(name), checkpoint_format), None
    from musecore_quant.checkpoint import open_checkpoint
    reader = open_checkpoint(folder)
    config = MuseConfig.from_dict(reader.config, source=str(folder / "config.json"))
    names = reader.weight_names()
    for n in names:
        fmt = reader.weight_format(n)
        if fmt not in QUANTIZED + DENSE:
            raise CheckpointMismatch(f"{folder}: tensor {n!r} is stored as {fmt}, but Muse weights are bf16, fp16 or "
                                     f"fp32 (or a quantized format: {', '.join(QUANTIZED)}); re-export the checkpoint")
    shapes = {n: tuple(reader.weight_shape(n)) for n in names}
    config.check_tensor_shapes(shapes, source=str(folder / "config.json"))  # headers vs config, before any plan
    return CheckpointSummary(name, config, {n: reader.weight_format(n) for n in names}, shapes), reader


def check_checkpoint_format(checkpoint_format: str) -> None:
    """A ValueError listing the formats a preset's quantized experts can be planned in, for any other."""
    if checkpoint_format not in QUANTIZED + DENSE:
        raise ValueError(f"checkpoint_format must be one of {list(QUANTIZED + DENSE)}; got {checkpoint_format!r}")


def preset_summary(name: str, config: MuseConfig, checkpoint_format: str) -> CheckpointSummary:
    """A checkpoint as MODEL.md section 2 ships it: routed experts of the quantized layers in
    ``checkpoint_format``, everything else BF16 (for presets, which have no files to read)."""
    check_checkpoint_format(checkpoint_format)
    shapes = checkpoint_shapes(config)
    quantized_layers = set(quantized_expert_layers(config))
    formats = {}
    for tensor in shapes:
        expert = expert_weight(tensor)
        quantized = expert is not None and expert.layer in quantized_layers and expert.proj in FUSED_EXPERT_TENSORS
        formats[tensor] = checkpoint_format if quantized else ("fp32" if is_fp32_tensor(tensor) else "bf16")
    return CheckpointSummary(name, config, formats, shapes)


def torch_device_type(backend: str) -> torch.device:
    """The torch device a backend's tensors live on. TorchTPU registers ``tpu`` as the name of torch's
    PrivateUse1 device only once it is imported; without it that name does not parse, and the plan
    (which needs no hardware) names the same device by its generic name."""
    kind = TORCH_DEVICE_TYPE.get(backend, "cpu")
    try:
        return torch.device(kind)
    except RuntimeError:
        return torch.device("privateuseone")


def resolve_device(device: str, records: Optional[dict] = None) -> tuple[str, torch.device]:
    """A catalog name, ``auto`` or a torch device string -> (catalog name, torch device)."""
    if device in CATALOG:
        return device, torch_device_type(CATALOG[device].backend)
    records = discover() if records is None else records
    if device == "auto":
        return resolve_device(best_device(records), records)
    try:
        tdev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; choose one of {sorted(CATALOG)}, 'auto', or a torch "
                         "device string such as 'cuda:0'") from None
    if tdev.type == "cpu":
        return "cpu", tdev
    wanted = {"cuda": "rocm" if torch.version.hip else "cuda"}.get(tdev.type, tdev.type)
    why = unavailable_reason(records, wanted)
    if why is not None:
        raise ValueError(f"device {device!r} is not usable here: {why}")
    return records[wanted].probe.devices[0], tdev


def resolve_target(device: str, emulate: bool, records: Optional[dict] = None) -> tuple[str, torch.device]:
    """(catalog device, torch device) that both :func:`plan` and :func:`load` use: ``device`` as
    :func:`resolve_device` reads it (``auto``: the best device here); with ``emulate`` its numerics
    run on the reference kernels of this machine's CPU."""
    if emulate:
        name = device if device in CATALOG else resolve_device(device, records)[0]
        return name, torch.device("cpu")
    return resolve_device(device, records)


def plan(model: Union[str, Path], device: str = "auto", *, dtype: Union[None, str, torch.dtype] = None,
         emulate: bool = False, allow_emulation: bool = False, allow_reference: bool = False,
         kv_format: str = "bf16", checkpoint_format: str = "bf16", quantize_dense: DenseGroups = None,
         tp: Optional[int] = None, ep: Optional[int] = None, sp: bool = False, towers: Towers = None) -> Plan:
    """Resolve what would run where, in which format and why; reads config and headers only.

    ``tp``/``ep``/``sp`` plan the model over a mesh of ranks (as :func:`load` takes them): the plan's
    ``mesh`` shows each rank's weight and KV bytes and the bytes each collective moves per token.
    Without them, a model that does not fit on one device gets a ``proposed_mesh``.

    ``quantize_dense`` converts the attention, pooler/unpooler, lm_head and dense-MLP projections (True) or the
    named ones of them with the device's rule for BF16 weights, or keeps them (False); None, the
    default, takes the device's choice: all three on ``xeon``/``xeon6`` (see
    :func:`musecore.planning.make_plan`)."""
    check_arguments(model, device, flags={"emulate": emulate, "allow_emulation": allow_emulation,
                                          "allow_reference": allow_reference, "sp": sp},
                    groups={"quantize_dense": quantize_dense, "towers": towers},
                    names={"kv_format": kv_format, "checkpoint_format": checkpoint_format})
    check_checkpoint_format(checkpoint_format)  # before the config is read: the same answer for every model
    summary, _ = summarize(model, checkpoint_format)
    records = discover()
    name, _ = resolve_target(device, emulate, records)
    return make_plan(summary, name, emulate=emulate, allow_emulation=allow_emulation, allow_reference=allow_reference,
                     dtype_label=DTYPE_LABELS[model_dtype(dtype)], kv_format=kv_format, records=records,
                     quantize_dense=quantize_dense, mesh=mesh_of(tp, ep, sp), towers=towers)


def bind_ops(the_plan: Plan, backends: dict[str, Any]) -> Ops:
    """An op table from the plan; ``linear`` and ``moe`` dispatch on the weight's (format, activations)."""
    table, sources = {}, {}
    keyed: dict[str, dict[tuple, Any]] = {"linear": {}, "moe": {}}
    for choice in the_plan.ops:
        impl = getattr(backends[choice.implementation], choice.op)
        if choice.op in keyed:
            keyed[choice.op][(choice.weight_format, choice.act_format)] = impl
        else:
            table[choice.op], sources[choice.op] = impl, f"{choice.implementation}.{choice.op}"
    for op, impls in keyed.items():
        table[op], sources[op] = _dispatcher(op, impls), op + ": " + ", ".join(f"{k}" for k in impls)
    return Ops(table, sources)


def _dispatcher(op: str, impls: dict[tuple, Any]):
    if len(impls) == 1:
        return next(iter(impls.values()))

    def dispatch(x, w, *args, **kwargs):
        fn = impls.get((w.format, w.act_format))
        if fn is None:
            raise RuntimeError(f"{op}: the plan has no implementation for {w.format} weights with "
                               f"{w.act_format or '16-bit'} activations (it has {sorted(impls, key=str)})")
        return fn(x, w, *args, **kwargs)

    def dispatch_moe(z, weights, ids, experts, *args, **kwargs):
        fn = impls.get((experts.format, experts.act_format))
        if fn is None:
            raise RuntimeError(f"moe: the plan has no implementation for {experts.format} experts")
        return fn(z, weights, ids, experts, *args, **kwargs)

    return dispatch_moe if op == "moe" else dispatch


def load(model: Union[str, Path] = "muse-tiny", device: str = "auto", *, dtype: Union[None, str, torch.dtype] = None,
         emulate: bool = False, allow_emulation: bool = False, allow_reference: bool = False,
         kv_format: str = "bf16", progress: Optional[bool] = None, quantize_dense: DenseGroups = None,
         download: bool = False, tp: Optional[int] = None, ep: Optional[int] = None, sp: bool = False,
         towers: Towers = None) -> MuseModel:
    """Load a checkpoint folder (or the bundled ``muse-tiny``) onto ``device``, executing its plan.

    ``model`` may be a Hugging Face Hub id (``org/name``): its snapshot is taken from the local
    Hugging Face cache, and fetched from the Hub only with ``download=True``.

    ``device`` is a catalog name (``musecore devices``), ``auto`` or a torch device string.
    ``emulate=True`` runs the named device's numerics (weight conversion, activation quantization)
    on the local reference kernels. ``quantize_dense=True`` also converts the attention,
    pooler/unpooler and lm_head projections with the device's rule for BF16 weights (INT4 on ``xeon``);
    a collection of those group names converts only them (e.g. ``quantize_dense=("lm_head",)``);
    False keeps them as the checkpoint has them. The default, None, is the device's choice: on
    ``xeon``/``xeon6`` all three are INT4 too (decode there is bound by the bytes read per token).

    ``tp``/``ep``/``sp`` split the model across the ranks of a ``torchrun`` launch (every rank calls
    the same line; see :mod:`musecore.distributed`): ``tp``-way tensor parallel (1 or the number of
    ranks), ``ep``-way expert parallel (divides it), sequence-parallel prefill with ``sp=True``.
    ``towers``: the vision/audio towers to load (``model.vision`` / ``model.audio``). The default, None,
    loads each tower the checkpoint has when the plan can run its ops (on the device's backend, or the
    reference with ``allow_reference=True``) and otherwise leaves it out, saying why in the plan's
    notes; True (or ``"vision"``, ``("vision", "audio")``) requires them (what keeps one from running
    is a gap); False loads none (text only: the towers' bytes are never read).

    Raises :class:`~musecore.planning.PlanError` listing every gap.
    """
    check_arguments(model, device, flags={"emulate": emulate, "allow_emulation": allow_emulation,
                                          "allow_reference": allow_reference, "download": download, "sp": sp},
                    optional_flags={"progress": progress}, groups={"quantize_dense": quantize_dense, "towers": towers},
                    names={"kv_format": kv_format})
    dtype = model_dtype(dtype)
    comm = join(mesh_of(tp, ep, sp), device, emulate)
    try:
        summary, reader = summarize(model, download=download)
    except Exception as e:  # a checkpoint missing on one rank: every rank says which
        if comm is None:
            raise
        comm.agree(e, f"reading {model}")
    if comm is not None:
        comm.agree(None, f"reading {model}")
    if reader is None:
        raise FileNotFoundError(f"{model!r} is a preset without weights; pass a checkpoint folder "
                                "(musecore.plan works on presets)")
    show = sys.stderr.isatty() if progress is None else progress
    start = time.perf_counter()
    log.info("loading %s from %s onto device %r", summary.name, reader.folder, device)
    muse = assemble(summary, device, lambda placer, _device: placer.stream(reader, show), emulate=emulate,
                    allow_emulation=allow_emulation, allow_reference=allow_reference, dtype=dtype,
                    kv_format=kv_format, source=str(reader.folder), quantize_dense=quantize_dense,
                    comm=comm, towers=towers)
    from musecore.tokenizer import load_tokenizer
    muse.tokenizer = load_tokenizer(reader.folder)
    log.info("loaded %s on %s (backend %s, mode %s) in %.2f s", summary.name, muse.plan.device, muse.plan.backend,
             muse.plan.mode, time.perf_counter() - start)
    return muse


def load_random(preset: Union[str, MuseConfig], device: str = "auto", *, checkpoint_format: str = "bf16",
                dtype: Union[None, str, torch.dtype] = None, emulate: bool = False, seed: int = 0, std: float = 0.02,
                allow_reference: bool = False, quantize_dense: DenseGroups = None, tp: Optional[int] = None,
                ep: Optional[int] = None, sp: bool = False) -> MuseModel:
    """A model with random weights (MODEL.md initialisation) through the same plan and placement as
    :func:`load`, made tensor by tensor on the target device: for benchmarks of presets that have no
    checkpoint (``muse-small``). Quantized experts are produced with the producers' quantizers.

    Example::

        model = musecore.api.load_random("muse-small", device="h200", checkpoint_format="nvfp4")
    """
    from musecore_quant import quantize

    check_arguments(preset if isinstance(preset, str) else "custom config", device,
                    flags={"emulate": emulate, "allow_reference": allow_reference, "sp": sp},
                    groups={"quantize_dense": quantize_dense}, names={"checkpoint_format": checkpoint_format})
    config = preset if isinstance(preset, MuseConfig) else MuseConfig.from_name(preset)
    dtype = model_dtype(dtype)
    summary = preset_summary(preset if isinstance(preset, str) else "custom config", config, checkpoint_format)

    def tensors(_placer: Placer, torch_device: torch.device):
        gen = torch.Generator(device=torch_device).manual_seed(seed)
        for tensor_name, shape in summary.shapes.items():
            w = initial_value(tensor_name, shape, gen, std, torch_device)
            fmt = summary.formats[tensor_name]
            yield tensor_name, (w if fmt == "fp32" else w.to(dtype) if fmt == "bf16" else quantize(w, fmt))

    return assemble(summary, device, tensors, emulate=emulate, allow_reference=allow_reference, dtype=dtype,
                    source=f"random {summary.name}", quantize_dense=quantize_dense,
                    comm=join(mesh_of(tp, ep, sp), device, emulate))


def mesh_of(tp: Optional[int], ep: Optional[int], sp: bool) -> Optional[Mesh]:
    """The :class:`~musecore.distributed.Mesh` that ``tp``/``ep``/``sp`` ask for (None: one device)."""
    if tp is None and ep is None and not sp:
        return None
    return Mesh(1 if tp is None else tp, 1 if ep is None else ep, sp)


def join(mesh: Optional[Mesh], device: str, emulate: bool) -> Optional[Comm]:
    """This rank's :class:`~musecore.distributed.Comm` in the ``torchrun`` launch ``mesh`` needs (NCCL on
    CUDA devices, gloo on the CPU); None for one device. Raises when the launch does not fit the mesh."""
    problems = [] if mesh is None else mesh.shape_problems()
    if problems:  # before the launch's size is compared with it, and before a one-rank mesh is taken as no mesh
        raise MeshError(f"mesh {mesh.options}: " + "; ".join(problems))
    if mesh is None or mesh.world == 1:
        announce_alone()  # under torchrun: a rank given a mesh refuses at once rather than waiting for this one
        return None
    _name, torch_device = resolve_target(device, emulate, discover())
    return connect(mesh, torch_device.type)


def assemble(summary: CheckpointSummary, device: str,
             tensors: Callable[[Placer, torch.device], Iterable[tuple[str, Any]]], *, emulate: bool = False,
             allow_emulation: bool = False, allow_reference: bool = False, dtype: torch.dtype = torch.bfloat16,
             kv_format: str = "bf16", source: str = "checkpoint", quantize_dense: DenseGroups = None,
             comm: Optional[Comm] = None, towers: Towers = None) -> MuseModel:
    """Plan ``summary`` on ``device`` (raising on gaps), make the backends, and fill a model with
    ``tensors(placer, torch_device)`` converted and prepared per the plan: what every loader shares.
    With ``comm``, this process is one rank of a ``torchrun`` launch and keeps its pieces only."""
    dtype = model_dtype(dtype)
    records = discover()
    name, torch_device = resolve_target(device, emulate, records)
    if comm is not None:
        comm.agree_on(load_fingerprint(summary, name, torch_device, emulate, allow_emulation, allow_reference, dtype,
                                       kv_format, quantize_dense, towers, comm.mesh), f"loading {summary.name}")
        comm.mesh.check(summary.config)  # the same answer on every rank: no rank waits for another
        mesh = comm.mesh
        if torch_device.type == "cuda":
            torch_device = torch.device("cuda", torch.cuda.current_device())
    the_plan = make_plan(summary, name, emulate=emulate, allow_emulation=allow_emulation,
                         allow_reference=allow_reference, dtype_label=DTYPE_LABELS[dtype], kv_format=kv_format,
                         records=records, quantize_dense=quantize_dense, mesh=None if comm is None else comm.mesh,
                         towers=towers)
    if comm is not None:  # another host's backends or kernels could make another plan
        plan_digest = digest(plan_fingerprint(the_plan))
        shown = f"backend {the_plan.backend}, mode {the_plan.mode}, {len(the_plan.gaps)} gap(s), digest {plan_digest}"
        comm.agree_on({"plan": Shown(plan_digest, shown)}, f"loading {summary.name}")
    if the_plan.gaps:
        raise PlanError(the_plan)
    problem = the_plan.fit_problem(emulated_on=host_memory_bytes() if emulate else 0)
    if problem is not None:  # before a weight is read, not an exhausted memory part way through the load
        raise FitError(the_plan, problem)
    backends: dict[str, Any] = {REFERENCE: ReferenceBackend(torch_device)}
    if the_plan.backend != REFERENCE:
        backends[the_plan.backend] = records[the_plan.backend].backend_class(torch_device)
    muse = MuseModel(summary.config, bind_ops(the_plan, backends), dtype=dtype, device=torch_device,
                     backend=backends[the_plan.backend], comm=comm, towers=the_plan.towers)
    placer = Placer(the_plan, backends, dtype)
    if comm is not None:
        placer.keep = lambda tensor: keeps_expert(tensor, summary.config, mesh, comm.rank)
        expected = checkpoint_shapes(summary.config)
        placer.leading = {name: leading_ranges(piece) for name, shape in summary.shapes.items()
                          if (piece := tensor_piece(name, summary.config, mesh, comm.rank)) is not None
                          and leading_ranges(piece) and expected.get(name) == tuple(shape)}
    failure = None
    stream = tensors(placer, torch_device)
    try:
        fill_model(muse, stream, placer, source=source)
    except Exception as e:
        if hasattr(stream, "close"):  # end the reading stage now (its progress line before the error)
            stream.close()
        if comm is None:
            raise
        failure = e
    if comm is not None:  # every rank learns if one failed, instead of waiting in a collective
        comm.agree(failure, f"loading {source}")
    muse.plan, muse.conversion_report, muse.kv_format = the_plan, placer.report, kv_format
    muse.fuse_blocks()
    return muse


def load_fingerprint(summary: CheckpointSummary, device_name: str, torch_device: torch.device, emulate: bool,
                     allow_emulation: bool, allow_reference: bool, dtype: torch.dtype, kv_format: str,
                     quantize_dense: DenseGroups, towers: Towers, mesh: Mesh) -> dict[str, Any]:
    """What every rank of a launch must have been given alike (:meth:`~musecore.distributed.Comm.agree_on`): the
    checkpoint (its config, tensor formats and shapes, wherever its folder is), the device, the options, the mesh."""
    model = digest((summary.config.to_dict(), sorted(summary.formats.items()), sorted(summary.shapes.items())))
    return {"mesh": f"tp={mesh.tp} ep={mesh.ep} sp={mesh.sp}", "model": Shown(model, f"{summary.name} (digest {model})"),
            "device": f"{device_name} ({torch_device.type})", "dtype": DTYPE_LABELS[dtype], "emulate": emulate,
            "allow_emulation": allow_emulation, "allow_reference": allow_reference, "kv_format": kv_format,
            "quantize_dense": quantize_dense if quantize_dense is None or isinstance(quantize_dense, (bool, str))
            else sorted(quantize_dense),
            "towers": towers if towers is None or isinstance(towers, (bool, str)) else sorted(towers)}


def plan_fingerprint(the_plan: Plan) -> Any:
    """The parts of a plan every rank must share: backend, mode, formats and the implementation of every op."""
    whole = the_plan.to_dict()
    return [whole[key] for key in ("device", "backend", "mode", "checkpoint_format", "groups", "ops", "kernels",
                                   "towers", "gaps")]
