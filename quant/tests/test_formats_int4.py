"""INT4 weight-only: AutoRound RTN conventions, error bound, GPTQ/AWQ layouts and their vectors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from musecore_quant import QTensor
from musecore_quant.formats.fp4 import pack_nibbles, unpack_nibbles
from musecore_quant.formats.int4 import (int4_dequantize, int4_from_awq, int4_from_gptq, int4_quantize,
                                         int4_to_awq, int4_to_gptq)


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # fixed data; the assertions hold for any seed, a failure must reproduce


def _qtensor(codes: torch.Tensor, group_size: int, zero=None, scale=None) -> QTensor:
    out, k = codes.shape[-2:]
    if scale is None:
        scale = torch.ones(*codes.shape[:-1], k // group_size, dtype=torch.float16)
    return QTensor(format="int4", data=pack_nibbles(codes), scale=scale, shape=tuple(codes.shape),
                   group_size=group_size, zero=zero)


def _as_u32(word: torch.Tensor) -> int:
    return word.item() & 0xFFFFFFFF


def test_gptq_vector_q_0_to_7_along_in_packs_to_0x76543210():
    codes = torch.arange(8, dtype=torch.uint8).repeat(8, 1)                 # [out=8, in=8], q = k
    packed = int4_to_gptq(_qtensor(codes, group_size=8))
    assert _as_u32(packed["qweight"][0, 0]) == 0x76543210
    assert packed["qweight"].shape == (1, 8) and packed["qweight"].dtype == torch.int32


def test_gptq_symmetric_zeros_are_stored_as_0x77777777():
    packed = int4_to_gptq(_qtensor(torch.zeros(8, 16, dtype=torch.uint8), group_size=8))
    assert packed["qzeros"].shape == (2, 1)
    assert all(_as_u32(w) == 0x77777777 for w in packed["qzeros"].flatten())
    assert packed["g_idx"].tolist() == [0] * 8 + [1] * 8


def test_awq_vector_q_0_to_7_along_out_packs_to_0x75316420():
    codes = torch.arange(8, dtype=torch.uint8).unsqueeze(1).repeat(1, 8)   # [out=8, in=8], q = n
    packed = int4_to_awq(_qtensor(codes, group_size=8))
    assert _as_u32(packed["qweight"][0, 0]) == 0x75316420
    assert int4_from_awq(**packed).data.equal(pack_nibbles(codes))


def test_gptq_reader_adds_one_back_to_stored_zeros():
    qweight = torch.zeros(2, 8, dtype=torch.int32)
    qzeros = torch.full((1, 1), 0x77777777, dtype=torch.int32)
    scales = torch.ones(1, 8, dtype=torch.float16)
    assert int4_from_gptq(qweight, qzeros, scales).zero is None                  # 7 + 1 = 8: symmetric
    true_zero = int4_from_gptq(qweight, qzeros, scales, zero_minus_one=False)   # auto_round / GPTQ v2
    assert true_zero.zero.eq(7).all()
    wrapped = int4_from_gptq(qweight, torch.full((1, 1), -1, dtype=torch.int32), scales)  # 0xF + 1 = 0
    assert wrapped.zero.eq(0).all()


def test_act_order_g_idx_is_refused_with_a_clear_error():
    qt = int4_quantize(torch.randn(8, 32), group_size=16)
    packed = int4_to_gptq(qt)
    packed["g_idx"] = packed["g_idx"].flip(0)
    with pytest.raises(ValueError, match="act-order GPTQ checkpoints are not supported"):
        int4_from_gptq(**packed)


def test_symmetric_scale_is_negative_when_the_positive_extreme_is_larger_and_maps_to_minus_eight():
    w = torch.tensor([[4.0, -1.0, 0.5, 2.0] * 8])                               # one group of 32
    qt = int4_quantize(w, group_size=32, sym=True)
    assert qt.zero is None
    assert qt.scale.item() == -0.5                                             # -4 / 8: never abs()
    codes = unpack_nibbles(qt.data)
    assert codes[0, 0].item() == 0                                             # 4.0 -> q - 8 = -8
    assert torch.equal(int4_dequantize(qt), w)
    flipped = int4_quantize(-w, group_size=32, sym=True)
    assert flipped.scale.item() == 0.5 and torch.equal(int4_dequantize(flipped), -w)


def test_negative_scales_survive_the_gptq_round_trip():
    qt = int4_quantize(torch.tensor([[4.0, -1.0, 0.5, 2.0] * 8] * 8), group_size=32)
    back = int4_from_gptq(**int4_to_gptq(qt))
    assert back.scale.lt(0).all() and torch.equal(int4_dequantize(back), int4_dequantize(qt))


def test_asymmetric_zero_point_makes_zero_exact():
    w = torch.linspace(-0.3, 1.2, 64).reshape(1, 64)
    w[0, 10] = 0.0
    qt = int4_quantize(w, group_size=64, sym=False)
    assert qt.zero.dtype == torch.uint8 and qt.zero.item() == round(0.3 / qt.scale.float().item())
    assert int4_dequantize(qt)[0, 10].item() == 0.0


def test_all_zero_group_is_representable():
    qt = int4_quantize(torch.zeros(2, 128))
    assert torch.equal(int4_dequantize(qt), torch.zeros(2, 128)) and qt.scale.abs().min().item() > 0


def test_group_size_minus_one_means_one_group_per_row():
    qt = int4_quantize(torch.randn(4, 96), group_size=-1)
    assert qt.group_size == 96 and qt.scale.shape == (4, 1)


weights = hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])),
                     elements=st.floats(-100, 100, width=32))


@settings(max_examples=50, deadline=None)
@given(weights, st.booleans(), st.sampled_from([16, 32]))
def test_every_element_is_within_half_a_step_unless_beyond_the_grid(values, sym, group_size):
    w = torch.from_numpy(values)
    qt = int4_quantize(w, group_size=group_size, sym=sym)
    w_hat = int4_dequantize(qt)
    scale = qt.scale.float().repeat_interleave(group_size, dim=-1)
    zero = (qt.zero.float() if qt.zero is not None else torch.full(qt.scale.shape, 8.0))
    zero = zero.repeat_interleave(group_size, dim=-1)
    ends = torch.stack(((0 - zero) * scale, (15 - zero) * scale))
    low, high = ends.amin(0), ends.amax(0)
    beyond = (low - w).clamp(min=0) + (w - high).clamp(min=0)                  # distance past the grid's ends
    excess = (w - w_hat).abs() - (0.5 * scale.abs() + beyond) * (1 + 1e-5)
    assert excess.max().item() <= 1e-6, f"error exceeds half a step by {excess.max().item():.3g}"


def test_a_symmetric_dequantized_weight_is_a_fixed_point():
    once = int4_dequantize(int4_quantize(torch.randn(8, 256)))
    twice = int4_dequantize(int4_quantize(once))
    assert torch.equal(once, twice), f"max change {(once - twice).abs().max().item()}"


layouts = st.tuples(st.integers(1, 2), st.sampled_from([8, 16]), st.sampled_from([(8, 8), (16, 8), (32, 16)]),
                    st.booleans())


@settings(max_examples=40, deadline=None)
@given(layouts, st.randoms(use_true_random=False))
def test_gptq_and_awq_conversions_are_lossless_inverses(layout, rnd):
    experts, out, (k, group_size), symmetric = layout
    gen = torch.Generator().manual_seed(rnd.randint(0, 2 ** 31))
    codes = torch.randint(0, 16, (experts, out, k), generator=gen, dtype=torch.uint8)
    scale = (torch.randn(experts, out, k // group_size, generator=gen)).to(torch.float16)
    zero = None if symmetric else torch.randint(0, 16, (experts, out, k // group_size), generator=gen,
                                                dtype=torch.uint8)
    if zero is not None and zero.eq(8).all():
        zero = None
    qt = _qtensor(codes, group_size, zero=zero, scale=scale)
    for back in (int4_from_gptq(**int4_to_gptq(qt)), int4_from_awq(**int4_to_awq(qt))):
        assert torch.equal(back.data, qt.data) and torch.equal(back.scale, qt.scale)
        assert (back.zero is None) == (qt.zero is None)
        assert back.zero is None or torch.equal(back.zero, qt.zero)
        assert back.group_size == group_size and back.shape == qt.shape


def test_gptq_tensors_have_the_producer_shapes_and_dtypes():
    packed = int4_to_gptq(int4_quantize(torch.randn(64, 256), group_size=128, sym=False))
    assert {k: (v.dtype, tuple(v.shape)) for k, v in packed.items()} == {
        "qweight": (torch.int32, (32, 64)), "qzeros": (torch.int32, (2, 8)),
        "scales": (torch.float16, (2, 64)), "g_idx": (torch.int32, (256,))}


def test_packing_needs_out_features_divisible_by_eight():
    with pytest.raises(ValueError, match="divisible by 8"):
        int4_to_gptq(int4_quantize(torch.randn(4, 32), group_size=32))


def test_inconsistent_gptq_shapes_are_an_error():
    with pytest.raises(ValueError, match="inconsistent GPTQ shapes"):
        int4_from_gptq(torch.zeros(4, 8, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                       torch.ones(1, 16, dtype=torch.float16))


def test_asymmetric_bf16_scale_is_computed_in_bf16_as_autoround_does():
    # AutoRound's quant_tensor_asym on a bf16 weight: (max - min) / 15 rounded to bf16, then fp16.
    # 2 / 15 = 0.13333: bf16 0.1337890625 (exact in fp16), where fp16 of the fp32 quotient is
    # 0.13330078125. The zero point follows: round(1 / 0.13379) = round(7.474) = 7, not round(7.502) = 8.
    w = torch.tensor([[1.0, -1.0, 0.5, -0.25] + [0.0] * 12])
    bf16 = int4_quantize(w.bfloat16(), group_size=16, sym=False)
    assert bf16.scale.item() == 0.1337890625 and bf16.zero.item() == 7
    assert unpack_nibbles(bf16.data)[0, :4].tolist() == [14, 0, 11, 5]
    fp32 = int4_quantize(w, group_size=16, sym=False)
    assert fp32.scale.item() == 0.13330078125 and fp32.zero.item() == 8
    assert unpack_nibbles(fp32.data)[0, :4].tolist() == [15, 0, 12, 6]
    # Symmetric scales are extreme / 8, exact in any dtype: bf16 and fp32 agree.
    assert torch.equal(int4_quantize(w.bfloat16(), group_size=16).scale, int4_quantize(w, group_size=16).scale)
