"""A 16-bit weight GEMV for one token (``x [1,K] @ W.T``), for the small dense projections of decode.

cuBLAS picks GEMM tiles even at M = 1, and on the small weights of a decode step (0.2-10 MB: a
block's fused q/k/v/gate, o_proj, router + pooler, unpooler) those launches take ~4-8 us each on
the H200, well under the memory ceiling. Here one program owns ``BLOCK_N`` whole rows, loads its
``[BLOCK_N, K]`` slice in ``BLOCK_K`` chunks (all of K at once up to 2048 columns, so every load is in flight
together), multiplies in fp32 and reduces once at the end. ``UNROLL_K`` (off: slower in a decode graph) unrolls K's
chunks instead (:func:`gemv_blocks`).

The cut (2 rows per program, 2 warps) and the size limit ``DENSE_GEMV_MAX_BYTES`` (above it cuBLAS was as fast or
faster) come from sweeps against cuBLAS (``backends/cuda/lab/scripts/cuda_dense_gemv_sweep.py``); figures in
``backends/cuda/lab/NOTES.md``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels import attention, norms

MAX_BLOCK_K = 2048
# K's chunks unrolled (K_STATIC): off. Standalone, 1 row per program and 256-column chunks won on every muse-small
# projection (session 50, run 44's sweep: q/k/v/gate 4.73 against 5.22 us, lm_head 48.4 against cuBLAS's 53.1), but
# in the decode graph the step lost 86 us (run 45: 771.4 against 685.3 us per replay); unexplained (lab NOTES).
UNROLL_K, UNROLL_BLOCK_N, UNROLL_BLOCK_K, UNROLL_MAX_CHUNKS = False, 1, 256, 8
DENSE_GEMV_MAX_BYTES = 64 << 20
BLOCK_N, NUM_WARPS = 2, 2
# Rows x warps per program of the launches whose last program runs a row op over the whole row, which its warps
# share: a GEMV with the residual norm (o_proj's, the unpooler's beside 16-bit experts) and the q/k/v/gate GEMV with
# the heads' q/k norms and RoPE. None: the backend's (``hooks.row_op_cut``), else ``BLOCK_N`` x ``NUM_WARPS``. Read at
# call time; set, they override the backend's (lab A/B: ``cuda_fused_ab.py``'s ``rn_*`` / ``qkv_*`` modes).
RESIDUAL_NORM_BLOCK_N: int | None = None
RESIDUAL_NORM_WARPS: int | None = None
QKV_BLOCK_N: int | None = None
QKV_WARPS: int | None = None


def use_dense_gemv(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``linear`` of ``x2 [M,K]`` on the 16-bit weight ``w`` takes :func:`dense_gemv`: up to
    ``DENSE_GEMV_MAX_BYTES``, or at any size where K's chunks unroll (``UNROLL_K``; session 50's sweep: muse-small's
    201 MB lm_head 48.4 us against cuBLAS's 53.1)."""
    return (x2.shape[0] == 1 and x2.is_cuda and w.dtype in (torch.bfloat16, torch.float16) and w.stride(1) == 1
            and (w.numel() * w.element_size() <= DENSE_GEMV_MAX_BYTES or unrolled(w.shape[1])))


@triton.jit
def dense_gemv_kernel(x_ptr, w_ptr, w2_ptr, ids_ptr, y_ptr, N, K, stride_w, stride_e, a_div, count_ptr, res_ptr,
                      post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr, normed_ptr, post_eps, eps,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXPERTS: tl.constexpr, SWIGLU: tl.constexpr,
                      PDL: tl.constexpr, EARLY: tl.constexpr, ROUND_X: tl.constexpr = False,
                      EPILOGUE: tl.constexpr = 0, HAS_POST: tl.constexpr = False, HAS_NEXT: tl.constexpr = False,
                      BLOCK_NORM: tl.constexpr = 1, WARM: tl.constexpr = False, K_STATIC: tl.constexpr = 0):
    """Output rows ``BLOCK_N * pid0 ..`` of GEMV number ``pid1`` (:func:`gemv_program`)."""
    gemv_program(tl.program_id(0), tl.program_id(1), tl.num_programs(0), x_ptr, w_ptr, w2_ptr, ids_ptr, y_ptr, N, K,
                 stride_w, stride_e, a_div, count_ptr, res_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr,
                 new_res_ptr, normed_ptr, post_eps, eps, BLOCK_N, BLOCK_K, EXPERTS, SWIGLU, PDL, EARLY, ROUND_X,
                 EPILOGUE, HAS_POST, HAS_NEXT, BLOCK_NORM, WARM, K_STATIC)


@triton.jit
def gemv_program(pid, a, programs, x_ptr, w_ptr, w2_ptr, ids_ptr, y_ptr, N, K, stride_w, stride_e, a_div, count_ptr,
                 res_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr, normed_ptr, post_eps, eps,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EXPERTS: tl.constexpr, SWIGLU: tl.constexpr,
                 PDL: tl.constexpr, EARLY: tl.constexpr, ROUND_X: tl.constexpr, EPILOGUE: tl.constexpr,
                 HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr, BLOCK_NORM: tl.constexpr, WARM: tl.constexpr,
                 K_STATIC: tl.constexpr = 0):
    """Output rows ``BLOCK_N * pid ..`` of GEMV number ``a``: one token's ``x`` row against one weight; ``programs``
    row blocks of this GEMV make up the launch (the one that draws the last ticket runs the ``EPILOGUE`` row op).

    With ``EXPERTS``, GEMV ``a`` is token-expert assignment ``a``: weight ``ids[a]`` of a stack, token
    row ``a // a_div``; with ``SWIGLU`` a second stack ``w2`` (up) is read alongside and the output is
    ``silu(x @ w.T) * (x @ w2.T)``.

    With ``PDL`` (dependent launch, :mod:`musecore_triton.hooks`) a plain GEMV loads its first weight chunk before it
    waits for the kernel before it; with ``EXPERTS`` the expert id is an input, so it waits first. With ``WARM``
    (``hooks.l2_warm``) each program prefetches its rows' slice of the row op's weights into L2 first: the last
    program, the launch's serial tail, then reads them from L2 (in a decode graph they were last read a step ago).

    ``K_STATIC`` (K itself, or 0) unrolls the loop over K's ``BLOCK_K`` chunks (:func:`gemv_blocks`)."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    if WARM and EPILOGUE == 1:
        hooks.prefetch_l2(next_w_ptr + rows, rmask)
    if WARM and EPILOGUE == 2:
        hooks.prefetch_l2(alpha_ptr + rows, rmask)
        hooks.prefetch_l2(beta_ptr + rows, rmask)
        if HAS_POST:
            hooks.prefetch_l2(post_w_ptr + rows, rmask)
        if HAS_NEXT:
            hooks.prefetch_l2(next_w_ptr + rows, rmask)
    if EXPERTS:
        hooks.pdl_wait(PDL)
        e = tl.load(ids_ptr + a).to(tl.int64)
        w_ptr += e * stride_e
        w2_ptr += e * stride_e
    x_ptr += (a // a_div).to(tl.int64) * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if K_STATIC:  # K's chunks unrolled: every chunk's weights in flight before the wait, no [BLOCK_N, K] fp32 tile
        ws = ()
        w2s = ()
        for c in tl.static_range((K_STATIC + BLOCK_K - 1) // BLOCK_K):
            wv, w2v = _chunk_weights(c * BLOCK_K, rows, rmask, w_ptr, w2_ptr, K, stride_w, BLOCK_K, SWIGLU)
            ws = ws + (wv,)
            w2s = w2s + (w2v,)
        if not EXPERTS:
            hooks.pdl_launch_dependents(EARLY)
            hooks.pdl_wait(PDL)
        for c in tl.static_range((K_STATIC + BLOCK_K - 1) // BLOCK_K):
            acc, acc2 = _chunk_products(acc, acc2, ws[c], w2s[c], c * BLOCK_K, x_ptr, K, BLOCK_K, SWIGLU, ROUND_X)
    else:
        for k0 in range(0, K, BLOCK_K):
            wv, w2v = _chunk_weights(k0, rows, rmask, w_ptr, w2_ptr, K, stride_w, BLOCK_K, SWIGLU)
            if not EXPERTS:  # after the first chunk's weight loads; a no-op once the kernel before has finished
                hooks.pdl_launch_dependents(EARLY)
                hooks.pdl_wait(PDL)
            acc, acc2 = _chunk_products(acc, acc2, wv, w2v, k0, x_ptr, K, BLOCK_K, SWIGLU, ROUND_X)
    hooks.pdl_wait(PDL)  # (a no-op after the first; K = 0 runs no chunk)
    y = tl.sum(acc, axis=1)
    if SWIGLU:
        y = y / (1.0 + tl.exp(-y)) * tl.sum(acc2, axis=1)
    tl.store(y_ptr + a.to(tl.int64) * N + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)
    if EPILOGUE != 0:
        tl.debug_barrier()  # every thread's rows are stored before the ticket is taken
        if last_ticket(count_ptr, programs):
            if EPILOGUE == 1:
                norm_row(y_ptr, next_w_ptr, normed_ptr, N, eps, HAS_NEXT, BLOCK_NORM)
            else:
                norms.residual_norm_row(res_ptr, y_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, new_res_ptr,
                                        normed_ptr, 0, N, post_eps, eps, HAS_POST, HAS_NEXT, BLOCK_NORM, True)


@triton.jit
def norm_row(y_ptr, w_ptr, normed_ptr, N, eps, HAS_WEIGHT: tl.constexpr, BLOCK_NORM: tl.constexpr):
    """``normed = rms_norm(y, w)`` over the row ``y [N]`` that the launch's programs wrote (read past this SM's L1):
    the ``norm=`` row op of :func:`dense_gemv`, in the program that draws the launch's last ticket."""
    offs_n = tl.arange(0, BLOCK_NORM)
    nmask = offs_n < N
    v = tl.load(y_ptr + offs_n, mask=nmask, other=0.0, cache_modifier=".cg").to(tl.float32)
    nw = tl.load(w_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)
    z = norms._norm(v, nw, nmask, N, eps, HAS_WEIGHT, False, normed_ptr.dtype.element_ty)
    tl.store(normed_ptr + offs_n, z.to(normed_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def deferred_gemv_program(pid, out_ptr, w_ptr, y_ptr, N, K, stride_w, res_ptr, post_w_ptr, alpha_ptr, beta_ptr,
                          next_w_ptr, new_res_ptr, post_eps, eps, HAS_POST: tl.constexpr, HAS_NEXT: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """Row block ``pid`` of ``y = W @ normed`` where ``normed`` is the ``residual_norm`` op's output on the row
    ``out [K]`` that the kernel before wrote, the op deferred to here: every program loads its rows of ``W`` with all
    of K in one chunk (``K <= BLOCK_K``) before its PDL wait, then works out the op over the whole row in registers
    (``norms.deferred_input``) as its ``x``; block 0 stores the new residual. Signals its dependents as
    :func:`gemv_program` does, after its weight loads."""
    rows, rmask, kk, kmask, wv = whole_k_tile(pid, w_ptr, N, K, stride_w, BLOCK_N, BLOCK_K)  # a weight
    hooks.pdl_launch_dependents(EARLY)
    new_res, x = norms.deferred_input(kk, kmask, out_ptr, res_ptr, post_w_ptr, alpha_ptr, beta_ptr, next_w_ptr, K,
                                      post_eps, eps, HAS_POST, HAS_NEXT, BLOCK_K, True, PDL)
    if pid == 0:
        tl.store(new_res_ptr + kk, new_res, mask=kmask)
    store_row_products(wv, x, y_ptr, rows, rmask)


@triton.jit
def _chunk_weights(k0, rows, rmask, w_ptr, w2_ptr, K, stride_w, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr):
    """The ``[BLOCK_N, BLOCK_K]`` weights of K's chunk at ``k0`` (and the up stack's with ``SWIGLU``), as stored."""
    kk = k0 + tl.arange(0, BLOCK_K)
    wo = rows[:, None].to(tl.int64) * stride_w + kk[None, :]
    wm = rmask[:, None] & (kk < K)[None, :]
    wv = tl.load(w_ptr + wo, mask=wm, other=0.0)
    w2v = wv
    if SWIGLU:
        w2v = tl.load(w2_ptr + wo, mask=wm, other=0.0)
    return wv, w2v


@triton.jit
def _chunk_products(acc, acc2, wv, w2v, k0, x_ptr, K, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr,
                    ROUND_X: tl.constexpr):
    """``acc (+ acc2) += w (w2) * x`` over K's chunk at ``k0``, in fp32; x rounded to w's dtype first with
    ``ROUND_X``."""
    kk = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
    if ROUND_X:
        x = x.to(wv.dtype)
    x = x.to(tl.float32)[None, :]
    acc += wv.to(tl.float32) * x
    if SWIGLU:
        acc2 += w2v.to(tl.float32) * x
    return acc, acc2


@triton.jit
def whole_k_tile(pid, w_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row block ``pid`` of ``W [N, K]`` with all of K in one chunk (``K <= BLOCK_K``), for GEMVs whose ``x`` a
    program works out itself (``moe.finalize_gemv_kernel``, ``router.pooler_deferred_program``): ``(rows, rmask, kk,
    kmask, w tile)``."""
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < K
    wv = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                 other=0.0)
    return rows, rmask, kk, kmask, wv


@triton.jit
def store_row_products(wv, x, y_ptr, rows, rmask):
    """``y[rows] = W[rows] @ x`` for :func:`whole_k_tile`'s tile ``wv`` and an fp32 ``x [BLOCK_K]`` (fp32 sums),
    stored in ``y``'s dtype."""
    y = tl.sum(wv.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def last_ticket(count_ptr, programs):
    """Whether this program is the last of ``programs`` to take a ticket on the int32 ``count``: an acq_rel add (this
    program's stores released before it; in the last program every earlier program's stores visible after it), and
    the last program resets ``count`` to 0 with a plain store (the next launch sees it: it starts after this one
    ends). The last program runs the launch's serial tail, so it waits for one atomic round trip only (session 49:
    a release add then an acquire exchange in the last program cost two; the acq_rel add's L1 invalidation in the
    other programs, ``CCTL.IVALL`` on SM90, measured no slower in session 47)."""
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel") == programs - 1
    if last:
        tl.store(count_ptr, 0)
    return last


@triton.jit
def qkv_gemv_rope_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, count_ptr, cos_ptr, sin_ptr, q_out_ptr, ck_ptr, cv_ptr,
                         cpos_ptr, pos_ptr, slots, capacity, eps, q_scale, res_ptr, post_w_ptr, alpha_ptr, beta_ptr,
                         next_w_ptr, new_res_ptr, post_eps, res_eps, NQ: tl.constexpr, NKV: tl.constexpr,
                         D: tl.constexpr, ROPE: tl.constexpr, RING: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, K_STATIC: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                         ROUND_X: tl.constexpr, DEFERRED: tl.constexpr = False, HAS_POST: tl.constexpr = False,
                         HAS_NEXT: tl.constexpr = False):
    """:func:`qkv_program` in every program; with ``DEFERRED`` its GEMV's input is ``residual_norm(res, x, post_w,
    alpha, beta, next_w, post_eps, res_eps)``'s normed row, which every program works out for itself
    (:func:`deferred_gemv_program`)."""
    pid = tl.program_id(0)
    if DEFERRED:
        deferred_gemv_program(pid, x_ptr, w_ptr, y_ptr, N, K, stride_w, res_ptr, post_w_ptr, alpha_ptr, beta_ptr,
                              next_w_ptr, new_res_ptr, post_eps, res_eps, HAS_POST, HAS_NEXT, BLOCK_N, BLOCK_K, PDL,
                              EARLY)
    else:
        gemv_program(pid, tl.program_id(1), tl.num_programs(0), x_ptr, w_ptr, w_ptr, x_ptr, y_ptr, N, K, stride_w, 0,
                     1, count_ptr, y_ptr, y_ptr, y_ptr, y_ptr, y_ptr, y_ptr, y_ptr, 0.0, 0.0, BLOCK_N, BLOCK_K, False,
                     False, PDL, EARLY, ROUND_X, 0, False, False, 1, False, K_STATIC)
    qkv_heads(pid, y_ptr, N, count_ptr, cos_ptr, sin_ptr, q_out_ptr, ck_ptr, cv_ptr, cpos_ptr, pos_ptr, slots,
              capacity, eps, q_scale, NQ, NKV, D, ROPE, RING, BLOCK_N)


@triton.jit
def qkv_program(pid, x_ptr, w_ptr, y_ptr, N, K, stride_w, count_ptr, cos_ptr, sin_ptr, q_out_ptr, ck_ptr, cv_ptr,
                cpos_ptr, pos_ptr, slots, capacity, eps, q_scale, NQ: tl.constexpr, NKV: tl.constexpr,
                D: tl.constexpr, ROPE: tl.constexpr, RING: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, K_STATIC: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                ROUND_X: tl.constexpr):
    """:func:`gemv_program` over rows ``q | k | v | gate`` (heads of ``D``), then :func:`qkv_heads`. Returns the head
    whose step this program ran (q heads 0 .. NQ-1, k heads NQ ..), or -1."""
    gemv_program(pid, tl.program_id(1), tl.num_programs(0), x_ptr, w_ptr, w_ptr, x_ptr, y_ptr, N, K, stride_w, 0, 1,
                 count_ptr, y_ptr, y_ptr, y_ptr, y_ptr, y_ptr, y_ptr, y_ptr, 0.0, 0.0, BLOCK_N, BLOCK_K, False, False,
                 PDL, EARLY, ROUND_X, 0, False, False, 1, False, K_STATIC)
    return qkv_heads(pid, y_ptr, N, count_ptr, cos_ptr, sin_ptr, q_out_ptr, ck_ptr, cv_ptr, cpos_ptr, pos_ptr, slots,
                     capacity, eps, q_scale, NQ, NKV, D, ROPE, RING, BLOCK_N)


@triton.jit
def qkv_heads(pid, y_ptr, N, count_ptr, cos_ptr, sin_ptr, q_out_ptr, ck_ptr, cv_ptr, cpos_ptr, pos_ptr, slots,
              capacity, eps, q_scale, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
              RING: tl.constexpr, BLOCK_N: tl.constexpr):
    """After a program stored its ``BLOCK_N`` rows of the q/k/v/gate product ``y``: each q/k head's last program to
    take its ticket runs :func:`norms.qk_norm_rope_row` on that head (a k head's ticket counts its v rows too).
    Returns the head whose step this program ran (q heads 0 .. NQ-1, k heads NQ ..), or -1."""
    head = pid * BLOCK_N // D  # q heads 0 .. NQ-1, k heads NQ .., v heads NQ + NKV .., then the gate rows
    done = -1
    if head < NQ + 2 * NKV:
        if head >= NQ + NKV:
            head -= NKV
        tl.debug_barrier()  # every thread's rows are stored before the ticket is taken
        if last_ticket(count_ptr + head, tl.where(head < NQ, 1, 2) * (D // BLOCK_N)):
            norms.qk_norm_rope_row(head.to(tl.int64), y_ptr, y_ptr + NQ * D, cos_ptr, sin_ptr, q_out_ptr, ck_ptr, NQ,
                                   NQ, NKV, N, N, eps, q_scale, y_ptr + (NQ + NKV) * D, cv_ptr, cpos_ptr, pos_ptr, 1,
                                   N, slots, capacity, D, ROPE, True, RING)
            done = head
    return done


@triton.jit
def qkv_attention_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, count_ptr, cos_ptr, sin_ptr, q_out_ptr, ck_ptr, cv_ptr,
                         cpos_ptr, pos_ptr, slots, capacity, eps, q_scale, group_ptr, k_ptr, v_ptr, kpos_ptr, o_ptr,
                         sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, S, window, qk_scale, keys, gate_eps,
                         NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
                         RING: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_STATIC: tl.constexpr,
                         PDL: tl.constexpr, EARLY: tl.constexpr, ROUND_X: tl.constexpr, BLOCK_M: tl.constexpr,
                         ATT_BLOCK_N: tl.constexpr, MODE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """:func:`qkv_program`, then attention with the head norm and gate for each KV head's group of ``NQ // NKV`` q
    heads in the last program to finish that group's part: its q heads' and k head's steps (the k head's covers v
    and the cache write) and its gate rows' programs each take a ticket on the group's counter."""
    pid = tl.program_id(0)
    done = qkv_program(pid, x_ptr, w_ptr, y_ptr, N, K, stride_w, count_ptr, cos_ptr, sin_ptr, q_out_ptr, ck_ptr,
                       cv_ptr, cpos_ptr, pos_ptr, slots, capacity, eps, q_scale, NQ, NKV, D, ROPE, RING, BLOCK_N,
                       BLOCK_K, K_STATIC, PDL, EARLY, ROUND_X)
    head = pid * BLOCK_N // D
    gate = head >= NQ + 2 * NKV
    group = tl.where(gate, (head - NQ - 2 * NKV) // (NQ // NKV), tl.where(done < NQ, done // (NQ // NKV), done - NQ))
    if gate | (done >= 0):
        tl.debug_barrier()  # the gate rows, or the head's step, stored by every thread before the ticket
        if last_ticket(group_ptr + group, NQ // NKV + 1 + NQ // NKV * (D // BLOCK_N)):
            attention.attend_tile(0, group, 0, NKV, q_out_ptr, k_ptr, v_ptr, pos_ptr, kpos_ptr, o_ptr, o_ptr,
                                  NQ * D, NQ * D, D, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, NQ * D, NQ * D, D,
                                  1, S, NKV, BLOCK_M, window, qk_scale, 1.0, keys, y_ptr + (NQ + 2 * NKV) * D, N, N,
                                  gate_eps, NQ // NKV, D, BLOCK_M, ATT_BLOCK_N, MODE, False, HAS_WINDOW, False, True,
                                  False)


def qkv_gemv_rope(x: torch.Tensor, w: torch.Tensor, nq: int, nkv: int, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, eps: float, q_scale: float, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  cache_pos: torch.Tensor, pos_new: torch.Tensor, capacity: int, ring: bool, counters: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's fused q/k/v/gate projection ``x [1,K] @ w.T`` (w's rows: nq q heads, nkv k heads, nkv v heads, nq
    gate heads, of the cache's head dim d) and :func:`norms.qk_norm_rope_kv_write` on its q/k/v heads, in one launch:
    each head's step runs in the last program to finish its rows, so heads overlap the rest of the GEMV and one
    dependent launch per attention block goes. Returns the raw projection ``y [1, N]`` (attention reads its gate
    rows) and the normed q ``[1, 1, nq, d]``; k and v go into the static cache as the KV write puts them.

    ``counters``: ``nq + nkv`` int32 zeros (one ticket per q head and per k head, each reset by the program that
    drew its last), owned by one call site whose launches do not overlap."""
    return _qkv_gemv_rope("qkv_gemv_rope", x, w, nq, nkv, cos, sin, eps, q_scale, cache_k, cache_v, cache_pos,
                          pos_new, capacity, ring, counters, None)[:2]


def qkv_gemv_rope_deferred(residual_norm: tuple, w: torch.Tensor, nq: int, nkv: int, cos: torch.Tensor | None,
                           sin: torch.Tensor | None, eps: float, q_scale: float, cache_k: torch.Tensor,
                           cache_v: torch.Tensor, cache_pos: torch.Tensor, pos_new: torch.Tensor, capacity: int,
                           ring: bool, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`qkv_gemv_rope` of ``residual_norm(residual, out, post_w, alpha, beta, next_w, post_eps, res_eps)``'s
    normed row, the op run in this launch's programs (:func:`deferred_gemv_program`) rather than in the last program
    of the GEMV that wrote ``out``: ``residual_norm = (out [1, K], residual [1, K], post_w | None, alpha, beta, next_w
    | None, post_eps, res_eps)`` (``musecore.model.DeferredNorm``'s). Returns ``(y, q, new_residual)``. Takes K up
    to one chunk (:func:`deferred_fits`); runs the backend's ``qkv_deferred`` cut (``hooks.row_op_cut``): six
    whole-row vectors per program beside its weights."""
    return _qkv_gemv_rope("qkv_gemv_rope_deferred", residual_norm[0], w, nq, nkv, cos, sin, eps, q_scale, cache_k,
                          cache_v, cache_pos, pos_new, capacity, ring, counters, residual_norm)


def _qkv_gemv_rope(name: str, x: torch.Tensor, w: torch.Tensor, nq: int, nkv: int, cos: torch.Tensor | None,
                   sin: torch.Tensor | None, eps: float, q_scale: float, cache_k: torch.Tensor, cache_v: torch.Tensor,
                   cache_pos: torch.Tensor, pos_new: torch.Tensor, capacity: int, ring: bool, counters: torch.Tensor,
                   deferred: tuple | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, q_out, args, meta = _qkv_launch(name, x, w, nq, nkv, cos, sin, eps, q_scale, cache_k, cache_v, cache_pos,
                                       pos_new, capacity, ring, counters, nq + nkv,
                                       "qkv" if deferred is None else "qkv_deferred")
    operands, flags, new_res = deferred_operands(name, deferred, w.shape[1], x)
    qkv_gemv_rope_kernel[(triton.cdiv(w.shape[0], meta["BLOCK_N"]),)](*args, *operands, **meta, **flags)
    return y, q_out, new_res


# Longest cache qkv_attention takes: one program per KV head steps through it (ATTEND_BLOCK_N keys a step); beyond,
# attention() splits the keys over more programs.
ATTEND_MAX_KEYS = 512
# qkv_attention's warps per program and keys per attention step. The whole launch gets the registers of its widest
# part: SM90 compiles of muse-small's kernel (session 51) took 242 registers at 2 warps and 128 keys (the plain
# q/k/v/gate GEMV: 122), 126 at 2 warps and 32 keys, 116 at 4 warps and 64 keys (the plain GEMV at 4 warps: 69),
# 158 at 4 warps and 128 keys. 4 warps x 116 keeps the routed GEMV's 512 threads per SM. In the decode graph
# the launch was slower at either cut (session 52, run 61; musecore_cuda.fused.ATTENTION_IN_QKV).
ATTEND_WARPS, ATTEND_BLOCK_N = 4, 64


def attention_fits(nq: int, nkv: int, keys: int) -> bool:
    """Whether :func:`qkv_attention` attends for ``nq`` query heads over ``nkv`` KV heads and a cache of ``keys``: a
    group of up to 16 heads fills one query tile, and one program per group steps through the whole cache."""
    return nq % nkv == 0 and nq // nkv <= 16 and 0 < keys <= ATTEND_MAX_KEYS


def qkv_attention(x: torch.Tensor, w: torch.Tensor, nq: int, nkv: int, cos: torch.Tensor | None,
                  sin: torch.Tensor | None, eps: float, q_scale: float, cache_k: torch.Tensor, cache_v: torch.Tensor,
                  cache_pos: torch.Tensor, pos_new: torch.Tensor, capacity: int, ring: bool, counters: torch.Tensor,
                  view: tuple[torch.Tensor, torch.Tensor, torch.Tensor], window: int | None, scale: float,
                  gate_eps: float) -> torch.Tensor:
    """:func:`qkv_gemv_rope`, then ``attention(q, k, v, pos_new, positions, window, scale, gate=(gate rows,
    gate_eps))`` over the cache ``view = (k, v, positions)`` (``[1, S, nkv, d]`` x2, ``[1, S]``, as
    ``KVCache.stored()`` gives them, after this launch's write), in one launch: the last program to finish a KV head's
    group (its q heads' and k head's steps, its gate rows) attends for that group. Returns the gated attention output
    ``[1, 1, nq, d]``. ``counters``: ``nq + 2 nkv`` int32 zeros (the heads' tickets, then the groups'). Takes
    ``nq / nkv <= 16`` heads per group and ``S <= ATTEND_MAX_KEYS``; runs ``ATTEND_WARPS`` warps per program and
    ``ATTEND_BLOCK_N`` keys per attention step."""
    k_view, v_view, kpos = view
    S = k_view.shape[1]
    if not attention_fits(nq, nkv, S) or k_view.shape != (1, S, nkv, cache_k.shape[-1]) \
            or v_view.shape != k_view.shape or kpos.shape != (1, S) or not kpos.is_contiguous() \
            or k_view.stride(3) != 1 or v_view.stride(3) != 1:
        raise ValueError(f"qkv_attention takes up to 16 q heads per KV head and a cache view of 1..{ATTEND_MAX_KEYS} "
                         f"keys (k, v [1, S, nkv, d] with d contiguous, positions [1, S] contiguous); got nq {nq}, "
                         f"nkv {nkv}, k {list(k_view.shape)}, v {list(v_view.shape)}, positions {list(kpos.shape)}")
    y, q_out, args, meta = _qkv_launch("qkv_attention", x, w, nq, nkv, cos, sin, eps, q_scale, cache_k, cache_v,
                                       cache_pos, pos_new, capacity, ring, counters, nq + 2 * nkv)
    o = torch.empty_like(q_out)
    block_n = ATTEND_BLOCK_N
    qkv_attention_kernel[(triton.cdiv(w.shape[0], meta["BLOCK_N"]),)](
        *args, counters.view(-1)[nq + nkv:], k_view, v_view, kpos, o, *k_view.stride()[:3], *v_view.stride()[:3], S,
        window if window is not None else 0, scale * attention.LOG2E, triton.cdiv(S, block_n) * block_n, gate_eps,
        **{**meta, "num_warps": ATTEND_WARPS}, BLOCK_M=16, ATT_BLOCK_N=block_n, MODE=attention.dot_mode(q_out.dtype),
        HAS_WINDOW=window is not None)
    return o


def _qkv_launch(name: str, x: torch.Tensor, w: torch.Tensor, nq: int, nkv: int, cos: torch.Tensor | None,
                sin: torch.Tensor | None, eps: float, q_scale: float, cache_k: torch.Tensor, cache_v: torch.Tensor,
                cache_pos: torch.Tensor, pos_new: torch.Tensor, capacity: int, ring: bool, counters: torch.Tensor,
                tickets: int, cut: str = "qkv") -> tuple[torch.Tensor, torch.Tensor, tuple, dict]:
    """Checks and outputs of :func:`qkv_gemv_rope` and :func:`qkv_attention`: ``(y, q_out, the kernels' shared
    arguments, their constexprs and launch options)``; ``cut``: the row-op cut's name (``hooks.row_op_cut``)."""
    d = cache_k.shape[-1]
    n, k = w.shape
    _, block_k, k_static = gemv_blocks(k)
    block_n, num_warps = row_op_cut(k, x.device, cut, QKV_BLOCK_N, QKV_WARPS)
    if x.shape != (1, k) or x.dtype not in (w.dtype, torch.float32) or w.stride(1) != 1 \
            or w.dtype not in (torch.bfloat16, torch.float16) or n != 2 * (nq + nkv) * d or d % block_n \
            or d & (d - 1):
        raise ValueError(f"{name} takes x [1,K] and a row-major 16-bit w [2 (nq + nkv) d, K] with a "
                         f"power-of-two head dim d; got x {x.dtype} {list(x.shape)}, w {w.dtype} {list(w.shape)}, "
                         f"nq {nq}, nkv {nkv}, d {d}")
    if counters.dtype != torch.int32 or counters.numel() < tickets or not counters.is_contiguous():
        raise ValueError(f"{name} needs {tickets} contiguous int32 counters; got {counters.dtype} "
                         f"{list(counters.shape)}")
    y = torch.empty(1, n, dtype=w.dtype, device=x.device)
    q, k_new, v = y.view(1, 1, -1, d)[:, :, :nq + 2 * nkv].split_with_sizes([nq, nkv, nkv], -2)
    norms.check_kv_write(name, q, k_new, v, cache_k, cache_v, cache_pos, pos_new, capacity)
    rows = norms.rope_rows(name, cos, sin, 1, 1, d)
    q_out = torch.empty(1, 1, nq, d, dtype=w.dtype, device=x.device)
    args = (x.contiguous(), w, y, n, k, w.stride(0), counters, *(rows or (q_out, q_out)), q_out, cache_k, cache_v,
            cache_pos, pos_new.contiguous(), capacity + 1, capacity, eps, q_scale)
    meta = dict(NQ=nq, NKV=nkv, D=d, ROPE=rows is not None, RING=ring, BLOCK_N=block_n, BLOCK_K=block_k,
                K_STATIC=k_static, ROUND_X=x.dtype != w.dtype, num_warps=num_warps,
                EARLY=hooks.early_trigger(x.device, "dense_gemv"), **hooks.launch_options(x.device, "dense_gemv"))
    return y, q_out, args, meta


def gemv_blocks(k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, K_STATIC): ``BLOCK_N`` rows per program and K in one chunk up to ``MAX_BLOCK_K`` columns,
    looped beyond (``K_STATIC = 0``). With ``UNROLL_K`` (off), a K of up to ``UNROLL_MAX_CHUNKS`` chunks of
    ``UNROLL_BLOCK_K`` columns (or of half that where it divides K and the whole does not) takes ``UNROLL_BLOCK_N``
    rows per program and K's chunks unrolled (``K_STATIC = K``): run 44's best standalone cut."""
    if unrolled(k):
        block_k = UNROLL_BLOCK_K // 2 if k % UNROLL_BLOCK_K and k % (UNROLL_BLOCK_K // 2) == 0 else UNROLL_BLOCK_K
        return UNROLL_BLOCK_N, block_k, k
    return BLOCK_N, min(triton.next_power_of_2(k), MAX_BLOCK_K), 0


def row_op_cut(k: int, device: torch.device, kernel: str, block_n: int | None,
               num_warps: int | None) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` of the row-op launch ``kernel`` (as :func:`musecore_triton.hooks.row_op_cut` names
    it) of depth ``k`` on ``device``: ``block_n`` x ``num_warps`` where given (a module's override), else the
    backend's cut, else ``BLOCK_N`` x ``NUM_WARPS``; :func:`gemv_blocks`' with ``NUM_WARPS`` where K's chunks unroll
    (``UNROLL_K``)."""
    if unrolled(k):
        return gemv_blocks(k)[0], NUM_WARPS
    if block_n is not None and num_warps is not None:
        return block_n, num_warps
    return hooks.row_op_cut(device, kernel) or (BLOCK_N, NUM_WARPS)


def unrolled(k: int) -> bool:
    """Whether :func:`gemv_blocks` unrolls K's chunks for a GEMV of depth ``k``."""
    return UNROLL_K and UNROLL_BLOCK_K < k <= UNROLL_BLOCK_K * UNROLL_MAX_CHUNKS


def dense_gemv(x: torch.Tensor, w: torch.Tensor, blocks: tuple[int, int, int] | None = None,
               num_warps: int | None = None, *, norm: tuple[torch.Tensor, float, torch.Tensor] | None = None,
               residual_norm: tuple | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``x [1,K] @ w[N,K].T`` -> ``[1,N]`` in w's dtype (fp32 accumulation, as cuBLAS); an fp32 ``x`` is rounded
    to w's dtype as it is loaded (the same bits as ``x.to(w.dtype)`` first). ``blocks = (BLOCK_N, BLOCK_K,
    K_STATIC)`` and ``num_warps`` override :func:`gemv_blocks` and :data:`NUM_WARPS` (for sweeps); with
    ``residual_norm`` the defaults are :func:`row_op_cut`'s.

    A row op on the product may run in the same launch, in the program that finishes last, given an int32 zero
    ``counter`` that the launch takes and gives back (owned by one call site whose launches do not overlap):

    * ``norm = (weight [N], eps, counter)``: return ``rms_norm(y, weight, eps)`` instead;
    * ``residual_norm = (residual [1,N], post_weight | None, alpha, beta, next_weight | None, post_eps, eps,
      counter)``: return ``residual_norm(residual, y, post_weight, alpha, beta, next_weight, post_eps, eps)``, the
      pair ``(residual', normed)``."""
    if x.shape[0] != 1 or x.shape[1] != w.shape[1] or w.stride(1) != 1 \
            or x.dtype not in (w.dtype, torch.float32) or w.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dense_gemv takes x [1,K] (of w's dtype, or fp32) and a row-major 16-bit w [N,K]; got x "
                         f"{x.dtype} {list(x.shape)}, w {w.dtype} {list(w.shape)} strides {w.stride()}")
    n, k = w.shape
    y = torch.empty(1, n, dtype=w.dtype, device=x.device)
    block_n, block_k, k_static = blocks or gemv_blocks(k)
    cut_n, cut_warps = (row_op_cut(k, x.device, "residual_norm", RESIDUAL_NORM_BLOCK_N, RESIDUAL_NORM_WARPS)
                        if residual_norm is not None else (block_n, NUM_WARPS))
    block_n, num_warps = (block_n if blocks else cut_n), (num_warps or cut_warps)
    extra: dict = {}
    if norm is not None and residual_norm is not None:
        raise ValueError("dense_gemv: give norm or residual_norm, not both")
    if norm is not None:
        norm_w, eps, counter = norm
        _check_epilogue(n, counter, norm_w=norm_w)
        normed = torch.empty_like(y)
        args = (counter, y, y, y, y, norm_w.contiguous(), y, normed, 0.0, eps)
        extra = dict(EPILOGUE=1, HAS_NEXT=True, BLOCK_NORM=triton.next_power_of_2(n))
    elif residual_norm is not None:
        args, extra, new_res, normed = residual_norm_operands(residual_norm, y)
    else:
        args = (y,) * 8 + (0.0, 0.0)
    dense_gemv_kernel[(triton.cdiv(n, block_n), 1)](x.contiguous(), w, w, x, y, n, k, w.stride(0), 0, 1, *args,
                                                     BLOCK_N=block_n, BLOCK_K=block_k, K_STATIC=k_static,
                                                     EXPERTS=False, SWIGLU=False, num_warps=num_warps,
                                                     ROUND_X=x.dtype != w.dtype, **extra,
                                                     EARLY=hooks.early_trigger(x.device, "dense_gemv"),
                                                     WARM=bool(extra) and hooks.l2_warm(x.device),
                                                     **hooks.launch_options(x.device, "dense_gemv"))
    if norm is not None:
        return normed
    if residual_norm is not None:
        return new_res, normed
    return y


def residual_norm_operands(residual_norm: tuple, y: torch.Tensor) -> tuple[tuple, dict, torch.Tensor, torch.Tensor]:
    """A launch's operands for the ``residual_norm`` row op on its product ``y [1, N]`` in the last program
    (``residual_norm`` as :func:`dense_gemv` takes it): ``(the kernel's ten row-op arguments from its counter on,
    its constexprs, new_res, normed)``."""
    residual, post_w, alpha, beta, next_w, post_eps, eps, counter = residual_norm
    n = y.shape[1]
    _check_epilogue(n, counter, residual=residual, alpha=alpha, beta=beta, post_w=post_w, next_w=next_w)
    new_res, normed = torch.empty_like(residual), torch.empty_like(residual)
    args = (counter, residual.contiguous(), y if post_w is None else post_w.contiguous(), alpha.contiguous(),
            beta.contiguous(), y if next_w is None else next_w.contiguous(), new_res, normed, post_eps, eps)
    extra = dict(EPILOGUE=2, HAS_POST=post_w is not None, HAS_NEXT=next_w is not None,
                 BLOCK_NORM=triton.next_power_of_2(n))
    return args, extra, new_res, normed


def deferred_fits(k: int) -> bool:
    """Whether a GEMV of depth ``k`` takes a deferred residual norm as its input (:func:`deferred_gemv_program`):
    its programs hold the whole row, one chunk, not unrolled."""
    _, block_k, k_static = gemv_blocks(k)
    return k <= block_k and not k_static


def deferred_operands(what: str, deferred: tuple | None, k: int, x: torch.Tensor) -> tuple[tuple, dict, torch.Tensor]:
    """A launch's eight operands for a deferred residual norm on its input (``res_ptr, post_w_ptr, alpha_ptr,
    beta_ptr, next_w_ptr, new_res_ptr, post_eps, eps``), its constexprs and the new residual it fills, for
    ``deferred = (out [1, k], residual [1, k], post_w | None, alpha, beta, next_w | None, post_eps, eps)``; for None
    (nothing deferred) placeholders, no constexprs and the launch's own input ``x``."""
    if deferred is None:
        return (x,) * 6 + (0.0, 0.0), {}, x
    out, residual, post_w, alpha, beta, next_w, post_eps, eps = deferred
    vectors = dict(alpha=alpha, beta=beta, post_w=post_w, next_w=next_w)
    if not deferred_fits(k) or residual.shape != (1, k) or residual.dtype != out.dtype \
            or any(v is not None and v.numel() != k for v in vectors.values()):
        raise ValueError(f"{what} takes out and residual [1, K] of one dtype with K up to one GEMV chunk and the "
                         f"residual norm's weights [K]; got K {k}, residual {residual.dtype} {list(residual.shape)} "
                         f"(out {out.dtype}), "
                         + ", ".join(f"{name} {list(v.shape)}" for name, v in vectors.items() if v is not None))
    new_res = torch.empty_like(residual)
    operands = (residual.contiguous(), out if post_w is None else post_w.contiguous(), alpha.contiguous(),
                beta.contiguous(), out if next_w is None else next_w.contiguous(), new_res, post_eps, eps)
    return operands, dict(DEFERRED=True, HAS_POST=post_w is not None, HAS_NEXT=next_w is not None), new_res


def _check_epilogue(n: int, counter: torch.Tensor, **vectors: torch.Tensor | None) -> None:
    """The row op's operands: every vector ``[n]`` (the residual ``[1, n]``), a one-element int32 counter."""
    if counter.dtype != torch.int32 or counter.numel() != 1:
        raise ValueError(f"dense_gemv: the row op takes a one-element int32 counter; got {counter.dtype} "
                         f"{list(counter.shape)}")
    for name, v in vectors.items():
        if v is not None and v.numel() != n:
            raise ValueError(f"dense_gemv: the row op's {name} has {v.numel()} elements; the product has {n}")


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
        block_n, block_k, k_static = gemv_blocks(k)
        dense_gemv_kernel[(triton.cdiv(n, block_n), flat.numel())](
            x, stack, up if up is not None else stack, flat, y, n, k, k, n * k, a_div, *(y,) * 8, 0.0, 0.0,
            BLOCK_N=block_n, BLOCK_K=block_k, K_STATIC=k_static, EXPERTS=True, SWIGLU=up is not None,
            num_warps=NUM_WARPS,
            EARLY=False, **hooks.launch_options(x.device, "expert_gemv"))
    return y
