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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype)


def residual_norm(residual: torch.Tensor, out: torch.Tensor, post_weight: torch.Tensor,
                  gate: torch.Tensor, next_weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (residual.float() + gate.float() * rms_norm(out.float(), post_weight, eps)).to(residual.dtype)
    return new_residual, rms_norm(new_residual, next_weight, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.float()[:, :, None, :], sin.float()[:, :, None, :]  # [B,T,1,d]
    qn, kn = rms_norm(q.float(), q_weight, eps), rms_norm(k.float(), k_weight, eps)
    q_out = qn * cos + rotate_half(qn) * sin
    k_out = kn * cos + rotate_half(kn) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


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


def head_norm_gate(o: torch.Tensor, weight: torch.Tensor, gate_logits: torch.Tensor, eps: float) -> torch.Tensor:
    return (rms_norm(o.float(), weight, eps) * torch.sigmoid(gate_logits.float())[..., None]).to(o.dtype)


def fake_quantize_activation(x: torch.Tensor, act_format: Optional[str],
                             input_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """What a W4A4 / W8A8 target does to activations before its matmul, as dequantized values.

    NVFP4 activations need a global scale: the checkpoint's calibrated ``input_scale`` when it has
    one (ModelOpt exports do); otherwise a dynamic per-token one, ``amax(|x|) / (6*448)`` per row,
    so a token's numerics never depend on the other tokens of its batch.
    """
    if act_format is None:
        return x
    from musecore_quant import fake_quantize_activation as fq
    if act_format == "nvfp4" and input_scale is None:
        input_scale = (x.float().abs().amax(-1) / (6 * 448)).clamp_min(torch.finfo(torch.float32).tiny)
    return fq(x, act_format, input_scale=input_scale)


def linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    xq = fake_quantize_activation(x, w.act_format, w.input_scale)
    return (xq.float() @ w.data.float().T).to(x.dtype)


def embedding(ids: torch.Tensor, table: Weight) -> torch.Tensor:
    return F.embedding(ids, table.data)


def router_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)  # [T,E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T,k]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def expert_forward(z: torch.Tensor, experts: ExpertWeights, e: int) -> torch.Tensor:
    """SwiGLU expert ``e`` on tokens ``z [n,l]``: ``down(silu(gate(z)) * up(z))``, fp32 math."""
    pick = lambda s: None if s is None else s[e]  # noqa: E731
    zq = fake_quantize_activation(z.float(), experts.act_format, pick(experts.gate_up_input_scale))
    h = F.silu(zq @ experts.gate[e].float().T) * (zq @ experts.up[e].float().T)
    hq = fake_quantize_activation(h, experts.act_format, pick(experts.down_input_scale))
    return hq @ experts.down[e].float().T


def moe(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights,
        output_norm: torch.Tensor, eps: float) -> torch.Tensor:
    T, k = ids.shape
    y = torch.zeros(T, z.shape[-1], dtype=torch.float32, device=z.device)
    for e in ids.unique().tolist():  # only routed experts run
        tok, slot = (ids == e).nonzero(as_tuple=True)
        out = rms_norm(expert_forward(z[tok], experts, e), output_norm[e], eps)  # per-expert norm first
        y.index_add_(0, tok, weights[tok, slot, None].float() * out)  # then routing weight, fp32 sum
    return y


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    logits = logits.float()
    if temperature <= 0.0:
        return logits.argmax(-1)
    logits = logits / temperature
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
