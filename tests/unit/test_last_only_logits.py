"""``MuseModel.forward(last_only=True)``: the prefill that samples one token computes the lm_head and
softcap for the last position only; its logits are the full forward's last row (same weights, one row of
the same product: the reference's fp32 matmul may take another BLAS path for one row, so the tolerance
is fp32 rounding of a 256-long dot product, not bits)."""

from __future__ import annotations

import torch

import musecore

TOLERANCE = 1e-4  # max |logit difference|; logits are soft-capped at 20


def test_last_only_is_the_last_row_of_the_full_forward():
    model = musecore.load("muse-tiny", device="cpu", progress=False)
    ids = torch.tensor([model.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n")])
    full = model.forward(ids)
    last = model.forward(ids, last_only=True)
    assert last.shape == (1, 1, full.shape[-1]), last.shape
    err = (full[:, -1:] - last).abs().max().item()
    assert err <= TOLERANCE, f"last_only logits differ from the full forward's last row by {err:.3g} (tolerance {TOLERANCE})"


def test_left_padded_batch_last_only_matches_the_full_forward():
    """generate() left-pads a batch (position -1), so the last column is every row's last real token."""
    model = musecore.load("muse-tiny", device="cpu", progress=False)
    a, b = model.tokenizer.encode("import os\n"), model.tokenizer.encode("class A:\n    pass\n")
    longest = max(len(a), len(b))
    ids = torch.zeros((2, longest), dtype=torch.long)
    positions = torch.full((2, longest), -1, dtype=torch.long)
    for row, p in enumerate((a, b)):
        ids[row, longest - len(p):] = torch.tensor(p)
        positions[row, longest - len(p):] = torch.arange(len(p))
    full = model.forward(ids, positions=positions)[:, -1]
    last = model.forward(ids, positions=positions, last_only=True)[:, -1]
    err = (full - last).abs().max().item()
    assert err <= TOLERANCE, f"left-padded batch: {err:.3g} (tolerance {TOLERANCE})"
