"""``cuda_persistent_probe.verdict``: session 53's decision rule (write the per-layer persistent kernel only if the
best one-launch form beats the PDL chain by more than 1 us per phase at D = 1536) applied to a run's rows."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import cuda_persistent_probe as probe  # noqa: E402


def row(mode: str, us_per_phase: float, D: int = 1536, cut: str = "2x2048", diff: float = 0.0,
        gave_up: bool = False) -> dict:
    return {"D": D, "cut": cut, "mode": mode, "us_per_phase": us_per_phase, "max_diff_vs_chain": diff,
            "barrier_gave_up": gave_up}


def test_a_one_launch_form_past_the_margin_says_write():
    v = probe.verdict([row("chain_pdl", 5.0), row("chain", 6.0), row("persistent_prefetch", 4.5, cut="2x512"),
                       row("hold_4x2w", 3.6, diff=1e-3)])
    assert v["verdict"] is True and v["best_mode"] == "hold_4x2w" and v["gain_us_per_phase"] == 1.4, v


def test_within_the_margin_says_do_not_write():
    v = probe.verdict([row("chain_pdl", 5.0), row("persistent_prefetch", 4.2), row("hold_2x2w", 4.4, diff=1e-3)])
    assert v["verdict"] is False and v["best_mode"] == "persistent_prefetch", v


def test_invalid_or_other_width_rows_do_not_count():
    rows = [row("chain_pdl", 5.0),
            row("persistent_prefetch", 1.0, gave_up=True),      # its barrier gave up: not a result
            row("persistent_prefetch", 1.0, diff=0.5),           # differs from the chain: a wrong kernel
            row("hold_4x4w", 1.0, diff=float("nan")),            # a non-finite output
            row("hold_2x2w", 1.0, D=3072),                       # another width
            row("persistent", 1.0),                              # without the prefetch: not a candidate
            {"D": 1536, "mode": "hold_16x8w", "skipped": "96 programs; ..."}]
    v = probe.verdict(rows)
    assert v["verdict"] is None and "one-launch" in v["reason"], v
    assert probe.verdict(rows + [row("hold_2x2w", 3.5, diff=1e-3)])["gain_us_per_phase"] == 1.5


def test_the_chain_of_the_default_cut_is_the_baseline():
    v = probe.verdict([row("chain_pdl", 4.0, cut="2x512"), row("chain_pdl", 5.0), row("hold_2x2w", 3.8, diff=1e-3)])
    assert v["chain_pdl_us_per_phase"] == 5.0 and v["verdict"] is True, v
    assert probe.verdict([row("hold_2x2w", 3.8)])["verdict"] is None
