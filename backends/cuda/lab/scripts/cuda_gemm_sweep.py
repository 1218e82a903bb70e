"""Sweep the tiled CUDA W4A16 GEMM's cuts (``fp4_gemm_cuda.GemmPlan``) at the 816B linear shapes for
M > 16, next to BF16 cuBLAS, the path ``fp4_linear`` takes today, dequantize + cuBLAS and the memory
ceiling, all measured in one process.

Every configuration is first checked against the reference linear (NMSE within the op tolerance),
then timed like ``musecore bench`` (CUDA-graph replays, weights rotated past L2). Prints one line per
shape and M and saves every row as JSON::

    python backends/cuda/lab/scripts/cuda_gemm_sweep.py [--ms 16,32,64,128,256,1024] [--out backends/cuda/lab/results/cuda_gemm_sweep.json]
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable

import torch

from cuda_gemv_sweep import checked_time, sweep_main, sweep_points
from musecore_cuda.backend import fp4_dequant_linear, fp4_linear, fp4_linear_path
from musecore_cuda.bench import memory_ceiling_gbps
from musecore_cuda.kernels import fp4_gemm_cuda


def gemm(x, w, n, k, plan):
    out = torch.empty(x.shape[0], n, device="cuda", dtype=x.dtype)
    return fp4_gemm_cuda.launch(x, w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                n=n, k=k, out=out, plan=plan)


def candidates(m: int, n: int, k: int) -> list[fp4_gemm_cuda.GemmPlan]:
    chosen = fp4_gemm_cuda.make_plan(m, n, k, torch.device("cuda"))
    plans = {chosen}
    for tile, split in itertools.product((1, 2), range(1, 9)):
        if k // fp4_gemm_cuda.CHUNK_K // split >= 4:
            plans.add(dataclasses.replace(chosen, tile=tile, split=split))
    return [chosen] + sorted(plans - {chosen}, key=lambda p: (p.tile, p.split, p.stages, p.prefetch))


def point_rows(p, fmt: str, ceiling: float, rows: list[dict]) -> tuple[Callable[..., dict], dict, dict]:
    """For one sweep point: a recorder of rows (appended to ``rows``, with the ratio to BF16 and the share of
    the memory ceiling), after the baselines it records first: BF16 cuBLAS, the path ``fp4_linear`` takes
    (returned as ``now``) and dequantize + cuBLAS (``deq``)."""
    name, n, k, m, x, t_bf16, nbytes = p.case.name, p.case.n, p.case.k, p.m, p.x, p.t_bf16, p.case.nbytes

    def row(impl: str, t: float, **extra) -> dict:
        r = {"shape": f"{name} {k}->{n}", "format": fmt, "M": m, "impl": impl, "time_us": round(t, 2),
             "speedup_vs_bf16": round(t_bf16 / t, 3),
             "pct_memory_ceiling": round(100 * nbytes / t / 1e3 / ceiling, 1), **extra}
        rows.append(r)
        return r

    row("bf16", t_bf16)
    path = fp4_linear_path(m, x.dtype, x.device, n * k, weight_format=fmt, out_features=n)
    now = row(f"fp4_linear ({path})", checked_time(p, lambda x, w: fp4_linear(x, w), path)[0])
    deq = row("dequant", checked_time(p, lambda x, w: fp4_dequant_linear(x, w), "dequant")[0])
    return row, now, deq


def sweep(ms: list[int], shapes: list[str], fmt: str) -> list[dict]:
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    rows = []
    for p in sweep_points(ms, shapes, fmt):
        name, n, k, m, t_bf16 = p.case.name, p.case.n, p.case.k, p.m, p.t_bf16
        row, now, deq = point_rows(p, fmt, ceiling, rows)
        results = []
        for i, plan in enumerate(candidates(m, n, k)):
            t, err = checked_time(p, lambda x, w: gemm(x, w, n, k, plan), str(plan))
            results.append(row("gemm", t, plan=plan.__dict__, chosen=i == 0, nmse=err))
        best = min(results, key=lambda r: r["time_us"])
        print(f"{name:12s} M={m:5d}: bf16 {t_bf16:8.2f} us | now {now['time_us']:8.2f} "
              f"({now['speedup_vs_bf16']:.2f}x {now['impl']}) | dequant {deq['speedup_vs_bf16']:.2f}x | "
              f"gemm chosen {results[0]['time_us']:8.2f} ({results[0]['speedup_vs_bf16']:.2f}x, "
              f"{results[0]['pct_memory_ceiling']:.0f}%) | best {best['time_us']:8.2f} "
              f"({best['speedup_vs_bf16']:.2f}x) {best['plan']}", flush=True)
    return rows


if __name__ == "__main__":
    sweep_main(__doc__.splitlines()[0], "16,32,64,128,256,1024", "cuda_gemm_sweep.json", sweep)
