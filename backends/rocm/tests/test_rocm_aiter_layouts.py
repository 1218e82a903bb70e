"""aiter's preshuffled MXFP4 weight and E8M0 scale layouts: bijections with tested inverses, equal to
aiter's own ``shuffle_weight`` / ``shuffle_scale`` where AMD's aiter is importable."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from musecore_rocm.aiter_adapter import shuffle_scale, shuffle_weight, unshuffle_scale, unshuffle_weight


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
