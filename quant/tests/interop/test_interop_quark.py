"""MXFP4 against amd-quark 0.13's own quantization functions, on CPU.

Skipped unless ``quark.torch`` is importable: ``pip install --no-deps amd-quark`` plus what its
import needs (onnx, protobuf, ml_dtypes, onnxslim, ninja; its hw_emulation C++ extension is
JIT-compiled on first import). Two Quark paths are compared:

- the export path (``RealQuantizer.to_real_quantize_params``): scale ``even_round(amax, "fp4")``
  (EVEN), elements by ``real_quantize_fp4_fp6_per_group`` (the C++ ``fake_quantize_to_low_precision_fp``,
  round half to even), packed by ``Pack_fp4``, scale bytes by ``to_e8m0_uint8``. Equal to our
  default ``mxfp4_quantize(w)`` byte for byte in the scales and in every element code except one
  by-design difference: a negative value that rounds to zero is +0 (0x0) for Quark's C++ cast and
  -0 (0x8) for us (ModelOpt's sign rule, FORMATS.md); both decode to 0, so values are equal.
- ``downcast_to_mxfp_torch`` with ``DequantScaleRoundingMode.EVEN``, the torch reference of Quark's
  Triton MX kernel: the same EVEN scale bytes, elements rounded half away from zero. Equal to our
  ``rounding="away"`` byte for byte (and different from RNE exactly at the ties).
"""

import pytest
import torch

pytest.importorskip("quark.torch", reason="amd-quark is not installed (pip install --no-deps amd-quark + deps)")

from quark.torch.kernel.hw_emulation.hw_emulation_interface import real_quantize_fp4_fp6_per_group  # noqa: E402
from quark.torch.kernel.mx.triton import DequantScaleRoundingMode, downcast_to_mxfp_torch  # noqa: E402
from quark.torch.quantization.utils import even_round  # noqa: E402
from quark.torch.utils.numerics import to_e8m0_uint8  # noqa: E402
from quark.torch.utils.pack import Pack_fp4  # noqa: E402

import musecore_quant  # noqa: E402
from musecore_quant.formats.fp4 import fp4_decode, unpack_nibbles  # noqa: E402

CASES = [(0, (64, 512), torch.bfloat16), (1, (96, 256), torch.float32), (2, (32, 1024), torch.bfloat16),
         (3, (128, 128), torch.float32)]
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _weight(seed, shape, dtype):
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-6, 6, shape[0]).view(-1, 1)            # many binades: every EVEN case
    return (torch.randn(*shape, generator=g) * rows).to(dtype)


def _ties_weight():
    # Every tie and its neighbours, both signs, in blocks whose amax (6 or 4*2^k) fixes the scale so
    # that the tie values land exactly on E2M1 midpoints; plus a block with amax 7 (EVEN rounds up).
    vals = TIES + [-t for t in TIES] + [0.5, 1.0, 3.0, -6.0, 6.0, 0.1, -0.1, 0.0, -0.2, 0.2]
    block = torch.tensor(vals + [0.0] * (32 - len(vals)))
    rows = [block * 2.0 ** k for k in (-3, 0, 5)]
    rows.append(torch.tensor([7.0, -3.3, 1.25, 0.3, 2.5, 5.0, -0.75, 0.1] + [0.0] * 24))   # FORMATS.md vector
    return torch.stack(rows)


def _quark_export(w: torch.Tensor):
    """What Quark's HF export writes for a weight with fp4 per_group(32) e8m0 EVEN, round_method half_even."""
    amax = w.float().unflatten(-1, (-1, 32)).abs().amax(-1)
    scale = even_round(amax, "fp4")                                        # fp32 powers of two
    codes = real_quantize_fp4_fp6_per_group(w, scale, axis=-1, group_size=32, quant_dtype="fp4")
    data = Pack_fp4(None, "fp4").pack(codes.float().reshape(w.shape), reorder=False)
    return data.to(torch.uint8), to_e8m0_uint8(scale)


def _quark_triton_reference(w: torch.Tensor):
    return downcast_to_mxfp_torch(w, torch.uint8, axis=-1, DEQUANT_SCALE_ROUNDING_MODE=DequantScaleRoundingMode.EVEN)


@pytest.mark.parametrize("seed,shape,dtype", CASES)
def test_mxfp4_default_bytes_match_quark_export(seed, shape, dtype):
    w = _weight(seed, shape, dtype)
    data, scale = _quark_export(w)
    ours = musecore_quant.quantize(w, "mxfp4")
    assert torch.equal(scale, ours.scale), f"{(scale != ours.scale).sum().item()} scale bytes differ"
    _assert_equal_up_to_negative_zero(data, ours.data)


def _assert_equal_up_to_negative_zero(quark_data, our_data):
    """Quark's C++ cast writes +0 (0x0) for a negative value that rounds to zero, we (as ModelOpt)
    keep the sign (0x8); both decode to 0. That is the only difference allowed."""
    theirs, ours = unpack_nibbles(quark_data), unpack_nibbles(our_data)
    differ = theirs != ours
    assert bool((ours[differ] == 0x8).all() & (theirs[differ] == 0x0).all()), "codes differ beyond the sign of zero"
    assert torch.equal(fp4_decode(theirs), fp4_decode(ours))


@pytest.mark.parametrize("seed,shape,dtype", CASES)
def test_mxfp4_ties_away_bytes_match_quark_triton_reference(seed, shape, dtype):
    w = _weight(seed, shape, dtype)
    data, scale = _quark_triton_reference(w)
    ours = musecore_quant.quantize(w, "mxfp4", rounding="away")
    assert torch.equal(scale, ours.scale)
    assert torch.equal(data, ours.data), f"{(data != ours.data).sum().item()} of {data.numel()} bytes differ"


def test_mxfp4_ties_match_both_quark_paths():
    w = _ties_weight()
    rne, away = musecore_quant.quantize(w, "mxfp4"), musecore_quant.quantize(w, "mxfp4", rounding="away")
    export_data, export_scale = _quark_export(w)
    triton_data, triton_scale = _quark_triton_reference(w)
    assert torch.equal(export_scale, rne.scale) and torch.equal(triton_scale, rne.scale)
    assert rne.scale.tolist() == [[127 - 3], [127], [127 + 5], [128]]
    _assert_equal_up_to_negative_zero(export_data, rne.data)
    # -0.1 (index 20) rounds to zero: +0 from Quark, -0 from us
    assert unpack_nibbles(export_data)[0, 20].item() == 0x0 and unpack_nibbles(rne.data)[0, 20].item() == 0x8
    assert torch.equal(triton_data, away.data)
    assert not torch.equal(rne.data, away.data)          # the two Quark paths differ exactly at ties
    # FORMATS.md vector: EVEN -> byte 128, RNE bytes b6 01 42 09, ties-away codes 6 B 1 0 3 5 9 0.
    assert export_data[3, :4].tolist() == [0xB6, 0x01, 0x42, 0x09]
    assert triton_data[3, :4].tolist() == [0xB6, 0x01, 0x53, 0x09]


def test_mxfp4_dequantization_matches_quark_fake_quant_values():
    w = _weight(0, (64, 512), torch.float32)
    amax = w.unflatten(-1, (-1, 32)).abs().amax(-1)
    scale = even_round(amax, "fp4")
    codes = real_quantize_fp4_fp6_per_group(w, scale, axis=-1, group_size=32, quant_dtype="fp4")
    theirs = (codes.float().reshape(w.shape).unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2)
    assert torch.equal(theirs, musecore_quant.dequantize(musecore_quant.quantize(w, "mxfp4")))
