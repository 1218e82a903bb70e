"""The one-program sort of the decode MoE's assignments (``musecore_triton.kernels.sort``) equals
``torch.sort(stable=True)``, and the one-program alignment (``moe.align_assignments`` up to its MAX_ASSIGNMENTS)
the PyTorch ops': in Triton's CPU interpreter without a GPU, on the GPU with one."""

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


@pytest.mark.parametrize("n,experts,block_m", [(1, 4, 16), (8, 256, 16), (37, 6, 16), (48, 256, 16), (64, 16, 32),
                                               (128, 64, 16), (200, 3, 64), (1024, 256, 16), (2048, 256, 128),
                                               (96, 8, 256)])
def test_align_in_one_program_equals_the_torch_ops(n, experts, block_m, monkeypatch):
    """``align_assignments``' one-program kernel (up to MAX_ASSIGNMENTS) gives exactly the PyTorch ops' three tensors:
    random routing, a single expert holding every assignment (n = 200, E = 3: skewed) and unused experts."""
    from musecore_triton.kernels import moe
    want_fn = moe._align_torch
    gen = torch.Generator().manual_seed(n * 7 + block_m)
    ids = torch.randint(0, experts, (n,), generator=gen)
    if experts == 3:
        ids[: n // 2] = 1
    ids = ids.reshape(-1, 1 if n % 8 else 8).to(DEVICE)
    want = want_fn(ids, experts, block_m)
    monkeypatch.setattr(moe, "_align_torch", lambda *a: pytest.fail("align_assignments took the PyTorch ops"))
    got = moe.align_assignments(ids, experts, block_m)
    for name, g, w in zip(("sorted_ids", "blk_expert", "position"), got, want):
        assert g.dtype == w.dtype == torch.int32 and g.shape == w.shape, (name, g.dtype, g.shape, w.shape)
        bad = (g != w).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} of {g.numel()} differ, first at {bad[0].tolist()}: " \
                                 f"{g[bad[0]].tolist()} vs {w[bad[0]].tolist()}"


def test_align_in_one_program_stays_inside_its_outputs_for_ids_past_the_experts():
    """Ids at or past ``num_experts`` break the contract (the router never gives them) and more segments than the
    outputs' bound can hold: the kernel's writes stay inside its outputs (rows past the bound are dropped)."""
    from musecore_triton.kernels import moe
    ids = torch.arange(64).to(DEVICE)  # 64 one-row segments of 16-row blocks, with num_experts 2: room for 6 blocks
    sorted_ids, blk_expert, position = moe._align_one_program(ids, 2, 16)
    assert sorted_ids.shape == (96,) and blk_expert.shape == (6,) and position.shape == (64,)
    assert int(sorted_ids[0]) == 0 and int(blk_expert[5]) == 5 and int(position[5]) == 80
