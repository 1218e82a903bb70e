"""Compile the swap-AB FP4 GEMM (``fp4_gemm_swapab``) for SM90 and report whether
its weight operand reaches ``wgmma`` from registers: in the TTGIR the left operand of
``ttng.warp_group_dot`` is a tensor with ``#ttg.dot_op<{opIdx = 0`` (register A) rather than a
``!ttg.memdesc`` (shared memory); in the PTX ``wgmma.mma_async`` takes A as a register list. Needs no GPU
(``triton.compile`` for ``GPUTarget("cuda", 90, 32)``); writes the TTGIR/PTX of each cut to ``--out``::

    python backends/cuda/lab/scripts/swapab_ttgir.py [--cuts 128,64,4,4;64,32,4,4] [--out /tmp/swapab_ir]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab: the swap-AB kernel
import fp4_gemm_swapab as sw  # noqa: E402


def compile_cut(block_n: int, block_m: int, stages: int, warps: int, split: int = 1, wfmt: int = 1,
                hw_fp8: bool = True, scales_n_major: bool = False):
    fn = sw.fp4_swapab_kernel
    act = "*bf16"
    sig = {"a_ptr": act, "stride_am": "i32", "w_ptr": "*u8", "s_ptr": "*u8", "stride_wn": "i32", "stride_sn": "i32",
           "stride_sg": "i32",
           "out_scale_ptr": "*fp32", "c_ptr": "*fp32" if split > 1 else act, "stride_cm": "i32",
           "M": "i32", "N": "i32", "K": "i32"}
    const = {"WFMT": wfmt, "EB": 126, "GROUP": 16 if wfmt == 1 else 32, "FOLD": 9 if wfmt == 1 else 0,
             "HW_FP8": hw_fp8, "BLOCK_N": block_n, "BLOCK_M": block_m, "GROUP_N": 8, "ATOMIC": split > 1,
             "STAGES": stages, "EVEN_N": True, "PDL": False}
    for name, v in const.items():
        sig[name] = "constexpr"
    names = list(fn.arg_names)
    constexprs = {(names.index(k),): v for k, v in const.items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("a_ptr", "w_ptr", "s_ptr", "c_ptr", "out_scale_ptr",
                                                                    "stride_am", "stride_wn", "stride_cm", "K", "N")}
    if scales_n_major:  # scales stored [K/group, N]: stride 1 along N (Triton specializes the 1)
        sig["stride_sn"] = "constexpr"
        constexprs[(names.index("stride_sn"),)] = 1
        attrs[(names.index("stride_sg"),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def summarize(k) -> dict:
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    dots = [l.strip() for l in ttgir.splitlines() if "warp_group_dot " in l and "=" in l]
    reg_a = sum(1 for d in dots if re.search(r": tensor<\S+, #ttg.dot_op<\{opIdx = 0", d))
    wg = [l.strip() for l in ptx.splitlines() if "wgmma.mma_async" in l]
    return {"wgmma_dots": len(dots), "register_a_dots": reg_a, "dot_lines": dots[:2], "ptx_wgmma": len(wg),
            "ptx_example": wg[:1], "register_tiles_to_smem": len(re.findall(r"ttg.local_alloc %", ttgir)),
            "local_load_to_dot_op": len(re.findall(r"ttg.local_load .*-> tensor<\S+, #ttg.dot_op<\{opIdx = 0", ttgir)),
            "async_copy": ttgir.count("async_copy_global_to_local"),
            "convert_layout": ttgir.count("ttg.convert_layout"), "regs": getattr(k, "n_regs", None),
            "spills": getattr(k, "n_spills", None), "shared": k.metadata.shared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuts", default="128,64,4,4;128,64,4,4,1")
    parser.add_argument("--out", default="/tmp/swapab_ir")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for cut in args.cuts.split(";"):
        bn, bm, st, wp, *rest = map(int, cut.split(","))
        k = compile_cut(bn, bm, st, wp, scales_n_major=bool(rest and rest[0]))
        tag = f"bn{bn}_bm{bm}_s{st}_w{wp}" + ("_sT" if rest and rest[0] else "")
        (out / f"swapab_{tag}.ttgir").write_text(k.asm["ttgir"])
        (out / f"swapab_{tag}.ptx").write_text(k.asm["ptx"])
        print(tag, summarize(k), flush=True)


if __name__ == "__main__":
    main()
