"""SASS of the CUDA C++ decode GEMV without a GPU: NVRTC (``nvidia-cuda-nvrtc-cu12``'s libnvrtc, by ctypes) compiles
one instantiation of ``fp4_gemv_mma`` to an SM90 cubin, Triton's bundled ``nvdisasm`` disassembles it, and the script
reports the registers and the instructions of the kernel's innermost loops (label to backward branch), counted by
opcode. For instruction-count work on the decode kernels (lab NOTES: the q_proj M = 1 GEMV is issue-bound, ~244 warp
instructions per 1 KB chunk), on the CPU host::

    pip download nvidia-cuda-nvrtc-cu12 --no-deps -d /tmp/nvrtc && (cd /tmp/nvrtc && python3 -m zipfile -e *.whl x)
    python3 backends/cuda/lab/scripts/gemv_sass.py --nvrtc /tmp/nvrtc/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 \\
        --nvdisasm /tmp/t36/lib/python3.12/site-packages/triton/backends/nvidia/bin/nvdisasm \\
        --name "fp4_gemv_mma<1, 4, 2, 1, 1, false, false, 1, false>"
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import re
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "musecore_cuda" / "csrc"


def compile_cubin(lib: str, source: str, name: str, arch: str) -> bytes:
    nvrtc = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    check = lambda rc, what: (_ for _ in ()).throw(RuntimeError(f"{what}: nvrtc error {rc}")) if rc else None  # noqa
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"fp4_gemv.cu", 0, None, None), "create")
    check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), "name")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    if rc:
        raise RuntimeError(f"nvrtc compile failed:\n{log.value.decode()[-3000:]}")
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
    return cubin.raw


def loops(sass: str) -> list[list[str]]:
    """Instruction lists of the backward-branch loops (label .. BRA back to it), innermost first by length."""
    lines = [ln for ln in sass.splitlines()]
    labels, found = {}, []
    instrs = []
    for ln in lines:
        m = re.match(r"\s*(\.L_x_\d+):", ln)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", ln)
        if m:
            instrs.append(m.group(1).strip())
            b = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", m.group(1))
            if b and b.group(1) in labels and labels[b.group(1)] < len(instrs):
                found.append(instrs[labels[b.group(1)]:])
    return sorted(found, key=len)


def opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    return ins.split()[0].split(".")[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nvrtc", required=True)
    p.add_argument("--nvdisasm", required=True)
    p.add_argument("--name", default="fp4_gemv_mma<1, 4, 2, 1, 1, false, false, 1, false>")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--source", default="", help="a .cu file instead of csrc/pdl.cuh + csrc/fp4_gemv.cu")
    p.add_argument("--dump", default="")
    args = p.parse_args()
    source = Path(args.source).read_text() if args.source else (CSRC / "pdl.cuh").read_text() + (
        CSRC / "fp4_gemv.cu").read_text()
    cubin = compile_cubin(args.nvrtc, source, args.name, args.arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([args.nvdisasm, "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout
        cuobjdump = Path(args.nvdisasm).with_name("cuobjdump")
        usage = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
    if args.dump:
        Path(args.dump).write_text(sass)
    regs = re.search(r"REG:(\d+)", usage)
    print(f"{args.name} ({args.arch}): {regs.group(1) if regs else '?'} registers, {sass.count(';')} SASS lines")
    for body in loops(sass)[-4:]:
        counts = collections.Counter(opcode(i) for i in body)
        print(f"loop of {len(body)} instructions: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))


if __name__ == "__main__":
    main()
