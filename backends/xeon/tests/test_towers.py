"""The towers' ops on the xeon backend (:mod:`musecore_xeon.towers`) against the reference: varlen attention
batched per segment length in both dense compute dtypes, the conv's streaming state, the claims in
``supports()``, and one-line errors. The conformance suite covers the preset shapes
(``test_conformance.py``)."""

from __future__ import annotations

import pytest
import torch

from musecore.ops import OpSpec, TOWER_OPS, tolerance
from musecore.ops import reference as ref
from musecore.testing import assert_nmse
from musecore_xeon import XeonBackend
from musecore_xeon import towers


def cu(*lengths: int) -> torch.Tensor:
    return torch.tensor((0,) + lengths).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_batches_equal_length_segments_and_matches_reference(compute_dtype):
    lengths = (64, 64, 0, 1, 64, 37, 1)  # three windows of one length, two one-token segments, an empty one
    q, k, v = (torch.randn(sum(lengths), 3, 40).bfloat16() for _ in range(3))
    out = towers.varlen_attention(q, k, v, cu(*lengths), 40 ** -0.5, compute_dtype=compute_dtype)
    assert out.dtype == torch.bfloat16
    assert_nmse(ref.varlen_attention(q, k, v, cu(*lengths), 40 ** -0.5), out, tolerance("varlen_attention"),
                f"xeon varlen_attention in {compute_dtype}")


def test_varlen_attention_in_fp32_is_exact():
    lengths = (30, 30, 7)
    q, k, v = (torch.randn(sum(lengths), 2, 24) for _ in range(3))
    out = towers.varlen_attention(q, k, v, cu(*lengths), 0.2)
    assert_nmse(ref.varlen_attention(q, k, v, cu(*lengths), 0.2), out, 1e-10, "xeon varlen_attention fp32")


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([1, 10], dtype=torch.int32), "rise from 0 to N=10"),
    (torch.tensor([0, 6, 4, 10], dtype=torch.int32), "without decreasing"),
    (torch.tensor([0.0, 10.0]), "cu_seqlens must be int32"),
])
def test_varlen_attention_rejects_a_malformed_cu_seqlens_in_one_line(bad, message):
    q = torch.randn(10, 1, 16)
    with pytest.raises(ValueError, match=message):
        towers.varlen_attention(q, q, q, bad, 0.25)


def test_causal_conv1d_in_chunks_equals_one_pass_and_the_reference():
    x = torch.randn(2, 50, 48).bfloat16().transpose(1, 2)  # the audio tower's [B,T,C] seen as [B,C,T]
    w, b = (torch.randn(48, 1, 7) / 3).bfloat16(), torch.randn(48).bfloat16()
    whole, _ = towers.causal_conv1d(x, w, b)
    want, _ = ref.causal_conv1d(x, w, b)
    assert_nmse(want, whole, tolerance("causal_conv1d"), "xeon causal_conv1d")
    parts, state = [], None
    for lo, hi in ((0, 1), (1, 5), (5, 50)):
        y, state = towers.causal_conv1d(x[..., lo:hi], w, b, state)
        parts.append(y)
    assert torch.equal(torch.cat(parts, -1), whole), "streaming with the returned state must equal one pass"
    with pytest.raises(ValueError, match=r"state must be \[batch=2, channels=48, kernel-1=6\]"):
        towers.causal_conv1d(x, w, b, torch.zeros(2, 48, 7).bfloat16())


def test_every_tower_op_is_claimed_natively_with_its_reason(xeon: XeonBackend):
    for op in TOWER_OPS:
        answer = xeon.supports(op, OpSpec(op, device="xeon"))
        assert answer.ok and answer.tier.value == "native" and answer.reason == towers.TOWER_REASONS[op], op
        assert callable(getattr(xeon, op)), op


def test_the_backend_runs_varlen_attention_in_its_dense_dtype(xeon: XeonBackend):
    q, k, v = (torch.randn(20, 2, 16).bfloat16() for _ in range(3))
    out = xeon.varlen_attention(q, k, v, cu(12, 8), 0.25)
    assert_nmse(ref.varlen_attention(q, k, v, cu(12, 8), 0.25), out, tolerance("varlen_attention"),
                f"XeonBackend.varlen_attention ({xeon.dense_dtype})")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-9), (torch.bfloat16, 1e-4)])
def test_muse_tiny_towers_on_xeon_equal_the_reference_backend(dtype, tol):
    """The bundled muse-tiny's (random) towers loaded for xeon and for the reference: the plan binds the tower ops
    to xeon, and images of odd grids (several 32x32-patch windows, a video) and clips with a mask encode the same.
    fp32: the same math in another order (NMSE ~1e-13 measured); bf16: roundings at the same points."""
    import musecore
    xeon = musecore.load("muse-tiny", device="xeon", dtype=dtype)
    reference = musecore.load("muse-tiny", device="cpu", dtype=dtype)
    assert {xeon.ops.sources[op] for op in TOWER_OPS} == {f"xeon.{op}" for op in TOWER_OPS}
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 6, 10], [2, 4, 4], [1, 40, 36]])  # the last: windows of 32x32, 32x4, 8x32 and 8x4
    pixels = torch.randn(int(grid.prod(-1).sum()), 1176, generator=gen)
    audio = 0.3 * torch.randn(2, 1920 * 5, generator=gen)
    mask = torch.ones_like(audio, dtype=torch.bool)
    mask[1, 1920 * 3 + 17:] = False
    for what, encode in (("images", lambda m: m.encode_images(pixels, grid)),
                         ("audio", lambda m: m.encode_audio(audio, mask))):
        assert_nmse(torch.cat(encode(reference)).float(), torch.cat(encode(xeon)).float(), tol,
                    f"muse-tiny {what} on xeon vs reference ({dtype})")
