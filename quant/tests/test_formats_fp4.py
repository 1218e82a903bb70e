"""E2M1 element codec: FORMATS.md vectors, both rounding rules, saturation, packing."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from musecore_quant.formats.fp4 import e2m1_table, fp4_decode, fp4_encode, pack_nibbles, unpack_nibbles


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)  # fixed data; the assertions hold for any seed, a failure must reproduce


MIDPOINTS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def test_formats_md_packing_vector_gives_bytes_c2_71():
    codes = fp4_encode(torch.tensor([1.0, -2.0, 0.5, 6.0]))
    assert codes.tolist() == [0x2, 0xC, 0x1, 0x7]
    assert pack_nibbles(codes).tolist() == [0xC2, 0x71]
    assert fp4_decode(unpack_nibbles(torch.tensor([0xC2, 0x71], dtype=torch.uint8))).tolist() == [1.0, -2.0, 0.5, 6.0]


def test_round_half_even_ties_follow_modelopt():
    decoded = fp4_decode(fp4_encode(torch.tensor(MIDPOINTS), "rne")).tolist()
    assert decoded == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    negative = fp4_decode(fp4_encode(-torch.tensor(MIDPOINTS), "rne")).tolist()
    assert negative == [0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]


def test_ties_away_rounding_follows_aiter():
    decoded = fp4_decode(fp4_encode(torch.tensor(MIDPOINTS), "away")).tolist()
    assert decoded == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_values_beyond_six_saturate_to_six():
    codes = fp4_encode(torch.tensor([6.0, 7.0, 1e30, -8.0, -1e30]))
    assert codes.tolist() == [0x7, 0x7, 0x7, 0xF, 0xF]


def test_negative_zero_encodes_as_0x0_like_modelopt_but_small_negatives_keep_sign():
    codes = fp4_encode(torch.tensor([-0.0, 0.0, -0.1]))
    assert codes.tolist() == [0x0, 0x0, 0x8]


def test_bf16_and_fp16_inputs_encode_like_fp32():
    x = torch.randn(1000) * 4
    for dtype in (torch.bfloat16, torch.float16):
        y = x.to(dtype)
        assert torch.equal(fp4_encode(y), fp4_encode(y.float()))


def test_unknown_rounding_is_an_error_listing_choices():
    with pytest.raises(ValueError, match="'rne'.*'away'"):
        fp4_encode(torch.zeros(2), rounding="nearest")


def test_pack_nibbles_rejects_odd_length():
    with pytest.raises(ValueError, match="even last dimension"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=9),
                  elements=st.floats(-12, 12, width=32)),
       st.sampled_from(["rne", "away"]))
def test_encode_picks_a_nearest_grid_value_and_breaks_ties_by_rule(values, rounding):
    x = torch.from_numpy(values)
    decoded = fp4_decode(fp4_encode(x, rounding))
    grid = e2m1_table()
    distances = (x.unsqueeze(-1) - grid).abs()
    best = distances.amin(dim=-1)
    error = (x - decoded).abs()
    assert torch.equal(error, best), f"max excess over nearest: {(error - best).max().item()}"
    ties = torch.isin(x.abs(), torch.tensor(MIDPOINTS))
    if ties.any():
        magnitude = decoded[ties].abs()
        if rounding == "away":
            assert bool((magnitude > x[ties].abs()).all()), f"ties {x[ties]} -> {decoded[ties]}"
        else:
            codes = fp4_encode(x[ties], rounding)
            assert bool(((codes & 1) == 0).all()), f"RNE ties {x[ties]} -> odd codes {codes}"


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 8).map(lambda n: 2 * n)),
                  elements=st.integers(0, 15)))
def test_unpack_inverts_pack(codes):
    c = torch.from_numpy(codes)
    packed = pack_nibbles(c)
    assert packed.shape[-1] == c.shape[-1] // 2
    assert torch.equal(unpack_nibbles(packed), c)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6)))
def test_pack_inverts_unpack_for_any_byte(packed):
    b = torch.from_numpy(packed)
    assert torch.equal(pack_nibbles(unpack_nibbles(b)), b)


def test_decode_covers_all_sixteen_codes():
    values = fp4_decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert values == [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
