"""Lab: a W4A16 GEMM for FP4 weights with the weight as the left operand ("swap AB"), in Triton.

Not selected by any path of the backend: on the H200 it was slower than the path ``fp4_linear`` takes at
every measured shape and M but one (backends/cuda/lab/NOTES.md, session 10; sweep:
``lab/scripts/cuda_swapab_sweep.py``; TTGIR check: ``lab/scripts/swapab_ttgir.py``).

``fp4_gemm.w4a16_gemm_kernel`` computes ``C = A @ W^T``: the upcast weight is the right operand,
and on Hopper ``wgmma`` reads its right operand only from shared memory, so every upcast tile is
written to shared memory before the tensor cores see it. Here the same product is computed
transposed, ``C^T[n, m] = W[n, :] @ A[m, :]^T``: the upcast weight tile ``[BLOCK_N, 64]`` is
``tl.dot``'s left operand, which ``wgmma`` can take from registers, and the activations
``[BLOCK_M, 64]`` are the right operand, staged in shared memory by the software pipeline. Tokens
are the MMA's N dimension, so a tile of 16-256 tokens costs no padding to 64 rows.

The weight tile is a plain 2-D elementwise expression of 2-D loads (packed bytes ``[BLOCK_N, 64]``
and the scale byte of each element's group, addressed ``offs // GROUP``), so Triton's dot-operand
optimisation can move the register-layout conversion above the upcast, onto the packed bytes.
The resident layout and the exact upcast are those of :mod:`musecore_triton.kernels.fp4_gemm`
(byte ``j`` of a 128-element chunk holds elements ``j`` and ``j + 64``: the two halves multiply
two contiguous activation halves).

Split-K (a second grid dimension; ``ATOMIC``) adds fp32 partial sums into a zeroed fp32 output with atomics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels.fp4_gemm import CHUNK_K, EXP_OFFSET, MODE_BF16, WFMT_DENSE, _group_mult, grouped_tile


@triton.jit
def _weight_half(w_ptrs, s_ptrs, kc, stride_sg, HALF: tl.constexpr, WFMT: tl.constexpr, EB: tl.constexpr,
                 GROUP: tl.constexpr, FOLD: tl.constexpr, HW_FP8: tl.constexpr):
    """Half ``HALF`` (0: low nibbles, elements 0-63; 1: high nibbles, 64-127) of chunk ``kc`` as a bf16
    ``[BLOCK_N, 64]`` tile; ``w_ptrs``/``s_ptrs`` address column ``j`` of chunk 0.

    With ``HW_FP8`` every op between the loads and the dot widens or keeps the element width and takes
    only loads and constants (no truncation, no select, no runtime scalar): Triton's MMAv3 operand
    hoisting needs that to keep the tile in registers for ``wgmma``. ``FOLD`` is a constexpr for the
    same reason."""
    b = tl.load(w_ptrs + kc * 64).to(tl.int16)
    s = tl.load(s_ptrs + (kc * (128 // GROUP) + HALF * (64 // GROUP)) * stride_sg)
    if HALF == 0:
        c = b & 15
    else:
        c = b >> 4
    w = (((c & 7) << 6) | ((c & 8) << 12)).to(tl.bfloat16, bitcast=True)  # code value * 2**-126, exact
    if not HW_FP8:  # the portable decode of fp4_gemm (interpreter, other vendors)
        mult = _group_mult(s.to(tl.int32), tl.full((), FOLD, tl.int32), WFMT, 1, EB, False)
    elif WFMT == 1:  # e4m3 -> bf16 in hardware, times 2**(EB - FOLD): exact (4 significant bits)
        mult = s.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16) * (2.0 ** (EB - FOLD))
    else:  # e8m0: the bf16 bits of 2**(s - 127 + EB - FOLD), at least 2**-126
        biased = tl.maximum(s.to(tl.int16) + tl.full((), EB - FOLD, tl.int16), tl.full((), 1, tl.int16))
        mult = (biased << 7).to(tl.bfloat16, bitcast=True)
    return w * mult


@triton.jit
def fp4_swapab_kernel(
    a_ptr, stride_am, w_ptr, s_ptr, stride_wn, stride_sn, stride_sg, out_scale_ptr,
    c_ptr, stride_cm, M, N, K,
    WFMT: tl.constexpr, EB: tl.constexpr, GROUP: tl.constexpr, FOLD: tl.constexpr, HW_FP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_N: tl.constexpr, ATOMIC: tl.constexpr,
    STAGES: tl.constexpr, EVEN_N: tl.constexpr, PDL: tl.constexpr,
):
    """C[M, N] (+)= A[M, K] @ W[N, K]^T, computed as its transpose with W as the left operand."""
    hooks.pdl_wait(PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n, pid_m = grouped_tile(pid, N, M, BLOCK_N, BLOCK_M, GROUP_N)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_j = tl.arange(0, 64)
    m_mask = offs_m < M
    if EVEN_N:
        rows = offs_n
    else:  # rows past N read row 0 (in bounds) and are never stored
        rows = tl.where(offs_n < N, offs_n, 0)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + offs_j[None, :]
    s_ptrs = s_ptr + rows.to(tl.int64)[:, None] * stride_sn + ((offs_j // GROUP) * stride_sg)[None, :]
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_j[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    chunks = K // 128 // tl.num_programs(1)
    first = pid_k * chunks
    for i in tl.range(0, chunks, num_stages=STAGES):
        kc = first + i
        a_lo = tl.load(a_ptrs + kc * 128, mask=m_mask[:, None], other=0.0)
        a_hi = tl.load(a_ptrs + kc * 128 + 64, mask=m_mask[:, None], other=0.0)
        w_lo = _weight_half(w_ptrs, s_ptrs, kc, stride_sg, 0, WFMT, EB, GROUP, FOLD, HW_FP8)
        w_hi = _weight_half(w_ptrs, s_ptrs, kc, stride_sg, 1, WFMT, EB, GROUP, FOLD, HW_FP8)
        acc = tl.dot(w_lo, tl.trans(a_lo), acc)
        acc = tl.dot(w_hi, tl.trans(a_hi), acc)

    acc = acc * tl.load(out_scale_ptr)
    c_ptrs = c_ptr + offs_m.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
    c_mask = m_mask[None, :] & (offs_n < N)[:, None]
    if ATOMIC:
        tl.atomic_add(c_ptrs, acc, mask=c_mask)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@dataclass(frozen=True)
class SwapAbConfig:
    block_n: int   # weight rows per program (the MMA's M: 64 per warpgroup)
    block_m: int   # tokens per program (the MMA's N)
    split_k: int
    stages: int
    num_warps: int
    group_n: int = 8


def launch(a: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, *, wfmt: int,
           group: int, fold_log2: int, n: int, k: int, out: torch.Tensor, cfg: SwapAbConfig,
           hw_fp8: Optional[bool] = None) -> torch.Tensor:
    """Launch :func:`fp4_swapab_kernel` for one FP4 weight (``w``/``scales`` ``[N, K/2]``/``[N, K/group]``, or
    the ``[1, ...]`` resident stack). ``out`` is ``[M, N]``: fp32 and zeroed when ``cfg.split_k > 1``."""
    if wfmt == WFMT_DENSE:
        raise ValueError("the swap-AB GEMM takes FP4 weights only")
    if a.dtype != torch.bfloat16:
        raise TypeError(f"the swap-AB GEMM takes bf16 activations; got {a.dtype}")
    if k % (CHUNK_K * cfg.split_k):
        raise ValueError(f"the swap-AB GEMM needs K divisible by {CHUNK_K} x split_k={cfg.split_k}; got K={k}")
    if a.dim() != 2 or a.stride(-1) != 1:
        raise ValueError("activations must be a 2-D tensor contiguous along K")
    if cfg.split_k > 1 and out.dtype != torch.float32:
        raise TypeError("split-K accumulates into a zeroed float32 output")
    w2, s2 = w.reshape(-1, w.shape[-1]), scales.reshape(-1, scales.shape[-1]) if scales.dim() > 2 else scales
    if w2.shape[0] != n or s2.shape[0] != n:
        raise ValueError(f"weight rows {w2.shape[0]} / scale rows {s2.shape[0]} != N={n}")
    m = a.shape[0]
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    fp4_swapab_kernel[grid](
        a, a.stride(0), w2, s2, w2.stride(0), s2.stride(0), s2.stride(1), out_scale,
        out, out.stride(0), m, n, k,
        WFMT=wfmt, EB=EXP_OFFSET[MODE_BF16], GROUP=group, FOLD=fold_log2,
        HW_FP8=hooks.launch_features(a.device)["HW_FP8"] if hw_fp8 is None else hw_fp8,
        BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, GROUP_N=cfg.group_n, ATOMIC=cfg.split_k > 1, STAGES=cfg.stages,
        EVEN_N=n % cfg.block_n == 0, num_warps=cfg.num_warps,
        **hooks.launch_options(a.device, "fp4_swapab"),
    )
    return out
