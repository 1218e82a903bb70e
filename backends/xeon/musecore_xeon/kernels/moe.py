"""The routed-expert MoE on CPU: tokens grouped per expert, one fused gate/up GEMM and one down GEMM
per routed expert, then per-expert RMSNorm, routing weight and an fp32 sum (MODEL.md section 1).

Grouping by a stable sort of the ``[T, k]`` expert ids gives each expert a contiguous block of
rows, so each expert's weights are streamed once per call however many tokens chose it (decode
reads only the routed experts' bytes). Gate and up are fused into one ``[2I, l]`` weight per expert
at load, which halves the kernel launches. The norm, weighting and sum run once over all
``T * k`` rows instead of once per expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

from musecore_xeon.kernels.dense import DenseLinear
from musecore_xeon.kernels.int4 import Int4Linear

ExpertLinear = Union[Int4Linear, DenseLinear]


@dataclass
class XeonExperts:
    """Per-expert resident weights of one MoE layer: fused ``[gate; up]`` ``[2I, l]`` and ``down [l, I]``."""

    gate_up: list[ExpertLinear]
    down: list[ExpertLinear]
    intermediate: int
    latent: int

    @property
    def num_experts(self) -> int:
        return len(self.down)


def moe_forward(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: XeonExperts,
                output_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """``y[t] = sum_j w[t,j] * rms_norm(down(silu(gate(z)) * up(z)), output_norm[id])`` -> fp32 ``[T, l]``."""
    T, k = ids.shape
    l, inter = experts.latent, experts.intermediate
    if z.shape != (T, l):
        raise ValueError(f"moe: z has shape {tuple(z.shape)}; expected [T={T}, l={l}] for these ids and experts")
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # rows grouped by expert
    sorted_ids = flat_ids[order]
    token = order // k  # [T*k] token of each grouped row
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    z_rows = z.to(torch.bfloat16)[token]  # [T*k, l]; the INT4 kernel takes bf16 activations
    expert_out = torch.empty(T * k, l, dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gu = experts.gate_up[e](z_rows[rows]).float()  # [n, 2I]
        h = F.silu(gu[:, :inter]) * gu[:, inter:]  # SwiGLU in fp32
        expert_out[rows] = experts.down[e](h.to(torch.bfloat16))
        start += n
    # Per-expert norm first, then the routing weight, then the fp32 sum (never a norm of the sum).
    normed = F.rms_norm(expert_out, (l,), eps=eps)
    scale = output_norm.float()[sorted_ids] * weights.reshape(-1)[order].float()[:, None]  # [T*k, l]
    y = torch.zeros(T, l, dtype=torch.float32)
    y.index_add_(0, token, normed * scale)
    return y
