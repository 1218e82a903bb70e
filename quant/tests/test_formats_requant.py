"""NVFP4 <-> MXFP4: the FORMATS.md error numbers for the lossy direction, exactness of the other."""

import pytest
import torch

from formats_md_vectors import FORMATS_MD_ROW
from musecore_quant.formats.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from musecore_quant.formats.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from musecore_quant.formats.requant import (nvfp4_exact_weight_scale_2, requantize_mxfp4_to_nvfp4,
                                            requantize_nvfp4_to_mxfp4)
from musecore_quant.metrics import quant_error


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # fixed data; the assertions hold for any seed, a failure must reproduce


def test_formats_md_rmse_row_nvfp4_requantized_and_straight_mxfp4():
    nvfp4 = nvfp4_quantize(FORMATS_MD_ROW)
    requantized = requantize_nvfp4_to_mxfp4(nvfp4)
    straight = mxfp4_quantize(FORMATS_MD_ROW)
    rmse = [quant_error(FORMATS_MD_ROW, w).rmse for w in
            (nvfp4_dequantize(nvfp4), mxfp4_dequantize(requantized), mxfp4_dequantize(straight))]
    assert [f"{r:.4g}" for r in rmse] == ["0.01868", "0.02167", "0.01877"], f"measured RMSE {rmse}"


def test_nvfp4_to_mxfp4_is_dequantize_then_even_scales():
    nvfp4 = nvfp4_quantize(torch.randn(2, 8, 64))
    expected = mxfp4_quantize(nvfp4_dequantize(nvfp4), scale_mode="even")
    got = requantize_nvfp4_to_mxfp4(nvfp4)
    assert torch.equal(got.data, expected.data) and torch.equal(got.scale, expected.scale)
    assert got.input_scale is None


def _wide_range_weights(experts: int = 3) -> torch.Tensor:
    # Rows spread over 2^-12 .. 2^12 so block exponents differ by up to 16 binades within a matrix.
    rows = 2.0 ** torch.randint(-8, 9, (experts, 16, 1)).float()
    return torch.randn(experts, 16, 128) * rows


def test_mxfp4_to_nvfp4_keeps_the_bytes_and_every_value_exactly():
    mx = mxfp4_quantize(_wide_range_weights())
    nv = requantize_mxfp4_to_nvfp4(mx)
    assert torch.equal(nv.data, mx.data), "element codes must be unchanged"
    assert nv.global_scale.shape == (3,)
    w_mx, w_nv = mxfp4_dequantize(mx), nvfp4_dequantize(nv)
    assert torch.equal(w_nv, w_mx), f"max difference {(w_nv - w_mx).abs().max().item()}"


def test_exact_weight_scale_2_is_two_to_the_largest_exponent_minus_eight():
    mx = mxfp4_quantize(torch.full((1, 32), 6.0) * 2.0 ** 5)        # block exponent 5
    ws2 = nvfp4_exact_weight_scale_2(mx)
    assert ws2.item() == 2.0 ** (5 - 8)
    nv = requantize_mxfp4_to_nvfp4(mx)
    assert nv.scale.float().tolist() == [[256.0, 256.0]]           # 2^8, the largest power of two in E4M3


def test_fused_siblings_share_an_exact_weight_scale_2():
    gate = mxfp4_quantize(torch.randn(8, 64))
    up = mxfp4_quantize(torch.randn(8, 64) * 50)
    shared = nvfp4_exact_weight_scale_2(gate, up)
    for mx in (gate, up):
        nv = requantize_mxfp4_to_nvfp4(mx, weight_scale_2=shared)
        assert torch.equal(nv.global_scale, shared)
        assert torch.equal(nvfp4_dequantize(nv), mxfp4_dequantize(mx))


def test_blocks_more_than_seventeen_binades_down_are_rerounded_and_the_rest_stay_exact():
    w = torch.randn(2, 64)
    w[1, :32] = torch.randn(32) * 2.0 ** -25                          # far below the largest block
    mx = mxfp4_quantize(w)
    nv = requantize_mxfp4_to_nvfp4(mx)
    w_mx, w_nv = mxfp4_dequantize(mx), nvfp4_dequantize(nv)
    assert torch.equal(w_nv[0], w_mx[0]) and torch.equal(w_nv[1, 32:], w_mx[1, 32:])
    # Such blocks hold values below 6 * 2^(k_max - 18) = 6 * weight_scale_2 / 2^10, so that bounds the change.
    tiny_error = (w_nv[1, :32] - w_mx[1, :32]).abs().max().item()
    bound = 6 * nv.global_scale.item() / 2 ** 10
    assert tiny_error <= bound, f"re-rounded tiny block moved by {tiny_error}, bound {bound}"
    assert tiny_error < 2.0 ** -15 * w.abs().max().item()


def test_a_weight_scale_2_that_is_not_a_large_enough_power_of_two_is_refused():
    mx = mxfp4_quantize(torch.randn(4, 32))
    own = nvfp4_exact_weight_scale_2(mx)
    with pytest.raises(ValueError, match="power of two"):
        requantize_mxfp4_to_nvfp4(mx, weight_scale_2=own * 1.5)
    with pytest.raises(ValueError, match="power of two >="):
        requantize_mxfp4_to_nvfp4(mx, weight_scale_2=own / 2)


def test_all_zero_mxfp4_converts_to_a_finite_zero_nvfp4():
    nv = requantize_mxfp4_to_nvfp4(mxfp4_quantize(torch.zeros(2, 32)))
    assert torch.isfinite(nv.global_scale).all()
    assert torch.equal(nvfp4_dequantize(nv), torch.zeros(2, 32))
