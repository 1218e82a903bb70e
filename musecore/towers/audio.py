"""The audio tower: raw 24 kHz mono waveform -> one feature per 1920 samples (MODEL.md section 2).

Transformers' ``MuseSparkAudioModel``: no spectrogram and no attention, a causal conv pyramid.
Each stage embeds patches of its input (sizes 16, 6, 5, 4: 1920 samples = 80 ms per output token)
with a linear and an RMSNorm, then runs blocks of a depthwise causal conv (kernel 7), an RMSNorm
and a GELU MLP, each block with a residual. A final RMSNorm, a projection to the text width and
another RMSNorm follow; ``MuseSparkModel.get_audio_features`` keeps each clip's real tokens and
applies the text embedding's weightless norm (``MuseModel.encode_audio``).

Every conv is causal, so the tower streams: :class:`AudioState` carries each conv's last inputs
from one chunk (a multiple of 1920 samples) to the next, and the chunks' features equal one pass.

Example::

    feats, state = model.audio(chunk_1)          # [B, n1, H]
    more, state = model.audio(chunk_2, state)    # = the next rows of model.audio(cat(chunk_1, chunk_2))
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from musecore.names import AUDIO
from musecore.ops import Ops
from musecore.towers.vision import biased

TOWER = "model.audio_tower."

# A streaming state: each conv block's last K-1 inputs, by (stage, block).
AudioState = dict[tuple[int, int], torch.Tensor]


def audio_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor of the audio tower (transformers' names) and its shape."""
    from musecore.config import check_audio_sizes
    a = config.audio_config
    check_audio_sizes(a)  # bounded before the loop below builds names per conv block
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (patch, width, depth) in enumerate(zip(a["patch_sizes"], a["hidden_sizes"], a["depths"])):
        q = f"{TOWER}layers.{i}."
        width_in = 1 if i == 0 else a["hidden_sizes"][i - 1]
        inter = int(width * a["mlp_ratio"])
        shapes.update({q + "patch_embedder.proj.weight": (width, width_in * patch),
                       q + "patch_embedder.proj.bias": (width,), q + "patch_embedder.norm.weight": (width,)})
        for j in range(depth):
            b = f"{q}conv_blocks.{j}."
            shapes.update({b + "conv.weight": (width, 1, a["conv_kernel_size"]), b + "conv.bias": (width,),
                           b + "norm.weight": (width,), b + "mlp.fc1.weight": (inter, width), b + "mlp.fc1.bias": (inter,),
                           b + "mlp.fc2.weight": (width, inter), b + "mlp.fc2.bias": (width,)})
    last, out = a["hidden_sizes"][-1], a["out_hidden_size"]
    shapes.update({TOWER + "norm.weight": (last,), TOWER + "proj.weight": (out, last), TOWER + "proj.bias": (out,),
                   TOWER + "post_proj_norm.weight": (out,)})
    return shapes


def check_audio_config(config: Any) -> None:
    """What the tower needs of ``audio_config``; ConfigError naming the field."""
    from musecore.config import ConfigError, check_audio_sizes
    from musecore.towers import gelu_approximation
    a = config.audio_config
    check_audio_sizes(a)
    lengths = [len(a[k]) for k in ("patch_sizes", "hidden_sizes", "depths")]
    if len(set(lengths)) != 1 or lengths[0] != a["num_hidden_layers"] or not lengths[0]:
        raise ConfigError("audio_config.num_hidden_layers", "must equal the lengths of patch_sizes, hidden_sizes and "
                          f"depths (got {lengths})", a["num_hidden_layers"])
    for key in ("patch_sizes", "hidden_sizes"):
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in a[key]):
            raise ConfigError(f"audio_config.{key}", "must be positive integers", a[key])
    if not isinstance(a["conv_kernel_size"], int) or a["conv_kernel_size"] < 1:
        raise ConfigError("audio_config.conv_kernel_size", "must be a positive integer", a["conv_kernel_size"])
    gelu_approximation(a["hidden_act"], "audio_config.hidden_act")


class ConvBlock:
    """Depthwise causal conv, RMSNorm, GELU MLP, plus the block's input."""

    def __init__(self) -> None:
        self.conv_weight = self.conv_bias = self.norm = None
        self.fc1 = self.fc2 = None  # Weights
        self.fc1_bias = self.fc2_bias = None


class AudioStage:
    def __init__(self, patch: int, depth: int) -> None:
        self.patch = patch
        self.proj = self.proj_bias = self.norm = None
        self.blocks = [ConvBlock() for _ in range(depth)]


class AudioTower:
    """``tower(input_values [B, L], state=None) -> (features [B, L/1920, H], state')`` (``MuseSparkAudioModel``;
    ``L`` a multiple of :attr:`samples_per_token`)."""

    kind = AUDIO

    def __init__(self, config: Any, ops: Ops, dtype: torch.dtype, device: torch.device) -> None:
        from musecore.towers import gelu_approximation
        check_audio_config(config)
        a = config.audio_config
        self.ops, self.dtype, self.device = ops, dtype, device
        self.eps = a["rms_norm_eps"]
        self.act = gelu_approximation(a["hidden_act"], "audio_config.hidden_act")
        self.samples_per_token = math.prod(a["patch_sizes"])
        self.stages = [AudioStage(p, d) for p, d in zip(a["patch_sizes"], a["depths"])]
        self.norm = self.proj = self.proj_bias = self.post_proj_norm = None

    @classmethod
    def linear_names(cls, config: Any) -> list[str]:
        """The checkpoint tensors this tower runs through ``linear`` (the plan asks backends about them)."""
        tower = cls(config, None, torch.bfloat16, torch.device("cpu"))
        return [name for name, (_owner, _attr, role) in tower.weights().items() if role == "linear"]

    def weights(self) -> dict[str, tuple[Any, str, str]]:
        """Checkpoint tensor -> (owner, attribute, role) for the loader."""
        out = {TOWER + "norm.weight": (self, "norm", "vector"), TOWER + "proj.weight": (self, "proj", "linear"),
               TOWER + "proj.bias": (self, "proj_bias", "vector"),
               TOWER + "post_proj_norm.weight": (self, "post_proj_norm", "vector")}
        for i, stage in enumerate(self.stages):
            q = f"{TOWER}layers.{i}."
            out.update({q + "patch_embedder.proj.weight": (stage, "proj", "linear"),
                        q + "patch_embedder.proj.bias": (stage, "proj_bias", "vector"),
                        q + "patch_embedder.norm.weight": (stage, "norm", "vector")})
            for j, block in enumerate(stage.blocks):
                b = f"{q}conv_blocks.{j}."
                out.update({b + "conv.weight": (block, "conv_weight", "vector"),
                            b + "conv.bias": (block, "conv_bias", "vector"),
                            b + "norm.weight": (block, "norm", "vector"),
                            b + "mlp.fc1.weight": (block, "fc1", "linear"), b + "mlp.fc1.bias": (block, "fc1_bias", "vector"),
                            b + "mlp.fc2.weight": (block, "fc2", "linear"), b + "mlp.fc2.bias": (block, "fc2_bias", "vector")})
        return out

    def __call__(self, input_values: torch.Tensor, state: Optional[AudioState] = None
                 ) -> tuple[torch.Tensor, AudioState]:
        """Features of every 1920-sample step of ``input_values [B, L]`` and the state that continues
        the stream after it (pass it with the next chunk; None starts from silence)."""
        ops = self.ops
        if input_values.dim() != 2 or input_values.shape[1] % self.samples_per_token:
            raise ValueError(f"input_values has shape {list(input_values.shape)}; the audio tower takes [clips, samples] "
                             f"with samples a multiple of {self.samples_per_token} (pad as the feature extractor does)")
        B = input_values.shape[0]
        state = {} if state is None else state
        new_state: AudioState = {}
        x = input_values.to(self.device, self.dtype)[..., None]  # [B,L,1]
        for i, stage in enumerate(self.stages):
            T, C = x.shape[1], x.shape[2]
            x = x.reshape(B, T // stage.patch, stage.patch * C)  # patch embedding: stride = size
            x = ops.rms_norm(biased(ops, x, stage.proj, stage.proj_bias), stage.norm, self.eps)  # [B,T',C']
            for j, block in enumerate(stage.blocks):
                y, new_state[(i, j)] = ops.causal_conv1d(x.transpose(1, 2).contiguous(), block.conv_weight, block.conv_bias,
                                                         state.get((i, j)))
                y = ops.rms_norm(y.transpose(1, 2), block.norm, self.eps)
                y = biased(ops, ops.gelu(biased(ops, y, block.fc1, block.fc1_bias), self.act), block.fc2, block.fc2_bias)
                x = y + x
        x = biased(ops, ops.rms_norm(x, self.norm, self.eps), self.proj, self.proj_bias)
        return ops.rms_norm(x, self.post_proj_norm, self.eps), new_state
