"""The GEMVs' CPython extension (musecore_xeon.kernels.binding) against the ctypes calls it replaces."""

from __future__ import annotations

import ctypes

import pytest
import torch

from musecore_quant.qtensor import QTensor
from musecore_xeon.kernels import binding, native
from musecore_xeon.kernels.int4 import prepare_int4

needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler: the native INT4 kernels are not built")


def bound_gemv(out_features: int = 37, in_features: int = 512, group_size: int = 128) -> native.Int4Gemv:
    """The bound GEMV of a random INT4 weight (signed scales, random zeros; 37 rows: padded to 40)."""
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=g)
    scale = ((torch.rand(out_features, in_features // group_size, generator=g) - 0.5) * 0.04).half()
    zero = torch.randint(0, 16, scale.shape, dtype=torch.uint8, generator=g)
    qt = QTensor("int4", data, scale, (out_features, in_features), group_size, zero=zero)
    return prepare_int4(qt, torch.float32, calibrate=False).gemv


@needs_native
def test_the_extension_is_built_wherever_the_c_kernels_are() -> None:
    """No silent fallback: with a C compiler (the native kernels) the binding is expected too; say why if not."""
    if binding.cxx_compiler() is None:
        pytest.skip("no C++ compiler: the GEMV is called through ctypes (announced by a RuntimeWarning)")
    assert native.linear_binding() is not None, f"binding not built: {binding.UNAVAILABLE}"
    assert bound_gemv().binding == "extension"


@needs_native
@pytest.mark.parametrize("kind", ["int4", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("leading", [(), (1,), (3,), (2, 2), (0,)])
def test_extension_call_gives_the_same_bits_and_shape_as_the_ctypes_call(kind, dtype, leading) -> None:
    """Both bound GEMVs (INT4: 37 x 512; BF16: 37 x 83, odd K) through the extension and through ctypes."""
    gemv, k = (bound_gemv(), 512) if kind == "int4" else (native.Bf16Gemv(torch.randn(37, 83).to(torch.bfloat16)), 83)
    x = torch.randn(*leading, k).to(dtype)
    y_fast, y_ctypes = gemv(x), gemv.call_ctypes(x)
    assert y_fast.dtype == dtype and y_fast.shape == (*leading, 37) == y_ctypes.shape
    assert torch.equal(y_fast, y_ctypes), f"{kind} {dtype} {leading}: extension and ctypes results differ"


@needs_native
def test_extension_rejects_what_the_ctypes_call_rejects() -> None:
    gemv = bound_gemv()
    if gemv.binding != "extension":
        pytest.skip(f"the binding is not built here: {binding.UNAVAILABLE}")
    bad = {"fp16": torch.randn(1, 512).half(), "wrong K": torch.randn(1, 256), "not contiguous": torch.randn(512, 2).T}
    for name, x in bad.items():
        with pytest.raises(ValueError, match="contiguous bf16/fp32"):
            gemv(x)
        with pytest.raises(ValueError, match="contiguous bf16/fp32"):
            gemv.call_ctypes(x)
    with pytest.raises(ValueError, match="contiguous bf16/fp32"):
        gemv(torch.tensor(1.0))  # a 0-d tensor (the ctypes path fails on x.shape[-1] with an IndexError)
    with pytest.raises(TypeError, match="torch.Tensor"):
        gemv([0.0] * 512)


@needs_native
def test_every_call_returns_a_fresh_output() -> None:
    gemv = bound_gemv()
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    first, second = gemv(x), gemv(x)
    assert first.data_ptr() != second.data_ptr() and torch.equal(first, second)


@needs_native
def test_binding_env_chooses_ctypes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(binding.BINDING_ENV, "0")
    address = ctypes.cast(native.load().musecore_int4_linear, ctypes.c_void_p).value
    assert binding.load.__wrapped__(address, address) is None  # uncached: the environment is read again
    assert binding.UNAVAILABLE[-1] == f"disabled by {binding.BINDING_ENV}"
    monkeypatch.setattr(native, "linear_binding", lambda: None)
    gemv = bound_gemv()
    assert gemv.binding == "ctypes"
    x = torch.randn(2, 512, dtype=torch.bfloat16)
    assert torch.equal(gemv(x), gemv.call_ctypes(x))


@needs_native
def test_without_a_cxx_compiler_the_gemv_goes_through_ctypes_with_a_warning(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(binding.BINDING_ENV, raising=False)
    monkeypatch.setattr(binding, "cxx_compiler", lambda: None)
    address = ctypes.cast(native.load().musecore_int4_linear, ctypes.c_void_p).value
    with pytest.warns(RuntimeWarning, match=r"no C\+\+ compiler .* called through ctypes"):
        assert binding.load.__wrapped__(address, address) is None
