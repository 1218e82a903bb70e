"""MXFP4: torchao's checked vectors, the three shared-exponent rules, error bound, GPT-OSS layout."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from musecore_quant.formats.mxfp4 import (e8m0_to_float, mxfp4_dequantize, mxfp4_fake_quantize_activation,
                                          mxfp4_from_gpt_oss, mxfp4_quantize, mxfp4_to_gpt_oss, shared_exponent)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # fixed data; the assertions hold for any seed, a failure must reproduce


TORCHAO_BLOCK = torch.tensor([[7.0, -3.3, 1.25, 0.3, 2.5, 5.0, -0.75, 0.1] + [0.0] * 24])


def _first_bytes(qt, n=4):
    return qt.data[0, :n].numpy().tobytes().hex(" ")


def test_torchao_vector_floor_scale():
    qt = mxfp4_quantize(TORCHAO_BLOCK, scale_mode="floor")
    assert qt.scale.tolist() == [[127]]
    assert _first_bytes(qt) == "d7 12 64 0a"          # codes 7 D 2 1 4 6 A 0, 7.0 clips to 6
    assert qt.data[0, 4:].eq(0).all()


def test_torchao_vector_even_scale():
    qt = mxfp4_quantize(TORCHAO_BLOCK, scale_mode="even")
    assert qt.scale.tolist() == [[128]]
    assert _first_bytes(qt) == "b6 01 42 09"          # codes 6 B 1 0 2 4 9 0


def test_torchao_vector_even_scale_with_aiter_ties_away():
    qt = mxfp4_quantize(TORCHAO_BLOCK, scale_mode="even", rounding="away")
    assert _first_bytes(qt) == "b6 01 53 09"          # codes 6 B 1 0 3 5 9 0


def test_defaults_are_quark_even_and_round_half_even():
    assert torch.equal(mxfp4_quantize(TORCHAO_BLOCK).data, mxfp4_quantize(TORCHAO_BLOCK, "even", "rne").data)


def test_all_zero_block_gets_scale_byte_zero():
    qt = mxfp4_quantize(torch.zeros(2, 64))
    assert qt.scale.eq(0).all() and qt.data.eq(0).all()
    assert torch.equal(mxfp4_dequantize(qt), torch.zeros(2, 64))


def test_e8m0_bytes_decode_to_powers_of_two_and_0xff_to_nan():
    values = e8m0_to_float(torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8))
    assert values[:6].tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert math.isnan(values[6].item())


def _reference_exponent(amax: float, mode: str) -> int:
    """The FORMATS.md rules in float64 arithmetic, one value at a time."""
    if amax == 0:
        return -127
    if mode == "ceil":
        mantissa, exponent = math.frexp(float(np.float32(amax) / np.float32(6.0)))
        e = exponent - 1 if mantissa == 0.5 else exponent
    else:
        mantissa, exponent = math.frexp(amax)               # amax = m * 2^e, m in [0.5, 1)
        floor_log2 = exponent - 1
        if mode == "even" and 2 * mantissa >= 1.75:
            floor_log2 += 1
        e = floor_log2 - 2
    return max(-127, min(127, e))


@settings(max_examples=80, deadline=None)
@given(st.floats(0, 2.0 ** 100, width=32), st.sampled_from(["even", "floor", "ceil"]))
def test_shared_exponent_follows_the_producer_rule(amax, mode):
    got = shared_exponent(torch.tensor([amax], dtype=torch.float32), mode).item()
    assert got == _reference_exponent(amax, mode), f"amax {amax!r} mode {mode}: got {got}"


def test_shared_exponent_at_the_rule_boundaries():
    amax = torch.tensor([6.0, 6.01, 7.0, 4.0, 3.1, 1.75, 1.7499])
    assert shared_exponent(amax, "floor").tolist() == [0, 0, 0, 0, -1, -2, -2]
    assert shared_exponent(amax, "even").tolist() == [0, 0, 1, 0, -1, -1, -2]
    assert shared_exponent(amax, "ceil").tolist() == [0, 1, 1, 0, 0, -1, -1]
    # Rounding the largest fp32 values up overflows to inf; the exponent must still come out right.
    assert shared_exponent(torch.tensor([3.4e38]), "even").tolist() == [126]


def _fp4_half_step(y):
    return torch.where(y < 2, 0.25, torch.where(y < 4, 0.5, 1.0))


weights = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])),
                     elements=st.floats(-1000, 1000, width=32))


@settings(max_examples=50, deadline=None)
@given(weights, st.sampled_from(["even", "floor", "ceil"]), st.sampled_from(["rne", "away"]), st.integers(-30, 30))
def test_every_element_is_within_half_a_grid_step_of_its_block_scale(values, mode, rounding, exponent):
    w = torch.from_numpy(values) * 2.0 ** exponent
    qt = mxfp4_quantize(w, scale_mode=mode, rounding=rounding)
    w_hat = mxfp4_dequantize(qt)
    s = e8m0_to_float(qt.scale).repeat_interleave(32, dim=-1)
    y = w.abs() / s
    err = (w - w_hat).abs()
    excess = torch.where(y <= 6, err - _fp4_half_step(y) * s, (w_hat.abs() - 6 * s).abs())
    assert excess.max().item() <= 0, f"error exceeds half a grid step by {excess.max().item():.3g}"
    if mode == "ceil":
        assert bool((y <= 6).all()), "CEIL scales must never saturate"


def test_a_dequantized_weight_is_a_fixed_point_of_quantization():
    w = torch.randn(8, 128) * torch.logspace(-3, 3, 8).unsqueeze(1)
    for mode in ("even", "floor", "ceil"):
        once = mxfp4_dequantize(mxfp4_quantize(w, mode))
        twice = mxfp4_dequantize(mxfp4_quantize(once, mode))
        assert torch.equal(once, twice), f"{mode}: max change {(once - twice).abs().max().item()}"


def test_stacked_experts_quantize_like_each_expert():
    experts = torch.randn(3, 4, 64)
    stacked = mxfp4_quantize(experts)
    for e in range(3):
        single = mxfp4_quantize(experts[e])
        assert torch.equal(stacked.data[e], single.data) and torch.equal(stacked.scale[e], single.scale)


def test_gpt_oss_blocks_and_scales_round_trip_through_the_canonical_layout():
    w = torch.randn(2, 6, 96)
    qt = mxfp4_quantize(w)
    blocks, scales = mxfp4_to_gpt_oss(qt)
    assert blocks.shape == (2, 6, 3, 16) and scales.shape == (2, 6, 3)
    back = mxfp4_from_gpt_oss(blocks, scales)
    assert back.shape == (2, 6, 96) and torch.equal(back.data, qt.data) and torch.equal(back.scale, qt.scale)
    assert torch.equal(mxfp4_dequantize(back), mxfp4_dequantize(qt))


def test_gpt_oss_low_nibble_is_the_even_element():
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0xC2                                  # elements 0, 1 = 1.0, -2.0
    w = mxfp4_dequantize(mxfp4_from_gpt_oss(blocks, torch.full((1, 1), 127, dtype=torch.uint8)))
    assert w[0, :3].tolist() == [1.0, -2.0, 0.0]


def test_gpt_oss_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match=r"\[..., rows, in/32, 16\]"):
        mxfp4_from_gpt_oss(torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))


def test_activation_fake_quant_equals_weight_round_trip_and_keeps_dtype():
    x = torch.randn(5, 96, dtype=torch.bfloat16)
    x_hat = mxfp4_fake_quantize_activation(x, scale_mode="floor", rounding="away")
    assert x_hat.dtype == torch.bfloat16
    reference = mxfp4_dequantize(mxfp4_quantize(x, "floor", "away")).to(torch.bfloat16)
    assert torch.equal(x_hat, reference)


def test_unknown_scale_mode_lists_the_choices():
    with pytest.raises(ValueError, match="'even', 'floor', 'ceil'"):
        mxfp4_quantize(torch.randn(2, 32), scale_mode="round")
