"""The INT4 x BF16 GEMM on AVX512_BF16 (``csrc/bf16dot.c``, ``native.int4_bf16_gemm``) against an fp64 reference.

Reference: the exact weight ``(q - z) * scale`` (``Int4Linear.dequantize``, itself tested equal to the quantizer's
dequantization) times the bf16-rounded activations, in fp64. The kernel's only roundings are fp32 sums (and the
bf16 output, when asked), so the tolerance is an fp32 summation bound per output:

    |y - ref| <= 2^-24 * (g/2 + K/g + 4) * 47 * sum_G |s_G| * sum_{k in G} |x_k|

(a group's ``g/2`` vdpbf16ps steps and ``K/g`` flushes each round once; 47 = 31 + 16 bounds ``16 + q`` plus the
``16 + z`` correction term). A wrong pair order, nibble or group scale gives errors of the order of |w||x|, far
above it. NMSE (fp32 output, Gaussian x) must stay below 1e-10 (measured ~6e-14). The bf16 output must equal the
fp32 output rounded to bf16, and fp32 activations must give the same result as the same activations rounded to
bf16 first (the kernel rounds them, as PyTorch's BF16 GEMM does).
"""

from __future__ import annotations

import pytest
import torch

from musecore_quant.qtensor import QTensor
from musecore_xeon.kernels import native
from musecore_xeon.kernels.int4 import Int4Linear, pack_int4

pytestmark = pytest.mark.skipif(not native.bf16_dot_ready(),
                                reason="this CPU or build has no AVX512_BF16 (the kernel returns -2 there; "
                                       "test_bf16dot_refused_without_avx512_bf16 covers that)")

GROUPS = (32, 64, 128, 256)
NMSE_MAX = 1e-10


def random_weight(n: int, k: int, g: int, seed: int, asymmetric: bool = True) -> Int4Linear:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001) * torch.where(
        torch.rand(n, k // g, generator=gen) < 0.5, -1.0, 1.0)
    zero = torch.randint(0, 16, (n, k // g), dtype=torch.uint8, generator=gen) if asymmetric else None
    qt = QTensor("int4", data, scale.half(), (n, k), g, zero=zero)
    return pack_int4(qt.data, qt.scale, qt.zero, g, torch.bfloat16)


def bound(lin: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """The fp32 summation bound of the module docstring, per output ``[M, N]``."""
    n, k, g = lin.out_features, lin.in_features, lin.group_size
    sz = lin.scale_zero.permute(0, 3, 1, 2).reshape(-1, k // g, 2)[:n, :, 0].double().abs()  # |s| [N, K/g]
    xg = x.bfloat16().double().abs().view(x.shape[0], k // g, g).sum(-1)  # [M, K/g]
    return 2.0 ** -24 * (g / 2 + k / g + 4) * 47 * (xg @ sz.T)


def check(lin: Int4Linear, m: int, what: str, seed: int = 0) -> None:
    k = lin.in_features
    gen = torch.Generator().manual_seed(seed)
    x32 = torch.randn(m, k, generator=gen)
    ref = x32.bfloat16().double() @ lin.dequantize().double().T
    y32 = native.int4_bf16_gemm(lin.bound_gemv(), x32)  # fp32 in, fp32 out
    assert y32.dtype == torch.float32 and y32.shape == (m, lin.out_features)
    err = (y32.double() - ref).abs()
    limit = bound(lin, x32)
    worst = (err / limit).max().item()
    assert worst <= 1.0, f"{what}: |error| reaches {worst:.3g}x the fp32 summation bound (max error {err.max():.3g})"
    nmse = ((err ** 2).sum() / (ref ** 2).sum().clamp_min(1e-300)).item()
    assert nmse <= NMSE_MAX, f"{what}: NMSE {nmse:.3g} > {NMSE_MAX}"
    y16 = native.int4_bf16_gemm(lin.bound_gemv(), x32.bfloat16())  # bf16 in, bf16 out
    assert y16.dtype == torch.bfloat16
    same = torch.equal(y16, y32.bfloat16())
    assert same, (f"{what}: bf16 output differs from the fp32 output rounded to bf16 at "
                  f"{(y16 != y32.bfloat16()).sum().item()} of {y16.numel()} outputs")


@pytest.mark.parametrize("g", GROUPS)
def test_every_group_size_and_odd_shapes(g: int) -> None:
    # N: a single row block, a partial 64-row panel, several panels with a tail; K: one chunk, a block and a tail
    # block (K not a multiple of 256), several blocks
    for n, k in ((4, max(g, 64)), (100, 768 if g <= 256 else 1024), (260, 1280 if g != 256 else 1536), (64, 2048)):
        if k % max(g, 64):
            continue
        lin = random_weight(n, k, g, seed=n + k + g)
        for m in (1, 2, 5, 6, 7, 13):
            check(lin, m, f"g={g} N={n} K={k} M={m}")


@pytest.mark.parametrize("m", [1, 3, 6, 8, 31, 64, 129, 256, 300, 517])
def test_every_m_tail(m: int) -> None:
    # 517 rows: two activation blocks of the kernel (512 + 5); 6-row micro-kernel tails everywhere
    lin = random_weight(132, 512, 128, seed=m)
    check(lin, m, f"g=128 N=132 K=512 M={m}")


def test_symmetric_and_zero_activations() -> None:
    lin = random_weight(64, 512, 64, seed=3, asymmetric=False)
    check(lin, 9, "symmetric g=64")
    y = native.int4_bf16_gemm(lin.bound_gemv(), torch.zeros(4, 512, dtype=torch.bfloat16))
    assert torch.count_nonzero(y).item() == 0, "all-zero activations must give exact zeros"


def test_outliers() -> None:
    lin = random_weight(96, 1024, 128, seed=5)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 1024, generator=gen)
    x[:, ::128] *= 100.0  # one element 100x the rest in every group
    ref = x.bfloat16().double() @ lin.dequantize().double().T
    y = native.int4_bf16_gemm(lin.bound_gemv(), x)
    worst = ((y.double() - ref).abs() / bound(lin, x)).max().item()
    assert worst <= 1.0, f"outliers: |error| reaches {worst:.3g}x the fp32 summation bound"


def test_dense_path_routes_to_it() -> None:
    """On this host the INT4 dense path is this GEMM (no AMX), and Int4Linear above its crossover calls it."""
    lin = random_weight(128, 512, 128, seed=7)
    if lin.amx:
        pytest.skip("AMX host: the dense path is measured between AMX and AVX512_BF16 (test_choices covers the pick)")
    assert lin.bf16_dot and lin.dense_path == "bf16dot"
    lin.crossover = 8
    x = torch.randn(16, 512, dtype=torch.bfloat16)
    assert lin.path(16) == "bf16dot" and lin.path(4) == "native"
    assert torch.equal(lin(x), native.int4_bf16_gemm(lin.bound_gemv(), x))


def test_bf16dot_refused_without_avx512_bf16() -> None:
    """Built for AVX2 only (MUSECORE_XEON_ISA=avx2), the kernel is not there: ready() is 0 and a call returns -2."""
    lib = native.load_variant("avx2")
    if lib is None:
        pytest.skip("no C compiler")
    assert lib.musecore_int4_bf16_ready() == 0
    lin = random_weight(8, 128, 128, seed=1)
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    y = torch.empty(2, 8, dtype=torch.bfloat16)
    assert lib.musecore_int4_bf16_gemm(lin.bound_gemv().args_ptr, x.data_ptr(), 1, y.data_ptr(), 1, 2) == -2
