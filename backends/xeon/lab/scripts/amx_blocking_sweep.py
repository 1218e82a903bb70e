"""The INT4 AMX GEMM's blocking, swept, and where its time goes (leave-one-out), on an AMX host.

For each shape and M: PyTorch BF16 ``F.linear`` and the AMX GEMM at every (K block, activation-row block, panel cap,
streamed packing) of the grid, hot (the weight stays in the L3 between calls: this compares blockings, the issue's
table is ``issue30_tables.py linear``, cold), best of ``--repeats``; then, at the default and at the best blocking,
the same call with one phase skipped (``no_dequant``, ``no_products``, ``no_pack``: garbage results, time only),
which says how much of the time each phase holds. Every blocking is first checked to give the default's bits.

    MUSECORE_NUM_THREADS=16 python3 backends/xeon/lab/scripts/amx_blocking_sweep.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from musecore_xeon import XeonBackend
from musecore_xeon.bench import random_int4_linear
from musecore_xeon.kernels import native
from musecore_xeon.kernels.crossover import time_us

DEFAULT = (1024, 256, 128, 0)  # csrc/amx.c: AMX_K_BLOCK, AMX_M_BLOCK, AMX_MAX_PANEL, streamed packing off


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1024x8192", "10240x8192", "8192x2048", "2048x8192"],
                        help="NxK (out x in)")
    parser.add_argument("--ms", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--k-blocks", nargs="+", type=int, default=[256, 1024, 2048])
    parser.add_argument("--m-blocks", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--panels", nargs="+", type=int, default=[128, 256])
    parser.add_argument("--stream", nargs="+", type=int, default=[0, 1], help="packed activations streamed (1) or not")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    if not native.amx_ready():
        raise SystemExit("no AMX here (musecore_xeon.kernels.native.amx_ready() is False)")
    threads = int(os.environ.get("MUSECORE_NUM_THREADS", torch.get_num_threads()))
    torch.set_num_threads(threads)
    backend = XeonBackend()
    host = {"cpu": platform.processor() or platform.machine(), "threads": threads,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_avg_1m": os.getloadavg()[0],
            "isa": "amx"}
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = list(itertools.product(args.k_blocks, args.m_blocks, args.panels, args.stream))
    if DEFAULT not in grid:
        grid.append(DEFAULT)
    try:
        for shape in args.shapes:
            n, k = (int(v) for v in shape.split("x"))
            lin = random_int4_linear(backend, n, k)
            gemv = lin.bound_gemv()
            w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            for m in args.ms:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                native.int4_amx_tune()
                base = native.int4_amx(gemv, x)
                t_bf16 = time_us(lambda: F.linear(x, w), args.repeats)
                times = {}
                for kb, mb, panel, stream in grid:
                    native.int4_amx_tune(kb, mb, panel, stream=bool(stream))
                    if not torch.equal(native.int4_amx(gemv, x), base):
                        raise SystemExit(f"{shape} M={m}: blocking {(kb, mb, panel, stream)} changed the result's bits")
                    times[(kb, mb, panel, stream)] = time_us(lambda: native.int4_amx(gemv, x), args.repeats)
                best = min(times, key=times.get)
                t_bf16 = min(t_bf16, time_us(lambda: F.linear(x, w), args.repeats))  # again, after: load drift
                phases = {}
                for label, blocking in (("default", DEFAULT), ("best", best)):
                    for mode in ("no_dequant", "no_products", "no_pack"):
                        native.int4_amx_tune(*blocking[:3], mode=mode, stream=bool(blocking[3]))
                        phases[f"{label}_{mode}"] = time_us(lambda: native.int4_amx(gemv, x), args.repeats)
                    native.int4_amx_tune()
                row = {"shape": shape, "m": m, "bf16_us": t_bf16, "default": list(DEFAULT),
                       "default_us": times[DEFAULT], "best": list(best), "best_us": times[best],
                       "default_vs_bf16": t_bf16 / times[DEFAULT], "best_vs_bf16": t_bf16 / times[best],
                       "phases_us": phases, "grid_us": {"/".join(map(str, key)): t for key, t in times.items()},
                       "load_avg_1m": os.getloadavg()[0], **{key: v for key, v in host.items() if key != "load_avg_1m"}}
                rows.append(row)
                print(f"{shape} M={m}: bf16 {t_bf16:.0f} us | default {times[DEFAULT]:.0f} us "
                      f"({row['default_vs_bf16']:.2f}x) | best {best} {times[best]:.0f} us ({row['best_vs_bf16']:.2f}x)"
                      f" | leave-out default: " + " ".join(f"{k.split('_', 1)[1]} {v:.0f}" for k, v in phases.items()
                                                          if k.startswith("default")), flush=True)
                (out / "amx_blocking_sweep.json").write_text(json.dumps({"host": host, "rows": rows,
                                                                         "finished": False}, indent=1))
    finally:
        native.int4_amx_tune()
    (out / "amx_blocking_sweep.json").write_text(json.dumps({"host": host, "rows": rows, "finished": True,
                                                             "time": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))


if __name__ == "__main__":
    main()
