"""FlyDSL MoE finalize for gfx950: unpermute + per-expert post norm + routing weight + fp32 sum, one kernel.

Lab, not shipped: it compiles to gfx950 in CI (``backends/rocm/tests/test_rocm_flydsl.py``) but has never run
(no AMD GPU was reachable, and FlyDSL has no CPU interpreter), so the plan does not select it; the shared
Triton ``moe_finalize_kernel`` (:mod:`musecore_triton.kernels.moe`) runs. It is the third kernel of the FlyDSL
MoE candidate of issue 22, after the gate/up and down GEMMs of ``mx_expert_gemm.py``.

What it computes, per token ``t`` (the reference ``musecore.ops.reference.moe`` after the expert GEMMs, and
exactly the Triton finalize's arithmetic)::

    y[t] = sum_j  w[t, j] * round(rms(round(round(o[pos[t, j]]) * norm)))        (fp32 sum over j in order)

where ``o [rows, L]`` fp32 holds the down GEMM's rows in the expert-sorted order, ``pos [T*k]`` int32 the row
of each assignment (the unpermute), ``w [T*k]`` fp32 the routing weights, ``norm [L]`` the shared post-expert
norm weight, ``round`` the rounding to the activation dtype (bf16 or fp16), and
``rms(s) = s / sqrt(mean(s^2) + eps)`` (the post norm scales first, then normalises: transformers'
InputScaledRMSNorm). One workgroup of 256 threads (4 waves) per token; thread ``l`` holds the columns
``l, l + 256, ...`` (coalesced loads; 16 per thread at L = 4096), and each assignment's sum of squares is a
block reduction (``fx.coop.BlockReduce``: DPP moves within each wave, the 4 wave sums through LDS, in a fixed
order, so the result is deterministic). Never timed: one workgroup per token is the first thing to compare
against a split of L over more workgroups on an MI355X at decode.

Run ``python moe_finalize.py L TOPK ACT TOKENS`` (ACT ``bf16`` or ``fp16``) with ``COMPILE_ONLY=1 ARCH=gfx950``
and a ROCm toolkit root holding ``llvm/bin/ld.lld`` in ``ROCM_PATH`` to compile without a GPU.
"""

from __future__ import annotations

import sys

import flydsl.compiler as flyc
import flydsl.expr as fx

THREADS = 256
ACT_TYPES = {"bf16": fx.BFloat16, "fp16": fx.Float16}


def build(L: int, topk: int, act: str, eps: float):
    """The kernel and its launcher for one (width L, top-k, activation dtype, eps): compile-time constants."""
    if L % THREADS:
        raise ValueError(f"L must be a multiple of {THREADS} (one workgroup per token); got {L}")
    if act not in ACT_TYPES:
        raise ValueError(f"act is one of {sorted(ACT_TYPES)}; got {act!r}")
    per_lane = L // THREADS
    Act = ACT_TYPES[act]
    Reduce = fx.coop.BlockReduce[fx.Float32, THREADS]

    def rnd(v):
        return v.to(Act).to(fx.Float32)  # the activation dtype's rounding, as the reference writes its tensors

    @flyc.kernel
    def moe_finalize(O: fx.Tensor, pos: fx.Tensor, W: fx.Tensor, norm: fx.Tensor, Y: fx.Tensor):
        lane = fx.thread_idx.x
        t = fx.block_idx.x
        o_ptr, p_ptr, w_ptr, n_ptr, y_ptr = (fx.get_iter(O), fx.get_iter(pos), fx.get_iter(W), fx.get_iter(norm),
                                             fx.get_iter(Y))
        storage = fx.SharedAllocator().allocate(Reduce.SharedStorage).peek()
        nw = [fx.ptr_load(n_ptr + (fx.Int32(i * THREADS) + lane)).to(fx.Float32) for i in fx.range_constexpr(per_lane)]
        y = [fx.Float32(0.0) for _ in range(per_lane)]
        for j in fx.range_constexpr(topk):
            a = t * fx.Int32(topk) + fx.Int32(j)
            row = fx.ptr_load(p_ptr + a)   # the unpermute: this assignment's row of o
            weight = fx.ptr_load(w_ptr + a)
            s = []
            sq = fx.Float32(0.0)
            for i in fx.range_constexpr(per_lane):
                v = fx.ptr_load(o_ptr + (row * fx.Int32(L) + fx.Int32(i * THREADS) + lane))
                si = rnd(rnd(v) * nw[i])  # the expert output as written, scaled by the norm weight, rounded
                s.append(si)
                sq = sq + si * si
            total = Reduce.sum(sq, storage=storage)  # every thread gets the row's sum of squares
            fx.barrier()  # the shared storage is reused by the next assignment
            r = fx.Float32(1.0) / fx.math.sqrt(total / fx.Float32(L) + fx.Float32(eps))
            for i in fx.range_constexpr(per_lane):
                y[i] = y[i] + rnd(s[i] * r) * weight  # normalised, rounded, weighted; fp32 sum over j in order
        for i in fx.range_constexpr(per_lane):
            fx.ptr_store(y[i], y_ptr + (t * fx.Int32(L) + fx.Int32(i * THREADS) + lane))

    @flyc.jit
    def launch(O: fx.Tensor, pos: fx.Tensor, W: fx.Tensor, norm: fx.Tensor, Y: fx.Tensor,
               tokens: fx.Constexpr[int], stream: fx.Stream = fx.Stream(None)):
        moe_finalize(O, pos, W, norm, Y).launch(grid=(tokens, 1, 1), block=(THREADS, 1, 1), stream=stream)

    return launch


def compile_placeholders(L: int, topk: int, act: str, tokens: int) -> None:
    """Compile for ``$ARCH`` with CPU placeholder tensors (``COMPILE_ONLY=1``: nothing runs)."""
    import torch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[act]
    rows = tokens * topk
    O = torch.zeros(rows, L)
    pos = torch.zeros(rows, dtype=torch.int32)
    W = torch.zeros(rows)
    norm = torch.zeros(L, dtype=dtype)
    Y = torch.zeros(tokens, L)
    flyc.compile(build(L, topk, act, 1e-6), O, pos, W, norm, Y, tokens)


if __name__ == "__main__":
    compile_placeholders(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
