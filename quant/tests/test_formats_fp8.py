"""FP8 E4M3 weights: per tensor and 128x128 blocks, clamping before the cast, error bound."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from musecore_quant.formats.fp8 import fp8_dequantize, fp8_fake_quantize_activation, fp8_quantize


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # fixed data; the assertions hold for any seed, a failure must reproduce


def test_per_tensor_scale_is_amax_over_448_and_dequant_multiplies():
    w = torch.tensor([[896.0, -448.0], [2.0, 0.0]])
    qt = fp8_quantize(w)
    assert qt.group_size == 0 and qt.scale.shape == () and qt.scale.item() == 2.0
    assert qt.data.dtype == torch.float8_e4m3fn
    assert torch.equal(fp8_dequantize(qt), w)


def test_block_scales_have_ceil_shape_and_ragged_edges_dequantize():
    w = torch.randn(300, 200)
    w[256:, 128:] *= 1000                                   # the ragged corner block gets its own scale
    qt = fp8_quantize(w, block_size=128)
    assert qt.scale.shape == (3, 2) and qt.group_size == 128
    assert abs(qt.scale[2, 1].item() - w[256:, 128:].abs().max().item() / 448) < 1e-6 * qt.scale[2, 1].item()
    scale = qt.scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    # E4M3 keeps 3 mantissa bits (relative error <= 2^-4) down to its subnormals (step 2^-9 of the scale).
    excess = (fp8_dequantize(qt) - w).abs() - (w.abs() / 16 + scale / 2 ** 10) * (1 + 1e-6)
    assert excess.max().item() <= 0, f"error exceeds the E4M3 bound by {excess.max().item():.3g}"


def test_quotients_are_clamped_before_the_cast_so_nothing_becomes_nan():
    x = torch.tensor([1.0, 500.0, -1e6])
    x_hat = fp8_fake_quantize_activation(x, input_scale=1.0)      # static scale far below the amax
    assert torch.isfinite(x_hat).all() and x_hat.tolist() == [1.0, 448.0, -448.0]


def test_all_zero_tensor_and_block_get_scale_one():
    assert fp8_quantize(torch.zeros(4, 4)).scale.item() == 1.0
    qt = fp8_quantize(torch.cat([torch.zeros(4, 128), torch.ones(4, 128)], dim=1), block_size=128)
    assert torch.equal(qt.scale, torch.tensor([[1.0, 1.0 / 448]]))


def test_stacked_experts_get_one_scale_each():
    experts = torch.randn(3, 8, 16) * torch.tensor([1.0, 10.0, 100.0]).view(3, 1, 1)
    qt = fp8_quantize(experts)
    assert qt.scale.shape == (3,)
    for e in range(3):
        assert torch.equal(fp8_dequantize(qt)[e], fp8_dequantize(fp8_quantize(experts[e])))


def _e4m3_half_ulp(y: torch.Tensor) -> torch.Tensor:
    """Half the E4M3 spacing at magnitude ``y``: 2^(floor(log2 y) - 4) for normals, 2^-10 below 2^-6."""
    _, exponent = torch.frexp(y.clamp(min=2.0 ** -6))
    return torch.ldexp(torch.ones_like(y), (exponent - 1 - 4).float())


@settings(max_examples=50, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 20), st.integers(1, 20)),
                  elements=st.floats(-1e4, 1e4, width=32)),
       st.sampled_from([None, 4, 8]))
def test_every_element_is_within_half_an_e4m3_step_of_its_scale(values, block_size):
    w = torch.from_numpy(values)
    qt = fp8_quantize(w, block_size=block_size)
    w_hat = fp8_dequantize(qt)
    if block_size is None:
        scale = qt.scale.expand_as(w)
    else:
        scale = qt.scale.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)[: w.shape[0], : w.shape[1]]
    y = w.abs() / scale
    bound = _e4m3_half_ulp(y) * scale * (1 + 1e-6)
    excess = (w - w_hat).abs() - bound
    assert excess.max().item() <= 0, f"error exceeds half an E4M3 step by {excess.max().item():.3g}"


def test_a_dequantized_weight_is_a_fixed_point():
    once = fp8_dequantize(fp8_quantize(torch.randn(64, 64) * 3))
    assert torch.equal(fp8_dequantize(fp8_quantize(once)), once)


def test_dynamic_activation_fake_quant_keeps_dtype():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    x_hat = fp8_fake_quantize_activation(x)
    assert x_hat.dtype == torch.bfloat16
    assert ((x_hat.float() - x.float()).abs() <= x.float().abs() / 16 + 1e-2).all()


def test_an_amax_whose_scale_underflows_fp32_gets_scale_one_not_zero():
    qt = fp8_quantize(torch.full((2, 2), 1e-45))
    assert qt.scale.item() == 1.0 and torch.isfinite(fp8_dequantize(qt)).all()


def test_a_bf16_matrix_rounds_its_quotient_to_bf16_first_as_modelopt_export_does():
    # amax 320 -> scale 5/7. Quotients 7.2625 and 6.7375 lie just off E4M3's midpoints 7.25 and
    # 6.75; ModelOpt's bf16 weight / 0-dim fp32 scale is a bf16 quotient, which lands ON the
    # midpoint, and the cast breaks that tie to even (7.0). One rounding goes the other way.
    w = torch.tensor([[320.0, 5.1875, 4.8125, -5.1875]])
    assert torch.equal(w.bfloat16().float(), w)
    twice = fp8_quantize(w.bfloat16())
    assert twice.scale.item() == torch.tensor(320.0 / 448.0).item()
    assert twice.data.float().tolist() == [[448.0, 7.0, 7.0, -7.0]]
    assert twice.data.view(torch.uint8).tolist() == [[0x7E, 0x4E, 0x4E, 0xCE]]
    once = fp8_quantize(w)                                    # fp32 weight: one rounding
    assert once.data.float().tolist() == [[448.0, 7.5, 6.5, -7.5]]
    # Stacked experts and blocks divide by a dimensioned fp32 scale in ModelOpt: one rounding.
    assert fp8_quantize(w.bfloat16().unsqueeze(0)).data.float().tolist() == [[[448.0, 7.5, 6.5, -7.5]]]
    assert fp8_quantize(w.bfloat16(), block_size=4).data.float().tolist() == [[448.0, 7.5, 6.5, -7.5]]
