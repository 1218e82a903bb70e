"""Run the CUDA backend's kernel benchmarks and the lab's sweep, print a table, save JSON under lab/results/.

Usage (on a machine with an NVIDIA GPU; PYTHONPATH=.:quant:backends/triton:backends/cuda when not installed)::

    python backends/cuda/lab/scripts/cuda_bench.py --cases linear,moe,attention [--out-dir backends/cuda/lab/results]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import sys

import torch

from musecore_cuda.bench import memory_ceiling_gbps, benchmarks as product_benchmarks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab: the lab's cases
from bench_sweeps import sweep_linear_configs  # noqa: E402


def benchmarks() -> dict:
    """The product's cases (``musecore bench --backend cuda``) and the lab's tile sweep."""
    return {**product_benchmarks(), "sweep": sweep_linear_configs}

COLUMNS = ("case", "format", "path", "shape", "M", "config", "time_us", "speedup_vs_bf16", "pct_memory_ceiling")


def print_table(rows: list[dict]) -> None:
    print(" | ".join(COLUMNS))
    for row in rows:
        print(" | ".join(str(row.get(c, "")) for c in COLUMNS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="linear,moe,attention", help=f"comma list of {sorted(benchmarks())}")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "results"))
    parser.add_argument("--ms", default=None, help="linear, sweep, gemlite: comma list of M (default: each case's own)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_bench needs a CUDA GPU: torch.cuda.is_available() is False")
    table = benchmarks()
    unknown = [c for c in args.cases.split(",") if c not in table]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; valid: {sorted(table)}")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **memory_ceiling_gbps()}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        started = time.time()
        kwargs = {"ms": tuple(int(m) for m in args.ms.split(","))} if args.ms and case in ("linear", "sweep", "gemlite") else {}
        rows = table[case](**kwargs)
        print(f"\n== {case} ({time.time() - started:.0f} s) ceiling {meta['ceiling_gbps']:.0f} GB/s")
        print_table(rows)
        (out_dir / f"cuda_{case}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
