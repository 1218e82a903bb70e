"""Compile the lab's Gluon W4A16 GEMM (``fp4_gemm_gluon``) for SM90 without a GPU and report what reached
the PTX: register-A ``wgmma`` (A as a register list), TMA copies, mbarriers, the warp-specialized partitions,
registers, spills and shared memory (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``; Triton 3.6)::

    PYTHONPATH=/tmp/triton36 python backends/cuda/lab/scripts/gluon_ir.py [--cuts 64,64,1,6;128,128,1,4] [--out DIR]

A cut is ``block_n,block_m,split_k,stages[,asm_upcast]``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab: the Gluon kernel
import fp4_gemm_gluon as gk  # noqa: E402


def desc_sig(dtype: str, block: list[int], layout) -> str:
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{layout}>"


def compile_cut(cfg: "gk.GluonConfig", maxnreg: int | None = None):
    fn = gk.fp4_gluon_kernel
    w_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, 64], gl.uint8)
    x_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, 64], gl.bfloat16)
    sig = {"w_desc": desc_sig("u8", [cfg.block_n, 64], w_layout), "x_desc": desc_sig("bf16", [cfg.block_m, 64], x_layout),
           "s_ptr": "*i64", "stride_s": "i32", "out_scale_ptr": "*fp32",
           "c_ptr": "*fp32" if cfg.split_k > 1 else "*bf16", "stride_cm": "i32", "M": "i32", "N": "i32", "K": "i32"}
    const = {"BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "STAGES": cfg.stages, "GROUP_M": cfg.group_m,
             "FOLD": 9, "ATOMIC": cfg.split_k > 1, "ASM_UPCAST": cfg.asm_upcast, "num_warps": cfg.num_warps}
    names = list(fn.arg_names)
    for name in const:
        sig[name] = "constexpr"
    constexprs = {(names.index(k),): v for k, v in const.items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("s_ptr", "c_ptr", "out_scale_ptr", "stride_cm",
                                                                    "K", "N")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_info(ptx: str) -> str:
    """Registers, spills and the wgmma-serialization warning (C7513) from the wheel's ptxas for sm_90a."""
    import subprocess
    import tempfile
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([str(ptxas), "--gpu-name", "sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    keep = [l.split("info    : ")[-1].strip() for l in res.stderr.splitlines()
            if "registers" in l or "spill" in l or "C75" in l]
    return "; ".join(keep)


def summarize(k) -> dict:
    ptx = k.asm["ptx"]
    wg = [l.strip() for l in ptx.splitlines() if "wgmma.mma_async" in l]
    reg_a = [l for l in wg if re.search(r"\{%r\d+, ?%r\d+, ?%r\d+, ?%r\d+\}, %rd", l)]
    return {"ptx_wgmma": len(wg), "ptxas": ptxas_info(ptx), "register_a_wgmma": len(reg_a), "example": wg[:1],
            "tma_loads": ptx.count("cp.async.bulk.tensor"), "mbarrier_waits": len(re.findall(r"mbarrier.try_wait", ptx)),
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", ptx))),
            "shared": k.metadata.shared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", default="64,64,1,6")
    parser.add_argument("--out", default="/tmp/gluon_ir")
    parser.add_argument("--maxnreg", type=int, default=0,
                        help="Triton's maxnreg option; Triton 3.6 still raises the default partition to 256 "
                             "(setmaxnreg), more than a 192-register launch leaves it: inspect, do not run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for cut in args.cuts.split(";"):
        bn, bm, split, stages, *asm = map(int, cut.split(","))
        cfg = gk.GluonConfig(bn, bm, split, stages, asm_upcast=bool(asm and asm[0]))
        k = compile_cut(cfg, args.maxnreg or None)
        tag = (f"bn{bn}_bm{bm}_k{split}_s{stages}" + ("_asm" if cfg.asm_upcast else "")
               + (f"_r{args.maxnreg}" if args.maxnreg else ""))
        for ext in ("ttgir", "ptx"):
            (out / f"gluon_{tag}.{ext}").write_text(k.asm[ext])
        print(tag, summarize(k), flush=True)


if __name__ == "__main__":
    main()
