"""Compile the Gluon W4A16 GEMM (``musecore_cuda.kernels.fp4_gemm_gluon``) for SM90 without a GPU and report what
reached the PTX: register-A ``wgmma`` (A as a register list), TMA copies, mbarriers, the warp-specialized partitions,
registers, spills and shared memory (``triton.compile`` for ``GPUTarget("cuda", 90, 32)``; Triton 3.6)::

    PYTHONPATH=/tmp/triton36 python backends/cuda/lab/scripts/gluon_ir.py [--cuts 64,64,1,6;128,128,1,4] [--out DIR]
    PYTHONPATH=/tmp/triton36 python backends/cuda/lab/scripts/gluon_ir.py --routed [--ms 17,32,64,128,256]

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

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # backends/cuda: musecore_cuda without installing it
from musecore_cuda.kernels import fp4_gemm_gluon as gk  # noqa: E402
from musecore_cuda.kernels.fp4_gluon_plan import SMEM_BYTES, pick_config  # noqa: E402

SHAPES = {"q_proj": (8192, 8192), "k_proj": (1024, 8192), "expert_up": (8192, 4096), "expert_down": (4096, 4096)}


def desc_sig(dtype: str, block: list[int], layout) -> str:
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{layout}>"


def compile_cut(cfg: "gk.GluonConfig", maxnreg: int | None = None):
    """The dense kernel for ``cfg`` (:func:`gk.fp4_gluon_persistent_kernel` when ``cfg.persistent``)."""
    fn = gk.fp4_gluon_persistent_kernel if cfg.persistent else gk.fp4_gluon_kernel
    w_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, 64], gl.uint8)
    x_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, 64], gl.bfloat16)
    sig = {"w_desc": desc_sig("u8", [cfg.block_n, 64], w_layout),
           "x_desc": desc_sig("bf16", [cfg.block_m, 64], x_layout),
           "s_ptr": "*i64", "stride_s": "i32", "out_scale_ptr": "*fp32",
           "c_ptr": "*fp32" if cfg.atomic else "*bf16", "stride_cm": "i32", "M": "i32",
           "N": "i32", "K": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    const = {"BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "STAGES": cfg.stages, "GROUP_M": cfg.group_m,
             "FOLD": 9, "ATOMIC": cfg.atomic, "UPCAST": gk.UPCASTS[cfg.upcast], "FIXUP": cfg.fixup,
             "num_warps": cfg.num_warps}
    names = list(fn.arg_names)
    sig = {k: v for k, v in sig.items() if k in names}
    const = {k: v for k, v in const.items() if k in names}
    for name in const:
        sig[name] = "constexpr"
    constexprs = {(names.index(k),): v for k, v in const.items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("s_ptr", "c_ptr", "out_scale_ptr", "stride_cm",
                                                                    "ws_ptr", "cnt_ptr", "K", "N") if k in names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_grouped(cfg: "gk.GluonConfig", swiglu: bool):
    """:func:`gk.fp4_gluon_moe_kernel` for ``cfg`` (gate/up with SwiGLU, or down)."""
    fn = gk.fp4_gluon_moe_kernel
    box = [cfg.block_n // 2 if swiglu else cfg.block_n, 64]
    w_sig = desc_sig("u8", box, gl.NVMMASharedLayout.get_default_for(box, gl.uint8))
    sig = {"w_desc": w_sig, "w2_desc": w_sig,
           "x_desc": desc_sig("bf16", [cfg.block_m, 64], gl.NVMMASharedLayout.get_default_for([cfg.block_m, 64],
                                                                                               gl.bfloat16)),
           "s_ptr": "*i64", "s2_ptr": "*i64", "stride_s": "i32", "out_scale_ptr": "*fp32", "out_scale2_ptr": "*fp32",
           "blk_expert_ptr": "*i32", "c_ptr": "*bf16", "stride_cm": "i32", "M": "i32", "N": "i32", "K": "i32"}
    const = {"BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "STAGES": cfg.stages, "GROUP_M": cfg.group_m,
             "FOLD": 9, "SWIGLU": swiglu, "num_warps": cfg.num_warps}
    names = list(fn.arg_names)
    for name in const:
        sig[name] = "constexpr"
    constexprs = {(names.index(k),): v for k, v in const.items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("s_ptr", "s2_ptr", "c_ptr", "out_scale_ptr",
                                                                    "out_scale2_ptr", "blk_expert_ptr", "stride_cm",
                                                                    "K", "N", "M")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg.num_warps})


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
    if not any("C75" in l for l in res.stderr.splitlines()):
        keep.append("no C75xx warning (wgmma not serialized)")
    return "; ".join(keep)


def consumer_loop_sass(cubin: bytes) -> dict:
    """The consumer's main loop in SASS (``nvdisasm`` of the wheel): the innermost loop (label to the branch back
    to it) holding at least 8 HGMMAs, i.e. one 128-element chunk per warp (more if a loop is unrolled). Returns the
    instruction count, an opcode histogram (the mnemonic before its first dot, predicates dropped), the count per
    128-element chunk and how many lie between the loop's last HGMMA and the next ``WARPGROUP`` instruction."""
    import subprocess
    import tempfile
    from collections import Counter
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        lines = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    labels = {l.rstrip(":"): i for i, l in enumerate(lines) if re.match(r"^\.L_x_\d+:", l)}
    loops = []  # (head, end) of every backward branch whose body holds a chunk's 8 HGMMAs
    for end, l in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", l)
        if m and labels.get(m.group(1), end) < end:
            head = labels[m.group(1)]
            if sum("HGMMA" in x for x in lines[head:end]) >= 8:
                loops.append((end - head, head, end))
    _, head, end = min(loops)  # the innermost such loop
    ops = []
    for l in lines[head:end + 1]:
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", l)
        if m:
            ops.append(m.group(2))
    last_mma = max(i for i, op in enumerate(ops) if op == "HGMMA")
    depbar = next((i for i in range(last_mma, len(ops)) if ops[i] == "WARPGROUP" and i > last_mma), len(ops))
    chunks = ops.count("HGMMA") // 8
    return {"per_chunk": round(len(ops) / chunks, 1), "chunks_per_iteration": chunks, "instructions": len(ops),
            "histogram": dict(Counter(ops).most_common()), "between_last_hgmma_and_wait": depbar - last_mma - 1}


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
        k = compile_cut(cfg, args.maxnreg or cfg.maxnreg)
        if k.metadata.shared > SMEM_BYTES + 8 * 1024:  # what the launch would refuse (227 KiB per block on SM90)
            print(f"{cut}: {k.metadata.shared} bytes of shared memory, over the SM90 limit", flush=True)
        tag = (f"bn{bn}_bm{bm}_k{split}_s{stages}" + ("" if cfg.upcast == "int16" else "_" + cfg.upcast)
               + ("_persistent" if cfg.persistent else "") + (f"_r{args.maxnreg}" if args.maxnreg else ""))
        for ext in ("ttgir", "ptx"):
            (out / f"gluon_{tag}.{ext}").write_text(k.asm[ext])
        print(tag, summarize(k), flush=True)


if __name__ == "__main__":
    main()
