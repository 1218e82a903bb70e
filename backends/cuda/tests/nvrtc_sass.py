"""The CUDA C++ kernels compiled for a GPU's ISA on a host without one: NVRTC (the ``nvidia-cuda-nvrtc-cu12`` wheel's
libnvrtc, through ctypes) makes the cubin, and the ``cuobjdump`` / ``nvdisasm`` that Triton's wheel bundles read its
registers, spills and SASS. Used by ``test_cuda_kernels_compile.py`` and ``lab/scripts/gemv_sass.py``."""

from __future__ import annotations

import collections
import ctypes
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


def nvrtc_library() -> Optional[Path]:
    """libnvrtc of the ``nvidia-cuda-nvrtc-cu12`` wheel, or None when it is not installed."""
    try:
        from nvidia import cuda_nvrtc
    except ImportError:
        return None
    found = sorted(Path(list(cuda_nvrtc.__path__)[0], "lib").glob("libnvrtc.so.*"))
    return found[0] if found else None


def cuda_tool(name: str) -> Optional[Path]:
    """``cuobjdump`` or ``nvdisasm`` from Triton's wheel, or None."""
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return path if path.exists() else None


def compile_cubin(source: str, name: str, arch: str = "sm_90", lib: Optional[Path] = None) -> bytes:
    """The cubin of the template instantiation ``name`` of ``source``, as ``torch.cuda._compile_kernel`` would build
    it for ``arch`` (raises RuntimeError with NVRTC's log when it does not compile)."""
    nvrtc = ctypes.CDLL(str(lib or nvrtc_library()))
    prog = ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"NVRTC {what} failed (error {rc}) for {name}")

    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None), "create")
    try:
        check(nvrtc.nvrtcAddNameExpression(prog, name.encode()), "name expression")
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"]
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        if rc:
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{log.value.decode()[-3000:]}")
        check(nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


@dataclass
class Compiled:
    registers: int
    stack: int       # bytes of stack frame (spills land here)
    sass: str

    def loops(self) -> list[list[str]]:
        """The instructions of each backward-branch loop (label .. the branch back to it), shortest first."""
        labels: dict[str, int] = {}
        instrs: list[str] = []
        found = []
        for line in self.sass.splitlines():
            m = re.match(r"\s*(\.L_x_\d+):", line)
            if m:
                labels[m.group(1)] = len(instrs)
                continue
            m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
            if m:
                instrs.append(m.group(1))
                b = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", m.group(1))
                if b and b.group(1) in labels:
                    found.append(instrs[labels[b.group(1)]:])
        return sorted(found, key=len)

    def main_loop(self) -> list[str]:
        """The longest loop (the decode kernels' K loop)."""
        return self.loops()[-1]


def opcode_counts(instrs: list[str]) -> collections.Counter:
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in instrs)


def inspect(cubin: bytes) -> Compiled:
    """Registers, stack frame and SASS of a one-kernel cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(cuda_tool("cuobjdump")), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(cuda_tool("nvdisasm")), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    regs, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return Compiled(int(regs.group(1)), int(stack.group(1)) if stack else 0, sass)


def missing() -> Optional[str]:
    """Why kernels cannot be compiled here (None when they can)."""
    if nvrtc_library() is None:
        return "NVRTC is not installed (pip install nvidia-cuda-nvrtc-cu12; .ci/run installs it)"
    if cuda_tool("cuobjdump") is None or cuda_tool("nvdisasm") is None:
        return "Triton's bundled cuobjdump / nvdisasm are missing"
    return None
