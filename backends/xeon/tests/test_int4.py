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
from musecore_xeon.kernels.int4 import (Int4Linear, from_planar, int4_crossover, interleave_row_blocks,
                                        int4pack_block_n, prepare_int4, to_planar, uses_amx)

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


def test_pick_crossover_gives_a_tie_within_the_margin_to_the_dense_path() -> None:
    ms = (1, 2, 4, 8)
    assert pick_crossover(ms, (1, 1, 10, 10), (2, 2, 10.5, 10.5)) is None
    assert pick_crossover(ms, (1, 1, 10, 10), (2, 2, 10.5, 10.5), dense_margin=0.1) == 4
    assert pick_crossover(ms, (1, 1, 10, 10), (2, 2, 10.5, 11.5), dense_margin=0.1) is None  # 15% slower at M=8


def test_calibration_scans_down_from_the_largest_m_and_stops_at_the_first_kernel_win() -> None:
    """Synthetic paths: the 'kernel' costs 40 us per row, the 'dense' path a flat 2 ms."""
    small = lambda x: time.sleep(40e-6 * x.shape[0])  # noqa: E731
    dense = lambda x: time.sleep(2e-3)  # noqa: E731
    calibration = measure_crossover("synthetic", 8, 8, small, dense, torch.float32)
    print(calibration.table())
    assert calibration.crossover == 64
    assert calibration.ms == (32, 64, 128, 256)  # 1..16 never timed: the scan stopped at 32


def test_calibration_retimes_a_stalled_dense_path() -> None:
    """The dense path stalls (5 ms instead of 1 ms) for its first warm-up + 3 timed calls: the kernel
    (2 ms) seems to win at M=256, which would stop the scan and keep the kernel at every M. The close
    call is timed again, so the dense path still wins at the largest M."""
    dense, _ = stalling_path(stalled_calls=4, stalled_s=5e-3, then_s=1e-3)
    calibration = measure_crossover("synthetic", 8, 8, lambda x: time.sleep(2e-3), dense, torch.float32,
                                    ms=(128, 256))
    print(calibration.table())
    assert calibration.crossover == 128, calibration.table()


def stalling_path(stalled_calls: int, stalled_s: float, then_s: float):
    """A synthetic path that sleeps ``stalled_s`` for its first ``stalled_calls`` calls, then ``then_s``; and its call
    counter."""
    calls = {"n": 0}

    def path(x: torch.Tensor) -> None:
        calls["n"] += 1
        time.sleep(stalled_s if calls["n"] <= stalled_calls else then_s)

    return path, calls


def test_calibration_gives_a_close_call_more_alternating_rounds() -> None:
    """A close call (the paths within CLOSE_CALL_RATIO): the dense path is 18% slow for its first two timings (8
    calls: a burst of other work), then the faster of the two (2.0 ms against the kernel's 2.2 ms). Two rounds
    would keep the kernel; the extra alternating rounds find the dense path's real time."""
    dense, calls = stalling_path(stalled_calls=8, stalled_s=2.6e-3, then_s=2.0e-3)
    calibration = measure_crossover("synthetic", 8, 8, lambda x: time.sleep(2.2e-3), dense, torch.float32,
                                    ms=(128, 256))
    print(calibration.table())
    assert calls["n"] > 8 and calibration.crossover == 128, calibration.table()


def test_calibration_confirms_the_point_that_ends_the_scan() -> None:
    """The dense path stalls 10x (20 ms against the kernel's 2 ms, past RETIME_RATIO: no close call) for its first
    warm-up + 3 timed calls at M = 256: the kernel seems to win there, which would end the scan and keep the
    kernel at every M. The point that ends the scan is timed again in alternating rounds: the dense path wins."""
    dense, calls = stalling_path(stalled_calls=4, stalled_s=20e-3, then_s=1e-3)
    calibration = measure_crossover("synthetic", 8, 8, lambda x: time.sleep(2e-3), dense, torch.float32,
                                    ms=(128, 256))
    print(calibration.table())
    assert calls["n"] > 4 and calibration.crossover == 128, calibration.table()


def test_calibration_retimes_a_point_slower_than_the_larger_m_before_it() -> None:
    """The kernel (40 us per row) stalls 5x at M = 32 for its first warm-up + 3 calls there (10 ms: slower than its
    2.56 ms at M = 64, which fewer rows cannot be), so the dense path (flat 2 ms) seems to win at 32 by more than
    RETIME_RATIO and the crossover would drop to 32 (the dense path then taken at M = 32, 1.6x slower than the
    kernel). The point is timed again: the kernel wins at 32 and the crossover stays 64."""
    seen = {"n": 0}

    def small(x: torch.Tensor) -> None:
        if x.shape[0] == 32:
            seen["n"] += 1
            if seen["n"] <= 4:
                time.sleep(10e-3)
                return
        time.sleep(40e-6 * x.shape[0])

    calibration = measure_crossover("synthetic", 8, 8, small, lambda x: time.sleep(2e-3), torch.float32,
                                    ms=(16, 32, 64, 128))
    print(calibration.table())
    assert seen["n"] > 4 and calibration.crossover == 64, calibration.table()


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
    """Both tile dequantizers: the compiled C loop (skipped without a compiler) and PyTorch ops."""
    if request.param == "native" and not native.available():
        pytest.skip("no C compiler: the native kernels are not built")
    if request.param == "torch-ops":
        monkeypatch.setattr(native, "available", lambda: False)
    return request.param


def fp64_reference(x: torch.Tensor, qt: QTensor) -> torch.Tensor:
    """``x @ W.T`` in fp64 with ``W = (q - z) * scale`` straight from the QTensor."""
    return x.double() @ musecore_quant.dequantize(qt).double().T


def rel_err(want: torch.Tensor, got: torch.Tensor) -> float:
    return (((got.double() - want) ** 2).sum() / (want ** 2).sum().clamp_min(1e-300)).item()


needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler: the native INT4 kernels are not built")

# The native GEMV quantizes each activation group to int16 (sx = max|x_group| / 32767, xq = round(x / sx)) and
# sums xq * (q - z) exactly in int32; each activation is then off by at most half a step (0.5 sx, plus the fp32
# rounding of x * 32767/max: 0.51 sx), so per output |y - y_exact| <= sum_groups 0.51 sx sum_group |w|, plus fp32
# rounding of the per-group float terms (1e-6 sum |x w| covers them). Measured: |err| <= 0.23x this bound on these
# shapes; a wrong nibble, column or group order gives errors of the size of sum |x w| itself (~1e4x the bound).
INT16_STEP = 0.51
FP32_SLACK = 1e-6
# NMSE over all outputs of an M sweep: the rounding error is uniform in +-sx/2 (variance sx^2/12) and sx ~ 3 sigma /
# 32767 for Gaussian groups, ~7e-10 expected; measured 4-6e-10 (the fp32 kernel before it: ~1e-13). One element 100x
# the rest per group makes sx 100x larger for the others: ~7e-9 measured, bounded at 5e-8.
NATIVE_INT16_NMSE = 3e-9
NATIVE_INT16_NMSE_OUTLIERS = 5e-8


def int16_error_ratio(x: torch.Tensor, qt: QTensor, y: torch.Tensor) -> float:
    """max over outputs of |y - fp64 reference| / the int16-activation error bound above."""
    w = musecore_quant.dequantize(qt).double()  # [N, K]
    xd, g = x.double(), qt.group_size
    m, k = xd.shape
    sx = xd.abs().view(m, k // g, g).amax(-1) / 32767  # [M, K/g]
    bound = INT16_STEP * sx @ w.abs().view(w.shape[0], k // g, g).sum(-1).T + FP32_SLACK * (xd.abs() @ w.abs().T)
    err = (y.double() - fp64_reference(x, qt)).abs()
    return (err / bound.clamp_min(1e-300)).max().item()


def sweep_nmse(lin: Int4Linear, qt: QTensor, xs: list[torch.Tensor], what: str) -> float:
    """Runs every x, checks the per-output bound, returns the NMSE over all outputs of the sweep."""
    num = den = 0.0
    for x in xs:
        y = lin(x)
        assert y.dtype == x.dtype and y.shape == (x.shape[0], qt.shape[0])
        ratio = int16_error_ratio(x, qt, y)
        assert ratio <= 1.0, f"{what} M={x.shape[0]}: error {ratio:.3g}x the int16-activation bound"
        ref = fp64_reference(x, qt)
        num += ((y.double() - ref) ** 2).sum().item()
        den += (ref ** 2).sum().item()
    return num / max(den, 1e-300)


@needs_native
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("out_features", [1, 7, 37])  # odd, padded to a multiple of native.ROWS
def test_native_gemv_matches_the_fp64_reference_for_every_small_m(group_size, out_features) -> None:
    for negative_scales, asymmetric in [(True, True), (False, False), (True, False)]:
        qt = random_int4(out_features, 512, group_size, negative_scales=negative_scales, asymmetric=asymmetric)
        lin = prepare_int4(qt, torch.float32, calibrate=False)
        assert lin.kernel == "native" and lin.codes.shape[0] % native.ROWS == 0
        what = f"g={group_size} N={out_features} neg={negative_scales} asym={asymmetric}"
        err = sweep_nmse(lin, qt, [torch.randn(m, 512) for m in range(1, 17)], what)
        assert err <= NATIVE_INT16_NMSE, f"{what}: NMSE {err:.3e} > {NATIVE_INT16_NMSE:.0e}"


@needs_native
@pytest.mark.parametrize("group_size", [32, 128, 256])
def test_native_gemv_passes_over_many_rows(group_size) -> None:
    """Above 16 activation rows the GEMV runs passes of at most 16 rows over the weight (a remainder below 16 joins
    the last pass): every row's output is the one its rows alone give (the same bits), and within the int16 bound of
    the fp64 product, for M = 17 (one pass of 17), 32, 33, 47 (16 + 31), 70 (16 + 16 + 16 + 22)."""
    qt = random_int4(37, 512, group_size, negative_scales=True, asymmetric=True)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    for m in (17, 32, 33, 47, 70):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, 512).to(dtype)
            y = lin.run_small_m(x)
            alone = torch.cat([lin.run_small_m(x[i:i + 4]) for i in range(0, m, 4)])
            assert torch.equal(y, alone), f"g={group_size} M={m} {dtype}: rows differ from the same rows run alone " \
                                          f"by {(y.float() - alone.float()).abs().max():.3g}"
        err = sweep_nmse(lin, qt, [torch.randn(m, 512)], f"g={group_size} M={m}")
        assert err <= NATIVE_INT16_NMSE, f"g={group_size} M={m}: NMSE {err:.3e} > {NATIVE_INT16_NMSE:.0e}"


@needs_native
@pytest.mark.parametrize("group_size", [32, 128, 256])
def test_native_gemv_with_outliers_and_all_zero_groups(group_size) -> None:
    """One activation 100x the rest in every group, every other group all zero, and an all-zero row (-> exact 0)."""
    qt = random_int4(37, 1024, group_size, negative_scales=True, asymmetric=True)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    xs = []
    for m in (1, 2, 5, 16):
        x = torch.randn(m, 1024)
        x.view(m, -1, group_size)[:, :, 5] *= 100
        x.view(m, -1, group_size)[:, 1::2] = 0
        x[-1] = 0 if m > 1 else x[-1]
        xs.append(x)
    err = sweep_nmse(lin, qt, xs, f"outliers g={group_size}")
    assert err <= NATIVE_INT16_NMSE_OUTLIERS, f"g={group_size}: NMSE {err:.3e} > {NATIVE_INT16_NMSE_OUTLIERS:.0e}"
    assert torch.equal(lin(torch.zeros(3, 1024)), torch.zeros(3, 37))


@needs_native
def test_int16_bound_fails_on_a_wrong_nibble_order() -> None:
    """The bound is tight enough to catch a layout bug: codes written in the previous order (nibble j = column
    j*W + q, not the int16-pair order) must fail it by orders of magnitude."""
    qt = random_int4(36, 512, 128, negative_scales=True, asymmetric=False)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    x = torch.randn(3, 512)
    assert int16_error_ratio(x, qt, lin(x)) <= 1.0
    codes = from_planar(lin.codes, 128).view(36, 4, 8, 16)  # [N, chunk, column block p, q]
    wrong = (codes.to(torch.int64) << (4 * torch.arange(8)).view(8, 1)).sum(2)  # nibble p = column block p
    lin.codes.copy_(interleave_row_blocks(torch.where(wrong >= 2 ** 31, wrong - 2 ** 32, wrong).to(torch.int32).view(36, 64), 128))
    ratio = int16_error_ratio(x, qt, lin(x))
    assert ratio > 100, f"a wrong nibble order stayed within {ratio:.3g}x the bound: the test would miss it"


@needs_native
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_portable_c_path_gives_the_same_bits_as_avx2(group_size) -> None:
    """The ``#ifndef __AVX2__`` path (built without ISA flags) does the same integer sums and float operations,
    also for an odd group count (K = 384: the AVX2 GEMV flushes groups in pairs and the last one alone)."""
    portable = native.load_portable()
    if native.compile_flags() == [f for f in native.compile_flags() if not f.startswith("-m")]:
        pytest.skip("this CPU has no AVX2: the default build is already the portable path")
    for k in (512, 384):
        if k % max(group_size, 64):
            continue
        qt = random_int4(37, k, group_size, negative_scales=True, asymmetric=True)
        lin = prepare_int4(qt, torch.float32, calibrate=False)
        for m, dtype in ((1, torch.float32), (1, torch.bfloat16), (2, torch.float32), (2, torch.bfloat16), (5, torch.float32),
                         (16, torch.bfloat16)):
            x = torch.randn(m, k).to(dtype)
            x.view(m, -1, group_size)[:, 0, 3] *= 100
            y = torch.empty(m, 37, dtype=dtype)
            bf16 = int(dtype == torch.bfloat16)
            portable.musecore_int4_gemv(lin.codes.data_ptr(), lin.scale_zero.data_ptr(), x.data_ptr(), bf16,
                                        y.data_ptr(), bf16, m, k, group_size, lin.codes.shape[0], 37, 1)
            assert torch.equal(y, lin(x)), f"g={group_size} K={k} M={m} {dtype}: portable and AVX2 results differ"
            if dtype == torch.float32:
                ratio = int16_error_ratio(x, qt, y)
                assert ratio <= 1.0, f"g={group_size} K={k} M={m}: error {ratio:.3g}x the int16-activation bound"


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_dense_tiles_are_exact_and_the_same_in_every_build(group_size) -> None:
    """The tile dequantizer gives (q - z) * scale exactly (fp32 holds it), with its vector path (AVX2, one scale per
    chunk) and the portable loop alike."""
    qt = random_int4(36, 512, group_size, negative_scales=True, asymmetric=True)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    rows, k = lin.padded_out_features, 512
    fast = native.int4_dequant(lin.codes, lin.scale_zero, torch.empty(rows, k), group_size)
    portable = native.load_portable()
    slow = torch.empty(rows, k)
    portable.musecore_int4_dequant(lin.codes.data_ptr(), lin.scale_zero.data_ptr(), slow.data_ptr(), rows, k,
                                   group_size, 1)
    assert torch.equal(fast, slow), f"g={group_size}: vector and portable tiles differ by {(fast - slow).abs().max():.3g}"
    exact = reference_linear(torch.eye(k), qt).T  # rows of W as the reference dequantizes them, fp32
    assert torch.equal(fast[:36], exact), f"g={group_size}: tiles differ from the reference weight"


@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
def test_avx512_vnni_build_gives_the_same_bits_as_the_avx2_build(group_size) -> None:
    """Where the CPU has AVX-512 VNNI the default build reads 512 bits per load and accumulates with vpdpwssd
    (g >= 128 in the GEMVs, every g in the skinny GEMM, four activation rows at a time); its integer sums are the
    AVX2 build's, so the outputs are equal bit for bit: M = 1 (GEMV), 2 (two-row GEMV), 4, 5, 7 and 16 (skinny
    GEMM: whole blocks of four and the pairs left over), odd group counts included."""
    if native.compile_flags() == native.compile_flags("avx2"):
        pytest.skip("this CPU has no AVX-512 VNNI (avx512f/bw/vl/vnni): the default build is the AVX2 build")
    avx2 = native.load_variant("avx2")
    for n, k in ((37, 512), (64, 384), (8, 2048)):
        if k % max(group_size, 64):
            continue
        qt = random_int4(n, k, group_size, negative_scales=True, asymmetric=True)
        lin = prepare_int4(qt, torch.float32, calibrate=False)
        for m, dtype in ((1, torch.float32), (1, torch.bfloat16), (2, torch.float32), (4, torch.float32),
                         (5, torch.bfloat16), (7, torch.float32), (16, torch.float32)):
            x = torch.randn(m, k).to(dtype)
            x.view(m, -1, group_size)[:, 0, 3] *= 100
            y = torch.empty(m, n, dtype=dtype)
            bf16 = int(dtype == torch.bfloat16)
            avx2.musecore_int4_gemv(lin.codes.data_ptr(), lin.scale_zero.data_ptr(), x.data_ptr(), bf16,
                                    y.data_ptr(), bf16, m, k, group_size, lin.codes.shape[0], n, 1)
            fast = native.int4_gemv(lin.codes, lin.scale_zero, x, group_size, n)
            diff = (fast.float() - y.float()).abs().max().item()
            assert torch.equal(fast, y), f"g={group_size} {n}x{k} M={m} {dtype}: AVX-512 and AVX2 differ by {diff:.3g}"


@needs_native
def test_native_gemv_takes_bf16_activations_and_returns_bf16() -> None:
    qt = random_int4(64, 1024, 128, negative_scales=True, asymmetric=True)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    for m in (1, 2, 5):
        x = torch.randn(m, 1024, dtype=torch.bfloat16)
        y = lin(x)
        assert y.dtype == torch.bfloat16
        err = rel_err(fp64_reference(x, qt), y)
        assert err <= 1e-5, f"M={m}: NMSE {err:.3e} (bf16 output rounding, expected ~1e-6)"


@needs_native
def test_native_gemv_uses_several_threads_with_the_same_result() -> None:
    qt = random_int4(260, 512, 64, negative_scales=True, asymmetric=True)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    x = torch.randn(3, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(2)
        two = lin(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two), "row blocks are independent: the thread count must not change the result"


def test_planar_layout_round_trips_and_pairs_columns_2j_w_and_2j_plus_1_w_in_nibbles_j_and_j_plus_4() -> None:
    g = torch.Generator().manual_seed(1)
    for group_size in (32, 64, 128, 256):
        codes = torch.randint(0, 16, (8, 512), generator=g, dtype=torch.int32)
        planar = to_planar(codes, group_size)
        assert planar.dtype == torch.int32 and planar.shape == (8, 64)
        assert torch.equal(from_planar(planar, group_size), codes)
    # g = 128: 16 words per group, column 16 p + q in word q, nibble p/2 + 4 (p%2): nibbles j, j+4 = columns
    # 16 (2j) + q, 16 (2j+1) + q, the two int16 halves of the GEMV's madd
    codes = (torch.arange(128, dtype=torch.int32) // 16).view(1, 128).repeat(4, 1)  # column c: code c // 16 = p
    words = to_planar(codes, 128)
    assert words[0, 0].item() == 0x75316420


def test_row_blocks_are_interleaved_chunk_by_chunk() -> None:
    """Resident order: per block of ROWS rows, chunk c of row 0, of row 1, ..., then chunk c + 1 (one sequential
    stream per block); g = 64: 8 words per chunk."""
    rows = torch.arange(8, dtype=torch.int32).view(8, 1).expand(8, 256)  # row r has code r everywhere
    words = to_planar(rows, 64).view(2, 4, 4, 8)  # [block, chunk, row in block, word]
    expect = torch.arange(8, dtype=torch.int64).view(2, 1, 4, 1) * 0x11111111
    assert torch.equal(words.to(torch.int64), expect.expand(2, 4, 4, 8))


@pytest.mark.parametrize("shape", [(256, 512), (96, 256), (5, 128), (130, 192)])
@pytest.mark.parametrize("group_size", [32, 64])
def test_dense_tiles_dequantize_exactly_to_the_quantizer_weights(shape, group_size, dequantizer) -> None:
    """(q - z) * fp16 scale is exact in fp32: the tiles equal musecore_quant.dequantize bit for bit."""
    for negative_scales, asymmetric in [(True, True), (False, True)]:
        qt = random_int4(*shape, group_size, negative_scales=negative_scales, asymmetric=asymmetric)
        lin = prepare_int4(qt, torch.float32, calibrate=False)
        assert torch.equal(lin.dequantize(), musecore_quant.dequantize(qt).float()), \
            f"{shape} g={group_size} neg={negative_scales} asym={asymmetric} ({dequantizer})"


def test_one_copy_of_the_codes_with_the_native_kernel() -> None:
    if not native.available():
        pytest.skip("no C compiler: the native INT4 kernels are not built")
    qt = random_int4(256, 512, negative_scales=True, asymmetric=False)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    lin.set_crossover(32)
    assert lin.packed is None and lin.dense_nbytes == 0
    assert lin.nbytes == 256 * 512 // 2 + 256 * 4 * 4  # codes + fp16 (scale, zero) per group


def test_int4pack_kernel_on_request_keeps_the_planar_copy_only_when_tiles_can_run() -> None:
    qt = random_int4(96, 512, negative_scales=True, asymmetric=True)
    lin = prepare_int4(qt, torch.float32, calibrate=False, kernel="int4pack")
    assert lin.kernel == "int4pack" and lin.packed is not None
    codes = lin.codes.clone()
    lin.set_crossover(None)
    assert lin.codes is None and lin.dense_nbytes == 0
    lin.set_crossover(8)  # rebuilt from PyTorch's packing: the same planar codes
    assert torch.equal(lin.codes, codes)
    for m in (1, 3, 8, 20):
        x = torch.randn(m, 512, dtype=torch.bfloat16)
        assert_nmse(reference_linear(x, qt), lin(x).float(), tolerance("linear"), f"int4pack M={m}")
    with pytest.raises(ValueError, match="INT4 small-M kernel 'fast'"):
        prepare_int4(qt, torch.float32, calibrate=False, kernel="fast")


@pytest.mark.parametrize("shape", [(256, 512), (96, 384), (600, 4096)])  # 600 x 4096: two tiles, the second partial
def test_dense_tiles_match_the_small_m_kernel_with_either_dequantizer(shape, dequantizer) -> None:
    qt = random_int4(*shape, 32, negative_scales=True, asymmetric=True)
    lin = both_paths(prepare_int4(qt, torch.float32, calibrate=False), crossover=1)
    for m in (1, 5, 64):
        x = torch.randn(m, shape[1], dtype=torch.bfloat16)
        assert_nmse(lin.run_small_m(x).float(), lin(x).float(), 1e-5, f"{shape} M={m} {dequantizer}")
        assert_nmse(reference_linear(x, qt), lin(x).float(), tolerance("linear"), f"{shape} M={m} {dequantizer}")


def test_without_a_compiler_int4_falls_back_to_int4pack_with_a_warning(no_c_compiler) -> None:
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert not native.available()
    qt = random_int4(96, 512, negative_scales=True, asymmetric=True)
    lin = prepare_int4(qt, torch.float32, calibrate=False)
    assert lin.kernel == "int4pack"
    lin.set_crossover(16)
    for m in (1, 20):  # int4pack below, PyTorch-op tiles above
        x = torch.randn(m, 512, dtype=torch.bfloat16)
        assert_nmse(reference_linear(x, qt), lin(x).float(), tolerance("linear"), f"no compiler M={m}")


def test_isa_cap_limits_the_build_and_rejects_unknown_levels(monkeypatch) -> None:
    assert not any(f.startswith("-mavx512") for f in native.compile_flags("avx2"))
    assert not any(f.startswith("-m") for f in native.compile_flags("portable"))
    monkeypatch.setenv(native.ISA_ENV, "avx9")
    with pytest.raises(ValueError, match="MUSECORE_XEON_ISA='avx9'"):
        native.compile_flags()


def test_int4_tiles_are_larger_where_the_dense_gemm_is_native_bf16() -> None:
    from musecore_xeon.kernels.dense import DENSE_TILE_ELEMENTS, NATIVE_BF16_TILE_ELEMENTS
    qt = random_int4(8192, 2048, 128, negative_scales=False, asymmetric=False)
    assert prepare_int4(qt, torch.float32, calibrate=False).tile_rows == DENSE_TILE_ELEMENTS // 2048
    assert prepare_int4(qt, torch.bfloat16, calibrate=False).tile_rows == NATIVE_BF16_TILE_ELEMENTS // 2048


def test_the_native_kernels_build_wherever_a_c_compiler_exists() -> None:
    """The backend falls back to slower PyTorch paths (with a warning) when the build fails, and the tests of the
    native kernels skip without them: so a source that no longer compiles would pass the suite. Where a compiler
    exists and nothing disables the kernels, the build must succeed; the error shows the compiler's message."""
    if native.disabled():
        pytest.skip(f"{native.NATIVE_ENV} disables the native kernels")
    if native.compiler() is None:
        pytest.skip("no C compiler (cc/gcc) here: the native kernels cannot be built")
    assert native.available(), f"the native kernels failed to build: {native.UNAVAILABLE}"
    assert native.linear_binding() is not None, "the CPython extension failed to build (see the RuntimeWarning)"


# -- The INT4 GEMM on AMX (native_amx_source): its tile layout and its products against the dequantized weight. These
# run only where the CPU has AMX-BF16 (Sapphire Rapids and later), elsewhere they skip with the reason; the GPU
# machine's host CPU (a 5th-gen Xeon) runs them: bash backends/xeon/lab/scripts/xeon_amx_host.sh.

needs_amx = pytest.mark.skipif(not native.amx_ready(),
                               reason="no AMX here: the CPU lacks amx_tile/amx_bf16/avx512_bf16, MUSECORE_XEON_ISA caps "
                                      "the build below amx, or Linux refused the tile state")


def bf16_weight(lin) -> torch.Tensor:
    """The weight as the AMX kernel multiplies it: ``(q - z) * scale`` (exact fp32) rounded to bf16."""
    return lin.dequantize().to(torch.bfloat16)


@needs_amx
@pytest.mark.parametrize("group_size", [128, 256])
def test_amx_tiles_hold_the_bf16_weight_in_slot_order(group_size) -> None:
    """Weight tile (t, s) of a panel: row i holds output row 16t + i at the 32 columns of its slots (in
    amx_column_order); rows past the weight's padded rows are zero (52 rows: the second panel has 4 valid rows)."""
    n, k = 52, 2 * 256
    lin = prepare_int4(random_int4(n, k, group_size, negative_scales=True, asymmetric=True), torch.bfloat16,
                       calibrate=False)
    w = torch.zeros(64, k, dtype=torch.bfloat16)
    w[:n] = bf16_weight(lin)
    w = w[:, native.amx_column_order(k, group_size)]  # the tiles' column order (the activations are packed alike)
    for n0 in (0, 32):
        for k0 in range(0, k, 256):
            tiles = native.int4_amx_panel(lin.bound_gemv(), n0, k0, 256)  # [t, s, i, slot]
            expect = w[n0:n0 + 32, k0:k0 + 256].view(2, 16, 8, 32).permute(0, 2, 1, 3)  # [t, i, s, slot] -> [t, s, i, slot]
            mismatch = (tiles != expect).sum().item()
            assert mismatch == 0, f"g={group_size} n0={n0} k0={k0}: {mismatch} of {expect.numel()} tile elements differ"


@needs_amx
@pytest.mark.parametrize("n,k,group_size", [(52, 384, 128), (96, 768, 256), (300, 640, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amx_linear_matches_the_bf16_weight_product(n, k, group_size, dtype) -> None:
    """Against ``x_bf16 @ W_bf16.T`` in fp64: only the fp32 summation order (and, for bf16 outputs, the final
    rounding) differs. M covers one partial activation tile, pairs and a single tile left over, and more than one
    256-row block; K covers whole and partial 256-column blocks."""
    lin = prepare_int4(random_int4(n, k, group_size, negative_scales=True, asymmetric=True), torch.bfloat16,
                       calibrate=False)
    w = bf16_weight(lin).double()
    for m in (1, 5, 16, 17, 48, 300):
        x = torch.randn(m, k).to(dtype)
        y = native.int4_amx(lin.bound_gemv(), x)
        assert y.dtype == dtype and y.shape == (m, n)
        expect = x.to(torch.bfloat16).double() @ w.T
        err = ((y.double() - expect).abs().max() / expect.abs().max()).item()
        tol = 2 ** -8 if dtype == torch.bfloat16 else 1e-5  # bf16: one rounding of the output; fp32: summation order
        assert err <= tol, f"{n}x{k} g={group_size} M={m} {dtype}: max error {err:.3g} of the largest output > {tol:.3g}"


@needs_amx
@pytest.mark.parametrize("n,k,group_size", [(300, 1536, 128), (1024, 1024, 256), (96, 2304, 256)])
def test_amx_blocking_and_task_split_do_not_change_the_bits(n, k, group_size) -> None:
    """The blocking (K block, activation-row block, panel cap) and so the task split over threads only regroup the
    same tile products, and streamed stores only change where the packed activations sit: every setting (the
    previous defaults 256/256/256 among them) gives the default's bits (K blocks that do not divide K leave a partial last
    block); out-of-range settings and unknown leave-one-out modes are refused."""
    lin = prepare_int4(random_int4(n, k, group_size, negative_scales=True, asymmetric=True), torch.bfloat16,
                       calibrate=False)
    x = torch.randn(300, k, dtype=torch.bfloat16)
    try:
        native.int4_amx_tune()
        base = native.int4_amx(lin.bound_gemv(), x)
        expect = x.double() @ bf16_weight(lin).double().T
        err = ((base.double() - expect).abs().max() / expect.abs().max()).item()
        assert err <= 2 ** -8, f"default blocking: max error {err:.3g} of the largest output > 2^-8"
        for kb, mb, panel, stream in ((512, 0, 0, False), (1024, 128, 64, True), (256, 64, 1024, False),
                                      (2048, 32, 32, True), (768, 1024, 96, False), (256, 256, 256, False)):
            native.int4_amx_tune(kb, mb, panel, stream=stream)
            y = native.int4_amx(lin.bound_gemv(), x)
            diff = (y.float() - base.float()).abs().max().item()
            assert torch.equal(y, base), (f"k_block={kb} m_block={mb} max_panel={panel} stream={stream}: "
                                          f"max |diff| {diff:.3g} != 0")
        with pytest.raises(ValueError, match="k_block"):
            native.int4_amx_tune(100)
        with pytest.raises(ValueError, match="mode"):
            native.int4_amx_tune(mode="fast")
    finally:
        native.int4_amx_tune()


@needs_amx
def test_amx_is_the_dense_path_and_meets_the_op_tolerance() -> None:
    """With BF16 compute and g = 128 the dense path above the crossover is the AMX GEMM (not the dequantized tiles),
    and its output meets the linear op's tolerance against the reference dequantized matmul."""
    qt = random_int4(256, 1024, 128, negative_scales=True, asymmetric=True)
    lin = prepare_int4(qt, torch.bfloat16, calibrate=False)
    lin.crossover = 8
    assert lin.amx and lin.path(64) == "amx" and lin.path(4) == "native"
    x = torch.randn(64, 1024, dtype=torch.bfloat16)
    assert_nmse(reference_linear(x, qt), lin(x).float(), tolerance("linear"), "int4 AMX dense path, M=64")


def test_amx_serves_only_bf16_compute_and_groups_of_128_or_more() -> None:
    """Where AMX runs, g = 32/64 and fp32 compute keep the tiles; where it does not, nothing claims it."""
    assert not uses_amx(64, torch.bfloat16) and not uses_amx(32, torch.bfloat16)
    assert not uses_amx(128, torch.float32)
    assert uses_amx(128, torch.bfloat16) == native.amx_ready()
