"""W4A16 GEMM for FP4 weights (NVFP4, MXFP4) and dense 16-bit weights, in Triton.

Hopper has no FP4 tensor cores, so the FP4 tile is upcast in registers and fed to ``tl.dot``
in the activation's 16-bit type with fp32 accumulation. One kernel serves three callers, chosen
by constexpr flags so that each specialisation carries no dead work:

* ``linear`` at decode (M <= 16): BLOCK_M = 16, split-K with fp32 atomics, so that a weight of
  only 1024 rows still spreads over every SM and streams at memory speed;
* ``linear`` at prefill: 128x128 tiles with a grouped launch order for L2 reuse;
* the MoE grouped GEMM: each M block belongs to one expert (``blk_expert``), its rows are
  gathered through ``a_idx`` (sorted token-expert assignments), and gate and up are computed
  together with SwiGLU fused in the epilogue.

The upcast avoids conversion instructions: the 3 magnitude bits of an E2M1 code are shifted
straight into the exponent/mantissa field of the target type (``_fp4_bits``), which yields the
code's value times ``2**-EB`` exactly (also for the subnormal 0.5). The per-group scale is folded
with ``2**EB / F`` into one 16-bit multiplier per group (``_group_mult``), so the tile costs a few
integer ops and one multiply per element; ``F`` (a per-tensor power of two) and the NVFP4 global
scale are applied once to the fp32 accumulator (``out_scale``). The resident layout this reads is
built by :mod:`musecore_triton.layouts`: within each 128-element chunk of K, byte ``j`` holds element
``j`` in its low nibble and element ``j + 64`` in its high nibble, so the activation tile is two
contiguous halves instead of an even/odd gather.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from musecore_triton import hooks

CHUNK_K = 128  # elements of K per resident chunk (and per kernel iteration)
WFMT_DENSE, WFMT_NVFP4, WFMT_MXFP4 = 0, 1, 2
MODE_FP16, MODE_BF16, MODE_FP32 = 0, 1, 2
# Exponent offset of the shifted E2M1 bits per dot type: fp16 2**-14, bf16/fp32 2**-126.
EXP_OFFSET = {MODE_FP16: 14, MODE_BF16: 126, MODE_FP32: 126}
NVFP4_FOLD_LOG2 = 9  # e4m3 scales are <= 448 < 2**9: the multiplier stays below 2**EB


def dot_mode(dtype: torch.dtype) -> int:
    modes = {torch.float16: MODE_FP16, torch.bfloat16: MODE_BF16, torch.float32: MODE_FP32}
    if dtype not in modes:
        raise TypeError(f"FP4 GEMM takes fp16, bf16 or fp32 activations; got {dtype}")
    return modes[dtype]


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program ``pid``'s output tile ``(pid_m, pid_n)``, ``GROUP_M`` row tiles per group so that the
    programs running together share weight columns in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group
    return pid_m, pid_n


@triton.jit
def activation_rows(a_idx_ptr, offs_m, m_mask, n_assign, GATHER: tl.constexpr, A_DIV: tl.constexpr):
    """``(a_valid, a_rows)``: which rows of the tile are real and which activation row each reads.
    With ``GATHER`` row ``m`` is assignment ``idx[m]`` of the routing sort, reading token
    ``idx // A_DIV`` (``A_DIV == 0``: rows already in sorted order, as the MoE down projection's)."""
    if GATHER:
        idx = tl.load(a_idx_ptr + offs_m, mask=m_mask, other=n_assign)
        a_valid = idx < n_assign
        if A_DIV == 0:
            a_rows = offs_m
        else:
            a_rows = tl.where(a_valid, idx // A_DIV, 0)
    else:
        a_valid = m_mask
        a_rows = offs_m
    return a_valid, a_rows


@triton.jit
def _pow2(e):
    """Exact 2**e for integer e in [-126, 127] (bit construction: ex2.approx is not exact)."""
    return ((e + 127).to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_bits(c, MODE: tl.constexpr):
    """E2M1 codes (int32, 0..15) -> the dot type, holding value * 2**-EXP_OFFSET[MODE] exactly."""
    mag = c & 7
    sign = c & 8
    if MODE == 0:
        return ((mag << 9) | (sign << 12)).to(tl.int16).to(tl.float16, bitcast=True)
    elif MODE == 1:
        return ((mag << 6) | (sign << 12)).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return ((mag << 22) | (sign << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _group_mult(s, fold_log2, WFMT: tl.constexpr, MODE: tl.constexpr, EB: tl.constexpr, HW_FP8: tl.constexpr):
    """Scale bytes (int32) -> scale * 2**EB / 2**fold_log2 in the dot type (exact: <= 4 significant bits)."""
    if WFMT == 1 and HW_FP8:  # hardware e4m3 -> fp32 conversion
        v = s.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * _pow2(EB - fold_log2)
    elif WFMT == 1:  # e4m3: s eeee mmm, bias 7, decoded with integer ops (anywhere, and the interpreter)
        e = (s >> 3) & 15
        m = s & 7
        normal = (8 + m).to(tl.float32) * _pow2(e - 10 + EB - fold_log2)
        subnormal = m.to(tl.float32) * _pow2(EB - 9 - fold_log2)
        v = tl.where(e > 0, normal, subnormal)
        v = tl.where((s & 128) != 0, -v, v)
    else:  # e8m0: 2**(s - 127)
        v = _pow2(tl.maximum(s - 127 + EB - fold_log2, -126))
    if MODE == 0:
        return v.to(tl.float16)
    elif MODE == 1:
        return v.to(tl.bfloat16)
    else:
        return v


@triton.jit
def _load_w_halves(w_ptr, s_ptr, w_row, s_row, n_mask, kc, fold_log2,
                   WFMT: tl.constexpr, MODE: tl.constexpr, EB: tl.constexpr,
                   BLOCK_N: tl.constexpr, GROUP: tl.constexpr, HW_FP8: tl.constexpr,
                   PACKED_UPCAST: tl.constexpr):
    """The weight tile of chunk ``kc`` as two [BLOCK_N, 64] halves in the dot type."""
    if WFMT == 0:
        offs = tl.arange(0, 64)
        base = w_ptr + w_row[:, None] + kc * 128 + offs[None, :]
        w_lo = tl.load(base, mask=n_mask[:, None], other=0.0)
        w_hi = tl.load(base + 64, mask=n_mask[:, None], other=0.0)
    else:
        NG: tl.constexpr = 64 // GROUP          # scale groups per half
        GB: tl.constexpr = GROUP                # bytes per group within a half
        offs_g = tl.arange(0, NG)
        offs_b = tl.arange(0, GB)
        byte_off = kc * 64 + offs_g[None, :, None] * GB + offs_b[None, None, :]
        b = tl.load(w_ptr + w_row[:, None, None] + byte_off, mask=n_mask[:, None, None], other=0)
        s_base = s_ptr + s_row[:, None] + kc * (2 * NG) + offs_g[None, :]
        s_lo = tl.load(s_base, mask=n_mask[:, None], other=0).to(tl.int32)
        s_hi = tl.load(s_base + NG, mask=n_mask[:, None], other=0).to(tl.int32)
        m_lo = _group_mult(s_lo, fold_log2, WFMT, MODE, EB, HW_FP8)
        m_hi = _group_mult(s_hi, fold_log2, WFMT, MODE, EB, HW_FP8)
        if PACKED_UPCAST and MODE == 1:  # a vendor's packed upcast (musecore_triton.hooks)
            v_lo, v_hi = hooks.fp4x2_bf16_scaled(b, tl.broadcast_to(m_lo[:, :, None], b.shape),
                                            tl.broadcast_to(m_hi[:, :, None], b.shape))
            w_lo = tl.reshape(v_lo, (BLOCK_N, 64))
            w_hi = tl.reshape(v_hi, (BLOCK_N, 64))
        else:
            b = b.to(tl.int32)
            w_lo = tl.reshape(_fp4_bits(b & 15, MODE) * m_lo[:, :, None], (BLOCK_N, 64))
            w_hi = tl.reshape(_fp4_bits(b >> 4, MODE) * m_hi[:, :, None], (BLOCK_N, 64))
    return w_lo, w_hi


@triton.jit
def w4a16_gemm_kernel(
    a_ptr, a_idx_ptr, n_assign, stride_am,
    w_ptr, s_ptr, w2_ptr, s2_ptr, stride_we, stride_wn, stride_se, stride_sn,
    out_scale_ptr, out_scale2_ptr, fold_log2,
    c_ptr, stride_cm, blk_expert_ptr,
    M, N, K,
    WFMT: tl.constexpr, MODE: tl.constexpr, EB: tl.constexpr, GROUP: tl.constexpr,
    GATHER: tl.constexpr, A_DIV: tl.constexpr, EXPERTS: tl.constexpr, SWIGLU: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    HW_FP8: tl.constexpr, PACKED_UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    """C[M, N] (+)= A[M, K] @ W[e, N, K]^T; see the module docstring for the three uses."""
    hooks.pdl_wait(PDL)  # the kernel before has finished (musecore_triton.hooks)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    if EXPERTS:
        expert = tl.load(blk_expert_ptr + pid_m)
    else:
        expert = tl.full((), 0, tl.int32)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        a_valid, a_rows = activation_rows(a_idx_ptr, offs_m, m_mask, n_assign, GATHER, A_DIV)
        a_base = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + tl.arange(0, 64)[None, :]
        w_row = expert.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wn
        s_row = expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        chunks = K // 128 // SPLIT_K
        for i in range(0, chunks):
            kc = pid_k * chunks + i
            a_lo = tl.load(a_base + kc * 128, mask=a_valid[:, None], other=0.0)
            a_hi = tl.load(a_base + kc * 128 + 64, mask=a_valid[:, None], other=0.0)
            w_lo, w_hi = _load_w_halves(w_ptr, s_ptr, w_row, s_row, n_mask, kc, fold_log2,
                                        WFMT, MODE, EB, BLOCK_N, GROUP, HW_FP8, PACKED_UPCAST)
            acc = tl.dot(a_lo, tl.trans(w_lo), acc)
            acc = tl.dot(a_hi, tl.trans(w_hi), acc)
            if SWIGLU:
                u_lo, u_hi = _load_w_halves(w2_ptr, s2_ptr, w_row, s_row, n_mask, kc, fold_log2,
                                            WFMT, MODE, EB, BLOCK_N, GROUP, HW_FP8, PACKED_UPCAST)
                acc2 = tl.dot(a_lo, tl.trans(u_lo), acc2)
                acc2 = tl.dot(a_hi, tl.trans(u_hi), acc2)

        if WFMT != 0:
            acc = acc * tl.load(out_scale_ptr + expert)
            if SWIGLU:
                acc2 = acc2 * tl.load(out_scale2_ptr + expert)
        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc2
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_mask = (a_valid & m_mask)[:, None] & n_mask[None, :]
        if SPLIT_K > 1:  # relaxed: the default acq_rel fences every add (MEMBAR.ALL.GPU in SM90 SASS); none is needed
            tl.atomic_add(c_ptrs, acc, mask=c_mask, sem="relaxed")
        else:
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    split_k: int
    group_m: int
    num_warps: int
    num_stages: int


# (largest m_rows, block_m, block_n, warps, stages, group_m, largest split-K) per M regime, from a tile
# sweep of NVFP4 q_proj and expert_down on the H200 (backends/cuda/lab/NOTES.md).
TILE_REGIMES = ((16, 16, 64, 8, 3, 1, 8), (64, 64, 64, 4, 4, 1, 4), (128, 64, 128, 4, 3, 8, 2),
                (256, 128, 128, 8, 3, 8, 2), (None, 128, 256, 8, 3, 8, 1))


def tile_regime(m_rows: int) -> tuple[int, int, int, int, int, int]:
    """``(block_m, block_n, warps, stages, group_m, max_split)`` of :func:`pick_config` for ``m_rows``."""
    for top, *cut in TILE_REGIMES:
        if top is None or m_rows <= top:
            return tuple(cut)
    raise AssertionError("TILE_REGIMES ends with an open regime")


def pick_config(m_rows: int, n: int, k: int, m_blocks: Optional[int], device: torch.device,
                allow_split: bool) -> GemmConfig:
    """Tile shapes per M regime (decode: split-K GEMV-like; prefill: 128x128 tensor-core tiles).

    ``m_rows`` is the rows one weight sees (M for linear, tokens per expert for MoE); ``m_blocks``
    the number of M blocks launched when it is not ``cdiv(m_rows, block_m)`` (MoE). Split-K fills
    ``4 * num_sms`` programs (:func:`musecore_triton.hooks.num_sms`).
    """
    bm, bn, warps, stages, group, max_split = tile_regime(m_rows)
    if device.type != "cuda":  # the interpreter pays per program: fewer, larger tiles
        bn = min(bn, 64)
    blocks = (m_blocks if m_blocks is not None else triton.cdiv(m_rows, bm)) * triton.cdiv(n, bn)
    split = 1
    chunks = k // CHUNK_K
    if allow_split:
        target = 4 * hooks.num_sms(device)
        while (split < max_split and blocks * split < target and chunks % (split * 2) == 0
               and chunks // (split * 2) >= 4):
            split *= 2
    return GemmConfig(bm, bn, split, group, warps, stages)


def launch_gemm(a: torch.Tensor, w: torch.Tensor, scales: Optional[torch.Tensor],
                out_scale: Optional[torch.Tensor], *, wfmt: int, group: int, fold_log2: int,
                n: int, k: int, out: torch.Tensor, cfg: GemmConfig,
                a_idx: Optional[torch.Tensor] = None, n_assign: int = 0, a_div: int = 1,
                blk_expert: Optional[torch.Tensor] = None, m_rows: Optional[int] = None,
                w2: Optional[torch.Tensor] = None, scales2: Optional[torch.Tensor] = None,
                out_scale2: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch :func:`w4a16_gemm_kernel`. ``w``/``scales`` are ``[E, N, ...]`` resident stacks."""
    if k % CHUNK_K:
        raise ValueError(f"the W4A16 kernel needs K divisible by {CHUNK_K}; got K={k}")
    mode = dot_mode(a.dtype)
    if wfmt == WFMT_DENSE and w.dtype != a.dtype:
        raise TypeError(f"dense weights must match the activation dtype ({a.dtype}); got {w.dtype}")
    if a.stride(-1) != 1:
        raise ValueError("activations must be contiguous along K")
    rows = m_rows if m_rows is not None else a.shape[0]
    num_pid_m = triton.cdiv(rows, cfg.block_m)
    grid = (num_pid_m * triton.cdiv(n, cfg.block_n), cfg.split_k)
    dummy = w
    w4a16_gemm_kernel[grid](
        a, a_idx if a_idx is not None else dummy, n_assign, a.stride(0),
        w, scales if scales is not None else dummy, w2 if w2 is not None else dummy,
        scales2 if scales2 is not None else dummy,
        w.stride(0), w.stride(1),
        scales.stride(0) if scales is not None else 0, scales.stride(1) if scales is not None else 0,
        out_scale if out_scale is not None else dummy, out_scale2 if out_scale2 is not None else dummy,
        fold_log2, out, out.stride(0), blk_expert if blk_expert is not None else dummy,
        rows, n, k,
        WFMT=wfmt, MODE=mode, EB=EXP_OFFSET[mode], GROUP=group,
        GATHER=a_idx is not None, A_DIV=a_div, EXPERTS=blk_expert is not None, SWIGLU=w2 is not None,
        SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **hooks.launch_features(a.device), **hooks.launch_options(a.device, "w4a16_gemm"),
    )
    return out


def w4a16_linear(x: torch.Tensor, w) -> torch.Tensor:
    """``x [..., K] @ W.T`` for an FP4 resident weight (:class:`musecore_triton.layouts.Fp4Resident`)
    through :func:`w4a16_gemm_kernel` at any M: the portable path of a backend with no faster one."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != w.in_features):
        x2 = x2.contiguous()
    m, n, k = x2.shape[0], w.out_features, w.in_features
    if m == 0:
        return x.new_empty(*lead, n)
    cfg = pick_config(m, n, k, None, x2.device, allow_split=True)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x2.device) if cfg.split_k > 1
           else torch.empty(m, n, dtype=x2.dtype, device=x2.device))
    launch_gemm(x2, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2,
                n=n, k=k, out=out, cfg=cfg)
    return out.to(x2.dtype).reshape(*lead, n)
