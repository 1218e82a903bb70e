"""The Gluon kernels (``musecore_cuda.kernels.fp4_gemm_gluon``) compiled for SM90 (the H200's ISA) without a GPU:
``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` with Triton 3.6 (the version the kernels are written for, kept
beside the test environment's own Triton in ``.triton36``, which ``.ci/run`` installs), then the wheel's ``ptxas``
and ``nvdisasm`` for registers, spills, the wgmma-serialization warning (C7513) and the consumer loop's SASS.

Used by ``test_cuda_gluon_compile.py`` (through a subprocess: the test environment's Triton is another version) and
by ``backends/cuda/lab/scripts/gluon_ir.py``. As a script it compiles the cuts named on its command line (a cut is
``GluonConfig.label()``'s syntax; ``grouped:`` before it compiles the grouped kernel's gate/up and down) and prints
one JSON line per kernel::

    PYTHONPATH=.triton36 python3 backends/cuda/tests/gluon_sm90.py 64,128,1,4,packed grouped:128,256,1,3,packed
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[3]
TRITON36 = Path(os.environ.get("MUSECORE_TRITON36", REPO / ".triton36"))  # Triton 3.6 installed with pip --target


def _installed_triton() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("triton")
    except PackageNotFoundError:
        return "(none)"


def _triton36_path() -> Optional[Path]:
    """Where Triton 3.6 comes from: ``TRITON36`` when it holds one, else None (the environment's own is 3.6, as on
    the GPU machine), or a missing path when neither."""
    if (TRITON36 / "triton" / "backends" / "nvidia" / "bin" / "ptxas").exists():
        return TRITON36
    return None if _installed_triton().startswith("3.6.") else TRITON36 / "(missing)"


def missing() -> Optional[str]:
    """Why the SM90 compile checks cannot run here (None: they can)."""
    path = _triton36_path()
    if path is not None and not path.exists():
        return (f"needs Triton 3.6 at {TRITON36} or installed (this environment has triton {_installed_triton()}): "
                "python3 -m pip install -q --no-deps --target .triton36 triton==3.6.0, as .ci/run does")
    return None


def compile_in_subprocess(cuts: list[str], timeout: int = 900) -> list[dict]:
    """:func:`report` of every cut, compiled by this file run with Triton 3.6 first on the path."""
    first = [str(p) for p in [_triton36_path()] if p is not None]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(first + [str(REPO / "backends" / "cuda")]
                                                       + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    res = subprocess.run([sys.executable, __file__, *cuts], capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode:
        raise RuntimeError(f"gluon_sm90.py failed (rc {res.returncode}): {res.stderr[-3000:]}")
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def _triton():
    """Triton 3.6's pieces and the kernel module (imported only in the subprocess, where 3.6 comes first)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from musecore_cuda.kernels import fp4_gemm_gluon as gk
    return triton, GPUTarget, gl, GluonASTSource, gk


def desc_sig(dtype: str, block: list[int], layout) -> str:
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{layout}>"


def compile_cut(cfg, maxnreg: Optional[int] = None, pdl: bool = False):
    """The dense kernel for ``cfg`` (a ``GluonConfig``; :func:`gk.fp4_gluon_persistent_kernel` when
    ``cfg.persistent``), with ``pdl`` as launched with programmatic dependent launch, at ``maxnreg`` registers per
    thread (by default the launch's own: ``cfg.maxnreg``)."""
    triton, GPUTarget, gl, GluonASTSource, gk = _triton()
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
             "FINISH": cfg.finish, "num_warps": cfg.num_warps, "PAIR": 2 if cfg.pair else 1,
             "LATE": cfg.late, "AHEAD": cfg.ahead, "REZERO": cfg.rezero, "PDL": pdl}
    names = list(fn.arg_names)
    sig = {k: v for k, v in sig.items() if k in names}
    const = {k: v for k, v in const.items() if k in names}
    for name in const:
        sig[name] = "constexpr"
    constexprs = {(names.index(k),): v for k, v in const.items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("s_ptr", "c_ptr", "out_scale_ptr", "stride_cm",
                                                                    "ws_ptr", "cnt_ptr", "K", "N") if k in names}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {**cfg.launch_options, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_grouped(cfg, swiglu: bool):
    """:func:`gk.fp4_gluon_moe_kernel` for ``cfg`` (gate/up with SwiGLU, or down)."""
    triton, GPUTarget, gl, GluonASTSource, gk = _triton()
    fn = gk.fp4_gluon_moe_kernel
    box = [cfg.block_n // 2 if swiglu else cfg.block_n, 64]
    w_sig = desc_sig("u8", box, gl.NVMMASharedLayout.get_default_for(box, gl.uint8))
    sig = {"w_desc": w_sig, "w2_desc": w_sig,
           "x_desc": desc_sig("bf16", [cfg.block_m, 64], gl.NVMMASharedLayout.get_default_for([cfg.block_m, 64],
                                                                                               gl.bfloat16)),
           "s_ptr": "*i64", "s2_ptr": "*i64", "stride_s": "i32", "out_scale_ptr": "*fp32", "out_scale2_ptr": "*fp32",
           "blk_expert_ptr": "*i32", "c_ptr": "*bf16", "stride_cm": "i32", "M": "i32", "N": "i32", "K": "i32"}
    const = {"BLOCK_N": cfg.block_n, "BLOCK_M": cfg.block_m, "STAGES": cfg.stages, "GROUP_M": cfg.group_m,
             "FOLD": 9, "SWIGLU": swiglu, "num_warps": cfg.num_warps, "PAIR": 2 if cfg.pair else 1,
             "LATE": cfg.late, "AHEAD": cfg.ahead}
    names = list(fn.arg_names)
    for name in const:
        sig[name] = "constexpr"
    constexprs = {(names.index(k),): v for k, v in const.items()}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in ("s_ptr", "s2_ptr", "c_ptr", "out_scale_ptr",
                                                                    "out_scale2_ptr", "blk_expert_ptr", "stride_cm",
                                                                    "K", "N", "M")}
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=cfg.launch_options)


def ptxas_info(ptx: str) -> str:
    """Registers, spills and the wgmma-serialization warning (C7513) from the wheel's ptxas for sm_90a."""
    import tempfile
    triton = _triton()[0]
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
    import tempfile
    from collections import Counter
    triton = _triton()[0]
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


def report(kernel) -> dict:
    """What the checks read from one compiled kernel: ptxas's registers, spill bytes and warnings, the consumer
    loop's SASS per chunk, shared memory."""
    info = ptxas_info(kernel.asm["ptx"])
    spills = sum(int(b) for b in re.findall(r"(\d+) bytes spill", info))
    return {"ptxas": info, "spill_bytes": spills, "c75": "C75" in info.replace("no C75xx", ""),
            "shared": kernel.metadata.shared, "per_chunk": consumer_loop_sass(kernel.asm["cubin"])["per_chunk"],
            "atomics": dict(Counter(re.findall(r"\batom\.global\.[\w.]*add\.(v4\.f32|f32)", kernel.asm["ptx"]))),
            "gdc_waits": kernel.asm["ptx"].count("griddepcontrol.wait")}


def main(cuts: list[str]) -> None:
    gk = _triton()[4]
    for cut in cuts:
        grouped = cut.startswith("grouped:")
        cfg = gk.GluonConfig.parse(cut.removeprefix("grouped:").removeprefix("pdl:"))
        kernels = ({"gate_up": compile_grouped(cfg, True), "down": compile_grouped(cfg, False)} if grouped
                   else {"dense": compile_cut(cfg, pdl=cut.startswith("pdl:"))})
        for kind, kernel in kernels.items():
            print(json.dumps({"cut": cut, "kernel": kind, **report(kernel)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
