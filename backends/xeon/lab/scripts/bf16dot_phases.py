"""Per-phase timing of the AVX512_BF16 INT4 GEMM (csrc/bf16dot.c): where the time goes when it misses oneDNN.

Builds three variants of the kernel from a copy of ``musecore_xeon/csrc`` (the source itself is not changed):
``full`` (as shipped), ``no-decode`` (the panels are never decoded: the micro-kernels read stale panels, so this
is the dot-product phase alone, with the activation conversion and the output stores) and ``no-dot`` (decode,
activation conversion and stores, no micro-kernel calls), and times each on the same weight in alternating rounds,
thread CPU time, one thread. Reports ns per 16-row x 2-column weight vector (one vdpbf16ps operand) and GFLOP/s,
next to PyTorch's BF16 F.linear on the same shape.

    python backends/xeon/lab/scripts/bf16dot_phases.py 8192 2048 --ms 16 64 256
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
# (anchor in bf16dot.c, replacement): each toggle wraps one phase in #ifndef
TOGGLES = {
    "no-decode": ("        if (r0 >= w->n_rows) {\n            for (int64_t p = 0; p < kb / 2; ++p)",
                  "        continue;\n        if (r0 >= w->n_rows) {\n            for (int64_t p = 0; p < kb / 2; ++p)"),
    "no-dot": ("                        bg_block(xp", "                        if (0) bg_block(xp"),
}


def build(variant: str, tmp: Path) -> ctypes.CDLL:
    src = tmp / variant
    shutil.copytree(CSRC, src)
    if variant in TOGGLES:
        anchor, new = TOGGLES[variant]
        text = (src / "bf16dot.c").read_text()
        if text.count(anchor) != 1:
            raise SystemExit(f"bf16dot.c changed: the {variant} anchor is not found once; update TOGGLES")
        (src / "bf16dot.c").write_text(text.replace(anchor, new))
    so = tmp / f"{variant}.so"
    subprocess.run(["gcc", *native.compile_flags(), "-o", str(so), str(src / "kernels.c"), "-lm"], check=True)
    return native.declare_signatures(ctypes.CDLL(str(so)))


def best(fn, repeats: int, clock=time.thread_time) -> float:
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
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="> 1: wall time (perf_counter) instead of thread time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    n, k = args.n, args.k
    w = torch.randn(n, k) * 0.02
    lin = prepare_int4(musecore_quant.quantize(w, "int4", group_size=args.group), torch.bfloat16, calibrate=False)
    gemv, wb = lin.bound_gemv(), w.bfloat16()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {v: build(v, Path(tmp)) for v in ("full", "no-decode", "no-dot")}
        vectors = n * k / 32
        print(f"{n}x{k} g={args.group}, {args.threads} thread(s), best of {args.rounds} alternating rounds "
              f"({'thread CPU' if args.threads == 1 else 'wall'} time)")
        for m in args.ms:
            x = torch.randn(m, k).bfloat16()
            y = torch.empty(m, n, dtype=torch.bfloat16)
            times = {}
            for _ in range(args.rounds):
                for name, lib in libs.items():
                    t = best(lambda: lib.musecore_int4_bf16_gemm(gemv.args_ptr, x.data_ptr(), 1, y.data_ptr(), 1, m), 3,
                             clock)
                    times[name] = min(times.get(name, t), t)
                t = best(lambda: F.linear(x, wb), 3, clock)
                times["torch-bf16"] = min(times.get("torch-bf16", t), t)
            cells = [f"{name} {t * 1e3:8.3f} ms {t / vectors * 1e9:6.2f} ns/vec {2 * m * n * k / t / 1e9:5.0f} GF/s"
                     for name, t in times.items()]
            print(f"M={m:4d}  " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
