"""Muse Spark tensor names: which checkpoint tensor is what, in one place (MODEL.md section 3).

The plan groups weights by these rules, the loader routes tensors by them, the converter and the
calibrators select the routed experts by them. A rule about a tensor *name* lives here and nowhere
else in ``musecore``; the checkpoint-layout regexes that ``musecore_quant`` needs without the model
graph (fused and per-expert expert keys, the Muse quantization rule) live in
``musecore_quant.checkpoint.experts`` and are imported from there, not restated.

Example::

    from musecore import names
    names.weight_group("model.language_model.layers.3.mlp.experts.gate_up_proj", config)
    # -> ("experts (quantized layers)", True)
    names.expert_weight("model.language_model.layers.3.mlp.experts.5.up_proj.weight")
    # -> ExpertWeightName(layer=3, expert=5, proj="up_proj")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from musecore_quant.checkpoint.experts import FUSED_EXPERT, PER_EXPERT, muse_quantized_layers, muse_rule

PREFIX = "model.language_model."  # the text decoder's tensors (transformers' MuseSparkForConditionalGeneration)

# The multimodal towers (MODEL.md section 2; musecore.towers). "vision" is the vision tower with its
# adapter and projection to the text width (all of them or none); "audio" the audio tower. A tower the
# plan does not load (musecore.planning.plan_towers) is skipped by the loader, its bytes never read.
VISION, AUDIO = "vision", "audio"
VISION_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.")
AUDIO_PREFIXES = ("model.audio_tower.",)
TOWER_PREFIXES = VISION_PREFIXES + AUDIO_PREFIXES

# Tensors kept in fp32 whatever the checkpoint dtype (transformers' _keep_in_fp32_modules_strict).
FP32_TENSORS = (".post_attention_residual_gate.gate", ".post_feedforward_residual_gate.gate", ".mlp.gate.weight",
                ".mlp.gate.e_score_correction_bias")

# Projections that read one input and may run as one stacked linear (musecore.loader.fuse_group).
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "gate_proj")  # all read the normed input
DENSE_MLP_INPUTS = ("gate_proj", "up_proj")
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")       # one routed expert's SwiGLU
FUSED_EXPERT_TENSORS = ("gate_up_proj", "down_proj")             # transformers' 3-D expert tensors

# Weight groups, as the plan names them.
EXPERTS_QUANTIZED = "experts (quantized layers)"
EXPERTS_BF16 = "experts (BF16 layers)"
EMBEDDING = "embedding"
LM_HEAD = "lm_head"
ATTENTION = "attention"
ROUTER = "router"
POOLER = "pooler/unpooler"
DENSE_MLP = "dense MLP"
NORMS = "norms and gates"
TOWERS = "vision/audio towers (not loaded)"
TOWER_GROUPS = {VISION: "vision tower", AUDIO: "audio tower"}  # the groups of a loaded tower's tensors

# Dense projections that ``quantize_dense=True`` converts like the routed experts (the router, the
# embedding, norms and the BF16 expert layers stay as they are: small, or sensitive to rounding).
DENSE_QUANTIZABLE = (ATTENTION, POOLER, LM_HEAD, DENSE_MLP)

# ``mlp_layer_types`` values: a dense SwiGLU MLP, or routed experts (MoE).
MLP_LAYER_TYPES = DENSE_LAYER, SPARSE_LAYER = ("dense", "sparse")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_DENSE_MLP_WEIGHT = re.compile(r"\.mlp\.(gate|up|down)_proj\.weight$")


def is_tower_tensor(name: str) -> bool:
    return name.startswith(TOWER_PREFIXES)


def tower_of(name: str) -> Optional[str]:
    """``"vision"`` or ``"audio"`` for a tower tensor (adapter and projection count as vision), else None."""
    if name.startswith(VISION_PREFIXES):
        return VISION
    return AUDIO if name.startswith(AUDIO_PREFIXES) else None


def is_fp32_tensor(name: str) -> bool:
    return name.endswith(FP32_TENSORS)


def layer_of(name: str) -> Optional[int]:
    """The decoder layer a tensor belongs to, or None (embedding, final norm, lm_head, towers)."""
    m = None if is_tower_tensor(name) else _LAYER.search(name)
    return int(m[1]) if m else None


def experts_prefix(layer: int) -> str:
    """The name prefix of layer ``layer``'s routed experts (``...layers.3.mlp.experts``)."""
    return f"{PREFIX}layers.{layer}.mlp.experts"


def per_expert_name(prefix: str, expert: int, proj: str) -> str:
    """A producer's per-expert key: ``{prefix}.{expert}.{proj}.weight`` (``proj``: ``gate_proj``...)."""
    return f"{prefix}.{expert}.{proj}.weight"


def expert_key(name: str) -> Optional[tuple[str, int, str]]:
    """``(experts prefix, expert, "gate"|"up"|"down")`` for a producer's per-expert key (ModelOpt, Quark
    and AutoRound unfuse experts on export; the name rule is musecore_quant's), else None."""
    m = PER_EXPERT.match(name)
    return (m["prefix"], int(m["e"]), m["proj"].removesuffix("_proj")) if m else None


def fused_expert_parts(name: str) -> Optional[tuple[str, str]]:
    """``(experts prefix, "gate_up_proj"|"down_proj")`` for a fused expert tensor, else None."""
    m = FUSED_EXPERT.match(name)
    return (m["prefix"], m["proj"]) if m else None


def fused_expert_name(prefix: str, proj: str) -> str:
    """The fused tensor a per-expert projection belongs to: ``gate``/``up`` -> ``gate_up_proj``."""
    return f"{prefix}.{'down_proj' if proj == 'down' else 'gate_up_proj'}"


@dataclass(frozen=True)
class ExpertWeightName:
    """A routed expert weight's name, parsed: per expert (``expert`` set, ``proj`` one of
    :data:`EXPERT_PROJECTIONS`) or fused (``expert`` None, ``proj`` one of :data:`FUSED_EXPERT_TENSORS`)."""

    layer: int
    expert: Optional[int]
    proj: str

    @property
    def fused(self) -> bool:
        return self.expert is None


def expert_weight(name: str) -> Optional[ExpertWeightName]:
    """The routed expert projection ``name`` names (fused or per expert), else None (the shared
    post-expert norm is not an expert weight)."""
    m = PER_EXPERT.match(name) or FUSED_EXPERT.match(name)
    layer = layer_of(name)
    if m is None or layer is None:
        return None
    expert = m.groupdict().get("e")
    return ExpertWeightName(layer, None if expert is None else int(expert), m["proj"])


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Whether ``layer`` has routed experts (``mlp_layer_types[layer] == "sparse"``) or a dense MLP."""
    return config.mlp_layer_types[layer] == SPARSE_LAYER


def sparse_layers(config: Any) -> list[int]:
    """The layers with routed experts."""
    return [i for i in range(config.num_hidden_layers) if is_sparse_layer(config, i)]


def quantized_expert_layers(config: Any) -> list[int]:
    """The sparse layers whose routed experts the quantized releases quantize (musecore_quant's Muse
    rule: all but the first and the last layer)."""
    quantized = muse_quantized_layers(config.num_hidden_layers)
    return [i for i in sparse_layers(config) if i in quantized]


def bf16_expert_layers(config: Any) -> list[int]:
    """The sparse layers whose routed experts the quantized releases keep in BF16."""
    quantized = set(quantized_expert_layers(config))
    return [i for i in sparse_layers(config) if i not in quantized]


def quantized_expert_patterns(config: Any) -> list[str]:
    """``include`` regexes selecting the expert tensors MODEL.md quantizes (musecore_quant's Muse rule)."""
    return muse_rule(config.num_hidden_layers)


def expert_patterns(layers: Iterable[int]) -> list[str]:
    """``include`` regexes selecting every routed expert weight (fused or per expert) of ``layers``."""
    alt = "|".join(str(i) for i in layers)
    return [rf"{re.escape(PREFIX)}layers\.({alt})\.mlp\.experts\."
            r"(gate_up_proj|down_proj|\d+\.(gate|up|down)_proj\.weight)$"]


def weight_group(name: str, config: Any) -> tuple[str, bool]:
    """(group label, whether it is a routed-expert projection of a quantized layer).

    Routed experts come fused (``experts.gate_up_proj`` / ``experts.down_proj``, transformers' layout)
    or per expert (``experts.{e}.gate_proj.weight``, how some producers export them).
    """
    if is_tower_tensor(name):
        return TOWERS, False
    expert = expert_weight(name)
    if expert is not None:
        if expert.layer not in quantized_expert_layers(config):
            return EXPERTS_BF16, False
        return EXPERTS_QUANTIZED, True
    if ".mlp.experts." in name:  # the shared post-expert norm
        return NORMS, False
    if "embed_tokens" in name:
        return EMBEDDING, False
    if name.startswith("lm_head"):
        return LM_HEAD, False
    if ".self_attn." in name and name.endswith("_proj.weight"):
        return ATTENTION, False
    if ".mlp.gate." in name:
        return ROUTER, False
    if name.endswith(("pre_expert_proj.weight", "post_expert_proj.weight")):
        return POOLER, False
    if _DENSE_MLP_WEIGHT.search(name):
        return DENSE_MLP, False
    return NORMS, False


def projection_of(name: str) -> str:
    """The module a weight belongs to: ``q_proj``, ``pre_expert_proj``, ``gate_up_proj``, ``lm_head``..."""
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "gate", "e_score_correction_bias") else parts[-1]


def fusable_projections(group: str) -> tuple[str, ...]:
    """The projections of a group's block that read one input and may run as one stacked linear."""
    return {ATTENTION: ATTENTION_INPUTS, DENSE_MLP: DENSE_MLP_INPUTS}.get(group, ())


def op_of_weight(name: str) -> Optional[str]:
    """The op that takes weight ``name``: ``"moe"`` (routed experts), ``"linear"`` (every other
    projection and lm_head), ``"embedding"``, or None (norms, gates, the router: placed as vectors;
    the towers' tensors: not run)."""
    if is_tower_tensor(name):
        return None
    if expert_weight(name) is not None:
        return "moe"
    if name.endswith("_proj.weight") or name.startswith("lm_head"):
        return "linear"
    if "embed_tokens" in name:
        return "embedding"
    return None
