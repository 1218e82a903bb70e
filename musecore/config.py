"""``MuseConfig``: the Muse Spark Open text backbone's hyperparameters, as in an HF ``config.json``.

One dataclass validated in ``__post_init__``, read and written as the HF-style JSON of MODEL.md
section 4, with the named presets of MODEL.md and the parameter counts that tie the 816B preset
to the public figures. Unknown keys are kept (``extra``) and written back unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

FULL, SLIDING = "full_attention", "sliding_attention"

REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                 "moe_latent_size", "moe_intermediate_size")


@dataclass
class MuseConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_latent_size: int
    moe_intermediate_size: int
    max_position_embeddings: int = 1_048_576
    rms_norm_eps: float = 1e-6
    sliding_window: int = 4096
    global_layer_period: int = 4
    layer_types: Optional[list[str]] = None
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=lambda: {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "default", "rope_theta": 1_000_000.0},
    })
    norm_topk_prob: bool = True
    bf16_expert_layers: Optional[list[int]] = None
    tie_word_embeddings: bool = False
    model_type: str = "muse_spark"
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, list[int]]] = None
    pad_token_id: Optional[int] = None
    quantization_config: Optional[dict[str, Any]] = None
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, kept verbatim

    def __post_init__(self) -> None:
        L = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [FULL if (i + 1) % self.global_layer_period == 0 or i == L - 1 else SLIDING
                                for i in range(L)]
        if self.bf16_expert_layers is None:
            self.bf16_expert_layers = sorted({0, L - 1})
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid Muse config: {msg}")
        for name in REQUIRED_KEYS:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise bad(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                      f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise bad(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise bad(f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise bad(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown:
            raise bad(f"unknown layer types {unknown}; expected {FULL!r} or {SLIDING!r}")
        for kind in set(self.layer_types):
            if "rope_theta" not in self.rope_parameters.get(kind, {}):
                raise bad(f"rope_parameters[{kind!r}] needs a rope_theta")
        if self.rope_parameters.get(SLIDING, {}).get("rope_type", "default") != "default":
            raise bad("sliding-attention layers never scale RoPE; rope_parameters['sliding_attention'] must be 'default'")
        if self.sliding_window <= 0:
            raise bad(f"sliding_window must be positive, got {self.sliding_window}")
        if self.tie_word_embeddings:
            raise bad("Muse does not tie embeddings (tie_word_embeddings must be false)")
        out_of_range = [i for i in self.bf16_expert_layers if not 0 <= i < self.num_hidden_layers]
        if out_of_range:
            raise bad(f"bf16_expert_layers {out_of_range} are outside 0..{self.num_hidden_layers - 1}")

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "MuseConfig":
        data = dict(data)
        if "text_config" in data:  # multimodal wrapper: the backbone's fields live in text_config
            outer = {k: v for k, v in data.items() if k != "text_config"}
            data = {**data["text_config"], "extra_outer": outer}
        missing = [k for k in REQUIRED_KEYS if k not in data]
        if missing:
            raise ValueError(f"{source} is missing required keys {missing}; a Muse config.json needs "
                             f"{list(REQUIRED_KEYS)} (see MODEL.md section 4)")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names}
        try:
            return cls(**known, extra=extra)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_pretrained(cls, path: Union[str, Path]) -> "MuseConfig":
        """Read ``config.json`` from a checkpoint folder (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no config.json at {file}; a checkpoint folder needs config.json")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON ({e}); re-download or re-export the checkpoint") from None
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_name(cls, name: str) -> "MuseConfig":
        """A preset: ``muse-tiny``, ``muse-small`` or ``muse-spark-open-816b-a42b``."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        data = {k: v for k, v in data.items() if v is not None}
        return {**data, **self.extra}

    def save_pretrained(self, folder: Union[str, Path]) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        file = folder / "config.json"
        file.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return file

    # -- derived quantities ------------------------------------------------------------------------

    @property
    def num_key_value_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def window(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def attention_parameters(self) -> int:
        H, d, nq, nkv = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        return H * nq * d + 2 * H * nkv * d + nq * d * H + H * nq + 3 * d

    def expert_parameters(self) -> int:
        l, inter = self.moe_latent_size, self.moe_intermediate_size
        return 3 * l * inter + l

    def dense_layer_parameters(self) -> int:
        """Everything in a layer except the routed experts: attention, router, pooler, norms, gates."""
        H, l, E = self.hidden_size, self.moe_latent_size, self.num_experts
        mlp = E * H + l * H + l + H * l
        norms = 4 * H + 2 * H  # input/post-attn/pre-ffn/post-ffn norms + two residual gates
        return self.attention_parameters() + mlp + norms

    def num_parameters(self) -> int:
        """Text-backbone parameters: embeddings, every layer with all experts, final norm, lm_head."""
        per_layer = self.dense_layer_parameters() + self.num_experts * self.expert_parameters()
        return 2 * self.vocab_size * self.hidden_size + self.num_hidden_layers * per_layer + self.hidden_size

    def num_active_parameters(self) -> int:
        """Parameters that one token touches: embeddings/lm_head, dense parts, k routed experts."""
        per_layer = self.dense_layer_parameters() + self.num_experts_per_tok * self.expert_parameters()
        return 2 * self.vocab_size * self.hidden_size + self.num_hidden_layers * per_layer + self.hidden_size


PRESETS: dict[str, dict[str, Any]] = {
    "muse-spark-open-816b-a42b": dict(
        vocab_size=202048, hidden_size=8192, num_hidden_layers=62, num_attention_heads=80,
        num_key_value_heads=8, head_dim=128, num_experts=256, num_experts_per_tok=8,
        moe_latent_size=2048, moe_intermediate_size=8192, sliding_window=4096, global_layer_period=4,
        max_position_embeddings=1_048_576,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                         FULL: {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 8.0,
                                "original_max_position_embeddings": 131072,
                                "beta_fast": 32.0, "beta_slow": 1.0}}),
    "muse-small": dict(
        vocab_size=65536, hidden_size=1536, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
        moe_latent_size=512, moe_intermediate_size=768, sliding_window=1024, global_layer_period=4,
        max_position_embeddings=131072),
    "muse-tiny": dict(
        # 12 experts (MODEL.md's table says 16) and V=4096 keep the bundled BF16 checkpoint under
        # the 25 MB package limit: 10.8M parameters = 21.6 MB.
        vocab_size=4096, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, num_experts=12, num_experts_per_tok=4,
        moe_latent_size=128, moe_intermediate_size=256, sliding_window=64, global_layer_period=3,
        max_position_embeddings=4096,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                         FULL: {"rope_type": "default", "rope_theta": 100_000.0}}),
}
