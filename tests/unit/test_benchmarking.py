"""The backends' shared cold-weight rotation (musecore.benchmarking)."""

from __future__ import annotations

import torch

from musecore.benchmarking import copies_needed, cycle, rotating


def test_copies_reach_the_total_with_at_least_the_minimum() -> None:
    assert copies_needed(1000, 10_500) == 11
    assert copies_needed(1 << 30, 1 << 20) == 1
    assert copies_needed(1 << 30, 1 << 20, min_copies=2) == 2
    assert copies_needed(0, 10) == 10  # an empty object counts as one byte


def test_rotating_makes_independent_copies_and_cycle_calls_each_in_order() -> None:
    copies = rotating(lambda: torch.zeros(100, dtype=torch.uint8), 100, 350)
    assert len(copies) == 4 and len({c.data_ptr() for c in copies}) == 4
    seen: list[int] = []
    cycle([2, 0, 1], seen.append)()
    assert seen == [2, 0, 1]
