"""The rotary position table (MODEL.md section 1): HF Llama convention, YaRN optional.

One table with the global ``rope_parameters``: in transformers 5.24 a layer's ``layer_rope_theta``
only switches RoPE on (non-zero) or off (0, NoPE). Default frequencies are computed in fp32 exactly
as transformers' ``compute_default_rope_parameters`` does; YaRN (``rope_type: "yarn"``) as its
``_compute_yarn_parameters``.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_inv_freq(dim: int, params: dict[str, Any], max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN frequencies and the attention factor (mscale) applied to cos/sin."""
    base, factor = float(params["rope_theta"]), float(params["factor"])
    original_max = int(params.get("original_max_position_embeddings", max_positions))
    beta_fast, beta_slow = float(params.get("beta_fast", 32.0)), float(params.get("beta_slow", 1.0))
    attention_factor = params.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep_extrapolation = 1 - ramp
    inv_freq = interpolation * (1 - keep_extrapolation) + extrapolation * keep_extrapolation
    return inv_freq.float(), float(attention_factor)


class RotaryTable:
    """``cos, sin = table(positions [B,T])`` -> ``[B,T,d]`` each, fp32; negative positions give 0."""

    def __init__(self, head_dim: int, params: dict[str, Any], max_positions: int,
                 device: torch.device | str = "cpu") -> None:
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            self.inv_freq = 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            self.attention_factor = 1.0
        elif rope_type == "yarn":
            self.inv_freq, self.attention_factor = yarn_inv_freq(head_dim, params, max_positions)
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}; musecore implements 'default' and 'yarn'")
        self.inv_freq = self.inv_freq.to(device)  # resident: no host copy per step (graph-capturable)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.clamp(min=0).float()[..., None] * self.inv_freq.to(positions.device)  # no-op when resident  # [B,T,d/2]
        emb = torch.cat((angles, angles), dim=-1)  # duplicated over the two halves
        if self.attention_factor == 1.0:  # default rope: skip two [B,T,d] multiplies per step (x * 1.0 == x)
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
