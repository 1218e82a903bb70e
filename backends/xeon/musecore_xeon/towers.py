"""The vision and audio towers' ops (``musecore.ops.TOWER_OPS``) on x86 CPUs: PyTorch's CPU kernels, run with
the backend's threads.

* ``varlen_attention``: ``F.scaled_dot_product_attention`` (a flash kernel on CPU) per segment length: the
  segments of one length (the 1024-token 32x32-patch windows of a large image, the frames of a video) are
  gathered into one batch and run in one call, instead of a loop of small calls or one block-diagonal mask
  whose cost grows with the square of the whole packed sequence. Computed in the backend's dense dtype
  (fp32 on CPUs without native BF16, where it is both exact and faster).
* ``causal_conv1d``: the state prepended, then ``F.conv1d(groups=C)`` (oneDNN's depthwise convolution) in
  fp32, the reference's math.
* ``layer_norm``, ``gelu``: PyTorch's vectorised CPU kernels, which compute 16-bit inputs in fp32 and round
  once (the reference's numerics without its fp32 copies); ``rope``: the reference's formula with fused
  multiply-adds.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch
import torch.nn.functional as F

from musecore.ops import reference as ref

TOWER_REASONS = {
    "layer_norm": "PyTorch's vectorised CPU LayerNorm (fp32 statistics, one rounding)",
    "gelu": "PyTorch's vectorised CPU GELU (fp32 erf / tanh math, one rounding)",
    "varlen_attention": "scaled_dot_product_attention (CPU flash kernel) once per distinct segment length, the "
                        "segments of that length batched; in the backend's dense compute dtype",
    "causal_conv1d": "state prepended, then oneDNN depthwise conv1d (groups=C) in fp32",
    "rope": "PyTorch ops in fp32 (fused multiply-adds), one rounding",
}


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float) -> torch.Tensor:
    """LayerNorm over the last dim in x's dtype (fp32 inside); the reference's fp32 path when the parameters'
    dtype differs from x's, so an fp32 weight is never rounded."""
    if all(t is None or t.dtype == x.dtype for t in (weight, bias)):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return ref.layer_norm(x, weight, bias, eps)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Exact erf GELU (``"none"``) or its tanh approximation (``"tanh"``), in x's dtype."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate={approximate!r}; choose 'none' (exact erf) or 'tanh'")
    return F.gelu(x, approximate=approximate)


def _segments(cu_seqlens: torch.Tensor, n: int) -> list[int]:
    """``cu_seqlens`` as a list, after a one-line error when it is not ``0 = cu[0] <= ... <= cu[S] = n``."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"varlen_attention: cu_seqlens must be int32 [segments+1] (cumulative segment lengths from "
                         f"0 to N); got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != n or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"varlen_attention: cu_seqlens must rise from 0 to N={n} without decreasing; got "
                         f"{bounds[:8]}{' ...' if len(bounds) > 8 else ''}")
    return bounds


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float, *,
                     compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bidirectional attention inside each segment ``[cu[i], cu[i+1])`` of packed ``[N, heads, d]`` q/k/v."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"varlen_attention: q, k, v must all be [N, heads, head_dim]; got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    bounds = _segments(cu_seqlens, q.shape[0])
    by_length: dict[int, list[int]] = defaultdict(list)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop > start:
            by_length[stop - start].append(start)
    out = torch.empty_like(q)
    for length, starts in by_length.items():
        # [G, L] token indices of the G segments of this length (a slice when there is one: no gather)
        index = (slice(starts[0], starts[0] + length) if len(starts) == 1
                 else (torch.tensor(starts)[:, None] + torch.arange(length)).to(q.device))
        qs, ks, vs = (t[index].to(compute_dtype).reshape(len(starts), length, *t.shape[1:]) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), scale=scale)
        out[index] = o.transpose(1, 2).to(q.dtype).reshape(out[index].shape)  # [G, L, nh, d] back in place
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``x [B,C,T]`` left-padded with ``state [B,C,K-1]`` (zeros when None), fp32 math;
    returns ``(y, state')`` in x's dtype, ``state'`` the last K-1 columns of the padded input."""
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be [batch, channels, time]; got {list(x.shape)}")
    B, C, _ = x.shape
    if weight.dim() != 3 or weight.shape[0] != C or weight.shape[1] != 1:
        raise ValueError(f"causal_conv1d: weight must be [channels={C}, 1, kernel] (depthwise); got "
                         f"{list(weight.shape)}")
    K = weight.shape[2]
    if state is not None and tuple(state.shape) != (B, C, K - 1):
        raise ValueError(f"causal_conv1d: state must be [batch={B}, channels={C}, kernel-1={K - 1}] (the previous "
                         f"chunk's last input columns); got {list(state.shape)}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"causal_conv1d: bias must be [{C}]; got {list(bias.shape)}")
    prev = state.float() if state is not None else x.new_zeros(B, C, K - 1, dtype=torch.float32)
    xp = torch.cat([prev, x.float()], dim=-1)  # [B, C, K-1+T]
    y = F.conv1d(xp, weight.float(), None if bias is None else bias.float(), groups=C)
    return y.to(x.dtype), xp[..., xp.shape[-1] - (K - 1):].to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with one ``cos/sin [N, d]`` row per token for every head, fp32 math."""
    if x.dim() != 3 or tuple(cos.shape) != (x.shape[0], x.shape[2]) or cos.shape != sin.shape:
        raise ValueError(f"rope: x must be [N, heads, d] and cos/sin [N, d]; got {list(x.shape)}, {list(cos.shape)}, "
                         f"{list(sin.shape)}")
    xf = x.float()
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    return torch.addcmul(xf * c, ref.rotate_half(xf), s).to(x.dtype)
