"""Where the INT4 AMX GEMM spends its time: hot (weight in cache) timings by M and thread count.

t(M) = a fixed part (the dequantization of the weight into B tiles, the activations' packing, the fork/join) plus
a part that grows with M (the tile products): the M sweep at one thread separates them, the thread sweep shows
how the fixed part scales. Reference rows: the INT4 GEMV at M = 1 and PyTorch's BF16 F.linear, same process.

    python3 backends/xeon/lab/scripts/xeon_amx_probe.py --shapes 4096x8192 8192x4096 4096x4096 768x768 --threads 1 16 --out probe.txt

The default shapes are the 816B preset's pooler [h, H], unpooler [H, h] and expert [I, h] and muse-small's expert
(``MuseConfig.from_name``; h = ``moe_hidden_size``, I = ``moe_intermediate_size``).
"""

from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F

from musecore.config import MuseConfig
from musecore_xeon import XeonBackend
from musecore_xeon.bench import random_int4_linear
from musecore_xeon.kernels import native
from musecore_xeon.kernels.crossover import time_us


def default_shapes() -> list[str]:
    big, small = MuseConfig.from_name("muse-spark-open-816b-a42b"), MuseConfig.from_name("muse-small")
    H, h, inter = big.hidden_size, big.moe_hidden_size, big.moe_intermediate_size
    return list(dict.fromkeys(f"{n}x{k}" for n, k in ((h, H), (H, h), (inter, h),
                                                      (small.moe_intermediate_size, small.moe_hidden_size))))


def best_us(fn) -> float:
    return time_us(fn, repeats=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=default_shapes(), help="NxK (out x in)")
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--ms", nargs="+", type=int, default=[16, 32, 64, 128, 256])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not native.amx_ready():
        raise SystemExit("no AMX here (musecore_xeon.kernels.native.amx_ready() is False)")
    backend = XeonBackend()
    lines = []
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        lin = random_int4_linear(backend, n, k)
        gemv = lin.bound_gemv()
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        for threads in args.threads:
            torch.set_num_threads(threads)
            x1 = torch.randn(1, k, dtype=torch.bfloat16)
            lines.append(f"{shape} threads {threads}: gemv M=1 {best_us(lambda: gemv.call(x1)):.1f} us")
            for m in args.ms:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                t_amx = best_us(lambda: native.int4_amx(gemv, x))
                t_bf16 = best_us(lambda: F.linear(x, w))
                lines.append(f"  M={m:4d}  amx {t_amx:9.1f} us  bf16 F.linear {t_bf16:9.1f} us  "
                             f"({t_bf16 / t_amx:.2f}x)  {2 * m * n * k / t_amx / 1e6:.2f} TFLOP/s")
            print("\n".join(lines[-len(args.ms) - 1:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
