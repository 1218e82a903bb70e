"""Compare builds of the AVX512_BF16 INT4 GEMM (csrc/bf16dot.c) that differ in ``-D`` tuning knobs (or in a source
edit kept in a copy of csrc: ``--src NAME=DIR``), on one weight, in alternating rounds, next to PyTorch's BF16
``F.linear``. One thread: thread CPU time (ranks variants on a shared host); more: wall time.

    python backends/xeon/lab/scripts/bf16dot_variants.py 2048 8192 --ms 64 256 \\
        --variant base= --variant t1=-DBG_PF_HINT=_MM_HINT_T1 --variant ahead2=-DBG_AHEAD=2

A variant is ``NAME=FLAGS`` (FLAGS: comma-separated compiler flags, possibly empty). Each variant's output is
checked against the first one's (exact equality is not required between summation orders; the max difference is
printed).
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import musecore_quant
from musecore_xeon.kernels import native
from musecore_xeon.kernels.int4 import prepare_int4

CSRC = Path(native.__file__).resolve().parents[1] / "csrc"


def build(name: str, flags: list[str], src: Path, tmp: Path) -> ctypes.CDLL:
    so = tmp / f"{name}.so"
    subprocess.run(["gcc", *native.compile_flags(), *flags, "-o", str(so), str(src / "kernels.c"), "-lm"], check=True)
    return native.declare_signatures(ctypes.CDLL(str(so)))


def best(fn, repeats: int, clock) -> float:
    fn()
    out = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        out = min(out, clock() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("n", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("--ms", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", action="append", default=[], help="NAME=FLAGS (comma-separated)")
    parser.add_argument("--src", action="append", default=[], help="NAME=DIR: variant NAME builds DIR/kernels.c")
    parser.add_argument("--fn", choices=("bf16dot", "gemv"), default="bf16dot",
                        help="the kernel timed: the AVX512_BF16 GEMM or the int16 GEMV (musecore_int4_linear)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    n, k = args.n, args.k
    w = torch.randn(n, k) * 0.02
    lin = prepare_int4(musecore_quant.quantize(w, "int4", group_size=args.group), torch.bfloat16, calibrate=False)
    gemv, wb = lin.bound_gemv(), w.bfloat16()
    sources = dict(s.split("=", 1) for s in args.src)
    variants = [v.split("=", 1) for v in args.variant] or [["base", ""]]
    with tempfile.TemporaryDirectory() as tmp:
        libs = {}
        for name, flags in variants:
            src = Path(sources.get(name, ""))
            if name not in sources:
                src = Path(tmp) / f"src-{name}"
                shutil.copytree(CSRC, src)
            libs[name] = build(name, [f for f in flags.split(",") if f], src, Path(tmp))
        print(f"{n}x{k} g={args.group}, {args.threads} thread(s), best of {args.rounds} alternating rounds "
              f"({'thread CPU' if args.threads == 1 else 'wall'} time)", flush=True)
        for m in args.ms:
            x = torch.randn(m, k).bfloat16()
            ys = {name: torch.empty(m, n, dtype=torch.bfloat16 if args.fn == "gemv" else torch.float32) for name in libs}
            times: dict[str, float] = {}
            for _ in range(args.rounds):
                for name, lib in libs.items():
                    y = ys[name]
                    if args.fn == "gemv":
                        call = lambda: lib.musecore_int4_linear(gemv.args_ptr, x.data_ptr(), y.data_ptr(), m, 1)  # noqa: E731
                    else:
                        call = lambda: lib.musecore_int4_bf16_gemm(gemv.args_ptr, x.data_ptr(), 1, y.data_ptr(), 0, m)  # noqa: E731
                    t = best(call, 3, clock)
                    times[name] = min(times.get(name, t), t)
                t = best(lambda: F.linear(x, wb), 3, clock)
                times["torch-bf16"] = min(times.get("torch-bf16", t), t)
            ref = next(iter(ys.values()))
            diffs = {name: float((y.float() - ref.float()).abs().max()) for name, y in ys.items()}
            cells = [f"{name} {t * 1e3:8.3f} ms {2 * m * n * k / t / 1e9:5.0f} GF/s"
                     + (f" ({times['torch-bf16'] / t:.3f}x torch, diff {diffs[name]:.1e})" if name in diffs else "")
                     for name, t in times.items()]
            print(f"M={m:4d}  " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
