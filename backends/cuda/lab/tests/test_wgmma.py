"""The lab's wgmma GEMM (``backends/cuda/lab/fp4_gemm_wgmma.py``, selected by no path of the backend)
against the reference; moved from ``backends/cuda/tests/test_cuda_linear.py`` with the kernel. Run with
``pytest -m gpu backends/cuda/lab/tests``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import musecore_quant
from musecore.ops import Weight, tolerance
from musecore.ops import reference as ref

from musecore_triton.testing import assert_nmse, nmse
from musecore_triton.layouts import prepare_fp4

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab
import fp4_gemm_wgmma  # noqa: E402


def reference_linear(x: torch.Tensor, qt) -> torch.Tensor:
    dense = musecore_quant.dequantize(qt).to(x.device)
    return ref.linear(x.float(), Weight(data=dense, format=qt.format, out_features=dense.shape[0],
                                        in_features=dense.shape[1]))


def _check_every_code(fmt, rows, run, what):
    """``run(x, w, n, k)`` on one-hot rows ``x`` (``rows`` at a time) against a weight holding every
    E2M1 code at every nibble position: each output within 1e-6 relative of the dequantized weight."""
    n, k = 40, 1024
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
    qt = musecore_quant.quantize(values, fmt)
    dense = musecore_quant.dequantize(qt).float().cuda()
    w = prepare_fp4(qt, torch.device("cuda"))
    for start in range(0, k, rows):
        x = torch.eye(k, device="cuda")[start:start + rows].to(torch.bfloat16)
        out = run(x, w, n, k).float()
        expected = dense[:, start:start + rows].T
        err = ((out - expected).abs() / expected.abs().clamp_min(1e-30)).max()
        assert err <= 1e-6, f"{what} columns {start}..{start + rows - 1}: max relative error {err:.3g} > 1e-6"


def test_wgmma_slot_order_pairs_what_the_fp4_bytes_pair():
    """The wgmma kernel's activation order is a permutation of K, chunk by chunk, and each A register's
    two slots hold the elements ``decode_bf16x2`` pairs: ``e`` and ``e + 2`` of one word's half."""
    order = fp4_gemm_wgmma.slot_order(512)
    assert torch.equal(order.sort().values, torch.arange(512))
    chunks = order.view(-1, 128)
    assert torch.equal(chunks - 128 * torch.arange(4)[:, None], chunks[:1].expand(4, 128))  # same in every chunk
    pairs = order.view(-1, 2)
    assert torch.equal(pairs[:, 1] - pairs[:, 0], torch.full((256,), 2))
    # word q of a chunk holds elements 4q..4q+3 and 64+4q..64+4q+3; its 4 pairs lie in one k16 step
    # pair (2 slots of one thread, low half first), the other half 8 slots later
    step = order[:16]
    assert step[0].item() == 64 + 1 and step[8].item() == 1, step


def test_wgmma_plan_refuses_cuts_it_cannot_build():
    for bad in (dict(tokens=48), dict(tokens=64, stages=2), dict(tokens=128, stages=8), dict(tokens=64, groups=3),
                dict(tokens=64, split=9)):
        with pytest.raises(ValueError, match="cannot be built"):
            fp4_gemm_wgmma.WgmmaPlan(**bad)
    assert fp4_gemm_wgmma.WgmmaPlan(tokens=128, stages=7).smem == 7 * 128 * 128 * 2  # the largest ring that fits


def _needs_wgmma():
    if not fp4_gemm_wgmma.available(torch.device("cuda")):
        pytest.skip(f"the wgmma GEMM needs an SM90 GPU; this one is {torch.cuda.get_device_name()}")


def _wgmma(x, w, n, k, plan=None, offsets=None, dtype=torch.bfloat16):
    out = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=dtype)
    return fp4_gemm_wgmma.launch(x, w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                 n=n, k=k, out=out, plan=plan, offsets=offsets)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_wgmma_gemm_upcasts_every_code_exactly(fmt):
    """Every E2M1 code at every nibble position through the wgmma GEMM (one-hot rows, 64 per call).
    Tolerance 1e-6 relative per weight, as for the other FP4 kernels."""
    _needs_wgmma()
    _check_every_code(fmt, 64, lambda x, w, n, k: _wgmma(x, w, n, k, fp4_gemm_wgmma.WgmmaPlan(tokens=64)),
                      "wgmma GEMM")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [16, 24, 33, 64, 100, 128, 200, 256])
def test_cuda_wgmma_gemm_tiles_splits_and_stages_match_reference(fmt, m):
    """Partial token tiles and row blocks (1000 rows: a partial block for 1, 2 and 4 warpgroups), every
    token tile, even and uneven cluster splits, 1-3 chunks in flight, 3-8 stages, bf16 and fp32 outputs;
    tolerance: the linear op's NMSE."""
    _needs_wgmma()
    n, k = 1000, 4096
    qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
    w = prepare_fp4(qt, torch.device("cuda"))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    expected = reference_linear(x, qt)
    tiles = fp4_gemm_wgmma.TOKEN_TILES  # (tokens, split, prefetch, stages, warpgroups)
    cuts = [(tiles[0], 1, 2, 4, 4), (tiles[1], 3, 1, 4, 2), (tiles[2], 8, 3, 3, 1), (tiles[3], 2, 2, 3, 4),
            (tiles[2], 5, 2, 8, 2), (tiles[3], 1, 1, 7, 1), (tiles[1], 7, 3, 3, 4), (tiles[0], 4, 2, 3, 2)]
    i = [16, 24, 33, 64, 100, 128, 200, 256].index(m)
    plans = [fp4_gemm_wgmma.make_plan(m, n, k, x.device)] + [
        fp4_gemm_wgmma.WgmmaPlan(tokens=t, split=split, prefetch=pf, stages=stages, groups=groups)
        for t, split, pf, stages, groups in (cuts[i], cuts[(i + 3) % len(cuts)])]
    for plan in plans:
        for dtype in (torch.bfloat16, torch.float32):
            out = _wgmma(x, w, n, k, plan, dtype=dtype)
            assert_nmse(expected, out.float(), tolerance("linear"), f"{fmt} wgmma GEMM M={m} {plan} -> {dtype}")


@pytest.mark.gpu
def test_cuda_wgmma_slot_order_kernel_matches_the_permutation():
    _needs_wgmma()
    x = torch.randn(5, 1024, device="cuda").to(torch.bfloat16)
    wide = torch.randn(5, 1536, device="cuda").to(torch.bfloat16)[:, :1024]  # a row stride past K
    for a in (x, wide):
        assert torch.equal(fp4_gemm_wgmma.to_slot_order(a), a[:, fp4_gemm_wgmma.slot_order(1024).cuda()])


@pytest.mark.gpu
def test_cuda_wgmma_gemm_depends_on_its_shared_memory_layout():
    """The descriptor's offsets are what make B right: a wrong one must break the product (so the
    tests above cannot pass by accident of layout)."""
    _needs_wgmma()
    n, k, m = 256, 1024, 64
    qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, "nvfp4")
    w = prepare_fp4(qt, torch.device("cuda"))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    lead, stride = fp4_gemm_wgmma.descriptor_offsets(64)
    plan = fp4_gemm_wgmma.WgmmaPlan(tokens=64)
    right = nmse(reference_linear(x, qt), _wgmma(x, w, n, k, plan).float())
    # half the leading offset: k slots 8-15 read from token groups 4-7 of slots 0-7 (in bounds, wrong)
    wrong = nmse(reference_linear(x, qt), _wgmma(x, w, n, k, plan, offsets=(lead // 2, stride)).float())
    assert right <= tolerance("linear") < wrong, f"NMSE with the layout's offsets {right:.3g}, a wrong one {wrong:.3g}"
