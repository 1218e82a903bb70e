"""Where the time of a small INT4 linear goes on this CPU: the same call with its weight hot (one copy, called
back to back: in cache) and cold (300 copies cycled: from DRAM), at 1 and 2 threads, M = 1::

    python3 benchmarks/xeon_small_shape_probe.py

If hot is close to cold, the call is bound by the kernel's own rate and per-call cost, not by memory.
"""

from __future__ import annotations

import time

import torch

import musecore_quant
from musecore_xeon import XeonBackend

SHAPES = ((768, 512), (512, 768), (512, 1536))  # (N, K): muse-small's expert and projection shapes
COPIES, CALLS, ROUNDS = 300, 2000, 5


def best_us(fn, calls: int) -> float:
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


def main() -> None:
    be = XeonBackend()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n, k in SHAPES:
            make = lambda: be.prepare_weight(musecore_quant.quantize(torch.randn(n, k) * 0.02, "int4", group_size=128,  # noqa: E731
                                                                     sym=True), "linear")
            copies = [make() for _ in range(COPIES)]
            x = torch.randn(1, k, dtype=torch.bfloat16)
            hot = copies[0]
            for _ in range(200):
                be.linear(x, hot)
            t_hot = best_us(lambda: [be.linear(x, hot) for _ in range(CALLS)], CALLS)
            t_cold = best_us(lambda: [be.linear(x, w) for w in copies], COPIES)
            nbytes = n * k // 2 + n * (k // 128) * 2 * 2  # codes + fp16 scales and zeros
            print(f"threads {threads} {n}x{k}: hot {t_hot:.2f} us, cold {t_cold:.2f} us "
                  f"({nbytes / 1e3:.0f} KB: {nbytes / t_cold / 1e3:.1f} GB/s cold)")


if __name__ == "__main__":
    main()
