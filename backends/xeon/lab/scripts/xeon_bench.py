"""Run the xeon backend's benchmarks, print a table and save JSON under backends/xeon/lab/results/.

    python backends/xeon/lab/scripts/xeon_bench.py                       # linear, moe, attention, e2e (muse-tiny)
    python backends/xeon/lab/scripts/xeon_bench.py --cases linear --ms 1 8 64 --shapes 18432x8192
    python backends/xeon/lab/scripts/xeon_bench.py --cases e2e --presets muse-tiny muse-small

Linear and MoE weights are timed cold from DRAM: each implementation cycles through copies of its weight
totalling at least twice the L3 (``musecore_xeon.bench.rotating``), one call = cycle time / copies; the rows carry
``cold_copies`` and ``cold_bytes``. The host's load average is recorded before and after: on a shared machine the numbers move with it. The memory
ceiling is measured at the start and again at the end; ``pct_memory_ceiling`` is against the higher of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from musecore_xeon.bench import LINEAR_MS, LINEAR_SHAPES, benchmarks, l3_cache_bytes, memory_bandwidth_gbs, rotation_bytes
from musecore_xeon.cpu import configure_threads, read_cpu_info
from musecore_xeon.kernels.crossover import calibrations
from musecore_xeon.kernels.native import ISA_ENV, compile_flags

RESULTS = Path(__file__).resolve().parents[1] / "results"  # backends/xeon/lab/results
COLUMNS = ("case", "shape", "M", "impl", "path", "time_us", "speedup_vs_bf16", "speedup_vs_xeon_bf16",
           "speedup_vs_f_linear", "pct_memory_ceiling")


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


def print_table(rows: list[dict[str, Any]]) -> None:
    cells = [[fmt(r.get(c)) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["linear", "moe", "attention", "e2e"],
                        choices=sorted(benchmarks()))
    parser.add_argument("--shapes", nargs="+", default=[f"{n}x{k}" for n, k in LINEAR_SHAPES], help="NxK (out x in)")
    parser.add_argument("--ms", nargs="+", type=int, default=list(LINEAR_MS))
    parser.add_argument("--presets", nargs="+", default=["muse-tiny"], help="e2e presets")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="default: MUSECORE_NUM_THREADS or PyTorch's")
    parser.add_argument("--out", type=Path, default=RESULTS / "xeon_bench.json")
    args = parser.parse_args(argv)

    threads = configure_threads(args.threads)
    cpu = read_cpu_info()
    load_before = os.getloadavg()
    bandwidth = memory_bandwidth_gbs()
    isa_flags = [f for f in compile_flags() if f.startswith("-m")]
    print(f"{cpu.summary()}\nthreads {threads}, torch {torch.__version__}, load average {load_before}")
    print(f"native isa: {' '.join(isa_flags) or 'portable C'} ({ISA_ENV}={os.environ.get(ISA_ENV, '')!r})")
    print(f"memory: copy {bandwidth['copy_gbs']:.1f} GB/s, read {bandwidth['read_gbs']:.1f} GB/s")
    cold = (f"weights cold from DRAM: each implementation cycles through copies of its weight totalling >= "
            f"{rotation_bytes() >> 20} MiB (2x the {l3_cache_bytes() >> 20} MiB L3); time = cycle / copies")
    print(cold)
    cases = benchmarks()
    options = {"linear": {"shapes": [tuple(int(v) for v in s.split("x")) for s in args.shapes], "ms": args.ms,
                          "repeats": args.repeats},
               "moe": {"tokens": args.ms, "repeats": args.repeats},
               "attention": {"repeats": args.repeats},
               "e2e": {"presets": args.presets}}
    rows: list[dict[str, Any]] = []
    for case in args.cases:
        start = time.perf_counter()
        case_rows = cases[case](**options[case])
        note = f"; {cold}" if case in ("linear", "moe") else ""
        print(f"\n== {case} ({time.perf_counter() - start:.0f} s{note})")
        print_table(case_rows)
        rows.extend(case_rows)
    # the ceiling again at the end: on a shared host one measurement can land in a busy phase (a 2-thread run once
    # measured 22.8 GB/s against 32-36 in the runs around it, and reported INT4 at 103-121% of it); the higher of the
    # two is the ceiling, and every row's percentage is rescaled to it (never raised)
    bandwidth_after = memory_bandwidth_gbs.__wrapped__()
    ceiling = max(bandwidth["ceiling_gbs"], bandwidth_after["ceiling_gbs"])
    for row in rows:
        if row.get("pct_memory_ceiling") is not None:
            row["pct_memory_ceiling"] *= bandwidth["ceiling_gbs"] / ceiling
    print(f"\nmemory at the end: copy {bandwidth_after['copy_gbs']:.1f} GB/s, read {bandwidth_after['read_gbs']:.1f} GB/s; "
          f"ceiling used for pct_memory_ceiling: {ceiling:.1f} GB/s (the higher of start and end)")
    if ceiling != bandwidth["ceiling_gbs"]:
        print_table([r for r in rows if r["case"] == "linear" and r["M"] == 1])
    crossovers = [c.table() for c in calibrations()]
    print("\n== measured crossovers\n" + "\n".join(crossovers))
    report = {"machine": {"cpu": cpu.summary(), "isa_tier": cpu.isa_tier, "native_isa_flags": isa_flags, "threads": threads,
                          "torch": torch.__version__, "python": platform.python_version(),
                          "load_average_before": load_before, "load_average_after": os.getloadavg()},
              "memory_bandwidth_gbs": {**bandwidth, "ceiling_gbs": ceiling, "ceiling_at_start_gbs": bandwidth["ceiling_gbs"]},
              "memory_bandwidth_at_end_gbs": bandwidth_after,
              "cold_weights": {"l3_bytes": l3_cache_bytes(), "rotation_bytes": rotation_bytes(), "note": cold}, "crossovers": crossovers, "command": " ".join(sys.argv),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nload average after {os.getloadavg()}; saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
