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


@pytest.mark.parametrize("preset", ["muse-tiny", "muse-small", "muse-spark-open-816b-a42b"])
def test_decode_bytes_count_every_active_weight_once(preset: str) -> None:
    """All-BF16 bytes per token = 2 bytes per active parameter, less the embedding table (one row read) and the norm
    and residual-gate vectors, plus 2 more bytes per router weight (the router is fp32)."""
    from musecore.config import MuseConfig
    config = MuseConfig.from_name(preset)
    H, L, sparse = config.hidden_size, config.num_hidden_layers, len(config.sparse_layers)
    vectors = L * 5 * H + sparse * 2 * config.moe_hidden_size + H  # 3 norms + 2 gates per layer, 2 MoE norms, final
    expected = 2 * (config.num_active_parameters() - config.vocab_size * H - vectors) \
        + 2 * sparse * config.num_local_experts * H
    got = bench.decode_bytes_per_token(config)
    assert got["bf16_bytes"] == expected, (got["bf16_bytes"], expected)
    assert got["int4_dense_bytes"] < got["int4_plan_bytes"] < got["bf16_bytes"]


def test_all_bf16_baseline_keeps_every_sparse_layer_in_bf16() -> None:
    from musecore.config import MuseConfig
    config = MuseConfig.from_name("muse-tiny")
    baseline = bench.all_experts_bf16(config)
    assert baseline.bf16_expert_layers == config.sparse_layers != config.bf16_expert_layers
    assert baseline.hidden_size == config.hidden_size and baseline.layer_types == config.layer_types


def test_musecore_bench_finds_the_cases_through_the_entry_point_group() -> None:
    from musecore.commands.bench import benchmark_cases
    from musecore_xeon import XeonBackend

    cases = benchmark_cases("xeon")
    assert set(cases) == {"linear", "moe", "attention", "e2e", "prefill", "distributed"} and all(
        callable(f) for f in cases.values()), cases
    assert not hasattr(XeonBackend, "benchmarks"), "the cases come from the entry point, not from the backend class"


def test_the_backend_does_not_import_its_benchmarks() -> None:
    import subprocess
    import sys

    code = "import sys, musecore_xeon; XeonBackend = musecore_xeon.XeonBackend; XeonBackend().probe(); " \
           "print('musecore_xeon.bench' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]


def test_every_row_records_the_isa_threads_and_load_average() -> None:
    """PERF.md: a ratio names the hardware it was measured on; the rows carry the ISA tier, the INT4 GEMMs this
    build runs, the thread count and the load average (linear rows per (shape, M), other cases per call)."""
    from musecore_xeon.cpu import read_cpu_info
    rows = bench.benchmarks()["attention"](cases=((1, 64, None),), repeats=1)
    rows += bench.benchmarks()["linear"](shapes=[(64, 128)], ms=[1, 16], repeats=1, rotate_bytes=1 << 16)
    for row in rows:
        assert row["isa"] == read_cpu_info().isa_tier and row["threads"] == torch.get_num_threads(), row
        assert isinstance(row["load_avg_1m"], float) and row["int4_gemms"] in (
            "tiles", "amx", "avx512_bf16", "amx+avx512_bf16"), row
