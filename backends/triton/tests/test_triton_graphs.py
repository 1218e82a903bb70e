"""``GreedyGraphStep``'s body with ``FUSED_STATE`` (the position update through ``sampling.greedy_positions``, the
argmax written into the tokens by an ``argmax_into``) against its PyTorch-op body, replayed without a capture (here in
the interpreter; the captured graph on a GPU: ``backends/cuda/tests/test_cuda_e2e.py``)."""

from __future__ import annotations

import types

import pytest
import torch

from musecore_triton import graphs
from musecore_triton.kernels import sampling
from musecore_triton.testing import DEVICE

V = 50


class _Model:
    """Logits that depend on each row's token and position (every position's logits differ), and records of the
    positions each step saw."""

    device = DEVICE

    def __init__(self):
        self.seen: list = []
        self.ops = types.SimpleNamespace(sample=lambda logits, *a: logits.argmax(-1))

    def forward(self, ids, positions, cache):
        self.seen.append(positions.clone())
        scores = ((ids * 7 + positions * 3)[:, :, None] + torch.arange(V, device=ids.device) * 11) % V  # [B,1,V]
        return torch.where(positions[:, :, None] >= 0, scores.float(), 0.0)


def _run(fused: bool, argmax_into, monkeypatch) -> tuple[list, list]:
    monkeypatch.setattr(graphs, "FUSED_STATE", fused)
    monkeypatch.setattr(graphs, "_capture", lambda model, cache, scope, body: (
        types.SimpleNamespace(replay=body), body()))
    model = _Model()
    cache = types.SimpleNamespace(next_position=torch.zeros(3, dtype=torch.long, device=DEVICE))
    step = graphs.GreedyGraphStep(model, cache, argmax_into=argmax_into)
    model.seen.clear()
    step.start(torch.tensor([1, 2, 3], device=DEVICE), torch.tensor([5, 9, 2], device=DEVICE),
               torch.tensor([True, True, False], device=DEVICE))
    tokens = []
    for i in range(4):
        if i == 2:
            step.set_live(torch.tensor([True, False, False], device=DEVICE))
        tokens.append(step().clone())
    return [t.tolist() for t in tokens], [p.flatten().tolist() for p in model.seen]


@pytest.mark.parametrize("with_into", [False, True])
def test_fused_state_gives_the_positions_and_tokens_of_the_op_body(monkeypatch, with_into):
    """Same positions (a row not live runs at -1, a row that ends stops advancing) and the same tokens, with the
    argmax written into the tokens or (no ``argmax_into``, or one that declines) sampled and copied."""
    want = _run(False, None, monkeypatch)
    calls = []

    def into(logits, tokens):
        calls.append(logits.shape)
        sampling.argmax(logits, out=tokens)
        return True
    got = _run(True, into if with_into else (lambda logits, tokens: False), monkeypatch)
    assert got == want, f"fused {got} != ops {want}"
    assert want[1][0] == [5, 9, -1] and want[1][3] == [8, -1, -1], want[1]
    assert len(calls) == (5 if with_into else 0), calls  # the stand-in capture's run and four replays
