"""The one-kernel static KV cache write against the reference scatter (``musecore.kv_cache.write_static``)."""

from __future__ import annotations

import pytest
import torch

from musecore.kv_cache import write_static
from musecore_triton.kernels.kv_cache import kv_write
from musecore_triton.testing import DEVICE, SMALL_DTYPES

CACHE_DTYPES = SMALL_DTYPES + [torch.float32, torch.float8_e4m3fn]


def empty_cache(B: int, capacity: int, heads: int, d: int, dtype: torch.dtype):
    k = torch.randn(B, capacity + 1, heads, d, device=DEVICE).to(dtype)
    v = torch.randn(B, capacity + 1, heads, d, device=DEVICE).to(dtype)
    return k, v, torch.full((B, capacity + 1), -1, dtype=torch.long, device=DEVICE)


@pytest.mark.parametrize("heads,d", [(2, 16), (16, 64)], ids=["2x16", "816b-16x64"])
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("ring", [True, False], ids=["ring", "full"])
def test_kv_write_matches_the_reference_scatter(dtype, ring, heads, d):
    """Padding (-1) and positions past a full layer's capacity go to the trash slot; ring positions
    wrap; the new keys are a strided slice of a fused q/k/v projection, the values not even row-contiguous.
    Copies must be exact."""
    B, T, capacity = 2, 4, 6
    pos_new = torch.tensor([[-1, 3, 7, 8], [0, 1, 2, 5]], device=DEVICE)
    if not ring:
        pos_new[0, 3] = 9  # beyond the full layer's capacity: trash
    fused = torch.randn(B, T, 3 * heads * d, device=DEVICE).to(dtype)
    k_new = fused[..., heads * d:2 * heads * d].view(B, T, heads, d)  # strided, rows contiguous
    v_new = fused[..., :2 * heads * d].view(B, T, heads, 2 * d)[..., ::2]  # rows not contiguous: copied first
    want = empty_cache(B, capacity, heads, d, dtype)
    got = tuple(t.clone() for t in want)
    write_static(*want, k_new, v_new, pos_new, capacity, ring)
    kv_write(*got, k_new, v_new, pos_new, capacity, ring)
    for name, w, g in zip(("keys", "values", "positions"), want, got):
        w, g = w[:, :capacity], g[:, :capacity]  # the trash slot's content is whichever write came last
        if w.dtype == torch.float8_e4m3fn:
            w, g = w.view(torch.uint8), g.view(torch.uint8)
        bad = (w != g).sum().item()
        assert bad == 0, f"{name}: {bad} elements differ from the reference scatter ({dtype}, ring={ring})"


def test_kv_write_rejects_buffers_that_are_not_a_static_cache():
    k, v, pos = empty_cache(1, 4, 2, 16, torch.float16)
    new = torch.randn(1, 1, 2, 16, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match="static cache"):
        kv_write(k, v, pos, new, new, torch.zeros(1, 1, dtype=torch.long, device=DEVICE), 5, True)  # capacity + 1 != 5
    with pytest.raises(ValueError, match="static cache"):
        kv_write(k, v, pos, new.float(), new.float(), torch.zeros(1, 1, dtype=torch.long, device=DEVICE), 4, True)
