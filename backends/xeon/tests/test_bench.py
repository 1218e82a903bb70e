"""The benchmark's cold-weight rotation: enough distinct copies, each called once per cycle, in order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from musecore_xeon import bench


def test_rotation_makes_distinct_copies_totalling_the_requested_bytes() -> None:
    copies = bench.rotating(lambda: torch.zeros(1000, dtype=torch.uint8), 1000, total_bytes=10_500)
    assert len(copies) == 11  # ceil(10500 / 1000)
    assert len({c.data_ptr() for c in copies}) == len(copies), "copies share memory: the cache would serve them"


def test_rotation_keeps_two_copies_when_one_already_exceeds_the_total() -> None:
    assert bench.copies_needed(1 << 30, total_bytes=1 << 20) == 2


def test_cycle_calls_every_copy_once_in_order() -> None:
    seen: list[int] = []
    run = bench.cycle([3, 1, 2], seen.append)
    run()
    run()
    assert seen == [3, 1, 2, 3, 1, 2]


def test_default_rotation_is_twice_the_l3() -> None:
    assert bench.rotation_bytes() == 2 * bench.l3_cache_bytes()
    assert bench.l3_cache_bytes() >= 1 << 20, bench.l3_cache_bytes()


@pytest.mark.parametrize("text, expected", [("32768K\n", 32 << 20), ("1M", 1 << 20), ("junk", bench.DEFAULT_L3_BYTES)])
def test_l3_size_is_read_from_sysfs_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                                         expected: int) -> None:
    path = tmp_path / "size"
    path.write_text(text)
    monkeypatch.setattr(bench, "L3_SIZE_PATH", path)
    bench.l3_cache_bytes.cache_clear()
    try:
        assert bench.l3_cache_bytes() == expected
    finally:
        bench.l3_cache_bytes.cache_clear()


def test_missing_sysfs_entry_falls_back_to_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "L3_SIZE_PATH", tmp_path / "absent")
    bench.l3_cache_bytes.cache_clear()
    try:
        assert bench.l3_cache_bytes() == bench.DEFAULT_L3_BYTES
    finally:
        bench.l3_cache_bytes.cache_clear()
