"""The lab's swap-AB W4A16 GEMM (``backends/cuda/lab/fp4_gemm_swapab.py``: the upcast FP4 weight as the MMA's
left operand; selected by no path of the backend) against the reference linear, with and without the CUDA
backend's hooks (hardware e4m3 decode or the portable one). It takes bf16 activations only, which Triton's CPU
interpreter cannot run, so every test here is marked ``gpu``: ``pytest -m gpu backends/cuda/lab/tests``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import musecore_quant
from musecore.ops import Weight, tolerance
from musecore.ops import reference as ref

from musecore_triton.testing import DEVICE, assert_nmse
from musecore_triton.layouts import prepare_fp4

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab
import fp4_gemm_swapab as sw  # noqa: E402

pytestmark = pytest.mark.gpu


def reference_linear(x: torch.Tensor, qt) -> torch.Tensor:
    dense = musecore_quant.dequantize(qt).to(x.device)
    return ref.linear(x.float(), Weight(data=dense, format=qt.format, out_features=dense.shape[0],
                                        in_features=dense.shape[1]))


def swapab_linear(x, w, cfg, n_major=False, hw_fp8=None):
    n, k = w.out_features, w.in_features
    out = (torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device) if cfg.split_k > 1
           else torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device))
    scales = w.scales[0].t().contiguous().t() if n_major else w.scales
    sw.launch(x, w.packed, scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2, n=n, k=k,
              out=out, cfg=cfg, hw_fp8=hw_fp8)
    return out.to(x.dtype)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,cfg", [
    (5, sw.SwapAbConfig(64, 16, 2, 3, 4)),      # partial token tile, split-K
    (16, sw.SwapAbConfig(128, 16, 4, 4, 4)),
    (40, sw.SwapAbConfig(64, 32, 1, 3, 4)),     # two token tiles, the second partial
    (64, sw.SwapAbConfig(128, 64, 2, 4, 8)),
    (256, sw.SwapAbConfig(128, 128, 1, 3, 8)),
    (300, sw.SwapAbConfig(256, 128, 1, 3, 8)),  # partial last tile at large M
])
@pytest.mark.parametrize("n_major", [False, True], ids=["resident_scales", "n_major_scales"])
@pytest.mark.parametrize("hw_fp8", [True, False], ids=["hw_fp8", "portable_scales"])
def test_swapab_gemm_matches_reference(fmt, m, cfg, n_major, hw_fp8):
    n, k = 320, 1024  # N not a multiple of 256 / 128: the row clamp; 8 chunks: split-K up to 4
    w = torch.randn(n, k) * 0.05
    w[3, :16] *= 40  # one block with a large scale, one nearly empty
    w[7, 32:64] *= 1e-3
    qt = musecore_quant.quantize(w, fmt)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    y = swapab_linear(x, prepare_fp4(qt, DEVICE), cfg, n_major, hw_fp8)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert_nmse(reference_linear(x, qt), y, tolerance("linear"), f"{fmt} swap-AB M={m} {cfg} n_major={n_major}")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n_major", [False, True], ids=["resident_scales", "n_major_scales"])
@pytest.mark.parametrize("hw_fp8", [True, False], ids=["hw_fp8", "portable_scales"])
def test_swapab_gemm_upcasts_every_code_exactly(fmt, n_major, hw_fp8):
    """Every E2M1 code at every nibble position (one-hot activation rows, 64 per call, fp32 output through
    split-K): each output within 1e-6 relative of the dequantized weight, as for the CUDA kernels."""
    n, k = 40, 1024
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
    qt = musecore_quant.quantize(values, fmt)
    dense = musecore_quant.dequantize(qt).float().to(DEVICE)
    w = prepare_fp4(qt, DEVICE)
    cfg = sw.SwapAbConfig(64, 64, 2, 3, 4)
    for start in range(0, k, 64):
        x = torch.eye(k, device=DEVICE)[start:start + 64].to(torch.bfloat16)
        out = torch.zeros(64, n, dtype=torch.float32, device=DEVICE)
        scales = w.scales[0].t().contiguous().t() if n_major else w.scales
        sw.launch(x, w.packed, scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2, n=n, k=k,
                  out=out, cfg=cfg, hw_fp8=hw_fp8)
        expected = dense[:, start:start + 64].T
        err = ((out - expected).abs() / expected.abs().clamp_min(1e-30)).max()
        assert err <= 1e-6, f"columns {start}..{start + 63}: max relative error {err:.3g} > 1e-6"


def test_swapab_gemm_refuses_what_it_cannot_run():
    qt = musecore_quant.quantize(torch.randn(64, 256) * 0.05, "nvfp4")
    w = prepare_fp4(qt, DEVICE)
    cfg = sw.SwapAbConfig(64, 16, 1, 3, 4)
    with pytest.raises(TypeError, match="bf16 activations"):
        swapab_linear(torch.randn(4, 256, device=DEVICE).half(), w, cfg)
    with pytest.raises(ValueError, match="divisible by 128"):
        swapab_linear(torch.randn(4, 256, device=DEVICE).to(torch.bfloat16), w, sw.SwapAbConfig(64, 16, 4, 3, 4))
