"""The vision and audio towers (MODEL.md section 2), as transformers 5.24's ``muse_spark`` computes them.

Images and video frames go through :class:`~musecore.towers.vision.VisionTower` (then the vision
adapter, the projection to the text width and a weightless norm); raw 24 kHz audio through
:class:`~musecore.towers.audio.AudioTower` (then the text embedding's weightless norm). Their
outputs replace the prompt's placeholder embeddings (``MuseModel.forward(media=)``). Every
computation goes through the op table, like the text decoder's: the towers add the ops
``musecore.ops.TOWER_OPS`` and also call ``linear`` (BF16 weights, never quantized) and ``rms_norm``.

A tower is loaded when the checkpoint has its tensors and the plan can run its ops (see
``musecore.planning.plan_towers``); ``model.vision`` / ``model.audio`` are None otherwise.
"""

from __future__ import annotations

from typing import Any

from musecore.names import AUDIO, VISION, tower_of  # noqa: F401 (re-export)

# The ops each tower calls besides ``linear`` (which it calls with weights in the model dtype).
TOWER_OP_NEEDS: dict[str, tuple[str, ...]] = {
    VISION: ("layer_norm", "gelu", "varlen_attention", "rope", "rms_norm"),
    AUDIO: ("causal_conv1d", "gelu", "rms_norm"),
}


class MediaCountError(ValueError):
    """The prompt's placeholders and the feature rows given for them differ in number."""


def gelu_approximation(act: Any, field: str) -> str:
    """transformers' ACT2FN name -> the ``gelu`` op's ``approximate`` argument."""
    from musecore.config import ConfigError
    table = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}
    if act not in table:
        raise ConfigError(field, f"is not supported by musecore's towers (choose one of {sorted(table)})", act)
    return table[act]


def tower_shapes(config: Any, tower: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``tower`` ("vision": tower, adapter and projection; "audio") with its shape."""
    if tower == VISION:
        from musecore.towers.vision import vision_shapes
        return vision_shapes(config)
    from musecore.towers.audio import audio_shapes
    return audio_shapes(config)


def tower_linears(config: Any, tower: str) -> dict[str, tuple[int, int]]:
    """The tensors of ``tower`` that run through the ``linear`` op, with their ``(out, in)`` shapes."""
    from musecore.towers.audio import AudioTower
    from musecore.towers.vision import VisionTower
    shapes = tower_shapes(config, tower)
    roles = (VisionTower if tower == VISION else AudioTower).linear_names(config)
    return {name: shapes[name] for name in roles}


__all__ = ["AUDIO", "VISION", "MediaCountError", "TOWER_OP_NEEDS", "tower_linears", "tower_of", "tower_shapes"]
