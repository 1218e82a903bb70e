"""aiter's preshuffled MXFP4 weight and E8M0 scale layouts: bijections with tested inverses, equal to
aiter's own ``shuffle_weight`` / ``shuffle_scale`` where AMD's aiter is importable."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from musecore_rocm.aiter_adapter import (shuffle_scale, shuffle_scale_a16w4, shuffle_weight, shuffle_weight_a16w4,
                                         unshuffle_scale, unshuffle_scale_a16w4, unshuffle_weight,
                                         unshuffle_weight_a16w4)


@pytest.mark.parametrize("shape", [(32, 64), (3, 48, 128), (256, 2048)])
def test_weight_shuffle_is_a_bijection_and_unshuffle_undoes_it(shape):
    ids = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)  # every position distinct
    shuffled = shuffle_weight(ids)
    assert shuffled.shape == ids.shape
    assert torch.equal(shuffled.flatten().sort().values, ids.flatten())  # a permutation: nothing lost or repeated
    assert not torch.equal(shuffled, ids)
    assert torch.equal(unshuffle_weight(shuffled), ids)


@pytest.mark.parametrize("shape", [(256, 8), (300, 20), (4096, 128)])
def test_scale_shuffle_is_a_bijection_on_the_padded_tensor_and_unshuffle_undoes_it(shape):
    rows, cols = shape
    ids = torch.arange(1, rows * cols + 1, dtype=torch.int64).reshape(shape)
    shuffled = shuffle_scale(ids)
    assert shuffled.shape == ((rows + 255) // 256 * 256, (cols + 7) // 8 * 8)
    nonzero = shuffled[shuffled != 0]
    assert torch.equal(nonzero.sort().values, ids.flatten())  # each scale exactly once, padding zeros
    assert torch.equal(unshuffle_scale(shuffled, rows, cols), ids)


@pytest.mark.parametrize("gate_up", [True, False])
@pytest.mark.parametrize("shape", [(2, 64, 64), (3, 32, 128)])
def test_a16w4_weight_shuffle_is_a_bijection_with_its_inverse(shape, gate_up):
    ids = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)
    shuffled = shuffle_weight_a16w4(ids, gate_up)
    assert shuffled.shape == ids.shape and not torch.equal(shuffled, ids)
    assert torch.equal(shuffled.flatten().sort().values, ids.flatten())
    assert torch.equal(unshuffle_weight_a16w4(shuffled, gate_up), ids)


@pytest.mark.parametrize("gate_up", [True, False])
def test_a16w4_weight_shuffle_puts_each_byte_where_aiters_tile_order_says(gate_up):
    """Independent of the view/permute code: aiter's interleaved order (E, N0, [gate|up], K0, KLane 4, NLane 16,
    KPack 16) written out as an index formula, checked on every byte of a small tensor."""
    E, N, KB = 2, 64, 128
    ids = torch.arange(E * N * KB, dtype=torch.int64).reshape(E, N, KB)
    flat = shuffle_weight_a16w4(ids, gate_up).flatten()
    rows = N // 2 if gate_up else N
    N0, K0 = rows // 16, KB // 64
    for e in range(E):
        for r in range(N):
            g, rr = (r // rows, r % rows)
            for c in range(0, KB, 7):
                n0, nl, k0, kl, kp = rr // 16, rr % 16, c // 64, (c % 64) // 16, c % 16
                if gate_up:
                    at = (((((e * N0 + n0) * 2 + g) * K0 + k0) * 4 + kl) * 16 + nl) * 16 + kp
                else:
                    at = ((((e * N0 + n0) * K0 + k0) * 4 + kl) * 16 + nl) * 16 + kp
                assert flat[at] == ids[e, r, c], (e, r, c)


@pytest.mark.parametrize("gate_up", [True, False])
def test_a16w4_scale_shuffle_is_a_bijection_placed_as_aiter_says(gate_up):
    E, n, k = 2, 64, 16  # rows per expert (2I for gate/up), K/32 scale columns
    ids = torch.arange(E * n * k, dtype=torch.int64).reshape(E * n, k)
    shuffled = shuffle_scale_a16w4(ids, E, gate_up)
    assert torch.equal(shuffled.flatten().sort().values, ids.flatten())
    assert torch.equal(unshuffle_scale_a16w4(shuffled, E, gate_up), ids)
    flat, N1, K1 = shuffled.flatten(), n // 32, k // 8
    for e in range(E):
        for r in range(n):
            for c in range(k):
                k1, kp, kl = c // 8, (c % 8) // 4, c % 4
                if gate_up:  # rows: [gate | up] halves, each N1 x 16 lanes -> (e, n1, k1, kl, nl, kp, half)
                    half, rr = r // (n // 2), r % (n // 2)
                    n1, nl, last = rr // 16, rr % 16, half
                else:        # rows: N1 x (2 packs x 16 lanes) -> (e, n1, k1, kl, nl, kp, pack)
                    n1, last, nl = r // 32, (r % 32) // 16, r % 16
                at = ((((((e * N1 + n1) * K1 + k1) * 4 + kl) * 16 + nl) * 2 + kp) * 2) + last
                assert flat[at] == ids[e * n + r, c], (e, r, c)


def test_a16w4_layouts_refuse_shapes_that_are_no_permutation():
    with pytest.raises(ValueError, match="a16w4 scale shuffle"):
        shuffle_scale_a16w4(torch.zeros(64, 12, dtype=torch.uint8), 1, False)  # K/32 % 8 != 0: aiter pads
    with pytest.raises(ValueError, match="a16w4 weight shuffle"):
        shuffle_weight_a16w4(torch.zeros(1, 24, 64, dtype=torch.uint8), True)


def test_layouts_equal_aiters_own_functions():
    if importlib.util.find_spec("aiter") is None:
        pytest.skip("AMD's aiter is not installed: the layouts are checked against its definition only where it is")
    try:
        from aiter.ops.shuffle import shuffle_scale as aiter_scale
        from aiter.ops.shuffle import shuffle_weight as aiter_weight
    except Exception as exc:  # PyPI's unrelated 'aiter', or aiter without its HIP extensions
        pytest.skip(f"aiter's shuffles are not importable here ({type(exc).__name__}: {exc})")
    w = torch.randint(0, 256, (64, 256), dtype=torch.uint8)
    s = torch.randint(100, 140, (300, 20), dtype=torch.uint8)
    assert torch.equal(shuffle_weight(w), aiter_weight(w, layout=(16, 16)))
    assert torch.equal(shuffle_scale(s), aiter_scale(s))
    from aiter.ops.shuffle import shuffle_scale_a16w4 as aiter_scale_a16w4
    from aiter.ops.shuffle import shuffle_weight_a16w4 as aiter_weight_a16w4
    w3 = torch.randint(0, 256, (2, 64, 128), dtype=torch.uint8)
    s2 = torch.randint(100, 140, (2 * 64, 16), dtype=torch.uint8)
    for gate_up in (True, False):
        assert torch.equal(shuffle_weight_a16w4(w3, gate_up), aiter_weight_a16w4(w3, 16, gate_up))
        assert torch.equal(shuffle_scale_a16w4(s2, 2, gate_up), aiter_scale_a16w4(s2, 2, gate_up))
