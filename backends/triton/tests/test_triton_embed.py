"""The decode step's prologue kernel (``musecore_triton.kernels.embed``) against ``MuseModel.embed``'s ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore.rope import RotaryTable
from musecore_triton.kernels.embed import decode_embed
from musecore_triton.testing import DEVICE, SMALL_DTYPES, assert_nmse

ROPES = {"default": {"rope_type": "default", "rope_theta": 10000.0},
         "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512}}


@pytest.mark.parametrize("rope_kind", sorted(ROPES))
@pytest.mark.parametrize("dtype", SMALL_DTYPES)
def test_decode_embed_gives_the_ops_embedding_norms_rotary_rows_and_next_positions(dtype, rope_kind):
    gen = torch.Generator().manual_seed(0)
    V, H, d = 50, 200, 64  # H = 200: not a power of two
    table = (torch.randn(V, H, generator=gen) * 0.5).to(dtype).to(DEVICE)
    norm = (1.0 + 0.3 * torch.randn(H, generator=gen)).to(dtype).to(DEVICE)
    placeholders = torch.tensor([40, 41, 42], device=DEVICE)
    ids = torch.tensor([[3], [41], [49], [0]], device=DEVICE)  # 41: a placeholder, embedded as token 0
    positions = torch.tensor([[5], [-1], [1300], [0]], device=DEVICE)  # -1: a padding row
    next_position = torch.tensor([2, 9, 1000, 7], device=DEVICE)
    rope = RotaryTable(d, ROPES[rope_kind], 4096, device=DEVICE)
    eps = 1e-6

    x, a, (cos, sin) = decode_embed(ids, positions, next_position, table, placeholders, norm, eps, rope.inv_freq,
                                    rope.attention_factor, dtype)

    token_ids = ids.masked_fill(torch.isin(ids, placeholders), 0)
    want_x = ref.rms_norm(F.embedding(token_ids, table).to(dtype), None, eps)
    want_a = ref.rms_norm(want_x, norm, eps)
    want_cos, want_sin = rope.compute(positions)
    assert x.dtype == a.dtype == dtype and cos.shape == want_cos.shape == (4, 1, d)
    assert_nmse(want_x, x, tolerance("rms_norm"), f"x {dtype}")
    assert_nmse(want_a, a, tolerance("rms_norm"), f"a {dtype}")
    err = max((cos - want_cos).abs().max().item(), (sin - want_sin).abs().max().item())
    assert err <= 2e-6, f"rotary rows ({rope_kind}): max |error| {err:.3g} > 2e-6"
    assert next_position.tolist() == [6, 9, 1301, 7]


def test_decode_embed_refuses_a_prefill_with_what_it_takes():
    table, norm = torch.zeros(8, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    ids = torch.zeros(1, 2, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"ids and positions \[B,1\].*got ids \[1, 2\]"):
        decode_embed(ids, ids, torch.zeros(1, dtype=torch.long, device=DEVICE), table,
                     torch.tensor([5], device=DEVICE), norm, 1e-6, torch.ones(8, device=DEVICE), 1.0, torch.float32)
