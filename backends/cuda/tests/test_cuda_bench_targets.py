"""``musecore bench --case targets``' summary rows from given detail rows (no GPU: every measurement is replaced by a
row of known values), so that a device call's table is not lost to a bug in the arithmetic after the measurements:
each target's worst and median, met or not, and the grouped Gluon MoE's row with its error where it cannot run."""

from __future__ import annotations

import pytest
import torch

from musecore_cuda import bench


def _linear(fmt: str, m: int, speedup: float) -> dict:
    return {"format": fmt, "M": m, "shape": "q_proj 8192->8192", "speedup_vs_bf16": speedup, "default": True,
            "time_us": 10.0}


@pytest.fixture
def fake_runs(monkeypatch):
    def moe(batches, prefill):
        rows = [{"M": b, "pct_memory_ceiling": 50.0 + b, "speedup_vs_bf16": 2.0} for b in batches]
        return rows + [{"M": prefill, "pct_memory_ceiling": 5.0, **grouped}]

    grouped = {"path": "grouped gluon", "speedup_vs_bf16": 1.54, "triton_speedup_vs_bf16": 0.83}
    monkeypatch.setattr(bench, "gpu_name", lambda: "fake H200")
    monkeypatch.setattr(bench, "memory_ceiling_gbps", lambda: {"ceiling_gbps": 4000.0})
    monkeypatch.setattr(bench, "bench_linear", lambda ms, formats: [_linear("nvfp4", m, 1.0 + m / 1000) for m in ms])
    monkeypatch.setattr(bench, "bench_moe", moe)
    monkeypatch.setattr(bench, "bench_fp8", lambda ms, moe_tokens: [
        {"format": "fp8", "path": "per-token", "M": 4096, "speedup_vs_bf16": 1.2},
        {"format": "fp8", "path": "moe", "M": 8192, "speedup_vs_bf16": 2.0}])
    monkeypatch.setattr(bench, "bench_e2e", lambda batches: [{"format": "nvfp4", "cuda_graphs": True,
                                                              "pct_memory_ceiling": 25.0}])
    monkeypatch.setattr(bench, "bench_gemlite", lambda formats, budget_s: [])
    return grouped


def _targets() -> dict:
    return {r["target"]: r for r in bench.bench_targets() if r.get("case") == "targets"}


def test_targets_summarize_each_goal_and_the_moe_prefill_row(fake_runs):
    rows = _targets()
    assert rows["linear M=4096"]["worst"] == pytest.approx(5.096) and rows["linear M=4096"]["met"]
    assert not rows["MoE decode batch 1-16 (% of memory ceiling over routed bytes)"]["met"]
    prefill = rows["MoE prefill 8192 tokens (NVFP4 vs BF16 experts)"]
    assert prefill["worst"] == pytest.approx(1.54) and prefill["met"]
    assert "grouped gluon" in prefill["detail"] and "Triton GEMM 0.83x" in prefill["detail"]


def test_the_moe_prefill_row_says_why_the_gluon_gemm_did_not_run(fake_runs):
    fake_runs.update(path="grouped triton", speedup_vs_bf16=0.83, gluon_error="triton 3.9.0: not 3.6")
    prefill = _targets()["MoE prefill 8192 tokens (NVFP4 vs BF16 experts)"]
    assert not prefill["met"] and "not Gluon: triton 3.9.0" in prefill["detail"]


def test_the_moe_decode_row_names_the_gemvs_beside_the_grouped_batches(fake_runs, monkeypatch):
    """Where the grouped GEMM took a decode batch, the GEMVs timed beside it (``_gemv_moe_columns``) are named in the
    MoE decode target's detail, so one targets run says on which side of the crossover its GPU sits; the target is
    still judged on the default path's percentages."""
    def moe(batches, prefill):
        rows = [{"M": b, "path": "gemv", "pct_memory_ceiling": 70.0} for b in batches if b < 8]
        rows += [{"M": b, "path": "grouped gluon", "pct_memory_ceiling": 60.0 + b / 8, "gemv_time_us": 600.0,
                  "gemv_pct_memory_ceiling": 68.5} for b in batches if b >= 8]
        return rows + [{"M": prefill, "pct_memory_ceiling": 5.0, **fake_runs}]
    monkeypatch.setattr(bench, "bench_moe", moe)
    row = _targets()["MoE decode batch 1-16 (% of memory ceiling over routed bytes)"]
    assert row["worst"] == pytest.approx(61.0) and not row["met"]
    assert "at 8 the grouped gluon 61.0%, the GEMVs beside 68.5%" in row["detail"], row["detail"]
    assert "at 16 the grouped gluon 62.0%, the GEMVs beside 68.5%" in row["detail"], row["detail"]
    assert "at 4 " not in row["detail"]


def test_the_gemv_columns_beside_a_grouped_decode_batch(monkeypatch):
    """``_gemv_moe_columns``' arithmetic with the kernels stood in for (CPU tensors, fixed times): % of the ceiling
    over the row's bytes, the default's speed-up over the GEMVs and the NMSE of their outputs."""
    out = torch.ones(4, 8)
    monkeypatch.setattr(bench, "moe_decode_gemv", lambda *args: out * 1.01)
    monkeypatch.setattr(bench, "time_us", lambda fn, reps=1: 500.0)

    class Backend:
        def moe(self, *args):
            return out

    class Experts:
        gate = up = down = None
    cols = bench._gemv_moe_columns(Backend(), None, None, None, Experts(), None, 400.0, 2_000_000_000,
                                   {"ceiling_gbps": 4000.0})
    assert cols["gemv_time_us"] == 500.0 and cols["default_vs_gemv"] == pytest.approx(1.25)
    assert cols["gemv_pct_memory_ceiling"] == pytest.approx(100.0)  # 2 GB in 500 us = 4000 GB/s
    assert cols["gemv_nmse_vs_default"] == pytest.approx(1e-4 / 1.01 ** 2, rel=1e-3)  # against the GEMVs' power


def test_the_moe_rows_route_the_same_experts_everywhere():
    """The seeded MoE inputs (the bench's rows and the lab's ncu of them) route the distinct experts the GPU runs
    recorded (runs 131-138: 8 / 16 / 31 / 56 / 100 at 1 / 2 / 4 / 8 / 16 tokens); here through the reference router,
    the same fp32 sigmoid + bias top-k, on the CPU."""
    from musecore.ops.reference import router_topk

    router = bench.seeded_router(256, 8192, "cpu")
    routed = {t: int(bench.seeded_moe_batch(router_topk, router, t, 8, 4096)[2].unique().numel())
              for t in (1, 2, 4, 8, 16)}
    assert routed == {1: 8, 2: 16, 4: 31, 8: 56, 16: 100}, routed
    again = bench.seeded_moe_batch(router_topk, bench.seeded_router(256, 8192, "cpu"), 2, 8, 4096)
    first = bench.seeded_moe_batch(router_topk, router, 2, 8, 4096)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
