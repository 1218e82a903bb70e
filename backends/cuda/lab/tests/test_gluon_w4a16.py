"""The lab's Gluon W4A16 GEMM (``backends/cuda/lab/fp4_gemm_gluon.py``: swap-AB, register-A ``wgmma``, TMA ring,
warp specialization; selected by no path of the backend) against the reference linear. It needs an SM90 GPU and
Triton's Gluon (``triton.experimental.gluon``), so every test here is marked ``gpu`` and the module skips when
Gluon is missing: ``pytest -m gpu backends/cuda/lab/tests/test_gluon_w4a16.py``."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="needs Triton's Gluon (Triton >= 3.5)")

import musecore_quant  # noqa: E402
from musecore.ops import Weight, tolerance  # noqa: E402
from musecore.ops import reference as ref  # noqa: E402

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs an SM90 (Hopper) GPU: TMA and wgmma", allow_module_level=True)

from musecore_triton.layouts import prepare_fp4  # noqa: E402
from musecore_triton.testing import DEVICE, assert_nmse  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab
import fp4_gemm_gluon as gk  # noqa: E402


def reference_linear(x: torch.Tensor, qt) -> torch.Tensor:
    dense = musecore_quant.dequantize(qt).to(x.device)
    return ref.linear(x.float(), Weight(data=dense, format=qt.format, out_features=dense.shape[0],
                                        in_features=dense.shape[1]))


def gluon_linear(x, w, cfg, out=None):
    n, k = w.out_features, w.in_features
    if out is None:
        out = (torch.zeros(x.shape[0], n, dtype=torch.float32, device=x.device) if cfg.split_k > 1
               else torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device))
    gk.launch(x, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2, n=n, k=k,
              out=out, cfg=cfg)
    return out.to(x.dtype)


@pytest.mark.parametrize("m,cfg", [
    (5, gk.GluonConfig(64, 16, 2, 4)),       # partial token tile (TMA zero fill), split-K
    (16, gk.GluonConfig(128, 16, 1, 6)),
    (40, gk.GluonConfig(64, 32, 1, 3)),      # two token tiles, the second partial; ring wraps (8 chunks, 3 stages)
    (64, gk.GluonConfig(128, 64, 2, 4)),
    (200, gk.GluonConfig(128, 128, 1, 4)),   # partial last tile
    (256, gk.GluonConfig(64, 256, 1, 2)),
])
@pytest.mark.parametrize("asm_upcast", [False, True], ids=["int16_upcast", "asm_upcast"])
def test_gluon_gemm_matches_reference(m, cfg, asm_upcast):
    cfg = dataclasses.replace(cfg, asm_upcast=asm_upcast)
    n, k = 320, 1024  # N not a multiple of 128: the last weight tile is partial (TMA zero fill, masked scales)
    w = torch.randn(n, k) * 0.05
    w[3, :16] *= 40  # one block with a large scale, one nearly empty
    w[7, 32:64] *= 1e-3
    qt = musecore_quant.quantize(w, "nvfp4")
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    y = gluon_linear(x, prepare_fp4(qt, DEVICE), cfg)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert_nmse(reference_linear(x, qt), y, tolerance("linear"), f"nvfp4 Gluon M={m} {cfg}")


@pytest.mark.parametrize("asm_upcast", [False, True], ids=["int16_upcast", "asm_upcast"])
def test_gluon_gemm_upcasts_every_code_exactly(asm_upcast):
    """Every E2M1 code at every nibble position (one-hot activation rows, 64 per call, fp32 output through
    split-K): each output within 1e-6 relative of the dequantized weight, as for the CUDA kernels."""
    n, k = 64, 1024
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
    values = values * (1 + torch.arange(k // 16).repeat_interleave(16) % 5)[None, :]  # varied group scales
    qt = musecore_quant.quantize(values, "nvfp4")
    dense = musecore_quant.dequantize(qt).float().to(DEVICE)
    w = prepare_fp4(qt, DEVICE)
    cfg = gk.GluonConfig(64, 64, 2, 3, asm_upcast=asm_upcast)
    for start in range(0, k, 64):
        x = torch.eye(k, device=DEVICE)[start:start + 64].to(torch.bfloat16)
        out = torch.zeros(64, n, dtype=torch.float32, device=DEVICE)
        gk.launch(x, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2, n=n, k=k,
                  out=out, cfg=cfg)
        expected = dense[:, start:start + 64].T
        err = ((out - expected).abs() / expected.abs().clamp_min(1e-30)).max()
        assert err <= 1e-6, f"columns {start}..{start + 63}: max relative error {err:.3g} > 1e-6"


def test_gluon_gemm_refuses_what_it_cannot_run():
    w = prepare_fp4(musecore_quant.quantize(torch.randn(64, 256) * 0.05, "nvfp4"), DEVICE)
    with pytest.raises(TypeError, match="bf16 activations"):
        gluon_linear(torch.randn(4, 256, device=DEVICE).half(), w, gk.GluonConfig(64, 16, 1, 3))
    with pytest.raises(ValueError, match="divisible by 128"):
        gluon_linear(torch.randn(4, 256, device=DEVICE).to(torch.bfloat16), w, gk.GluonConfig(64, 16, 4, 3))
    mx = prepare_fp4(musecore_quant.quantize(torch.randn(64, 256) * 0.05, "mxfp4"), DEVICE)
    with pytest.raises(ValueError, match="NVFP4"):
        gluon_linear(torch.randn(4, 256, device=DEVICE).to(torch.bfloat16), mx, gk.GluonConfig(64, 16, 1, 3))
