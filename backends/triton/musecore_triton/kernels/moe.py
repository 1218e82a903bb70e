"""Routed-expert MoE in Triton: align assignments by expert, two grouped GEMMs, fused finalize.

Only routed experts run, and each expert's weight is streamed once per block of its tokens:

1. ``align_assignments`` sorts the ``T*k`` token-expert assignments by expert and pads each
   expert's segment to the GEMM's BLOCK_M, entirely with device ops (no host sync, so the layer
   can be captured in a CUDA graph). Each M block then belongs to exactly one expert.
2. gate and up in one grouped GEMM (rows gathered from ``z``), SwiGLU in its epilogue -> ``h``.
3. down in a second grouped GEMM over ``h`` (already in sorted order) -> fp32 ``o``.
4. ``moe_finalize_kernel``: per token, each of its k expert rows is rounded to the activation
   dtype (the expert's output as the reference writes it), goes through the shared post-expert
   norm (scale first: ``rms(round(e * w))``), then gets its routing weight; the k rows are summed
   in fp32 (MODEL.md: norm before weight, fp32 sum). Deterministic: a token's rows are read back
   through the inverse permutation, no atomics.

At decode, 16-bit expert stacks take one GEMV per assignment instead (:func:`moe_decode_dense`,
:func:`uses_dense_decode`); a backend with a faster FP4 decode kernel calls it before
:func:`moe_forward` (the CUDA backend's CUDA C++ expert GEMVs), reusing :func:`finalize`.

:func:`finalize_gemv` runs one token's finalize in every program of the GEMV that follows the block (the unpooler),
so a fused decode block saves the finalize's launch (``musecore_cuda.fused.FusedMoE``).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Union

import torch
import triton
import triton.language as tl


from musecore_triton import hooks
from musecore_triton.kernels.fp4_gemm import WFMT_DENSE, launch_gemm, pick_config
from musecore_triton.kernels import norms
from musecore_triton.kernels.dense_gemv import (MAX_BLOCK_K, expert_gemv, last_ticket, residual_norm_operands,
                                                 store_row_products, whole_k_tile)
from musecore_triton.kernels.sort import INDEX_BITS, MAX_ASSIGNMENTS, MAX_EXPERTS
from musecore_triton.layouts import Fp4Resident

ExpertStack = Union[Fp4Resident, torch.Tensor]


def align_assignments(ids: torch.Tensor, num_experts: int, block_m: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted, block-padded assignment order.

    Returns ``sorted_ids`` int32 ``[max_blocks*block_m]`` (assignment ``t*k+j`` per row, ``T*k`` for
    padding), ``blk_expert`` int32 ``[max_blocks]`` (-1 past the last used block) and ``position``
    int32 ``[T*k]`` (the row of each assignment). ``max_blocks`` is an upper bound known without a
    sync: every expert wastes less than one block. Up to ``sort.MAX_ASSIGNMENTS`` assignments one Triton program
    computes all three (:func:`align_assignments_kernel`; ~20 small PyTorch kernels otherwise, each a node of a
    decode step's CUDA graph); the same values either way.
    """
    n = ids.numel()
    on_triton = ids.device.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1"  # (CPU ids on a GPU machine)
    if on_triton and 0 < n <= MAX_ASSIGNMENTS and num_experts <= MAX_EXPERTS:
        return _align_one_program(ids.reshape(-1), num_experts, block_m)
    return _align_torch(ids, num_experts, block_m)


def _max_blocks(n: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(n, block_m) + min(num_experts, n)


def _align_torch(ids: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`align_assignments` in PyTorch ops (any number of assignments)."""
    flat = ids.reshape(-1)
    n = flat.numel()
    device = ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    blk_end = torch.cumsum(blocks, 0)
    blk_start = blk_end - blocks
    max_blocks = _max_blocks(n, num_experts, block_m)
    blk_expert = torch.searchsorted(blk_end, torch.arange(max_blocks, device=device), right=True)
    blk_expert = torch.where(blk_expert < num_experts, blk_expert, -1).to(torch.int32)
    sorted_experts, order = torch.sort(flat, stable=True)
    seg_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=device) - seg_start[sorted_experts]
    pos = blk_start[sorted_experts] * block_m + rank
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[pos] = order.to(torch.int32)
    position = torch.empty(n, dtype=torch.int32, device=device)
    position[order] = pos.to(torch.int32)
    return sorted_ids, blk_expert, position


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def align_assignments_kernel(ids_ptr, experts_ptr, sorted_ptr, blk_expert_ptr, position_ptr, n, rows, blocks,
                             BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, FILL: tl.constexpr,
                             INDEX_BITS: tl.constexpr):
    """One program: the ``n`` assignments sorted by ``expert << INDEX_BITS | index`` (``sort.sort_assignments``'
    keys: stable), each expert's segment padded to ``BLOCK_M`` rows. A sorted position's rank in its segment is its
    distance from the segment's first position (a running maximum over the segment starts); the padding before it is
    the running sum of the earlier segments' pads, each counted at its segment's last position."""
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    keys = tl.sort(tl.where(mask, (e << INDEX_BITS) | offs, 2147483647), 0)  # padding sorts last
    expert = keys >> INDEX_BITS
    index = keys & ((1 << INDEX_BITS) - 1)
    tl.store(experts_ptr + offs, expert, mask=mask)  # (read back shifted by one below)
    for start in range(0, rows, FILL):
        o = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + o, n, mask=o < rows)
    for start in range(0, blocks, FILL):
        o = start + tl.arange(0, FILL)
        tl.store(blk_expert_ptr + o, -1, mask=o < blocks)
    tl.debug_barrier()
    before = tl.load(experts_ptr + offs - 1, mask=mask & (offs > 0), other=-1)
    after = tl.load(experts_ptr + offs + 1, mask=offs + 1 < n, other=-1)
    first = tl.associative_scan(tl.where(expert != before, offs, 0), 0, _maximum)
    rank = offs - first
    pad = tl.where(mask & (expert != after), (BLOCK_M - (rank + 1) % BLOCK_M) % BLOCK_M, 0)
    pos = offs + tl.cumsum(pad, 0) - pad
    inside = mask & (pos < rows)  # (always, for ids below num_experts; ids past it must not write out of bounds)
    tl.store(sorted_ptr + pos, index, mask=inside)
    tl.store(position_ptr + index, pos, mask=inside)
    tl.store(blk_expert_ptr + pos // BLOCK_M, expert, mask=inside & (rank % BLOCK_M == 0))


def _align_one_program(flat: torch.Tensor, num_experts: int, block_m: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = flat.numel()
    max_blocks = _max_blocks(n, num_experts, block_m)
    device = flat.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    blk_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    position = torch.empty(n, dtype=torch.int32, device=device)
    experts = torch.empty(n, dtype=torch.int32, device=device)  # the sorted experts, for the neighbours' reads
    align_assignments_kernel[(1,)](flat, experts, sorted_ids, blk_expert, position, n, sorted_ids.numel(), max_blocks,
                                   BLOCK_M=block_m, BLOCK=max(16, triton.next_power_of_2(n)), FILL=1024,
                                   INDEX_BITS=INDEX_BITS, num_warps=4 if n <= 256 else 8)
    return sorted_ids, blk_expert, position


@triton.jit
def gather_rows_kernel(z_ptr, sorted_ptr, blk_expert_ptr, xs_ptr, T, K, TOPK: tl.constexpr, BLOCK_M: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``xs[r] = z[min(sorted[r] // TOPK, T - 1)]`` for ``ROWS`` rows and ``BLOCK_K`` columns per program, only in
    token tiles of ``BLOCK_M`` rows that hold an expert (padding rows read the last token)."""
    r0 = tl.program_id(0) * ROWS
    if tl.load(blk_expert_ptr + r0 // BLOCK_M) >= 0:
        rows = r0 + tl.arange(0, ROWS)
        tok = tl.minimum(tl.load(sorted_ptr + rows) // TOPK, T - 1).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (cols < K)[None, :]
        v = tl.load(z_ptr + tok[:, None] * K + cols[None, :], mask=mask)
        tl.store(xs_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], v, mask=mask)


def gather_token_rows(z: torch.Tensor, sorted_ids: torch.Tensor, blk_expert: torch.Tensor, topk: int,
                      block_m: int) -> torch.Tensor:
    """Each sorted row's token activations ``[rows, K]`` (a GEMM that reads them with TMA needs the rows contiguous),
    for the token tiles that hold an expert; rows of the spare tiles past the last used one are left unwritten (no
    kernel reads them), padding rows inside a used tile read the last token."""
    T, K = z.shape
    rows = sorted_ids.numel()
    xs = torch.empty(rows, K, dtype=z.dtype, device=z.device)
    rows_per_program = math.gcd(16, block_m)  # a power of two that divides the tile
    if rows and T:
        block_k = min(256, triton.next_power_of_2(K))
        gather_rows_kernel[(rows // rows_per_program, triton.cdiv(K, block_k))](
            z.contiguous(), sorted_ids, blk_expert, xs, T, K, TOPK=topk, BLOCK_M=block_m, ROWS=rows_per_program,
            BLOCK_K=block_k, num_warps=4)
    return xs


ACT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit
def moe_finalize_kernel(o_ptr, pos_ptr, ids_ptr, w_ptr, norm_ptr, y_ptr, L, eps,
                        TOPK: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, SORTED: tl.constexpr,
                        ACT: tl.constexpr, PDL: tl.constexpr):
    """y[t] = sum_j w[t,j] * rms(round(round(o[pos[t,j]]) * norm)), fp32 (pos = identity unless SORTED;
    round = to the activation dtype ``ACT``, as the reference rounds the expert output and the norm's).

    A token's k rows are loaded as one [KP, BLOCK] tile and their norms reduced together: one memory
    round trip per token instead of k dependent ones (the k-step loop took ~4.8 us at batch 1)."""
    offs = tl.arange(0, BLOCK)
    nw = tl.load(norm_ptr + offs, mask=offs < L, other=0.0).to(tl.float32)  # a weight: read before the wait
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KP)
    jm = j < TOPK
    mask = jm[:, None] & (offs < L)[None, :]
    if SORTED:
        p = tl.load(pos_ptr + t * TOPK + j, mask=jm, other=0).to(tl.int64)
    else:
        p = t * TOPK + j
    wt = tl.load(w_ptr + t * TOPK + j, mask=jm, other=0.0).to(tl.float32)
    rows = tl.load(o_ptr + p[:, None] * L + offs[None, :], mask=mask, other=0.0)
    tl.store(y_ptr + t * L + offs, finalize_sum(rows, wt, nw, L, eps, ACT), mask=offs < L)


@triton.jit
def finalize_sum(rows, wt, nw, L, eps, ACT: tl.constexpr):
    """One token's finalize: its expert rows ``[KP, BLOCK]`` (as loaded), routing weights ``[KP]`` and the shared
    post-expert norm ``[BLOCK]`` (fp32) -> ``sum_j wt[j] * rms(round(round(rows[j]) * nw))``, fp32 ``[BLOCK]``."""
    s = (rows.to(ACT).to(tl.float32) * nw[None, :]).to(ACT).to(tl.float32)  # the norm scales first, then rounds
    r = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / L + eps)
    normed = (s * r[:, None]).to(ACT).to(tl.float32)
    return tl.sum(normed * wt[:, None], axis=0)


# finalize_gemv's cut: 16 rows per program on 16 warps (80 registers at top-8, h = 768 on sm90, no spills). In
# muse-small's decode graph on an H100 (run 141, cuda_fused_ab.py, three rounds): 715.5 us per replay against 734.0
# with the finalize its own launch; 4 x 4 717.9, 8 x 8 731.2 (lab NOTES, session 75). Not timed on an H200 yet.
FINALIZE_GEMV_BLOCK_N, FINALIZE_GEMV_WARPS = 16, 16


@triton.jit
def finalize_gemv_kernel(o_ptr, wt_ptr, norm_ptr, w_ptr, y_ptr, N, L, stride_w, post_eps, count_ptr, res_ptr,
                         post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr, normed_ptr, res_post_eps, eps,
                         TOPK: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         ACT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, EPILOGUE: tl.constexpr,
                         HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK_NORM: tl.constexpr):
    """``y[rows] = W[rows] @ round(finalize(o))`` for one token: every program runs ``moe_finalize_kernel``'s steps
    and roundings on the token's ``TOPK`` rows of ``o [TOPK, L]`` (fp32) and keeps the sum in registers as its ``x``,
    rounded to ``ACT`` as ``dense_gemv`` rounds an fp32 ``x`` when it loads it. With ``EPILOGUE`` 2 the program that
    draws the launch's last ticket runs the residual norm on ``y``, as ``dense_gemv(residual_norm=...)`` does."""
    rows, rmask, offs, lmask, wv = whole_k_tile(tl.program_id(0), w_ptr, N, L, stride_w, BLOCK_N,
                                                BLOCK_K)  # no kernel's: before the wait
    nw = tl.load(norm_ptr + offs, mask=lmask, other=0.0).to(tl.float32)
    hooks.pdl_launch_dependents(EARLY)
    hooks.pdl_wait(PDL)
    j = tl.arange(0, KP)
    jm = j < TOPK
    wt = tl.load(wt_ptr + j, mask=jm, other=0.0).to(tl.float32)
    expert_rows = tl.load(o_ptr + j[:, None] * L + offs[None, :], mask=jm[:, None] & lmask[None, :], other=0.0)
    x = finalize_sum(expert_rows, wt, nw, L, post_eps, ACT)  # moe_finalize_kernel's steps and roundings
    store_row_products(wv, x.to(ACT).to(tl.float32), y_ptr, rows, rmask)  # the sum rounded as dense_gemv loads it
    if EPILOGUE == 2:  # dense_gemv's code for the residual norm (residual_norm_operands)
        tl.debug_barrier()  # every thread's rows are stored before the ticket is taken
        if last_ticket(count_ptr, tl.num_programs(0)):
            norms.residual_norm_row(res_ptr, y_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr,
                                    normed_ptr, 0, N, res_post_eps, eps, HAS_POST, HAS_NEXT, BLOCK_NORM, True)


def finalize_gemv(o: torch.Tensor, weights: torch.Tensor, post_norm: torch.Tensor, post_eps: float, w: torch.Tensor,
                  block_n: int | None = None, num_warps: int | None = None,
                  residual_norm: tuple | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``W @ finalize(o) [1, N]`` for one token's expert rows ``o [topk, L]`` (fp32, unsorted: row j is the token's
    j-th choice), routing ``weights [1, topk]`` and the shared post-expert norm ``[L]``; ``w [N, L]`` 16-bit,
    ``L <= MAX_BLOCK_K``: what :func:`finalize` then ``dense_gemv(y, w)`` compute, in one launch. ``residual_norm``:
    as ``dense_gemv``'s (``(residual [1, N], post_weight | None, alpha, beta, next_weight | None, post_eps, eps,
    counter)``), returning its pair ``(residual', normed)``. ``block_n`` rows per program on ``num_warps`` warps:
    by default :data:`FINALIZE_GEMV_BLOCK_N` and :data:`FINALIZE_GEMV_WARPS`."""
    n, k = w.shape
    topk = weights.shape[-1]
    if k > MAX_BLOCK_K or o.shape != (topk, k) or o.dtype != torch.float32 or weights.shape != (1, topk) \
            or post_norm.shape != (k,) or w.stride(1) != 1 or w.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"finalize_gemv takes o [topk, L] fp32, weights [1, topk], post_norm [L] and a 16-bit w "
                         f"[N, L], L <= {MAX_BLOCK_K}; got o {o.dtype} {list(o.shape)}, weights "
                         f"{list(weights.shape)}, post_norm {list(post_norm.shape)}, w {w.dtype} {list(w.shape)}")
    y = torch.empty(1, n, dtype=w.dtype, device=w.device)
    if residual_norm is None:
        tail, flags = (y,) * 8 + (0.0, 0.0), dict(EPILOGUE=0, HAS_POST=False, HAS_NEXT=False, BLOCK_NORM=1)
    else:
        tail, flags, new_res, normed = residual_norm_operands(residual_norm, y)
    # launched as the GEMV it replaces: dense_gemv's PDL wait and early signal
    block_n, num_warps = block_n or FINALIZE_GEMV_BLOCK_N, num_warps or FINALIZE_GEMV_WARPS
    finalize_gemv_kernel[(triton.cdiv(n, block_n),)](
        o.contiguous(), weights.contiguous(), post_norm.contiguous(), w, y, n, k, w.stride(0), post_eps, *tail,
        TOPK=topk, KP=triton.next_power_of_2(topk), BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(k),
        ACT=ACT_DTYPES[w.dtype], num_warps=num_warps, EARLY=hooks.early_trigger(w.device, "dense_gemv"), **flags,
        **hooks.launch_options(w.device, "dense_gemv"))
    return y if residual_norm is None else (new_res, normed)


def check_post_norm(post_norm: torch.Tensor, width: int) -> None:
    if post_norm.shape != (width,):
        raise ValueError(f"moe: the post-expert norm is one weight [h] = [{width}] shared by every expert; got "
                         f"{list(post_norm.shape)}")


def finalize(o: torch.Tensor, position: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             post_norm: torch.Tensor, post_eps: float, sorted_rows: bool, act_dtype: torch.dtype) -> torch.Tensor:
    """Step 4 of the module docstring: fp32 ``[T, h]`` from the expert rows ``o`` (``position`` maps a
    token's j-th assignment to its row when ``sorted_rows``); ``act_dtype`` is the activations' dtype."""
    T, topk = ids.shape
    width = o.shape[-1]
    check_post_norm(post_norm, width)
    y = torch.empty(T, width, dtype=torch.float32, device=o.device)
    if T:
        kp, block = triton.next_power_of_2(topk), triton.next_power_of_2(width)
        moe_finalize_kernel[(T,)](o, position, ids.contiguous(), weights.contiguous(), post_norm.contiguous(), y,
                                  width, post_eps, TOPK=topk, KP=kp, BLOCK=block, SORTED=sorted_rows,
                                  ACT=ACT_DTYPES[act_dtype], num_warps=max(4, min(16, kp * block // 1024)),
                                  **hooks.launch_options(o.device, "moe_finalize"))
    return y


def _gemm_args(stack: ExpertStack) -> dict:
    if isinstance(stack, Fp4Resident):
        return dict(w=stack.packed, scales=stack.scales, out_scale=stack.out_scale, wfmt=stack.wfmt,
                    group=stack.group, fold_log2=stack.fold_log2)
    return dict(w=stack, scales=None, out_scale=None, wfmt=WFMT_DENSE, group=16, fold_log2=0)


def _out_features(stack: ExpertStack) -> int:
    return stack.out_features if isinstance(stack, Fp4Resident) else stack.shape[1]


def uses_dense_decode(n_assign: int, num_experts: int) -> bool:
    """16-bit expert stacks take :func:`moe_decode_dense` (one GEMV per assignment) up to ``E / 2``
    assignments, where few experts repeat; beyond, the grouped GEMM."""
    return n_assign <= max(1, num_experts // 2)


def moe_forward(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: ExpertStack,
                up: ExpertStack, down: ExpertStack, num_experts: int, post_norm: torch.Tensor,
                post_eps: float) -> torch.Tensor:
    """The ``moe`` op over resident expert stacks; returns fp32 ``[T, h]``."""
    T, topk = ids.shape
    width = z.shape[-1]
    check_post_norm(post_norm, width)
    inter = _out_features(gate)
    n_assign = T * topk
    if T == 0:
        return torch.empty(T, width, dtype=torch.float32, device=z.device)
    if isinstance(gate, torch.Tensor) and uses_dense_decode(n_assign, num_experts):  # BF16 expert layers
        return moe_decode_dense(z, weights, ids, gate, up, down, post_norm, post_eps)
    z = z.contiguous()
    rows_per_expert = max(1, n_assign // min(num_experts, n_assign))
    active = min(num_experts, n_assign)
    cfg_up = pick_config(rows_per_expert, inter, width, active, z.device, allow_split=False)
    cfg_up = replace(cfg_up, block_n=min(cfg_up.block_n, 128))  # gate and up tiles both live in smem
    if not isinstance(gate, Fp4Resident):  # two dense 16-bit weight tiles per stage: 128x128 x 2 stages
        cfg_up = replace(cfg_up, block_n=64, num_stages=2)  # asked for 288 KB of shared memory on SM90
    sorted_ids, blk_expert, position = align_assignments(ids, num_experts, cfg_up.block_m)
    rows = sorted_ids.numel()
    h = torch.empty(rows, inter, dtype=z.dtype, device=z.device)
    g_args, u_args = _gemm_args(gate), _gemm_args(up)
    launch_gemm(z, **g_args, n=inter, k=width, out=h, cfg=cfg_up, a_idx=sorted_ids, n_assign=n_assign,
                a_div=topk, blk_expert=blk_expert, m_rows=rows, w2=u_args["w"], scales2=u_args["scales"],
                out_scale2=u_args["out_scale"])
    cfg_down = pick_config(rows_per_expert, width, inter, active, z.device, allow_split=True)
    cfg_down = replace(cfg_down, block_m=cfg_up.block_m, group_m=cfg_up.group_m)  # one alignment for both
    if not isinstance(down, Fp4Resident):  # a 16-bit 128x256 weight tile x 3 stages needs 288 KB of smem
        cfg_down = replace(cfg_down, block_n=min(cfg_down.block_n, 128), num_stages=2)
    alloc = torch.zeros if cfg_down.split_k > 1 else torch.empty
    o = alloc(rows, width, dtype=torch.float32, device=z.device)
    launch_gemm(h, **_gemm_args(down), n=width, k=inter, out=o, cfg=cfg_down, a_idx=sorted_ids,
                n_assign=n_assign, a_div=0, blk_expert=blk_expert, m_rows=rows)
    return finalize(o, position, ids, weights, post_norm, post_eps, sorted_rows=True, act_dtype=z.dtype)


def moe_decode_dense(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor,
                     up: torch.Tensor, down: torch.Tensor, post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
    """The ``moe`` op at decode on 16-bit expert stacks (the first and last layers): gate+up+SwiGLU and
    down as one GEMV per token-expert assignment (:func:`expert_gemv`), then the finalize. Three
    launches instead of the grouped path's sort, alignment, gathers and two GEMMs (~20)."""
    o = moe_decode_dense_rows(z, ids, gate, up, down)
    return finalize(o, ids.reshape(-1), ids, weights, post_norm, post_eps, sorted_rows=False, act_dtype=z.dtype)


def moe_decode_dense_rows(z: torch.Tensor, ids: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                          down: torch.Tensor) -> torch.Tensor:
    """:func:`moe_decode_dense` without its finalize: ``o [T * k, h]`` fp32, row ``a`` the down product of
    assignment ``a`` in ``ids``' order."""
    h = expert_gemv(z, gate, ids, ids.shape[1], up=up)
    return expert_gemv(h, down, ids, 1, out_dtype=torch.float32)
