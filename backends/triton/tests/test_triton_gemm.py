"""The portable W4A16 GEMM (FP4 and dense 16-bit weights), the resident FP4 layout and the dense GEMV
against the reference, in Triton's interpreter on CPU (or on any GPU)."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore.ops import Weight, tolerance
from musecore.ops import reference as ref

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_triton.kernels.dense_gemv import dense_gemv
from musecore_triton.kernels.fp4_gemm import launch_gemm, pick_config
from musecore_triton.layouts import prepare_fp4, repack_chunk_halves


def reference_linear(x: torch.Tensor, qt) -> torch.Tensor:
    dense = musecore_quant.dequantize(qt).to(x.device)
    return ref.linear(x.float(), Weight(data=dense, format=qt.format, out_features=dense.shape[0],
                                        in_features=dense.shape[1]))


def tiled_linear(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ W.T`` through the Triton GEMM with the config ``pick_config`` chooses (split-K allowed)."""
    m, n, k = x.shape[0], w.out_features, w.in_features
    cfg = pick_config(m, n, k, None, x.device, allow_split=True)
    out = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if cfg.split_k > 1
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    launch_gemm(x, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2,
                n=n, k=k, out=out, cfg=cfg)
    return out.to(x.dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_w4a16_gemm_matches_reference(fmt, m, dtype):
    n, k = 96, 256  # n not a multiple of the tile: exercises the row mask
    w = torch.randn(n, k) * 0.05
    w[3, :16] *= 40  # one block with a large scale, one nearly empty
    w[7, 32:64] *= 1e-3
    qt = musecore_quant.quantize(w, fmt)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    y = tiled_linear(x, prepare_fp4(qt, DEVICE))
    assert y.shape == (m, n) and y.dtype == dtype
    assert_nmse(reference_linear(x, qt), y, tolerance("linear"), f"{fmt} W4A16 GEMM M={m} {dtype}")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_w4a16_gemm_split_k_sums_every_split(fmt):
    n, k = 64, 1024  # 8 chunks: pick_config splits a one-token GEMM
    qt = musecore_quant.quantize(torch.randn(n, k) * 0.05, fmt)
    x = torch.randn(1, k, device=DEVICE).half()
    assert pick_config(1, n, k, None, x.device, allow_split=True).split_k > 1
    assert_nmse(reference_linear(x, qt), tiled_linear(x, prepare_fp4(qt, DEVICE)), tolerance("linear"),
                f"{fmt} split-K")


def test_repack_puts_element_j_and_j_plus_64_in_one_byte():
    codes = torch.randint(0, 16, (3, 256), dtype=torch.uint8)
    canonical = codes[:, 0::2] | (codes[:, 1::2] << 4)
    packed = repack_chunk_halves(canonical)
    for c in range(2):
        chunk = codes[:, c * 128:(c + 1) * 128]
        assert torch.equal(packed[:, c * 64:(c + 1) * 64] & 0xF, chunk[:, :64])
        assert torch.equal(packed[:, c * 64:(c + 1) * 64] >> 4, chunk[:, 64:])


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("n,k,blocks", [(37, 100, None), (130, 257, (4, 128, 0)), (130, 257, (4, 128, 257)),
                                        (64, 2100, None), (64, 2100, (2, 1024, 0)), (9, 64, (1, 64, 0)),
                                        (50, 1536, (16, 512, 0)), (50, 1536, (2, 512, 1536))])
def test_dense_gemv_matches_reference(dtype, n, k, blocks):
    """Partial row blocks, K not a power of two, K beyond one chunk (2100 > 2048, and in unrolled chunks:
    ``K_STATIC``, the default up to ``UNROLL_MAX_CHUNKS``), one row per program."""
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    got = dense_gemv(x, w, blocks=blocks)
    assert got.shape == (1, n) and got.dtype == dtype
    assert_nmse(x.float() @ w.float().T, got, tolerance("linear"), f"dense_gemv {n}x{k} {blocks} {dtype}")
    with pytest.raises(ValueError, match="dense_gemv takes"):
        dense_gemv(torch.randn(2, k, device=DEVICE).to(dtype), w)


def test_gemv_blocks_unroll_k_only_when_asked(monkeypatch):
    """``gemv_blocks``: K in one looped chunk by default; with ``UNROLL_K`` the unrolled cut up to its chunk limit,
    256- or 128-column chunks (whichever divides K)."""
    from musecore_triton.kernels import dense_gemv as module
    assert [module.gemv_blocks(k) for k in (64, 1536, 4096)] == [(2, 64, 0), (2, 2048, 0), (2, 2048, 0)]
    monkeypatch.setattr(module, "UNROLL_K", True)
    assert [module.gemv_blocks(k) for k in (256, 640, 768, 1536, 2048, 2100)] == [
        (2, 256, 0), (1, 128, 640), (1, 256, 768), (1, 256, 1536), (1, 256, 2048), (2, 2048, 0)]


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(96, 64), (130, 257), (768, 1536)])
def test_dense_gemv_with_the_norm_in_its_last_program_matches_the_separate_ops(dtype, n, k):
    """``dense_gemv(norm=)``: the program that finishes last normalises the whole row (as the rms_norm op does from
    the rounded product) and gives the counter back at zero, launch after launch; an fp32 x is rounded as it
    loads, giving the bits of ``x.to(w.dtype)`` first."""
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    want = ref.rms_norm(dense_gemv(x, w), norm_w, 1e-6)
    for launch in range(2):
        got = dense_gemv(x, w, norm=(norm_w, 1e-6, counter))
        assert got.shape == (1, n) and got.dtype == dtype
        assert int(counter) == 0, f"launch {launch}: the counter was left at {int(counter)}"
        assert_nmse(want, got, tolerance("rms_norm"), f"dense_gemv + norm {n}x{k} {dtype}, launch {launch}")
    x32 = torch.randn(1, k, device=DEVICE)
    assert torch.equal(dense_gemv(x32, w), dense_gemv(x32.to(dtype), w))
    with pytest.raises(ValueError, match="one-element int32 counter"):
        dense_gemv(x, w, norm=(norm_w, 1e-6, counter.long()))


@pytest.mark.parametrize("post,n,k,cut", [("weightless", 96, 64, None), ("scale_first", 96, 64, None),
                                          ("weightless", 768, 1536, None), ("scale_first", 768, 1536, None),
                                          ("scale_first", 100, 64, (16, 4)), ("weightless", 100, 64, "hook")])
def test_dense_gemv_with_the_residual_norm_in_its_last_program_matches_the_separate_ops(post, n, k, cut, monkeypatch):
    """``dense_gemv(residual_norm=)``: the product, then the residual_norm op on it, in one launch; an fp32 x (the
    experts' output reaching the unpooler) rounded as it loads. ``cut``: the launch at that many rows x warps per
    program (``RESIDUAL_NORM_BLOCK_N`` / ``_WARPS``; 100 rows: a last program of 4 rows); ``"hook"``: at a backend's
    ``hooks.row_op_cut`` (8 x 4), which the launch must ask for."""
    from musecore_triton import hooks
    from musecore_triton.kernels import dense_gemv as module
    asked: list = []
    if cut == "hook":
        monkeypatch.setattr(hooks, "_row_op_cut", lambda device, kernel: asked.append(kernel) or (8, 4))
    elif cut is not None:
        monkeypatch.setattr(module, "RESIDUAL_NORM_BLOCK_N", cut[0])
        monkeypatch.setattr(module, "RESIDUAL_NORM_WARPS", cut[1])
    dtype = SMALL_DTYPES[-1]
    x = torch.randn(1, k, device=DEVICE)
    w = (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)
    residual = torch.randn(1, n, device=DEVICE).to(dtype)
    post_w = None if post == "weightless" else (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    alpha, beta = torch.rand(n, device=DEVICE) + 0.5, torch.rand(n, device=DEVICE)
    next_w = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    want = ref.residual_norm(residual, dense_gemv(x, w), post_w, alpha, beta, next_w, 1e-5, 1e-6)
    for launch in range(2):
        got = dense_gemv(x, w, residual_norm=(residual, post_w, alpha, beta, next_w, 1e-5, 1e-6, counter))
        assert int(counter) == 0, f"launch {launch}: the counter was left at {int(counter)}"
        for name, a, b in zip(("residual", "normed"), want, got):
            assert b.shape == a.shape and b.dtype == a.dtype
            assert_nmse(a, b, tolerance("residual_norm"), f"dense_gemv + residual_norm {n}x{k} {post}: {name}")
    assert asked == (["residual_norm"] * 2 if cut == "hook" else []), f"hooks.row_op_cut asked for {asked}"
    with pytest.raises(ValueError, match="has 95 elements"):
        dense_gemv(x, w, residual_norm=(residual, post_w, alpha[:95], beta, next_w, 1e-5, 1e-6, counter))
