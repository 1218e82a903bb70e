"""Sweep the wgmma W4A16 GEMM's cuts (``fp4_gemm_wgmma.WgmmaPlan``) at the 816B linear shapes, next to
BF16 cuBLAS, the path ``fp4_linear`` takes today, the mma.sync tiled GEMM, dequantize + cuBLAS and the
memory ceiling, all measured in one process.

Every configuration is first checked against the reference linear (NMSE within the op tolerance),
then timed like ``musecore bench`` (CUDA-graph replays, weights rotated past L2). The activation
permutation the kernel needs is timed inside each wgmma figure, and alone (``permute_us``; the GEMM
on permuted activations: ``gemm_alone_us``)::

    python backends/cuda/lab/scripts/cuda_wgmma_sweep.py [--ms 16,32,64,128,256,1024,4096] [--shapes q_proj,...]
        [--out backends/cuda/lab/results/cuda_wgmma_sweep.json]

``WGMMA_CUTS="split,stages,groups;..."`` times only those cuts (of the chosen token tile).
"""

from __future__ import annotations

import sys
from pathlib import Path

import dataclasses
import itertools
import os

import torch

from cuda_gemm_sweep import point_rows
from cuda_gemv_sweep import checked_time, sweep_main, sweep_points
from musecore.benchmarking import cycle
from musecore_cuda.bench import memory_ceiling_gbps, time_us
from musecore_cuda.kernels import fp4_gemm_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab: the wgmma GEMM
import fp4_gemm_wgmma  # noqa: E402


def wgmma(x, w, n, k, plan, ordered=False):
    out = torch.empty(x.shape[0], n, device="cuda", dtype=x.dtype)
    return fp4_gemm_wgmma.launch(x, w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                 n=n, k=k, out=out, plan=plan, ordered=ordered)


def mma_gemm(x, w, n, k):
    out = torch.empty(x.shape[0], n, device="cuda", dtype=x.dtype)
    return fp4_gemm_cuda.launch(x, w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                n=n, k=k, out=out)


def candidates(m: int, n: int, k: int) -> list[fp4_gemm_wgmma.WgmmaPlan]:
    """The chosen cut, then warpgroups per block x cluster split x shared-memory ring depth."""
    chosen = fp4_gemm_wgmma.make_plan(m, n, k, torch.device("cuda"))
    if os.environ.get("WGMMA_CUTS"):  # "split,stages,groups;...": only these cuts of the chosen token tile
        return [dataclasses.replace(chosen, split=a, stages=b, groups=c)
                for a, b, c in (map(int, cut.split(",")) for cut in os.environ["WGMMA_CUTS"].split(";"))]
    plans = {chosen}
    chunks = k // fp4_gemm_wgmma.CHUNK_K
    depths = (4, 6, 8) if chosen.tokens <= 64 else (3, 5, 7)
    for groups, split, stages in itertools.product((2, 4), (4, 8), depths):
        if chunks // split >= 4:
            plans.add(dataclasses.replace(chosen, groups=groups, split=split, stages=stages))
    return [chosen] + sorted(plans - {chosen}, key=lambda p: (p.groups, p.split, p.prefetch, p.stages))


def sweep(ms: list[int], shapes: list[str], fmt: str) -> list[dict]:
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    rows = []
    for p in sweep_points(ms, shapes, fmt):
        name, n, k, m, x, t_bf16 = p.case.name, p.case.n, p.case.k, p.m, p.x, p.t_bf16
        row, now, deq = point_rows(p, fmt, ceiling, rows)
        mma = row("mma_gemm", checked_time(p, lambda x, w: mma_gemm(x, w, n, k), "mma gemm")[0])
        permute = time_us(lambda: fp4_gemm_wgmma.to_slot_order(x))
        xo = fp4_gemm_wgmma.to_slot_order(x)
        results = []
        for i, plan in enumerate(candidates(m, n, k)):
            t, err = checked_time(p, lambda x, w: wgmma(x, w, n, k, plan), str(plan))
            alone = time_us(cycle(p.case.ws, lambda w: wgmma(xo, w, n, k, plan, ordered=True))) / len(p.case.ws)
            results.append(row("wgmma", t, plan=plan.__dict__, chosen=i == 0, nmse=err, permute_us=round(permute, 2),
                               gemm_alone_us=round(alone, 2)))
        best = min(results, key=lambda r: r["time_us"])
        for leave_out in (1, 2):  # the best cut without one stage: where its time goes (results not checked)
            plan = dataclasses.replace(fp4_gemm_wgmma.WgmmaPlan(**best["plan"]), leave_out=leave_out)
            t = time_us(cycle(p.case.ws, lambda w: wgmma(xo, w, n, k, plan, ordered=True))) / len(p.case.ws)
            rows.append({"shape": f"{name} {k}->{n}", "format": fmt, "M": m, "impl": "wgmma_without",
                         "plan": plan.__dict__, "time_us": round(t, 2)})
            print(f"    best cut without {('the wgmmas', 'the weight loads')[leave_out - 1]}: {t:.2f} us", flush=True)
        print(f"{name:12s} M={m:5d}: bf16 {t_bf16:8.2f} us | now {now['speedup_vs_bf16']:.2f}x {now['impl']} | "
              f"mma {mma['speedup_vs_bf16']:.2f}x | dequant {deq['speedup_vs_bf16']:.2f}x | "
              f"wgmma chosen {results[0]['time_us']:8.2f} ({results[0]['speedup_vs_bf16']:.2f}x, "
              f"{results[0]['pct_memory_ceiling']:.0f}%, alone {results[0]['gemm_alone_us']:.1f}) | "
              f"best {best['time_us']:8.2f} "
              f"({best['speedup_vs_bf16']:.2f}x) {best['plan']} | permute {permute:.1f} us", flush=True)
    return rows


if __name__ == "__main__":
    sweep_main(__doc__.splitlines()[0], "16,32,64,128,256,1024,4096", "cuda_wgmma_sweep.json", sweep)
