"""Load time of the least-error requantization against the producer rule (issue 28: within 1.5x).

Converts the bundled muse-tiny to NVFP4 (experts), then times ``musecore.load`` of three loads that
requantize, alternating MUSECORE_REQUANTIZATION=producer and =least-error, and reports the median
CPU time (``time.process_time``: this box's 2 cores are shared, and wall time moves with the other
jobs' load) and wall time of each, their ratio and the mean SQNR of the converted tensors.

    python benchmarks/requant_load_speed.py --repeats 7 --json benchmarks/results/real_arch/requant_load_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import musecore
from musecore.quantize import convert_muse_checkpoint

BF16 = Path(musecore.__file__).parent / "data" / "muse-tiny"
RULES = ("producer", "least-error")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        nvfp4 = Path(tmp) / "nvfp4"
        convert_muse_checkpoint(BF16, nvfp4, to="nvfp4", progress=False)
        cases = [("mi355x: NVFP4 experts -> MXFP4", nvfp4, "mi355x", False),
                 ("xeon6: NVFP4 experts -> INT4", nvfp4, "xeon6", False),
                 ("xeon6 default plan: BF16 experts and attention/pooler/lm_head -> INT4", BF16, "xeon6", None)]
        results = {}
        for label, folder, device, dense in cases:
            cpu = {rule: [] for rule in RULES}
            wall = {rule: [] for rule in RULES}
            sqnr = {}
            for _ in range(args.repeats):
                for rule in RULES:  # alternated, so drift in the machine's load hits both alike
                    os.environ["MUSECORE_REQUANTIZATION"] = rule
                    c, w = time.process_time(), time.perf_counter()
                    model = musecore.load(folder, device=device, emulate=True, progress=False, quantize_dense=dense)
                    cpu[rule].append(time.process_time() - c)
                    wall[rule].append(time.perf_counter() - w)
                    report = model.conversion_report
                    sqnr[rule] = sum(r.sqnr_db for r in report) / len(report)
                    del model
            med = {k: {rule: statistics.median(v[rule]) for rule in RULES} for k, v in (("cpu_s", cpu), ("wall_s", wall))}
            results[label] = {**med, "cpu_ratio": med["cpu_s"]["least-error"] / med["cpu_s"]["producer"],
                              "wall_ratio": med["wall_s"]["least-error"] / med["wall_s"]["producer"],
                              "mean_sqnr_db": sqnr, "tensors_converted": len(report), "runs_cpu_s": cpu}
            print(f"{label}: CPU {med['cpu_s']['producer']:.3f} s -> {med['cpu_s']['least-error']:.3f} s "
                  f"({results[label]['cpu_ratio']:.2f}x), wall {results[label]['wall_ratio']:.2f}x; mean SQNR "
                  f"{sqnr['producer']:.2f} -> {sqnr['least-error']:.2f} dB", flush=True)
        os.environ.pop("MUSECORE_REQUANTIZATION", None)
    if args.json:
        args.json.write_text(json.dumps({"machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
                                         "torch": torch.__version__, "threads": 1, "repeats": args.repeats,
                                         "cases": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
