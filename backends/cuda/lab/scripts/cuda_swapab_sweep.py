"""Sweep the swap-AB W4A16 GEMM (``fp4_gemm_swapab``: the upcast weight as ``tl.dot``'s
left operand, so ``wgmma`` may take it from registers) at the 816B linear shapes, next to BF16 cuBLAS, the path
``fp4_linear`` takes today and dequantize + cuBLAS, all measured in one process.

Two scale layouts: ``resident`` (the backend's ``[N, K/group]`` bytes, read with a per-column gather) and
``n_major`` (a ``[K/group, N]`` copy; its gather is contiguous along N, so Triton pipelines it into shared
memory and the weight tile stays in registers up to the MMA: see ``swapab_ttgir.py``). Every cut is first
checked against an fp32 product of the dequantized weight (NMSE within the linear op's tolerance), then timed
like ``musecore bench`` (CUDA-graph replays, weights rotated past L2)::

    python backends/cuda/lab/scripts/cuda_swapab_sweep.py [--ms 16,32,64,128,256,1024,4096] [--shapes q_proj,...]
        [--out backends/cuda/lab/results/cuda_swapab_sweep.json] [--precompile 12]

``--precompile N`` compiles every cut first in N worker processes (Triton's disk cache), so that the timed
process does not compile serially.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

import importlib

from musecore_cuda.bench import LINEAR_SHAPES, memory_ceiling_gbps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab: the swap-AB kernel

SCALE_LAYOUTS = ("resident", "n_major")
WARPS = {64: (4,), 128: (4, 8), 256: (8,)}
STAGES = tuple(int(s) for s in os.environ.get("SWAPAB_STAGES", "2,3").split(","))


def block_ms(m: int) -> tuple[int, ...]:
    if m <= 16:
        return (16,)
    if m <= 32:
        return (16, 32)
    if m <= 64:
        return (32, 64)
    if m <= 128:
        return (64, 128)
    if m <= 256:
        return (64, 128, 256)
    return (128, 256)


def split_for(m: int, n: int, k: int, bn: int, bm: int, sms: int = 132) -> int:
    """Split-K (power of two, >= 4 chunks per split) until the grid has at least one program per SM."""
    tiles = -(-m // bm) * -(-n // bn)
    chunks, split = k // 128, 1
    while tiles * split < sms and chunks // (split * 2) >= 4:
        split *= 2
    return split


def cuts(m: int, n: int, k: int):
    from fp4_gemm_swapab import SwapAbConfig
    for bn, bm, stages in itertools.product((64, 128, 256), block_ms(m), STAGES):
        for warps in WARPS[bn]:
            yield SwapAbConfig(bn, bm, split_for(m, n, k, bn, bm), stages, warps)


def n_major(scales: torch.Tensor) -> torch.Tensor:
    """``[N, G]`` view of a ``[G, N]`` copy of a resident weight's scales (stride 1 along N)."""
    return scales.reshape(-1, scales.shape[-1]).t().contiguous().t()


def run(x, w, cfg, layout, s_nm=None):
    import fp4_gemm_swapab as sw
    n, k = w.out_features, w.in_features
    out = (torch.zeros(x.shape[0], n, device=x.device, dtype=torch.float32) if cfg.split_k > 1
           else torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype))
    scales = w.scales if layout == "resident" else s_nm
    sw.launch(x, w.packed, scales, w.out_scale, wfmt=w.wfmt, group=w.group, fold_log2=w.fold_log2, n=n, k=k,
              out=out, cfg=cfg)
    return out.to(x.dtype)


def _compile_worker(jobs):
    importlib.import_module("musecore_cuda.backend")  # installs the CUDA hooks the timed process uses
    from musecore_cuda.bench import random_fp4
    from musecore_triton.layouts import prepare_fp4
    failed = []
    cache = {}
    for (n, k, cfg, layout) in jobs:
        if (n, k) not in cache:
            w = prepare_fp4(random_fp4("nvfp4", (n, k)), torch.device("cuda"))
            cache[(n, k)] = (w, n_major(w.scales))
        w, s_nm = cache[(n, k)]
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        try:
            run(x, w, cfg, layout, s_nm)
        except Exception as e:  # out of shared memory: the timed process skips it too
            failed.append(f"{cfg} {layout}: {type(e).__name__}")
    torch.cuda.synchronize()
    return failed


def precompile(ms, shapes, procs):
    jobs = {}
    for name in shapes:
        n, k = LINEAR_SHAPES[name]
        for m in ms:
            for cfg in cuts(m, n, k):
                for layout in SCALE_LAYOUTS:
                    key = (cfg.block_n, cfg.block_m, cfg.stages, cfg.num_warps, cfg.split_k > 1, layout)
                    jobs.setdefault(key, (n, k, cfg, layout))
    todo = list(jobs.values())
    ctx = mp.get_context("spawn")
    with ctx.Pool(procs) as pool:
        chunks = [todo[i::procs] for i in range(procs)]
        failed = sum(pool.map(_compile_worker, chunks), [])
    print(f"precompiled {len(todo)} kernels in {procs} processes; {len(failed)} failed", flush=True)


def sweep(ms, shapes, out_path, meta):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_gemv_sweep import checked_time, sweep_points
    from cuda_gemm_sweep import point_rows
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    rows = []
    for p in sweep_points(ms, shapes, "nvfp4"):
        name, n, k, m = p.case.name, p.case.n, p.case.k, p.m
        row, now, deq = point_rows(p, "nvfp4", ceiling, rows)
        if not hasattr(p.case, "s_nm"):
            p.case.s_nm = {id(w): n_major(w.scales) for w in p.case.ws + [p.case.w_check]}
        results = []
        for cfg in cuts(m, n, k):
            for layout in SCALE_LAYOUTS:
                fn = lambda x, w: run(x, w, cfg, layout, p.case.s_nm[id(w)])  # noqa: E731
                try:
                    t, err = checked_time(p, fn, f"swapab {cfg} {layout}")
                except triton_errors() as e:
                    print(f"    skip {cfg} {layout}: {type(e).__name__}", flush=True)
                    continue
                except SystemExit as e:  # wrong result: recorded, never timed
                    print(f"    FAILED {e}", flush=True)
                    rows.append({"shape": f"{name} {k}->{n}", "M": m, "impl": "swapab", "plan": cfg.__dict__,
                                 "scales": layout, "failed": str(e)})
                    continue
                results.append(row("swapab", t, plan=cfg.__dict__, scales=layout, nmse=err))
        for layout in SCALE_LAYOUTS:
            mine = [r for r in results if r["scales"] == layout]
            if mine:
                best = min(mine, key=lambda r: r["time_us"])
                best["best"] = True
                print(f"{name:12s} M={m:5d}: bf16 {p.t_bf16:8.2f} us | now {now['time_us']:8.2f} "
                      f"({now['speedup_vs_bf16']:.2f}x {now['impl']}) | dequant {deq['speedup_vs_bf16']:.2f}x | "
                      f"swapab[{layout}] best {best['time_us']:8.2f} ({best['speedup_vs_bf16']:.2f}x, "
                      f"{best['time_us'] and now['time_us'] / best['time_us']:.2f}x today) {best['plan']}", flush=True)
        Path(out_path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


def profile_cut(spec: str, m: int, shape: str) -> None:
    """Five launches of one cut (``block_n,block_m,split,stages,warps,layout``) for ``ncu`` to pick from."""
    from fp4_gemm_swapab import SwapAbConfig
    from musecore_cuda.bench import random_fp4
    from musecore_triton.layouts import prepare_fp4
    bn, bm, split, stages, warps, layout = spec.split(",")
    cfg = SwapAbConfig(int(bn), int(bm), int(split), int(stages), int(warps))
    n, k = LINEAR_SHAPES[shape]
    w = prepare_fp4(random_fp4("nvfp4", (n, k)), torch.device("cuda"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        run(x, w, cfg, layout, n_major(w.scales))
    torch.cuda.synchronize()


def triton_errors():
    import triton
    return (triton.runtime.errors.OutOfResources,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="16,32,64,128,256,1024,4096")
    parser.add_argument("--shapes", default="q_proj,k_proj,expert_up,expert_down")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results"
                                             / "cuda_swapab_sweep.json"))
    parser.add_argument("--precompile", type=int, default=0)
    parser.add_argument("--only-precompile", action="store_true")
    parser.add_argument("--profile-cut", default="", help="block_n,block_m,split,stages,warps,layout: five launches "
                        "of that cut at the first --ms and --shapes (for ncu), no sweep")
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    if args.profile_cut:
        importlib.import_module("musecore_cuda.backend")
        profile_cut(args.profile_cut, ms[0], args.shapes.split(",")[0])
        return
    shapes = args.shapes.split(",")
    started = time.time()
    if args.precompile:
        precompile(ms, shapes, args.precompile)
        print(f"precompile took {time.time() - started:.0f} s", flush=True)
        if args.only_precompile:
            return
    importlib.import_module("musecore_cuda.backend")
    meta = {"kernel": os.environ.get("SWAPAB_KERNEL", ""), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "host_load": os.getloadavg()[0], **memory_ceiling_gbps()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    sweep(ms, shapes, args.out, meta)
    print(f"sweep took {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
