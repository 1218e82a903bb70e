"""Greedy sampling's argmax (``musecore_triton.kernels.sampling``) against ``torch.argmax``: ties, NaN, infinities,
signed zeros, 16-bit logits, strided rows, vocabularies that do not fill the last block; and greedy decoding's position
update (``greedy_positions``)."""

from __future__ import annotations

import pytest
import torch

from musecore_triton.kernels.sampling import BLOCK, MAX_V, argmax, greedy_positions
from musecore_triton.testing import DEVICE


def check(x: torch.Tensor, what: str) -> None:
    want, got = x.float().cpu().argmax(-1), argmax(x).cpu()
    assert got.dtype == torch.long and got.shape == want.shape, f"{what}: {got.dtype} {list(got.shape)}"
    assert torch.equal(got, want), f"{what}: argmax {got.tolist()} vs torch's {want.tolist()}"


@pytest.mark.parametrize("V", [1, 7, BLOCK, BLOCK + 1, 3 * BLOCK - 5, 65536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_matches_torch(V, dtype):
    gen = torch.Generator().manual_seed(V)
    x = torch.randn(3, V, generator=gen).to(dtype).to(DEVICE)
    check(x, f"V={V} {dtype}")


def test_argmax_ties_and_special_values():
    V = 3 * BLOCK + 17
    x = torch.full((8, V), -1.0)
    x[0, [5, BLOCK + 3, 2 * BLOCK]] = 2.0  # a tie across partial programs: the first index wins
    x[1, [V - 1, 9]] = float("inf")
    x[2, [BLOCK + 1, 4]] = float("nan")  # NaN beats everything, +inf included; the first NaN wins
    x[2, 0] = float("inf")
    x[3] = float("-inf")  # all -inf: index 0
    x[4] = 0.0
    x[4, :BLOCK] = -0.0  # -0 == +0: the first zero
    x[5] = -0.0
    x[5, 100] = 1e-45  # the smallest subnormal beats both zeros
    x[6] = torch.linspace(-3, 3, V)  # the last entry
    x[7, 1:] = -torch.tensor(float("nan"))  # a NaN with its sign bit set (x86's default NaN) is still the largest
    assert x[7, 1].view(torch.int32) < 0
    check(x.to(DEVICE), "special values")


def test_argmax_reads_strided_rows_and_keeps_leading_dims():
    x = torch.randn(2, 5, 300, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    check(x[:, -1], "a [B, T, V] tensor's last position (strided rows)")
    check(x, "leading dims")
    check(x.transpose(0, 1), "a non-contiguous batch")
    assert argmax(x[:0, -1]).shape == (0,)


def test_argmax_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="argmax takes"):
        argmax(torch.zeros(2, 3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="argmax takes"):
        argmax(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="argmax takes"):
        argmax(torch.zeros(1, MAX_V + 1, dtype=torch.float16, device=DEVICE))


@pytest.mark.parametrize("B", [1, 3, 16])
def test_greedy_positions_is_the_masked_fill_and_the_add(B):
    """``greedy_positions``: the greedy step's positions (-1 for a row that ended) and the loop's advance, as
    ``GreedyGraphStep`` computes them with PyTorch ops."""
    gen = torch.Generator().manual_seed(B)
    start = torch.randint(0, 1000, (B,), generator=gen)
    live = torch.rand(B, generator=gen) < 0.6
    live[0] = True
    live[-1] = B == 1  # (a row that ended, wherever there are two)
    nxt = start.clone().to(DEVICE)
    got = greedy_positions(nxt, live.to(DEVICE))
    want = start.masked_fill(~live, -1)[:, None]
    assert got.dtype == torch.long and torch.equal(got.cpu(), want), f"positions {got.tolist()} vs {want.tolist()}"
    assert torch.equal(nxt.cpu(), start + live.long()), f"advanced {nxt.tolist()} vs {(start + live.long()).tolist()}"
    with pytest.raises(ValueError, match="contiguous int64"):
        greedy_positions(nxt.int(), live.to(DEVICE))


def test_argmax_writes_into_a_given_buffer():
    """``argmax(out=)``: the indices land in the caller's int64 buffer (a greedy graph's static tokens) and that
    buffer is returned; a buffer of the wrong type, size or layout is refused."""
    x = torch.randn(3, 5000, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    out = torch.full((3,), -5, dtype=torch.long, device=DEVICE)
    got = argmax(x, out=out)
    assert torch.equal(out.cpu(), x.cpu().argmax(-1)) and got.data_ptr() == out.data_ptr()
    for bad in (out.int(), out[:2], torch.zeros(3, 2, dtype=torch.long, device=DEVICE)[:, 0]):
        with pytest.raises(ValueError, match="out= must be"):
            argmax(x, out=bad)
