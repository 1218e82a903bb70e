"""Flash attention with musecore's position-based mask contract, for prefill and decode.

The mask is not a shape rule but a function of positions (``musecore.ops.attention``): key j is
visible to query i iff ``0 <= k_pos[j] <= q_pos[i]`` and, with a window, ``q_pos[i] - k_pos[j] <
W``; ``k_pos = -1`` marks an empty cache slot, so ring-buffer caches and padded batches need no
special casing. The kernel evaluates exactly that per tile and skips tiles nothing sees.

GQA is handled by packing the ``G = nq/nkv`` query heads of one KV head into the rows of a tile
(row r = token ``r // G``, head ``r % G``): K/V are read once per group, and at decode the 8-80
heads of one token fill a 16-row tensor-core tile. Long decode contexts are split along S
(flash-decoding) so that a handful of KV heads still occupies every SM; the partial results are
merged with their log-sum-exp by one more kernel, which also takes the gate's epilogue. FP8 K/V bytes
are upcast exactly in registers and their per-tensor scales are applied to the scores and the
output, never to the cache.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


from musecore_triton import hooks
from musecore_triton.kernels.fp4_gemm import dot_mode

LOG2E = 1.4426950408889634

# Keys per loop step of a one-token (decode) attention program. Each step is two dependent memory round trips (the
# keys' positions, then k and v), so wider steps mean fewer of them: 128 against 64 took muse-small's batch-1
# generate (96-key cache) from 740 to 720 us per token on the H200, 32 lost 50 (backends/cuda/lab/NOTES.md, session
# 51). How many programs split the keys is still decided in units of SPLIT_UNIT keys, as before (key_splits; a split's
# range is then rounded to whole steps, which at some lengths leaves one split fewer).
DECODE_BLOCK_N = 128
SPLIT_UNIT = 64
# A one-token program loads the next step's key positions while it works on this step's keys (the loop's loads are
# not software-pipelined by Triton: they sit in the step's condition), so a step after the first, e.g. the empty second
# block of a 256-slot generation cache, costs no memory round trip of its own. Off: run 69 (session 55, muse-small
# NVFP4 greedy decode on the H200, 4 rounds) timed it at replay 687.2 -> 685.3 us, and on top of EAGER_FIRST_STEP
# 678.2 -> 678.3 us (generate 701.3 -> 698.7 us/token), too little for what it costs AMD (below).
PREFETCH_POSITIONS = False
# A one-token program loads its first step's k and v together with that step's key positions, where the loop reads
# them only once a position there is visible: one memory round trip fewer per call (a muse-small step has 16), at the
# price of reading k and v even when none of the step's keys is visible. Later steps keep the lazy loads, so with
# PREFETCH_POSITIONS an empty later step (a 256-slot generation cache's second block) still costs nothing. Run 59
# (session 51) timed the older form, which loaded k and v eagerly in every step of caches up to 256 keys: the plain
# step's replay 685.6 -> 679.3 us, greedy generate 719.8 -> 728.9 (a 256-slot cache, whose empty second step then read
# its k and v). Run 69 (session 55, this form, 4 rounds on the H200): replay 687.2 -> 678.2 us per muse-small NVFP4
# step, greedy generate 709.0 -> 701.3 us/token (medians; A/B mode attn_eager of cuda_fused_ab.py). So it is the
# backend's choice (hooks.eager_first_step: the CUDA backend's on, the portable default off); None here follows it,
# True / False force it (tests, A/B).
EAGER_FIRST_STEP: Optional[bool] = None
# Compiled for AMD without a GPU (backends/rocm/tests/test_rocm_compile.py, sessions 54-55), the one-token program
# takes on gfx950 205 VGPRs (2 waves) plain, 256 + 45-76 AGPRs (1 wave) with PREFETCH_POSITIONS, and with EAGER 205
# without a window but 256 + 7 AGPRs (1 wave, against 252 and 2 waves) with one, and 256 + 44-48 AGPRs with an FP8 KV
# cache: neither is on for ROCm.


def eager_first_step(device: torch.device) -> bool:
    """:data:`EAGER_FIRST_STEP` where set, else the backend's choice (``musecore_triton.hooks.eager_first_step``)."""
    return hooks.eager_first_step(device) if EAGER_FIRST_STEP is None else EAGER_FIRST_STEP


def key_splits(S: int, programs: int, block_n: int, sms: int) -> tuple[int, int]:
    """``(splits, keys_per_split)``: how many programs share each (query block, KV head)'s ``S`` keys. Only a grid
    of fewer than two programs per SM splits, into at most one split per ``4 * SPLIT_UNIT`` keys; each split's range
    is a whole number of ``block_n``-key steps."""
    splits = 1
    if programs < 2 * sms:
        splits = max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(S, 4 * SPLIT_UNIT)))
    keys_per_split = triton.cdiv(triton.cdiv(S, splits), block_n) * block_n
    return (triton.cdiv(S, keys_per_split) if S else 1), keys_per_split


@triton.jit
def _e4m3_to(b, MODE: tl.constexpr):
    """e4m3 bytes (int32) -> exact values in the dot type (bits shifted into place, then rescaled)."""
    if MODE == 0:
        x = (((b & 127) << 7) | ((b & 128) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        return (x * 256.0).to(tl.float16)
    elif MODE == 1:
        x = (((b & 127) << 4) | ((b & 128) << 8)).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return (x * 1.329227995784916e36).to(tl.bfloat16)  # 2**120
    else:
        return (((b & 127) << 20) | ((b & 128) << 24)).to(tl.float32, bitcast=True) * 1.329227995784916e36


@triton.jit
def attention_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, o_ptr, ml_ptr,
                     sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_t, so_h,
                     T, S, nkv, rows_pad, window, qk_scale, v_scale, keys_per_split, g_ptr, sg_b, sg_t, gate_eps,
                     G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     MODE: tl.constexpr, KV_FP8: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     SPLIT: tl.constexpr, PDL: tl.constexpr, GATE: tl.constexpr = False,
                     PREFETCH: tl.constexpr = False, EAGER: tl.constexpr = False, EARLY: tl.constexpr = False):
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    # EARLY: the kernel after (o_proj's GEMV) may start now and load its weights while this one attends; it starts
    # after this kernel's wait, so at most this grid and the next are resident (as the early-signalling GEMVs keep it)
    hooks.pdl_launch_dependents(EARLY)
    attend_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(1), q_ptr, k_ptr, v_ptr,
                qpos_ptr, kpos_ptr, o_ptr, ml_ptr, sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_t,
                so_h, T, S, nkv, rows_pad, window, qk_scale, v_scale, keys_per_split, g_ptr, sg_b, sg_t, gate_eps,
                G, D, BLOCK_M, BLOCK_N, MODE, KV_FP8, HAS_WINDOW, SPLIT, GATE, PREFETCH, EAGER)


@triton.jit
def attend_tile(pid_m, pid_bh, pid_s, programs_bh, q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, o_ptr, ml_ptr,
                sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, so_b, so_t, so_h,
                T, S, nkv, rows_pad, window, qk_scale, v_scale, keys_per_split, g_ptr, sg_b, sg_t, gate_eps,
                G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MODE: tl.constexpr, KV_FP8: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
                GATE: tl.constexpr, PREFETCH: tl.constexpr, EAGER: tl.constexpr = False):
    """Query rows ``pid_m * BLOCK_M ..`` (token-major, ``G`` heads per token) of (batch, KV head) ``pid_bh`` against
    key split ``pid_s`` (``programs_bh`` (batch, KV head) pairs in all): the output rows (with the head norm and gate
    when ``GATE``), or with ``SPLIT`` the split's unnormalised partial and its (max, sum) for the merge kernel. With
    ``PREFETCH`` each step's key positions are loaded during the step before (:data:`PREFETCH_POSITIONS`); with
    ``EAGER`` the first step's k and v are loaded with its positions (:data:`EAGER_FIRST_STEP`)."""
    b = pid_bh // nkv
    kvh = pid_bh % nkv
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_valid = r < T * G
    t = r // G
    h = kvh * G + r % G
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + t[:, None].to(tl.int64) * sq_t + h[:, None] * sq_h + d[None, :],
                mask=r_valid[:, None], other=0.0)
    qp = tl.load(qpos_ptr + b.to(tl.int64) * T + t, mask=r_valid, other=-1)
    g = qp  # (unused without the gate)
    if GATE and not SPLIT:  # the gate rows with q, not after the loop's reductions: one memory round trip fewer
        g = _gate_rows(g_ptr, b, t, h, r_valid, sg_b, sg_t, D)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    s_begin = pid_s * keys_per_split
    s_end = tl.minimum(S, s_begin + keys_per_split)
    k_base = k_ptr + b.to(tl.int64) * sk_b + kvh * sk_h
    v_base = v_ptr + b.to(tl.int64) * sv_b + kvh * sv_h
    kpos_base = kpos_ptr + b.to(tl.int64) * S
    s_loop = s_begin
    if EAGER:  # the first step peeled: its positions, k and v in flight together
        offs_s = s_begin + tl.arange(0, BLOCK_N)
        s_mask = offs_s < s_end
        kp = tl.load(kpos_base + offs_s, mask=s_mask, other=-1)
        k, v = _step_kv(k_base, v_base, offs_s, s_mask, sk_s, sv_s, d)
        visible = _visible(kp, qp, window, HAS_WINDOW)
        if tl.max(tl.max(visible.to(tl.int32), axis=1), axis=0) > 0:
            m_i, l_i, acc = _accumulate(q, k, v, visible, m_i, l_i, acc, qk_scale, MODE, KV_FP8)
        s_loop = s_begin + BLOCK_N
    if PREFETCH:
        first = s_loop + tl.arange(0, BLOCK_N)
        kp_next = tl.load(kpos_base + first, mask=first < s_end, other=-1)
    for s0 in range(s_loop, s_end, BLOCK_N):
        offs_s = s0 + tl.arange(0, BLOCK_N)
        s_mask = offs_s < s_end
        if PREFETCH:
            kp = kp_next
            following = offs_s + BLOCK_N  # (the last step's is masked off: no memory access)
            kp_next = tl.load(kpos_base + following, mask=following < s_end, other=-1)
        else:
            kp = tl.load(kpos_base + offs_s, mask=s_mask, other=-1)
        visible = _visible(kp, qp, window, HAS_WINDOW)
        if tl.max(tl.max(visible.to(tl.int32), axis=1), axis=0) > 0:
            k, v = _step_kv(k_base, v_base, offs_s, s_mask, sk_s, sv_s, d)
            m_i, l_i, acc = _accumulate(q, k, v, visible, m_i, l_i, acc, qk_scale, MODE, KV_FP8)

    if SPLIT:
        part = (pid_s * programs_bh + pid_bh).to(tl.int64) * rows_pad + r
        tl.store(o_ptr + part[:, None] * D + d[None, :], acc * v_scale)
        tl.store(ml_ptr + part * 2, m_i)
        tl.store(ml_ptr + part * 2 + 1, l_i)
    else:
        out = tl.where(l_i[:, None] > 0, acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
        _store_rows(o_ptr, out, g, b, t, h, r_valid, so_b, so_t, so_h, gate_eps, D, GATE)


@triton.jit
def _step_kv(k_base, v_base, offs_s, s_mask, sk_s, sv_s, d):
    """A step's keys and values ``[BLOCK_N, D]`` at slots ``offs_s`` (masked-off slots read as 0), as stored."""
    k = tl.load(k_base + offs_s[:, None].to(tl.int64) * sk_s + d[None, :], mask=s_mask[:, None], other=0)
    v = tl.load(v_base + offs_s[:, None].to(tl.int64) * sv_s + d[None, :], mask=s_mask[:, None], other=0)
    return k, v


@triton.jit
def _visible(kp, qp, window, HAS_WINDOW: tl.constexpr):
    """Which (query row, key) pairs attend: the key's slot holds a position, not after the query's, in the window."""
    visible = (kp[None, :] >= 0) & (kp[None, :] <= qp[:, None])
    if HAS_WINDOW:
        visible = visible & ((qp[:, None] - kp[None, :]) < window)
    return visible


@triton.jit
def _accumulate(q, k, v, visible, m_i, l_i, acc, qk_scale, MODE: tl.constexpr, KV_FP8: tl.constexpr):
    """One step of the online softmax over the step's keys ``k`` / values ``v``: the updated (max, sum, output)."""
    if KV_FP8:
        k = _e4m3_to(k.to(tl.int32), MODE)
        v = _e4m3_to(v.to(tl.int32), MODE)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _gate_rows(g_ptr, b, t, h, r_valid, sg_b, sg_t, D: tl.constexpr):
    """The gate logits of a tile's rows (row = token ``t``, head ``h``), fp32 ``[rows, D]``."""
    d = tl.arange(0, D)
    return tl.load(g_ptr + b.to(tl.int64) * sg_b + t[:, None].to(tl.int64) * sg_t + h[:, None] * D + d[None, :],
                   mask=r_valid[:, None], other=0.0).to(tl.float32)


@triton.jit
def _store_rows(o_ptr, out, g, b, t, h, r_valid, so_b, so_t, so_h, gate_eps, D: tl.constexpr,
                GATE: tl.constexpr):
    """Store a tile's finished rows (row = token ``t``, head ``h``) into ``[B,T,nq,D]``; with ``GATE``, the
    head_norm_gate op on each row first (``g``: their gate logits, :func:`_gate_rows`), rounded to the output's dtype
    as that op reads it."""
    d = tl.arange(0, D)
    if GATE:
        out = out.to(o_ptr.dtype.element_ty).to(tl.float32)
        rs = 1.0 / tl.sqrt(tl.sum(out * out, axis=1) / D + gate_eps)
        out = out * rs[:, None] * (1.0 / (1.0 + tl.exp(-g)))
    o_ptrs = o_ptr + b.to(tl.int64) * so_b + t[:, None].to(tl.int64) * so_t + h[:, None] * so_h + d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=r_valid[:, None])


@triton.jit
def merge_splits_kernel(part_ptr, ml_ptr, o_ptr, splits, nkv, rows, rows_pad, so_b, so_t, so_h,
                        g_ptr, sg_b, sg_t, gate_eps, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                        PDL: tl.constexpr, GATE: tl.constexpr):
    """Flash-decoding's merge: one tile of rows of one (batch, KV head), its ``splits`` partials ``[BH, R, D]`` and
    their (max, sum) combined by log2-sum-exp (a split that saw nothing has max -inf: weight 0; a row nothing saw
    is 0), stored like the unsplit kernel's epilogue (with the gate when asked)."""
    hooks.pdl_wait(PDL)
    pid_bh = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_valid = r < rows
    b, kvh = pid_bh // nkv, pid_bh % nkv
    d = tl.arange(0, D)
    stride = tl.num_programs(0).to(tl.int64) * rows_pad  # one split's rows
    row = pid_bh.to(tl.int64) * rows_pad + r
    t, h = r // G, kvh * G + r % G
    g = r  # (unused without the gate)
    if GATE:  # loaded with the partials, not after the merge's reductions
        g = _gate_rows(g_ptr, b, t, h, r_valid, sg_b, sg_t, D)
    m_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for s in range(splits):
        m_max = tl.maximum(m_max, tl.load(ml_ptr + (s * stride + row) * 2, mask=r_valid, other=float("-inf")))
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.zeros((BLOCK_M,), dtype=tl.float32)
    num = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for s in range(splits):
        at = s * stride + row
        w = tl.exp2(tl.load(ml_ptr + at * 2, mask=r_valid, other=float("-inf")) - m_max)
        denom += w * tl.load(ml_ptr + at * 2 + 1, mask=r_valid, other=0.0)
        num += w[:, None] * tl.load(part_ptr + at[:, None] * D + d[None, :], mask=r_valid[:, None], other=0.0)
    out = tl.where(denom[:, None] > 0, num / tl.where(denom > 0, denom, 1.0)[:, None], 0.0)
    _store_rows(o_ptr, out, g, b, t, h, r_valid, so_b, so_t, so_h, gate_eps, D, GATE)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
              window: Optional[int], scale: float, k_scale: Optional[float] = None,
              v_scale: Optional[float] = None, gate: Optional[tuple[torch.Tensor, float]] = None) -> torch.Tensor:
    """The ``attention`` op (``musecore.ops``): causal GQA by positions, optional window and FP8 K/V.

    ``gate = (gate_logits [B,T,nq,d], eps)``: return ``head_norm_gate(attention, gate_logits, eps)`` instead, in the
    epilogue of the attention kernel, or of the merge kernel when the keys are split. The logits may be a fused
    projection's slice (each token's heads contiguous)."""
    B, T, nq, d = q.shape
    S, nkv = k.shape[1], k.shape[2]
    if nq % nkv:
        raise ValueError(f"GQA needs nq divisible by nkv; got nq={nq}, nkv={nkv}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"the attention kernel needs a power-of-two head dim >= 16; got {d}")
    kv_fp8 = k.dtype == torch.float8_e4m3fn
    if kv_fp8 != (v.dtype == torch.float8_e4m3fn):
        raise TypeError(f"k and v must both be fp8 or both 16-bit; got {k.dtype} and {v.dtype}")
    if not kv_fp8 and k.dtype != q.dtype:
        raise TypeError(f"16-bit k/v must match q's dtype {q.dtype}; got {k.dtype}")
    mode = dot_mode(q.dtype)
    group = nq // nkv
    rows = T * group
    block_m = 16 if rows <= 16 else 64
    block_n = DECODE_BLOCK_N if T == 1 else SPLIT_UNIT
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    m_blocks = triton.cdiv(rows, block_m)
    programs = m_blocks * B * nkv
    splits, keys_per_split = key_splits(S, programs, block_n, hooks.num_sms(q.device))
    if kv_fp8:
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    qk_scale = scale * LOG2E * (k_scale if k_scale is not None else 1.0)
    if gate is not None:
        g, g_eps = gate
        if g.shape != q.shape or g.stride(3) != 1 or g.stride(2) != d:
            raise ValueError(f"attention: gate logits must be [B,T,nq,d] = {list(q.shape)} with each token's heads "
                             f"contiguous; got {list(g.shape)} strides {g.stride()}")
        gate_args = (g, g.stride(0), g.stride(1), g_eps)
    else:
        gate_args = (q, 0, 0, 0.0)
    rows_pad = m_blocks * block_m
    if splits > 1:
        partial = torch.empty(splits, B * nkv, rows_pad, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(splits, B * nkv, rows_pad, 2, dtype=torch.float32, device=q.device)
        target = partial
    else:
        ml = target = out
    attention_kernel[(m_blocks, B * nkv, splits)](
        q, k, v, q_pos.contiguous(), k_pos.contiguous(), target, ml,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        T, S, nkv, rows_pad, window if window is not None else 0, qk_scale,
        v_scale if v_scale is not None else 1.0, keys_per_split, *gate_args,
        G=group, D=d, BLOCK_M=block_m, BLOCK_N=block_n, MODE=mode, KV_FP8=kv_fp8,
        HAS_WINDOW=window is not None, SPLIT=splits > 1, GATE=gate is not None and splits == 1,
        PREFETCH=PREFETCH_POSITIONS and T == 1, EAGER=eager_first_step(q.device) and T == 1,
        EARLY=splits == 1 and hooks.early_trigger(q.device, "attention"), num_warps=4,
        num_stages=1 if kv_fp8 else 2,  # fp8 with 2 stages asked for 288 KB of shared memory on SM90
        **hooks.launch_options(q.device, "attention"))
    if splits > 1:
        merge_splits_kernel[(B * nkv, m_blocks)](
            partial, ml, out, splits, nkv, rows, rows_pad, out.stride(0), out.stride(1), out.stride(2), *gate_args,
            G=group, D=d, BLOCK_M=block_m, GATE=gate is not None, num_warps=4,
            **hooks.launch_options(q.device, "attention_merge"))
    return out
