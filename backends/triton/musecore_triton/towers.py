"""The vision and audio towers' ops (``musecore.ops.TOWER_OPS``) for the GPU backends.

``varlen_attention``, ``causal_conv1d`` and ``rope`` are Triton kernels (:mod:`musecore_triton.kernels`);
``layer_norm`` and ``gelu`` are PyTorch's own GPU kernels, which are already what a Triton kernel
would be: one pass that reads 16-bit values, computes in fp32 (``opmath``/``acc_type``) and rounds
once, the reference's numerics; a Triton copy would add a kernel to maintain and gain nothing. Where
the weights' dtype differs from the activations' (an fp32 LayerNorm weight on bf16 activations)
layer_norm takes the reference's fp32 path, so a weight is never rounded.

:data:`TOWER_REASONS` is what a backend's ``supports()`` says about each (one text, every vendor).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from musecore_triton.kernels.causal_conv import causal_conv1d  # noqa: F401  (re-exported: the op)
from musecore_triton.kernels.rope import rope  # noqa: F401
from musecore_triton.kernels.varlen_attention import MAX_HEAD_DIM, varlen_attention  # noqa: F401

TOWER_REASONS: dict[str, str] = {
    "layer_norm": "PyTorch's fused LayerNorm kernel (one pass, fp32 statistics and affine, one rounding)",
    "gelu": "PyTorch's element-wise GELU kernel (fp32 erf or tanh math, one rounding)",
    "varlen_attention": "Triton flash attention over packed segments (cu_seqlens), fp32 online softmax, "
                        f"head dims up to {MAX_HEAD_DIM} (padded to a power of two)",
    "causal_conv1d": "Triton depthwise causal conv kernel, fp32 taps, the streaming state read in place",
    "rope": "Triton kernel: one token's heads per program, fp32 math",
}


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float) -> torch.Tensor:
    """The ``layer_norm`` op: ``F.layer_norm`` in x's dtype (fp32 inside), or in fp32 when the weight's
    dtype differs from x's."""
    params = [t for t in (weight, bias) if t is not None]
    if all(t.dtype == x.dtype for t in params):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return F.layer_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(),
                        None if bias is None else bias.float(), eps).to(x.dtype)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The ``gelu`` op: exact erf GELU (``"none"``) or the tanh approximation (``"tanh"``), x's dtype."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate={approximate!r}; choose 'none' (exact erf) or 'tanh'")
    return F.gelu(x, approximate=approximate)


def tower_kernel_limit(op: str, shape: dict) -> Optional[str]:
    """Why a tower op's kernel cannot run these sizes, or None."""
    head_dim = shape.get("head_dim")
    if op == "varlen_attention" and head_dim is not None and head_dim > MAX_HEAD_DIM:
        return f"the varlen attention Triton kernel takes head dims up to {MAX_HEAD_DIM}; got {head_dim}"
    if op == "rope" and head_dim is not None and head_dim % 2:
        return f"rope rotates halves of the head dim, which must be even; got {head_dim}"
    return None
