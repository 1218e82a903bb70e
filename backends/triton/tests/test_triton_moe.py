"""The portable MoE path (alignment, grouped W4A16 GEMMs with SwiGLU, finalize) against the reference."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore.ops import ExpertWeights, tolerance
from musecore.ops import reference as ref

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_triton.kernels.dense_gemv import dense_gemv
from musecore_triton.kernels.moe import finalize, finalize_gemv, moe_forward, uses_dense_decode
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


FINALIZE_GEMV_TOLERANCE = 1e-5  # NMSE: the same roundings as the separate launches; the row sums' order may differ


def _finalize_gemv_case(d, topk, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(topk, d, generator=gen).to(DEVICE)  # the token's expert rows, fp32, in choice order
    weights = torch.softmax(torch.randn(1, topk, generator=gen), -1).to(DEVICE)
    post_norm = (1 + 0.1 * torch.randn(d, generator=gen)).to(DEVICE, dtype)
    w = (torch.randn(n, d, generator=gen) * d ** -0.5).to(DEVICE, dtype)
    return o, weights, post_norm, w


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("d,topk,n", [(64, 2, 64), (96, 8, 200), (200, 5, 48)])
def test_finalize_gemv_is_the_finalize_then_the_gemv(d, topk, n, dtype):
    """``finalize_gemv``: ``finalize``'s launch then ``dense_gemv`` (which rounds its fp32 input as it loads it), in
    one launch, at the default cut and at dense_gemv's; and the reference's finalize (scale-first post-expert norm
    per row, routing-weighted fp32 sum) through the 16-bit weight."""
    o, weights, post_norm, w = _finalize_gemv_case(d, topk, n, dtype)
    ids = torch.arange(topk, device=DEVICE).view(1, topk)
    separate = dense_gemv(finalize(o, ids.reshape(-1), ids, weights, post_norm, 1e-6, sorted_rows=False,
                                   act_dtype=dtype), w)
    normed = ref.rms_norm(o.to(dtype), post_norm, 1e-6, scale_first=True).float()
    y = (normed * weights.T).sum(0, keepdim=True)
    want = (y.to(dtype).float() @ w.float().T).to(dtype)
    what = f"d={d} top-{topk} n={n} {dtype}"
    assert_nmse(want.float(), separate.float(), FINALIZE_GEMV_TOLERANCE, f"separate launches, {what}")
    for cut in ((None, None), (2, 2)):
        got = finalize_gemv(o, weights, post_norm, 1e-6, w, *cut)
        assert got.shape == (1, n) and got.dtype == dtype
        assert_nmse(separate.float(), got.float(), FINALIZE_GEMV_TOLERANCE, f"finalize_gemv {cut}, {what}")


@pytest.mark.parametrize("dtype", SMALL_DTYPES)
@pytest.mark.parametrize("post,nxt", [(True, True), (False, True), (True, False)])
def test_finalize_gemv_with_the_residual_norm_tail_is_the_separate_launches(dtype, post, nxt):
    """``finalize_gemv(residual_norm=...)`` (the fused MoE block's last launch) gives the pair that ``finalize`` then
    ``dense_gemv(residual_norm=...)`` give, twice through one counter (given back as 0)."""
    d, topk = 96, 8
    o, weights, post_norm, w = _finalize_gemv_case(d, topk, d, dtype)
    gen = torch.Generator().manual_seed(1)
    residual, post_w, next_w = (torch.randn(*shape, generator=gen).to(DEVICE, dtype) for shape in ((1, d), (d,), (d,)))
    alpha, beta = torch.full((d,), 0.9, device=DEVICE, dtype=dtype), torch.full((d,), 1.1, device=DEVICE, dtype=dtype)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    norm = (residual, post_w if post else None, alpha, beta, next_w if nxt else None, 1e-6, 1e-6, counter)
    ids = torch.arange(topk, device=DEVICE).view(1, topk)
    y = finalize(o, ids.reshape(-1), ids, weights, post_norm, 1e-6, sorted_rows=False, act_dtype=dtype)
    want_res, want_normed = dense_gemv(y, w, residual_norm=norm)
    assert int(counter.item()) == 0
    what = f"{dtype} post={post} next={nxt}"
    for _ in range(2):
        got_res, got_normed = finalize_gemv(o, weights, post_norm, 1e-6, w, residual_norm=norm)
        assert int(counter.item()) == 0, f"counter left at {int(counter.item())}, {what}"
        assert_nmse(want_res.float(), got_res.float(), FINALIZE_GEMV_TOLERANCE, f"residual, {what}")
        assert_nmse(want_normed.float(), got_normed.float(), FINALIZE_GEMV_TOLERANCE, f"normed, {what}")


def test_finalize_gemv_refuses_what_it_does_not_take():
    o, weights, norm, w = _finalize_gemv_case(64, 4, 8, torch.bfloat16)
    for what, bad in (("bf16 rows", dict(o=o.to(torch.bfloat16))), ("short rows", dict(o=o[:, :32])),
                      ("3 weights for 4 rows", dict(weights=weights[:, :3])), ("short norm", dict(post_norm=norm[:32])),
                      ("fp32 weight", dict(w=w.float())), ("K over one chunk", dict(w=w.new_zeros(8, 4096)))):
        args = dict(o=o, weights=weights, post_norm=norm, post_eps=1e-6, w=w) | bad
        with pytest.raises(ValueError, match="finalize_gemv takes"):
            finalize_gemv(**args)
            pytest.fail(f"finalize_gemv took {what}")
