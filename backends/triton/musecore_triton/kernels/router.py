"""The MoE router's choice: sigmoid scores, top-k on scores + correction bias, renormalised weights.

The router's fp32 product ``x @ W^T`` ([T,H] x [H,E]) runs in cuBLAS (``F.linear`` on fp32 operands; an
fp32 GEMM, never TF32 unless the caller switched PyTorch's fp32 matmul precision). Everything after it is
one kernel per token row: sigmoid of the scaled logits, k rounds of max over ``scores + bias`` (the bias
only chooses), the chosen *scores* gathered, renormalised and scaled. It replaces sigmoid, add, topk
(a sort), gather, sum and two divisions: about seven PyTorch kernels at decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from musecore.ops import reference as ref
from musecore_triton import hooks

MAX_TOP_K = 64  # the kernel keeps k rounds unrolled; larger k runs the reference's torch ops (same numerics)


@triton.jit
def router_topk_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, E, stride, k, multiplier, scaling, K: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row: ``s = sigmoid(logits * multiplier)``; the k largest ``s + bias`` by k rounds of max (lowest
    index first on ties); weights ``s[ids] / (sum + 1e-15) * scaling``."""
    offs = tl.arange(0, BLOCK)
    mask = offs < E
    bias = tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: read before the wait
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-(x * multiplier)))
    left = tl.where(mask, s + bias, -float("inf"))
    kk = tl.arange(0, K)
    weights = tl.zeros((K,), dtype=tl.float32)
    ids = tl.zeros((K,), dtype=tl.int64)
    for j in tl.static_range(K):  # K = k rounded up to a power of two; rounds past k are not stored
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, offs, BLOCK), axis=0)
        chosen = tl.sum(tl.where(offs == idx, s, 0.0), axis=0)  # the score, not score + bias
        weights = tl.where(kk == j, chosen, weights)
        ids = tl.where(kk == j, idx.to(tl.int64), ids)
        left = tl.where(offs == idx, -float("inf"), left)
    weights = tl.where(kk < k, weights, 0.0)
    weights = weights / (tl.sum(weights, axis=0) + 1e-15) * scaling
    tl.store(w_ptr + row * k + kk, weights, mask=kk < k)
    tl.store(ids_ptr + row * k + kk, ids, mask=kk < k)


def router_topk(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, multiplier: float,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``router_topk`` op: fp32 cuBLAS product, then the choice kernel.

    Example::

        weights, ids = router_topk(m, w_router, e_score_correction_bias, 8, 0.1768, 1.0)  # [T,8] fp32, long
    """
    T, E = x.shape[0], weight.shape[0]
    if weight.dtype != torch.float32 or bias.dtype != torch.float32:
        raise TypeError(f"router_topk: the router weight and bias are kept fp32 (MODEL.md); got {weight.dtype} "
                        f"and {bias.dtype}")
    if not 0 < k <= E:
        raise ValueError(f"router_topk: k must be in 1..{E} (the number of experts); got {k}")
    if k > MAX_TOP_K:
        return ref.router_topk(x, weight, bias, k, multiplier, scaling)
    logits = F.linear(x.float(), weight)  # [T,E] fp32
    weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    if T:
        block = triton.next_power_of_2(E)
        # 2k + 1 dependent reductions per row: within one warp they are shuffles, across warps each is
        # a shared-memory round trip and a barrier (4 warps took ~3 us per row at E = 64).
        router_topk_kernel[(T,)](logits, bias.contiguous(), weights, ids, E, logits.stride(0), k, multiplier,
                                 scaling, K=triton.next_power_of_2(k), BLOCK=block,
                                 num_warps=1 if block <= 512 else 4, **hooks.launch_options(x.device, "router_topk"))
    return weights, ids
