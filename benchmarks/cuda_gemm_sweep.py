"""Sweep the tiled CUDA W4A16 GEMM's cuts (``fp4_gemm_cuda.GemmPlan``) at the 816B linear shapes for
M > 16, next to BF16 cuBLAS, the path ``fp4_linear`` takes today, dequantize + cuBLAS and the memory
ceiling, all measured in one process.

Every configuration is first checked against the reference linear (NMSE within the op tolerance),
then timed like ``musecore bench`` (CUDA-graph replays, weights rotated past L2). Prints one line per
shape and M and saves every row as JSON::

    python benchmarks/cuda_gemm_sweep.py [--ms 16,32,64,128,256,1024] [--out benchmarks/results/cuda_gemm_sweep.json]
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.nn.functional as F

import musecore_quant
from cuda_gemv_sweep import nmse, sweep_main
from musecore.ops import tolerance
from musecore_cuda.backend import fp4_dequant_linear, fp4_linear, fp4_linear_path
from musecore_cuda.bench import LINEAR_SHAPES, _cycle, _rotating, memory_ceiling_gbps, random_fp4, time_us
from musecore_cuda.kernels import fp4_gemm_cuda
from musecore_cuda.layouts import prepare_fp4


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


def sweep(ms: list[int], shapes: list[str], fmt: str) -> list[dict]:
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    rows = []
    for name in shapes:
        n, k = LINEAR_SHAPES[name]
        qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
        w_check = prepare_fp4(qt, torch.device("cuda"))
        dense = musecore_quant.dequantize(qt).float().cuda()
        ws = _rotating(lambda: prepare_fp4(random_fp4(fmt, (n, k)), torch.device("cuda")), n * k // 2)
        bf16 = _rotating(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16), n * k * 2)
        nbytes = ws[0].nbytes
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ dense.T

            def row(impl: str, t: float, **extra) -> dict:
                r = {"shape": f"{name} {k}->{n}", "format": fmt, "M": m, "impl": impl, "time_us": round(t, 2),
                     "speedup_vs_bf16": round(t_bf16 / t, 3),
                     "pct_memory_ceiling": round(100 * nbytes / t / 1e3 / ceiling, 1), **extra}
                rows.append(r)
                return r

            t_bf16 = time_us(_cycle(bf16, lambda w: F.linear(x, w))) / len(bf16)
            row("bf16", t_bf16)
            path = fp4_linear_path(m, x.dtype, x.device, n * k)
            now = row(f"fp4_linear ({path})", time_us(_cycle(ws, lambda w: fp4_linear(x, w))) / len(ws))
            deq = row("dequant", time_us(_cycle(ws, lambda w: fp4_dequant_linear(x, w))) / len(ws))
            results = []
            for i, plan in enumerate(candidates(m, n, k)):
                err = nmse(ref, gemm(x, w_check, n, k, plan))
                if err > tolerance("linear"):
                    raise SystemExit(f"{name} M={m} {plan}: NMSE {err:.3g} > {tolerance('linear')}")
                t = time_us(_cycle(ws, lambda w: gemm(x, w, n, k, plan))) / len(ws)
                results.append(row("gemm", t, plan=plan.__dict__, chosen=i == 0, nmse=err))
            best = min(results, key=lambda r: r["time_us"])
            print(f"{name:12s} M={m:5d}: bf16 {t_bf16:8.2f} us | now {now['time_us']:8.2f} "
                  f"({now['speedup_vs_bf16']:.2f}x {now['impl']}) | dequant {deq['speedup_vs_bf16']:.2f}x | "
                  f"gemm chosen {results[0]['time_us']:8.2f} ({results[0]['speedup_vs_bf16']:.2f}x, "
                  f"{results[0]['pct_memory_ceiling']:.0f}%) | best {best['time_us']:8.2f} "
                  f"({best['speedup_vs_bf16']:.2f}x) {best['plan']}", flush=True)
        del ws, bf16
        torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    sweep_main(__doc__.splitlines()[0], "16,32,64,128,256,1024", "cuda_gemm_sweep.json", sweep)
