"""Fused MoE experts (transformers 5): names, the Muse rule, and each producer's export layout.

transformers 5 stores a MoE layer's routed experts FUSED, as 3-D parameters without a
``.weight`` suffix: ``P.gate_up_proj`` ``[E, 2I, h]`` (rows ``0..I-1`` are the gate, ``I..2I-1``
the up projection) and ``P.down_proj`` ``[E, h, I]``, where ``P`` is e.g.
``model.language_model.layers.3.mlp.experts`` (``MuseSparkExperts`` in
``transformers/models/muse_spark/modeling_muse_spark.py``; Mixtral, Qwen3-MoE, DeepSeek-V3 alike).
musecore_quant treats both as weights (logical shape 3-D; a stacked ``QTensor`` holds one block
scale grid and, for NVFP4, one ``weight_scale_2`` per expert, ``[E]``).

What each producer writes when it quantizes such a model (read from the producers' own code):

- **ModelOpt 0.47** (``modelopt/torch/export/moe_utils.py``, ``_export_fused_experts``, called by
  ``hf_export_handlers._export_fused_experts_module`` for every module with
  ``gate_up_proj_weight_quantizers``): UNFUSES. For each expert ``e`` it slices
  ``gate_up_proj[e, :I]`` / ``[e, I:]`` and ``down_proj[e]`` and registers them as
  ``P.{e}.gate_proj``, ``P.{e}.up_proj``, ``P.{e}.down_proj`` with the ordinary per-Linear tensors
  ``weight`` (uint8 ``[out, in/2]``), ``weight_scale`` (E4M3 ``[out, in/16]``), ``weight_scale_2``
  (fp32 ``[]``) and ``input_scale`` (fp32 ``[]``, one input quantizer shared by all experts of a
  projection). gate and up get the SAME ``weight_scale_2``: the amax of the fused
  ``gate_up_proj[e]`` (the fused weight quantizer is calibrated on the fused slice; the
  uncalibrated fallback also takes ``first_proj[idx].abs().amax()`` "so gate and up share the same
  weight_scale_2", because vLLM asserts it). ``exclude_modules``/``quantized_layers`` name the
  per-expert modules. ``unified_export_hf.py`` then reverses only transformers'
  ``conversion_mapping`` renames (``quant_aware_conversion.revert_weight_conversion_quant_aware``);
  a model without one (``muse_spark``) keeps the per-expert keys.
- **AMD Quark 0.13**: the model path replaces every ``@use_experts_implementation`` experts
  class by ``QuarkExperts`` (``quark/torch/utils/llm/module_replacement/quark_experts.py``,
  ``_build_expert_module``), which slices ``gate_up_proj[e]`` at ``I`` into per-expert
  ``nn.Linear`` ``P.{e}.gate_proj`` / ``P.{e}.up_proj`` and ``down_proj[e]`` into ``P.{e}.down_proj``
  and deletes the fused parameters (``_release_source_parameters``); the export then writes the
  usual ``weight`` (uint8) + ``weight_scale`` (uint8 E8M0) per expert Linear. The file-to-file
  path (``quark/torch/quantization/file2file_quantization.py``, ``_is_linear_weight_tensor`` and
  ``_quantized_module_key``) only quantizes names ending ``.weight``: fused ``gate_up_proj`` /
  ``down_proj`` are copied unquantized unless a ``WeightConverter`` splits them first.
- **AutoRound 0.16.1** (``auto_round/modeling/fused_moe/moe_experts_interface.py``,
  ``_unfuse_experts_weights_inplace``, run by ``prepare_model_for_moe_quantization``): splits
  ``gate_up_proj`` into ``gate_proj`` + ``up_proj`` (``chunk(2)`` along the output rows) and
  registers numbered per-expert containers, "state_dict keys like ``{prefix}0.gate_proj.weight``";
  the ``auto_round:auto_gptq`` export writes ``P.{e}.{gate,up,down}_proj.qweight`` / ``qzeros`` /
  ``scales`` / ``g_idx``. Its fusion spec is used only by the GGUF exporter.
- GPT-OSS (transformers' own MXFP4) is the one layout that keeps experts fused with companion
  scales (``gate_up_proj_blocks`` / ``_scales``, see ``gpt_oss.py``); its gate/up rows are
  interleaved, so the gate-then-up split here does not apply to it.

So no producer keeps Muse's fused experts fused once quantized: the writer turns a quantized
fused expert tensor into the producer's per-expert keys (``unfuse``), and the reader reads those
as per-expert logical weights (2-D); BF16 fused tensors stay fused. ``--fuse-experts`` (the
converter's ``fuse_experts``) puts per-expert weights back into the fused layout that
transformers 5 loads, when writing BF16.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from ..qtensor import QTensor, slice_rows
from .errors import CheckpointError
from .safetensors_io import TensorHeader

FUSED_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
Weight = Union[torch.Tensor, QTensor]


def is_fused_expert(name: str) -> bool:
    """Whether ``name`` is a fused 3-D expert weight (``*.experts.gate_up_proj`` / ``*.experts.down_proj``)."""
    return FUSED_EXPERT.match(name) is not None


# The most decoder layers a Muse config may declare (musecore.config.MAX_LAYERS): a bound checked before
# anything is built from num_hidden_layers, so an absurd value is a one-line error, never a hang.
MAX_LAYERS = 1024


def muse_quantized_layers(num_hidden_layers: int) -> range:
    """The layers whose routed experts the Muse releases quantize: ``1..L-2`` (the first and the last
    layer keep BF16 experts)."""
    return range(1, num_hidden_layers - 1)


def muse_rule(num_hidden_layers: int) -> list[str]:
    """The Muse rule as ``include`` regexes: the routed experts of layers ``1..L-2``.

    Matches both the fused names (``layers.{i}.mlp.experts.gate_up_proj`` / ``down_proj``) and the
    per-expert names (``layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``); layers 0 and
    ``L-1`` keep BF16 experts. An empty list (nothing selected) when ``L < 3``.

    Example::

        convert(src, dst, to="nvfp4", include=muse_rule(62))
    """
    if (isinstance(num_hidden_layers, bool) or not isinstance(num_hidden_layers, int)
            or not 1 <= num_hidden_layers <= MAX_LAYERS):
        raise CheckpointError(f"muse_rule needs num_hidden_layers as an int in 1..{MAX_LAYERS}, got "
                              f"{num_hidden_layers!r}")
    layers = muse_quantized_layers(num_hidden_layers)
    if not layers:
        return []
    alt = "|".join(str(i) for i in layers)  # (at most MAX_LAYERS - 2 of them)
    return [rf"(^|\.)layers\.(?:{alt})\.mlp\.experts\.(?:gate_up_proj|down_proj|\d+\.(?:gate|up|down)_proj\.weight)$"]


def num_hidden_layers(config: Mapping) -> int:
    """``num_hidden_layers`` of a (possibly nested, ``text_config``) model config, in ``1..MAX_LAYERS``."""
    for section in (config.get("text_config") or {}, config):
        n = section.get("num_hidden_layers") if isinstance(section, Mapping) else None
        if isinstance(n, int) and not isinstance(n, bool):
            if not 1 <= n <= MAX_LAYERS:
                raise CheckpointError(f"config.json num_hidden_layers is {n}; a Muse config has 1..{MAX_LAYERS} "
                                      "decoder layers: fix num_hidden_layers in config.json (or pass --include "
                                      "patterns instead of the Muse rule)")
            return n
    raise CheckpointError("config.json has no integer num_hidden_layers (nor text_config.num_hidden_layers); "
                          "the Muse rule needs it: pass --include patterns instead")


_DECODER_LAYER = re.compile(r"^(?P<stack>(?:.*\.)?layers)\.(?P<i>\d+)\.(?P<rest>.*)$")


def check_layer_count(layers: int, names: Iterable[str], source: Union[str, Path] = "config.json") -> None:
    """``num_hidden_layers`` (``layers``) against the decoder layers the checkpoint's tensors hold: the
    layers of the stack whose layers hold routed experts (``*.layers.{i}.mlp.experts.*``; not the vision
    or audio towers' ``layers``) must end at ``layers - 1``, or the Muse rule would quantize the wrong
    layers (a config saying 10 over a 6-layer checkpoint would quantize its last layer, which stays BF16).
    Nothing is checked when no layer holds routed experts (the rule then selects nothing)."""
    found: dict[str, set[int]] = {}
    decoders = set()
    for name in names:
        m = _DECODER_LAYER.match(name)
        if m:
            found.setdefault(m["stack"], set()).add(int(m["i"]))
            if m["rest"].startswith("mlp.experts."):
                decoders.add(m["stack"])
    indices = set().union(*(found[s] for s in decoders)) if decoders else set()
    if indices and max(indices) + 1 != layers:
        raise CheckpointError(f"{source}: num_hidden_layers is {layers}, but the checkpoint's tensors hold decoder "
                              f"layers {min(indices)}..{max(indices)}: config.json contradicts the checkpoint, so the "
                              "Muse rule cannot tell which layers keep BF16 experts; fix num_hidden_layers (or use "
                              "the config.json these weights came with), or pass --include patterns",
                              path=source)


# ------------------------------------------------------------------------------ checks
def check_fused_headers(headers: Mapping[str, TensorHeader]) -> None:
    """Rank and shape checks of fused expert tensors read from a checkpoint (one-line errors)."""
    fused: dict[str, dict[str, TensorHeader]] = {}
    for key, h in headers.items():
        m = FUSED_EXPERT.match(key)
        if m:
            fused.setdefault(m["prefix"], {})[m["proj"]] = h
    for prefix, projs in fused.items():
        shapes = {}
        for proj, h in projs.items():
            shapes[proj] = check_fused_shape(h.key, tuple(h.shape), f"{h.file}: ")
        if len(shapes) == 2:
            e, i2, hid = shapes["gate_up_proj"]
            h = projs["down_proj"]
            # transposed layouts (GPT-OSS: gate_up [E, h, 2I], down [E, I, h]) are left to their readers
            if tuple(h.shape) not in ((e, hid, i2 // 2), (e, hid // 2, i2)):
                raise CheckpointError(
                    f"{h.file}: fused expert tensor {h.key!r} has shape {list(h.shape)} but "
                    f"{projs['gate_up_proj'].key!r} is {[e, i2, hid]}; down_proj must be [E, h, I] = "
                    f"{[e, hid, i2 // 2]}: the checkpoint is inconsistent, re-export it", path=h.file, tensor=h.key)


def check_fused_shape(name: str, shape: Sequence[int], where: str = "") -> tuple[int, ...]:
    """A fused expert tensor must be 3-D, and ``gate_up_proj`` must have an even row count (gate, up)."""
    proj = name.rsplit(".", 1)[-1]
    layout = "[E, 2I, h] (gate rows then up rows)" if proj == "gate_up_proj" else "[E, h, I]"
    if len(shape) != 3:
        raise CheckpointError(f"{where}fused expert tensor {name!r} has shape {list(shape)} (rank {len(shape)}); "
                              f"{proj} must be 3-D {layout}", tensor=name)
    if proj == "gate_up_proj" and shape[1] % 2:
        raise CheckpointError(f"{where}fused expert tensor {name!r} has shape {list(shape)}: {shape[1]} rows are "
                              f"odd, so they cannot split into gate and up halves; gate_up_proj is {layout}",
                              tensor=name)
    return tuple(int(s) for s in shape)


def check_fused_qtensor(name: str, qt: QTensor) -> None:
    """The scales of a stacked QTensor must be stacked like its codes: one grid (and global scale) per expert."""
    check_fused_shape(name, qt.shape)
    e = qt.shape[0]
    for what, t in (("data", qt.data), ("scale", qt.scale), ("zero", qt.zero)):
        if t is not None and (t.dim() != 3 or t.shape[0] != e) and not (what == "scale" and qt.format == "fp8"
                                                                          and t.numel() in (1, e)):
            raise CheckpointError(f"fused expert tensor {name!r} ({qt.format}{list(qt.shape)}) has {what} of shape "
                                  f"{list(t.shape)}; expected [E={e}, ...] stacked per expert", tensor=name)
    for what, t in (("global_scale", qt.global_scale), ("input_scale", qt.input_scale)):
        if t is not None and t.numel() not in (1, e):
            raise CheckpointError(f"fused expert tensor {name!r} ({qt.format}{list(qt.shape)}) has {what} of shape "
                                  f"{list(t.shape)}; expected one value per expert ([{e}]) or one in all",
                                  tensor=name)


# ------------------------------------------------------------------------------ unfuse / fuse
def _expert(qt: QTensor, e: int) -> QTensor:
    pick = lambda t: None if t is None else (t.reshape(()) if t.numel() == 1 else t.reshape(-1)[e])  # noqa: E731
    pick_grid = lambda t: None if t is None else t[e]  # noqa: E731
    scale = pick(qt.scale) if (qt.format == "fp8" and qt.scale.dim() < 3) else pick_grid(qt.scale)
    return QTensor(qt.format, data=qt.data[e], scale=scale, shape=qt.shape[1:], group_size=qt.group_size,
                   global_scale=pick(qt.global_scale), zero=pick_grid(qt.zero), input_scale=pick(qt.input_scale),
                   layout=qt.layout)


def unfuse(name: str, value: Weight) -> list[tuple[str, Weight]]:
    """Per-expert 2-D weights of a fused expert tensor, as ModelOpt, Quark and AutoRound export them.

    ``P.gate_up_proj [E, 2I, h]`` -> ``P.{e}.gate_proj.weight`` (rows ``:I``) and ``P.{e}.up_proj.weight``
    (rows ``I:``); ``P.down_proj [E, h, I]`` -> ``P.{e}.down_proj.weight``. QTensors are split without
    requantizing (``slice_rows``): gate and up keep the expert's shared NVFP4 ``weight_scale_2``.
    """
    m = FUSED_EXPERT.match(name)
    if m is None:
        raise CheckpointError(f"weight {name!r} is not a fused expert tensor (*.experts.gate_up_proj or "
                              "*.experts.down_proj)", tensor=name)
    if isinstance(value, QTensor):
        check_fused_qtensor(name, value)
    else:
        check_fused_shape(name, tuple(value.shape))
    prefix, e_count, rows = m["prefix"], value.shape[0], value.shape[1]
    out: list[tuple[str, Weight]] = []
    for e in range(e_count):
        one = _expert(value, e) if isinstance(value, QTensor) else value[e]
        if m["proj"] == "down_proj":
            out.append((f"{prefix}.{e}.down_proj.weight", one))
            continue
        half = rows // 2
        for proj, (a, b) in (("gate_proj", (0, half)), ("up_proj", (half, rows))):
            part = slice_rows(one, a, b) if isinstance(one, QTensor) else one[a:b]
            out.append((f"{prefix}.{e}.{proj}.weight", part))
    return out


def fuse_groups(names: Iterable[str], where: Optional[Mapping[str, str]] = None) -> dict[str, list[str]]:
    """Per-expert weight names grouped under the fused name they make: ``{P.gate_up_proj: [gate_0, up_0,
    gate_1, up_1, ...], P.down_proj: [down_0, ...]}``. Every expert ``0..E-1`` must be present.

    ``where`` (name -> file) is used only for error messages.
    """
    found: dict[str, dict[int, dict[str, str]]] = {}
    for n in names:
        m = PER_EXPERT.match(n)
        if m:
            found.setdefault(m["prefix"], {}).setdefault(int(m["e"]), {})[m["proj"]] = n
    groups: dict[str, list[str]] = {}
    for prefix, experts in found.items():
        count = max(experts) + 1
        for fused, projs in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            members = []
            for e in range(count):
                for p in projs:
                    n = experts.get(e, {}).get(p)
                    if n is None:
                        file = (where or {}).get(next(iter(next(iter(experts.values())).values())), "")
                        raise CheckpointError(
                            f"{file}{': ' if file else ''}cannot fuse the experts of {prefix!r}: "
                            f"{prefix}.{e}.{p}.weight is missing (experts 0..{count - 1} needed); pass "
                            "fuse_experts=False (--no-fuse-experts) to keep per-expert weights", tensor=prefix)
                    members.append(n)
            groups[f"{prefix}.{fused}"] = members
    return groups


def fuse(name: str, members: Sequence[tuple[str, torch.Tensor]], where: Optional[Mapping[str, str]] = None
         ) -> torch.Tensor:
    """Stack per-expert 2-D tensors (in ``fuse_groups`` order) into the fused 3-D tensor ``name``."""
    first_name, first = members[0]
    for n, t in members:
        if t.dim() != 2 or t.shape[1] != first.shape[1] or t.shape[0] != first.shape[0] or t.dtype != first.dtype:
            file = (where or {}).get(n, "")
            raise CheckpointError(
                f"{file}{': ' if file else ''}cannot fuse {n!r} ({t.dtype}{list(t.shape)}) into {name!r}: it "
                f"differs from {first_name!r} ({first.dtype}{list(first.shape)}); every expert projection must "
                "have one shape and dtype", tensor=n)
    if name.endswith(".gate_up_proj"):
        pairs = [torch.cat([members[i][1], members[i + 1][1]]) for i in range(0, len(members), 2)]
        return torch.stack(pairs)
    return torch.stack([t for _, t in members])
