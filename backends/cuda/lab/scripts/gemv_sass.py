"""SASS of one CUDA C++ kernel instantiation without a GPU (``backends/cuda/tests/nvrtc_sass.py``: NVRTC from the
``nvidia-cuda-nvrtc-cu12`` wheel, Triton's ``cuobjdump`` / ``nvdisasm``): registers, stack, and the instructions of
its longest loops counted by opcode. For instruction-count work on the decode GEMV (issue-bound: lab NOTES, session
56) on the CPU host::

    python3 backends/cuda/lab/scripts/gemv_sass.py --name "fp4_gemv_mma<1, 4, 2, 1, 1, false, false, 1, false, true, 0>"
        [--source FILE.cu (default: the package's pdl.cuh + fp4_gemv.cu + fp4_gemm.cu)] [--arch sm_90] [--dump F]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import nvrtc_sass  # noqa: E402
from musecore_cuda.kernels import fp4_gemm_cuda  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--name", default="fp4_gemv_mma<1, 4, 2, 1, 1, false, false, 1, false, true, 0>")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--source", default="")
    p.add_argument("--dump", default="", help="write the SASS here")
    args = p.parse_args()
    if nvrtc_sass.missing():
        sys.exit(nvrtc_sass.missing())
    source = Path(args.source).read_text() if args.source else fp4_gemm_cuda.SOURCE
    c = nvrtc_sass.inspect(nvrtc_sass.compile_cubin(source, args.name, args.arch))
    if args.dump:
        Path(args.dump).write_text(c.sass)
    print(f"{args.name} ({args.arch}): {c.registers} registers, {c.stack}-byte stack")
    for body in c.loops()[-3:]:
        ops = nvrtc_sass.opcode_counts(body)
        print(f"loop of {len(body)} instructions: " + ", ".join(f"{k} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()
