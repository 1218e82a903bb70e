"""FP4 GEMV for decode (M <= 8 rows per weight): FMA on CUDA cores, no tensor cores, no shared memory.

At decode a weight is read once per step and every weight takes part in at most a few products, so
the limit is how fast the weight bytes can be turned into fp32 operands, not the multiply. This
kernel reads the same resident bytes as :mod:`musecore_cuda.kernels.fp4_gemm` (no second copy): the
chunk-halves layout viewed as int32 words, so that word ``q`` of a 128-element chunk holds elements
``4q + b`` (low nibble of byte ``b``) and ``64 + 4q + b`` (high nibble). Nibble ``n`` of a word is
element ``(n % 2) * 64 + 4q + n // 2``.

The upcast (``_decode_word``, inline PTX) turns one word into eight fp32 weights with about three
integer instructions per weight and no conversion instructions: the two nibbles at the top of each
16-bit half (``n = 7 - k`` and ``3 - k`` after a shift by ``4k``) become, with one shift for the
magnitudes and one AND-OR for the signs, the two halves of a bf16x2-shaped word whose halves are
exactly ``code * 2**-126`` as fp32 once moved to the top 16 bits (E2M1's subnormal 0.5 included:
``mul.rn.f32`` without ``.ftz`` keeps it). One ``mul.rn.f32`` per weight applies the group
multiplier (``2**126 * scale / 2**fold``), then one FMA per weight and activation row accumulates
in fp32. The per-tensor factor (NVFP4 global scale times ``2**fold``) is applied to the sums.

One launch serves three callers (constexpr flags, no dead work in any specialisation):

* ``linear`` at decode: all ``M`` rows in one program (each weight is upcast once), split-K over
  programs with fp32 atomics when the weight has too few rows to fill the GPU;
* the MoE gate+up projection per token-expert assignment (``EXPERTS``): program ``(n, 0, a)``
  reads expert ``ids[a]`` and activation row ``a // A_DIV``, computes gate and up together and
  stores ``silu(gate) * up`` (``SWIGLU``);
* the MoE down projection per assignment (``A_DIV = 1``), storing fp32 rows for the finalize.

The interpreter (CI) runs an element-wise Triton version of the same upcast (``HW=False``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from musecore_cuda.kernels.fp4_gemm import CHUNK_K, EXP_OFFSET, MODE_FP32, WFMT_NVFP4, _group_mult

GEMV_MAX_M = 8  # rows per weight up to which decode takes this kernel (FMA count grows with M)
WORDS_PER_CHUNK = CHUNK_K // 8  # int32 words per row per 128-element chunk
COMPILED_STATS: dict[tuple, tuple[int, int]] = {}  # (block_n, warps, split, M, swiglu) -> (registers, spills)


@triton.jit
def _decode_word(w, m_lo, m_hi):
    """int32 word -> its 8 weights (nibbles 0..7) as fp32, times the group multipliers.

    ``m_lo`` applies to nibbles 0, 2, 4, 6 (low half of the chunk), ``m_hi`` to 1, 3, 5, 7.
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t, q, p, h, l;
        shr.b32 t, $8, 6;  and.b32 t, t, 0x01C001C0; and.b32 q, $8, 0x80008000; or.b32 p, t, q;
        and.b32 h, p, 0xFFFF0000; shl.b32 l, p, 16; mul.rn.f32 $7, h, $10; mul.rn.f32 $3, l, $10;
        shr.b32 t, $8, 2;  and.b32 t, t, 0x01C001C0; shl.b32 q, $8, 4;  and.b32 q, q, 0x80008000; or.b32 p, t, q;
        and.b32 h, p, 0xFFFF0000; shl.b32 l, p, 16; mul.rn.f32 $6, h, $9;  mul.rn.f32 $2, l, $9;
        shl.b32 t, $8, 2;  and.b32 t, t, 0x01C001C0; shl.b32 q, $8, 8;  and.b32 q, q, 0x80008000; or.b32 p, t, q;
        and.b32 h, p, 0xFFFF0000; shl.b32 l, p, 16; mul.rn.f32 $5, h, $10; mul.rn.f32 $1, l, $10;
        shl.b32 t, $8, 6;  and.b32 t, t, 0x01C001C0; shl.b32 q, $8, 12; and.b32 q, q, 0x80008000; or.b32 p, t, q;
        and.b32 h, p, 0xFFFF0000; shl.b32 l, p, 16; mul.rn.f32 $4, h, $9;  mul.rn.f32 $0, l, $9;
        }
        """,
        constraints="=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
        args=[w, m_lo, m_hi], dtype=(tl.float32,) * 8, is_pure=True, pack=1)


@triton.jit
def _decode_nibble(w, n: tl.constexpr, m):
    """Element-wise version of one output of :func:`_decode_word` (interpreter, any device)."""
    mag = (w >> (4 * n)) & 7
    sign = (w >> (4 * n + 3)) & 1
    return ((mag << 22) | (sign << 31)).to(tl.float32, bitcast=True) * m


@triton.jit
def _x_nibble(x_rows, kc, n: tl.constexpr, word, x_mask):
    """Activations [BM, 1, G, WPG] (fp32) that meet nibble ``n`` of the words of chunk ``kc``."""
    offs = kc * 128 + (n % 2) * 64 + 4 * word + n // 2
    return tl.load(x_rows + offs, mask=x_mask, other=0.0).to(tl.float32)


@triton.jit
def _gemv_load(w_ptr, s_ptr, w_row, s_row, n_mask, kc, G: tl.constexpr, WPG: tl.constexpr):
    """Words [BN, G, WPG] of chunk ``kc`` and their scale bytes [BN, G, 1] (low half, high half)."""
    g = tl.arange(0, G)[None, :, None]
    i = tl.arange(0, WPG)[None, None, :]
    words = tl.load(w_ptr + w_row[:, None, None] + kc * 16 + g * WPG + i, mask=n_mask[:, None, None], other=0)
    s_base = s_ptr + s_row[:, None, None] + kc * (2 * G) + g
    s_lo = tl.load(s_base, mask=n_mask[:, None, None], other=0)
    s_hi = tl.load(s_base + G, mask=n_mask[:, None, None], other=0)
    return words, s_lo, s_hi


@triton.jit
def _gemv_chunk(acc, words, s_lo, s_hi, fold_log2, x_rows, kc, word, x_mask,
                WFMT: tl.constexpr, HW: tl.constexpr):
    """acc [BM, BN, G, WPG] += (upcast words) * activations, for one 128-element chunk."""
    m_lo = _group_mult(s_lo.to(tl.int32), fold_log2, WFMT, 2, 126, HW)
    m_hi = _group_mult(s_hi.to(tl.int32), fold_log2, WFMT, 2, 126, HW)
    if HW:
        f0, f1, f2, f3, f4, f5, f6, f7 = _decode_word(words, tl.broadcast_to(m_lo, words.shape),
                                                      tl.broadcast_to(m_hi, words.shape))
    else:
        f0 = _decode_nibble(words, 0, m_lo)
        f1 = _decode_nibble(words, 1, m_hi)
        f2 = _decode_nibble(words, 2, m_lo)
        f3 = _decode_nibble(words, 3, m_hi)
        f4 = _decode_nibble(words, 4, m_lo)
        f5 = _decode_nibble(words, 5, m_hi)
        f6 = _decode_nibble(words, 6, m_lo)
        f7 = _decode_nibble(words, 7, m_hi)
    acc += f0[None] * _x_nibble(x_rows, kc, 0, word, x_mask)
    acc += f1[None] * _x_nibble(x_rows, kc, 1, word, x_mask)
    acc += f2[None] * _x_nibble(x_rows, kc, 2, word, x_mask)
    acc += f3[None] * _x_nibble(x_rows, kc, 3, word, x_mask)
    acc += f4[None] * _x_nibble(x_rows, kc, 4, word, x_mask)
    acc += f5[None] * _x_nibble(x_rows, kc, 5, word, x_mask)
    acc += f6[None] * _x_nibble(x_rows, kc, 6, word, x_mask)
    acc += f7[None] * _x_nibble(x_rows, kc, 7, word, x_mask)
    return acc


@triton.jit
def fp4_gemv_kernel(
    x_ptr, stride_xm, ids_ptr,
    w_ptr, s_ptr, w2_ptr, s2_ptr, stride_we, stride_wn, stride_se, stride_sn,
    out_scale_ptr, out_scale2_ptr, fold_log2,
    y_ptr, stride_ym,
    M, N, K,
    WFMT: tl.constexpr, G: tl.constexpr, WPG: tl.constexpr,
    EXPERTS: tl.constexpr, A_DIV: tl.constexpr, SWIGLU: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HW: tl.constexpr,
):
    """y[M, N] (+)= x[M, K] @ W[e, N, K]^T; ``stride_we``/``stride_wn`` count int32 words."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    if EXPERTS:  # one token-expert assignment per program (BLOCK_M == 1)
        a = tl.program_id(2)
        expert = tl.load(ids_ptr + a).to(tl.int64)
        x_row = a // A_DIV
        out_row = a + offs_m
        m_mask = offs_m < 1
    else:
        expert = tl.full((), 0, tl.int64)
        x_row = 0
        out_row = offs_m
        m_mask = offs_m < M
    x_rows = x_ptr + ((x_row + offs_m).to(tl.int64) * stride_xm)[:, None, None, None]
    x_mask = m_mask[:, None, None, None]
    word = (tl.arange(0, G)[:, None] * WPG + tl.arange(0, WPG)[None, :])[None, None, :, :]
    w_row = expert * stride_we + offs_n.to(tl.int64) * stride_wn
    s_row = expert * stride_se + offs_n.to(tl.int64) * stride_sn

    acc = tl.zeros((BLOCK_M, BLOCK_N, G, WPG), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N, G, WPG), dtype=tl.float32)
    chunks = K // 128 // SPLIT_K
    k0 = pid_k * chunks
    # Register double buffer: chunk c+1's bytes are requested before chunk c is computed, so each
    # program keeps two chunks of loads in flight (the loop is memory-latency bound otherwise).
    words, s_lo, s_hi = _gemv_load(w_ptr, s_ptr, w_row, s_row, n_mask, k0, G, WPG)
    if SWIGLU:
        words2, s2_lo, s2_hi = _gemv_load(w2_ptr, s2_ptr, w_row, s_row, n_mask, k0, G, WPG)
    for c in range(0, chunks):
        kc = k0 + c
        nxt = k0 + tl.minimum(c + 1, chunks - 1)
        words_n, s_lo_n, s_hi_n = _gemv_load(w_ptr, s_ptr, w_row, s_row, n_mask, nxt, G, WPG)
        acc = _gemv_chunk(acc, words, s_lo, s_hi, fold_log2, x_rows, kc, word, x_mask, WFMT, HW)
        words, s_lo, s_hi = words_n, s_lo_n, s_hi_n
        if SWIGLU:
            words2_n, s2_lo_n, s2_hi_n = _gemv_load(w2_ptr, s2_ptr, w_row, s_row, n_mask, nxt, G, WPG)
            acc2 = _gemv_chunk(acc2, words2, s2_lo, s2_hi, fold_log2, x_rows, kc, word, x_mask, WFMT, HW)
            words2, s2_lo, s2_hi = words2_n, s2_lo_n, s2_hi_n

    y = tl.sum(tl.sum(acc, axis=3), axis=2) * tl.load(out_scale_ptr + expert)
    if SWIGLU:
        up = tl.sum(tl.sum(acc2, axis=3), axis=2) * tl.load(out_scale2_ptr + expert)
        y = y / (1.0 + tl.exp(-y)) * up
    y_ptrs = y_ptr + out_row.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(y_ptrs, y, mask=y_mask)
    else:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=y_mask)


def _words(packed: torch.Tensor) -> torch.Tensor:
    """The resident uint8 ``[E, N, K/2]`` bytes as int32 words ``[E, N, K/8]`` (a view)."""
    return packed.view(torch.int32)


def gemv_block_n(n: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 32  # the interpreter pays per program: fewer, larger tiles
    return 64 if n >= 4096 else 32


def gemv_split_k(programs: int, k: int, device: torch.device, max_split: int = 8) -> int:
    """Split K until the launch has about 4 programs per SM (each split keeps >= 8 chunks)."""
    if device.type != "cuda":
        return 1 if k // CHUNK_K < 4 else 2
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    split, chunks = 1, k // CHUNK_K
    while split < max_split and programs * split < target and chunks % (split * 2) == 0 and chunks // (split * 2) >= 8:
        split *= 2
    return split


def launch_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, out_scale: torch.Tensor, *,
                wfmt: int, group: int, fold_log2: int, n: int, k: int, out: torch.Tensor, split_k: int = 1,
                block_n: Optional[int] = None, ids: Optional[torch.Tensor] = None, a_div: int = 1,
                packed2: Optional[torch.Tensor] = None, scales2: Optional[torch.Tensor] = None,
                out_scale2: Optional[torch.Tensor] = None, num_warps: int = 4) -> torch.Tensor:
    """Launch :func:`fp4_gemv_kernel`; ``ids`` (int32 ``[A]``) selects the per-assignment MoE mode."""
    if k % CHUNK_K:
        raise ValueError(f"the FP4 GEMV needs K divisible by {CHUNK_K}; got K={k}")
    if x.stride(-1) != 1:
        raise ValueError("activations must be contiguous along K")
    m = x.shape[0] if ids is None else 1
    if m > GEMV_MAX_M:
        raise ValueError(f"the FP4 GEMV takes at most {GEMV_MAX_M} rows; got {m} (use the tiled GEMM)")
    if split_k > 1 and (ids is not None or packed2 is not None or out.dtype != torch.float32):
        raise ValueError("split-K accumulates with fp32 atomics: linear only, into an fp32 output")
    words = _words(packed)
    g = CHUNK_K // 2 // group             # groups per half chunk
    bn = block_n or gemv_block_n(n, x.device)
    grid = (triton.cdiv(n, bn), split_k, 1 if ids is None else ids.numel())
    w2 = _words(packed2) if packed2 is not None else words
    compiled = fp4_gemv_kernel[grid](
        x, x.stride(0), ids if ids is not None else out_scale,
        words, scales, w2, scales2 if scales2 is not None else scales,
        words.stride(0), words.stride(1), scales.stride(0), scales.stride(1),
        out_scale, out_scale2 if out_scale2 is not None else out_scale, fold_log2,
        out, out.stride(0), m, n, k,
        WFMT=wfmt, G=g, WPG=WORDS_PER_CHUNK // g, EXPERTS=ids is not None, A_DIV=a_div,
        SWIGLU=packed2 is not None, SPLIT_K=split_k, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn,
        HW=x.device.type == "cuda", num_warps=num_warps,
    )
    if compiled is not None and hasattr(compiled, "n_regs"):  # registers/spills per config, for the sweep
        COMPILED_STATS[(bn, num_warps, split_k, m, packed2 is not None)] = (compiled.n_regs, compiled.n_spills)
    return out
