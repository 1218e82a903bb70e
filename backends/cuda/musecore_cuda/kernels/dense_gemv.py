"""A 16-bit weight GEMV for one token (``x [1,K] @ W.T``), for the small dense projections of decode.

cuBLAS picks GEMM tiles even at M = 1, and on the small weights of a decode step (0.2-10 MB: a
block's fused q/k/v/gate, o_proj, router + pooler, unpooler) those launches take ~4-8 us each on
the H200, 9-44% of the memory ceiling. Here one program owns ``BLOCK_N`` whole rows, loads its
``[BLOCK_N, K]`` slice in ``BLOCK_K`` chunks (all of K at once up to 2048 columns, so every load is
in flight together), multiplies in fp32 and reduces once at the end.

Measured (``benchmarks/cuda_dense_gemv_sweep.py``, ``benchmarks/results/cuda_dense_gemv_sweep.json``):
2 rows per program and 2 warps was the best fixed cut over the sweep (1.36x cuBLAS geometric mean).
It is 1.08-2.07x cuBLAS on every measured weight up to 38 MB; of the two ~200 MB ones, the 816B
fused q/k/v/gate gains 1.15x and muse-small's lm_head loses (0.96x), so above
``DENSE_GEMV_MAX_BYTES`` (64 MB, where nothing was measured between) the weights stay on cuBLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_K = 2048
DENSE_GEMV_MAX_BYTES = 64 << 20
BLOCK_N, NUM_WARPS = 2, 2


def use_dense_gemv(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear`` of ``x2 [M,K]`` on the 16-bit weight ``w`` takes :func:`dense_gemv`."""
    return (x2.shape[0] == 1 and x2.is_cuda and w.dtype in (torch.bfloat16, torch.float16)
            and w.numel() * w.element_size() <= DENSE_GEMV_MAX_BYTES and w.stride(1) == 1)


@triton.jit
def dense_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    offs = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs
        kmask = kk < K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + kk[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        x = tl.load(x_ptr + kk, mask=kmask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=rmask)


def gemv_blocks(k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): the sweep's best fixed cut, K in one chunk up to ``MAX_BLOCK_K`` columns."""
    return BLOCK_N, min(triton.next_power_of_2(k), MAX_BLOCK_K)


def dense_gemv(x: torch.Tensor, w: torch.Tensor, blocks: tuple[int, int] | None = None,
               num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``x [1,K] @ w[N,K].T`` -> ``[1,N]`` in x's dtype (fp32 accumulation, as cuBLAS); ``blocks``
    overrides :func:`gemv_blocks` (for sweeps)."""
    if x.shape[0] != 1 or x.shape[1] != w.shape[1] or w.stride(1) != 1 or x.dtype != w.dtype:
        raise ValueError(f"dense_gemv takes x [1,K] and a row-major w [N,K] of x's dtype; got x {x.dtype} "
                         f"{list(x.shape)}, w {w.dtype} {list(w.shape)} strides {w.stride()}")
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k = blocks or gemv_blocks(k)
    dense_gemv_kernel[(triton.cdiv(n, block_n),)](x.contiguous(), w, y, n, k, w.stride(0), BLOCK_N=block_n,
                                                  BLOCK_K=block_k, num_warps=num_warps)
    return y
