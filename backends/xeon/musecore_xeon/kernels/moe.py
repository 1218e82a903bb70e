"""The routed-expert MoE on CPU: tokens grouped per expert, one fused gate/up GEMM and one down GEMM
per routed expert, then the shared post-expert norm (scale first), the routing weight and an fp32 sum
(the ``moe`` contract of :mod:`musecore.ops`, MODEL.md section 1).

Grouping by a stable sort of the ``[T, k]`` expert ids gives each expert a contiguous block of
rows, so each expert's weights are streamed once per call however many tokens chose it (decode
reads only the routed experts' bytes). Gate and up are fused into one ``[2I, h]`` weight per expert
at load, which halves the kernel launches. The norm, weighting and sum run once over all
``T * k`` rows instead of once per expert.

INT4 experts at decode sizes (every expert's token count below the measured dense-tile crossover) take
one native call for the whole layer (``native.int4_moe``): grouping, gate/up, SwiGLU, down, norm, weight
and sum in C under one OpenMP region (BF16 experts likewise, ``native.bf16_moe``). Per expert, the Python path costs
~16 small calls per layer with an OpenMP fork/join, a few torch ops and allocations each: more than the experts'
codes take to stream. Where the extension is built, the op is ONE call from Python (its ``moe``: the checks, the
fit test per expert, the allocation and the same kernel; ~13-17 us less per layer than the checks and the 21-argument
ctypes call, warm, on the Intel Xeon host: lab/NOTES.md).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F

from musecore_xeon.kernels import native
from musecore_xeon.kernels.dense import DenseLinear
from musecore_xeon.kernels.int4 import Int4Linear
from musecore_xeon.ops import fast_ops

ExpertLinear = Union[Int4Linear, DenseLinear]


class MoeExpertsArgs(ctypes.Structure):
    """A layer's experts as the extension's ``moe`` reads them (``moe_experts_t`` of ``csrc/binding.cpp``): kind 0
    INT4, 1 BF16; the addresses of the per-expert pointer arrays (rows of ``XeonExperts.native_pointers``), the
    shapes, and the most routed rows per expert for which the fused call runs."""

    _fields_ = [("kind", ctypes.c_int64), ("gu_w", ctypes.c_void_p), ("gu_sz", ctypes.c_void_p),
                ("dn_w", ctypes.c_void_p), ("dn_sz", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("experts", "hidden", "inter", "g_gu", "g_dn", "gu_rows", "dn_rows",
                                            "max_tokens")]


# The crossover of one INT4 linear compares one call with one call; leaving the fused MoE call costs two calls per
# routed expert plus the Python between them, so the fused call is kept below 32 tokens per expert even where the
# dense path's own crossover is lower (AMX: lab/NOTES.md).
INT4_FUSED_MIN_TOKENS = 32


@dataclass
class XeonExperts:
    """Per-expert resident weights of one MoE layer: fused ``[gate; up]`` ``[2I, h]`` and ``down [h, I]``
    (``hidden`` is the experts' width h, ``moe_hidden_size``)."""

    gate_up: list[ExpertLinear]
    down: list[ExpertLinear]
    intermediate: int
    hidden: int

    @property
    def num_experts(self) -> int:
        return len(self.down)

    def __post_init__(self) -> None:
        self.native_pointers: Optional[torch.Tensor] = None  # int64 [4, E] (int4) or [2, E] (bf16), see native
        self.native_kind: Optional[str] = None  # "int4" or "bf16": which fused native call runs the layer
        self.native_max_tokens = 0  # the fused native call is taken while every expert has fewer tokens
        linears = self.gate_up + self.down
        if all(isinstance(lin, Int4Linear) and lin.kernel == "native" and lin.codes is not None for lin in linears):
            one_shape = lambda ls: len({(l.codes.shape, l.scale_zero.shape, l.group_size) for l in ls}) == 1  # noqa: E731
            if one_shape(self.gate_up) and one_shape(self.down):
                self.native_kind = "int4"
                self.native_pointers = torch.tensor(
                    [[lin.codes.data_ptr() for lin in self.gate_up], [lin.scale_zero.data_ptr() for lin in self.gate_up],
                     [lin.codes.data_ptr() for lin in self.down], [lin.scale_zero.data_ptr() for lin in self.down]],
                    dtype=torch.int64)
        elif all(isinstance(lin, DenseLinear) and lin.gemv is not None and lin.weight.dtype == torch.bfloat16
                 and lin.weight.is_contiguous() for lin in linears):  # the BF16 GEMV is built and used here
            shapes = {tuple(lin.weight.shape) for lin in self.gate_up}, {tuple(lin.weight.shape) for lin in self.down}
            if shapes == ({(2 * self.intermediate, self.hidden)}, {(self.hidden, self.intermediate)}):
                self.native_kind = "bf16"
                self.native_pointers = torch.tensor([[lin.weight.data_ptr() for lin in self.gate_up],
                                                     [lin.weight.data_ptr() for lin in self.down]], dtype=torch.int64)
        self.native_rows: Optional[list[int]] = None  # the addresses of native_pointers' rows (native.row_addresses)
        # The extension's one-call MoE (checks, fit test, allocation and the fused kernel): ``native_call(
        # native_args_address, z, weights, ids, post_norm, post_eps, threads)`` -> y, or None where it does not apply.
        self.native_args: Optional[MoeExpertsArgs] = None
        self.native_args_address = 0
        self.native_call = None
        if self.native_kind is not None:
            self.native_rows = native.row_addresses(self.native_pointers)
            fast = fast_ops()
            if fast is not None:
                if self.native_kind == "int4":
                    gu, dn = self.gate_up[0], self.down[0]
                    self.native_args = MoeExpertsArgs(0, *self.native_rows, self.num_experts, self.hidden,
                                                      self.intermediate, gu.group_size, dn.group_size,
                                                      gu.padded_out_features, dn.padded_out_features, 0)
                else:
                    gu_w, dn_w = self.native_rows
                    self.native_args = MoeExpertsArgs(1, gu_w, None, dn_w, None, self.num_experts, self.hidden,
                                                      self.intermediate, 0, 0, 0, 0, 0)
                self.native_args_address = ctypes.addressof(self.native_args)
                self.native_call = fast.moe
            self.refresh_native_limit()

    def refresh_native_limit(self) -> None:
        """Tokens per expert below which the fused native call runs: the smaller measured crossover of the first
        expert's two projections (INT4: to the dense path; BF16: away from the native GEMV), and for INT4 at least
        :data:`INT4_FUSED_MIN_TOKENS`."""
        pick = (lambda lin: lin.crossover) if self.native_kind == "int4" else (lambda lin: lin.gemv_crossover)
        crossovers = [pick(lin) for lin in (self.gate_up[0], self.down[0]) if pick(lin) is not None]
        limit = min(crossovers, default=1 << 62)
        if self.native_kind == "int4":
            limit = max(limit, INT4_FUSED_MIN_TOKENS)
        self.native_max_tokens = limit - 1
        if self.native_args is not None:
            self.native_args.max_tokens = self.native_max_tokens

    def native_fits(self, tokens: int, ids: torch.Tensor) -> bool:
        if self.native_pointers is None:
            return False
        if tokens <= self.native_max_tokens:
            return True
        return int(torch.bincount(ids.reshape(-1), minlength=self.num_experts).max()) <= self.native_max_tokens


def moe_forward(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: XeonExperts,
                post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
    """``y[t] = sum_j w[t,j] * rms_norm(round(down(silu(gate(z)) * up(z))), post_norm, scale_first=True)`` -> fp32
    ``[T, h]``: each expert's output rounded to z's dtype, then the ONE post-expert norm weight ``[h]`` shared by all
    experts, applied scale first (product rounded, then normalised, output rounded), then the routing weight."""
    if experts.native_call is not None:  # decode: the whole op in one extension call (None: the paths below)
        y = experts.native_call(experts.native_args_address, z, weights, ids, post_norm, post_eps,
                                torch.get_num_threads())
        if y is not None:
            return y
    T, k = ids.shape
    h, inter = experts.hidden, experts.intermediate
    if z.shape != (T, h):
        raise ValueError(f"moe: z has shape {tuple(z.shape)}; expected [T={T}, h={h}] for these ids and experts")
    if post_norm.shape != (h,):
        raise ValueError(f"moe: the post-expert norm weight must be [h={h}] (one weight shared by all experts); "
                         f"got {tuple(post_norm.shape)}")
    if z.dtype in (torch.bfloat16, torch.float32) and experts.native_fits(T, ids):
        z = z if z.is_contiguous() else z.contiguous()
        # no .to()/.contiguous() dispatch when already so (the router's int64 ids and fp32 weights): ~1 us each
        ids64 = ids if ids.dtype is torch.int64 and ids.is_contiguous() else ids.to(torch.int64).contiguous()
        w32 = weights if weights.dtype is torch.float32 and weights.is_contiguous() else \
            weights.to(torch.float32).contiguous()
        if experts.native_kind == "bf16":
            return native.bf16_moe(experts.native_pointers, z, ids64, w32, post_norm, post_eps, inter,
                                   experts.native_rows)
        gu, dn = experts.gate_up[0], experts.down[0]
        return native.int4_moe(experts.native_pointers, z, ids64, w32, post_norm, post_eps, inter,
                               (gu.group_size, dn.group_size), (gu.padded_out_features, dn.padded_out_features),
                               experts.native_rows)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # rows grouped by expert
    token = order // k  # [T*k] token of each grouped row
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    z_rows = z.to(torch.bfloat16)[token]  # [T*k, h]; the INT4 kernel takes bf16 activations
    expert_out = torch.empty(T * k, h, dtype=z.dtype)  # each expert's output rounded to z's dtype, as the contract has it
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gu = experts.gate_up[e](z_rows[rows]).float()  # [n, 2I]
        act = F.silu(gu[:, :inter]) * gu[:, inter:]  # SwiGLU in fp32
        expert_out[rows] = experts.down[e](act.to(torch.bfloat16))
        start += n
    # The shared post-expert norm first (scale first, rounded to z's dtype twice), then the routing weight, then the
    # fp32 sum (never a norm of the sum).
    scaled = (expert_out.float() * post_norm.float()).to(z.dtype)
    normed = F.rms_norm(scaled.float(), (h,), eps=post_eps).to(z.dtype)
    y = torch.zeros(T, h, dtype=torch.float32)
    y.index_add_(0, token, normed.float() * weights.reshape(-1)[order].float()[:, None])
    return y
