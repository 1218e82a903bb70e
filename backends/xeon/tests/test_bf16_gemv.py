"""The native BF16 weight GEMV (native_bf16_source.py) against an fp64 reference, and its use in DenseLinear."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore.testing import assert_nmse
from musecore_xeon.kernels import native
from musecore_xeon.kernels.crossover import BF16_GEMV_CROSSOVER_ENV
from musecore_xeon.kernels.dense import BF16_GEMV_CALIBRATION_MS, bf16_gemv_crossover, prepare_dense

needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler: the native kernels are not built")

# (N, K): K below, at and above one 16-column chunk, tails of 1..15 columns, N not a multiple of the 4-row block
SHAPES = [(1, 16), (3, 17), (37, 83), (64, 512), (5, 1031), (130, 2048 + 7)]
UNIT = 2.0 ** -24  # fp32 unit roundoff


def fp64_bound(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact product of the bf16 weight and the activation as given, and a bound on fp32 accumulation error:
    every term passes at most K/16 lane additions, 3 reduction levels and the K % 16 tail additions."""
    k = w.shape[1]
    exact = x.double() @ w.double().T
    depth = k // 16 + 4 + k % 16
    return exact, depth * UNIT * (x.double().abs() @ w.double().abs().T)


@needs_native
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_bf16_gemv_matches_the_fp64_product_within_the_fp32_accumulation_bound(shape, m, act_dtype) -> None:
    n, k = shape
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    x = torch.randn(m, k).to(act_dtype)
    y = native.Bf16Gemv(w)(x)
    assert y.dtype == act_dtype and y.shape == (m, n)
    exact, bound = fp64_bound(w, x)
    if act_dtype == torch.bfloat16:  # plus the one rounding of the output to bf16 (half an ulp: 2^-9 relative)
        bound = bound * (1 + 2.0 ** -8) + exact.abs() * 2.0 ** -8
    err = (y.double() - exact).abs()
    ratio = (err / bound.clamp_min(1e-300)).max().item()
    nmse = (err.pow(2).sum() / exact.pow(2).sum().clamp_min(1e-300)).item()
    print(f"{shape} M={m} {act_dtype}: max err / bound {ratio:.3g}, NMSE vs fp64 {nmse:.3g}")
    assert ratio <= 1.0, f"{shape} M={m} {act_dtype}: error {ratio:.3g}x the fp32 accumulation bound (NMSE {nmse:.3g})"
    assert nmse <= (1e-12 if act_dtype == torch.float32 else 1e-5), f"{shape} M={m} {act_dtype}: NMSE {nmse:.3g}"


@needs_native
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16])
def test_bf16_dense_linear_matches_the_reference_linear(xeon, reference, act_dtype) -> None:
    w = torch.randn(300, 777) * 0.05
    mine, theirs = xeon.prepare_weight(w, "linear"), reference.prepare_weight(w, "linear")
    lin = mine.extra["linear"]
    for m in (1, 2, 7):
        assert lin.path(m) == "native"
        x = torch.randn(m, 777).to(act_dtype)
        assert_nmse(ref.linear(x, theirs).float(), xeon.linear(x, mine).float(), tolerance("linear"),
                    f"{act_dtype} M={m} native")


@needs_native
@pytest.mark.parametrize("shape", [(37, 83), (64, 512), (9, 2048 + 7)])
def test_portable_c_path_gives_the_same_bits_as_avx2(shape) -> None:
    portable = native.load_portable()
    if portable is None:
        pytest.skip("no C compiler for the portable build")
    n, k = shape
    w = torch.randn(n, k).to(torch.bfloat16)
    for m in (1, 2, 3):
        for act_dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(act_dtype)
            fast, scalar = native.bf16_gemv(w, x), native.bf16_gemv_with(portable, w, x)
            diff = (fast.double() - scalar.double()).abs().max().item()
            assert torch.equal(fast, scalar), f"{shape} M={m} {act_dtype}: AVX2 and portable differ by {diff:.3g}"


@needs_native
def test_bf16_gemv_bits_depend_on_neither_m_nor_the_thread_count() -> None:
    """Every (row, activation row) is summed in one fixed order, whatever block or thread computes it."""
    w = torch.randn(203, 1000 + 9).to(torch.bfloat16)  # 203 x 1009 x 2 bytes: above the 32 KiB threading threshold
    x = torch.randn(5, 1009)
    alone = torch.cat([native.bf16_gemv(w, x[i:i + 1], threads=1) for i in range(5)])
    for m in (2, 3, 5):
        for threads in (1, 2):
            assert torch.equal(native.bf16_gemv(w, x[:m], threads=threads), alone[:m]), f"M={m} threads={threads}"


@needs_native
def test_bf16_gemv_rejects_what_it_cannot_take() -> None:
    with pytest.raises(ValueError, match="contiguous bf16"):
        native.Bf16Gemv(torch.randn(8, 16))  # an fp32 weight
    gemv = native.Bf16Gemv(torch.randn(8, 16).to(torch.bfloat16))
    for call in (gemv, gemv.call_ctypes):
        for x in (torch.randn(1, 16).half(), torch.randn(1, 15), torch.randn(16, 2).T):
            with pytest.raises(ValueError, match="contiguous bf16/fp32"):
                call(x)


@needs_native
def test_dense_linear_takes_the_gemv_below_its_crossover_then_f_linear_then_tiles(monkeypatch) -> None:
    lin = prepare_dense(torch.randn(96, 256), torch.bfloat16, native_bf16_dot=False)  # conftest: 16 and 64
    assert [lin.path(m) for m in (1, 15, 16, 63, 64)] == ["native", "native", "F.linear", "F.linear", "tiles"]
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)  # leading dims through the fast path
    assert torch.equal(lin(x), lin.run_gemv(x.reshape(6, 256)).reshape(2, 3, 96))
    monkeypatch.setenv(BF16_GEMV_CROSSOVER_ENV, "1")
    off = prepare_dense(torch.randn(96, 256), torch.bfloat16, native_bf16_dot=False)
    assert off.gemv is None and off.path(1) == "F.linear"
    monkeypatch.setenv(BF16_GEMV_CROSSOVER_ENV, "none")
    assert prepare_dense(torch.randn(96, 256), torch.bfloat16, native_bf16_dot=False).path(4096) == "native"
    fp32 = prepare_dense(torch.randn(96, 256), torch.float32, native_bf16_dot=False)
    assert fp32.gemv is None and fp32.path(1) == "F.linear"  # fp32 weights: PyTorch's SGEMV


@needs_native
def test_bf16_gemv_crossover_is_measured_and_never_extrapolated(monkeypatch) -> None:
    monkeypatch.delenv(BF16_GEMV_CROSSOVER_ENV, raising=False)
    calibration = bf16_gemv_crossover(512, 256, tiles_crossover=64)
    print(calibration.table())
    # the scan runs from the largest M down and stops at the first GEMV win (pick_crossover needs no more)
    assert calibration.source == "measured" and calibration.ms[-1] == max(BF16_GEMV_CALIBRATION_MS)
    assert calibration.crossover is not None and 1 <= calibration.crossover <= max(BF16_GEMV_CALIBRATION_MS) + 1


def test_without_the_native_kernels_bf16_weights_run_f_linear(monkeypatch) -> None:
    """The no-compiler case is announced by native.load (test_int4); DenseLinear then never binds the GEMV."""
    monkeypatch.setattr(native, "available", lambda: False)
    monkeypatch.delenv(BF16_GEMV_CROSSOVER_ENV, raising=False)
    lin = prepare_dense(torch.randn(40, 64), torch.bfloat16, native_bf16_dot=False)
    assert lin.gemv is None and lin.path(1) == "F.linear"
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    assert_nmse(x.float() @ lin.weight.float().T, lin(x).float(), tolerance("linear"), "F.linear fallback")


def test_the_missing_native_library_warning_names_the_bf16_fallback(no_c_compiler) -> None:
    with pytest.warns(RuntimeWarning, match="BF16 weights PyTorch's F.linear"):
        assert not native.available()
    lin = prepare_dense(torch.randn(40, 64), torch.bfloat16, native_bf16_dot=False)
    assert lin.gemv is None and lin.path(1) == "F.linear"
