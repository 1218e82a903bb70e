"""Helpers for a backend's tests of its fused blocks (``Backend.fuse_block``): the blocks a model fused, and one
block's call through its separate ops, the reference those tests compare against."""

from __future__ import annotations

from typing import Any

import torch

from musecore.model import MoE


def fused_blocks(model: Any, kind: str) -> list:
    """Every ``"moe"`` (MoE layers only) or ``"attention"`` block of ``model``, asserting that loading fused each
    one (a test of the fused form that silently ran the separate ops would prove nothing)."""
    if kind == "moe":
        found = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
    elif kind == "attention":
        found = [layer.self_attn for layer in model.layers]
    else:
        raise ValueError(f"fused_blocks: kind is 'moe' or 'attention'; got {kind!r}")
    label = "MoE" if kind == "moe" else kind
    assert found and all(b.fused is not None for b in found), \
        f"load_random fused {sum(b.fused is not None for b in found)} of {len(found)} {label} blocks; expected all"
    return found


def through_separate_ops(block: Any, *args: Any) -> Any:
    """``block(*args)`` with its fused form set aside for the call (its separate ops run), in inference mode."""
    fused, block.fused = block.fused, None
    try:
        with torch.inference_mode():
            return block(*args)
    finally:
        block.fused = fused
