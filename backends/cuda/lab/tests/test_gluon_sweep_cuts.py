"""The Gluon sweep's ``--cuts`` (session 63): literal cut labels timed beside the routed launch at every point whose
K they fit, precompiled with it; checked here without a GPU (labels, twins and the fit rule only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
sweep = pytest.importorskip("cuda_gluon_sweep")
from musecore_cuda.kernels.fp4_gluon_plan import GluonConfig, pick_config  # noqa: E402

WIDE = "128,64,4,8,packed,1,finish,pair,late,ahead2,rezero"


def test_cut_labels_round_trip_and_fit_only_where_k_divides(monkeypatch):
    cut = GluonConfig.parse(WIDE)
    assert cut.label() == WIDE and cut.block_n == 128 and cut.rezero and cut.ahead == 2
    assert sweep.fits(cut, 4096) and sweep.fits(cut, 8192)                      # 32 / 64 chunks: 8 / 16 per split
    assert not sweep.fits(cut, 768)                                             # 6 chunks do not split in 4
    assert not sweep.fits(GluonConfig.parse("64,16,4,8,packed,1,finish,pair"), 1536)  # 3 chunks a split: pairs need 2
    assert not sweep.fits(GluonConfig.parse("64,16,8,4,packed,1,finish"), 1024)  # 1 chunk per split


def test_extra_cuts_join_the_routed_launchs_twins_once_and_never_repeat_it(monkeypatch):
    routed = pick_config(64, 4096, 4096, 132)
    monkeypatch.setattr(sweep, "EXTRA_CUTS", [GluonConfig.parse(WIDE), routed, GluonConfig.parse("64,64,1,4,packed")])
    cuts = [(impl, cfg.label()) for impl, cfg in sweep.twins(routed, 4096) if impl == "gluon cut"]
    # session 68's expert_down M = 64 pick (session 63's was WIDE): the cut equal to it is not timed twice
    assert routed.label() == "64,64,4,4,packed,2,finish,rezero"
    assert cuts == [("gluon cut", WIDE), ("gluon cut", "64,64,1,4,packed")]
    monkeypatch.setattr(sweep, "PAIR", True)  # a two-CTA pick's consumer variants stay within half the SM
    monkeypatch.setattr(sweep, "LATE", True)
    assert [v.label() for v in sweep.variants(routed, 4096)] == ["64,64,4,4,packed,2,finish,pair,rezero",
                                                                  "64,64,4,4,packed,2,finish,late,rezero"]
    monkeypatch.setattr(sweep, "EXTRA_CUTS", [GluonConfig.parse(WIDE)])
    assert [c.label() for i, c in sweep.twins(pick_config(64, 8192, 768, 132), 768) if i == "gluon cut"] == []
