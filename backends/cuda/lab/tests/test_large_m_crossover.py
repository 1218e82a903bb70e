"""``cuda_large_m_crossover.crossover``: the targets case's large-M rows paired per (shape, M), and the largest M up
to which the Gluon launch led on every shape."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import cuda_large_m_crossover as lab  # noqa: E402


def rows(m: int, shape: str, gluon: float, dequant: float, routed: str = "dequant") -> list[dict]:
    return [{"format": "nvfp4", "path": "gluon", "shape": shape, "M": m, "time_us": gluon,
             "default": routed == "gluon"},
            {"format": "nvfp4", "path": "dequant", "shape": shape, "M": m, "time_us": dequant,
             "default": routed == "dequant"},
            {"format": "bf16", "path": "", "shape": shape, "M": m, "time_us": 1.0, "default": False}]


def test_pairs_the_two_paths_and_finds_where_gluon_stops_leading_everywhere():
    got = lab.crossover(rows(2048, "q", 100.0, 120.0, "gluon") + rows(2048, "o", 100.0, 110.0, "gluon")
                        + rows(3072, "q", 150.0, 160.0) + rows(3072, "o", 150.0, 149.0)
                        + rows(4096, "q", 200.0, 190.0) + rows(4096, "o", 200.0, 210.0))
    assert got["gluon_leads_all_to"] == 2048, got  # o trails at 3072, so 4096's q lead does not count
    assert got["leads_to"] == {"o": 2048, "q": 3072}, got
    first = got["points"][0]
    assert (first["shape"], first["M"], first["gluon_vs_dequant"], first["routed"]) == ("o", 2048, 1.1, "gluon")
    assert len(got["points"]) == 6


def test_none_when_gluon_trails_at_the_smallest_m_and_unpaired_rows_are_left_out():
    got = lab.crossover(rows(2048, "q", 130.0, 120.0, "gluon") + rows(4096, "q", 100.0, 120.0)
                        + [{"format": "nvfp4", "path": "gluon", "shape": "k", "M": 2048, "time_us": 1.0}])
    assert got["gluon_leads_all_to"] is None, got
    assert [p["shape"] for p in got["points"]] == ["q", "q"]


def test_a_shape_already_on_dequant_at_the_smallest_m_has_no_say():
    """Run 169's k_proj (N = 1024: too few output tiles for the Gluon launch past M = 256) trailed at 2048 while
    q / o / pooler led: the bound is theirs."""
    got = lab.crossover(rows(2048, "k", 84.0, 53.0) + rows(2048, "q", 360.0, 400.0, "gluon")
                        + rows(3072, "k", 92.0, 78.0) + rows(3072, "q", 580.0, 610.0))
    assert got["leads_to"] == {"k": None, "q": 3072}, got
    assert got["gluon_leads_all_to"] == 3072, got
    assert lab.crossover(rows(2048, "k", 84.0, 53.0))["gluon_leads_all_to"] is None  # no shape on the Gluon launch
