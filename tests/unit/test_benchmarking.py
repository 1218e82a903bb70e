"""The backends' shared cold-weight rotation and result rows (musecore.benchmarking)."""

from __future__ import annotations

import json

import torch

from musecore.benchmarking import copies_needed, cycle, rotating, write_rows


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


def test_write_rows_is_a_json_list_one_row_per_line(tmp_path):
    rows = [{"mode": "tail", "us": 1.5}, {"mode": "prologue", "us": 1.25, "ok": True}]
    path = write_rows(tmp_path / "sub" / "rows.json", rows)
    text = path.read_text()
    assert json.loads(text) == rows
    assert text.splitlines()[1:-1] == [json.dumps(rows[0]) + ",", json.dumps(rows[1])], text
