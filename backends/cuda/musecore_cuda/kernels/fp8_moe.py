"""Routed experts in FP8 E4M3 (W8A8, per-token activations) on SM90 FP8 tensor cores, in Triton.

The ``h200-fp8`` profile's MoE (:mod:`musecore_cuda.fp8` for the scheme). Same structure as the
W4A16 grouped path of :mod:`musecore_triton.kernels.moe`, whose alignment and finalize it reuses:

1. ``quantize_rows_kernel``: each token of ``z`` to E4M3 with its own scale ``amax / 448``, divisions
   correctly rounded (``div_rn``) so the codes equal :func:`musecore_cuda.fp8.quantize_rows` bit for bit;
2. ``align_assignments`` sorts the token-expert assignments by expert, padded to BLOCK_M;
3. ``fp8_grouped_gemm_kernel`` for gate and up together (rows gathered from the quantized ``z``), fp32
   accumulation, then the token's scale and the expert's per-channel scale, SwiGLU in fp32 -> ``h`` fp32
   (the reference quantizes the fp32 ``h``, so it is not rounded to 16 bits first);
4. ``h`` quantized per row (step 1's kernel), then the down projection (same kernel) -> fp32 rows;
5. the shared finalize: each expert row rounded to the activation dtype, post-expert norm, routing
   weight, fp32 sum per token.

No host sync anywhere, so a decode step with it is captured in a CUDA graph. ``tl.dot`` on two E4M3
tiles lowers to wgmma on SM90 (FP8 tensor cores). Those keep their partial sums at reduced precision,
and Triton's SM90 default never promotes them (measured on the H200: NMSE ~3e-5 against exact fp32
sums on a 256-wide expert, flipping E4M3 codes of ``h``); the kernel adds them into the fp32
accumulator once per 128-deep K tile by default (DeepSeek-V3's interval): 12% slower than never at
prefill, where promoting after every wgmma spilled registers and ran 40x slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from musecore_triton.kernels.moe import align_assignments, check_post_norm, finalize

E4M3_MAX = 448.0


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr):
    """One row: ``s = amax/448`` (1 if 0), ``q = e4m3(clamp(x / s, +-448))``; both divisions round to nearest."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    s = tl.math.div_rn(amax, tl.full((), 448.0, tl.float32))
    s = tl.where(s == 0.0, 1.0, s)
    q = tl.math.div_rn(x, tl.zeros_like(x) + s)
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(q_ptr + row * K + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, s)


def quantize_rows_gpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`musecore_cuda.fp8.quantize_rows` of a 2-D CUDA tensor in one launch: ``(codes [M, K], scales [M, 1])``."""
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), BLOCK=block, num_warps=max(4, min(16, block // 512)))
    return q, s


@triton.jit
def fp8_grouped_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, w2_ptr, w2_scale_ptr, out_ptr,
                            sorted_ids_ptr, blk_expert_ptr, n_assign, N, K,
                            A_DIV: tl.constexpr, GATE_UP: tl.constexpr, ACC: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out[r, n] = (sum_k a[row(r), k] * w[e, n, k]) * a_scale[row(r)] * w_scale[e, n]`` for the rows of
    one M block (all of expert ``e = blk_expert[block]``); with ``GATE_UP`` the same for ``w2`` and
    ``out = silu(gate) * up``. ``row(r)`` is token ``sorted_ids[r] // A_DIV`` (``A_DIV == 0``: ``r``).
    ``ACC``: how often the FP8 tensor cores' partial sums (kept at reduced precision inside wgmma) are
    added into the fp32 accumulator: 0 after every wgmma (precise), ``BLOCK_K`` once per K tile
    (DeepSeek-V3's interval of 128; the default), -1 never (Triton's SM90 default: fastest, least precise)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(blk_expert_ptr + pid_m)
    if e < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    idx = tl.load(sorted_ids_ptr + offs_m)
    valid = idx < n_assign
    if A_DIV == 0:
        a_rows = offs_m.to(tl.int64)
    else:
        a_rows = tl.where(valid, idx // A_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    e64 = e.to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * K + offs_k[None, :]
    w_off = e64 * N * K + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=valid[:, None], other=0.0)
        b = tl.load(w_ptr + w_off + k0, mask=n_mask[:, None], other=0.0)
        if ACC < 0:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=ACC)
        if GATE_UP:
            b2 = tl.load(w2_ptr + w_off + k0, mask=n_mask[:, None], other=0.0)
            if ACC < 0:
                acc2 = tl.dot(a, tl.trans(b2), acc2)
            else:
                acc2 = tl.dot(a, tl.trans(b2), acc2, max_num_imprecise_acc=ACC)
    sa = tl.load(a_scale_ptr + a_rows, mask=valid, other=0.0)
    sw = tl.load(w_scale_ptr + e64 * N + offs_n, mask=n_mask, other=0.0)
    y = acc * sa[:, None] * sw[None, :]
    if GATE_UP:
        sw2 = tl.load(w2_scale_ptr + e64 * N + offs_n, mask=n_mask, other=0.0)
        u = acc2 * sa[:, None] * sw2[None, :]
        y = y * tl.sigmoid(y) * u
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, y, mask=n_mask[None, :])


@dataclass(frozen=True)
class Fp8MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    stages_up: int
    stages_down: int


def pick_config(rows_per_expert: int) -> Fp8MoeConfig:
    """Tiles by the rows an expert gets: decode (few rows) streams weights in 64-row blocks (the smallest
    wgmma M); prefill uses 128x128 tiles, K 128, deep enough pipelines to hide the loads (smem per stage:
    gate+up 48 KB, down 32 KB)."""
    if rows_per_expert <= 64:
        return Fp8MoeConfig(64, 64, 128, 4, 4, 4)
    return Fp8MoeConfig(128, 128, 128, 8, 3, 4)


ACC_PRECISE, ACC_PER_TILE, ACC_FAST = "precise", "per-tile", "fast"


def fp8_moe(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate, up, down, num_experts: int,
            post_norm: torch.Tensor, post_eps: float, accumulate: str = ACC_PER_TILE) -> torch.Tensor:
    """The ``moe`` op over FP8 expert stacks (:class:`musecore_cuda.fp8.Fp8Resident` ``[E, N, K]``); fp32 ``[T, h]``.
    ``accumulate``: "per-tile" (default), "precise" or "fast" (the kernel's ``ACC``). Measured on the H200
    (816B layer, ``benchmarks/results/h200_issue26/run3_final_fp8_moe``): at 8192 tokens per-tile 12.0 ms, fast
    10.7 ms, precise 509 ms (two extra 128x128 fp32 partial tiles spill registers); at 256 tokens 3.67 / 3.65 /
    4.49 ms."""
    T, topk = ids.shape
    width = z.shape[-1]
    check_post_norm(post_norm, width)
    if T == 0:
        return torch.empty(T, width, dtype=torch.float32, device=z.device)
    inter = gate.out_features
    for name, w, k in (("gate", gate, width), ("up", up, width), ("down", down, inter)):
        if w.in_features != k or k % 128:
            raise ValueError(f"fp8 moe: {name} has in_features {w.in_features}; expected {k}, a multiple of 128")
    n_assign = T * topk
    cfg = pick_config(max(1, n_assign // min(num_experts, n_assign)))
    acc = {ACC_PRECISE: 0, ACC_PER_TILE: cfg.block_k, ACC_FAST: -1}[accumulate]
    # CPU tensors (Triton's interpreter) take the CPU definition: the interpreter's fp32 -> E4M3 cast does not round
    # to nearest, so its codes would differ from the reference's (as fp8_linear_rows does)
    quantize = quantize_rows_gpu if z.is_cuda else _quantize_rows_cpu
    zq, zs = quantize(z.reshape(T, width))
    sorted_ids, blk_expert, position = align_assignments(ids, num_experts, cfg.block_m)
    rows = sorted_ids.numel()
    blocks = rows // cfg.block_m
    h = torch.empty(rows, inter, dtype=torch.float32, device=z.device)
    fp8_grouped_gemm_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        zq, zs, gate.data, gate.col_scale, up.data, up.col_scale, h, sorted_ids, blk_expert, n_assign, inter, width,
        A_DIV=topk, GATE_UP=True, ACC=acc, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.stages_up)
    hq, hs = quantize(h)
    o = torch.empty(rows, width, dtype=torch.float32, device=z.device)
    fp8_grouped_gemm_kernel[(blocks, triton.cdiv(width, cfg.block_n))](
        hq, hs, down.data, down.col_scale, down.data, down.col_scale, o, sorted_ids, blk_expert, n_assign, width,
        inter, A_DIV=0, GATE_UP=False, ACC=acc, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.stages_down)
    return finalize(o, position, ids, weights, post_norm, post_eps, sorted_rows=True, act_dtype=z.dtype)


def _quantize_rows_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from musecore_cuda.fp8 import quantize_rows
    return quantize_rows(x)


def emulate_fp8_moe(z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate, up, down,
                    post_norm: torch.Tensor, post_eps: float) -> torch.Tensor:
    """What :func:`fp8_moe` computes, in plain PyTorch fp32 on any device (tests): the reference's
    ``moe`` with per-token FP8 activations, weights given as ``(codes [E, N, K], scale [E])``."""
    from musecore.ops.reference import rms_norm

    from musecore_cuda.fp8 import quantize_rows
    y = torch.zeros(z.shape[0], z.shape[-1], dtype=torch.float32, device=z.device)
    zq, zs = quantize_rows(z)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xs = zq[tok].float()
        g = (xs @ gate[0][e].float().T) * zs[tok] * gate[1][e].float()
        u = (xs @ up[0][e].float().T) * zs[tok] * up[1][e].float()
        h = torch.nn.functional.silu(g) * u
        hq, hs = quantize_rows(h)
        out = ((hq.float() @ down[0][e].float().T) * hs * down[1][e].float()).to(z.dtype)
        out = rms_norm(out, post_norm, post_eps, scale_first=True)
        y.index_add_(0, tok, weights[tok, slot, None].float() * out.float())
    return y
