"""Fused row-wise kernels: RMSNorm, residual add + norm, q/k norm + RoPE, head norm + gate.

Each is one pass over its rows in fp32 (one program per row), which is what makes them worth a
kernel: the unfused PyTorch versions read and write the hidden state several times. Rounding
follows the reference exactly where it rounds (the new residual is rounded to its dtype before
the next norm reads it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore.ops import reference as ref
from musecore_cuda.kernels import pdl


@triton.jit
def _rms(x, mask, n, eps):
    x = tl.where(mask, x, 0.0)
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # wait for the kernel before (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * _rms(x, mask, n, eps) * w
    tl.store(y_ptr + row * n + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def residual_norm_kernel(res_ptr, out_ptr, post_w_ptr, gate_ptr, next_w_ptr, new_res_ptr, normed_ptr,
                         n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # wait for the kernel before (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    o = tl.load(out_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    post = tl.load(post_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * n + offs, mask=mask, other=0.0).to(tl.float32)
    new_res = (res + gate * (o * _rms(o, mask, n, eps) * post)).to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * n + offs, new_res, mask=mask)
    r = new_res.to(tl.float32)
    nxt = tl.load(next_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(normed_ptr + row * n + offs, (r * _rms(r, mask, n, eps) * nxt).to(normed_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _norm_rope_row(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, src, dst, bt, eps, D: tl.constexpr):
    """One head row: RMSNorm over d, then x*cos + rotate_half(x)*sin (HF halves)."""
    offs = tl.arange(0, D)
    rot = (offs + D // 2) % D  # rotate_half reads the other half...
    sign = tl.where(offs < D // 2, -1.0, 1.0)  # ...negating the second half moved to the front
    x = tl.load(x_ptr + src + offs).to(tl.float32)
    x_rot = tl.load(x_ptr + src + rot).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    xn = x * r * tl.load(w_ptr + offs).to(tl.float32)
    xn_rot = x_rot * r * tl.load(w_ptr + rot).to(tl.float32) * sign
    cos = tl.load(cos_ptr + bt * D + offs).to(tl.float32)
    sin = tl.load(sin_ptr + bt * D + offs).to(tl.float32)
    tl.store(y_ptr + dst + offs, (xn * cos + xn_rot * sin).to(y_ptr.dtype.element_ty))


@triton.jit
def qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qy_ptr, ky_ptr, q_rows, nq, nkv,
                        q_stride, k_stride, eps, D: tl.constexpr, PDL: tl.constexpr):
    """q's head rows then k's, one launch. Inputs may be slices of a fused projection: token
    ``bt``'s heads start at ``bt * stride`` (heads contiguous within it); outputs are contiguous."""
    pdl.wait(PDL)  # wait for the kernel before (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    if row < q_rows:  # (b*T + t) * nq + h
        bt = row // nq
        _norm_rope_row(q_ptr, qw_ptr, cos_ptr, sin_ptr, qy_ptr, bt * q_stride + (row % nq) * D, row * D, bt,
                       eps, D)
    else:
        row -= q_rows
        bt = row // nkv
        _norm_rope_row(k_ptr, kw_ptr, cos_ptr, sin_ptr, ky_ptr, bt * k_stride + (row % nkv) * D, row * D, bt,
                       eps, D)


@triton.jit
def head_norm_gate_kernel(o_ptr, w_ptr, g_ptr, y_ptr, nq, g_stride, eps, D: tl.constexpr, PDL: tl.constexpr):
    pdl.wait(PDL)  # wait for the kernel before (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)  # (b*T + t) * nq + h
    offs = tl.arange(0, D)
    o = tl.load(o_ptr + row * D + offs).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(o * o, axis=0) / D + eps)
    g = tl.load(g_ptr + (row // nq) * g_stride + row % nq).to(tl.float32)  # gates may be a fused projection's slice
    y = o * r * tl.load(w_ptr + offs).to(tl.float32) * (1.0 / (1.0 + tl.exp(-g)))
    tl.store(y_ptr + row * D + offs, y.to(y_ptr.dtype.element_ty))


# Warps per program of each row kernel; None keeps Triton's default (4). Measured at decode shapes of muse-small
# and the 816B preset (``benchmarks/cuda_norm_warps_sweep.py``, ``cuda_norm_warps_sweep.json``): the head kernels
# (one 128-wide head per program) run 1.10-1.17x faster on one warp, whose reductions are shuffles only; the
# hidden-width norms are within 4% of their best at the default.
WARPS: dict[str, int | None] = {"rms_norm": None, "residual_norm": None, "qk_norm_rope": 1, "head_norm_gate": 1}


def _warps(kernel: str) -> dict:
    return {} if WARPS[kernel] is None else {"num_warps": WARPS[kernel]}


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.numel() else 0


def _check_head_dim(d: int) -> None:
    if d & (d - 1):
        raise ValueError(f"the fused head kernels need a power-of-two head dim; got {d}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        n = x.shape[-1]
        rms_norm_kernel[(_rows(x),)](x, weight.contiguous(), y, n, eps, BLOCK=triton.next_power_of_2(n),
                                     **_warps("rms_norm"), **pdl.triton_options(x.device, "rms_norm"))
    return y


def residual_norm(residual: torch.Tensor, out: torch.Tensor, post_weight: torch.Tensor, gate: torch.Tensor,
                  next_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual, out = residual.contiguous(), out.contiguous()
    new_residual = torch.empty_like(residual)
    normed = torch.empty_like(residual)
    if residual.numel():
        n = residual.shape[-1]
        residual_norm_kernel[(_rows(residual),)](residual, out, post_weight.contiguous(), gate.contiguous(),
                                                 next_weight.contiguous(), new_residual, normed, n, eps,
                                                 BLOCK=triton.next_power_of_2(n), **_warps("residual_norm"),
                                                 **pdl.triton_options(out.device, "residual_norm"))
    return new_residual, normed


def _token_rows(x: torch.Tensor, inner: int) -> tuple[torch.Tensor, int]:
    """``x [B,T,...]`` and the distance between consecutive tokens' rows, where each token's trailing
    ``inner`` elements are contiguous and tokens are evenly spaced (a fused projection's slice is);
    otherwise a contiguous copy."""
    B, T = x.shape[:2]
    if x.numel() and x[0, 0].is_contiguous() and x[0, 0].numel() == inner:
        if T == 1:
            return x, x.stride(0)
        if B == 1 or x.stride(0) == T * x.stride(1):
            return x, x.stride(1)
    x = x.contiguous()
    return x, inner


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_head_dim(q.shape[-1])
    B, T, nq, d = q.shape
    nkv = k.shape[2]
    if k.shape[:2] != (B, T) or k.shape[3] != d:
        raise ValueError(f"qk_norm_rope: q {list(q.shape)} and k {list(k.shape)} need the same B, T and head dim")
    (q, q_stride), (k, k_stride) = _token_rows(q, nq * d), _token_rows(k, nkv * d)
    q_out = torch.empty(B, T, nq, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(B, T, nkv, d, dtype=k.dtype, device=k.device)
    if B * T:
        qk_norm_rope_kernel[(B * T * (nq + nkv),)](q, k, q_weight.contiguous(), k_weight.contiguous(),
                                                   cos.contiguous(), sin.contiguous(), q_out, k_out, B * T * nq,
                                                   nq, nkv, q_stride, k_stride, eps, D=d, **_warps("qk_norm_rope"),
                                                   **pdl.triton_options(q.device, "qk_norm_rope"))
    return q_out, k_out


def head_norm_gate(o: torch.Tensor, weight: torch.Tensor, gate_logits: torch.Tensor, eps: float) -> torch.Tensor:
    _check_head_dim(o.shape[-1])
    o = o.contiguous()
    y = torch.empty_like(o)
    B, T, nq, d = o.shape
    if gate_logits.shape != (B, T, nq):
        raise ValueError(f"head_norm_gate: gate logits {list(gate_logits.shape)} must be [B,T,nq] = {[B, T, nq]}")
    g, g_stride = _token_rows(gate_logits, nq)
    if o.numel():
        head_norm_gate_kernel[(_rows(o),)](o, weight.contiguous(), g, y, nq, g_stride, eps, D=d,
                                           **_warps("head_norm_gate"), **pdl.triton_options(o.device, "head_norm_gate"))
    return y


@triton.jit
def router_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, stride, k, K: tl.constexpr, RENORM: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: fp32 softmax over E experts, the k largest by k rounds of max (lowest index first on
    ties), optionally renormalised to sum 1. Replaces softmax + topk (two sorts) + sum + divide."""
    pdl.wait(PDL)  # wait for the kernel before (kernels/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < E
    x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(mask, p, 0.0)
    p = p / tl.sum(p, axis=0)
    left = tl.where(mask, p, -1.0)
    kk = tl.arange(0, K)
    weights = tl.zeros((K,), dtype=tl.float32)
    ids = tl.zeros((K,), dtype=tl.int64)
    for j in tl.static_range(K):  # K = k rounded up to a power of two; rounds past k are not stored
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, offs, BLOCK), axis=0)
        weights = tl.where(kk == j, best, weights)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        left = tl.where(offs == idx, -1.0, left)
    weights = tl.where(kk < k, weights, 0.0)
    if RENORM:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(w_ptr + row * k + kk, weights, mask=kk < k)
    tl.store(ids_ptr + row * k + kk, ids, mask=kk < k)


def router_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``router_topk`` op in one kernel (``k`` up to 64; larger k takes the reference's torch ops)."""
    T, E = logits.shape
    if k > E or k > 64 or logits.stride(-1) != 1:
        return ref.router_topk(logits, k, renormalize)
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T:
        block = triton.next_power_of_2(E)
        # k + 3 dependent reductions per row: within one warp they are shuffles, across warps each is
        # a shared-memory round trip and a barrier (4 warps took ~3 us per row at E = 64).
        router_topk_kernel[(T,)](logits, weights, ids, E, logits.stride(0), k, K=triton.next_power_of_2(k),
                                 RENORM=renormalize, BLOCK=block, num_warps=1 if block <= 512 else 4,
                                 **pdl.triton_options(logits.device, "router_topk"))
    return weights, ids
