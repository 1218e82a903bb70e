"""The decode MoE's token-expert assignments sorted by expert in one Triton program: the runs path of the CUDA decode
GEMVs (``musecore_cuda.kernels.moe_decode``) groups each expert's assignments with it. ``torch.sort``'s radix sort
there took 8.6 us per layer of a batch-16 muse-small step on the H200 (138 of 1917 us, several launches); graph
replays of one sort measured 17.2-17.6 us for this kernel against 17.2-19.5 us for ``torch.sort`` at 8-128
assignments and 17 against 36 us at 1024 (both near a graph replay's own floor;
``backends/cuda/lab/scripts/cuda_sort_probe.py``).

Each assignment's key is ``expert << 11 | index`` (unique, int32 for up to 2048 assignments and 2**20 experts); one
program sorts the keys (``tl.sort``, a bitonic network in registers, the count padded to a power of two with keys
that sort last) and writes ``order = key >> 11`` (the experts, ascending) and ``perm = key & 2047`` (the assignment at
each sorted position). Ties are broken by the index, so the result is ``torch.sort(flat, stable=True)``'s; the runs
kernel takes any order within an expert (the same bits), so either sort serves it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ASSIGNMENTS = 2048
INDEX_BITS = 11
MAX_EXPERTS = 1 << (31 - INDEX_BITS)  # expert << INDEX_BITS | index stays a positive int32


@triton.jit
def sort_assignments_kernel(ids_ptr, order_ptr, perm_ptr, n, BLOCK: tl.constexpr, INDEX_BITS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    e = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    keys = tl.where(mask, (e << INDEX_BITS) | offs, 2147483647)  # padding sorts last
    keys = tl.sort(keys, 0)
    tl.store(order_ptr + offs, (keys >> INDEX_BITS).to(tl.int64), mask=mask)
    tl.store(perm_ptr + offs, (keys & ((1 << INDEX_BITS) - 1)).to(tl.int64), mask=mask)


def sort_assignments(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, perm)`` as ``torch.sort(flat, stable=True)`` gives them, for int64 expert ids ``flat [n]``,
    ``n <= MAX_ASSIGNMENTS``, experts below ``MAX_EXPERTS`` (2**20; not checked here: that would read the ids)."""
    n = flat.numel()
    if flat.dim() != 1 or not 0 < n <= MAX_ASSIGNMENTS:
        raise ValueError(f"sort_assignments takes 1..{MAX_ASSIGNMENTS} expert ids in one dimension; got "
                         f"{list(flat.shape)}")
    order = torch.empty(n, dtype=torch.int64, device=flat.device)
    perm = torch.empty(n, dtype=torch.int64, device=flat.device)
    sort_assignments_kernel[(1,)](flat, order, perm, n, BLOCK=max(16, triton.next_power_of_2(n)),
                                  INDEX_BITS=INDEX_BITS, num_warps=4 if n <= 256 else 8)
    return order, perm
