"""One linear shape, INT4 vs PyTorch BF16 ``F.linear``, cold (weights rotated over ``--rotate-mib``, as
``musecore bench --case linear``) and warm (one weight called back to back), in interleaved rounds: the probe
behind the issue 30 notes (lab/NOTES.md "Session 37: linear").

    MUSECORE_NUM_THREADS=2 python backends/xeon/lab/scripts/linear_probe.py 1024 8192 --ms 64 128 256

Prints per M the best time of each path (us), GFLOP/s, INT4 dense/GEMV over torch, and every round's times
(``--rounds``) so a single stalled round shows as such.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from musecore.benchmarking import cycle
from musecore_xeon.bench import clone_int4, random_int4_linear, rotating, rotation_bytes
from musecore_xeon.backend import XeonBackend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("--ms", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rotate-mib", type=int, default=None, help="default: 2 x L3 (the bench's rotation)")
    parser.add_argument("--gemv", action="store_true", help="time the INT4 GEMV too")
    args = parser.parse_args()
    n, k = args.n, args.k
    total = rotation_bytes() if args.rotate_mib is None else args.rotate_mib << 20
    backend = XeonBackend()
    bf16 = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    torch_ws = [bf16] + rotating(bf16.clone, 2 * n * k, total)[1:]
    int4 = random_int4_linear(backend, n, k)
    int4s = [int4] + rotating(lambda: clone_int4(int4), int4.nbytes, total)[1:]
    print(f"{n}x{k} threads={torch.get_num_threads()} rotation {total >> 20} MiB: {len(torch_ws)} bf16 copies, "
          f"{len(int4s)} int4 copies; crossover {int4.crossover} load {os.getloadavg()[0]:.2f}", flush=True)
    for m in args.ms:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        paths = {"torch cold": (torch_ws, lambda w: F.linear(x, w)),
                 "int4 cold": (int4s, lambda lin: lin.run_dense(x)),
                 "torch warm": ([bf16] * 4, lambda w: F.linear(x, w)),
                 "int4 warm": ([int4] * 4, lambda lin: lin.run_dense(x))}
        if args.gemv:
            paths["gemv cold"] = (int4s, lambda lin: lin.run_small_m(x))
        fns = {name: cycle(objs, call) for name, (objs, call) in paths.items()}
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                start = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - start) * 1e6 / len(paths[name][0]))
        best = {name: min(t) for name, t in times.items()}
        flop = 2 * m * n * k
        line = "  ".join(f"{name} {us:8.1f}us {flop / us / 1e3:5.0f}GF" for name, us in best.items())
        print(f"M={m:4d} {line}  cold int4/torch {best['torch cold'] / best['int4 cold']:.2f}x "
              f"warm {best['torch warm'] / best['int4 warm']:.2f}x  load {os.getloadavg()[0]:.2f}", flush=True)
        for name, t in times.items():
            print(f"    {name:10s} " + " ".join(f"{u:8.0f}" for u in t))


if __name__ == "__main__":
    main()
