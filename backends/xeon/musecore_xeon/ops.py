"""The non-GEMM ops of the Xeon backend: norms, RoPE, the router, attention, and the ops the reference already
does the CPU way.

Each op computes the contract of :mod:`musecore.ops` (the reference's fp32 math and its roundings to the activation
dtype). Attention uses ``F.scaled_dot_product_attention`` (a flash kernel on CPU) with the reference's own visibility
mask, so the mask contract (causal, sliding window, ``k_pos = -1`` empty slots) is the reference's by construction.
``embedding``, ``sample`` and ``silu_mul`` are taken from the reference as they are: each is already a few
vectorised PyTorch calls (``silu_mul`` runs only in dense-MLP layers), and sharing ``sample`` keeps the random
stream identical to the reference's for a given generator; ``logit_softcap`` is one C call with the reference's bits
(PyTorch's own tanh kernel, see the op).

At decode sizes (at most :data:`NATIVE_NORM_MAX_ELEMENTS` elements, contiguous bf16/fp32 tensors) the four norm ops,
the router (logits and selection) and decode attention run one C call each (``musecore_xeon.kernels.native``, the
same fp32 math and roundings; the router's logits and attention's softmax within their ops' tolerances) through the CPython extension of :mod:`musecore_xeon.kernels.binding` (one call: checks, ``at::empty``,
the kernel): at decode sizes PyTorch's per-op cost (dispatch, dtype casts) exceeds the work, and a muse-small token
makes ~100 such calls. Larger inputs (prefill), other dtypes, and hosts where the extension cannot
be built run the PyTorch path below each fast call, which computes the same math.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from musecore.ops import reference as ref
from musecore_xeon.kernels import native

embedding = ref.embedding
sample = ref.sample
silu_mul = ref.silu_mul

NATIVE_NORM_MAX_ELEMENTS = 1 << 16  # decode sizes; above this the PyTorch ops (vectorised, threaded) win
NATIVE_ATTENTION_MAX_QUERIES = 8  # decode: per-query C loop; prefill keeps SDPA (a flash kernel)


@functools.cache
def fast_ops():
    """The extension's norm, router, decode-attention and fused-MoE calls (None without it): each returns None where
    its fast path does not apply. ``moe`` is called by :func:`musecore_xeon.kernels.moe.moe_forward`."""
    fast = native.ops_binding(NATIVE_NORM_MAX_ELEMENTS, NATIVE_ATTENTION_MAX_QUERIES)
    if fast is not None:
        lib = native.load()
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        fast.set_moe(address(lib.musecore_int4_moe), address(lib.musecore_bf16_moe))
    return fast


def _fast_call(name: str, *args):
    """The extension's ``name(*args)``, or None (no extension, or its fast path does not take these inputs)."""
    fast = fast_ops()
    return None if fast is None else getattr(fast, name)(*args)


def _rms_f32(x: torch.Tensor, eps: float, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``rms(x) * weight`` (``rms(x)`` without a weight) in fp32: PyTorch's fused ``F.rms_norm``, one pass."""
    return F.rms_norm(x.float(), (x.shape[-1],), None if weight is None else weight.float(), eps)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, scale_first: bool = False) -> torch.Tensor:
    """``rms(x) * weight`` (weightless when None), or with ``scale_first`` ``rms(round(x * weight))``: the product
    rounded to x's dtype first (transformers' InputScaledRMSNorm). Output in x's dtype."""
    if scale_first and weight is None:
        raise ValueError("rms_norm: scale_first=True needs a weight (the input-scaled norm multiplies before it "
                         "normalises); pass weight=None with scale_first=False for a weightless norm")
    out = _fast_call("rms_norm", x, weight, eps, scale_first)
    if out is not None:
        return out
    if scale_first:
        return _rms_f32((x.float() * weight.float()).to(x.dtype), eps).to(x.dtype)
    return _rms_f32(x, eps, weight).to(x.dtype)


def residual_norm(residual: torch.Tensor, out: torch.Tensor, post_weight: Optional[torch.Tensor],
                  alpha: torch.Tensor, beta: torch.Tensor, next_weight: Optional[torch.Tensor], post_eps: float,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = rms(round(out * post_weight))`` (``rms(out)`` when post_weight is None) in out's dtype;
    ``residual' = alpha * residual + beta * h`` in fp32, rounded to the residual's dtype;
    ``normed = rms(residual') * next_weight``."""
    pair = _fast_call("residual_norm", residual, out, post_weight, alpha, beta, next_weight, post_eps, eps)
    if pair is not None:
        return pair
    h = rms_norm(out, post_weight, post_eps, scale_first=post_weight is not None)
    new_residual = (alpha.float() * residual.float() + beta.float() * h.float()).to(residual.dtype)
    return new_residual, rms_norm(new_residual, next_weight, eps)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],
                 eps: float, q_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weightless per-head RMSNorm over d, q times ``q_scale``, then HF-convention RoPE (halves, not interleaved
    pairs) when cos/sin are given (None: a NoPE layer)."""
    if (cos is None) != (sin is None):
        raise ValueError("qk_norm_rope: pass both cos and sin (a RoPE layer) or neither (a NoPE layer)")
    pair = _fast_call("qk_norm_rope", q, k, cos, sin, eps, q_scale)
    if pair is not None:
        return pair
    qn, kn = _rms_f32(q, eps) * q_scale, _rms_f32(k, eps)
    if cos is not None:
        cos, sin = cos.float()[:, :, None, :], sin.float()[:, :, None, :]  # [B,T,1,d]
        qn = torch.addcmul(qn * cos, ref.rotate_half(qn), sin)
        kn = torch.addcmul(kn * cos, ref.rotate_half(kn), sin)
    return qn.to(q.dtype), kn.to(k.dtype)


def head_norm_gate(o: torch.Tensor, gate_logits: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms(o) * sigmoid(gate_logits)`` element-wise (weightless norm per head row of d), in o's dtype."""
    if gate_logits.shape != o.shape:
        raise ValueError(f"head_norm_gate: gate_logits {tuple(gate_logits.shape)} must have o's shape "
                         f"{tuple(o.shape)} (one gate per element)")
    out = _fast_call("head_norm_gate", o, gate_logits, eps)
    if out is not None:
        return out
    return (_rms_f32(o, eps) * torch.sigmoid(gate_logits.float())).to(o.dtype)


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], k: int, multiplier: float,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = sigmoid(fp32(x) @ W^T * multiplier)``; the top-k of ``s + bias`` (the bias only chooses);
    ``weights = s[ids] / (sum s[ids] + 1e-15) * scaling``.

    At decode sizes (at most :data:`NATIVE_ATTENTION_MAX_QUERIES` tokens, fp32 weight and bias) one C call computes
    it all: the logits as fp32 dot products in SIMD lanes (not the summation order of PyTorch's matmul: within the
    op's tolerance, not the reference's bits; the ids agree but for near-ties), shared by the threads, and the
    selection. Otherwise the logits are PyTorch's fp32 matmul, as in the reference (the same bits), and the selection
    runs in C at decode sizes (sigmoid, top-k, renormalisation: ~8 PyTorch calls otherwise)."""
    picked = _fast_call("router", x, weight, bias, k, multiplier, scaling, torch.get_num_threads())
    if picked is not None:
        return picked
    logits = x.float() @ (weight if weight.dtype is torch.float32 else weight.float()).T  # [T,E]
    if bias is not None and bias.dtype is not torch.float32:
        bias = bias.float()
    picked = _fast_call("router_topk", logits, bias, k, multiplier, scaling) if logits.dim() == 2 else None
    if picked is not None:
        return picked
    scores = torch.sigmoid(logits * multiplier)
    ids = torch.topk(scores if bias is None else scores + bias, k, dim=-1).indices  # [T,k]
    weights = scores.gather(-1, ids)
    return weights / (weights.sum(-1, keepdim=True) + 1e-15) * scaling, ids


def logit_softcap(logits: torch.Tensor, multiplier: float, cap: float) -> torch.Tensor:
    """``cap * tanh(fp32(logits) * multiplier / cap)`` with the reference's bits: one C call that runs the reference's
    products and quotient and PyTorch's own tanh kernel (MKL VML, checked against ``torch.tanh`` when the extension
    loads) per L1-sized chunk, shared by the threads; where that kernel is not found, the reference's ops in its order
    on one fp32 buffer (the reference allocates four such buffers)."""
    out = _fast_call("logit_softcap", logits, multiplier, cap, torch.get_num_threads())
    if out is not None:
        return out
    out = logits.to(torch.float32, copy=True)
    out.mul_(multiplier).div_(cap)
    return torch.tanh(out, out=out).mul_(cap)


def kv_write_row(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 slot: int, position: int) -> bool:
    """A KV cache layer's decode write (every batch row at ``position``) in one C call: ``k_new``/``v_new``
    ``[B,1,nkv,d]`` into ``slot`` of ``k``/``v`` ``[B,slots,nkv,d]``, ``positions[:, slot] = position``. False where the
    extension is not built or the tensors are not what it takes (the cache then narrows and copies: the same
    entries). The ``row_writer`` of :class:`musecore.kv_cache.KVCache`."""
    fast = fast_ops()
    return fast is not None and fast.kv_write_row(k, v, positions, k_new, v_new, slot, position)


def _to_compute(t: torch.Tensor, scale: Optional[float], dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return t.to(dtype)
    return (t.float() * scale).to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              window: Optional[int], scale: float, k_scale: Optional[float] = None,
              v_scale: Optional[float] = None, *, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal GQA attention ``[B,T,nq,d]`` over cached keys, prefill or decode, full or sliding window.

    Runs SDPA in ``compute_dtype``: fp32 on CPUs without native BF16, where it is both exact
    (NMSE ~1e-9 against the reference instead of ~6e-6) and faster than BF16 SDPA. FP8 K/V are dequantized with their per-tensor
    scales first. Queries that see no key return zeros.
    """
    nq, nkv = q.shape[2], k.shape[2]
    if nq % nkv:
        raise ValueError(f"attention: {nq} query heads are not a multiple of {nkv} kv heads")
    B, T, _, d = q.shape
    unscaled = k_scale is None and v_scale is None and (window is None or window > 0)  # what the C loop takes
    if unscaled:
        out = _fast_call("attention", q, k, v, q_pos, k_pos, -1 if window is None else window, scale,
                         torch.get_num_threads())
        if out is not None:
            return out
    if unscaled and T <= NATIVE_ATTENTION_MAX_QUERIES and k.dtype == v.dtype and k.shape == v.shape \
            and k.shape[0] == B and k.shape[3] == d and q_pos.shape == (B, T) and k_pos.shape == (B, k.shape[1]) \
            and k.shape[0] * k.shape[1] < 2 ** 31 \
            and all(t.dtype in (torch.bfloat16, torch.float32) and t.is_contiguous() for t in (q, k, v)):
        lib = native.load()  # no extension here: the same C loop through ctypes
        if lib is not None:
            out = torch.empty_like(q)
            q_pos64, k_pos64 = q_pos.to(torch.int64).contiguous(), k_pos.to(torch.int64).contiguous()
            lib.musecore_attention(q.data_ptr(), int(q.dtype == torch.bfloat16), k.data_ptr(), v.data_ptr(),
                                   int(k.dtype == torch.bfloat16), q_pos64.data_ptr(), k_pos64.data_ptr(),
                                   -1 if window is None else window, scale, out.data_ptr(), B, T, k.shape[1], nq, nkv,
                                   d, torch.get_num_threads())
            return out
    qc = q.to(compute_dtype)
    kc, vc = _to_compute(k, k_scale, compute_dtype), _to_compute(v, v_scale, compute_dtype)
    visible = ref.visibility_mask(q_pos, k_pos, window)  # [B,T,S]
    out = F.scaled_dot_product_attention(qc.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2),
                                         attn_mask=visible[:, None], scale=scale, enable_gqa=nq != nkv)
    out = out.transpose(1, 2).masked_fill(~visible.any(-1)[:, :, None, None], 0.0)  # [B,T,nq,d]
    return out.to(q.dtype)
