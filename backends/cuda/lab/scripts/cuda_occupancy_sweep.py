"""Occupancy of the CUDA C++ decode GEMV (``GemvPlan.min_blocks``: ``__launch_bounds__(128, min_blocks)``, which
caps registers so that many blocks fit on an SM) on the decode MoE of the 816B layer and on the 816B linears at
M = 1, 8, 16; and the dequantize kernel's bandwidth (the large-M path's first half). Every variant's output is
checked bit for bit against the default plan's first (a register cap changes no arithmetic)::

    python backends/cuda/lab/scripts/cuda_occupancy_sweep.py [--out cuda_occupancy_sweep.json]
        [--batches 1,2,4,8,16] [--ms 1,8,16] [--blocks 1,2,3,4,5,6]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from musecore.benchmarking import cycle
from musecore_cuda import CudaBackend
from musecore_cuda.bench import LINEAR_SHAPES, _rotating, gpu_name, memory_ceiling_gbps, random_fp4, time_us
from musecore_cuda.kernels import fp4_gemv_cuda
from musecore_cuda.kernels.moe_decode import moe_decode_gemv

E, TOPK, WIDTH, INTER, HIDDEN = 256, 8, 4096, 4096, 8192  # the 816B preset's MoE layer


def sweep_moe(be: CudaBackend, batches: list[int], blocks: list[int], ceiling: float) -> list[dict]:
    stack = be.prepare_experts(random_fp4("nvfp4", (E, INTER, WIDTH)), random_fp4("nvfp4", (E, INTER, WIDTH)),
                               random_fp4("nvfp4", (E, WIDTH, INTER)))
    per_expert = sum(s.nbytes for s in (stack.gate, stack.up, stack.down)) // E
    norm = torch.ones(WIDTH, device="cuda", dtype=torch.bfloat16)
    router = torch.randn(E, HIDDEN, device="cuda") * HIDDEN ** -0.5
    bias = torch.randn(E, device="cuda") * 0.01
    rows = []
    for t in batches:
        weights, ids = be.router_topk(torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16), router, bias,
                                      TOPK, (HIDDEN / 256) ** -0.5, 1.0)
        z = torch.randn(t, WIDTH, device="cuda", dtype=torch.bfloat16)
        nbytes = int(ids.unique().numel()) * per_expert + t * WIDTH * 6
        n_assign = t * TOPK
        up0 = fp4_gemv_cuda.make_plan(1, INTER, WIDTH, z.dtype, z.device, programs=n_assign, swiglu=True)
        down0 = fp4_gemv_cuda.make_plan(1, WIDTH, INTER, z.dtype, z.device, programs=n_assign)

        def run(plans):
            return lambda: moe_decode_gemv(z, weights, ids, stack.gate, stack.up, stack.down, norm, 1e-8, plans)
        want = run((up0, down0))()
        for bu, bd in itertools.product(blocks, blocks):
            plans = (dataclasses.replace(up0, min_blocks=bu), dataclasses.replace(down0, min_blocks=bd))
            got = run(plans)()
            if not torch.equal(got, want):
                raise AssertionError(f"MoE batch {t} min_blocks up {bu} down {bd}: output differs from the default")
            us = time_us(run(plans), reps=20)
            rows.append({"case": "moe", "M": t, "up": str(plans[0]), "down": str(plans[1]), "up_min_blocks": bu,
                         "down_min_blocks": bd, "time_us": round(us, 2),
                         "pct_memory_ceiling": round(100 * nbytes / us / 1e3 / ceiling, 1)})
        best = min((r for r in rows if r["M"] == t), key=lambda r: r["time_us"])
        base = next(r for r in rows if r["M"] == t and r["up_min_blocks"] == 1 and r["down_min_blocks"] == 1)
        print(f"moe batch {t}: default {base['time_us']} us ({base['pct_memory_ceiling']}%), best up "
              f"{best['up_min_blocks']} down {best['down_min_blocks']} {best['time_us']} us "
              f"({best['pct_memory_ceiling']}%)", flush=True)
    del stack
    torch.cuda.empty_cache()
    return rows


def sweep_linear(be: CudaBackend, ms: list[int], blocks: list[int], ceiling: float) -> list[dict]:
    rows = []
    for name, (n, k) in LINEAR_SHAPES.items():
        ws = _rotating(lambda: be.prepare_weight(random_fp4("nvfp4", (n, k)), name).data, n * k // 2)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            plan0 = fp4_gemv_cuda.make_plan(m, n, k, x.dtype, x.device)

            def run(w, plan):
                out = torch.empty(m, n, dtype=x.dtype, device=x.device)
                return fp4_gemv_cuda.launch(x, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                            n=n, k=k, out=out, plan=plan)
            want = run(ws[0], plan0)
            for b in blocks:
                plan = dataclasses.replace(plan0, min_blocks=b)
                if not torch.equal(run(ws[0], plan), want):
                    raise AssertionError(f"{name} M={m} min_blocks {b}: output differs from the default plan's")
                us = time_us(cycle(ws, lambda w: run(w, plan))) / len(ws)
                rows.append({"case": "linear", "shape": f"{name} {k}->{n}", "M": m, "plan": str(plan),
                             "min_blocks": b, "time_us": round(us, 2),
                             "pct_memory_ceiling": round(100 * (ws[0].nbytes + 2 * m * (n + k)) / us / 1e3 / ceiling,
                                                         1)})
            got = [r for r in rows if r["shape"].startswith(name + " ") and r["M"] == m]
            best = min(got, key=lambda r: r["time_us"])
            print(f"{name} M={m}: default {got[0]['time_us']} us, best min_blocks {best['min_blocks']} "
                  f"{best['time_us']} us", flush=True)
        del ws
        torch.cuda.empty_cache()
    return rows


def sweep_dequant(be: CudaBackend, ceiling: float) -> list[dict]:
    rows = []
    for name, (n, k) in LINEAR_SHAPES.items():
        ws = _rotating(lambda: be.prepare_weight(random_fp4("nvfp4", (n, k)), name).data, n * k // 2)
        out = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")

        def run(w):
            return fp4_gemv_cuda.dequantize(w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt,
                                            fold_log2=w.fold_log2, n=n, k=k, out=out)
        us = time_us(cycle(ws, run)) / len(ws)
        nbytes = ws[0].nbytes + 2 * n * k
        rows.append({"case": "dequant", "shape": f"{name} {k}->{n}", "time_us": round(us, 2), "bytes": nbytes,
                     "pct_memory_ceiling": round(100 * nbytes / us / 1e3 / ceiling, 1)})
        print(f"dequant {name}: {us:.1f} us, {rows[-1]['pct_memory_ceiling']}% of the ceiling", flush=True)
        del ws, out
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="cuda_occupancy_sweep.json")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--ms", default="1,8,16")
    p.add_argument("--blocks", default="1,2,3,4,5,6")
    p.add_argument("--parts", default="dequant,moe,linear")
    args = p.parse_args()
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    be = CudaBackend("cuda")
    ceil = memory_ceiling_gbps()
    rows = []
    parts = args.parts.split(",")
    if "dequant" in parts:
        rows += sweep_dequant(be, ceil["ceiling_gbps"])
    if "moe" in parts:
        rows += sweep_moe(be, ints(args.batches), ints(args.blocks), ceil["ceiling_gbps"])
    if "linear" in parts:
        rows += sweep_linear(be, ints(args.ms), ints(args.blocks), ceil["ceiling_gbps"])
    with open(args.out, "w") as f:
        json.dump({"meta": {"gpu": gpu_name(), "torch": torch.__version__, **ceil}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
