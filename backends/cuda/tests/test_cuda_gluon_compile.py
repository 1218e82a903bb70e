"""The Gluon kernels compiled for SM90 (the H200's ISA) on a host with no GPU, with Triton 3.6 (``gluon_sm90.py``):
every launch ``fp4_gluon_plan.pick_config`` makes for the 816B linears, the large-M, persistent, split-K finish,
paired-stage and late-release cuts the sweeps time (finish's atomics must be 16 bytes wide), and the grouped (MoE)
kernel's gate/up and down at every token tile the MoE probe times. Each must compile without spills and without
ptxas serializing its wgmmas (C7513), and the packed consumer loop must stay within its instruction budget per
128-element chunk (that loop's issue rate is its speed at M 9-256: lab NOTES, sessions 12 and 40). The grouped
kernel has never run on a GPU (session 59), so this is what checks it between device sessions; a mask on its 256 x
128 down tile spilled 926 bytes before this test existed."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # (the helper beside this file; pytest runs from the repository root)
import gluon_sm90  # noqa: E402
from musecore_cuda.bench import LINEAR_SHAPES  # noqa: E402
from musecore_cuda.kernels.fp4_gluon_plan import GluonConfig, pick_config  # noqa: E402

pytestmark = pytest.mark.skipif(gluon_sm90.missing() is not None, reason=str(gluon_sm90.missing()))

# SASS per chunk of the packed consumer loop: 242 one tile per program at block_m <= 128 (session 12), 245-246 at
# 256, 247-250 persistent (the stage and phase carried across tiles), 252 for the grouped gate/up at 128 x 256.
PACKED_CHUNK_BUDGET = 252


def routed_cuts() -> set[str]:
    """The launches the Gluon path makes for the 816B linears at M 8-256 on the H200's 132 SMs."""
    return {pick_config(m, n, k, 132).label() for n, k in LINEAR_SHAPES.values() for m in (8, 9, 16, 17, 32, 64, 128,
                                                                                             256)}


SWEPT = ("128,256,1,3,packed", "128,128,1,4,packed", "64,128,1,4,packed,1,persistent",
         "128,256,1,3,packed,1,persistent", "64,64,8,4,packed,1,finish", "64,256,4,3,packed,1,finish",
         "64,64,1,8,packed,1,pair", "64,16,8,4,packed,1,finish,pair", "128,128,1,4,packed,1,pair",
         "64,64,1,4,packed,1,late", "64,64,1,8,packed,1,pair,late", "64,128,8,6,packed,1,finish,pair,late",
         "64,64,1,4,packed,1,ahead2", "64,256,1,3,packed,1,ahead2", "64,64,1,8,packed,1,pair,late,ahead2",
         "64,16,8,8,packed,1,finish,pair,late,ahead2,rezero", "128,64,4,8,packed,1,finish,pair,late,ahead2,rezero")
GROUPED = tuple(f"grouped:{GluonConfig(bn, bm, 1, 3 if bm == 256 else 4, upcast='packed').label()}"
                for bn, bm in ((64, 16), (64, 64), (64, 128), (64, 256), (128, 16), (128, 32), (128, 64), (128, 256)))
GROUPED += ("grouped:128,16,1,8,packed,1,pair,late,ahead2", "grouped:128,32,1,8,packed,1,pair,late,ahead2",
            "grouped:128,16,1,4,packed,1,late,ahead2",  # the linear's consumer variants (session 67's MoE decode cuts)
            "grouped:64,16,1,4,packed,2",  # two CTAs per SM (routed: fp4_gluon_plan.MOE_TWO_CTA)
            "grouped:64,16,1,8,packed,2,pair,late,ahead2")


@functools.lru_cache(maxsize=1)
def reports() -> dict[tuple[str, str], dict]:
    """Every cut compiled once, in one subprocess (the test environment's own Triton is another version)."""
    cuts = sorted(routed_cuts()) + list(SWEPT) + list(GROUPED) + [f"pdl:{c}" for c in sorted(routed_cuts())]
    return {(r["cut"], r["kernel"]): r for r in gluon_sm90.compile_in_subprocess(cuts)}


@pytest.mark.parametrize("cut", sorted(routed_cuts()) + list(SWEPT) + list(GROUPED))
def test_gluon_kernels_compile_for_sm90_without_spills_within_budget(cut):
    found = {kind: r for (c, kind), r in reports().items() if c == cut}
    assert found and set(found) == ({"gate_up", "down"} if cut.startswith("grouped:") else {"dense"}), found
    for kind, r in found.items():
        assert r["spill_bytes"] == 0 and not r["c75"], f"{cut} {kind}: {r['ptxas']}"
        assert r["per_chunk"] <= PACKED_CHUNK_BUDGET, f"{cut} {kind}: {r['per_chunk']} SASS per chunk"
        assert r["shared"] <= 227 * 1024, f"{cut} {kind}: {r['shared']} bytes of shared memory"
        if GluonConfig.parse(cut.removeprefix("grouped:")).ctas_per_sm == 2:  # two CTAs' registers fit one SM
            assert "Used 128 registers" in r["ptxas"], f"{cut} {kind}: {r['ptxas']}"
        if ",finish" in cut:  # split-K finish adds 16 bytes per atomic (its layout's point), never 4
            assert r["atomics"].get("v4.f32") and not r["atomics"].get("f32"), f"{cut}: atomics {r['atomics']}"


@pytest.mark.parametrize("cut", sorted(routed_cuts()))
def test_gluon_linear_with_pdl_waits_before_its_first_load_and_keeps_its_loop(cut):
    """Launched with PDL, each routed cut waits in its loader (before its first load) and before its epilogue, and its
    consumer loop is the one it runs without PDL."""
    plain, pdl = reports()[(cut, "dense")], reports()[(f"pdl:{cut}", "dense")]
    assert plain["gdc_waits"] == 0 and pdl["gdc_waits"] == 2, (plain["gdc_waits"], pdl["gdc_waits"])
    assert pdl["spill_bytes"] == 0 and not pdl["c75"], pdl["ptxas"]
    assert pdl["per_chunk"] == plain["per_chunk"], (pdl["per_chunk"], plain["per_chunk"])
