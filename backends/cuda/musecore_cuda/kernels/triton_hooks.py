"""What the CUDA backend installs into :mod:`musecore_triton.hooks`: programmatic dependent launch
(:mod:`musecore_cuda.kernels.pdl`), hardware e4m3 conversion, a PTX upcast of packed FP4 to bf16, an L2
prefetch for the decode GEMVs' serial tails, the cuts of the decode launches with a row op and the one-token
router's columns per program.
Installed at import of :mod:`musecore_cuda` when this torch is a CUDA (not ROCm) build."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from musecore_cuda.kernels import pdl
from musecore_triton import hooks


@triton.jit
def fp4x2_bf16_scaled(b, m_lo, m_hi):
    """Packed E2M1 bytes -> (low-nibble, high-nibble) bf16 values times their group multipliers.

    Inline PTX on 4 bytes at a time: ``prmt`` spreads two bytes into the 16-bit lanes of a
    register, shift+mask put sign and magnitude bits in place (bf16 bits of value * 2**-126), and
    one ``mul.rn.bf16x2`` applies two multipliers: about 2 instructions per weight instead of ~10
    for the element-wise Triton path (which the interpreter and fp16 activations still use).
    """
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 t0, t1, a, s, c;
        prmt.b32 t0, $4, 0, 0x4140;
        prmt.b32 t1, $4, 0, 0x4342;
        shl.b32 a, t0, 6;  and.b32 a, a, 0x01C001C0; shl.b32 s, t0, 12; and.b32 s, s, 0x80008000;
        or.b32 c, a, s; mul.rn.bf16x2 $0, c, $5;
        shl.b32 a, t1, 6;  and.b32 a, a, 0x01C001C0; shl.b32 s, t1, 12; and.b32 s, s, 0x80008000;
        or.b32 c, a, s; mul.rn.bf16x2 $1, c, $6;
        shl.b32 a, t0, 2;  and.b32 a, a, 0x01C001C0; shl.b32 s, t0, 8;  and.b32 s, s, 0x80008000;
        or.b32 c, a, s; mul.rn.bf16x2 $2, c, $7;
        shl.b32 a, t1, 2;  and.b32 a, a, 0x01C001C0; shl.b32 s, t1, 8;  and.b32 s, s, 0x80008000;
        or.b32 c, a, s; mul.rn.bf16x2 $3, c, $8;
        }
        """,
        constraints="=r,=r,=r,=r,r,r,r,r,r",
        args=[b, m_lo, m_hi], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def prefetch_l2(ptrs, mask):
    """Each pointer's line fetched into L2 with an evict-last policy where ``mask``: nothing is returned to the SM and
    nothing waits on it (``prefetch.global.L2::evict_last``)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def l2_warm(device: torch.device) -> bool:
    """On an NVIDIA GPU (not in the CPU interpreter, which cannot run PTX)."""
    return device.type == "cuda"


def launch_features(device: torch.device) -> dict:
    """On an NVIDIA GPU: e4m3 scales through the hardware conversion and the PTX upcast above; in the
    CPU interpreter (tests) the integer-op paths."""
    on_gpu = device.type == "cuda"
    return {"HW_FP8": on_gpu, "PACKED_UPCAST": on_gpu}


def eager_first_step(device: torch.device) -> bool:
    """On an NVIDIA GPU: run 69 timed the eager first attention step at 687.2 -> 678.2 us per muse-small NVFP4 decode
    replay (``musecore_triton.kernels.attention``)."""
    return device.type == "cuda"


# Rows x warps per program of the decode launches whose last program runs a row op over the whole row (hooks.row_op_cut;
# muse-small's decode graph on an H100, session 76, cuda_fused_ab.py, 8 rounds: 715.8 us per replay at the kernels'
# 2 x 2, 707.7 with these two; the q/k/v/gate GEMV at 4 x 4 gained 0.8 more, within the rounds' spread, so it stays).
# "qkv_deferred" (session 79): the q/k/v/gate GEMV that works out the residual norm before it over the whole row in
# every program (musecore_cuda.fused.DEFER_MOE_NORM): six whole-row vectors per program beside its weights spill at
# 2 x 2 (session 70's sm90 compile of the same prologue: 255 registers), 8 x 8 took 131; 16 x 16 lost 7.8 us per
# replay against 8 x 8 in muse-small's decode graph (run 159, an H100); 4 x 4 not timed.
ROW_OP_CUTS = {"residual_norm": (8, 8), "router_pooler": (4, 4), "qkv_deferred": (8, 8)}


def row_op_cut(device: torch.device, kernel: str) -> tuple[int, int] | None:
    """On an NVIDIA GPU, :data:`ROW_OP_CUTS`; in the CPU interpreter the kernels' own."""
    return ROW_OP_CUTS.get(kernel) if device.type == "cuda" else None


# Hidden columns per program of the one-token router launches (hooks.router_block_k): muse-small's decode graph on an
# H100, session 78, cuda_fused_ab.py, 6 rounds: 660.3 us per replay at the kernel's 32 (658.9 .. 661.9), 652.0 at 64
# (651.1 .. 654.7): half the programs, each one-warp program holding 64 x 64 fp32 weights, and half the partials for
# the last program to sum. Not timed on the H200.
ROUTER_BLOCK_K = 64


def router_block_k(device: torch.device) -> int | None:
    """On an NVIDIA GPU, :data:`ROUTER_BLOCK_K`; in the CPU interpreter the kernel's own."""
    return ROUTER_BLOCK_K if device.type == "cuda" else None


def install() -> None:
    hooks.install("cuda", launch_options=pdl.triton_options, early_trigger=pdl.early,
                  launch_features=launch_features, l2_warm=l2_warm, eager_first_step=eager_first_step,
                  row_op_cut=row_op_cut, router_block_k=router_block_k,
                  pdl_wait=pdl.wait,
                  pdl_launch_dependents=pdl.trigger, fp4x2_bf16_scaled=fp4x2_bf16_scaled, prefetch_l2=prefetch_l2)
