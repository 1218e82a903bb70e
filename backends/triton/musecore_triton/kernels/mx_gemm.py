"""MXFP4 GEMMs through Triton's ``tl.dot_scaled``: W4A4 (activations quantized in the kernel) and W4A16.

``tl.dot_scaled`` multiplies microscaled operands: on AMD gfx950 (MI350X/MI355X) an e2m1 x e2m1
product lowers to the scaled MFMA (``v_mfma_scale_f32_*_f8f6f4``), on NVIDIA SM100 to the block-
scaled tensor-core MMA; elsewhere Triton upcasts (gfx942, SM90: bf16, or fp16 when the other
operand is fp16 on CDNA3). The weight stays in the checkpoint's canonical MXFP4 bytes (``[E, N, K/2]``
uint8, element ``2i`` in the low nibble, as ``dot_scaled`` wants; E8M0 scales ``[E, N, K/32]``), so
there is no resident repack.

One kernel, :func:`mx_gemm_kernel`, with the activation operand in one of three forms (``A_MODE``):

* ``A_QUANT``: 16/32-bit activations quantized to MXFP4 per 1x32 block (E8M0 scale) inside the
  kernel, tile by tile, then ``dot_scaled(e2m1, e2m1)``: the W4A4 linear at decode in one launch
  (beyond ``PREQUANTIZE_MIN_M`` rows :func:`mxfp4_quantize_kernel` runs first and the GEMM reads
  ``A_PACKED``);
* ``A_PACKED``: activations already MXFP4 (packed bytes + E8M0 scales), e.g. the MoE intermediate
  that the gate/up kernel quantized in its epilogue;
* ``A_DENSE``: ``dot_scaled(bf16|fp16, e2m1)``: W4A16.

The activation quantization is the emulated target's (``musecore_quant``'s
``mxfp4_fake_quantize_activation`` with its defaults, EVEN shared exponent and round-half-even
elements): :func:`activation_rule` reads it from there and the tests check the kernel's codes and
scales bit for bit against ``musecore_quant.quantize``. The MoE use (expert rows gathered through
``a_idx``, one expert per M block, gate and up with SwiGLU fused) mirrors
:func:`musecore_triton.kernels.fp4_gemm.w4a16_gemm_kernel`; with ``QUANT_OUT`` the SwiGLU output is
quantized to MXFP4 in the epilogue (from fp32, as the reference quantizes it), so the down
projection reads 4.25 bits per value.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from musecore_triton import hooks
from musecore_triton.kernels.fp4_gemm import activation_rows, grouped_tile

MX_BLOCK = 32            # values per E8M0 scale (musecore_quant.formats.mxfp4.MXFP4_BLOCK_SIZE)
BLOCK_K = 128            # K per kernel iteration: 4 scale blocks, one scaled-MFMA K step on gfx950
A_QUANT, A_PACKED, A_DENSE = 0, 1, 2
SCALE_MODES = {"even": 0, "floor": 1}
ROUNDINGS = {"rne": 0, "away": 1}
DOT_FORMAT = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# Above this many rows the W4A4 linear quantizes the activations in a kernel of their own and the GEMM
# reads packed bytes: quantizing inside the GEMM repeats the work for every N tile, and compiled for
# gfx950 the 128x128 in-kernel-quantizing tile spills (604 B scratch; tests/amd_compile.py). Not timed.
PREQUANTIZE_MIN_M = 64


@functools.lru_cache(maxsize=None)  # read once per process: launches must not pay for inspect
def activation_rule() -> dict:
    """The MXFP4 activation rule of the emulated W4A4 targets (``scale_mode``, ``rounding``): the
    defaults of ``musecore_quant``'s activation fake-quant, which the reference ``linear`` applies."""
    from musecore_quant.formats.mxfp4 import mxfp4_fake_quantize_activation
    params = inspect.signature(mxfp4_fake_quantize_activation).parameters
    rule = {name: params[name].default for name in ("scale_mode", "rounding")}
    if rule["scale_mode"] not in SCALE_MODES or rule["rounding"] not in ROUNDINGS:
        raise NotImplementedError(f"the MXFP4 activation kernels implement scale modes {list(SCALE_MODES)} and "
                                  f"roundings {list(ROUNDINGS)}; musecore_quant's rule is now {rule}")
    return rule


@triton.jit
def _pow2(e):
    """Exact 2**e for integer e in [-126, 127]."""
    return ((e + 127).to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_quantize_tile(x, ROWS: tl.constexpr, COLS: tl.constexpr, SCALE_MODE: tl.constexpr,
                        ROUNDING: tl.constexpr):
    """fp32 ``x [ROWS, COLS]`` -> (packed e2m1 uint8 ``[ROWS, COLS/2]``, E8M0 uint8 ``[ROWS, COLS/32]``).

    Shared exponent from the block amax's fp32 bits (EVEN: round the amax up when its mantissa is
    >= 1.75, then floor; FLOOR: floor), minus 2 (E2M1's largest binade), clamped to [-127, 127]; an
    all-zero block gets -127. Elements are multiplied by the exact power of two ``2**-exp`` (the
    same correctly rounded value as dividing by the scale) and rounded to E2M1 (RNE or ties away),
    saturating at 6; the sign is ``x < 0`` (so -0.0 -> code 0, a small negative -> code 8)."""
    NB: tl.constexpr = COLS // 32
    xb = tl.reshape(x, (ROWS, NB, 32))
    amax = tl.max(tl.abs(xb), axis=2)                                   # [ROWS, NB]
    bits = amax.to(tl.int32, bitcast=True)
    if SCALE_MODE == 0:
        bits = bits + (1 << 21)
    exp = ((bits & 0x7F800000) >> 23) - 127 - 2
    exp = tl.where(amax == 0, -127, exp)
    exp = tl.minimum(tl.maximum(exp, -127), 127)
    v = xb * _pow2(-exp)[:, :, None]                   # -exp in [-126, 127]: the EVEN carry caps exp at 126
    m = tl.abs(v)
    if ROUNDING == 0:  # ties to even: a tie goes up only towards an even code (0.75, 1.75, 3.5)
        q = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
             + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
             + (m > 5.0).to(tl.int32))
    else:              # ties away from zero
        q = ((m >= 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m >= 1.25).to(tl.int32)
             + (m >= 1.75).to(tl.int32) + (m >= 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
             + (m >= 5.0).to(tl.int32))
    codes = q | tl.where(v < 0, 8, 0)
    codes = tl.reshape(codes, (ROWS, COLS // 2, 2))
    lo, hi = tl.split(codes)
    packed = (lo | (hi << 4)).to(tl.uint8)
    return packed, (exp + 127).to(tl.uint8)


@triton.jit
def mxfp4_quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                          BLOCK_M: tl.constexpr, COLS: tl.constexpr, SCALE_MODE: tl.constexpr,
                          ROUNDING: tl.constexpr, PDL: tl.constexpr):
    """Rows of ``x [M, K]`` -> MXFP4 (packed ``[M, K/2]``, E8M0 ``[M, K/32]``), ``COLS`` values per program."""
    hooks.pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = pid_k * COLS + tl.arange(0, COLS)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=rmask[:, None], other=0.0)
    packed, scales = mxfp4_quantize_tile(x.to(tl.float32), BLOCK_M, COLS, SCALE_MODE, ROUNDING)
    qc = pid_k * (COLS // 2) + tl.arange(0, COLS // 2)
    sc = pid_k * (COLS // 32) + tl.arange(0, COLS // 32)
    tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + qc[None, :], packed, mask=rmask[:, None])
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * stride_sm + sc[None, :], scales, mask=rmask[:, None])


@triton.jit
def _load_w(w_ptr, s_ptr, w_row, s_row, n_mask, kb, BLOCK_N: tl.constexpr):
    """Weight tile of K block ``kb``: packed ``[BLOCK_K/2, BLOCK_N]`` (K-major for dot_scaled's rhs) and
    its E8M0 scales ``[BLOCK_N, BLOCK_K/32]`` (not transposed, as dot_scaled wants)."""
    kh = kb * 64 + tl.arange(0, 64)
    w = tl.load(w_ptr + w_row[None, :] + kh[:, None], mask=n_mask[None, :], other=0)
    ks = kb * 4 + tl.arange(0, 4)
    s = tl.load(s_ptr + s_row[:, None] + ks[None, :], mask=n_mask[:, None], other=127)
    return w, s


@triton.jit
def mx_gemm_kernel(
    a_ptr, as_ptr, a_idx_ptr, n_assign, stride_am, stride_asm,
    w_ptr, s_ptr, w2_ptr, s2_ptr, stride_we, stride_wn, stride_se, stride_sn,
    c_ptr, cs_ptr, stride_cm, stride_csm, blk_expert_ptr,
    M, N, K,
    A_MODE: tl.constexpr, A_FMT: tl.constexpr, SCALE_MODE: tl.constexpr, ROUNDING: tl.constexpr,
    GATHER: tl.constexpr, A_DIV: tl.constexpr, EXPERTS: tl.constexpr, SWIGLU: tl.constexpr,
    QUANT_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """C[M, N] = A[M, K] @ W[e, N, K]^T with MXFP4 W through ``tl.dot_scaled`` (module docstring)."""
    hooks.pdl_wait(PDL)
    pid = tl.program_id(0)
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
        a_row = a_rows.to(tl.int64) * stride_am
        as_row = a_rows.to(tl.int64) * stride_asm
        w_row = expert.to(tl.int64) * stride_we + offs_n.to(tl.int64) * stride_wn
        s_row = expert.to(tl.int64) * stride_se + offs_n.to(tl.int64) * stride_sn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, K // 128):
            if A_MODE == 1:    # packed MXFP4 activations
                a = tl.load(a_ptr + a_row[:, None] + kb * 64 + tl.arange(0, 64)[None, :],
                            mask=a_valid[:, None], other=0)
                a_s = tl.load(as_ptr + as_row[:, None] + kb * 4 + tl.arange(0, 4)[None, :],
                              mask=a_valid[:, None], other=127)
            else:
                x = tl.load(a_ptr + a_row[:, None] + kb * 128 + tl.arange(0, 128)[None, :],
                            mask=a_valid[:, None], other=0.0)
                if A_MODE == 0:  # W4A4: quantize this activation tile to MXFP4 here
                    a, a_s = mxfp4_quantize_tile(x.to(tl.float32), BLOCK_M, 128, SCALE_MODE, ROUNDING)
                else:
                    a = x
                    a_s = None
            w, w_s = _load_w(w_ptr, s_ptr, w_row, s_row, n_mask, kb, BLOCK_N)
            acc = tl.dot_scaled(a, a_s, A_FMT, w, w_s, "e2m1", acc)
            if SWIGLU:
                u, u_s = _load_w(w2_ptr, s2_ptr, w_row, s_row, n_mask, kb, BLOCK_N)
                acc2 = tl.dot_scaled(a, a_s, A_FMT, u, u_s, "e2m1", acc2)

        if SWIGLU:
            acc = acc / (1.0 + tl.exp(-acc)) * acc2
        c_mask = (a_valid & m_mask)[:, None] & n_mask[None, :]
        if QUANT_OUT:  # the next GEMM's MXFP4 activations, from the fp32 values (as the reference does)
            q, qs = mxfp4_quantize_tile(acc, BLOCK_M, BLOCK_N, SCALE_MODE, ROUNDING)
            qn = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            sn = pid_n * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
            row_ok = (a_valid & m_mask)[:, None]
            tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + qn[None, :], q,
                     mask=row_ok & (qn < N // 2)[None, :])
            tl.store(cs_ptr + offs_m.to(tl.int64)[:, None] * stride_csm + sn[None, :], qs,
                     mask=row_ok & (sn < N // 32)[None, :])
        else:
            c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


@dataclass(frozen=True)
class MxGemmConfig:
    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int


def pick_mx_config(m_rows: int, device: torch.device) -> MxGemmConfig:
    """Tiles per M regime. Not tuned on any AMD GPU (none has been available): a first guess from the
    scaled-MFMA shapes (16x16x128, 32x32x64) and the W4A16 kernel's regimes."""
    if device.type != "cuda":  # the interpreter pays per program, and dot_scaled needs M, N >= 16 there too
        return MxGemmConfig(16 if m_rows <= 16 else 32, 64, 1, 4, 1)
    if m_rows <= 16:
        return MxGemmConfig(16, 64, 1, 4, 2)
    if m_rows <= 64:
        return MxGemmConfig(32, 128, 1, 4, 2)
    return MxGemmConfig(128, 128, 8, 8, 2)


def check_mx_shapes(n: int, k: int) -> None:
    if k % BLOCK_K or n % MX_BLOCK:
        raise ValueError(f"the dot_scaled MXFP4 GEMM needs in_features divisible by {BLOCK_K} and out_features by "
                         f"{MX_BLOCK}; got {n}x{k}. Exclude this layer from quantization or pad it.")


def mxfp4_quantize_activation(x: torch.Tensor, *, scale_mode: Optional[str] = None,
                              rounding: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of activations ``x [M, K]`` in one kernel: (packed uint8 ``[M, K/2]``, E8M0 uint8 ``[M, K/32]``).
    Defaults: :func:`activation_rule` (what the emulated W4A4 plan applies)."""
    rule = activation_rule()
    scale_mode, rounding = scale_mode or rule["scale_mode"], rounding or rule["rounding"]
    if scale_mode not in SCALE_MODES or rounding not in ROUNDINGS:
        raise ValueError(f"the MXFP4 quantization kernel implements scale_mode {list(SCALE_MODES)} and rounding "
                         f"{list(ROUNDINGS)}; got {scale_mode!r}, {rounding!r}")
    m, k = x.shape
    if k % BLOCK_K:
        raise ValueError(f"MXFP4 activation quantization here takes K divisible by {BLOCK_K}; got {k}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    s = torch.empty(m, k // MX_BLOCK, dtype=torch.uint8, device=x.device)
    if m:
        block_m = 16
        mxfp4_quantize_kernel[(triton.cdiv(m, block_m), k // BLOCK_K)](
            x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), BLOCK_M=block_m, COLS=BLOCK_K,
            SCALE_MODE=SCALE_MODES[scale_mode], ROUNDING=ROUNDINGS[rounding],
            **hooks.launch_options(x.device, "mxfp4_quantize"))
    return q, s


def launch_mx_gemm(a: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor, *, n: int, k: int,
                   out: torch.Tensor, cfg: MxGemmConfig, a_mode: int, a_scales: Optional[torch.Tensor] = None,
                   out_scales: Optional[torch.Tensor] = None, a_idx: Optional[torch.Tensor] = None,
                   n_assign: int = 0, a_div: int = 1, blk_expert: Optional[torch.Tensor] = None,
                   m_rows: Optional[int] = None, w2: Optional[torch.Tensor] = None,
                   w2_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch :func:`mx_gemm_kernel`. ``w``/``w_scales`` are ``[E, N, K/2]`` / ``[E, N, K/32]`` uint8 stacks;
    ``out_scales`` given: ``out`` receives MXFP4 bytes ``[rows, N/2]`` and ``out_scales`` ``[rows, N/32]``."""
    check_mx_shapes(n, k)
    if a.stride(-1) != 1:
        raise ValueError("activations must be contiguous along K")
    if a_mode in (A_PACKED, A_QUANT):
        a_fmt = "e2m1"
    else:
        if a.dtype not in DOT_FORMAT:
            raise TypeError(f"W4A16 dot_scaled takes bf16 or fp16 activations; got {a.dtype}")
        a_fmt = DOT_FORMAT[a.dtype]
    rule = activation_rule()
    rows = m_rows if m_rows is not None else a.shape[0]
    grid = (triton.cdiv(rows, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    dummy = w
    mx_gemm_kernel[grid](
        a, a_scales if a_scales is not None else dummy, a_idx if a_idx is not None else dummy, n_assign,
        a.stride(0), a_scales.stride(0) if a_scales is not None else 0,
        w, w_scales, w2 if w2 is not None else dummy, w2_scales if w2_scales is not None else dummy,
        w.stride(0), w.stride(1), w_scales.stride(0), w_scales.stride(1),
        out, out_scales if out_scales is not None else dummy, out.stride(0),
        out_scales.stride(0) if out_scales is not None else 0, blk_expert if blk_expert is not None else dummy,
        rows, n, k,
        A_MODE=a_mode, A_FMT=a_fmt, SCALE_MODE=SCALE_MODES[rule["scale_mode"]], ROUNDING=ROUNDINGS[rule["rounding"]],
        GATHER=a_idx is not None, A_DIV=a_div, EXPERTS=blk_expert is not None, SWIGLU=w2 is not None,
        QUANT_OUT=out_scales is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **hooks.launch_options(a.device, "mx_gemm"),
    )
    return out


def mxfp4_linear(x: torch.Tensor, w: torch.Tensor, w_scales: torch.Tensor, *, quantize_activations: bool
                 ) -> torch.Tensor:
    """``x [..., K] @ W.T`` for a canonical MXFP4 weight (``w [N, K/2]`` or ``[1, N, K/2]``, scales
    ``[.., N, K/32]``): W4A4 (activations quantized in the kernel) or W4A16, output in ``x.dtype``.

    Example::

        qt = musecore_quant.quantize(w, "mxfp4")
        y = mxfp4_linear(x, qt.data, qt.scale, quantize_activations=True)
    """
    w3 = w if w.dim() == 3 else w[None]
    s3 = w_scales if w_scales.dim() == 3 else w_scales[None]
    n, k = w3.shape[1], w3.shape[2] * 2
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) != k):
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    cfg = pick_mx_config(m, x.device)
    if not quantize_activations:
        launch_mx_gemm(x2, w3, s3, n=n, k=k, out=out, cfg=cfg, a_mode=A_DENSE)
    elif m <= PREQUANTIZE_MIN_M:  # decode: quantize the few rows inside the GEMM, one launch
        launch_mx_gemm(x2, w3, s3, n=n, k=k, out=out, cfg=cfg, a_mode=A_QUANT)
    else:  # every N tile would requantize its rows: quantize once, then read packed bytes
        packed, scales = mxfp4_quantize_activation(x2)
        launch_mx_gemm(packed, w3, s3, n=n, k=k, out=out, cfg=cfg, a_mode=A_PACKED, a_scales=scales)
    return out.reshape(*lead, n)
