"""Public API: dispatch by format name, options, clear errors, requantization routes, metrics, devices."""

import math

import pytest
import torch

import musecore_quant
from musecore_quant import QTensor, QuantError, dequantize, fake_quantize_activation, quant_error, quantize, requantize
from musecore_quant import concat_qtensors, stack_qtensors
from musecore_quant.formats import (fp8_quantize, int4_quantize, mxfp4_dequantize, mxfp4_quantize, nvfp4_input_scale,
                                    nvfp4_quantize)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # fixed data; the assertions hold for any seed, a failure must reproduce


ALL_FORMAT_OPTIONS = [("nvfp4", {}), ("nvfp4", {"rounding": "away"}), ("mxfp4", {}),
                      ("mxfp4", {"scale_mode": "floor"}),
                      ("mxfp4", {"scale_mode": "ceil", "rounding": "away"}),
                      ("int4", {}), ("int4", {"group_size": 32, "sym": False}),
                      ("fp8", {}), ("fp8", {"block_size": 128})]


def _same_qtensor(a: QTensor, b: QTensor) -> bool:
    fields = ("data", "scale", "global_scale", "zero")
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    return (a.format, a.shape, a.group_size) == (b.format, b.shape, b.group_size) and all(
        (getattr(a, f) is None) == (getattr(b, f) is None)
        and (getattr(a, f) is None or torch.equal(bits(getattr(a, f)), bits(getattr(b, f)))) for f in fields)


def test_package_exports_the_public_names():
    for name in ("quantize", "dequantize", "requantize", "fake_quantize_activation", "QTensor", "stack_qtensors",
                 "QuantError", "quant_error", "FORMATS"):
        assert hasattr(musecore_quant, name), name


@pytest.mark.parametrize("fmt,opts", ALL_FORMAT_OPTIONS)
def test_quantize_dispatches_to_the_format_and_dequantize_gives_fp32(fmt, opts):
    w = torch.randn(32, 256, dtype=torch.bfloat16)
    qt = quantize(w, fmt, **opts)
    assert qt.format == fmt and qt.shape == (32, 256)
    w_hat = dequantize(qt)
    assert w_hat.dtype == torch.float32 and dequantize(qt, dtype=torch.bfloat16).dtype == torch.bfloat16
    err = quant_error(w.float(), w_hat)
    assert err.sqnr_db > 15, f"{fmt} {opts}: {err}"


@pytest.mark.parametrize("fmt,opts", ALL_FORMAT_OPTIONS)
def test_quantizing_stacked_experts_equals_stacking_each_expert(fmt, opts):
    experts = torch.randn(3, 16, 256) * torch.tensor([1.0, 30.0, 0.01]).view(3, 1, 1)
    stacked = quantize(experts, fmt, **opts)
    one_by_one = stack_qtensors([quantize(experts[e], fmt, **opts) for e in range(3)])
    assert _same_qtensor(stacked, one_by_one)
    assert torch.equal(dequantize(stacked), dequantize(one_by_one))


@pytest.mark.parametrize("fmt,opts", [("mxfp4", {}), ("int4", {"group_size": 128, "sym": True}),
                                      ("int4", {"group_size": 64, "sym": False})])
def test_concatenating_row_scaled_qtensors_keeps_every_row(fmt, opts):
    """Rows of differently scaled tensors side by side: the concatenation dequantizes to the parts'
    dequantizations stacked (codes and scales untouched)."""
    parts = [quantize(torch.randn(n, 256) * scale, fmt, **opts) for n, scale in ((32, 1.0), (8, 40.0), (16, 0.01))]
    cat = concat_qtensors(parts)
    assert cat.shape == (56, 256) and cat.format == fmt
    assert torch.equal(dequantize(cat), torch.cat([dequantize(p) for p in parts]))


def test_concatenation_refuses_what_it_would_have_to_requantize():
    with pytest.raises(ValueError, match="nvfp4 QTensors without requantizing"):
        concat_qtensors([quantize(torch.randn(16, 128), "nvfp4"), quantize(torch.randn(16, 128), "nvfp4")])
    with pytest.raises(ValueError, match="in_features and zero points must match"):
        concat_qtensors([quantize(torch.randn(16, 128), "int4", group_size=64),
                         quantize(torch.randn(16, 256), "int4", group_size=64)])


def test_direct_functions_and_the_api_agree():
    w = torch.randn(16, 128)
    assert _same_qtensor(quantize(w, "nvfp4"), nvfp4_quantize(w))
    assert _same_qtensor(quantize(w, "mxfp4", scale_mode="ceil"), mxfp4_quantize(w, "ceil"))
    assert _same_qtensor(quantize(w, "int4", group_size=64), int4_quantize(w, 64))
    assert _same_qtensor(quantize(w, "fp8", block_size=128), fp8_quantize(w, 128))


def test_unknown_format_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown quantized format 'int2'; valid formats: nvfp4, mxfp4, int4, fp8, int8"):
        quantize(torch.randn(4, 32), "int2")


def test_unknown_option_names_the_options_the_format_offers():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['group_size'\].*valid options: global_amax, rounding"):
        quantize(torch.randn(4, 32), "nvfp4", group_size=32)


@pytest.mark.parametrize("fmt,opts,message", [
    ("nvfp4", {},
     r"NVFP4 needs in_features divisible by 16; got 100 \(shape \[8, 100\]\)\. Exclude this layer \(--exclude\)\."),
    ("mxfp4", {}, r"MXFP4 needs in_features divisible by 32; got 100 .*Exclude this layer \(--exclude\)"),
    ("int4", {"group_size": 64}, r"INT4 needs in_features divisible by 64 \(the group size\); got 100 .*--exclude"),
])
def test_a_dim_the_block_does_not_divide_says_to_exclude_the_layer(fmt, opts, message):
    with pytest.raises(ValueError, match=message):
        quantize(torch.randn(8, 100), fmt, **opts)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4", "fp8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_in_a_weight_is_an_error(fmt, bad):
    w = torch.randn(4, 128)
    w[2, 7] = bad
    with pytest.raises(ValueError, match=r"NaN/Inf value\(s\), the first at index \[2, 7\]"):
        quantize(w, fmt)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "int4", "fp8", "int8"])
def test_an_empty_weight_is_an_error_naming_its_shape(fmt):
    with pytest.raises(ValueError, match=r"got an empty weight \(shape \[0, 128\]\)"):
        quantize(torch.empty(0, 128), fmt)


def test_a_one_dimensional_or_integer_weight_is_an_error():
    with pytest.raises(ValueError, match=r"\[..., out_features, in_features\]"):
        quantize(torch.randn(64), "nvfp4")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.ones(4, 32, dtype=torch.int32), "mxfp4")


def test_requantize_nvfp4_to_mxfp4_uses_even_scales_and_drops_input_scale():
    w = torch.randn(8, 64)
    nv = nvfp4_quantize(w)
    nv.input_scale = nvfp4_input_scale(3.0)
    mx = requantize(nv, "mxfp4")
    assert mx.input_scale is None
    assert torch.equal(mx.data, mxfp4_quantize(dequantize(nv), "even").data)
    floor = requantize(nv, "mxfp4", scale_mode="floor", rounding="away")
    assert torch.equal(floor.scale, mxfp4_quantize(dequantize(nv), "floor", "away").scale)


def test_requantize_mxfp4_to_nvfp4_is_exact_by_default():
    mx = mxfp4_quantize(torch.randn(2, 16, 128) * 100)
    nv = requantize(mx, "nvfp4")
    assert torch.equal(dequantize(nv), mxfp4_dequantize(mx)) and torch.equal(nv.data, mx.data)


def test_requantize_mxfp4_to_nvfp4_with_modelopt_options_takes_the_plain_rule():
    mx = mxfp4_quantize(torch.randn(4, 64))
    nv = requantize(mx, "nvfp4", rounding="rne")
    assert _same_qtensor(nv, nvfp4_quantize(mxfp4_dequantize(mx)))
    with pytest.raises(ValueError, match="weight_scale_2 is an option of the exact"):
        requantize(mx, "nvfp4", weight_scale_2=1.0, rounding="rne")


def test_requantize_within_a_format_keeps_nvfp4_input_scale_and_changes_int4_groups():
    nv = nvfp4_quantize(torch.randn(4, 64))
    nv.input_scale = torch.tensor(0.01)
    assert requantize(nv, "nvfp4").input_scale is nv.input_scale
    regrouped = requantize(int4_quantize(torch.randn(4, 256), 128), "int4", group_size=32)
    assert regrouped.group_size == 32 and regrouped.scale.shape == (4, 8)


def test_requantize_to_int4_and_fp8_goes_through_fp32():
    nv = nvfp4_quantize(torch.randn(16, 128))
    for fmt in ("int4", "fp8"):
        out = requantize(nv, fmt)
        assert _same_qtensor(out, quantize(dequantize(nv), fmt))


def test_fake_quantize_activation_dispatches_and_checks_its_inputs():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    scale = nvfp4_input_scale(x.float().abs().max())
    assert fake_quantize_activation(x, "nvfp4", input_scale=scale).dtype == torch.bfloat16
    assert fake_quantize_activation(x, "mxfp4", scale_mode="floor").shape == x.shape
    assert fake_quantize_activation(x, "fp8").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="needs input_scale"):
        fake_quantize_activation(x, "nvfp4")
    with pytest.raises(ValueError, match="must be None"):
        fake_quantize_activation(x, "mxfp4", input_scale=scale)
    with pytest.raises(ValueError, match="weight-only"):
        fake_quantize_activation(x, "int4")
    with pytest.raises(ValueError, match="unknown option"):
        fake_quantize_activation(x, "mxfp4", group_size=32)


def test_dequantize_refuses_a_backend_layout():
    qt = nvfp4_quantize(torch.randn(4, 32))
    qt.layout = "cutlass-swizzled"
    with pytest.raises(ValueError, match="backend layout 'cutlass-swizzled'"):
        dequantize(qt)


def test_quant_error_reports_sqnr_nmse_rmse_and_max():
    reference = torch.tensor([3.0, 4.0])
    err = quant_error(reference, torch.tensor([3.0, 3.0]))
    assert isinstance(err, QuantError)
    assert err.max_abs_error == 1.0 and err.rmse == math.sqrt(0.5)
    assert err.nmse == pytest.approx(1 / 25) and err.sqnr_db == pytest.approx(10 * math.log10(25))
    assert "SQNR 13.98 dB" in str(err)
    exact = quant_error(reference, reference.clone())
    assert exact.sqnr_db == math.inf and exact.nmse == 0.0
    with pytest.raises(ValueError, match="one shape"):
        quant_error(reference, torch.zeros(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
@pytest.mark.parametrize("fmt,opts", ALL_FORMAT_OPTIONS)
def test_cuda_gives_the_same_bytes_as_cpu(fmt, opts):
    w = torch.randn(4, 64, 512) * torch.logspace(-4, 4, 64).view(1, 64, 1)
    on_cpu = quantize(w, fmt, **opts)
    on_gpu = quantize(w.cuda(), fmt, **opts)
    assert on_gpu.data.is_cuda
    assert _same_qtensor(on_cpu, on_gpu.to("cpu"))
    assert torch.equal(dequantize(on_gpu).cpu(), dequantize(on_cpu))
    if fmt in ("nvfp4", "mxfp4"):
        requantized = requantize(on_gpu, "mxfp4" if fmt == "nvfp4" else "nvfp4")
        assert _same_qtensor(requantized.to("cpu"), requantize(on_cpu, requantized.format))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
def test_cuda_activation_fake_quant_matches_cpu():
    x = torch.randn(8, 256, dtype=torch.bfloat16) * 3
    scale = nvfp4_input_scale(2.0)
    for fmt, kwargs in (("nvfp4", {"input_scale": scale}), ("mxfp4", {}), ("fp8", {}), ("fp8", {"input_scale": 0.01})):
        on_cpu = fake_quantize_activation(x, fmt, **kwargs)
        gpu_kwargs = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        on_gpu = fake_quantize_activation(x.cuda(), fmt, **gpu_kwargs)
        assert torch.equal(on_gpu.cpu(), on_cpu), f"{fmt}: max difference {(on_gpu.cpu() - on_cpu).abs().max()}"


@pytest.mark.parametrize("fmt,opts", ALL_FORMAT_OPTIONS + [("fp8", {"block_size": 4})])
def test_chunked_encoding_gives_the_same_bytes_as_one_pass(fmt, opts, monkeypatch):
    from musecore_quant.formats import _common
    w = torch.randn(2, 40, 256) * torch.logspace(-2, 2, 40).view(1, 40, 1)
    one_pass = quantize(w, fmt, **opts)
    monkeypatch.setattr(_common, "CHUNK_ELEMENTS", 700)          # a few rows (or 4-row blocks) per pass
    assert _same_qtensor(quantize(w, fmt, **opts), one_pass)
