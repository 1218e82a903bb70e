"""FlyDSL MXFP4 grouped expert GEMMs for gfx950: the MoE's gate/up with SwiGLU, and its down projection.

Lab, not shipped: it compiles to gfx950 scaled MFMA in CI (``backends/rocm/tests/test_rocm_flydsl.py``)
but has never run (no AMD GPU was reachable, and FlyDSL has no CPU interpreter), so the plan does not
select it; the Triton ``dot_scaled`` MoE of ``musecore_triton`` runs. They are the two GEMMs of the
FlyDSL MoE candidate of issue 22 (the align, the activation quantization and the finalize would stay the
shared Triton kernels; the SwiGLU output is written in fp32 here, to be quantized by
``mxfp4_quantize_kernel``, since an MXFP4 block spans two of these 16-wide tiles).

What it computes: ``C[rows, N] (fp32) = A[rows, K] @ W[e(rows), N, K]^T`` where ``A`` is MXFP4 (packed
e2m1 viewed as int32 ``[rows, K/8]`` + E8M0 ``[rows, K/32]``), rows are sorted by expert and padded
to blocks of 16 (``blk_expert[i]`` is the expert of rows ``16i..16i+15``, -1 past the last block:
those rows are padding and get expert 0's garbage), and ``W`` is the canonical MXFP4 expert stack
(int32 ``[E, N, K/8]`` + E8M0 ``[E, N, K/32]``): the same bytes ``musecore_triton.kernels.mx_moe``
reads. One wave per 16x16 output tile, ``v_mfma_scale_f32_16x16x128_f8f6f4`` with ``cbsz = blgp = 4``
(e2m1 x e2m1), straight from global memory (no LDS staging, no preshuffle: a correctness-first
layout to time against aiter's preshuffled kernels on the first MI355X).

Operand layout of the 16x16x128 scaled MFMA (wave64): lane ``l`` holds row ``l % 16`` and the K
block ``32 * (l // 16) .. +32`` of its 128-wide K step (16 bytes of e2m1 in 4 of the 8 operand
dwords) and that block's E8M0 scale; the accumulator lane holds ``C[4 * (l // 16) + i, l % 16]``.

Run ``python mx_expert_gemm.py down|gate_up K N E ROWS`` with ``COMPILE_ONLY=1 ARCH=gfx950`` and a ROCm toolkit
root holding ``llvm/bin/ld.lld`` in ``ROCM_PATH`` to compile without a GPU.
"""

from __future__ import annotations

import sys

import flydsl.compiler as flyc
import flydsl.expr as fx
from flydsl.expr import rocdl
from flydsl.expr.typing import Vector as Vec

E2M1 = 4  # MFMA matrix-format code of FP4 e2m1 (cbsz / blgp)
TILE = 16
K_STEP = 128


def build(K: int, N: int):
    """The kernel and its launcher for one (K, N): both are compile-time constants of the kernel."""
    if K % K_STEP or N % TILE:
        raise ValueError(f"K must be a multiple of {K_STEP} and N of {TILE}; got K={K}, N={N}")
    words = K // 8      # int32 words of packed e2m1 per row
    blocks = K // 32    # E8M0 scales per row

    @flyc.kernel
    def mx_expert_gemm(A: fx.Tensor, A_scale: fx.Tensor, blk_expert: fx.Tensor, W: fx.Tensor,
                       W_scale: fx.Tensor, C: fx.Tensor):
        lane = fx.thread_idx.x
        m_blk = fx.block_idx.x
        n_blk = fx.block_idx.y
        r = lane % fx.Int32(TILE)
        g = lane // fx.Int32(TILE)
        e = fx.ptr_load(fx.get_iter(blk_expert) + m_blk)
        e = e + (e < fx.Int32(0)).to(fx.Int32)  # -1 (an unused block, all padding) reads expert 0
        a_row = m_blk * fx.Int32(TILE) + r
        w_row = e * fx.Int32(N) + n_blk * fx.Int32(TILE) + r
        a_ptr, as_ptr = fx.get_iter(A), fx.get_iter(A_scale)
        w_ptr, ws_ptr, c_ptr = fx.get_iter(W), fx.get_iter(W_scale), fx.get_iter(C)
        acc = Vec.filled(4, 0.0, fx.Float32)
        for kk in fx.range_constexpr(K // K_STEP):
            a_words, w_words = [], []
            for j in fx.range_constexpr(4):  # this lane's 32 e2m1 values = 4 words
                col = fx.Int32(kk * 16 + j) + g * fx.Int32(4)
                a_words.append(fx.ptr_load(a_ptr + (a_row * fx.Int32(words) + col)))
                w_words.append(fx.ptr_load(w_ptr + (w_row * fx.Int32(words) + col)))
            for _ in fx.range_constexpr(4):  # the operand has 8 dwords (fp8 width); fp4 uses 4
                a_words.append(fx.Int32(0))
                w_words.append(fx.Int32(0))
            a_scale = fx.ptr_load(as_ptr + (a_row * fx.Int32(blocks) + fx.Int32(kk * 4) + g)).to(fx.Int32)
            w_scale = fx.ptr_load(ws_ptr + (w_row * fx.Int32(blocks) + fx.Int32(kk * 4) + g)).to(fx.Int32)
            out = rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                Vec.make_type(4, fx.Float32),
                [Vec.from_elements(a_words, dtype=fx.Int32).ir_value(), Vec.from_elements(w_words, dtype=fx.Int32).ir_value(),
                 acc.ir_value(), E2M1, E2M1, 0, a_scale.ir_value(), 0, w_scale.ir_value()])
            acc = Vec(out, (4,), fx.Float32)
        n = n_blk * fx.Int32(TILE) + r
        for i in fx.range_constexpr(4):
            m = m_blk * fx.Int32(TILE) + g * fx.Int32(4) + fx.Int32(i)
            fx.ptr_store(acc[i], c_ptr + (m * fx.Int32(N) + n))

    @flyc.jit
    def launch(A: fx.Tensor, A_scale: fx.Tensor, blk_expert: fx.Tensor, W: fx.Tensor, W_scale: fx.Tensor,
               C: fx.Tensor, m_blocks: fx.Constexpr[int], stream: fx.Stream = fx.Stream(None)):
        mx_expert_gemm(A, A_scale, blk_expert, W, W_scale, C).launch(
            grid=(m_blocks, N // TILE, 1), block=(64, 1, 1), stream=stream)

    return launch


def build_gate_up(K: int, N: int):
    """The MoE's first GEMM: rows gathered by token (``token_of_row [rows]`` int32: the token of each sorted
    assignment, 0 for padding), gate and up of the row's expert on the same MXFP4 activation fragment (two
    scaled MFMAs per K step), SwiGLU in the epilogue: ``H[rows, N] = silu(A[tok] @ G[e]^T) * (A[tok] @ U[e]^T)``
    in fp32. The activations are the tokens' MXFP4 rows, quantized once per token (not per assignment)."""
    if K % K_STEP or N % TILE:
        raise ValueError(f"K must be a multiple of {K_STEP} and N of {TILE}; got K={K}, N={N}")
    words, blocks = K // 8, K // 32

    @flyc.kernel
    def mx_gate_up_swiglu(A: fx.Tensor, A_scale: fx.Tensor, token_of_row: fx.Tensor, blk_expert: fx.Tensor,
                          G: fx.Tensor, G_scale: fx.Tensor, U: fx.Tensor, U_scale: fx.Tensor, H: fx.Tensor):
        lane = fx.thread_idx.x
        m_blk = fx.block_idx.x
        n_blk = fx.block_idx.y
        r = lane % fx.Int32(TILE)
        g = lane // fx.Int32(TILE)
        e = fx.ptr_load(fx.get_iter(blk_expert) + m_blk)
        e = e + (e < fx.Int32(0)).to(fx.Int32)
        tok = fx.ptr_load(fx.get_iter(token_of_row) + (m_blk * fx.Int32(TILE) + r))
        w_row = e * fx.Int32(N) + n_blk * fx.Int32(TILE) + r
        a_ptr, as_ptr = fx.get_iter(A), fx.get_iter(A_scale)
        g_ptr, gs_ptr, u_ptr, us_ptr = fx.get_iter(G), fx.get_iter(G_scale), fx.get_iter(U), fx.get_iter(U_scale)
        acc_g = Vec.filled(4, 0.0, fx.Float32)
        acc_u = Vec.filled(4, 0.0, fx.Float32)
        for kk in fx.range_constexpr(K // K_STEP):
            a_words, g_words, u_words = [], [], []
            for j in fx.range_constexpr(4):
                col = fx.Int32(kk * 16 + j) + g * fx.Int32(4)
                a_words.append(fx.ptr_load(a_ptr + (tok * fx.Int32(words) + col)))
                g_words.append(fx.ptr_load(g_ptr + (w_row * fx.Int32(words) + col)))
                u_words.append(fx.ptr_load(u_ptr + (w_row * fx.Int32(words) + col)))
            for _ in fx.range_constexpr(4):
                a_words.append(fx.Int32(0))
                g_words.append(fx.Int32(0))
                u_words.append(fx.Int32(0))
            block = fx.Int32(kk * 4) + g
            a_scale = fx.ptr_load(as_ptr + (tok * fx.Int32(blocks) + block)).to(fx.Int32)
            g_scale = fx.ptr_load(gs_ptr + (w_row * fx.Int32(blocks) + block)).to(fx.Int32)
            u_scale = fx.ptr_load(us_ptr + (w_row * fx.Int32(blocks) + block)).to(fx.Int32)
            a = Vec.from_elements(a_words, dtype=fx.Int32).ir_value()
            acc_g = Vec(rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                Vec.make_type(4, fx.Float32),
                [a, Vec.from_elements(g_words, dtype=fx.Int32).ir_value(), acc_g.ir_value(), E2M1, E2M1, 0,
                 a_scale.ir_value(), 0, g_scale.ir_value()]), (4,), fx.Float32)
            acc_u = Vec(rocdl.mfma_scale_f32_16x16x128_f8f6f4(
                Vec.make_type(4, fx.Float32),
                [a, Vec.from_elements(u_words, dtype=fx.Int32).ir_value(), acc_u.ir_value(), E2M1, E2M1, 0,
                 a_scale.ir_value(), 0, u_scale.ir_value()]), (4,), fx.Float32)
        h_ptr = fx.get_iter(H)
        n = n_blk * fx.Int32(TILE) + r
        for i in fx.range_constexpr(4):
            gate = acc_g[i]
            h = gate / (fx.Float32(1.0) + fx.math.exp(-gate)) * acc_u[i]  # SwiGLU, fp32 as the reference
            m = m_blk * fx.Int32(TILE) + g * fx.Int32(4) + fx.Int32(i)
            fx.ptr_store(h, h_ptr + (m * fx.Int32(N) + n))

    @flyc.jit
    def launch(A: fx.Tensor, A_scale: fx.Tensor, token_of_row: fx.Tensor, blk_expert: fx.Tensor, G: fx.Tensor,
               G_scale: fx.Tensor, U: fx.Tensor, U_scale: fx.Tensor, H: fx.Tensor, m_blocks: fx.Constexpr[int],
               stream: fx.Stream = fx.Stream(None)):
        mx_gate_up_swiglu(A, A_scale, token_of_row, blk_expert, G, G_scale, U, U_scale, H).launch(
            grid=(m_blocks, N // TILE, 1), block=(64, 1, 1), stream=stream)

    return launch


def compile_placeholders(kind: str, K: int, N: int, E: int, rows: int) -> None:
    """Compile ``kind`` ("down": :func:`build`, "gate_up": :func:`build_gate_up`) for ``$ARCH`` with CPU
    placeholder tensors (``COMPILE_ONLY=1``: nothing runs)."""
    import torch
    W = torch.zeros(E, N, K // 8, dtype=torch.int32)
    W_scale = torch.zeros(E, N, K // 32, dtype=torch.uint8)
    blk = torch.zeros(rows // TILE, dtype=torch.int32)
    out = torch.zeros(rows, N)
    if kind == "down":
        A = torch.zeros(rows, K // 8, dtype=torch.int32)
        A_scale = torch.zeros(rows, K // 32, dtype=torch.uint8)
        flyc.compile(build(K, N), A, A_scale, blk, W, W_scale, out, rows // TILE)
    elif kind == "gate_up":
        tokens = 8
        A = torch.zeros(tokens, K // 8, dtype=torch.int32)
        A_scale = torch.zeros(tokens, K // 32, dtype=torch.uint8)
        token_of_row = torch.zeros(rows, dtype=torch.int32)
        flyc.compile(build_gate_up(K, N), A, A_scale, token_of_row, blk, W, W_scale, W.clone(), W_scale.clone(), out,
                     rows // TILE)
    else:
        raise ValueError(f"kind is 'down' or 'gate_up'; got {kind!r}")


if __name__ == "__main__":
    compile_placeholders(sys.argv[1], *(int(a) for a in sys.argv[2:6]))
