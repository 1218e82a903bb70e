"""One extension call for a layer's whole attention or MoE block at decode (issue 30, item 3: the decode step's fixed
cost).

``musecore.model.MoE`` runs router, pooler, pre-expert norm, experts, a cast and unpooler as six ops, and
``Attention`` runs the fused q/k/v/gate projection, the q/k norms and RoPE, the KV write, attention, the head norm
and gate and o_proj as six more: a dozen trips from Python into C, and two dozen tensors and views, per layer and
token. Each of those kernels is already a C call of this backend. :func:`fuse_block` binds their constant arguments
(weight structs, norms, shapes) once per block into one C struct (``moe_block_t`` / ``attention_block_t`` of
``csrc/binding.cpp``), and the extension's ``moe_block`` / ``attention_block`` runs the kernels in the same order
with the same arguments: the same bits as the separate ops, in one call, with one output tensor.

A block is fused where every piece is this backend's decode path (the router's fp32 weight, the projections on their
bound GEMVs, the experts' fused call, the loader's fused q/k/v/gate weight). A call is taken for a contiguous bf16
input of at most ``max_rows`` rows (MoE) or one new token of one sequence through a bf16, non-static KV cache
(attention); elsewhere the fused block returns None and the model runs the separate ops.
``MUSECORE_XEON_FUSED_BLOCKS=0`` turns fusion off.

Example::

    block = fuse_block(model.layers[3].mlp)   # None: not fusable here (the reason is logged at debug level)
    y = block(m)                              # [B, T, H] bf16, or None for inputs it does not take
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, Callable, Optional

import torch

from musecore.model import Attention, MoE
from musecore_xeon.kernels.dense import DenseLinear
from musecore_xeon.kernels.int4 import Int4Linear
from musecore_xeon.ops import NATIVE_ATTENTION_MAX_QUERIES, fast_ops

FUSED_ENV = "MUSECORE_XEON_FUSED_BLOCKS"
log = logging.getLogger("musecore.xeon")


class AttentionBlockArgs(ctypes.Structure):
    """``attention_block_t`` of ``csrc/binding.cpp``: one attention block's constant arguments."""

    _fields_ = [("in_proj", ctypes.c_void_p), ("o_proj", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("in_kind", "o_kind", "hidden", "nq", "nkv", "d", "window")] + [
        (name, ctypes.c_double) for name in ("eps", "q_scale", "scale")]


class MoeBlockArgs(ctypes.Structure):
    """``moe_block_t`` of ``csrc/binding.cpp``: one MoE block's constant arguments."""

    _fields_ = [("router_w", ctypes.c_void_p), ("router_bias", ctypes.c_void_p), ("pooler", ctypes.c_void_p),
                ("unpooler", ctypes.c_void_p), ("pooler_kind", ctypes.c_int64), ("unpooler_kind", ctypes.c_int64),
                ("pre_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("pre_norm_bf16", ctypes.c_int64),
                ("post_norm_bf16", ctypes.c_int64), ("experts", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("hidden", "pooled", "top_k", "max_rows")] + [
        (name, ctypes.c_double) for name in ("multiplier", "scaling", "eps", "post_eps")]


def disabled() -> bool:
    return os.environ.get(FUSED_ENV, "").strip().lower() in ("0", "off", "no", "false")


def _bound_gemv(weight: Any) -> tuple[Optional[tuple[int, int, int, Any]], str]:
    """``((kind, address, max_rows, gemv), "")`` for a projection on its bound native GEMV (kind 0 INT4, 1 BF16), or
    ``(None, why not)``."""
    resident = getattr(weight, "extra", {}).get("linear")
    if isinstance(resident, Int4Linear):
        gemv = resident.gemv
        if gemv is None or gemv.codes is not resident.codes or getattr(gemv, "binding", "") != "extension":
            return None, "the INT4 projection has no bound native GEMV"
        rows = (1 << 30) if resident.crossover is None else resident.crossover - 1
        return (0, gemv.args_ptr, rows, gemv), ""
    if isinstance(resident, DenseLinear):
        gemv = resident.gemv
        if gemv is None or resident.gemv_below_numel <= 0 or getattr(gemv, "binding", "") != "extension":
            return None, "the BF16 projection has no native GEMV"
        return (1, gemv.args_ptr, (resident.gemv_below_numel - 1) // resident.in_features, gemv), ""
    return None, f"the projection is not a xeon resident weight ({type(resident).__name__})"


def _bound_gemvs(**weights: Any) -> tuple[Optional[list[tuple[int, int, int, Any]]], str]:
    """Each named projection's :func:`_bound_gemv`, in order, or ``(None, "name: why not")`` for the first without."""
    found = []
    for name, weight in weights.items():
        gemv, why = _bound_gemv(weight)
        if gemv is None:
            return None, f"{name}: {why}"
        found.append(gemv)
    return found, ""


def _norm(weight: Optional[torch.Tensor], what: str) -> tuple[Optional[torch.Tensor], str]:
    if weight is None or weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) \
            or not weight.is_contiguous():
        return None, f"the {what} weight is not a contiguous bf16/fp32 CPU tensor"
    return weight, ""


def fuse_block(block: Any) -> Optional[Callable[..., Optional[torch.Tensor]]]:
    """``block`` (a ``musecore.model.MoE`` or ``Attention`` whose weights this backend prepared) -> a callable with
    the block's call signature computing its output in one extension call, or returning None for inputs it does not
    take; None here when the block cannot be fused (the reason at debug level). The callable keeps every tensor it
    points to alive and checks on each call that the block still holds the same weights (anything replaced since:
    None, and the separate ops run)."""
    fast = fast_ops()
    if disabled():
        fused, why = None, f"{FUSED_ENV}=0"
    elif fast is None or not hasattr(fast, "moe_block"):
        fused, why = None, "the CPython extension is not available"
    elif isinstance(block, MoE):
        fused, why = _fuse_moe(block, fast)
    elif isinstance(block, Attention):
        fused, why = _fuse_attention(block, fast)
    else:
        fused, why = None, f"no fused form of {type(block).__name__}"
    if fused is None:
        log.debug("layer %s: %s not fused: %s", getattr(block, "layer", "?"), type(block).__name__, why)
    return fused


def _fuse_moe(block: Any, fast: Any) -> tuple[Optional[FusedBlock], str]:
    router, bias = block.router, block.correction_bias
    if router is None or router.dtype is not torch.float32 or not router.is_contiguous() or router.dim() != 2:
        return None, "the router weight is not a contiguous fp32 [E, H] tensor"
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
        return None, "the router's correction bias is not a contiguous fp32 tensor"
    experts = getattr(block.experts, "extra", {}).get("xeon")
    if experts is None or experts.native_call is None or experts.native_args is None:
        return None, "the experts have no fused native call"
    gemvs, why = _bound_gemvs(pooler=block.pre_expert_proj, unpooler=block.post_expert_proj)
    if gemvs is None:
        return None, why
    pooler, unpooler = gemvs
    pre_norm, why = _norm(block.pre_expert_norm, "pre-expert norm")
    post_norm, why2 = _norm(block.post_expert_norm, "post-expert norm")
    if pre_norm is None or post_norm is None:
        return None, why or why2
    E, H = router.shape
    h = experts.hidden
    if E != experts.num_experts or block.pre_expert_proj.extra["linear"].out_features != h \
            or block.post_expert_proj.extra["linear"].out_features != H \
            or block.post_expert_proj.extra["linear"].in_features != h or pre_norm.numel() != h \
            or post_norm.numel() != h or not 0 < block.top_k <= E:
        return None, "the block's shapes do not chain (router, pooler, experts, unpooler)"
    max_rows = min(NATIVE_ATTENTION_MAX_QUERIES, pooler[2], unpooler[2])
    if max_rows < 1:
        return None, "the projections' GEMVs take no rows"
    args = MoeBlockArgs(router.data_ptr(), 0 if bias is None else bias.data_ptr(), pooler[1], unpooler[1],
                        pooler[0], unpooler[0], pre_norm.data_ptr(), post_norm.data_ptr(),
                        int(pre_norm.dtype is torch.bfloat16), int(post_norm.dtype is torch.bfloat16),
                        experts.native_args_address, H, h, block.top_k, max_rows, float(block.multiplier),
                        float(block.scaling), float(block.eps), float(block.post_eps))
    held = (router, bias, block.experts, block.pre_expert_proj, block.post_expert_proj, pre_norm, post_norm)
    return FusedMoE(block, args, fast.moe_block, held, (experts, pooler[3], unpooler[3])), ""


def _fuse_attention(block: Any, fast: Any) -> tuple[Optional[FusedBlock], str]:
    problem = block.fused_projection_problem()
    if problem:
        return None, problem
    fused_proj = block.in_proj
    nq, nkv, d = block.nq, block.nkv, block.d
    if block.window is not None and block.window <= 0:
        return None, f"window {block.window}"
    gemvs, why = _bound_gemvs(**{"q/k/v/gate": fused_proj.weight, "o_proj": block.o_proj})
    if gemvs is None:
        return None, why
    in_proj, o_proj = gemvs
    hidden = block.o_proj.extra["linear"].out_features
    if fused_proj.weight.extra["linear"].in_features != hidden or block.o_proj.extra["linear"].in_features != nq * d:
        return None, "the projections' shapes do not chain"
    args = AttentionBlockArgs(in_proj[1], o_proj[1], in_proj[0], o_proj[0], hidden, nq, nkv, d,
                              -1 if block.window is None else block.window, float(block.eps), float(block.q_scale),
                              float(block.scale))
    held = (fused_proj, fused_proj.weight, block.o_proj)
    return FusedAttention(block, args, fast.attention_block, held, (in_proj[3], o_proj[3])), ""


class FusedBlock:
    """A block's one-call form: its bound arguments (``args``, a ctypes struct whose address the extension reads), the
    extension function, the block's weights as bound (``held``: checked by identity on every call) and the objects
    the struct points into (``keep``: alive as long as this is)."""

    __slots__ = ("block", "args", "address", "call", "held", "keep")

    def __init__(self, block: Any, args: ctypes.Structure, call: Callable, held: tuple, keep: tuple) -> None:
        self.block, self.args, self.address, self.call = block, args, ctypes.addressof(args), call
        self.held, self.keep = held, keep


class FusedMoE(FusedBlock):
    """``fused(m)``: the MoE block's output for ``m [..., H]`` bf16 of at most ``args.max_rows`` rows, or None."""

    __slots__ = ()

    def __call__(self, m: torch.Tensor) -> Optional[torch.Tensor]:
        block, held = self.block, self.held
        if (block.router is not held[0] or block.correction_bias is not held[1] or block.experts is not held[2]
                or block.pre_expert_proj is not held[3] or block.post_expert_proj is not held[4]
                or block.pre_expert_norm is not held[5] or block.post_expert_norm is not held[6]):
            return None  # a weight was replaced after fusing: the separate ops (bound to the new weights) run
        return self.call(self.address, m, torch.get_num_threads())


class FusedAttention(FusedBlock):
    """``fused(a, positions, rope, cache)``: the attention block's output for one new token of one sequence through
    a bf16, non-static cache layer (written as the separate ops write it), or None."""

    __slots__ = ()

    def __call__(self, a: torch.Tensor, positions: torch.Tensor, rope: Any, cache: Any) -> Optional[torch.Tensor]:
        block, held = self.block, self.held
        if block.in_proj is not held[0] or held[0].weight is not held[1] or block.o_proj is not held[2] \
                or cache is None or positions.shape != (1, 1):
            return None
        lc = cache[block.layer]
        if lc.static or lc.k.dtype is not torch.bfloat16 or lc.kv_format == "fp8":
            return None
        position = int(positions)
        if position < 0:
            return None
        lc.check_capacity(position)  # before any write: the error the separate path gives
        slot = position % lc.capacity if lc.ring else position
        readable = lc.capacity if lc.ring else max(lc.used, position + 1)
        cos, sin = rope if block.rope else (None, None)
        out = self.call(self.address, a, position, cos, sin, lc.k, lc.v, lc.positions, slot, readable,
                        torch.get_num_threads())
        if out is not None and not lc.ring:
            lc.used = max(lc.used, position + 1)
        return out
