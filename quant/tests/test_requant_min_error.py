"""Least-error quantization at load (formats/requant.py ``quantize_min_error``): never worse than the
producer's rule per block, the same layout, and the producer modes' bytes untouched."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from formats_md_vectors import FORMATS_MD_ROW
from musecore_quant import dequantize, quantize, requantize
from musecore_quant.formats.fp4 import fp4_decode, fp4_encode
from musecore_quant.formats.int4 import int4_quantize, int4_quantize_min_error
from musecore_quant.formats.mxfp4 import (MXFP4_BLOCK_SIZE, e8m0_to_float, fp4_round, mxfp4_quantize,
                                          mxfp4_quantize_min_error, search_shared_exponent)
from musecore_quant.formats.nvfp4 import nvfp4_dequantize, nvfp4_quantize
from musecore_quant.formats.requant import quantize_min_error

# Blocks of 32 with magnitudes over many binades, zeros and outliers (what makes EVEN-1 win).
_BLOCKS = hnp.arrays(np.float32, (4, 64), elements=st.one_of(
    st.floats(-8.0, 8.0, width=32), st.floats(-2.0 ** -10, 2.0 ** -10, width=32), st.just(0.0),
    st.floats(-300.0, 300.0, width=32)))
_SCALES = st.sampled_from([2.0 ** -30, 2.0 ** -10, 1.0, 3.0, 2.0 ** 20])


def _block_errors(x: torch.Tensor, approx: torch.Tensor, block: int) -> torch.Tensor:
    """float64 squared error per block of the last dim."""
    return (approx.double() - x.double()).square().unflatten(-1, (-1, block)).sum(-1)


@settings(max_examples=80, deadline=None)
@given(_BLOCKS, _SCALES)
def test_mxfp4_search_is_never_worse_than_even_in_any_block(values, scale):
    x = torch.from_numpy(values) * scale
    even = dequantize(mxfp4_quantize(x, scale_mode="even"))
    searched = dequantize(mxfp4_quantize(x, scale_mode="mse"))
    e_even, e_search = _block_errors(x, even, 32), _block_errors(x, searched, 32)
    worse = e_search > e_even  # exact float64 comparison, no tolerance
    assert not bool(worse.any()), (f"blocks worse than EVEN: {worse.nonzero().tolist()}; searched "
                                   f"{e_search[worse].tolist()} vs EVEN {e_even[worse].tolist()}")


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, (8, 64), elements=st.floats(-4.0, 4.0, width=32)))
def test_nvfp4_requantized_by_search_is_never_worse_than_even_against_the_nvfp4_values(values):
    nv = nvfp4_quantize(torch.from_numpy(values))
    replaced = nvfp4_dequantize(nv)
    even = dequantize(requantize(nv, "mxfp4"))
    searched = dequantize(requantize(nv, "mxfp4", scale_mode="mse"))
    e_even, e_search = _block_errors(replaced, even, 32), _block_errors(replaced, searched, 32)
    assert bool((e_search <= e_even).all()), f"max excess {(e_search - e_even).max().item():.3e}"


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, (3, 256), elements=st.one_of(
    st.floats(-2.0, 2.0, width=32), st.just(0.0), st.floats(-50.0, 50.0, width=32))))
def test_int4_scale_search_is_never_worse_than_rtn_in_any_group(values):
    x = torch.from_numpy(values)
    rtn = dequantize(int4_quantize(x, group_size=128, sym=True))
    searched_qt, err = int4_quantize_min_error(x, group_size=128)
    searched = dequantize(searched_qt)
    e_rtn, e_search = _block_errors(x, rtn, 128), _block_errors(x, searched, 128)
    # The search measures in fp32 and keeps RTN unless a shrink wins by 1e-5 relative; 1e-6
    # relative here is float64 re-summation of the same fp32 values.
    slack = 1e-6 * e_rtn + 1e-30
    assert bool((e_search <= e_rtn + slack).all()), (f"groups worse than RTN: {(e_search - e_rtn).max().item():.3e}"
                                                     f" (tolerance {slack.max().item():.3e})")
    assert err.squared_error <= err.producer_squared_error * (1 + 1e-6), err


def test_search_reports_its_error_and_evens_as_measured():
    x = torch.randn(64, 256) * torch.rand(64, 1)
    qt, err = mxfp4_quantize_min_error(x)
    even = dequantize(mxfp4_quantize(x))
    measured = float((dequantize(qt).double() - x.double()).square().sum())
    measured_even = float((even.double() - x.double()).square().sum())
    assert math.isclose(err.squared_error, measured, rel_tol=1e-5), (err, measured)
    assert math.isclose(err.producer_squared_error, measured_even, rel_tol=1e-5), (err, measured_even)


def test_search_codes_are_the_rne_codes_at_the_chosen_exponent():
    x = torch.randn(32, 128) * 5
    x[0, :6] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30, 6.0, -7.0])
    qt = mxfp4_quantize(x, scale_mode="mse")
    blocks = x.unflatten(-1, (-1, MXFP4_BLOCK_SIZE))
    expected = fp4_encode(blocks / e8m0_to_float(qt.scale).unsqueeze(-1)).flatten(-2)
    from musecore_quant.formats.fp4 import unpack_nibbles
    assert torch.equal(unpack_nibbles(qt.data), expected)


def test_fp4_round_equals_encode_then_decode_including_every_tie():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 100.0])
    y = torch.cat([torch.linspace(-9, 9, 20001), ties, -ties])
    got, want = fp4_round(y), fp4_decode(fp4_encode(y))
    mismatch = (got != want).nonzero().flatten()
    assert mismatch.numel() == 0, f"{mismatch.numel()} values differ, first {y[mismatch[:5]].tolist()}"


def test_producer_modes_keep_their_bytes():
    # FORMATS.md's torchao vector: EVEN -> byte 128, codes 6 B 1 0 2 4 9 0.
    block = torch.tensor([[7.0, -3.3, 1.25, 0.3, 2.5, 5.0, -0.75, 0.1] + [0.0] * 24])
    even = mxfp4_quantize(block)
    assert even.scale.tolist() == [[128]] and even.data[0, :4].tolist() == [0xB6, 0x01, 0x42, 0x09]
    floor = mxfp4_quantize(block, scale_mode="floor")
    assert floor.scale.tolist() == [[127]] and floor.data[0, :4].tolist() == [0xD7, 0x12, 0x64, 0x0A]
    # The default requantization is still EVEN (Quark parity), whatever the load-time search does.
    nv = nvfp4_quantize(FORMATS_MD_ROW.repeat(1, 2))
    default, explicit = requantize(nv, "mxfp4"), mxfp4_quantize(nvfp4_dequantize(nv), scale_mode="even")
    assert torch.equal(default.data, explicit.data) and torch.equal(default.scale, explicit.scale)
    w = torch.randn(16, 256)
    rtn = quantize(w, "int4", group_size=128, sym=True)
    assert torch.equal(rtn.data, int4_quantize(w).data) and torch.equal(rtn.scale, int4_quantize(w).scale)


def test_quantize_min_error_names_the_formats_it_searches():
    with pytest.raises(ValueError, match="mxfp4"):
        quantize_min_error(torch.randn(4, 32), "fp8")


def test_searched_exponent_is_even_or_the_one_below():
    x = torch.randn(16, 8, 32) * 3
    exponent, err, err_even = search_shared_exponent(x)
    even = mxfp4_quantize(x.flatten(-2), scale_mode="even").scale.to(torch.int32).view(16, 8) - 127
    assert set((exponent - even).unique().tolist()) <= {-1, 0}
    assert bool((err <= err_even).all())
