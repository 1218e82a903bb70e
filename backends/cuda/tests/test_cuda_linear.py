"""W4A16 linear (NVFP4, MXFP4) and dense linear against ``musecore.ops.reference.linear``."""

from __future__ import annotations

import pytest
import torch

import musecore_quant
from musecore.ops import Weight, tolerance
from musecore.ops import reference as ref

from musecore_cuda.testing import DEVICE, SMALL_DTYPES, assert_nmse

from musecore_cuda import CudaBackend
from musecore_cuda.layouts import repack_chunk_halves


def reference_linear(x: torch.Tensor, qt) -> torch.Tensor:
    dense = musecore_quant.dequantize(qt).to(x.device)
    return ref.linear(x.float(), Weight(data=dense, format=qt.format, out_features=dense.shape[0],
                                        in_features=dense.shape[1]))


def test_repack_puts_element_j_and_j_plus_64_in_one_byte():
    codes = torch.randint(0, 16, (3, 256), dtype=torch.uint8)
    canonical = codes[:, 0::2] | (codes[:, 1::2] << 4)
    packed = repack_chunk_halves(canonical)
    for c in range(2):
        chunk = codes[:, c * 128:(c + 1) * 128]
        assert torch.equal(packed[:, c * 64:(c + 1) * 64] & 0xF, chunk[:, :64])
        assert torch.equal(packed[:, c * 64:(c + 1) * 64] >> 4, chunk[:, 64:])


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


def test_activation_quantization_is_refused_not_emulated():
    be = CudaBackend(DEVICE)
    with pytest.raises(NotImplementedError, match="W4A4"):
        be.prepare_weight(musecore_quant.quantize(torch.randn(16, 128), "nvfp4"), "test", act_format="nvfp4")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("shape", [(1024, 8192), (8192, 2048), (10240, 8192)])
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_fp4_linear_at_model_shapes_on_gpu(fmt, shape, m):
    n, k = shape
    w = torch.randn(n, k, device="cuda") * 0.02
    qt = musecore_quant.quantize(w, fmt)
    be = CudaBackend("cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = be.linear(x, be.prepare_weight(qt, "test"))
    assert_nmse(reference_linear(x, qt), y, tolerance("linear"), f"{fmt} {shape} M={m}")
