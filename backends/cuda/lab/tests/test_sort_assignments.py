"""The lab's one-program sort of the decode MoE's assignments (``backends/cuda/lab/sort_assignments.py``) equals
``torch.sort(stable=True)``: in Triton's CPU interpreter without a GPU, on the GPU with one
(``pytest backends/cuda/lab/tests``; the lab's tests are not in the default test run)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from musecore_triton.testing import DEVICE, use_interpreter_without_gpu

use_interpreter_without_gpu(__file__)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab
from sort_assignments import sort_assignments  # noqa: E402


@pytest.mark.parametrize("n,experts", [(1, 4), (8, 256), (37, 6), (128, 64), (1024, 256)])
def test_sort_assignments_equals_a_stable_torch_sort(n, experts):
    gen = torch.Generator().manual_seed(n)
    flat = torch.randint(0, experts, (n,), generator=gen).to(DEVICE)
    order, perm = sort_assignments(flat)
    want_order, want_perm = torch.sort(flat, stable=True)
    assert torch.equal(order, want_order) and torch.equal(perm, want_perm), (order[:8], perm[:8])


def test_sort_assignments_refuses_what_it_cannot_key():
    with pytest.raises(ValueError, match="1..2048 expert ids"):
        sort_assignments(torch.zeros(2049, dtype=torch.int64, device=DEVICE))
