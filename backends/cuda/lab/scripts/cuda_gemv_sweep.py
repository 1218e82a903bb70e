"""Sweep the CUDA tensor-core decode kernel's cuts (split-K, warps per K range, chunks in flight,
tiles per warp) against the plan ``make_plan`` picks, at the 816B linear shapes and as experts.

Every configuration is first checked against the reference linear (NMSE within the op tolerance),
then timed like ``musecore bench`` (CUDA-graph replays, weights rotated past L2), next to BF16
cuBLAS and the memory ceiling measured in the same process. Prints a table and saves JSON::

    python backends/cuda/lab/scripts/cuda_gemv_sweep.py [--ms 1,4,8] [--out backends/cuda/lab/results/cuda_gemv_sweep.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

import musecore_quant
from musecore.ops import tolerance
from musecore.testing import nmse
from musecore.benchmarking import cycle
from musecore_cuda.bench import LINEAR_SHAPES, _rotating, memory_ceiling_gbps, random_fp4, time_us
from musecore_cuda.kernels import fp4_gemv_cuda
from musecore_triton.layouts import prepare_fp4

CUTS = [(split, kw, pf) for split in (1, 2, 4, 8) for kw in (1, 2, 4) for pf in (1, 2, 3, 4)]
if os.environ.get("SWEEP_CUTS") == "0":  # only the plan make_plan chooses
    CUTS = []


def run(x, w, n, k, plan):
    out = torch.empty(x.shape[0], n, device="cuda", dtype=x.dtype)
    return fp4_gemv_cuda.launch(x, w.packed, w.scales, w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2, n=n, k=k,
                                out=out, plan=plan)


@dataclasses.dataclass
class ShapeCase:
    """One 816B linear shape for a sweep: a quantized weight to check against (``w_check``, ``dense``),
    random ones rotated past L2 to time (``ws``) and their BF16 counterparts (``bf16``)."""

    name: str
    n: int
    k: int
    w_check: object
    dense: torch.Tensor
    ws: list
    bf16: list

    @property
    def nbytes(self) -> int:
        return self.ws[0].nbytes


@dataclasses.dataclass
class Point:
    """One shape at one M: activations ``x``, their fp32 reference product and the BF16 cuBLAS time."""

    case: ShapeCase
    m: int
    x: torch.Tensor
    ref: torch.Tensor
    t_bf16: float


def shape_nk(name: str) -> tuple[int, int]:
    """``(N, K)`` of an 816B shape's name (``LINEAR_SHAPES``) or of a literal ``NxK`` (e.g. muse-small's
    ``1536x1536``)."""
    if name in LINEAR_SHAPES:
        return LINEAR_SHAPES[name]
    n, sep, k = name.partition("x")
    if not (sep and n.isdigit() and k.isdigit()):
        raise SystemExit(f"unknown shape {name!r}: one of {sorted(LINEAR_SHAPES)} or NxK (out x in features)")
    return int(n), int(k)


def sweep_points(ms: list[int], shapes: list[str], fmt: str) -> Iterator[Point]:
    for name in shapes:
        n, k = shape_nk(name)
        qt = musecore_quant.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
        case = ShapeCase(name, n, k, prepare_fp4(qt, torch.device("cuda")), musecore_quant.dequantize(qt).float().cuda(),
                         _rotating(lambda: prepare_fp4(random_fp4(fmt, (n, k)), torch.device("cuda")), n * k // 2),
                         _rotating(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16), n * k * 2))
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t_bf16 = time_us(cycle(case.bf16, lambda w: F.linear(x, w))) / len(case.bf16)
            yield Point(case, m, x, x.float() @ case.dense.T, t_bf16)
        del case
        torch.cuda.empty_cache()


def checked_time(p: Point, fn: Callable[[torch.Tensor, object], torch.Tensor], what: str) -> tuple[float, float]:
    """``fn(x, weight)`` checked on the known weight (NMSE within the linear op's tolerance, else the sweep
    stops), then timed over the rotated ones: ``(microseconds, nmse)``."""
    err = nmse(p.ref, fn(p.x, p.case.w_check))
    if err > tolerance("linear"):
        raise SystemExit(f"{p.case.name} M={p.m} {what}: NMSE {err:.3g} > {tolerance('linear')}")
    return time_us(cycle(p.case.ws, lambda w: fn(p.x, w))) / len(p.case.ws), err


def sweep(ms: list[int], shapes: list[str], fmt: str) -> list[dict]:
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    rows = []
    for p in sweep_points(ms, shapes, fmt):
        name, n, k, m, x, t_bf16, nbytes = p.case.name, p.case.n, p.case.k, p.m, p.x, p.t_bf16, p.case.nbytes
        chosen = fp4_gemv_cuda.make_plan(m, n, k, x.dtype, x.device)
        plans = {chosen}
        chunks = k // fp4_gemv_cuda.CHUNK_K
        for split, kw, pf in CUTS:
            if chunks % (split * kw) == 0 and chunks // (split * kw) >= 2:
                plan = dataclasses.replace(chosen, split_k=split, k_warps=kw, prefetch=pf)
                if plan.smem(k) < fp4_gemv_cuda.SMEM_LIMIT:
                    plans.add(plan)
        results = []
        for plan in sorted(plans, key=lambda p: (p.split_k, p.k_warps, p.prefetch, p.tile)):
            t, err = checked_time(p, lambda x, w: run(x, w, n, k, plan), str(plan))
            results.append((t, plan, err))
        best = min(results, key=lambda r: r[0])
        t_chosen = next(r[0] for r in results if r[1] == chosen)
        for t, plan, err in results:
            rows.append({"shape": f"{name} {k}->{n}", "format": fmt, "M": m, "split_k": plan.split_k,
                         "k_warps": plan.k_warps, "prefetch": plan.prefetch, "tile": plan.tile,
                         "chosen": plan == chosen, "best": plan == best[1], "time_us": round(t, 2),
                         "speedup_vs_bf16": round(t_bf16 / t, 3),
                         "pct_memory_ceiling": round(100 * nbytes / t / 1e3 / ceiling, 1), "nmse": err})
        print(f"{name:12s} M={m}: bf16 {t_bf16:7.2f} us | chosen {t_chosen:7.2f} us "
              f"({t_bf16 / t_chosen:.2f}x, {100 * nbytes / t_chosen / 1e3 / ceiling:.0f}%) "
              f"split {chosen.split_k} kw {chosen.k_warps} pf {chosen.prefetch} | best {best[0]:7.2f} us "
              f"({t_bf16 / best[0]:.2f}x, {100 * nbytes / best[0] / 1e3 / ceiling:.0f}%) "
              f"split {best[1].split_k} kw {best[1].k_warps} pf {best[1].prefetch}", flush=True)
    return rows


def sweep_main(description: str, default_ms: str, out_name: str,
               run: Callable[[list[int], list[str], str], list[dict]]) -> None:
    """The command line both sweeps share: ``--ms --shapes --format --out``, then the JSON with its meta."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ms", default=default_ms)
    parser.add_argument("--shapes", default=",".join(LINEAR_SHAPES))
    parser.add_argument("--format", default="nvfp4", choices=("nvfp4", "mxfp4"))
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / out_name))
    args = parser.parse_args()
    started = time.time()
    rows = run([int(m) for m in args.ms.split(",")], args.shapes.split(","), args.format)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "seconds": round(time.time() - started), **memory_ceiling_gbps()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    sweep_main(__doc__.splitlines()[0], "1,4,8", "cuda_gemv_sweep.json", sweep)
