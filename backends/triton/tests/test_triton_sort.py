"""The one-program sort of the decode MoE's assignments (``musecore_triton.kernels.sort``) equals
``torch.sort(stable=True)``: in Triton's CPU interpreter without a GPU, on the GPU with one."""

from __future__ import annotations

import pytest
import torch

from musecore_triton.kernels.sort import sort_assignments
from musecore_triton.testing import DEVICE


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
