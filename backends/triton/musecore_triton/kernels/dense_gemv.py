"""A 16-bit weight GEMV for one token (``x [1,K] @ W.T``), for the small dense projections of decode.

cuBLAS picks GEMM tiles even at M = 1, and on the small weights of a decode step (0.2-10 MB: a
block's fused q/k/v/gate, o_proj, router + pooler, unpooler) those launches take ~4-8 us each on
the H200, well under the memory ceiling. Here one program owns ``BLOCK_N`` whole rows, loads its
``[BLOCK_N, K]`` slice in ``BLOCK_K`` chunks (all of K at once up to 2048 columns, so every load is
in flight together), multiplies in fp32 and reduces once at the end.

The cut (2 rows per program, 2 warps) and the size limit ``DENSE_GEMV_MAX_BYTES`` (above it cuBLAS
was as fast or faster) come from a sweep against cuBLAS; figures in ``backends/cuda/lab/NOTES.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels import norms

MAX_BLOCK_K = 2048
DENSE_GEMV_MAX_BYTES = 64 << 20
BLOCK_N, NUM_WARPS = 2, 2


def use_dense_gemv(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear`` of ``x2 [M,K]`` on the 16-bit weight ``w`` takes :func:`dense_gemv`."""
    return (x2.shape[0] == 1 and x2.is_cuda and w.dtype in (torch.bfloat16, torch.float16)
            and w.numel() * w.element_size() <= DENSE_GEMV_MAX_BYTES and w.stride(1) == 1)


@triton.jit
def dense_gemv_kernel(x_ptr, w_ptr, w2_ptr, ids_ptr, y_ptr, N, K, stride_w, stride_e, a_div, count_ptr, norm_w_ptr,
                      z_ptr, eps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXPERTS: tl.constexpr,
                      SWIGLU: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, ROUND_X: tl.constexpr = False,
                      NORM: tl.constexpr = False, BLOCK_NORM: tl.constexpr = 1):
    """Output rows ``BLOCK_N * pid0 ..`` of GEMV number ``pid1``: one token's ``x`` row against one weight.

    With ``EXPERTS``, GEMV ``a`` is token-expert assignment ``a``: weight ``ids[a]`` of a stack, token
    row ``a // a_div``; with ``SWIGLU`` a second stack ``w2`` (up) is read alongside and the output is
    ``silu(x @ w.T) * (x @ w2.T)``.

    With ``PDL`` (dependent launch, :mod:`musecore_triton.hooks`) a plain GEMV loads its first weight chunk before it
    waits for the kernel before it; with ``EXPERTS`` the expert id is an input, so it waits first."""
    a = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    if EXPERTS:
        hooks.pdl_wait(PDL)
        e = tl.load(ids_ptr + a).to(tl.int64)
        w_ptr += e * stride_e
        w2_ptr += e * stride_e
    x_ptr += (a // a_div).to(tl.int64) * K
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs
        kmask = kk < K
        wo = rows[:, None].to(tl.int64) * stride_w + kk[None, :]
        wm = rmask[:, None] & kmask[None, :]
        wv = tl.load(w_ptr + wo, mask=wm, other=0.0).to(tl.float32)
        if SWIGLU:
            w2v = tl.load(w2_ptr + wo, mask=wm, other=0.0).to(tl.float32)
        if not EXPERTS:  # after the first chunk's weight loads; a no-op once the kernel before has finished
            hooks.pdl_launch_dependents(EARLY)
            hooks.pdl_wait(PDL)
        x = tl.load(x_ptr + kk, mask=kmask, other=0.0)
        if ROUND_X:
            x = x.to(w_ptr.dtype.element_ty)
        x = x.to(tl.float32)[None, :]
        acc += wv * x
        if SWIGLU:
            acc2 += w2v * x
    hooks.pdl_wait(PDL)  # (a no-op after the first; K = 0 runs no chunk)
    y = tl.sum(acc, axis=1)
    if SWIGLU:
        y = y / (1.0 + tl.exp(-y)) * tl.sum(acc2, axis=1)
    tl.store(y_ptr + a.to(tl.int64) * N + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)
    if NORM:
        tl.debug_barrier()  # every thread's rows are stored before the ticket is taken
        ticket = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            tl.store(count_ptr, 0)
            offs_n = tl.arange(0, BLOCK_NORM)
            nmask = offs_n < N
            v = tl.load(y_ptr + offs_n, mask=nmask, other=0.0, cache_modifier=".cg").to(tl.float32)
            nw = tl.load(norm_w_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
            z = norms._norm(v, nw, nmask, N, eps, True, False, z_ptr.dtype.element_ty)
            tl.store(z_ptr + offs_n, z.to(z_ptr.dtype.element_ty), mask=nmask)


def gemv_blocks(k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): the sweep's best fixed cut, K in one chunk up to ``MAX_BLOCK_K`` columns."""
    return BLOCK_N, min(triton.next_power_of_2(k), MAX_BLOCK_K)


def dense_gemv(x: torch.Tensor, w: torch.Tensor, blocks: tuple[int, int] | None = None,
               num_warps: int = NUM_WARPS, *, norm: tuple[torch.Tensor, float, torch.Tensor] | None = None
               ) -> torch.Tensor:
    """``x [1,K] @ w[N,K].T`` -> ``[1,N]`` in w's dtype (fp32 accumulation, as cuBLAS); an fp32 ``x`` is rounded
    to w's dtype as it is loaded (the same bits as ``x.to(w.dtype)`` first). ``blocks`` overrides
    :func:`gemv_blocks` (for sweeps). ``norm = (weight [N], eps, counter)``: return ``rms_norm(y, weight, eps)``
    instead, in the same launch (the last program normalises the row; ``counter`` is an int32 zero that the
    launch takes and gives back, owned by one call site whose launches do not overlap)."""
    if x.shape[0] != 1 or x.shape[1] != w.shape[1] or w.stride(1) != 1 \
            or x.dtype not in (w.dtype, torch.float32) or w.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dense_gemv takes x [1,K] (of w's dtype, or fp32) and a row-major 16-bit w [N,K]; got x "
                         f"{x.dtype} {list(x.shape)}, w {w.dtype} {list(w.shape)} strides {w.stride()}")
    n, k = w.shape
    y = torch.empty(1, n, dtype=w.dtype, device=x.device)
    block_n, block_k = blocks or gemv_blocks(k)
    extra = {}
    if norm is not None:
        norm_w, eps, counter = norm
        if norm_w.shape != (n,) or counter.dtype != torch.int32 or counter.numel() != 1:
            raise ValueError(f"dense_gemv: the norm takes a weight [{n}] and a one-element int32 counter; got "
                             f"{list(norm_w.shape)} and {counter.dtype} {list(counter.shape)}")
        z = torch.empty_like(y)
        extra = dict(NORM=True, BLOCK_NORM=triton.next_power_of_2(n))
        args = (counter, norm_w.contiguous(), z, eps)
    else:
        args = (y, y, y, 0.0)
    dense_gemv_kernel[(triton.cdiv(n, block_n), 1)](x.contiguous(), w, w, x, y, n, k, w.stride(0), 0, 1, *args,
                                                     BLOCK_N=block_n, BLOCK_K=block_k, EXPERTS=False, SWIGLU=False,
                                                     num_warps=num_warps, ROUND_X=x.dtype != w.dtype, **extra,
                                                     EARLY=hooks.early_trigger(x.device, "dense_gemv"),
                                                     **hooks.launch_options(x.device, "dense_gemv"))
    return y if norm is None else z


def expert_gemv(x: torch.Tensor, stack: torch.Tensor, ids: torch.Tensor, a_div: int,
                up: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """One GEMV per token-expert assignment over a contiguous 16-bit stack ``[E, N, K]``: row ``a`` of
    the result is ``x[a // a_div] @ stack[ids[a]].T``, or with ``up`` ``silu(that) * x[a // a_div] @
    up[ids[a]].T`` (gate+up+SwiGLU in one pass). Only the routed experts' rows are read."""
    E, n, k = stack.shape
    flat = ids.reshape(-1).contiguous()
    x = x.contiguous()
    if x.shape[-1] != k or x.dtype != stack.dtype or not stack.is_contiguous() \
            or (up is not None and (up.shape != stack.shape or not up.is_contiguous())):
        raise ValueError(f"expert_gemv: x {x.dtype} {list(x.shape)} against stack {stack.dtype} {list(stack.shape)}"
                         f"{'' if up is None else f' and up {list(up.shape)}'}: needs contiguous stacks of x's dtype")
    y = torch.empty(flat.numel(), n, dtype=out_dtype or x.dtype, device=x.device)
    if flat.numel():
        block_n, block_k = gemv_blocks(k)
        dense_gemv_kernel[(triton.cdiv(n, block_n), flat.numel())](
            x, stack, up if up is not None else stack, flat, y, n, k, k, n * k, a_div, y, y, y, 0.0, BLOCK_N=block_n,
            BLOCK_K=block_k, EXPERTS=True, SWIGLU=up is not None, num_warps=NUM_WARPS,
            EARLY=False, **hooks.launch_options(x.device, "expert_gemv"))
    return y
