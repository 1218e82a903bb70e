"""Bidirectional flash attention over packed variable-length segments (the vision tower's attention).

The encoders pack every image, video and 32x32-patch window into one sequence of ``N`` tokens and
say where each segment starts with ``cu_seqlens`` (``[S+1]``, ``cu[0] = 0``, ``cu[S] = N``): a query
sees every key of its own segment and nothing else (``musecore.ops.varlen_attention``).

One program takes ``BLOCK_M`` consecutive rows of the packed sequence for one head, whatever
segments they belong to. Each row's segment comes from a per-token segment id computed on the
device (``searchsorted``), so the grid is ``cdiv(N, BLOCK_M) x heads`` and needs no host copy of
``cu_seqlens`` (no maximum segment length, no per-segment launch). A program reads only the keys
from the start of its first row's segment to the end of its last row's, and masks by segment id;
a block that straddles two windows does a little extra work, a block inside one does none.

Head dims that are not a power of two (the 816B tower's 96, 72, 80) are padded to the next one
inside the kernel (masked loads, zeros that add nothing to the dots). Scores and the online
softmax are fp32 (exp2 with ``log2 e`` folded into the scale); the probabilities are rounded to
V's dtype for the second tensor-core product, as every flash kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels.attention import LOG2E

MAX_HEAD_DIM = 256  # the padded head row of one tile: q, K and V tiles of 256 fp16 columns still fit shared memory


@triton.jit
def varlen_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seg_ptr, cu_ptr, N, d,
                            sq_n, sq_h, sk_n, sk_h, sv_n, sv_h, so_n, so_h, qk_scale,
                            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                            PDL: tl.constexpr):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    cols = tl.arange(0, D)
    col_ok = cols < d
    seg_q = tl.load(seg_ptr + rows, mask=row_ok, other=-1)
    first = pid_m * BLOCK_M
    last = tl.minimum(first + BLOCK_M, N) - 1
    lo = tl.load(cu_ptr + tl.load(seg_ptr + first))  # keys this block can see: its first row's segment start ...
    hi = tl.load(cu_ptr + tl.load(seg_ptr + last) + 1)  # ... to its last row's segment end

    q = tl.load(q_ptr + rows[:, None].to(tl.int64) * sq_n + h * sq_h + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for s0 in range(lo, hi, BLOCK_N):
        keys = s0 + tl.arange(0, BLOCK_N)
        key_ok = keys < hi
        seg_k = tl.load(seg_ptr + keys, mask=key_ok, other=-2)
        k = tl.load(k_ptr + keys[:, None].to(tl.int64) * sk_n + h * sk_h + cols[None, :],
                    mask=key_ok[:, None] & col_ok[None, :], other=0.0)
        v = tl.load(v_ptr + keys[:, None].to(tl.int64) * sv_n + h * sv_h + cols[None, :],
                    mask=key_ok[:, None] & col_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # fp32 scores, log2 domain
        s = tl.where(seg_q[:, None] == seg_k[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible in this tile yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real row sees at least itself: l > 0
    tl.store(o_ptr + rows[:, None].to(tl.int64) * so_n + h * so_h + cols[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def check_varlen_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """One-line errors for inputs the kernel cannot take (shapes, dtypes, a malformed ``cu_seqlens``).

    Checking the values of ``cu_seqlens`` reads three numbers back from the device (one sync per
    call, microseconds beside an encoder layer); a malformed one would otherwise read out of bounds."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"varlen_attention: q, k, v must all be [N, heads, head_dim]; got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"varlen_attention: q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"varlen_attention: cu_seqlens must be int32 [segments+1] (cumulative segment lengths from "
                         f"0 to N); got {cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"varlen_attention: cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    steps = cu_seqlens[1:] - cu_seqlens[:-1]
    first, last, shortest = torch.stack([cu_seqlens[0].long(), cu_seqlens[-1].long(), steps.min().long()]).tolist()
    if first != 0 or last != q.shape[0] or shortest < 0:
        raise ValueError(f"varlen_attention: cu_seqlens must rise from 0 to N={q.shape[0]} without decreasing; got "
                         f"first {first}, last {last}, smallest step {shortest}")


def segment_ids(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """int32 ``[n]``: the segment of each packed token (the last segment that starts at or before it)."""
    tokens = torch.arange(n, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return (torch.searchsorted(cu_seqlens.contiguous(), tokens, right=True) - 1).to(torch.int32)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The ``varlen_attention`` op (``musecore.ops``): bidirectional attention inside each segment
    ``[cu[i], cu[i+1])`` of the packed ``[N, heads, d]`` q/k/v; fp32 softmax; returns q's dtype.

    q/k/v may be strided views (e.g. of a fused qkv projection) as long as the head dim is contiguous."""
    check_varlen_inputs(q, k, v, cu_seqlens)
    N, nh, d = q.shape
    if d > MAX_HEAD_DIM:
        raise ValueError(f"varlen_attention: head dim {d} exceeds the kernel's {MAX_HEAD_DIM}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"varlen_attention: q/k/v must be fp16, bf16 or fp32; got {q.dtype}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(N, nh, d, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    cu = cu_seqlens.to(torch.int32)
    seg = segment_ids(cu, N)
    D = max(16, triton.next_power_of_2(d))
    block_m = 64 if N > 32 else 16
    block_n = 64 if D <= 128 else 32
    varlen_attention_kernel[(triton.cdiv(N, block_m), nh)](
        q, k, v, out, seg, cu, N, d, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), float(scale) * LOG2E, D=D, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # fp32 inputs: no TF32 rounding
        num_warps=4 if D <= 64 else 8, num_stages=2, **hooks.launch_options(q.device, "varlen_attention"))
    return out
