"""Routed-expert MoE on MXFP4 experts through ``tl.dot_scaled`` (W4A4 or W4A16).

The same four steps as :mod:`musecore_triton.kernels.moe` (align, gate+up with SwiGLU, down,
finalize), with the GEMMs of :mod:`musecore_triton.kernels.mx_gemm` reading the canonical MXFP4
expert stacks. With MXFP4 activations (the gfx950 / SM100 W4A4 target) the token rows are
quantized inside the gate/up kernel, and the SwiGLU output is quantized to MXFP4 in that kernel's
epilogue from its fp32 values, exactly where the reference (``expert_forward``) quantizes it; the
down GEMM then reads packed bytes. The finalize (unpermute, per-expert post norm, routing weight,
fp32 sum in one kernel) is the shared :func:`musecore_triton.kernels.moe.finalize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from musecore_triton.kernels.moe import align_assignments, check_post_norm, finalize
from musecore_triton.kernels.mx_gemm import (A_DENSE, A_PACKED, A_QUANT, MX_BLOCK, check_mx_shapes,
                                             launch_mx_gemm, pick_mx_config)


@dataclass
class MxExperts:
    """MXFP4 expert stacks as ``dot_scaled`` reads them: canonical packed bytes and E8M0 scales."""

    gate: torch.Tensor         # uint8 [E, I, h/2]
    gate_scales: torch.Tensor  # uint8 [E, I, h/32]
    up: torch.Tensor
    up_scales: torch.Tensor
    down: torch.Tensor         # uint8 [E, h, I/2]
    down_scales: torch.Tensor  # uint8 [E, h, I/32]

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in (self.gate, self.gate_scales, self.up, self.up_scales, self.down,
                                       self.down_scales))


def mx_experts(gate, up, down, device: torch.device) -> MxExperts:
    """Three stacked canonical MXFP4 ``QTensor`` s (``[E, out, in]``) -> :class:`MxExperts` on ``device``."""
    for name, qt in (("gate", gate), ("up", up), ("down", down)):
        if qt.format != "mxfp4" or qt.group_size != MX_BLOCK or len(qt.shape) != 3:
            raise ValueError(f"{name}: the dot_scaled MoE takes stacked [E, out, in] MXFP4 QTensors (group 32); got "
                             f"{qt.format} group {qt.group_size} shape {list(qt.shape)}")
        check_mx_shapes(qt.shape[1], qt.shape[2])
    as_bytes = lambda t: t.to(device).view(torch.uint8).contiguous()  # noqa: E731
    return MxExperts(as_bytes(gate.data), as_bytes(gate.scale), as_bytes(up.data), as_bytes(up.scale),
                     as_bytes(down.data), as_bytes(down.scale))


def mx_moe_forward(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: MxExperts,
                   post_norm: torch.Tensor, post_eps: float, *, quantize_activations: bool) -> torch.Tensor:
    """The ``moe`` op on MXFP4 experts; fp32 ``[T, h]``. ``quantize_activations``: W4A4 (MXFP4
    activations, the emulated ``act_format="mxfp4"`` numerics), else W4A16."""
    T, topk = ids.shape
    width = z.shape[-1]
    check_post_norm(post_norm, width)
    inter = experts.gate.shape[1]
    if T == 0:
        return torch.empty(T, width, dtype=torch.float32, device=z.device)
    z = z.contiguous()
    n_assign = T * topk
    rows_per_expert = max(1, n_assign // min(experts.num_experts, n_assign))
    cfg = pick_mx_config(rows_per_expert, z.device)
    sorted_ids, blk_expert, position = align_assignments(ids, experts.num_experts, cfg.block_m)
    rows = sorted_ids.numel()
    common = dict(cfg=cfg, a_idx=sorted_ids, n_assign=n_assign, blk_expert=blk_expert, m_rows=rows)
    if quantize_activations:
        h = torch.empty(rows, inter // 2, dtype=torch.uint8, device=z.device)
        h_scales = torch.empty(rows, inter // MX_BLOCK, dtype=torch.uint8, device=z.device)
        launch_mx_gemm(z, experts.gate, experts.gate_scales, n=inter, k=width, out=h, out_scales=h_scales,
                       a_mode=A_QUANT, a_div=topk, w2=experts.up, w2_scales=experts.up_scales, **common)
        down_args = dict(a_mode=A_PACKED, a_scales=h_scales)
    else:
        h = torch.empty(rows, inter, dtype=z.dtype, device=z.device)
        h_scales = None
        launch_mx_gemm(z, experts.gate, experts.gate_scales, n=inter, k=width, out=h, a_mode=A_DENSE, a_div=topk,
                       w2=experts.up, w2_scales=experts.up_scales, **common)
        down_args = dict(a_mode=A_DENSE)
    o = torch.empty(rows, width, dtype=torch.float32, device=z.device)
    launch_mx_gemm(h, experts.down, experts.down_scales, n=width, k=inter, out=o, a_div=0, **down_args, **common)
    return finalize(o, position, ids, weights, post_norm, post_eps, sorted_rows=True, act_dtype=z.dtype)
