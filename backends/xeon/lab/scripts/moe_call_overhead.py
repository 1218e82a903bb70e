"""The Python around the fused decode MoE (issue 30 item 3): ``backend.moe`` at T = 1 (8 of 64 experts) against the
same kernel called through ctypes with everything prepared (``native.int4_moe`` / ``bf16_moe`` with the row
addresses kept), warm (the same layer every call), with small experts (h = I = 128: the kernel is a few us, so
the difference is the call's plumbing) and muse-small's (h = I = 768). Medians of alternating rounds; wall and
main-thread CPU per call. Runs on any tree that has ``backend.moe`` and ``native.int4_moe`` (before/after A/B
through PYTHONPATH).

    python3 backends/xeon/lab/scripts/moe_call_overhead.py [--threads 1 2] [--rounds 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import musecore_quant
from musecore_xeon import XeonBackend
from musecore_xeon.kernels import native


def timed(fn, n: int) -> tuple[float, float]:
    for _ in range(50):
        fn()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - wall) / n * 1e6, (time.thread_time() - cpu) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    backend = XeonBackend(num_threads=max(args.threads))
    E, k = 64, 8
    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in ("int4", "bf16"):
        for h in (128, 768):
            def weight(*shape):
                w = torch.randn(*shape, generator=gen) * 0.02
                return musecore_quant.quantize(w, "int4", group_size=128) if fmt == "int4" else w.to(torch.bfloat16)
            experts = backend.prepare_experts(weight(E, h, h), weight(E, h, h), weight(E, h, h))
            resident = experts.extra["xeon"]
            z = torch.randn(1, h, dtype=torch.bfloat16)
            ids = torch.randperm(E, generator=gen)[:k][None].contiguous()
            weights = torch.full((1, k), 1 / k)
            post = torch.ones(h, dtype=torch.bfloat16)
            rows_addr = native.row_addresses(resident.native_pointers)
            if fmt == "int4":
                gu, dn = resident.gate_up[0], resident.down[0]
                direct = lambda: native.int4_moe(resident.native_pointers, z, ids, weights, post, 1e-6, h,  # noqa: E731
                                                 (gu.group_size, dn.group_size),
                                                 (gu.padded_out_features, dn.padded_out_features), rows_addr)
            else:
                direct = lambda: native.bf16_moe(resident.native_pointers, z, ids, weights, post, 1e-6, h,  # noqa: E731
                                                 rows_addr)
            op = lambda: backend.moe(z, weights, ids, experts, post, 1e-6)  # noqa: E731
            assert torch.equal(op(), direct())
            n = args.calls if h == 128 else max(args.calls // 10, 100)
            for t in args.threads:
                torch.set_num_threads(t)
                runs = {"backend.moe": [], "ctypes kernel call": []}
                for _ in range(args.rounds):
                    runs["backend.moe"].append(timed(op, n))
                    runs["ctypes kernel call"].append(timed(direct, n))
                row = {"format": fmt, "h": h, "threads": t}
                for key, v in runs.items():
                    row[key] = {"us_wall": statistics.median(w for w, _ in v),
                                "us_cpu": statistics.median(c for _, c in v)}
                rows.append(row)
                print(f"{fmt} h=I={h} {t} thread(s): backend.moe {row['backend.moe']['us_wall']:.2f} us wall "
                      f"({row['backend.moe']['us_cpu']:.2f} CPU), ctypes kernel call "
                      f"{row['ctypes kernel call']['us_wall']:.2f} ({row['ctypes kernel call']['us_cpu']:.2f})",
                      flush=True)
    out = {"load_average": os.getloadavg(), "torch": torch.__version__, "rows": rows,
           "musecore_xeon": __import__("musecore_xeon").__file__}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
