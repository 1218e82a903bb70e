"""Sweep the Gluon W4A16 GEMM (``musecore_cuda.kernels.fp4_gemm_gluon``: swap-AB, register-A ``wgmma``, TMA ring, a
loader warp) at the 816B linear shapes, next to BF16 cuBLAS, the path ``fp4_linear`` takes (with
``MUSECORE_CUDA_GLUON=0`` in the environment: the path before the Gluon GEMM) and dequantize + cuBLAS, all measured
in one process. Every cut is first checked against an fp32 product of the dequantized weight (NMSE within the
linear op's tolerance), then timed like ``musecore bench`` (CUDA-graph replays, weights rotated past L2).

Every gluon row carries ``config`` (its cut as ``block_n,block_m,split_k,stages,upcast``); the fastest of a point is
marked ``best``; ``impl == "gluon routed"`` is the launch ``fp4_gluon_plan.pick_config`` chooses for the point on
this GPU (also among the cuts when it is one of them), timed on its own, so a run both refines the heuristic and
checks it (``best_config`` / ``routed_vs_best`` on the routed row)::

    python backends/cuda/lab/scripts/cuda_gluon_sweep.py [--ms 16,64,128,256,1024,4096] [--shapes q_proj,...]
        [--out backends/cuda/lab/results/cuda_gluon_sweep.json] [--precompile 12] [--routed-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

from musecore_cuda.bench import memory_ceiling_gbps

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the GEMV / GEMM sweeps' helpers

SMEM = 220 * 1024
# GLUON_UPCAST: which upcasts of fp4_gemm_gluon the cuts use: packed (the routed one, the default), int16, asm, a
# comma list of those, both (int16,asm) or all (int16,asm,packed)
_UPCAST_SETS = {"both": ("int16", "asm"), "all": ("int16", "asm", "packed")}
UPCASTS = _UPCAST_SETS.get(os.environ.get("GLUON_UPCAST", "packed"),
                           tuple(os.environ.get("GLUON_UPCAST", "packed").split(",")))
CTAS = int(os.environ.get("GLUON_CTAS", "1"))  # 2: also the two-CTAs-per-SM cuts (GluonConfig.ctas_per_sm)
FIXUP = os.environ.get("GLUON_FIXUP", "0") == "1"  # 1: every split-K cut also with the workspace fixup
FINISH = os.environ.get("GLUON_FINISH", "0") == "1"  # 1: every split-K cut also with finish (no cast kernel)
PAIR = os.environ.get("GLUON_PAIR", "0") == "1"  # 1: every packed cut with even stages also with paired stages
LATE = os.environ.get("GLUON_LATE", "0") == "1"  # 1: every cut that can also with late release (and paired + late)
AHEAD = os.environ.get("GLUON_AHEAD", "0") == "1"  # 1: also with the scale words loaded two chunks ahead
# 1: a routed finish cut again with its workspace kept zeroed (rezero) or, where it is so routed, memset per launch
REZERO = os.environ.get("GLUON_REZERO", "0") == "1"
WIDE = os.environ.get("GLUON_WIDE", "0") == "1"  # 1: the routed cut again with two consumer warpgroups (wide())
# 1: a routed split-K finish cut again with one more memset of its workspace's size per call (run_memset): what a
# memset node costs in a graph's chain, i.e. what a workspace that needs no zeroing per launch could save at most
MEMSET = os.environ.get("GLUON_MEMSET", "0") == "1"
PERSISTENT = os.environ.get("GLUON_PERSISTENT", "0") == "1"  # 1: packed split-1 cuts also on a persistent grid
BLOCK_NS = tuple(int(b) for b in os.environ.get("GLUON_BLOCK_NS", "64,128").split(","))  # weight rows per program


def block_ms(m: int) -> tuple[int, ...]:
    if m <= 16:
        return (16,)
    if m <= 32:
        return (32,)
    if m <= 64:
        return (32, 64)
    if m <= 128:
        return (64, 128)
    if m <= 256:
        return (128, 256)
    return (128, 256)


def fill_split(m: int, n: int, k: int, bn: int, bm: int, sms: int = 132) -> int:
    """Split-K (power of two, >= 4 chunks per split) until the grid has at least one program per SM."""
    tiles = -(-m // bm) * -(-n // bn)
    chunks, split = k // 128, 1
    while tiles * split < sms and chunks // (split * 2) >= 4:
        split *= 2
    return split


def variants(cfg, k: int):
    """``cfg`` with the scale words two chunks ahead (``GLUON_AHEAD=1``), paired stages (``GLUON_PAIR=1``), late
    release (``GLUON_LATE=1``) and the last two (with and without the first), where they can run
    at this K (packed, one tile per program; pairs: even stages, 4+, and even chunks per split; late: 3+ stages, 6+
    paired)."""
    if cfg.upcast != "packed" or cfg.persistent or cfg.pair or cfg.late or cfg.ahead != 1:
        return
    if AHEAD:
        yield dataclasses.replace(cfg, ahead=2)
    pairs = cfg.stages % 2 == 0 and cfg.stages >= 4 and (k // 128 // cfg.split_k) % 2 == 0  # 2+ pairs
    if PAIR and pairs:
        yield dataclasses.replace(cfg, pair=True)
    if LATE and cfg.stages >= 3:
        yield dataclasses.replace(cfg, late=True)
    per_stage, room = cfg.smem_bytes() // cfg.stages, SMEM // cfg.ctas_per_sm  # two CTAs per SM: half the SM each
    deep = max((st for st in (6, 8) if st * per_stage <= room), default=0)
    if PAIR and LATE and pairs and max(deep, cfg.stages) >= 6:  # 3+ pairs keep loads ahead of a late release
        yield dataclasses.replace(cfg, stages=max(deep, cfg.stages), pair=True, late=True)
        if AHEAD:
            yield dataclasses.replace(cfg, stages=max(deep, cfg.stages), pair=True, late=True, ahead=2)


def wide(cfg, k: int):
    """``cfg`` (block_n 64) with two consumer warpgroups (block_n 128) at its split and at twice it (the same CTA
    count on half the weight tiles; finish sums the splits), as many ring stages as fit (at most 8), paired with
    late release and the scale words two chunks ahead where the ring and the chunks allow, else late release alone
    (4+ stages; at 3, run 87's late lost): whether a second warpgroup's upcasts fill the issue slots one leaves idle
    at small M (session 61). Where the routed cut is such a launch already, the one-warpgroup launch it replaced."""
    from musecore_cuda.kernels.fp4_gluon_plan import GluonConfig, one_warpgroup, ring_stages
    if cfg.block_n == 128 and cfg.split_k > 1 and cfg.block_m <= 64:  # routed wide: the one-warpgroup launch instead
        yield one_warpgroup(cfg.block_m, cfg.split_k // 2, k // 128)
        return
    if cfg.block_n != 64 or cfg.upcast != "packed" or cfg.persistent or cfg.ctas_per_sm != 1:
        return
    stages = ring_stages(cfg.block_m, 128, most=8)
    for split in (cfg.split_k, 2 * cfg.split_k):
        chunks = k // 128
        if chunks % split or chunks // split < 2 or stages < 3:
            continue
        pair = stages >= 6 and (chunks // split) % 2 == 0
        even = stages - stages % 2 if pair else stages
        yield GluonConfig(128, cfg.block_m, split, even, upcast="packed", finish=split > 1, rezero=True, pair=pair,
                          late=stages >= 4, ahead=2 if pair else 1)  # rezero as routed (off without a split)


def twins(chosen, k: int) -> list[tuple[str, object]]:
    """``(impl, cfg)`` of the routed cut's twins the environment asks for, timed beside it (``vs routed``) and
    precompiled with it: finish (``GLUON_FINISH``), the consumer variants (``GLUON_PAIR`` / ``LATE`` / ``AHEAD``),
    two warpgroups (``GLUON_WIDE``), the same launch with one more memset (``GLUON_MEMSET``) and with rezero flipped
    (``GLUON_REZERO``)."""
    out = ([("gluon routed finish", dataclasses.replace(chosen, finish=True))]
           if FINISH and chosen.split_k > 1 and not chosen.finish else [])
    out += [("gluon routed " + v.label().split(",", 6)[-1], v) for v in variants(chosen, k)]
    out += [("gluon routed wide", v) for v in (wide(chosen, k) if WIDE else ())]
    out += [("gluon routed +memset", chosen)] if MEMSET and chosen.finish else []
    out += ([("gluon routed " + ("memset" if chosen.rezero else "rezero"),
              dataclasses.replace(chosen, rezero=not chosen.rezero))] if REZERO and chosen.finish else [])
    out += [("gluon cut", cfg) for cfg in EXTRA_CUTS if fits(cfg, k) and cfg != chosen]
    return out


# --cuts: literal cuts (GluonConfig labels) timed beside the routed one at every point where K's chunks divide by
# their split leaving 2+ per split (session 63: the two-warpgroup cuts the model does not rank)
EXTRA_CUTS: list = []


def fits(cfg, k: int) -> bool:
    chunks = k // 128
    return chunks % cfg.split_k == 0 and chunks // cfg.split_k >= 2 and (
        not cfg.pair or (chunks // cfg.split_k) % 2 == 0)


def routed(m: int, n: int, k: int):
    """The launch ``fp4_linear``'s gluon path picks for this point on this GPU."""
    from musecore_cuda.kernels.fp4_gluon_plan import pick_config, sm_count
    return pick_config(m, n, k, sm_count(torch.cuda.current_device()))


def cuts(m: int, n: int, k: int):
    """The sweep's cuts (:func:`_cuts`), and with ``GLUON_FIXUP=1`` / ``GLUON_FINISH=1`` each split-K one again with
    the fixup / finish (finish with rezero, as routed), with ``GLUON_PERSISTENT=1`` each packed split-1 one again on
    a persistent grid."""
    for cfg in _cuts(m, n, k):
        yield cfg
        if FIXUP and cfg.split_k > 1:  # (at split 1 fixup=True is the same launch)
            yield dataclasses.replace(cfg, fixup=True)
        if FINISH and cfg.split_k > 1:  # as routed since session 62: its workspace kept zeroed (rezero)
            yield dataclasses.replace(cfg, finish=True, rezero=True)
        for variant in variants(cfg, k):
            yield variant
        if PERSISTENT and cfg.split_k == 1 and cfg.upcast == "packed" and cfg.ctas_per_sm == 1:
            yield dataclasses.replace(cfg, persistent=True)


def _cuts(m: int, n: int, k: int):
    from musecore_cuda.kernels.fp4_gluon_plan import GluonConfig
    seen = set()
    for bn in BLOCK_NS:
        for bm in block_ms(m):
            # (128, 256): 2 warpgroups x 128 accumulator registers fit the consumer's 240 (ptxas, Triton 3.6, session
            # 59: 0 spills, no local loads, 3 stages in 216 KB); it halves the activation tiles' L2 reads of 64
            stage = bn * 64 + bm * 256
            split = fill_split(m, n, k, bn, bm)
            for stages in sorted({min(8, SMEM // stage), min(4, SMEM // stage)} - {0, 1}):
                # split 1 always: runs 1-2 filled the SMs by split-K only, and with acq_rel atomics every split lost
                for sk in sorted({1, split} | ({split * 2} if m <= 64 else set())):
                    if (k // 128) % sk or (k // 128) // sk < 2:
                        continue
                    for upcast in UPCASTS:
                        cfg = GluonConfig(bn, bm, sk, stages, upcast=upcast)
                        if cfg not in seen:
                            seen.add(cfg)
                            yield cfg
    if CTAS == 2:  # two CTAs per SM (128 registers per thread at launch): block_n 64, half the ring each
        for bm in block_ms(m):
            stage = 64 * 64 + bm * 256
            stages = min(4, SMEM // 2 // stage)
            if stages < 2:
                continue
            split = fill_split(m, n, k, 64, bm, sms=2 * 132)
            for sk in sorted({1, max(1, split // 2), split}):
                if (k // 128) % sk or (k // 128) // sk < 2:
                    continue
                cfg = GluonConfig(64, bm, sk, stages, upcast="packed", ctas_per_sm=2)
                if cfg not in seen:
                    seen.add(cfg)
                    yield cfg


def run(x, w, cfg):
    """One launch of ``cfg`` through the backend's own wrapper (the routed path's buffers and checks)."""
    from musecore_cuda.backend import fp4_gluon_linear
    return fp4_gluon_linear(x, w, cfg)


def run_memset(x, w, cfg):
    """:func:`run`, then one more zeroed fp32 buffer of the finish workspace's size (sums and per-tile counts)."""
    out = run(x, w, cfg)
    torch.zeros(cfg.finish_numel(x.shape[0], w.out_features), dtype=torch.float32, device=x.device)
    return out


def _compile_worker(jobs):
    importlib.import_module("musecore_cuda.backend")
    from musecore_cuda.bench import random_fp4
    from musecore_triton.layouts import prepare_fp4
    failed, cache = [], {}
    for (n, k, cfg) in jobs:
        if (n, k) not in cache:
            cache[(n, k)] = prepare_fp4(random_fp4("nvfp4", (n, k)), torch.device("cuda"))
        try:
            for m in (16, 17):  # Triton specializes M on divisibility by 16: both variants
                run(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), cache[(n, k)], cfg)
        except Exception as e:  # out of resources: the timed process skips it too
            failed.append(f"{cfg}: {type(e).__name__}: {str(e)[:200]}")
    torch.cuda.synchronize()
    return failed


def precompile(ms, shapes, procs):
    from cuda_gemv_sweep import shape_nk
    jobs = {}
    for name in shapes:
        n, k = shape_nk(name)
        for m in ms:
            chosen = routed(m, n, k)
            for cfg in [chosen] + [cfg for _, cfg in twins(chosen, k)] + list(cuts(m, n, k)):
                jobs.setdefault((cfg.block_n, cfg.block_m, cfg.stages, cfg.split_k > 1, cfg.upcast, cfg.ctas_per_sm,
                                 cfg.fixup, cfg.finish, cfg.pair, cfg.late, cfg.ahead, cfg.rezero), (n, k, cfg))
    todo = list(jobs.values())
    with mp.get_context("spawn").Pool(procs) as pool:
        failed = sum(pool.map(_compile_worker, [todo[i::procs] for i in range(procs)]), [])
    print(f"precompiled {len(todo)} kernels in {procs} processes; {len(failed)} failed", flush=True)
    for f in failed[:10]:
        print("   ", f, flush=True)


def sweep(ms, shapes, out_path, meta, routed_only=False):
    from cuda_gemv_sweep import checked_time, sweep_points
    from cuda_gemm_sweep import point_rows
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    rows = []
    for p in sweep_points(ms, shapes, "nvfp4"):
        name, n, k, m = p.case.name, p.case.n, p.case.k, p.m
        row, now, deq = point_rows(p, "nvfp4", ceiling, rows)
        results, chosen = [], routed(m, n, k)
        for impl, cfg in [("gluon routed", chosen)] + twins(chosen, k) + ([] if routed_only else
                                                               [("gluon", c) for c in cuts(m, n, k)]):
            try:
                launch = run_memset if impl.endswith("+memset") else run
                t, err = checked_time(p, lambda x, w: launch(x, w, cfg), f"{impl} {cfg.label()}")
            except SystemExit as e:  # wrong result: recorded, never timed
                print(f"    FAILED {e}", flush=True)
                rows.append({"shape": f"{name} {k}->{n}", "M": m, "impl": impl, "config": cfg.label(),
                             "plan": cfg.__dict__, "failed": str(e)})
                continue
            except Exception as e:  # out of resources
                print(f"    skip {cfg.label()}: {type(e).__name__}", flush=True)
                continue
            results.append(row(impl, t, config=cfg.label(), plan=cfg.__dict__, nmse=err))
        if results:
            best = min(results, key=lambda r: r["time_us"])
            best["best"] = True
            mine = next((r for r in results if r["impl"] == "gluon routed"), None)
            if mine is not None:
                mine["best_config"] = best["config"]
                mine["routed_vs_best"] = round(best["time_us"] / mine["time_us"], 3)
            print(f"{name:12s} M={m:5d}: bf16 {p.t_bf16:8.2f} us | now {now['time_us']:8.2f} "
                  f"({now['speedup_vs_bf16']:.2f}x {now['impl']}) | dequant {deq['speedup_vs_bf16']:.2f}x | "
                  f"gluon best {best['time_us']:8.2f} ({best['speedup_vs_bf16']:.2f}x, "
                  f"{now['time_us'] / best['time_us']:.2f}x today) {best['config']} | routed {chosen.label()} "
                  f"{mine['time_us'] if mine else float('nan'):8.2f}", flush=True)
            for r in results:  # the routed cut's variants (GLUON_FINISH / PAIR / LATE / AHEAD): speedup over it
                if mine is not None and (r["impl"].startswith("gluon routed ") or r["impl"] == "gluon cut"):
                    r["vs_routed"] = round(mine["time_us"] / r["time_us"], 3)
                    print(f"vs routed: {name} M={m} {r['config']} {r['time_us']:.2f} us = {r['vs_routed']:.3f}x",
                          flush=True)
        Path(out_path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


def profile_cut(spec: str, m: int, shape: str) -> None:
    """Five launches of one cut (``block_n,block_m,split_k,stages[,upcast]``) for ``ncu`` to pick from."""
    from musecore_cuda.bench import random_fp4
    from musecore_cuda.kernels.fp4_gluon_plan import GluonConfig
    from musecore_triton.layouts import prepare_fp4
    from cuda_gemv_sweep import shape_nk
    cfg = GluonConfig.parse(spec if spec.count(",") >= 4 else spec + ",packed")  # the upcast defaults to packed
    n, k = shape_nk(shape)
    w = prepare_fp4(random_fp4("nvfp4", (n, k)), torch.device("cuda"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        run(x, w, cfg)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", default="16,64,128,256,1024,4096")
    parser.add_argument("--shapes", default="q_proj,k_proj,expert_up,expert_down")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "cuda_gluon_sweep.json"))
    parser.add_argument("--precompile", type=int, default=0)
    parser.add_argument("--only-precompile", action="store_true")
    parser.add_argument("--routed-only", action="store_true", help="time only the routed config per point")
    parser.add_argument("--cuts", default="", help="cut labels separated by ';' (block_n,block_m,split_k,stages,"
                        "upcast[,ctas,flags...]): each also timed beside the routed cut at every point it fits")
    parser.add_argument("--profile-cut", default="", help="block_n,block_m,split_k,stages[,upcast]: five launches of "
                        "that cut at the first --ms and --shapes (for ncu), no sweep")
    args = parser.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    if args.profile_cut:
        importlib.import_module("musecore_cuda.backend")
        profile_cut(args.profile_cut, ms[0], args.shapes.split(",")[0])
        return
    shapes = args.shapes.split(",")
    from musecore_cuda.kernels.fp4_gluon_plan import GluonConfig
    EXTRA_CUTS.extend(GluonConfig.parse(c.strip()) for c in args.cuts.split(";") if c.strip())
    started = time.time()
    if args.precompile:
        precompile(ms, shapes, args.precompile)
        print(f"precompile took {time.time() - started:.0f} s", flush=True)
        if args.only_precompile:
            return
    importlib.import_module("musecore_cuda.backend")
    meta = {"kernel": "fp4_gemm_gluon", "gluon_env": os.environ.get("MUSECORE_CUDA_GLUON"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host_load": os.getloadavg()[0], **memory_ceiling_gbps()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    sweep(ms, shapes, args.out, meta, args.routed_only)
    print(f"sweep took {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
