"""Compile the Gluon W4A16 GEMM (``musecore_cuda.kernels.fp4_gemm_gluon``) for SM90 without a GPU and report what
reached the PTX: register-A ``wgmma`` (A as a register list), TMA copies, mbarriers, the warp-specialized partitions,
registers, spills and shared memory (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``; Triton 3.6)::

    PYTHONPATH=.triton36 python backends/cuda/lab/scripts/gluon_ir.py [--cuts 64,64,1,6;128,128,1,4] [--out DIR]
    PYTHONPATH=.triton36 python backends/cuda/lab/scripts/gluon_ir.py --routed [--ms 17,32,64,128,256]

A cut is ``block_n,block_m,split_k,stages[,upcast]`` with upcast int16 (default), asm (or 1: session 11's
``asm_upcast``) or packed. ``--routed`` compiles every config ``fp4_gluon_plan.pick_config`` returns for the 816B
shapes at those M on 132 SMs instead. Per cut it also prints the consumer loop's SASS (one 128-element chunk per
warp): instruction count, opcode histogram, and how many lie between the last HGMMA and the wait.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # backends/cuda: musecore_cuda without installing it
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # gluon_sm90: the compile helpers
from gluon_sm90 import compile_cut, compile_grouped, consumer_loop_sass, ptxas_info  # noqa: E402
from musecore_cuda.kernels import fp4_gemm_gluon as gk  # noqa: E402
from musecore_cuda.kernels.fp4_gluon_plan import SMEM_BYTES, pick_config  # noqa: E402

SHAPES = {"q_proj": (8192, 8192), "k_proj": (1024, 8192), "expert_up": (8192, 4096), "expert_down": (4096, 4096)}


def summarize(k) -> dict:
    ptx = k.asm["ptx"]
    wg = [l.strip() for l in ptx.splitlines() if "wgmma.mma_async" in l]
    reg_a = [l for l in wg if re.search(r"\{%r\d+, ?%r\d+, ?%r\d+, ?%r\d+\}, %rd", l)]
    return {"ptx_wgmma": len(wg), "ptxas": ptxas_info(ptx), "register_a_wgmma": len(reg_a), "example": wg[:1],
            "tma_loads": ptx.count("cp.async.bulk.tensor"),
            "mbarrier_waits": len(re.findall(r"mbarrier.try_wait", ptx)),
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx))),
            "shared": k.metadata.shared, "loop_sass": consumer_loop_sass(k.asm["cubin"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", default="64,64,1,6")
    parser.add_argument("--out", default="/tmp/gluon_ir")
    parser.add_argument("--routed", action="store_true", help="the configs pick_config returns (see --ms)")
    parser.add_argument("--ms", default="17,32,64,128,256")
    parser.add_argument("--grouped", action="store_true",
                        help="compile the grouped (MoE) kernel instead: every cut as gate/up with SwiGLU and as down")
    parser.add_argument("--maxnreg", type=int, default=0,
                        help="Triton's maxnreg option; Triton 3.6 still raises the default partition to 256 "
                             "(setmaxnreg), more than a 192-register launch leaves it: inspect, do not run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.routed:
        routed: dict = {}
        for name, (n, k) in SHAPES.items():
            for m in map(int, args.ms.split(",")):
                routed.setdefault(pick_config(m, n, k, 132), []).append(f"{name} M={m}")
        for cfg, where in routed.items():
            print(f"routed {cfg.label()}: {', '.join(where)}", flush=True)
        cuts = [cfg.label() for cfg in routed]
    else:
        cuts = args.cuts.split(";")
    for cut in cuts:
        cfg = gk.GluonConfig.parse(cut)
        bn, bm, split, stages = cfg.block_n, cfg.block_m, cfg.split_k, cfg.stages
        if args.grouped:
            for swiglu in (True, False):
                k = compile_grouped(cfg, swiglu)
                tag = f"moe_{'gate_up' if swiglu else 'down'}_bn{bn}_bm{bm}_s{stages}"
                (out / f"gluon_{tag}.ptx").write_text(k.asm["ptx"])
                print(tag, summarize(k), flush=True)
            continue
        k = compile_cut(cfg, args.maxnreg)  # 0: the launch's own (cfg.maxnreg)
        if k.metadata.shared > SMEM_BYTES + 8 * 1024:  # what the launch would refuse (227 KiB per block on SM90)
            print(f"{cut}: {k.metadata.shared} bytes of shared memory, over the SM90 limit", flush=True)
        tag = (f"bn{bn}_bm{bm}_k{split}_s{stages}" + ("" if cfg.upcast == "int16" else "_" + cfg.upcast)
               + ("_persistent" if cfg.persistent else "") + (f"_r{args.maxnreg}" if args.maxnreg else ""))
        for ext in ("ttgir", "ptx"):
            (out / f"gluon_{tag}.{ext}").write_text(k.asm[ext])
        print(tag, summarize(k), flush=True)


if __name__ == "__main__":
    main()
