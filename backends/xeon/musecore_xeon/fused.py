"""One extension call for a layer's whole MoE block at decode sizes (issue 30, item 3: the decode step's fixed cost).

``musecore.model.MoE`` runs router, pooler, pre-expert norm, experts, a cast and unpooler as six ops: six trips from
Python into C, a dozen tensors and views per layer and token. Each of those kernels is already a C call of this
backend; :func:`fuse_moe_block` binds their constant arguments (weight structs, norms, shapes) once per layer into one
C struct (``moe_block_t`` of ``csrc/binding.cpp``), and the extension's ``moe_block`` runs the six kernels in the same
order with the same arguments: the same bits as the separate ops, in one call, with one output tensor.

It applies where every piece is this backend's decode path (the router's fp32 weight, both projections on their bound
GEMV for the row count, the experts' fused call) and the input is a contiguous bf16 ``[..., H]`` of at most
``max_rows`` rows; elsewhere the block returns None and the model runs the separate ops. ``MUSECORE_XEON_FUSED_MOE=0``
turns it off.

Example::

    block = fuse_moe_block(model.layers[3].mlp)   # None: not fusable here (the reason is logged at debug level)
    y = block(m)                                  # [B, T, H] bf16, or None for inputs it does not take
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, Callable, Optional

import torch

from musecore_xeon.kernels.dense import DenseLinear
from musecore_xeon.kernels.int4 import Int4Linear
from musecore_xeon.ops import NATIVE_ATTENTION_MAX_QUERIES, fast_ops

FUSED_MOE_ENV = "MUSECORE_XEON_FUSED_MOE"
log = logging.getLogger("musecore.xeon")


class MoeBlockArgs(ctypes.Structure):
    """``moe_block_t`` of ``csrc/binding.cpp``: one MoE block's constant arguments."""

    _fields_ = [("router_w", ctypes.c_void_p), ("router_bias", ctypes.c_void_p), ("pooler", ctypes.c_void_p),
                ("unpooler", ctypes.c_void_p), ("pooler_kind", ctypes.c_int64), ("unpooler_kind", ctypes.c_int64),
                ("pre_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("pre_norm_bf16", ctypes.c_int64),
                ("post_norm_bf16", ctypes.c_int64), ("experts", ctypes.c_void_p)] + [
        (name, ctypes.c_int64) for name in ("hidden", "pooled", "top_k", "max_rows")] + [
        (name, ctypes.c_double) for name in ("multiplier", "scaling", "eps", "post_eps")]


def disabled() -> bool:
    return os.environ.get(FUSED_MOE_ENV, "").strip().lower() in ("0", "off", "no", "false")


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


def _norm(weight: Optional[torch.Tensor], what: str) -> tuple[Optional[torch.Tensor], str]:
    if weight is None or weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) \
            or not weight.is_contiguous():
        return None, f"the {what} weight is not a contiguous bf16/fp32 CPU tensor"
    return weight, ""


def fuse_moe_block(block: Any) -> Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]]:
    """``block`` (a ``musecore.model.MoE`` whose weights this backend prepared) -> ``fused(m)``: the block's output
    for ``m [..., H]`` in one extension call, or None from ``fused`` where it does not take ``m``; None here when the
    block cannot be fused (the reason at debug level). The closure keeps every tensor it points to alive and checks on
    each call that the block still holds the same weights (anything replaced since: None, the separate ops run)."""
    fused, why = _fuse(block)
    if fused is None:
        log.debug("layer %s: MoE block not fused: %s", getattr(block, "layer", "?"), why)
    return fused


def _fuse(block: Any) -> tuple[Optional[Callable], str]:
    if disabled():
        return None, f"{FUSED_MOE_ENV}=0"
    fast = fast_ops()
    if fast is None or not hasattr(fast, "moe_block"):
        return None, "the CPython extension is not available"
    router, bias = block.router, block.correction_bias
    if router is None or router.dtype is not torch.float32 or not router.is_contiguous() or router.dim() != 2:
        return None, "the router weight is not a contiguous fp32 [E, H] tensor"
    if bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous()):
        return None, "the router's correction bias is not a contiguous fp32 tensor"
    experts = getattr(block.experts, "extra", {}).get("xeon")
    if experts is None or experts.native_call is None or experts.native_args is None:
        return None, "the experts have no fused native call"
    pooler, why = _bound_gemv(block.pre_expert_proj)
    if pooler is None:
        return None, "pooler: " + why
    unpooler, why = _bound_gemv(block.post_expert_proj)
    if unpooler is None:
        return None, "unpooler: " + why
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
    address, call, get_threads = ctypes.addressof(args), fast.moe_block, torch.get_num_threads
    held = (router, bias, block.experts, block.pre_expert_proj, block.post_expert_proj, pre_norm, post_norm)
    keep = (args, experts, pooler[3], unpooler[3])  # the structs and bound GEMVs the addresses point into

    def fused(m: torch.Tensor) -> Optional[torch.Tensor]:
        if (block.router is not held[0] or block.correction_bias is not held[1] or block.experts is not held[2]
                or block.pre_expert_proj is not held[3] or block.post_expert_proj is not held[4]
                or block.pre_expert_norm is not held[5] or block.post_expert_norm is not held[6]):
            return None  # a weight was replaced after fusing: the separate ops (bound to the new weights) run
        return call(address, m, get_threads())

    fused.keep = keep  # type: ignore[attr-defined]
    return fused, ""
