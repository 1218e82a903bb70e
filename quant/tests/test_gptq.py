"""GPTQ (musecore_quant.gptq): lower output error than RTN where inputs correlate, the format's own
codec and bytes, RTN exactly when the Hessian is diagonal, one clear error for bad input."""

import pytest
import torch

from musecore_quant import dequantize, quantize
from musecore_quant.formats.int4 import int4_from_gptq, int4_to_gptq
from musecore_quant.gptq import gptq_quantize, input_hessian


def correlated_inputs(n: int, k: int, seed: int) -> torch.Tensor:
    """Rows with a rank-16 structure plus 30% isotropic noise: the correlated inputs GPTQ exploits."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(16, k, generator=gen)
    return torch.randn(n, 16, generator=gen) @ mix + 0.3 * torch.randn(n, k, generator=gen)


def output_nmse(x: torch.Tensor, w: torch.Tensor, approx: torch.Tensor) -> float:
    return float(((x @ (approx - w).T) ** 2).sum() / ((x @ w.T) ** 2).sum())


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_on_unseen_correlated_inputs_is_under_half_of_rtns(fmt, act_order):
    w = 0.05 * torch.randn(96, 256, generator=torch.Generator().manual_seed(1))
    rows = correlated_inputs(3072, 256, seed=2)
    calib, unseen = rows[:2048], rows[2048:]  # the same distribution; GPTQ never sees the last 1024 rows
    qt, stats = gptq_quantize(w, input_hessian(calib), fmt, act_order=act_order)
    gptq_err = output_nmse(unseen, w, dequantize(qt))
    rtn_err = output_nmse(unseen, w, dequantize(quantize(w, fmt)))
    # measured 0.05-0.08x RTN's on these inputs; the margin asked for is 0.5x
    assert gptq_err < 0.5 * rtn_err, f"{fmt} act_order={act_order}: GPTQ output NMSE {gptq_err:.3e}, RTN {rtn_err:.3e}"
    assert stats.output_error < stats.rtn_output_error and stats.reduction > 0.5, stats


def test_gptq_int4_codes_are_the_int4_codec_and_survive_the_gptq_export_round_trip():
    w = 0.05 * torch.randn(64, 256, generator=torch.Generator().manual_seed(3))
    qt, _ = gptq_quantize(w, input_hessian(correlated_inputs(512, 256, seed=4)), "int4", act_order=True)
    ref = quantize(w, "int4")
    assert (qt.format, qt.shape, qt.group_size, qt.zero, qt.data.dtype, qt.scale.dtype) == \
           (ref.format, ref.shape, ref.group_size, ref.zero, ref.data.dtype, ref.scale.dtype)
    assert qt.data.shape == ref.data.shape and qt.scale.shape == ref.scale.shape
    steps = dequantize(qt) / qt.scale.float().repeat_interleave(128, -1)   # every value a whole grid step
    assert torch.equal(steps, steps.round()) and steps.min() >= -8 and steps.max() <= 7
    back = int4_from_gptq(**int4_to_gptq(qt))
    assert torch.equal(dequantize(back), dequantize(qt)), "GPTQ v1 export and import change the values"


def test_gptq_mxfp4_values_are_what_quarks_even_rule_encodes_back_to():
    w = 0.05 * torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    qt, _ = gptq_quantize(w, input_hessian(correlated_inputs(512, 128, seed=6)), "mxfp4")
    values = dequantize(qt)
    again = quantize(values, "mxfp4")  # on-grid values: the producer rule reproduces them exactly
    assert qt.format == "mxfp4" and qt.scale.dtype == torch.uint8 and torch.equal(dequantize(again), values)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_gptq_with_a_diagonal_hessian_is_round_to_nearest_byte_for_byte(fmt):
    w = 0.05 * torch.randn(32, 256, generator=torch.Generator().manual_seed(7))
    h = torch.diag(torch.rand(256, generator=torch.Generator().manual_seed(8)) + 0.5).double()
    qt, stats = gptq_quantize(w, h, fmt)  # no correlation: no error is moved, every column rounds to nearest
    ref = quantize(w, fmt)
    assert torch.equal(qt.data, ref.data) and torch.equal(qt.scale, ref.scale), \
        f"{int((qt.data != ref.data).sum())} code bytes differ from RTN"
    assert stats.output_error == pytest.approx(stats.rtn_output_error, rel=1e-9)


def test_inputs_that_never_fire_leave_no_nan_and_are_counted():
    w = 0.05 * torch.randn(16, 128, generator=torch.Generator().manual_seed(9))
    x = correlated_inputs(256, 128, seed=10)
    x[:, :7] = 0
    qt, stats = gptq_quantize(w, input_hessian(x), "int4", act_order=True)
    assert stats.dead_columns == 7 and torch.isfinite(dequantize(qt)).all()


@pytest.mark.parametrize("args, kwargs, match", [
    ((torch.randn(8, 128), torch.eye(64)), {}, r"Hessian must be \[in, in\] = \[128, 128\]"),
    ((torch.randn(2, 8, 128), torch.eye(128)), {}, r"one floating-point weight \[out, in\]"),
    ((torch.randn(8, 96), torch.eye(96)), {}, r"in_features 96 must be divisible by the group size 128"),
    ((torch.randn(8, 128), torch.eye(128)), {"fmt": "nvfp4"}, r"GPTQ writes \('int4', 'mxfp4'\)"),
    ((torch.randn(8, 128), torch.eye(128)), {"damp": 0.0}, r"damp must be > 0"),
    ((torch.randn(8, 128), torch.full((128, 128), float("nan"))), {}, r"Hessian holds NaN"),
    ((torch.randn(8, 128), torch.eye(128)), {"scale_mode": "best"}, r"scale_mode must be one of"),
])
def test_bad_gptq_input_is_one_clear_error(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        gptq_quantize(*args, **kwargs)


def test_a_hessian_that_is_not_positive_definite_says_raise_damp():
    h = -torch.eye(128, dtype=torch.float64)
    h[0, 0] = 1.0
    with pytest.raises(ValueError, match="raise damp"):
        gptq_quantize(torch.randn(8, 128), h)
    with pytest.raises(ValueError, match="non-empty tensor"):
        input_hessian(torch.randn(5))
