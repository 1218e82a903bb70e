"""INT8 per output channel (the tpu-v6e-int8 load-time target): exact codes on hand-computed vectors, round half to
even, symmetric clamp, zero rows, the canonical layout, the decode, slicing, and activation fake-quant."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore_quant.formats.int8 import INT8_PER_CHANNEL, int8_dequantize, int8_quantize


def test_codes_and_scales_equal_hand_computed_values_with_ties_to_even() -> None:
    # Row 0: amax 127 -> scale 1.0 exactly; every quotient below is exact in fp32, so the codes are the rule's.
    # Row 1: amax 254 -> scale 2.0: 5 / 2 = 2.5 -> 2, 3 / 2 = 1.5 -> 2, -7 / 2 = -3.5 -> -4 (ties to even).
    # Row 2: all zero -> scale 1.0 (no 0/0), codes 0.
    w = torch.tensor([[127.0, -63.5, 0.5, 1.5, 2.5, -0.5, 0.0, -127.0],
                      [254.0, 5.0, 3.0, -7.0, 0.9, -1.1, 100.0, 0.0],
                      [0.0] * 8])
    qt = int8_quantize(w)
    assert qt.format == "int8" and qt.group_size == INT8_PER_CHANNEL and qt.shape == (3, 8)
    assert qt.data.dtype == torch.int8 and qt.scale.dtype == torch.float32 and qt.scale.shape == (3, 1)
    assert qt.scale.flatten().tolist() == [1.0, 2.0, 1.0]
    assert qt.data.tolist() == [[127, -64, 0, 2, 2, 0, 0, -127],
                                [127, 2, 2, -4, 0, -1, 50, 0],
                                [0] * 8]


def test_scale_is_the_correctly_rounded_fp32_quotient_and_codes_never_reach_minus_128() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 3, 64, generator=gen) * torch.tensor([1e-3, 1.0, 37.0]).view(1, 3, 1)
    w[0, 0, 5] = -w[0, 0].abs().max() * 1.0  # the row's amax is a negative value: its code is -127, not -128
    qt = int8_quantize(w.to(torch.bfloat16))
    amax = w.to(torch.bfloat16).float().abs().amax(-1, keepdim=True)
    want_scale = amax / torch.tensor(127.0)
    assert torch.equal(qt.scale, want_scale), "scale = amax / 127 in fp32 (one correctly rounded division)"
    want_codes = torch.round(w.to(torch.bfloat16).float() / want_scale).clamp(-127, 127).to(torch.int8)
    assert torch.equal(qt.data, want_codes)
    assert int(qt.data.min()) >= -127 and int(qt.data[0, 0, 5]) == -127
    assert qt.scale.shape == (4, 3, 1), "stacked experts keep one scale per output row"


def test_decode_is_codes_times_row_scale_and_the_round_trip_error_is_half_a_step() -> None:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(16, 256, generator=gen)
    qt = musecore_quant.quantize(w, "int8")
    w_hat = musecore_quant.dequantize(qt)
    assert torch.equal(w_hat, qt.data.float() * qt.scale) and torch.equal(w_hat, int8_dequantize(qt))
    step = qt.scale  # [16, 1]
    err = (w_hat - w).abs()
    assert bool((err <= step / 2 * (1 + 1e-6)).all()), f"largest error {float((err / step).max()):.4f} steps > 0.5"
    assert torch.equal(w_hat.abs().amax(-1, keepdim=True), 127 * qt.scale), "each row's amax decodes exactly"
    again = musecore_quant.quantize(w_hat, "int8")  # INT8 values re-quantize to the same codes
    assert torch.equal(again.data, qt.data)


def test_requantize_from_fp8_and_nvfp4_goes_through_the_decoded_values() -> None:
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(2, 32, 64, generator=gen)
    for source in ("fp8", "nvfp4"):
        qt = musecore_quant.quantize(w, source)
        got = musecore_quant.requantize(qt, "int8")
        want = int8_quantize(musecore_quant.dequantize(qt))
        assert torch.equal(got.data, want.data) and torch.equal(got.scale, want.scale), source


def test_slices_and_concatenation_keep_codes_and_row_scales() -> None:
    gen = torch.Generator().manual_seed(8)
    a, b = (int8_quantize(torch.randn(32, 64, generator=gen)) for _ in range(2))
    full = musecore_quant.dequantize(a)
    rows = musecore_quant.slice_rows(a, 8, 24)
    assert torch.equal(musecore_quant.dequantize(rows), full[8:24])
    cols = musecore_quant.slice_cols(a, 16, 48)
    assert torch.equal(musecore_quant.dequantize(cols), full[:, 16:48]) and cols.scale.shape == (32, 1)
    both = musecore_quant.concat_qtensors([a, b])
    assert torch.equal(musecore_quant.dequantize(both), torch.cat([full, musecore_quant.dequantize(b)]))
    stacked = musecore_quant.stack_qtensors([a, b])
    assert stacked.scale.shape == (2, 32, 1)
    assert torch.equal(musecore_quant.dequantize(musecore_quant.slice_experts(stacked, 1, 2))[0],
                       musecore_quant.dequantize(b))


def test_activation_fake_quant_per_row_scale_equals_the_formula() -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(5, 96, generator=gen) * torch.tensor([1.0, 10.0, 0.01, 3.0, 1.0]).view(5, 1)
    x[4] = 0.0
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax / torch.tensor(127.0) == 0, torch.tensor(1.0), amax / torch.tensor(127.0))
    got = musecore_quant.fake_quantize_activation(x, "int8", input_scale=scale)
    assert torch.equal(got, torch.round(x / scale).clamp(-127, 127) * scale)
    per_tensor = musecore_quant.fake_quantize_activation(x, "int8")
    s = x.abs().amax() / torch.tensor(127.0)
    assert torch.equal(per_tensor, torch.round(x / s).clamp(-127, 127) * s)


@pytest.mark.parametrize("bad,match", [(torch.randn(8), "out_features, in_features"),
                                       (torch.tensor([[1.0, float("nan")]]), "NaN"),
                                       (torch.zeros(2, 2, dtype=torch.int8), "floating")])
def test_bad_weights_fail_with_one_clear_error(bad: torch.Tensor, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        int8_quantize(bad)


def test_int8_takes_no_quantizer_options_and_a_bad_activation_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="valid options: none"):
        musecore_quant.quantize(torch.randn(4, 8), "int8", group_size=128)
    with pytest.raises(ValueError, match="finite and > 0"):
        musecore_quant.fake_quantize_activation(torch.randn(2, 8), "int8", input_scale=torch.zeros(2, 1))
