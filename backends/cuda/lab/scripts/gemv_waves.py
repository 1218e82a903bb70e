"""Waves of every decode-GEMV launch the plans make for the 816B shapes, on the CPU host: the instantiation's registers
(SM90 SASS through ``backends/cuda/tests/nvrtc_sass.py``), its shared memory, the blocks an H200 SM holds, and the
grid in waves. ncu of the MoE's gate/up launch at batch 1 (run 71) read 159 registers, 3 blocks per SM, 512 blocks:
1.29 waves, a partial last wave that ncu estimates at up to half the time. This table is where such tails show::

    python3 backends/cuda/lab/scripts/gemv_waves.py [--ms 1,2,4,8,16] [--batches 1,2,4] [--alternatives] [--json F]

``--alternatives`` also lists, for each launch, the other cuts of the same kernel (tile, warps splitting K, cluster
split) with their waves: the candidates a wave-aware plan would pick from (timing them needs the H200:
``cuda_gemv_ab.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import nvrtc_sass  # noqa: E402
from musecore_cuda.bench import LINEAR_SHAPES  # noqa: E402
from musecore_cuda.kernels import fp4_gemv_cuda as g, moe_decode  # noqa: E402
from musecore_triton.kernels.fp4_gemm import WFMT_NVFP4  # noqa: E402

# H200 (SM90) per-SM limits: 64K registers allocated per warp in units of 256 (8 per thread), 64 warps, 32 blocks,
# 228 KB of shared memory of which a block may take 227 KB, 1 KB reserved per block by the driver.
SMS, REGS, WARPS, BLOCKS, SMEM, SMEM_RESERVED = 132, 65536, 64, 32, 228 * 1024, 1024
CUDA = torch.device("cuda")  # (the MMA plans read no device property)
_REGISTERS: dict[str, int] = {}


class Spills(Exception):
    """An instantiation that needs a stack (spilled registers): no plan should make it."""


def registers(name: str) -> int:
    if name not in _REGISTERS:
        c = nvrtc_sass.inspect(nvrtc_sass.compile_cubin(g.SOURCE, name))
        if c.stack:
            raise Spills(f"{name} spills ({c.stack}-byte stack)")
        _REGISTERS[name] = c.registers
    return _REGISTERS[name]


def blocks_per_sm(regs: int, smem: int, warps: int = g.MMA_WARPS) -> int:
    per_warp = -(-regs * 32 // 256) * 256
    return min(REGS // (per_warp * warps), WARPS // warps, BLOCKS, SMEM // (smem + SMEM_RESERVED))


def row(label: str, plan: g.GemvPlan, n: int, k: int, programs: int, experts: bool, swiglu: bool,
        runs: bool = False) -> dict:
    name = g.plan_kernel_name(plan, WFMT_NVFP4, experts, swiglu, runs=runs)
    regs, smem = registers(name), plan.smem(k, swiglu)
    grid = math.prod(plan.grid(n, programs))
    per_sm = blocks_per_sm(regs, smem)
    waves = grid / (per_sm * SMS)
    return {"case": label, "plan": f"tile {plan.tile} k_warps {plan.k_warps} split {plan.split_k} pf {plan.prefetch}"
                                   + (f" min_blocks {plan.min_blocks}" if plan.min_blocks else ""),
            "kernel": name, "registers": regs, "smem": smem, "blocks_per_sm": per_sm, "grid": grid,
            "waves": round(waves, 2), "last_wave_full": round(waves / -(-waves // 1), 2)}


def alternatives(plan: g.GemvPlan, k: int) -> list[g.GemvPlan]:
    """Other cuts of the same M: tile 1/2, warps splitting K 1/2/4, cluster split 1/2/4/8, that divide K's chunks, at
    the plan's chunks in flight (fewer where a warp's K range is shorter) and its ``min_blocks``."""
    chunks = k // g.CHUNK_K
    out = []
    for tile in (1, 2):
        for kw in (1, 2, 4):
            for split in (1, 2, 4, 8):
                if chunks % (kw * split) or chunks // (kw * split) < 1:
                    continue
                p = replace(plan, tile=tile, k_warps=kw, split_k=split,
                            prefetch=min(plan.prefetch, chunks // (kw * split)))
                if p != plan:
                    out.append(p)
    return out


def cases(ms: list[int], batches: list[int]):
    for name, (n, k) in LINEAR_SHAPES.items():
        for m in ms:
            yield f"{name} M={m}", g.make_plan(m, n, k, torch.bfloat16, CUDA), n, k, 1, False, False, False
    for b in batches:  # the 816B MoE decode's GEMVs as moe_decode plans them (per assignment, or runs), top-8
        programs = 8 * b  # (on runs only the programs that start a run chunk work: at most this many)
        runs = moe_decode.on_runs_by_default(b, programs, 256)
        up, down, on_runs = moe_decode._plans(4096, 4096, torch.bfloat16, CUDA, programs, runs)
        tag = " runs" if on_runs else ""
        yield f"moe b{b}{tag} gate/up", up, 4096, 4096, programs, True, True, on_runs
        yield f"moe b{b}{tag} down", down, 4096, 4096, programs, True, False, on_runs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="1,2,4,8,16")
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--alternatives", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if nvrtc_sass.missing():
        sys.exit(nvrtc_sass.missing())
    try:
        table(args)
    except Spills as e:
        sys.exit(str(e))


def table(args: argparse.Namespace) -> None:
    rows = []
    for label, plan, n, k, programs, experts, swiglu, runs in cases([int(v) for v in args.ms.split(",")],
                                                                   [int(v) for v in args.batches.split(",")]):
        r = row(label, plan, n, k, programs, experts, swiglu, runs)
        rows.append(r)
        print(f"{label:22s} {r['plan']:34s} regs {r['registers']:3d} smem {r['smem']:6d} "
              f"{r['blocks_per_sm']:2d}/SM grid {r['grid']:5d} waves {r['waves']:5.2f}", flush=True)
        if args.alternatives and plan.kind == "mma":
            for alt in alternatives(plan, k):
                if alt.smem(k, swiglu) >= g.SMEM_LIMIT:
                    continue
                try:
                    a = row(label, alt, n, k, programs, experts, swiglu, runs)
                except Spills as e:  # (a plan's own launch spilling stops the table: that one would be a bug)
                    print(f"{'':22s}   {str(e)}", flush=True)
                    continue
                a["alternative"] = True
                rows.append(a)
                print(f"{'':22s}   {a['plan']:32s} regs {a['registers']:3d} smem {a['smem']:6d} "
                      f"{a['blocks_per_sm']:2d}/SM grid {a['grid']:5d} waves {a['waves']:5.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
