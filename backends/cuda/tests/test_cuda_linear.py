"""W4A16 linear (NVFP4, MXFP4) and dense linear against ``musecore.ops.reference.linear``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import musecore_quant
from musecore.ops import Weight, tolerance
from musecore.ops import reference as ref

from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_cuda import CudaBackend
from musecore_cuda.backend import fp4_gluon_linear, fp4_linear_path
from musecore_cuda.choices import GLUON_ENV, GLUON_MIN_M, gluon_min_m
from musecore_cuda.kernels import fp4_gemm_cuda, fp4_gemv_cuda, fp4_gluon_plan
from musecore_triton.kernels import dense_gemv as dense_gemv_module
from musecore_triton.kernels.dense_gemv import DENSE_GEMV_MAX_BYTES, use_dense_gemv
from musecore_triton.layouts import prepare_fp4


def reference_linear(x: torch.Tensor, qt) -> torch.Tensor:
    dense = musecore_quant.dequantize(qt).to(x.device)
    return ref.linear(x.float(), Weight(data=dense, format=qt.format, out_features=dense.shape[0],
                                        in_features=dense.shape[1]))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_fp4_linear_matches_reference(fmt, m, dtype):
    n, k = 96, 256  # n not a multiple of the tile: exercises the row mask
    w = torch.randn(n, k) * 0.05
    w[3, :16] *= 40  # one block with a large scale, one nearly empty
    w[7, 32:64] *= 1e-3
    qt = musecore_quant.quantize(w, fmt)
    be = CudaBackend(DEVICE)
    prepared = be.prepare_weight(qt, "test")
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    y = be.linear(x, prepared)
    assert y.dtype == dtype
    assert_nmse(reference_linear(x, qt), y, tolerance("linear"), f"{fmt} linear M={m} {dtype}")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_linear_split_k_accumulates_every_split(fmt):
    n, k = 64, 1024  # decode shape with K long enough to split
    qt = musecore_quant.quantize(torch.randn(n, k), fmt)
    be = CudaBackend(DEVICE)
    x = torch.randn(2, 3, k, device=DEVICE).half()  # leading dims are flattened and restored
    y = be.linear(x, be.prepare_weight(qt, "test"))
    assert y.shape == (2, 3, n)
    assert_nmse(reference_linear(x.reshape(6, k), qt).reshape(2, 3, n), y, tolerance("linear"), f"{fmt} split-K")


def test_dense_linear_uses_prepared_dtype_and_refuses_a_mismatch():
    be = CudaBackend(DEVICE)
    w = torch.randn(32, 64)
    prepared = be.prepare_weight(w, "test", dtype=torch.float32)
    x = torch.randn(4, 64, device=DEVICE)
    assert_nmse(x @ w.to(DEVICE).T, be.linear(x, prepared), tolerance("linear"), "fp32 linear")
    with pytest.raises(TypeError, match="prepare it with dtype"):
        be.linear(x.half(), prepared)


@pytest.mark.gpu
def test_dense_linear_takes_the_gemv_for_one_token_on_small_weights():
    """The backend's linear at M = 1 on a small bf16 weight goes through dense_gemv (and matches the
    reference); M = 2 and large weights of a K too deep to unroll stay on cuBLAS."""
    be = CudaBackend(DEVICE)
    small = be.prepare_weight(torch.randn(576, 1536) * 0.02, "test", dtype=torch.bfloat16)
    x = torch.randn(1, 1, 1536, device=DEVICE, dtype=torch.bfloat16)
    assert use_dense_gemv(x.reshape(1, -1), small.data)
    assert not use_dense_gemv(torch.randn(2, 1536, device=DEVICE, dtype=torch.bfloat16), small.data)
    big = torch.empty(DENSE_GEMV_MAX_BYTES // 2 // 4096 + 1, 4096, device=DEVICE, dtype=torch.bfloat16)
    assert not use_dense_gemv(torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16), big)
    vocab = torch.empty(65536, 1536, device=DEVICE, dtype=torch.bfloat16)  # the GEMV at any size where K unrolls
    assert use_dense_gemv(x.reshape(1, -1), vocab) == dense_gemv_module.UNROLL_K
    y = be.linear(x, small)
    assert y.shape == (1, 1, 576)
    assert_nmse(x.float() @ small.data.float().T, y, tolerance("linear"), "linear M=1 through dense_gemv")


def test_activation_quantization_is_refused_not_emulated():
    be = CudaBackend(DEVICE)
    with pytest.raises(NotImplementedError, match="W4A4"):
        be.prepare_weight(musecore_quant.quantize(torch.randn(16, 128), "nvfp4"), "test", act_format="nvfp4")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", [(1024, 8192), (8192, 2048), (10240, 8192)])
@pytest.mark.parametrize("m", [1, 4, 8, 16, 32, 64, 300])
def test_fp4_linear_at_model_shapes_on_gpu(fmt, shape, m):
    n, k = shape
    w = torch.randn(n, k, device="cuda") * 0.02
    qt = musecore_quant.quantize(w, fmt)
    be = CudaBackend("cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = be.linear(x, be.prepare_weight(qt, "test"))
    assert_nmse(reference_linear(x, qt), y, tolerance("linear"), f"{fmt} {shape} M={m}")


def _cuda_decode(x, w, n, k, kind, split=None, **cut):
    plan = fp4_gemv_cuda.make_plan(x.shape[0], n, k, x.dtype, x.device, kind=kind)
    if split is not None:  # at least the split the staged activations need
        plan = dataclasses.replace(plan, split_k=max(split, plan.split_k), **cut)
    out = torch.zeros(x.shape[0], n, device="cuda", dtype=torch.float32 if plan.atomic else x.dtype)
    return fp4_gemv_cuda.launch(x, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2, n=n, k=k,
                                out=out, plan=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_decode_lean_and_plain_paths_give_the_same_bits(fmt):
    """The MMA kernel's lean path (fp4_gemv_cuda.lean_path) changes instructions, not arithmetic: forced on and off
    on the same cuts (one warp per K range and warps splitting K, M = 1 / 2 / 9), the same bits."""
    n, k = 192, 1024
    w = prepare_fp4(musecore_quant.quantize(torch.randn(n, k) * 0.02, fmt), torch.device("cuda"))
    for m in (1, 2, 9):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        for kw in (1, 2):
            lean, plain = (_cuda_decode(x, w, n, k, "mma", split=1, k_warps=kw, lean=v) for v in (True, False))
            assert torch.equal(lean, plain), \
                f"{fmt} M={m} k_warps={kw}: max |diff| {(lean.float() - plain.float()).abs().max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mma", "fma"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_decode_upcasts_every_code_exactly(fmt, kind):
    """All 16 E2M1 codes (0.5 is subnormal in the upcast) at every nibble position, one-hot inputs.

    Tolerance: 1e-6 relative per weight (the per-tensor factor is applied to the fp32 sum, so the
    result may differ from the dequantized weight by an ulp); a flushed 0.5 or a lost sign is off by
    far more."""
    assert fp4_gemv_cuda.available(torch.device("cuda")), fp4_gemv_cuda.UNAVAILABLE
    rows = 2 if kind == "fma" else 16
    _check_every_code(fmt, rows, lambda x, w, n, k: _cuda_decode(x, w, n, k, kind), kind)
    if kind == "mma":  # both paths of the MMA kernel (fp4_gemv_cuda.lean_path), whichever the plan picks
        for lean in (True, False):
            _check_every_code(fmt, rows, lambda x, w, n, k: _cuda_decode(x, w, n, k, kind, split=1, lean=lean),
                              f"{kind} lean={lean}")


def _check_every_code(fmt, rows, run, what):
    """``run(x, w, n, k)`` on one-hot rows ``x`` (``rows`` at a time) against a weight holding every
    E2M1 code at every nibble position: each output within 1e-6 relative of the dequantized weight."""
    n, k = 40, 1024
    codes = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 16
    values = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
    qt = musecore_quant.quantize(values, fmt)
    dense = musecore_quant.dequantize(qt).float().cuda()
    w = prepare_fp4(qt, torch.device("cuda"))
    for start in range(0, k, rows):
        x = torch.eye(k, device="cuda")[start:start + rows].to(torch.bfloat16)
        out = run(x, w, n, k).float()
        expected = dense[:, start:start + rows].T
        err = ((out - expected).abs() / expected.abs().clamp_min(1e-30)).max()
        assert err <= 1e-6, f"{what} columns {start}..{start + rows - 1}: max relative error {err:.3g} > 1e-6"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("kind,m,dtype", [("fma", 1, torch.bfloat16), ("fma", 2, torch.float16),
                                          ("mma", 1, torch.bfloat16), ("mma", 3, torch.bfloat16),
                                          ("mma", 8, torch.bfloat16), ("mma", 11, torch.bfloat16),
                                          ("mma", 16, torch.bfloat16)])
def test_cuda_decode_rows_splits_and_dtypes_match_reference(fmt, kind, m, dtype):
    n, k = 1000, 4096  # a partial block of rows
    qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
    w = prepare_fp4(qt, torch.device("cuda"))
    x = torch.randn(m, k, device="cuda").to(dtype)
    expected = reference_linear(x, qt)
    # MMA: cluster split x warps splitting a block's K range x chunks in flight (every reduction path)
    cuts = ([(1, 1, 1), (2, 2, 2), (8, 4, 3), (1, 4, 4), (4, 1, 2), (1, 2, 1)] if kind == "mma"
            else [(1, 1, 2), (2, 1, 2), (8, 1, 2)])
    for split, k_warps, prefetch in cuts:
        out = _cuda_decode(x, w, n, k, kind, split, k_warps=k_warps, prefetch=prefetch)
        assert_nmse(expected, out.float(), tolerance("linear"),
                    f"{fmt} CUDA {kind} M={m} split {split} k_warps {k_warps} prefetch {prefetch} {dtype}")
    out = _cuda_decode(x, w, n, k, kind)  # the plan make_plan picks
    assert_nmse(expected, out.float(), tolerance("linear"), f"{fmt} CUDA {kind} M={m} default plan {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dequantize_matches_the_reference_dequantization(fmt):
    """The large-M path's bf16 copy of the weight: each element within one bf16 rounding (2**-8
    relative) of ``musecore_quant.dequantize`` in fp32 (both round code * scale * global once; the
    reference may round ``scale * global`` first), and exactly zero where the code is zero."""
    n, k = 300, 1024
    qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
    w = prepare_fp4(qt, torch.device("cuda"))
    out = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    fp4_gemv_cuda.dequantize(w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2, n=n, k=k,
                             out=out)
    expected = musecore_quant.dequantize(qt).float().cuda()
    err = ((out.float() - expected).abs() / expected.abs().clamp_min(1e-30)).max().item()
    assert err <= 2.0 ** -8, f"{fmt} dequantize: max relative error {err:.3g} > 2**-8"
    assert torch.equal(out.float() == 0, expected == 0), f"{fmt} dequantize: zeros differ"


@pytest.mark.gpu
def test_dequantize_every_row_and_word_at_odd_sizes():
    """The dequantize kernel (one thread per int32 word) on sizes that end mid-block: 3 rows and K=128 (48 words),
    129 rows x 384: equal to the reference within one bf16 rounding, every element written (the output starts as
    NaN)."""
    for n, k in ((3, 128), (129, 384)):
        qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, "nvfp4")
        w = prepare_fp4(qt, torch.device("cuda"))
        out = torch.full((n, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        fp4_gemv_cuda.dequantize(w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2, n=n,
                                 k=k, out=out)
        expected = musecore_quant.dequantize(qt).float().cuda()
        assert not out.isnan().any(), f"[{n}, {k}]: {int(out.isnan().sum())} elements never written"
        err = ((out.float() - expected).abs() / expected.abs().clamp_min(1e-30)).max().item()
        assert err <= 2.0 ** -8, f"[{n}, {k}] dequantize: max relative error {err:.3g} > 2**-8"


@pytest.mark.gpu
def test_cuda_decode_refuses_what_it_cannot_run():
    w = prepare_fp4(musecore_quant.quantize(torch.randn(64, 256), "nvfp4"), torch.device("cuda"))
    with pytest.raises(ValueError, match="no CUDA decode kernel"):
        fp4_gemv_cuda.make_plan(fp4_gemv_cuda.MAX_M + 1, 64, 256, torch.bfloat16, torch.device("cuda"))
    plan = fp4_gemv_cuda.make_plan(1, 64, 256, torch.bfloat16, torch.device("cuda"), kind="mma")
    with pytest.raises(ValueError, match="cannot take"):
        fp4_gemv_cuda.launch(torch.randn(1, 256, device="cuda").half(), w.packed, w.scales, w.out_scale,
                             wfmt=w.wfmt, fold_log2=w.fold_log2, n=64, k=256,
                             out=torch.empty(1, 64, device="cuda").half(), plan=plan)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_tiled_gemm_upcasts_every_code_exactly(fmt):
    """Every E2M1 code at every nibble position through the tiled GEMM (one-hot rows, 64 per call).
    Tolerance 1e-6 relative per weight, as for the decode kernels."""
    def run(x, w, n, k):
        out = torch.empty(x.shape[0], n, device="cuda", dtype=torch.bfloat16)
        return fp4_gemm_cuda.launch(x, w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                    n=n, k=k, out=out, plan=fp4_gemm_cuda.GemmPlan(groups=8, tile=1))

    _check_every_code(fmt, 64, run, "tiled GEMM")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [17, 24, 33, 64, 100, 256])
def test_cuda_tiled_gemm_tiles_splits_and_stages_match_reference(fmt, m):
    """Partial token tiles and row blocks, even and uneven cluster splits, 1-2 tiles per warp, 2-3 stages,
    1-2 chunks in flight, bf16 and fp32 outputs; tolerance: the linear op's NMSE."""
    n, k = 1000, 4096
    qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
    w = prepare_fp4(qt, torch.device("cuda"))
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    expected = reference_linear(x, qt)
    groups = min(8, -(-m // 8))
    cuts = [(groups, 2, 1, 3, 2), (groups, 1, 2, 2, 1), (groups, 2, 8, 3, 1),
            (groups, 1, 3, 3, 1), (groups, 2, 7, 2, 1),  # uneven K splits
            (max(1, groups // 2), 1, 5, 3, 2)]
    i = [17, 24, 33, 64, 100, 256].index(m)  # two cuts per M (each cut is one more NVRTC compile)
    plans = [fp4_gemm_cuda.make_plan(m, n, k, x.device)] + [
        fp4_gemm_cuda.GemmPlan(groups=g, tile=tile, split=split, stages=stages, prefetch=prefetch)
        for g, tile, split, stages, prefetch in (cuts[i], cuts[(i + 3) % len(cuts)])]
    for plan in plans:
        for dtype in (torch.bfloat16, torch.float32):
            out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
            fp4_gemm_cuda.launch(x, w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                 n=n, k=k, out=out, plan=plan)
            assert_nmse(expected, out.float(), tolerance("linear"), f"{fmt} tiled GEMM M={m} {plan} -> {dtype}")


# --- the Gluon GEMM as fp4_linear's path "gluon" (NVFP4, bf16, M 9-256) -------------------------------------------

def _needs_gluon() -> None:
    reason = fp4_gluon_plan.unavailable_reason(torch.device("cuda"))
    if reason:
        pytest.skip(reason)


GLUON_SHAPES = {"q_proj": (8192, 8192), "k_proj": (1024, 8192), "expert_up": (8192, 4096),
                "expert_down": (4096, 4096)}  # the 816B shapes (N, K) the routing was measured on


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GLUON_SHAPES))
def test_fp4_linear_gluon_path_matches_reference_at_816b_shapes(name, monkeypatch):
    """fp4_linear routes NVFP4 x bf16 at M 1-256 on these shapes (from 2 or 9 on smaller weights) to the Gluon GEMM
    with pick_config's launch (split-K on k_proj);
    each M against the fp32 product of the dequantized weight, NMSE within the linear op's 1e-4 (exact products and
    fp32 sums: the measured NMSE is the bf16 output rounding, ~3e-6)."""
    _needs_gluon()
    monkeypatch.delenv(GLUON_ENV, raising=False)
    n, k = GLUON_SHAPES[name]
    qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, "nvfp4")
    be = CudaBackend("cuda")
    w = be.prepare_weight(qt, name)
    sms = fp4_gluon_plan.sm_count(torch.cuda.current_device())
    first = gluon_min_m(n * k, k)  # 1 for the 816B shapes (2 for weights of 192 x 1536 and more: the GEMV keeps one)
    assert first == 1 or fp4_linear_path(first - 1, torch.bfloat16, torch.device("cuda"), n * k,
                                         weight_format="nvfp4", out_features=n) == "mma"
    for m in (first, 16, 17, 32, 64, 100, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert fp4_linear_path(m, x.dtype, x.device, n * k, weight_format="nvfp4", out_features=n) == "gluon"
        cfg = fp4_gluon_plan.pick_config(m, n, k, sms)
        assert_nmse(reference_linear(x, qt), be.linear(x, w), tolerance("linear"),
                    f"{name} {k}->{n} M={m} through the Gluon GEMM {cfg.label()}")


def _gluon_case(n: int, k: int, m: int):
    """An NVFP4 weight ``[n, k]`` (its QTensor and resident layout) and bf16 activations ``[m, k]`` on the GPU, for a
    Gluon GEMM test (skipped where the Gluon GEMM cannot run)."""
    _needs_gluon()
    qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, "nvfp4")
    return qt, prepare_fp4(qt, torch.device("cuda")), torch.randn(m, k, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["atomics", "fixup", "finish"])
@pytest.mark.parametrize("cut", [(64, 32, 2, 4), (64, 64, 4, 3), (64, 128, 8, 2), (64, 16, 1, 4), (64, 256, 4, 3)])
def test_fp4_gluon_linear_split_k_and_partial_tiles_match_reference(cut, mode):
    """Split-K 2/4/8 (fp32 atomics into a zeroed output, then bf16; ``fixup``: partials in a workspace, summed by
    the tile's last split; ``finish``: 16-byte atomics into a zeroed workspace that the tile's last split stores in
    bf16), ring wrap-around, a partial token tile (M=100) and a partial weight tile (N=1000) through the backend's
    wrapper; NMSE within 1e-4. With fixup two calls give the same bits (the per-tile counts start at zero each
    call); with finish the output is bf16 straight from the kernel and two calls agree within the atomics' order
    (the same tolerance against each other)."""
    n, k, m = 1000, 4096, 100
    qt, w, x = _gluon_case(n, k, m)
    cfg = fp4_gluon_plan.GluonConfig(*cut, upcast="packed", fixup=mode == "fixup", finish=mode == "finish")
    got = fp4_gluon_linear(x, w, cfg)
    assert_nmse(reference_linear(x, qt), got, tolerance("linear"), f"Gluon GEMM {cfg.label()} M={m} N={n}")
    again = fp4_gluon_linear(x, w, cfg)
    if mode == "fixup":
        assert torch.equal(got, again), f"{cfg.label()}: a second call differs by {(got - again).abs().max():.3g}"
    else:  # atomics add in any order: the sums may differ in their last bits, never by more
        assert_nmse(got.float(), again, 1e-5, f"Gluon GEMM {cfg.label()}: a second call against the first")


@pytest.mark.gpu
@pytest.mark.parametrize("cut,flags", [((64, 16, 1, 4), "pair"), ((64, 64, 1, 8), "pair"), ((64, 64, 4, 4), "pair"),
                                       ((64, 128, 8, 4), "pair"), ((128, 128, 1, 4), "pair"), ((64, 64, 1, 4), "late"),
                                       ((64, 16, 8, 3), "late"), ((64, 64, 1, 8), "pair,late"),
                                       ((64, 128, 4, 6), "pair,late"), ((64, 32, 16, 6), "pair,late"),
                                       ((64, 64, 1, 4), "ahead2"), ((64, 16, 16, 4), "ahead2"),
                                       ((64, 64, 1, 8), "pair,late,ahead2"), ((128, 64, 2, 8), "pair,late,ahead2")])
def test_fp4_gluon_linear_paired_stages_and_late_release_give_the_same_bits(cut, flags):
    """Paired ring stages (``GluonConfig.pair``: one ready/empty mbarrier pair per two stages, the consumer waiting
    and releasing once per two chunks), late release (``late``: a stage freed right before a later chunk's wait) and
    scale words loaded two chunks ahead (``ahead``; 2 chunks per split at 16) change only the synchronization and
    the loads' timing, not the order of the sums: the same bits as the plain launch (split 1 and
    split-K finish, ring wrap-around, 1 pair, splits of 2 chunks where the late pair path skips its peeled pair,
    partial tiles, two warpgroups, with split-K too), and within the linear tolerance of the reference."""
    n, k, m = 1000, 4096, 100
    qt, w, x = _gluon_case(n, k, m)
    base = fp4_gluon_plan.GluonConfig(*cut, upcast="packed", finish=cut[2] > 1)
    paired = dataclasses.replace(base, pair="pair" in flags, late="late" in flags,
                                 ahead=2 if "ahead2" in flags else 1)
    got = fp4_gluon_linear(x, w, paired)
    assert_nmse(reference_linear(x, qt), got, tolerance("linear"), f"Gluon GEMM {paired.label()} M={m} N={n}")
    want = fp4_gluon_linear(x, w, base)
    if base.split_k == 1:
        assert torch.equal(got, want), f"{paired.label()}: differs from unpaired by {(got - want).abs().max():.3g}"
    else:  # split-K finish adds its partials in arrival order: equal within that order's last bits
        assert_nmse(want.float(), got, 1e-5, f"Gluon GEMM {paired.label()} against {base.label()}")


@pytest.mark.gpu
@pytest.mark.parametrize("cut,flags", [((64, 64, 4, 4), ""), ((64, 16, 8, 8), "pair,late,ahead2"),
                                       ((128, 64, 4, 8), "pair,late,ahead2")])
def test_fp4_gluon_linear_rezero_leaves_the_workspace_zeroed_and_matches_finish(cut, flags):
    """Split-K finish with ``rezero`` (the last split zeroes the tile's sums and count again; the stream's workspace
    is kept): calls of several shapes in a row (partial tiles, a smaller M into the larger workspace) each match
    plain finish within the atomics' order and the linear tolerance of the reference, and the kept workspace is all
    zeros after each."""
    from musecore_cuda.kernels import finish_workspace
    base = fp4_gluon_plan.GluonConfig(*cut, upcast="packed", finish=True, pair="pair" in flags, late="late" in flags,
                                      ahead=2 if "ahead2" in flags else 1)
    cfg = dataclasses.replace(base, rezero=True)
    for n, k, m in ((1000, 4096, 100), (1000, 4096, 37), (4096, 8192, 64), (1000, 4096, 100)):
        qt, w, x = _gluon_case(n, k, m)
        got = fp4_gluon_linear(x, w, cfg)
        torch.cuda.synchronize()
        kept = finish_workspace._EAGER[(x.device.index, torch.cuda.current_stream().cuda_stream)]
        assert not kept.any(), f"{cfg.label()} M={m} N={n}: {int(kept.count_nonzero())} workspace words left nonzero"
        assert_nmse(reference_linear(x, qt), got, tolerance("linear"), f"Gluon GEMM {cfg.label()} M={m} N={n}")
        assert_nmse(fp4_gluon_linear(x, w, base).float(), got, 1e-5, f"{cfg.label()} against {base.label()}")


@pytest.mark.gpu
def test_fp4_gluon_linear_rezero_in_a_graph_scope_replays_right_without_memsets():
    """Split-K finish with ``rezero`` captured in a CUDA graph inside ``finish_workspace.graph_scope`` (as the decode
    graphs and ``musecore bench`` capture): three launches of different shapes in one graph share the device's graph
    workspace; replayed three times with new activations, every output matches plain finish run eagerly (within the
    atomics' order) and the linear tolerance of the reference, the graph workspace is all zeros after each replay,
    and the graph holds no memset of its own (the captured launches allocate no zeroed workspace)."""
    from musecore_cuda.kernels import finish_workspace
    cfg = fp4_gluon_plan.GluonConfig(64, 16, 8, 8, upcast="packed", finish=True, pair=True, late=True, ahead=2,
                                     rezero=True)
    cases = [_gluon_case(n, k, m) for n, k, m in ((1000, 4096, 16), (4096, 8192, 13), (1024, 8192, 16))]
    xs = [x.clone() for _, _, x in cases]

    def body():
        return [fp4_gluon_linear(x, w, cfg) for x, (_, w, _) in zip(xs, cases)]

    zeros = []
    with finish_workspace.graph_scope():
        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        real_zeros = torch.zeros
        with pytest.MonkeyPatch.context() as mp:  # a zeroed allocation while capturing would be a memset node
            mp.setattr(torch, "zeros", lambda *a, **kw: zeros.append(a) or real_zeros(*a, **kw))
            with torch.cuda.graph(graph):
                outs = body()
    assert not zeros, f"the capture zeroed {len(zeros)} workspaces of its own: {zeros}"
    for replay in range(3):
        for x, (_, _, fresh) in zip(xs, cases):
            x.copy_(torch.randn_like(fresh))
        graph.replay()
        torch.cuda.synchronize()
        kept = finish_workspace._GRAPH[xs[0].device.index][-1]
        assert not kept.any(), f"replay {replay}: {int(kept.count_nonzero())} graph workspace words left nonzero"
        for x, out, (qt, w, _) in zip(xs, outs, cases):
            what = f"replay {replay} {cfg.label()} M={x.shape[0]} N={w.out_features}"
            assert_nmse(reference_linear(x, qt), out, tolerance("linear"), what)
            plain = fp4_gluon_linear(x, w, dataclasses.replace(cfg, rezero=False))
            assert_nmse(plain.float(), out, 1e-5, what + " against plain finish")


@pytest.mark.gpu
@pytest.mark.parametrize("cut", [(128, 256, 1, 3), (128, 128, 1, 4)])
def test_fp4_gluon_linear_two_warpgroups_match_reference(cut):
    """Two consumer warpgroups (128 weight rows) over 256 / 128 tokens, the large-M cuts the sweep times since session
    59 (0 spills on SM90 at 3 stages): partial tiles (M = 300, N = 1000) within the linear tolerance."""
    n, k, m = 1000, 4096, 300
    qt, w, x = _gluon_case(n, k, m)
    cfg = fp4_gluon_plan.GluonConfig(*cut, upcast="packed")
    assert_nmse(reference_linear(x, qt), fp4_gluon_linear(x, w, cfg), tolerance("linear"),
                f"Gluon GEMM {cfg.label()} M={m} N={n}")


@pytest.mark.gpu
@pytest.mark.parametrize("cut", [(64, 64, 1, 3), (128, 256, 1, 3)])
def test_fp4_gluon_linear_persistent_matches_reference(cut):
    """The persistent grid (one program per SM over ~1000 tiles): the ring's stages and phases carried from tile to
    tile (8 chunks per tile on 3 stages), partial last tiles (M = 2100, N = 2000); within the linear tolerance and
    the same bits as the one-tile-per-program launch (the same mainloop and summation order)."""
    n, k, m = 2000, 1024, 2100
    qt, w, x = _gluon_case(n, k, m)
    cfg = fp4_gluon_plan.GluonConfig(*cut, upcast="packed", persistent=True)
    got = fp4_gluon_linear(x, w, cfg)
    assert_nmse(reference_linear(x, qt), got, tolerance("linear"), f"Gluon GEMM {cfg.label()} M={m} N={n}")
    plain = fp4_gluon_linear(x, w, dataclasses.replace(cfg, persistent=False))
    assert torch.equal(got, plain), f"{cfg.label()}: differs from one tile per program by {(got - plain).abs().max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("cut", ["64,16,1,4,packed,2", "64,64,1,4,packed,2", "64,64,4,4,packed,2",
                                 "64,128,2,2,packed,2", "64,64,4,4,packed,2,finish,rezero",
                                 "64,32,4,4,packed,2,finish,rezero", "64,16,16,4,packed,2,finish,rezero"])
def test_fp4_gluon_linear_two_ctas_per_sm_match_reference(cut):
    """The launch at 128 registers per thread (two CTAs per SM; Triton's setmaxnreg gives the consumer 232): split-K
    (atomics, and the finish with its kept workspace that pick_config routes at 32-64 tokens since session 68) and
    not, partial token and weight tiles, ring wrap-around; NMSE within 1e-4, and the compiled kernel did take 128
    registers (else the second CTA would not fit)."""
    n, k, m = 1000, 4096, 100
    qt, w, x = _gluon_case(n, k, m)
    from musecore_cuda.kernels import fp4_gemm_gluon
    cfg = fp4_gluon_plan.GluonConfig.parse(cut)
    assert_nmse(reference_linear(x, qt), fp4_gluon_linear(x, w, cfg), tolerance("linear"),
                f"Gluon GEMM {cfg.label()} M={m} N={n}")
    kernels = [kern for cache in fp4_gemm_gluon.fp4_gluon_kernel.device_caches.values() for kern in cache[0].values()
               if getattr(kern.metadata, "maxnreg", None) == 128]  # Triton 3.6's per-device kernel cache
    assert kernels and all(kern.n_regs <= 128 for kern in kernels), [kern.n_regs for kern in kernels]


@pytest.mark.gpu
def test_fp4_gluon_linear_upcasts_every_code_exactly():
    """Every E2M1 code at every nibble position through the routed launch (one-hot rows, 64 per call): each
    output within 1e-6 relative of the dequantized weight."""
    _needs_gluon()
    _check_every_code("nvfp4", 64, lambda x, w, n, k: fp4_gluon_linear(x, w), "Gluon GEMM")


@pytest.mark.gpu
def test_fp4_linear_gluon_path_is_switched_off_by_env_and_skips_mxfp4(monkeypatch):
    _needs_gluon()
    cuda = torch.device("cuda")
    monkeypatch.setenv(GLUON_ENV, "0")
    assert fp4_linear_path(64, torch.bfloat16, cuda, 1, weight_format="nvfp4", out_features=0) == "gemm"
    monkeypatch.delenv(GLUON_ENV)
    assert fp4_linear_path(64, torch.bfloat16, cuda, 1, weight_format="nvfp4", out_features=0) == "gluon"
    assert fp4_linear_path(64, torch.bfloat16, cuda, 1, weight_format="mxfp4", out_features=0) == "gemm"
    assert fp4_linear_path(GLUON_MIN_M, torch.bfloat16, cuda, 1, weight_format="nvfp4", out_features=0) == "gluon"
    assert fp4_linear_path(GLUON_MIN_M - 1, torch.bfloat16, cuda, 1, weight_format="nvfp4", out_features=0) == "mma"
    assert fp4_linear_path(257, torch.bfloat16, cuda, 1, weight_format="nvfp4", out_features=0) == "dequant"
    big = dict(weight_format="nvfp4", out_features=8192)  # 64 weight tiles of 128: the large-M launch from M = 257
    assert fp4_linear_path(257, torch.bfloat16, cuda, 8192 * 8192, **big) == "gluon"
    assert fp4_linear_path(1024, torch.bfloat16, cuda, 1024 * 8192, weight_format="nvfp4", out_features=1024) == \
        "dequant"  # 32 tiles: dequantize + cuBLAS measured faster
    assert fp4_linear_path(2048, torch.bfloat16, cuda, 8192 * 8192, **big) == "gluon"
    assert fp4_linear_path(2049, torch.bfloat16, cuda, 8192 * 8192, **big) == "dequant"  # every K: to 2048 (session 82)
    assert fp4_linear_path(4096, torch.bfloat16, cuda, 8192 * 4096, **big) == "dequant"


@pytest.mark.gpu
@pytest.mark.parametrize("m, path", [(2048, "gluon"), (4096, "dequant")])
def test_fp4_linear_at_large_m_on_k_8192_takes_its_path_and_matches_reference(monkeypatch, m, path):
    """Pooler's 4096 x 8192 weight (K = 8192, 256 output tiles of 128 x 256 at M = 2048): the large-M Gluon launch up
    to M = 2048, dequantize + cuBLAS past it (since session 82: behind it at 4096 in 36 of 52 targets rows), each
    matching the fp32 product within the linear tolerance."""
    _needs_gluon()
    monkeypatch.delenv(GLUON_ENV, raising=False)
    n, k = 4096, 8192
    qt, _, x = _gluon_case(n, k, m)
    be = CudaBackend("cuda")
    w = be.prepare_weight(qt, "pooler")
    assert fp4_linear_path(m, x.dtype, x.device, n * k, weight_format="nvfp4", out_features=n) == path
    assert_nmse(reference_linear(x, qt), be.linear(x, w), tolerance("linear"),
                f"fp4_linear M={m} {k}->{n} through {path}")


@pytest.mark.gpu
def test_fp4_linear_gluon_path_replays_from_a_cuda_graph(monkeypatch):
    """A decode graph of batch 9-32 captures this path: after one eager call (compile), capture and replay give
    the eager result, bit for bit for a single launch; split-K's atomics may add in another order (NMSE 1e-6)."""
    _needs_gluon()
    monkeypatch.delenv(GLUON_ENV, raising=False)
    be = CudaBackend("cuda")
    for n, k in ((8192, 4096), (1024, 8192)):  # 64,32,1,4 and 64,32,8,4 on an H200: split 1 and split-K
        w = be.prepare_weight(musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, "nvfp4"), "test")
        x = torch.randn(24, k, device="cuda", dtype=torch.bfloat16)
        eager = be.linear(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = be.linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
        cfg = fp4_gluon_plan.pick_config(24, n, k, fp4_gluon_plan.sm_count(torch.cuda.current_device()))
        if cfg.split_k == 1:
            assert torch.equal(captured, eager), f"{n}x{k} {cfg.label()}: replay differs from eager"
        else:  # atomics add the splits in any order
            assert_nmse(eager.float(), captured.float(), 1e-6, f"{n}x{k} {cfg.label()} replay vs eager")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [13, 16, 64])
def test_fp4_gluon_linear_chain_with_pdl_matches_the_chain_without(m, monkeypatch):
    """Three Gluon linears in a dependent chain (each reads the one before's output), launched with programmatic
    dependent launch: each may start while the one before finishes, so a missing or misplaced ``griddepcontrol.wait``
    reads the previous output half-written (or adds into a workspace not yet zeroed again). Captured in a CUDA
    graph inside the PDL and finish-workspace scopes (as the decode graphs are), and eagerly with
    ``MUSECORE_CUDA_PDL=1``, each replayed on fresh inputs: the outputs equal the chain launched without PDL (split-K
    finish adds in any order: NMSE 1e-6) and the kept workspace is zeros again. The first link's cut reads 4 chunks
    per split into an 8-stage ring; the others are pick_config's at M."""
    from musecore_cuda.kernels import finish_workspace, pdl
    if not pdl.supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs SM90+ and a Triton with grid dependency control")
    monkeypatch.delenv(pdl.ENV, raising=False)
    short = fp4_gluon_plan.GluonConfig(64, 16, 8, 8, upcast="packed", finish=True, pair=True, late=True, ahead=2,
                                       rezero=True)
    links = [(_gluon_case(n, k, m)[1], cfg) for n, k, cfg in ((4096, 4096, short), (8192, 4096, None),
                                                               (4096, 8192, None))]
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)

    def chain():
        y = x
        for w, cfg in links:
            y = fp4_gluon_linear(y, w, cfg)
        return y

    def check(got, what):
        want = chain()  # PDL off (outside every scope; the variable unset or 0)
        torch.cuda.synchronize()
        assert_nmse(want.float(), got.float(), 1e-6, f"M={m} {what} against the chain without PDL")

    with finish_workspace.graph_scope(), pdl.scope(True):
        chain()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain()
    for replay in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        kept = finish_workspace._GRAPH[x.device.index][-1]
        assert not kept.any(), f"replay {replay}: {int(kept.count_nonzero())} graph workspace words left nonzero"
        check(captured, f"graph replay {replay} (PDL)")
    monkeypatch.setenv(pdl.ENV, "1")
    for call in range(2):
        x.copy_(torch.randn_like(x))
        got = chain()  # eager launches with PDL, back to back on one stream
        monkeypatch.setenv(pdl.ENV, "0")
        check(got, f"eager call {call} (MUSECORE_CUDA_PDL=1)")
        monkeypatch.setenv(pdl.ENV, "1")


def test_decode_launch_refuses_a_weight_beyond_its_32_bit_offsets():
    """The lean path addresses one weight's words with 32-bit offsets: a [2**20, 2**15] weight (2**32 words) is refused
    before any launch, with what to do (no weight is allocated: the check comes first)."""
    n, k = 1 << 20, 1 << 15
    plan = fp4_gemv_cuda.make_plan(1, n, k, torch.bfloat16, torch.device("cuda"))
    x = torch.zeros(1, k, dtype=torch.bfloat16)
    dummy = torch.zeros(1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="32 bits.*split the layer"):
        fp4_gemv_cuda.launch(x, dummy, dummy, torch.ones(1), wfmt=1, fold_log2=9, n=n, k=k,
                             out=torch.empty(1, n, dtype=torch.bfloat16), plan=plan)


class _RecordedLaunch:
    """A stand-in for ``fp4_gluon_kernel``: ``kernel[grid](*args, **kwargs)`` records the launch instead of running."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


def _recorded_gluon_launch(monkeypatch, m: int, n: int, k: int, cfg, out_dtype=torch.bfloat16):
    """``fp4_gemm_gluon.launch`` on CPU tensors with the kernel and its TMA descriptors stubbed: what the host side
    allocates and passes (the kernel itself: the GPU tests above)."""
    from musecore_cuda.kernels import fp4_gemm_gluon
    kernel = _RecordedLaunch()
    monkeypatch.setattr(fp4_gemm_gluon, "fp4_gluon_kernel", kernel)
    monkeypatch.setattr(fp4_gemm_gluon, "descriptors", lambda x, w, c: ("w_desc", "x_desc"))
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    packed = torch.zeros(n, k // 2, dtype=torch.uint8)
    scales = torch.zeros(n, k // 16, dtype=torch.uint8)
    out = torch.empty(m, n, dtype=out_dtype)
    fp4_gemm_gluon.launch(x, packed, scales, torch.ones(1), wfmt=fp4_gemm_gluon.WFMT_NVFP4, group=16, fold_log2=9,
                          n=n, k=k, out=out, cfg=cfg)
    return kernel.calls


def test_gluon_launch_finish_allocates_one_zeroed_workspace_with_the_counts_behind_it(monkeypatch):
    """Split-K finish: one ``torch.zeros`` of M x N fp32 partial sums plus one int32 count per output tile (the same
    storage, so one memset), a bf16 output straight from the kernel, FINISH on and ATOMIC off."""
    m, n, k = 100, 1000, 4096
    cfg = fp4_gluon_plan.GluonConfig(64, 64, 4, 4, upcast="packed", finish=True)
    [(grid, args, kwargs)] = _recorded_gluon_launch(monkeypatch, m, n, k, cfg)
    tiles = -(-m // 64) * -(-n // 64)
    assert grid == (tiles, 4)
    ws, counts = args[10], args[11]
    assert ws.dtype == torch.float32 and ws.numel() == m * n + tiles and not ws.any()
    assert counts.dtype == torch.int32 and counts.numel() == tiles and not counts.any()
    assert counts.untyped_storage().data_ptr() == ws.untyped_storage().data_ptr()
    assert kwargs["FINISH"] and not kwargs["ATOMIC"] and not kwargs["FIXUP"]
    with pytest.raises(TypeError, match="zeroed float32 output"):  # atomics into bf16 are refused, finish is not
        _recorded_gluon_launch(monkeypatch, m, n, k, dataclasses.replace(cfg, finish=False))


def test_gluon_launch_rezero_shares_kept_workspaces_per_stream_and_per_graph_scope(monkeypatch):
    """Finish with ``rezero``: the kernel's last splits zero the workspace again, so eager launches on one stream
    share one zeroed workspace (replaced by a larger one when a launch needs more) and allocate nothing per launch;
    another stream has its own; a capture outside ``graph_scope`` zeroes a workspace of its own with REZERO off; in
    the scope the warm-up grows the device's graph workspace (never the eager one's) and the capture uses it on its
    first stream only, falling back to a zeroed workspace of its own on a second stream or past the warm-up's size,
    and a larger graph workspace keeps the older one alive for the graphs captured on it."""
    from types import SimpleNamespace
    from musecore_cuda.kernels import finish_workspace
    for name in ("_EAGER", "_GRAPH", "_CAPTURE_STREAM"):
        monkeypatch.setattr(finish_workspace, name, {})
    now = {"stream": 7, "capturing": False}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=now["stream"]))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: now["capturing"])
    cfg = fp4_gluon_plan.GluonConfig(64, 64, 4, 4, upcast="packed", finish=True, rezero=True)
    n, k = 1000, 4096

    def launch(m):
        [(_, args, kwargs)] = _recorded_gluon_launch(monkeypatch, m, n, k, cfg)
        tiles = -(-m // 64) * -(-n // 64)
        ws, counts = args[10], args[11]
        assert ws.numel() == m * n + tiles and counts.numel() == tiles and not ws.any(), (m, ws.numel())
        return ws.untyped_storage().data_ptr(), kwargs["REZERO"]

    first = launch(100)
    assert first[1] and launch(37) == first  # smaller: the same workspace, no allocation
    grown = launch(256)
    assert grown[1] and grown[0] != first[0] and launch(100) == grown  # larger: replaced once, then shared
    assert not finish_workspace._GRAPH  # outside the scope no graph workspace
    now["stream"] = 8
    other = launch(100)
    assert other[1] and other[0] != grown[0]  # another stream: its own
    now["capturing"] = True
    captured = launch(100)
    assert not captured[1] and captured[0] not in (grown[0], other[0])  # a capture: a workspace of its own, zeroed
    with finish_workspace.graph_scope():
        now["capturing"] = False
        warm = launch(100)  # the warm-up: the stream's eager workspace, and the graph workspace grown beside it
        assert warm == other and len(finish_workspace._GRAPH[0]) == 1
        graph_ws = finish_workspace._GRAPH[0][0].untyped_storage().data_ptr()
        now["capturing"] = True
        assert launch(100) == (graph_ws, True) and launch(37) == (graph_ws, True)  # captured: the graph workspace
        assert launch(256)[1] is False  # past the warm-up's size: a zeroed workspace of its own
        now["stream"] = 9
        assert launch(37)[1] is False  # a second stream of the capture: its own too
        now["capturing"] = False
        launch(256)  # the next warm-up grows it: a new graph workspace, the old one kept for the graph captured on it
        assert [w.untyped_storage().data_ptr() for w in finish_workspace._GRAPH[0]][0] == graph_ws
        assert len(finish_workspace._GRAPH[0]) == 2
        now["capturing"] = True
        assert launch(37)[0] == finish_workspace._GRAPH[0][1].untyped_storage().data_ptr()  # stream 9 binds now
    assert launch(100)[1] is False  # the scope closed: captures zero their own again
    assert not fp4_gluon_plan.GluonConfig(64, 64, 1, 4, upcast="packed", finish=True, rezero=True).rezero  # no split
    assert fp4_gluon_plan.GluonConfig.parse(cfg.label()) == cfg and cfg.label().endswith(",finish,rezero")


def test_gluon_launch_passes_pair_late_ahead_and_refuses_odd_chunks_in_pairs(monkeypatch):
    cfg = fp4_gluon_plan.GluonConfig(64, 64, 1, 8, upcast="packed", pair=True, late=True, ahead=2)
    [(_, _, kwargs)] = _recorded_gluon_launch(monkeypatch, 64, 128, 4096, cfg)
    assert (kwargs["PAIR"], kwargs["LATE"], kwargs["AHEAD"]) == (2, True, 2)
    [(_, _, kwargs)] = _recorded_gluon_launch(monkeypatch, 64, 128, 4096, fp4_gluon_plan.GluonConfig(64, 64, 1, 4))
    assert (kwargs["PAIR"], kwargs["LATE"], kwargs["AHEAD"]) == (1, False, 1)
    with pytest.raises(ValueError, match="two at a time"):  # 4096 / 128 / 32 = 1 chunk per split
        _recorded_gluon_launch(monkeypatch, 64, 128, 4096, fp4_gluon_plan.GluonConfig(64, 64, 32, 4, upcast="packed",
                                                                                       finish=True, pair=True))
