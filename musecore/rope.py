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
    """``cos, sin = table(positions [B,T])`` -> ``[B,T,d]`` each, fp32; negative positions give 0.

    On the CPU the rows come from a table of every position up to the largest one seen so far (grown by doubling,
    computed by the same fp32 ops as :meth:`compute`, which are element-wise: the same bits as computing the
    step's rows, tested for the default and YaRN tables), so a decode step reads its two rows instead of issuing
    ~8 ops (12-16 -> 7-8 us per token on the Intel Xeon host, alternating micro-benchmark). Reading a position on
    the host is free on the CPU; on an accelerator it would be a sync that a captured decode step cannot make, and
    inside torch.compile (the TPU backend's compiled step on CPU tensors) a guard on data: there every step computes
    its rows. The rows returned on the CPU are views of the table: callers must not write to them (none does).
    """

    TABLE_MIN_ROWS = 1024  # the table's first size; it doubles past the largest position seen

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
        self.tabled = torch.device(device).type == "cpu"
        self.cos_table = self.sin_table = None  # [N, 1, d] fp32 on the CPU once a position was asked for

    def compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``positions`` computed from the frequencies (what the table holds)."""
        angles = positions.clamp(min=0).float()[..., None] * self.inv_freq.to(positions.device)  # no-op when resident  # [B,T,d/2]
        emb = torch.cat((angles, angles), dim=-1)  # duplicated over the two halves
        if self.attention_factor == 1.0:  # default rope: skip two [B,T,d] multiplies per step (x * 1.0 == x)
            return emb.cos(), emb.sin()
        return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor

    def grow_to(self, last: int) -> None:
        """Grow the table (if needed) to hold position ``last``."""
        size = 0 if self.cos_table is None else self.cos_table.shape[0]
        if last < size:
            return
        size = max(size, self.TABLE_MIN_ROWS)
        while size <= last:
            size *= 2
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor: usable inside and outside inference mode
            positions = torch.arange(size, device=self.inv_freq.device)[:, None]
            self.cos_table, self.sin_table = self.compute(positions)  # [N,1,d]

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.tabled or positions.device.type != "cpu" or torch.compiler.is_compiling():
            return self.compute(positions)  # a compiled step (the TPU backend's, on CPU tensors) cannot read positions
        if positions.shape == (1, 1):  # decode of one sequence: two slices [1,1,d], no op over the data
            p = max(int(positions), 0)
            self.grow_to(p)
            return self.cos_table[p:p + 1], self.sin_table[p:p + 1]
        index = positions.clamp(min=0)
        self.grow_to(int(index.max()) if index.numel() else 0)
        return (torch.nn.functional.embedding(index, self.cos_table.view(self.cos_table.shape[0], -1)),
                torch.nn.functional.embedding(index, self.sin_table.view(self.sin_table.shape[0], -1)))
