"""Sweep the slab path for large M (``fp4_slab_linear``: the FP4 weight dequantized a few thousand output
rows at a time into a ring of bf16 slabs that stay in L2, cuBLAS on each slab, optionally on two streams)
against BF16 cuBLAS, the path ``fp4_linear`` takes today and whole-weight dequantize + cuBLAS, at the 816B
linear shapes, all measured in one process.

Every configuration is first checked against the reference linear (NMSE within the op tolerance), then
timed like ``musecore bench`` (CUDA-graph replays, weights rotated past L2)::

    python benchmarks/cuda_slab_sweep.py [--ms 64,128,256,1024,4096] [--out benchmarks/results/cuda_slab_sweep.json]
"""

from __future__ import annotations

import itertools

from cuda_gemm_sweep import point_rows
from cuda_gemv_sweep import checked_time, sweep_main, sweep_points
from musecore_cuda.backend import fp4_slab_linear
from musecore_cuda.bench import memory_ceiling_gbps

CUTS = [(rows, depth, streams) for rows, depth, streams in itertools.product((512, 1024, 2048, 4096), (2, 3), (1, 2))
        if not (streams == 1 and depth == 3)]


def sweep(ms: list[int], shapes: list[str], fmt: str) -> list[dict]:
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    rows = []
    for p in sweep_points(ms, shapes, fmt):
        name, m, t_bf16 = p.case.name, p.m, p.t_bf16
        row, now, deq = point_rows(p, fmt, ceiling, rows)
        results = []
        for slab, depth, streams in CUTS:
            if slab > p.case.n and slab != CUTS[0][0]:
                continue
            t, err = checked_time(p, lambda x, w: fp4_slab_linear(x, w, slab, depth, streams), f"slab {slab}/{depth}/{streams}")
            results.append(row("slab", t, slab_rows=slab, depth=depth, streams=streams, nmse=err))
        best = min(results, key=lambda r: r["time_us"])
        print(f"{name:12s} M={m:5d}: bf16 {t_bf16:8.2f} us | now {now['time_us']:8.2f} ({now['speedup_vs_bf16']:.2f}x "
              f"{now['impl']}) | dequant {deq['speedup_vs_bf16']:.2f}x | best slab {best['time_us']:8.2f} "
              f"({best['speedup_vs_bf16']:.2f}x) rows {best['slab_rows']} depth {best['depth']} "
              f"streams {best['streams']}", flush=True)
    return rows


if __name__ == "__main__":
    sweep_main(__doc__.splitlines()[0], "64,128,256,1024,4096", "cuda_slab_sweep.json", sweep)
