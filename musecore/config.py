"""``MuseConfig``: Muse Spark Open's configuration, read and written as transformers' nested ``config.json``.

The model is the one Hugging Face transformers 5.24 defines (``muse_spark``; MODEL.md): a
``MuseSparkConfig`` holding a ``text_config`` (the decoder musecore runs), a ``vision_config``, an
``audio_config`` and the multimodal token ids. ``MuseConfig`` keeps the text decoder's fields flat
(``config.hidden_size``: every part of musecore reads them) and the towers' configs as dicts with
transformers' defaults filled in; ``to_dict`` writes the nested layout back, so a config that
musecore writes loads in transformers and the reverse. Unknown keys are kept and written back
unchanged, at the level they came from. Every default below is transformers'.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from musecore import names
from musecore.names import MLP_LAYER_TYPES

FULL, SLIDING = "full_attention", "sliding_attention"
DENSE_MLP, SPARSE_MLP = MLP_LAYER_TYPES

# transformers' MuseSparkVisionConfig / MuseSparkAudioConfig defaults (musecore.towers reads them; unknown
# keys are kept so that a checkpoint's config.json survives a round trip unchanged).
VISION_DEFAULTS: dict[str, Any] = {
    "model_type": "muse_spark_vision", "patch_size": 14, "pos_emb_height": 32, "pos_emb_width": 32,
    "num_attention_heads": 16, "num_hidden_layers": 50, "hidden_size": 1536, "intermediate_size": 8960,
    "hidden_act": "gelu", "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
    "patch_temporal": 2, "merge_size": 2, "max_position_embeddings": 1024, "layer_norm_eps": 1e-5,
}
AUDIO_DEFAULTS: dict[str, Any] = {
    "model_type": "muse_spark_audio", "patch_sizes": [16, 6, 5, 4], "hidden_sizes": [256, 512, 1024, 2048],
    "depths": [2, 2, 2, 2], "num_hidden_layers": 4, "mlp_ratio": 4.0, "conv_kernel_size": 7,
    "hidden_act": "gelu", "rms_norm_eps": 1e-6, "out_hidden_size": 8192, "initializer_range": 0.02,
}
# Keys of the outer MuseSparkConfig (besides the three sub-configs) and their defaults.
OUTER_DEFAULTS: dict[str, Any] = {
    "image_token_id": 200092, "video_token_id": 200091, "audio_token_id": 200038,
    "out_hidden_size": 6144, "projector_hidden_size": 4096, "projector_hidden_act": "gelu",
}
# Every key of the outer config that MuseConfig holds as a field (the rest of the outer keys go to ``extra``).
OUTER_KEYS = frozenset(OUTER_DEFAULTS) | {"vision_config", "audio_config", "quantization_config"}
SUPPORTED_ROPE_TYPES = ("default", "yarn")

# -- the schema ------------------------------------------------------------------------------------
# Every field's type and range, checked before anything is built from the config. The upper bounds
# are generous multiples of any released model; they exist so that an absurd value is a one-line
# error in milliseconds instead of a MemoryError (or a hang) later.
INT32_MAX = 2**31 - 1      # token ids, positions and sizes are indexed with 32-bit integers by kernels
MAX_LAYERS = 1024          # planning and the model build Python objects per layer (~10 KB each)
MAX_EXPERTS = 65_536       # the router keeps [tokens, experts] fp32 scores per step
MAX_HEAD_DIM = 65_536      # the rotary table is built per head dimension
MAX_HEADS = 65_536
MAX_CONFIG_BYTES = 2**24   # a config.json is a few KB
MAX_WEIGHT_BYTES = 2**50   # 1 PiB of BF16 weights: ~600x the 816B model, more than any host or cluster loads
INT_FIELDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, INT32_MAX), "hidden_size": (1, INT32_MAX), "intermediate_size": (1, INT32_MAX),
    "num_hidden_layers": (1, MAX_LAYERS), "num_attention_heads": (1, MAX_HEADS),
    "num_key_value_heads": (1, MAX_HEADS), "head_dim": (2, MAX_HEAD_DIM), "max_position_embeddings": (1, INT32_MAX),
    "sliding_window": (1, INT32_MAX), "moe_intermediate_size": (1, INT32_MAX), "num_local_experts": (1, MAX_EXPERTS),
    "num_experts_per_tok": (1, MAX_EXPERTS), "moe_hidden_size": (1, INT32_MAX),
    "image_token_id": (0, INT32_MAX), "video_token_id": (0, INT32_MAX), "audio_token_id": (0, INT32_MAX),
    "out_hidden_size": (1, INT32_MAX), "projector_hidden_size": (1, INT32_MAX),
}
# name -> (lowest, whether the lowest itself is allowed, highest or None); every value must be finite.
NUMBER_FIELDS: dict[str, tuple[float, bool, Optional[float]]] = {
    "rms_norm_eps": (0.0, False, 1.0), "post_norm_eps": (0.0, False, 1.0), "initializer_range": (0.0, True, None),
    "attention_dropout": (0.0, True, 1.0), "final_logit_softcapping": (1.0, True, None),
    "qk_scale_factor": (0.0, False, None), "output_multiplier": (0.0, False, None),
    "residual_gate_temperature": (0.0, False, None), "routed_scaling_factor": (0.0, False, None),
}
BOOL_FIELDS = ("use_cache", "tie_word_embeddings", "attention_bias", "output_router_logits")
STR_FIELDS = ("hidden_act", "projector_hidden_act")
DICT_FIELDS = ("rope_parameters", "vision_config", "audio_config")
# Which config.json fields a checkpoint tensor's shape comes from (first matching name fragment wins).
SHAPE_FIELDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("embed_tokens.", ("vocab_size", "hidden_size")), ("lm_head.", ("vocab_size", "hidden_size")),
    ("self_attn.", ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size")),
    ("mlp.experts.", ("num_local_experts", "moe_intermediate_size", "moe_hidden_size")),
    ("mlp.gate.", ("num_local_experts", "hidden_size")),
    ("_expert_proj.", ("moe_hidden_size", "hidden_size")), ("pre_expert_norm.", ("moe_hidden_size",)),
    ("mlp.", ("intermediate_size", "hidden_size")),
)
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 2, 40, 40, 4, 4


class ConfigError(ValueError):
    """A config.json field with the wrong type, out of range, or contradicting another field (one line)."""

    def __init__(self, field: str, problem: str, *value: Any, source: str = "invalid Muse config") -> None:
        self.field, self.problem, self.value = field, problem, value
        got = f", got {_short(value[0])}" if value else ""
        super().__init__(f"{source}: {_label(field)} {problem}{got}; fix {_label(field)} in config.json")

    def at(self, source: str) -> "ConfigError":
        """The same error, naming the file it came from instead of "invalid Muse config"."""
        return ConfigError(self.field, self.problem, *self.value, source=source)


def _label(field: str) -> str:
    """The field as config.json nests it: ``text_config.x`` for the decoder's fields."""
    return field if field.split(".")[0] in OUTER_KEYS else f"text_config.{field}"


def _short(value: Any) -> str:
    """repr of user data, bounded in length and depth (a deeply nested value never recurses)."""
    return _REPR.repr(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_scalars(config: Any) -> None:
    """Types and ranges of every scalar field and of ``rope_parameters`` (:data:`INT_FIELDS`, ...)."""
    for name, (low, high) in INT_FIELDS.items():
        value = getattr(config, name)
        if not _is_int(value) or not low <= value <= high:
            kind = "a positive integer" if low == 1 else f"an integer >= {low}"
            raise ConfigError(name, f"must be {kind} (at most {high})", value)
    for name, (low, low_ok, high) in NUMBER_FIELDS.items():
        value = getattr(config, name)
        ok = _is_number(value) and math.isfinite(value) and (value >= low if low_ok else value > low)
        if not ok or (high is not None and value >= high):
            kind = "a positive finite number" if (low, low_ok) == (0.0, False) else f"a finite number >= {low}"
            raise ConfigError(name, f"must be {kind}" + (f" below {high}" if high is not None else ""), value)
    for name in BOOL_FIELDS:
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(name, "must be true or false", getattr(config, name))
    for name in STR_FIELDS:
        if not isinstance(getattr(config, name), str):
            raise ConfigError(name, "must be a string", getattr(config, name))
    for name in DICT_FIELDS:
        if not isinstance(getattr(config, name), dict):
            raise ConfigError(name, "must be an object", getattr(config, name))
    if config.quantization_config is not None and not isinstance(config.quantization_config, dict):
        raise ConfigError("quantization_config", "must be an object or absent", config.quantization_config)
    for name in ("layer_types", "mlp_layer_types", "layer_rope_theta"):
        value = getattr(config, name)
        if value is not None and not isinstance(value, list):
            raise ConfigError(name, "must be a list with one entry per layer", value)
    check_rope_parameters(config.rope_parameters)


def check_rope_parameters(params: Any) -> None:
    """``rope_parameters``: a supported ``rope_type``, a finite ``rope_theta`` > 1, and for YaRN a
    ``factor`` >= 1 (transformers' rule) and finite optional parameters."""
    if not isinstance(params, dict):
        raise ConfigError("rope_parameters", "must be an object such as {\"rope_type\": \"default\", "
                          "\"rope_theta\": 500000.0}", params)
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError("rope_parameters.rope_type", f"{_short(rope_type)} is not supported; musecore implements "
                          f"{list(SUPPORTED_ROPE_TYPES)}")
    theta = params.get("rope_theta")
    if not (_is_number(theta) and math.isfinite(theta) and theta > 1):
        raise ConfigError("rope_parameters.rope_theta", "must be a finite number > 1 (the RoPE base)", theta)
    if rope_type != "yarn":
        return
    factor = params.get("factor")
    if not (_is_number(factor) and math.isfinite(factor) and factor >= 1):
        raise ConfigError("rope_parameters.factor", "must be a finite number >= 1 for YaRN (the context extension)",
                          factor)
    for key in ("beta_fast", "beta_slow", "attention_factor"):
        value = params.get(key)
        if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
            raise ConfigError(f"rope_parameters.{key}", "must be a positive finite number or absent", value)
    original = params.get("original_max_position_embeddings")
    if original is not None and not (_is_int(original) and 0 < original <= INT32_MAX):
        raise ConfigError("rope_parameters.original_max_position_embeddings", "must be a positive integer or absent",
                          original)


def check_audio_sizes(audio_config: dict[str, Any]) -> None:
    """What ``audio_shapes`` computes the audio tower's tensors from, checked before anything iterates
    over it: ``depths`` (conv blocks per stage) positive integers adding up to at most :data:`MAX_LAYERS`
    (a depth of 10**9 would build a billion blocks' names and hang), ``mlp_ratio`` a positive finite number."""
    depths = audio_config.get("depths")
    if not isinstance(depths, (list, tuple)) or not all(_is_int(d) and 1 <= d <= MAX_LAYERS for d in depths):
        raise ConfigError("audio_config.depths", f"must be a list of positive integers (conv blocks per stage, at "
                          f"most {MAX_LAYERS} each)", depths)
    if sum(depths) > MAX_LAYERS:
        raise ConfigError("audio_config.depths", f"add up to {sum(depths)} conv blocks, over musecore's limit of "
                          f"{MAX_LAYERS}; a real audio tower has a few", depths)
    ratio = audio_config.get("mlp_ratio")
    if not (_is_number(ratio) and math.isfinite(ratio) and ratio > 0):
        raise ConfigError("audio_config.mlp_ratio", "must be a positive finite number", ratio)


def weight_bytes(config: Any) -> int:
    """Bytes of the text decoder's weights in BF16, in closed form (no per-layer loop, nothing built):
    what :func:`check_budget` bounds before any list or tensor is made from the config."""
    H, V, d, L = config.hidden_size, config.vocab_size, config.head_dim, config.num_hidden_layers
    nq, nkv, E = config.num_attention_heads, config.num_key_value_heads, config.num_local_experts
    h, inter = config.moe_hidden_size, config.moe_intermediate_size
    kinds = config.mlp_layer_types
    sparse = sum(1 for t in kinds if t == SPARSE_MLP) if isinstance(kinds, list) and len(kinds) == L else L
    attention = 3 * H * nq * d + 2 * H * nkv * d
    per_sparse = E * H + 2 * H * h + 2 * h + E * 3 * h * inter
    per_dense = 3 * H * config.intermediate_size
    parameters = 2 * V * H + H + L * (attention + 5 * H) + sparse * per_sparse + (L - sparse) * per_dense
    return 2 * parameters


def check_budget(config: Any) -> None:
    """The memory budget: the weights this config describes, at BF16, must not exceed
    :data:`MAX_WEIGHT_BYTES`. Computed from the (already range-checked) fields alone."""
    need = weight_bytes(config)
    if need > MAX_WEIGHT_BYTES:
        sizes = {k: getattr(config, k) for k in ("num_hidden_layers", "num_local_experts", "hidden_size",
                                                   "moe_intermediate_size", "vocab_size", "head_dim")}
        largest = max(sizes, key=lambda k: sizes[k] / max(1, INT_FIELDS[k][1]))
        raise ConfigError(largest, f"makes the model's BF16 weights {need / 2**50:.3g} PiB, over musecore's "
                          f"budget of {MAX_WEIGHT_BYTES / 2**50:.0f} PiB (sizes: {sizes}); a real Muse checkpoint "
                          "is far smaller: check these sizes")



@dataclass
class MuseConfig:
    """The text decoder's hyperparameters (transformers' ``MuseSparkTextConfig``) plus the outer config.

    Example::

        config = MuseConfig.from_pretrained("path/to/checkpoint")    # nested config.json
        config = MuseConfig.from_name("muse-tiny")                   # a preset
        config.num_parameters(), config.num_active_parameters()
    """

    vocab_size: int = 202_048
    hidden_size: int = 8192
    intermediate_size: int = 16384          # dense-MLP layers
    num_hidden_layers: int = 62
    num_attention_heads: int = 128
    num_key_value_heads: int = 16
    head_dim: int = 64
    max_position_embeddings: int = 1_048_576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, list[int]]] = 200_001
    bos_token_id: Optional[int] = 200_000
    tie_word_embeddings: bool = False
    rope_parameters: Optional[dict[str, Any]] = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    sliding_window: int = 2048
    layer_types: Optional[list[str]] = None
    final_logit_softcapping: float = 20.0
    qk_scale_factor: float = 5.4730064863875
    output_multiplier: float = 0.1767766952966369
    post_norm_eps: float = 1e-8
    layer_rope_theta: Optional[list[float]] = None
    hidden_act: str = "silu"
    moe_intermediate_size: int = 4096
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    routed_scaling_factor: float = 1.0
    moe_hidden_size: int = 4096
    mlp_layer_types: Optional[list[str]] = None
    residual_gate_temperature: float = 0.3
    output_router_logits: bool = False
    # -- the outer MuseSparkConfig ---------------------------------------------------------------
    image_token_id: int = OUTER_DEFAULTS["image_token_id"]
    video_token_id: int = OUTER_DEFAULTS["video_token_id"]
    audio_token_id: int = OUTER_DEFAULTS["audio_token_id"]
    out_hidden_size: int = OUTER_DEFAULTS["out_hidden_size"]
    projector_hidden_size: int = OUTER_DEFAULTS["projector_hidden_size"]
    projector_hidden_act: str = OUTER_DEFAULTS["projector_hidden_act"]
    vision_config: dict[str, Any] = field(default_factory=dict)
    audio_config: dict[str, Any] = field(default_factory=dict)
    quantization_config: Optional[dict[str, Any]] = None
    extra: dict[str, Any] = field(default_factory=dict)       # unknown outer keys, kept verbatim
    text_extra: dict[str, Any] = field(default_factory=dict)  # unknown text_config keys, kept verbatim

    def __post_init__(self) -> None:
        # Scalars and the memory budget first: the per-layer lists below are as long as
        # num_hidden_layers, so an absurd value must be refused before they are built.
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 500_000.0}
        check_scalars(self)
        check_budget(self)
        L = self.num_hidden_layers
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [SPARSE_MLP] * L
        # Full attention (and NoPE) on every 4th layer counted back from the last, sliding otherwise.
        if self.layer_types is None:
            self.layer_types = [FULL if (L - 1 - i) % 4 == 0 else SLIDING for i in range(L)]
        if self.layer_rope_theta is None:
            theta = self.rope_parameters.get("rope_theta", 500_000.0)
            self.layer_rope_theta = [0 if (L - 1 - i) % 4 == 0 else theta for i in range(L)]
        self.vision_config = {**VISION_DEFAULTS, **self.vision_config}
        if "layer_types" not in self.vision_config:
            n = self.vision_config["num_hidden_layers"]
            if not _is_int(n) or not 0 < n <= MAX_LAYERS:
                raise ConfigError("vision_config.num_hidden_layers", f"must be an integer in 1..{MAX_LAYERS}", n)
            self.vision_config["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 or i == n - 1
                                                 else "window_attention" for i in range(n)]
        # The audio features are spliced into the text embeddings: their width defaults to the text width.
        self.audio_config = {**AUDIO_DEFAULTS, "out_hidden_size": self.hidden_size, **self.audio_config}
        self.validate()

    def validate(self) -> None:
        """Every field against the schema (:data:`INT_FIELDS`, :data:`NUMBER_FIELDS`, ...), the memory
        budget, and the relations between fields; raises :class:`ConfigError` naming the field."""
        check_scalars(self)
        check_budget(self)
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("hidden_size", f"({self.hidden_size}) must be a multiple of num_attention_heads "
                              f"({self.num_attention_heads}), as transformers requires")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads", f"({self.num_attention_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ConfigError("head_dim", "must be even for rotary embeddings", self.head_dim)
        if not 0 < self.num_experts_per_tok <= self.num_local_experts:
            raise ConfigError("num_experts_per_tok", f"({self.num_experts_per_tok}) must be in 1..num_local_experts "
                              f"({self.num_local_experts})")
        L = self.num_hidden_layers
        for name, allowed in (("layer_types", (FULL, SLIDING)), ("mlp_layer_types", (DENSE_MLP, SPARSE_MLP)),
                              ("layer_rope_theta", None)):
            values = getattr(self, name)
            if not isinstance(values, list) or len(values) != L:
                raise ConfigError(name, f"has {len(values) if isinstance(values, list) else _short(values)} "
                                  f"entries but num_hidden_layers is {L}; give one entry per layer")
            if allowed is None:
                bad = [v for v in values if not _is_number(v) or not math.isfinite(v) or v < 0]
                if bad:
                    raise ConfigError(name, "entries must be finite numbers >= 0 (0 = no RoPE)", bad[:3])
                continue
            unknown = [v for v in values if not isinstance(v, str) or v not in allowed]
            if unknown:
                raise ConfigError(name, f"lists unknown {name} {_short(unknown[:3])}; expected one of {list(allowed)}")
        check_rope_parameters(self.rope_parameters)
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= INT32_MAX):
                raise ConfigError(name, "must be null or a token id (an integer >= 0)", value)
        eos = self.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(_is_int(t) and 0 <= t <= INT32_MAX for t in eos_ids):
            raise ConfigError("eos_token_id", "must be null, a token id or a list of token ids (integers >= 0)", eos)
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings", "must be false: Muse Spark does not tie embeddings")
        if self.attention_bias:
            raise ConfigError("attention_bias", "must be false: musecore's attention has no biases, as Muse Spark")
        if self.hidden_act != "silu":
            raise ConfigError("hidden_act", f"{self.hidden_act!r} is not supported; Muse Spark's experts use 'silu'")
        check_audio_sizes(self.audio_config)
        if self.audio_config.get("out_hidden_size") != self.hidden_size:
            raise ConfigError("audio_config.out_hidden_size", f"({_short(self.audio_config.get('out_hidden_size'))})"
                              f" must equal hidden_size ({self.hidden_size}): audio features are spliced into the "
                              "text embeddings")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "MuseConfig":
        """From transformers' nested layout (``text_config`` inside); a flat text config is accepted too."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
        data = dict(data)
        model_type = data.get("model_type")
        if model_type not in ("muse_spark", "muse_spark_text"):
            raise ValueError(f"{source}: model_type is {_short(model_type)}, not 'muse_spark'; this is not a Muse "
                             "Spark config.json (musecore runs transformers' muse_spark model)")
        if model_type == "muse_spark":
            text = data.pop("text_config", None)
            if not isinstance(text, dict):
                raise ValueError(f"{source}: a muse_spark config.json needs a text_config object (transformers' "
                                 "nested layout)")
            outer = data
        else:  # a bare text config
            text, outer = data, {}
        text = {k: v for k, v in text.items() if k != "model_type"}
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "text_extra"}
        known = {k: v for k, v in text.items() if k in names and k not in OUTER_KEYS}
        text_extra = {k: v for k, v in text.items() if k not in known}
        known.update({k: v for k, v in outer.items() if k in OUTER_KEYS and v is not None})
        extra = {k: v for k, v in outer.items() if k not in OUTER_KEYS and k != "model_type"}
        for sub in ("vision_config", "audio_config"):
            if sub in known and not isinstance(known[sub], dict):
                raise ValueError(f"{source}: {sub} must be an object, got {type(known[sub]).__name__}")
        try:
            return cls(**known, extra=extra, text_extra=text_extra)
        except ConfigError as e:
            raise e.at(source) from None

    @classmethod
    def from_pretrained(cls, path: Union[str, Path]) -> "MuseConfig":
        """Read ``config.json`` from a checkpoint folder (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}; a checkpoint folder needs config.json")
        size = file.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ValueError(f"{file} is {size} bytes, over the {MAX_CONFIG_BYTES} a config.json may have; "
                             "re-download or re-export the checkpoint")
        try:
            data = json.loads(file.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{file} is not valid JSON ({e}); re-download or re-export the checkpoint") from None
        except RecursionError:
            raise ValueError(f"{file} nests JSON too deeply to be a config; re-download or re-export the "
                             "checkpoint") from None
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_name(cls, name: str) -> "MuseConfig":
        """A preset: ``muse-tiny``, ``muse-small`` or ``muse-spark-open-816b-a42b``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    def text_dict(self) -> dict[str, Any]:
        skip = OUTER_KEYS | {"extra", "text_extra"}
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        return {"model_type": "muse_spark_text", **data, **self.text_extra}

    def to_dict(self) -> dict[str, Any]:
        """transformers' nested ``MuseSparkConfig`` layout."""
        data: dict[str, Any] = {"model_type": "muse_spark", "text_config": self.text_dict(),
                                "vision_config": dict(self.vision_config), "audio_config": dict(self.audio_config)}
        data.update({k: getattr(self, k) for k in OUTER_DEFAULTS})
        if self.quantization_config is not None:
            data["quantization_config"] = self.quantization_config
        return {**data, **self.extra}

    def save_pretrained(self, folder: Union[str, Path]) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        file = folder / "config.json"
        file.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return file

    def check_tensor_shapes(self, shapes: dict[str, tuple[int, ...]], source: str = "config.json") -> None:
        """The checkpoint's tensor shapes (from the safetensors headers: no weight read) against the
        shapes this config implies, as the loader checks them while reading, so that ``plan`` refuses a
        config.json that contradicts its weights. Raises ``CheckpointMismatch`` naming the tensor and
        the config.json fields its shape comes from. ``source``: the config.json path, for messages."""
        from musecore.loader import CheckpointMismatch
        from musecore.model import checkpoint_shapes
        from musecore.names import expert_key, fused_expert_name, is_tower_tensor

        self.check_tower_shapes(shapes, source)
        expected = checkpoint_shapes(self)
        seen: set[str] = set()
        per_expert: dict[str, set[tuple[int, str]]] = {}
        for name, shape in shapes.items():
            if is_tower_tensor(name):
                continue
            shape, key = tuple(shape), expert_key(name)
            if key is not None:
                prefix, e, proj = key
                fused = fused_expert_name(prefix, proj)
                if fused not in expected:
                    raise CheckpointMismatch(f"{source}: unexpected tensor {name!r}: its layer has no routed "
                                             f"experts in this config; fix {_label('mlp_layer_types')} or "
                                             f"{_label('num_hidden_layers')} in config.json")
                E, rows, cols = expected[fused]
                want = (rows // 2, cols) if proj != "down" else (rows, cols)
                if not 0 <= e < E:
                    raise CheckpointMismatch(f"{source}: the checkpoint has expert {e} ({name!r}), but "
                                             f"{_label('num_local_experts')} is {E}; fix it in config.json")
                if shape != want:
                    raise CheckpointMismatch(self._shape_message(source, name, shape, want))
                per_expert.setdefault(fused, set()).add((e, proj))
                continue
            if name not in expected:
                raise CheckpointMismatch(f"{source}: unexpected tensor {name!r}: a Muse Spark model with this config "
                                         "does not have it; check that config.json belongs to these weights "
                                         f"({_label('num_hidden_layers')}, {_label('mlp_layer_types')})")
            if shape != expected[name]:
                raise CheckpointMismatch(self._shape_message(source, name, shape, expected[name]))
            seen.add(name)
        for prefix in {fused.rsplit(".", 1)[0] for fused in per_expert}:  # as the loader: a layer's experts
            gate_up, down = fused_expert_name(prefix, "gate"), fused_expert_name(prefix, "down")  # count once all
            if len(per_expert.get(gate_up, ())) + len(per_expert.get(down, ())) == 3 * expected[down][0]:  # arrived
                seen.update((gate_up, down))
        missing = sorted(set(expected) - seen)
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointMismatch(f"{source}: missing {len(missing)} tensor(s) this config implies: "
                                     f"{shown}; check that config.json belongs to these weights "
                                     f"({_label('num_hidden_layers')}, {_label('mlp_layer_types')}, "
                                     f"{_label('num_local_experts')})")

    def check_tower_shapes(self, shapes: dict[str, tuple[int, ...]], source: str = "config.json") -> None:
        """A tower the checkpoint has (any tensor of it) must have all of its tensors, in the shapes
        ``vision_config`` / ``audio_config`` imply; a checkpoint without a tower's tensors is fine
        (that tower is absent). Raises ``CheckpointMismatch`` naming the tensor."""
        from musecore.loader import CheckpointMismatch
        from musecore.names import tower_of
        from musecore.towers import tower_shapes

        for tower in ("vision", "audio"):
            have = {n: tuple(s) for n, s in shapes.items() if tower_of(n) == tower}
            if not have:
                continue
            sub = "vision_config" if tower == "vision" else "audio_config"
            try:
                expected = tower_shapes(self, tower)
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointMismatch(f"{source}: {sub} cannot describe the checkpoint's {tower} tower "
                                         f"({type(e).__name__}: {e}); fix {sub} in config.json") from None
            for name, shape in have.items():
                if name not in expected:
                    raise CheckpointMismatch(f"{source}: unexpected tensor {name!r}: the {tower} tower that {sub} "
                                             "describes has no such tensor; check that config.json belongs to these "
                                             f"weights ({sub}.num_hidden_layers, depths)")
                if shape != expected[name]:
                    raise CheckpointMismatch(f"{source}: tensor {name!r} has shape {list(shape)} in the checkpoint, "
                                             f"but config.json implies {list(expected[name])} from {sub} (and "
                                             "out_hidden_size, projector_hidden_size, hidden_size); fix config.json "
                                             "or use the checkpoint it belongs to")
            missing = sorted(set(expected) - set(have))
            if missing:
                shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                raise CheckpointMismatch(f"{source}: the checkpoint has {len(have)} {tower} tower tensors but lacks "
                                         f"{len(missing)} that {sub} implies: {shown}; re-export the checkpoint "
                                         "with the whole tower (or without any of its tensors)")

    @staticmethod
    def _shape_message(source: str, name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> str:
        fields = next((f for suffix, f in SHAPE_FIELDS if suffix in name), ("hidden_size",))
        return (f"{source}: tensor {name!r} has shape {list(shape)} in the checkpoint, but config.json implies "
                f"{list(want)} from {', '.join(_label(f) for f in fields)}; fix config.json or use the checkpoint "
                "it belongs to")

    # -- derived quantities ------------------------------------------------------------------------

    @property
    def num_experts(self) -> int:
        """``num_local_experts``: the routed experts of each sparse layer."""
        return self.num_local_experts

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def uses_rope(self, layer: int) -> bool:
        """transformers 5.24: a non-zero ``layer_rope_theta`` switches RoPE on (with the global theta)."""
        return bool(self.layer_rope_theta[layer])

    def is_sparse(self, layer: int) -> bool:
        return names.is_sparse_layer(self, layer)

    @property
    def sparse_layers(self) -> list[int]:
        return names.sparse_layers(self)

    @property
    def bf16_expert_layers(self) -> list[int]:
        """Sparse layers whose routed experts the quantised releases keep in BF16: the first and last layer."""
        return names.bf16_expert_layers(self)

    def attention_parameters(self) -> int:
        H, d, nq, nkv = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        return 3 * H * nq * d + 2 * H * nkv * d  # q, gate, o + k, v

    def expert_parameters(self) -> int:
        h, inter = self.moe_hidden_size, self.moe_intermediate_size
        return 3 * h * inter  # gate_up [2I, h] + down [h, I]

    def mlp_parameters(self, layer: int, experts: int) -> int:
        """One layer's MLP with ``experts`` routed experts counted (sparse), or the dense MLP."""
        H = self.hidden_size
        if not self.is_sparse(layer):
            return 3 * H * self.intermediate_size
        h, E = self.moe_hidden_size, self.num_local_experts
        return E * H + 2 * H * h + 2 * h + experts * self.expert_parameters()  # router, pooler/unpooler, 2 norms

    def _count(self, experts: int) -> int:
        H = self.hidden_size
        per_layer_fixed = self.attention_parameters() + 3 * H + 2 * H  # 3 norms with weights, 2 residual gates
        layers = sum(per_layer_fixed + self.mlp_parameters(i, experts) for i in range(self.num_hidden_layers))
        return 2 * self.vocab_size * H + layers + H

    def num_parameters(self) -> int:
        """Text-decoder parameters (as transformers counts them: the correction bias is a buffer):
        embeddings, every layer with all experts, final norm, lm_head."""
        return self._count(self.num_local_experts)

    def num_active_parameters(self) -> int:
        """Parameters that one token touches: embeddings/lm_head, dense parts, ``num_experts_per_tok`` experts."""
        return self._count(self.num_experts_per_tok)


PRESETS: dict[str, dict[str, Any]] = {
    # transformers' MuseSparkConfig() defaults.
    "muse-spark-open-816b-a42b": {},
    "muse-small": dict(
        vocab_size=65536, hidden_size=1536, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=24,
        num_key_value_heads=3, head_dim=64, num_local_experts=64, num_experts_per_tok=8, moe_hidden_size=768,
        moe_intermediate_size=768, sliding_window=1024, max_position_embeddings=131072,
        output_multiplier=1 / math.sqrt(1536 / 256), out_hidden_size=1024, projector_hidden_size=1024,
        vision_config={"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4}),
    # The bundled trained model (musecore/data/muse-tiny; training/README.md).
    "muse-tiny": dict(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=4096, sliding_window=64, num_local_experts=12,
        num_experts_per_tok=4, moe_hidden_size=128, moe_intermediate_size=256, output_multiplier=1.0,
        bos_token_id=0, eos_token_id=3, pad_token_id=7, image_token_id=4, video_token_id=5, audio_token_id=6,
        out_hidden_size=256, projector_hidden_size=256,
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2},
        audio_config={"hidden_sizes": [32, 32, 32, 32], "depths": [1, 1, 1, 1]}),
}
