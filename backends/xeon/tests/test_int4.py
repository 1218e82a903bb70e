"""INT4 linear against the reference dequantized matmul, on both sides of the crossover M."""

from __future__ import annotations

import time

import pytest
import torch

import musecore_quant
from musecore.testing import assert_nmse
from musecore.backends.reference import ReferenceBackend
from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore_quant.qtensor import QTensor
from musecore_xeon import XeonBackend
from musecore_xeon.kernels import native
from musecore_xeon.kernels.crossover import INT4_CROSSOVER_ENV, measure_crossover, pick_crossover
from musecore_xeon.kernels.int4 import Int4Linear, int4_crossover, int4pack_block_n, prepare_int4

SHAPES = [(256, 512), (512, 256), (128, 1024), (96, 256), (4, 128)]  # (out, in); 96 and 4 rows are padded


def random_int4(out_features: int, in_features: int, group_size: int = 128, *, negative_scales: bool,
                asymmetric: bool) -> QTensor:
    """A canonical INT4 QTensor with random codes, scales of both signs and (optionally) random zeros."""
    g = torch.Generator().manual_seed(out_features * 7 + in_features)
    data = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=g)
    scale = torch.rand(out_features, in_features // group_size, generator=g) * 0.02 + 0.001
    if negative_scales:
        scale = scale * torch.where(torch.rand(scale.shape, generator=g) < 0.5, -1.0, 1.0)
    zero = torch.randint(0, 16, scale.shape, dtype=torch.uint8, generator=g) if asymmetric else None
    return QTensor("int4", data, scale.half(), (out_features, in_features), group_size, zero=zero)


def reference_linear(x: torch.Tensor, qt: QTensor) -> torch.Tensor:
    return ref.linear(x.float(), ReferenceBackend().prepare_weight(qt, "linear", dtype=torch.float32))


def both_paths(lin: Int4Linear, crossover: int) -> Int4Linear:
    lin.crossover = crossover
    return lin


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("negative_scales,asymmetric", [(False, False), (True, False), (True, True), (False, True)])
def test_int4_linear_matches_reference_on_both_sides_of_crossover(shape, negative_scales, asymmetric) -> None:
    qt = random_int4(*shape, negative_scales=negative_scales, asymmetric=asymmetric)
    lin = both_paths(prepare_int4(qt, torch.float32, calibrate=False), crossover=8)
    for m in (1, 3, 8, 33):
        x = torch.randn(m, shape[1], dtype=torch.bfloat16)
        path = "dense tiles" if lin.uses_dense_tiles(m) else "int4 kernel"
        assert path == ("dense tiles" if m >= 8 else "int4 kernel")
        assert_nmse(reference_linear(x, qt), lin(x).float(), tolerance("linear"),
                          f"int4 {shape} neg={negative_scales} asym={asymmetric} M={m} ({path})")


def test_quantizer_output_with_negative_scales_runs_through_the_backend(xeon: XeonBackend) -> None:
    w = torch.randn(512, 1024)
    for sym in (True, False):
        qt = musecore_quant.quantize(w, "int4", group_size=128, sym=sym)
        if sym:
            assert (qt.scale < 0).any(), "AutoRound full-range symmetric RTN should give negative scales"
        weight = xeon.prepare_weight(qt, "linear")
        for m in (1, 300):
            x = torch.randn(2, (m + 1) // 2, 1024, dtype=torch.bfloat16)  # leading dims are kept
            y = xeon.linear(x, weight)
            assert y.dtype == x.dtype and y.shape == (2, (m + 1) // 2, 512)
            assert_nmse(reference_linear(x, qt), y.float(), tolerance("linear"), f"quantize(sym={sym}) M={m}")


def test_dense_tile_dequantization_equals_the_quantizer_dequantization() -> None:
    qt = random_int4(256, 512, negative_scales=True, asymmetric=True)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    # Scales travel as bf16 for the kernel, so the match is to bf16 precision, not bit-exact.
    assert_nmse(musecore_quant.dequantize(qt), lin.dequantize(), 1e-5, "tile dequant vs dequantize")


def test_packing_block_is_detected() -> None:
    assert int4pack_block_n() in (16, 32, 64)


def test_crossover_is_measured_and_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INT4_CROSSOVER_ENV, raising=False)
    first = int4_crossover(256, 128, 128, torch.float32)
    print(first.table())
    assert first.source == "measured" and len(first.ms) == len(first.small_m_us) == len(first.dense_us) > 0
    assert first.crossover is None or first.crossover in first.ms
    assert int4_crossover(256, 128, 128, torch.float32) is first


def test_crossover_environment_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INT4_CROSSOVER_ENV, "48")
    assert int4_crossover(256, 128, 128, torch.float32).crossover == 48
    monkeypatch.setenv(INT4_CROSSOVER_ENV, "none")
    assert int4_crossover(256, 128, 128, torch.float32).crossover is None
    monkeypatch.setenv(INT4_CROSSOVER_ENV, "soon")
    with pytest.raises(ValueError, match=INT4_CROSSOVER_ENV):
        int4_crossover(256, 128, 128, torch.float32)


def test_pick_crossover_needs_a_win_at_every_larger_m() -> None:
    ms = (1, 2, 4, 8)
    assert pick_crossover(ms, (1, 1, 5, 5), (2, 2, 4, 4)) == 4
    assert pick_crossover(ms, (1, 5, 1, 5), (2, 4, 2, 4)) == 8   # an isolated early win does not count
    assert pick_crossover(ms, (1, 1, 1, 1), (2, 2, 2, 2)) is None


def test_calibration_scans_down_from_the_largest_m_and_stops_at_the_first_kernel_win() -> None:
    """Synthetic paths: the 'kernel' costs 40 us per row, the 'dense' path a flat 2 ms."""
    small = lambda x: time.sleep(40e-6 * x.shape[0])  # noqa: E731
    dense = lambda x: time.sleep(2e-3)  # noqa: E731
    calibration = measure_crossover("synthetic", 8, 8, small, dense, torch.float32)
    print(calibration.table())
    assert calibration.crossover == 64
    assert calibration.ms == (32, 64, 128, 256)  # 1..16 never timed: the scan stopped at 32


def test_unsupported_int4_shapes_and_formats_raise_with_advice(xeon: XeonBackend) -> None:
    with pytest.raises(ValueError, match="group size 16"):
        prepare_int4(random_int4(128, 256, 16, negative_scales=False, asymmetric=False), torch.float32)
    with pytest.raises(ValueError, match="convert to INT4 at load"):
        xeon.prepare_weight(musecore_quant.quantize(torch.randn(64, 64), "nvfp4"), "linear")
    with pytest.raises(ValueError, match="weight-only"):
        xeon.prepare_weight(random_int4(128, 256, negative_scales=False, asymmetric=False), "linear",
                            act_format="nvfp4")


@pytest.fixture(params=["native", "torch-ops"])
def dequantizer(request, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both tile dequantizers: the one-pass C loop (skipped without a compiler) and PyTorch ops."""
    if request.param == "native" and not native.available():
        pytest.skip("no C compiler: the native dequantizer is not built")
    if request.param == "torch-ops":
        monkeypatch.setattr(native, "available", lambda: False)
    return request.param


@pytest.mark.parametrize("shape", SHAPES + [(64, 384), (130, 96)])  # K/2 not a multiple of the group
@pytest.mark.parametrize("group_size", [32, 128])
def test_dense_copy_dequantizes_exactly_like_the_int4pack_path(shape, group_size, dequantizer) -> None:
    """The dense path's split-K copy + fp32 scale/offset gives bit-identical weights to unpacking the
    kernel's own packing with its bf16 scales/zeros (negative scales, asymmetric zeros, padded rows)."""
    if shape[1] % group_size:
        pytest.skip("in_features not a multiple of the group size")
    for negative_scales, asymmetric in [(True, True), (True, False), (False, True)]:
        qt = random_int4(*shape, group_size, negative_scales=negative_scales, asymmetric=asymmetric)
        lin = prepare_int4(qt, torch.float32, calibrate=False)
        assert lin.dense_codes is not None and lin.dense_nbytes > 0
        from_copy, from_int4pack = lin.dequantize(), lin.dequantize_int4pack()
        assert from_copy.shape == from_int4pack.shape == shape
        assert torch.equal(from_copy, from_int4pack), f"{shape} g={group_size} neg={negative_scales} asym={asymmetric}"
        # the copy rebuilt from the packing (after being dropped) is the same copy
        codes = lin.dense_codes.clone()
        lin.drop_dense_copy()
        lin.keep_dense_copy()
        assert torch.equal(lin.dense_codes, codes)


def test_dense_copy_is_kept_only_when_the_dense_path_can_run() -> None:
    qt = random_int4(256, 512, negative_scales=True, asymmetric=False)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    lin.set_crossover(None)
    assert lin.dense_codes is None and lin.dense_nbytes == 0
    lin.set_crossover(32)
    assert lin.dense_codes is not None and lin.dense_nbytes >= 256 * 512 // 2


@pytest.mark.parametrize("shape", [(256, 512), (96, 384), (600, 4096)])  # 600 x 4096: two tiles, the second partial
def test_dense_tiles_match_the_kernel_with_either_dequantizer(shape, dequantizer) -> None:
    qt = random_int4(*shape, 32, negative_scales=True, asymmetric=True)
    lin = both_paths(prepare_int4(qt, torch.float32, calibrate=False), crossover=1)
    for m in (1, 5, 64):
        x = torch.randn(m, shape[1], dtype=torch.bfloat16)
        assert_nmse(lin.run_kernel(x).float(), lin(x).float(), 1e-5, f"{shape} M={m} {dequantizer}")
        assert_nmse(reference_linear(x, qt), lin(x).float(), tolerance("linear"), f"{shape} M={m} {dequantizer}")
