"""The INT4 GEMM on AMX (native_amx_source): its tile layout and its products against the dequantized weight.

These run only where the CPU has AMX-BF16 (Sapphire Rapids and later): elsewhere they skip with the reason. The
GPU machine's host CPU (a 5th-gen Xeon) runs them: ``bash benchmarks/xeon_amx_host.sh``.
"""

from __future__ import annotations

import pytest
import torch

from musecore.testing import assert_nmse
from musecore_xeon.kernels import native
from musecore_xeon.kernels.int4 import prepare_int4, uses_amx

from test_int4 import random_int4

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
def test_amx_is_the_dense_path_and_meets_the_op_tolerance() -> None:
    """With BF16 compute and g = 128 the dense path above the crossover is the AMX GEMM (not the dequantized tiles),
    and its output meets the linear op's tolerance against the reference dequantized matmul."""
    from musecore.ops import tolerance
    from test_int4 import reference_linear
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
