"""The reference implementation of every op: plain PyTorch, fp32 math, slow and obviously right.

This is the oracle of every test (``musecore.testing``) and the definition a backend reproduces.
Inputs may be any float dtype; each op computes in fp32 and returns the input's dtype unless its
contract (``musecore.ops``) says otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from musecore.ops import ExpertWeights, Weight


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * (mean(x^2) + eps)^-1/2`` over the last dim, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, scale_first: bool = False) -> torch.Tensor:
    if scale_first:  # transformers' InputScaledRMSNorm: scale, round to the activation dtype, normalise
        scaled = (x.float() * weight.float()).to(x.dtype)
        return rms(scaled, eps).to(x.dtype)
    y = rms(x, eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def residual_gate_coefficients(gate: torch.Tensor, temperature: float,
                               eps: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """``(alpha, beta)`` of a residual gate parameter, fp32: ``w = g / T``, ``beta = sigmoid(w)``,
    ``alpha = sqrt(max(sigmoid(-w) * (1 + beta), eps))``. The loader computes them once per layer."""
    w = gate.float() / temperature
    beta = torch.sigmoid(w)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=eps))
    return alpha, beta


def residual_norm(residual: torch.Tensor, out: torch.Tensor, post_weight: Optional[torch.Tensor],
                  alpha: torch.Tensor, beta: torch.Tensor, next_weight: torch.Tensor, post_eps: float,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = rms_norm(out, post_weight, post_eps, scale_first=post_weight is not None)
    new_residual = (alpha.float() * residual.float() + beta.float() * h.float()).to(residual.dtype)
    return new_residual, rms_norm(new_residual, next_weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                 eps: float, q_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    qn, kn = rms(q, eps) * q_scale, rms(k, eps)
    if cos is not None:
        cos, sin = cos.float()[:, :, None, :], sin.float()[:, :, None, :]  # [B,T,1,d]
        qn = qn * cos + rotate_half(qn) * sin
        kn = kn * cos + rotate_half(kn) * sin
    return qn.to(q.dtype), kn.to(k.dtype)


def visibility_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int]) -> torch.Tensor:
    """``[B,T,S]`` bool: key j is visible to query i (causal, optional sliding window, valid slot)."""
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if window is not None:
        visible &= (qp - kp) < window
    return visible


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor, window: Optional[int], scale: float,
              k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> torch.Tensor:
    B, T, nq, d = q.shape
    nkv = k.shape[2]
    kf = k.float() * (k_scale if k_scale is not None else 1.0)
    vf = v.float() * (v_scale if v_scale is not None else 1.0)
    group = nq // nkv  # query head h reads kv head h // group
    kf = kf.repeat_interleave(group, dim=2)  # [B,S,nq,d]
    vf = vf.repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), kf) * scale  # [B,nq,T,S]
    visible = visibility_mask(q_pos, k_pos, window)[:, None]  # [B,1,T,S]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query that sees nothing -> zeros
    out = torch.einsum("bhts,bshd->bthd", probs, vf)
    return out.to(q.dtype)


def head_norm_gate(o: torch.Tensor, gate_logits: torch.Tensor, eps: float) -> torch.Tensor:
    return (rms(o, eps) * torch.sigmoid(gate_logits.float())).to(o.dtype)


def fake_quantize_activation(x: torch.Tensor, act_format: Optional[str],
                             input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """What a W4A4 / W8A8 target does to activations before its matmul, as dequantized values.

    ``fp8-token`` (the h200-fp8 profile) is FP8 E4M3 with a dynamic scale per token (row).
    ``int8-token`` (the tpu-v6e-int8 profile) is symmetric INT8 with a dynamic scale per token:
    ``s_t = amax(|x_t|) / 127`` in fp32 (1.0 for a zero row), ``round_half_even(x / s_t)`` clamped to
    +-127, times ``s_t``, returned in fp32: an int8 MXU kernel multiplies its exact int32 sums by
    the f32 scales, so x-hat is never rounded to bf16.

    NVFP4 activations need a global scale: the checkpoint's calibrated ``input_scale`` when it has
    one (ModelOpt exports do); otherwise a dynamic per-token one, ``amax(|x|) / (6*448)`` per row,
    so a token's numerics never depend on the other tokens of its batch.
    """
    if act_format is None:
        return x
    from musecore_quant import fake_quantize_activation as fq
    from musecore_quant.formats.nvfp4 import nvfp4_input_scale
    if act_format == "nvfp4" and input_scale is None:
        input_scale = nvfp4_input_scale(x.float().abs().amax(-1)).clamp_min(torch.finfo(torch.float32).tiny)
    if act_format == "fp8-token":  # FP8 E4M3, dynamic per token: amax(|x_t|) / 448 per row (1.0 for a zero row)
        amax = x.float().abs().amax(-1, keepdim=True)
        scale = amax / torch.tensor(448.0)
        return fq(x, "fp8", input_scale=torch.where(scale == 0, torch.ones_like(scale), scale))
    if act_format == "int8-token":  # INT8, dynamic per token: amax(|x_t|) / 127 per row (1.0 for a zero row)
        from musecore_quant.formats.int8 import int8_scale
        xf = x.float()
        return fq(xf, "int8", input_scale=int8_scale(xf.abs().amax(-1, keepdim=True)))
    return fq(x, act_format, input_scale=input_scale)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    xq = fake_quantize_activation(x, w.act_format, w.input_scale)
    return (xq.float() @ w.data.float().T).to(x.dtype)


def embedding(ids: torch.Tensor, table: Weight) -> torch.Tensor:
    return F.embedding(ids, table.data)


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, multiplier: float,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.sigmoid((x.float() @ weight.float().T) * multiplier)  # [T,E]
    ids = torch.topk(scores + bias.float(), k, dim=-1).indices  # the bias only chooses  # [T,k]
    weights = scores.gather(-1, ids)
    return weights / (weights.sum(-1, keepdim=True) + 1e-15) * scaling, ids


def expert_forward(z: torch.Tensor, experts: ExpertWeights, e: int) -> torch.Tensor:
    """SwiGLU expert ``e`` on tokens ``z [n,h]``: ``down(silu(gate(z)) * up(z))``, fp32 math."""
    pick = lambda s: None if s is None else s[e]  # noqa: E731
    zq = fake_quantize_activation(z.float(), experts.act_format, pick(experts.gate_up_input_scale))
    h = F.silu(zq @ experts.gate[e].float().T) * (zq @ experts.up[e].float().T)
    hq = fake_quantize_activation(h, experts.act_format, pick(experts.down_input_scale))
    return hq @ experts.down[e].float().T


def moe(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
        post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
    y = torch.zeros(z.shape[0], z.shape[-1], dtype=torch.float32, device=z.device)
    for e in ids.unique().tolist():  # only routed experts run
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out = expert_forward(z[tok], experts, e).to(z.dtype)  # the expert's output, as a kernel writes it
        out = rms_norm(out, post_norm, post_eps, scale_first=True)  # the shared post-expert norm first
        y.index_add_(0, tok, weights[tok, slot, None].float() * out.float())  # then routing weight, fp32 sum
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def logit_softcap(logits: torch.Tensor, multiplier: float, cap: float) -> torch.Tensor:
    return torch.tanh(logits.float() * multiplier / cap) * cap


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    logits = logits.float()
    if temperature <= 0.0:
        return logits.argmax(-1)
    # Shifted so the largest is 0 before the division: a tiny temperature then sends the others to -inf (greedy in
    # the limit) instead of every logit to +-inf and the softmax to NaN.
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# -- the vision and audio towers' ops (musecore.ops.TOWER_OPS) ---------------------------------------

def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float) -> torch.Tensor:
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate={approximate!r}; choose 'none' (exact erf) or 'tanh'")
    return F.gelu(x.float(), approximate=approximate).to(x.dtype)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):  # one segment (an image, a frame or a window) at a time
        ks, vs = k[start:stop].float(), v[start:stop].float()  # [n,nh,d]
        for q0 in range(start, stop, 1024):  # query blocks bound the [nh, 1024, n] scores of a large frame
            q1 = min(q0 + 1024, stop)
            scores = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), ks) * scale
            out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vs)
    return out.to(q.dtype)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    B, C, _T = x.shape
    K = weight.shape[-1]
    if state is None:
        state = torch.zeros(B, C, K - 1, dtype=x.dtype, device=x.device)
    xp = torch.cat([state.float(), x.float()], dim=-1)  # [B,C,K-1+T]
    y = F.conv1d(xp, weight.float(), None if bias is None else bias.float(), groups=C)
    return y.to(x.dtype), xp[..., xp.shape[-1] - (K - 1):].to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    cos, sin = cos.float()[:, None, :], sin.float()[:, None, :]  # [N,1,d]: the same angles for every head
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)
