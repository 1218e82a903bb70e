"""The towers' reference ops (``musecore.ops.TOWER_OPS``) against independent PyTorch formulations.

Tolerances: fp32 inputs, so the reference and the formulation it is checked against differ only in
summation order: max |difference| <= 1e-5 (values of order 1), except the exact identities (state
handling, segment independence) that are checked to 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from musecore.backends.reference import ReferenceBackend
from musecore.ops import OPS, TEXT_OPS, TOLERANCE_NMSE, TOWER_OPS, Ops
from musecore.ops import reference as ref


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol, f"{what}: max |difference| {err:.2e} > tolerance {tol:.0e}"


def test_tower_ops_are_declared_with_tolerances_and_the_reference_backend_has_them():
    assert set(TOWER_OPS) == {"layer_norm", "gelu", "varlen_attention", "causal_conv1d", "rope"}
    assert OPS == TEXT_OPS + TOWER_OPS
    for op in TOWER_OPS:
        assert op in TOLERANCE_NMSE
        assert callable(getattr(ReferenceBackend(), op))


def test_an_op_table_without_tower_ops_binds_and_names_the_missing_op():
    class TextOnly:
        name = "text-only"
    backend = ReferenceBackend()
    for op in TEXT_OPS:
        setattr(TextOnly, op, staticmethod(getattr(backend, op)))
    ops = Ops.from_backend(TextOnly())
    assert not ops.has("varlen_attention") and ops.has("linear")
    with pytest.raises(AttributeError, match="op 'varlen_attention' is not bound"):
        ops.varlen_attention


def test_layer_norm_equals_torch_layer_norm_and_keeps_the_input_dtype():
    x = torch.randn(3, 5, 16, generator=gen(0))
    w, b = torch.randn(16, generator=gen(1)), torch.randn(16, generator=gen(2))
    assert_close(ref.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (16,), w, b, 1e-5), 1e-5, "layer_norm")
    assert_close(ref.layer_norm(x, None, None, 1e-6), F.layer_norm(x, (16,), eps=1e-6), 1e-5, "weightless layer_norm")
    assert ref.layer_norm(x.bfloat16(), w, b, 1e-5).dtype == torch.bfloat16


def test_gelu_exact_and_tanh():
    x = torch.linspace(-6, 6, 101)
    exact = 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))
    tanh = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))
    assert_close(ref.gelu(x), exact, 1e-5, "gelu exact")
    assert_close(ref.gelu(x, "tanh"), tanh, 1e-5, "gelu tanh")
    with pytest.raises(ValueError, match="approximate='sigmoid'"):
        ref.gelu(x, "sigmoid")


def test_varlen_attention_over_packed_segments_equals_attention_per_segment():
    lengths = [5, 1, 0, 9, 3]  # an empty segment too: it produces nothing
    N, nh, d = sum(lengths), 3, 8
    q, k, v = (torch.randn(N, nh, d, generator=gen(i)) for i in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    got = ref.varlen_attention(q, k, v, cu, 0.3)
    start = 0
    for n in [n for n in lengths if n]:
        s = slice(start, start + n)
        want = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1),
                                              scale=0.3).transpose(0, 1)
        assert_close(got[s], want, 1e-5, f"segment at {start} (length {n})")
        start += n


def test_varlen_attention_on_a_segment_longer_than_a_query_block():
    """The reference takes queries 1024 at a time; a 1500-token segment must still see all of itself."""
    q, k, v = (torch.randn(1500, 1, 4, generator=gen(i)) for i in range(3))
    got = ref.varlen_attention(q, k, v, torch.tensor([0, 1500], dtype=torch.int32), 0.5)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          scale=0.5).transpose(0, 1)
    assert_close(got, want, 1e-5, "1500-token segment")


def test_varlen_attention_segments_do_not_see_each_other():
    q, k, v = (torch.randn(12, 2, 4, generator=gen(i)) for i in range(3))
    cu = torch.tensor([0, 7, 12], dtype=torch.int32)
    before = ref.varlen_attention(q, k, v, cu, 0.5)
    k2, v2 = k.clone(), v.clone()
    k2[7:] += 5.0
    v2[7:] -= 3.0
    after = ref.varlen_attention(q, k2, v2, cu, 0.5)
    assert_close(after[:7], before[:7], 1e-6, "first segment after changing the second's keys/values")
    assert (after[7:] - before[7:]).abs().max() > 0.1


def test_causal_conv1d_equals_a_left_padded_depthwise_conv():
    B, C, T, K = 2, 6, 11, 7
    x = torch.randn(B, C, T, generator=gen(0))
    w, b = torch.randn(C, 1, K, generator=gen(1)), torch.randn(C, generator=gen(2))
    y, state = ref.causal_conv1d(x, w, b, None)
    want = F.conv1d(F.pad(x, (K - 1, 0)), w, b, groups=C)
    assert_close(y, want, 1e-5, "causal_conv1d")
    assert_close(state, x[..., -(K - 1):], 0.0, "state' = the last K-1 input columns")


@pytest.mark.parametrize("chunks", [[11], [1] * 11, [2, 3, 1, 5], [6, 5], [4, 7]], ids=str)
def test_causal_conv1d_in_chunks_with_state_equals_one_pass(chunks):
    """Chunks shorter than K-1 included: the state then keeps old columns."""
    B, C, K = 2, 4, 7
    x = torch.randn(B, C, sum(chunks), generator=gen(3))
    w, b = torch.randn(C, 1, K, generator=gen(4)), torch.randn(C, generator=gen(5))
    whole, whole_state = ref.causal_conv1d(x, w, b, None)
    pieces, state, start = [], None, 0
    for n in chunks:
        y, state = ref.causal_conv1d(x[..., start:start + n], w, b, state)
        pieces.append(y)
        start += n
    assert_close(torch.cat(pieces, -1), whole, 1e-6, f"chunks {chunks}")
    assert_close(state, whole_state, 0.0, f"final state after chunks {chunks}")


def test_causal_conv1d_state_of_a_chunk_shorter_than_the_kernel_keeps_old_columns():
    C, K = 3, 5
    old = torch.arange(C * (K - 1), dtype=torch.float32).view(1, C, K - 1)
    x = torch.full((1, C, 2), -1.0)
    _y, state = ref.causal_conv1d(x, torch.ones(C, 1, K), None, old)
    assert torch.equal(state, torch.cat([old[..., 2:], x], -1))


def test_rope_rotates_half_with_the_same_angles_for_every_head():
    N, nh, d = 7, 3, 8
    x = torch.randn(N, nh, d, generator=gen(0))
    angles = torch.randn(N, d, generator=gen(1))
    cos, sin = angles.cos(), angles.sin()
    got = ref.rope(x, cos, sin)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    want = x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]
    assert_close(got, want, 1e-6, "rope")
    # cos/sin from one angle per pair: rope is a rotation, so it keeps each head's norm
    pair = torch.randn(N, d // 2, generator=gen(2)).repeat(1, 2)
    assert_close(ref.rope(x, pair.cos(), pair.sin()).norm(dim=-1), x.norm(dim=-1), 1e-5, "norm kept")
