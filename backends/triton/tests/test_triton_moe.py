"""The portable MoE path (alignment, grouped W4A16 GEMMs with SwiGLU, finalize) against the reference."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore.ops import ExpertWeights, tolerance
from musecore.ops import reference as ref

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_triton.kernels.moe import moe_forward, uses_dense_decode
from musecore_triton.layouts import prepare_fp4, share_fold


def _case(fmt, experts, width, inter, tokens, topk, dtype):
    """A routed layer (as backends/cuda/tests/test_cuda_moe.py builds one) and the reference's output."""
    gate = torch.randn(experts, inter, width, device=DEVICE) * width ** -0.5
    up = torch.randn(experts, inter, width, device=DEVICE) * width ** -0.5
    down = torch.randn(experts, width, inter, device=DEVICE) * inter ** -0.5
    if fmt == "dense":
        stacks = [w.to(dtype).contiguous() for w in (gate, up, down)]
        dense = [w.float() for w in stacks]
    else:
        qts = [musecore_quant.quantize(w, fmt) for w in (gate, up, down)]
        stacks = [prepare_fp4(qt, DEVICE) for qt in qts]
        share_fold(stacks[0], stacks[1])
        dense = [musecore_quant.dequantize(qt).to(DEVICE) for qt in qts]
    reference = ExpertWeights(gate=dense[0], up=dense[1], down=dense[2], format=fmt, num_experts=experts)
    norm = (1.0 + 0.5 * torch.randn(width, device=DEVICE)).to(dtype)
    x = torch.randn(tokens, 32, device=DEVICE)
    weights, ids = ref.router_topk(x, torch.randn(experts, 32, device=DEVICE), torch.zeros(experts, device=DEVICE),
                                   topk, 1.0, 1.0)
    z = torch.randn(tokens, width, device=DEVICE).to(dtype)
    return z, weights, ids, stacks, norm, ref.moe(z, weights, ids, reference, norm, 1e-8)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_grouped_fp4_moe_matches_reference(fmt, tokens, dtype):
    z, weights, ids, (g, u, d), norm, expected = _case(fmt, 8, 128, 256, tokens, 2, dtype)
    y = moe_forward(z, weights, ids, g, u, d, 8, norm, 1e-8)
    assert y.dtype == torch.float32 and y.shape == (tokens, 128)
    assert_nmse(expected, y, tolerance("moe"), f"{fmt} grouped MoE T={tokens} {dtype}")


@pytest.mark.parametrize("tokens", [1, 9])
def test_dense_expert_moe_takes_the_gemv_at_decode_and_the_grouped_gemm_beyond(tokens):
    dtype = SMALL_DTYPES[0]
    z, weights, ids, (g, u, d), norm, expected = _case("dense", 8, 128, 128, tokens, 2, dtype)
    assert uses_dense_decode(tokens * 2, 8) == (tokens == 1)
    y = moe_forward(z, weights, ids, g, u, d, 8, norm, 1e-8)
    assert_nmse(expected, y, tolerance("moe"), f"16-bit MoE T={tokens}")


@pytest.mark.parametrize("block_m,width", [(16, 96), (64, 256)])
def test_gather_token_rows_copies_each_used_tiles_rows_and_skips_the_spare_tiles(block_m, width):
    """The sorted rows' activations for a TMA-fed grouped GEMM: rows of tiles holding an expert equal their token's
    (padding rows the last token's), rows of spare tiles stay as allocated; K not a power of two (96) included."""
    from musecore_triton.kernels.moe import align_assignments, gather_token_rows
    tokens, topk, experts = 37, 2, 5
    ids = torch.stack([torch.randperm(experts, device=DEVICE)[:topk] for _ in range(tokens)])
    z = torch.randn(tokens, width, device=DEVICE)
    sorted_ids, blk_expert, _ = align_assignments(ids, experts, block_m)
    xs = gather_token_rows(z, sorted_ids, blk_expert, topk, block_m)
    used = blk_expert.repeat_interleave(block_m) >= 0
    want = z[(sorted_ids // topk).clamp(max=tokens - 1).long()]
    assert xs.shape == (sorted_ids.numel(), width) and used.any() and not used.all()
    assert torch.equal(xs[used], want[used]), (xs[used] - want[used]).abs().max()
