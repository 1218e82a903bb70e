"""Where the INT4 dense-tile path's time goes on a CPU with a native BF16 GEMM (AMX / AVX-512 BF16), and how the
tile size moves it: per tile the C dequantization (fp32), the copy to bf16 and ``torch.mm``, then the whole path
at several tile sizes against ``F.linear`` on the BF16 weight. Weights hot (one copy; the comparison is between
paths on the same cached data)::

    python3 backends/xeon/lab/scripts/xeon_tile_probe.py [--shapes 4096x8192 8192x4096] [--ms 16 64 256]

The default shapes are the 816B preset's pooler [h, H] and unpooler [H, h] (``MuseConfig.from_name``).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from musecore.config import MuseConfig
from musecore_xeon import XeonBackend
from musecore_xeon.bench import random_int4_linear
from musecore_xeon.kernels import dense, int4, native

TILE_ELEMENTS = (2 << 20, 8 << 20, 32 << 20)


def default_shapes() -> list[str]:
    cfg = MuseConfig.from_name("muse-spark-open-816b-a42b")
    H, h = cfg.hidden_size, cfg.moe_hidden_size
    return [f"{h}x{H}", f"{H}x{h}"]


def best_us(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=default_shapes(), help="NxK (out x in)")
    parser.add_argument("--ms", nargs="+", type=int, default=[16, 64, 256])
    args = parser.parse_args()
    be = XeonBackend()
    default, native_default = dense.DENSE_TILE_ELEMENTS, int4.NATIVE_BF16_TILE_ELEMENTS
    print(f"{be.cpu.summary()}; threads {torch.get_num_threads()}; dense dtype {be.dense_dtype}")
    for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes):
        lin = random_int4_linear(be, n, k)
        w16 = lin.dequantize().to(torch.bfloat16)
        rows = dense.tile_rows_for(k, n, native.ROWS)
        fp32 = torch.empty(rows, k)
        low = torch.empty(rows, k, dtype=torch.bfloat16)
        t_dq = best_us(lambda: native.int4_dequant(lin.codes[:rows], lin.scale_zero[:rows // native.ROWS], fp32, 128))
        t_cp = best_us(lambda: low.copy_(fp32))
        print(f"{n}x{k}: one {rows}-row tile: dequant {t_dq:.0f} us, copy to bf16 {t_cp:.0f} us")
        for m in args.ms:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            t_mm = best_us(lambda: torch.mm(x, low.T))
            t_lin = best_us(lambda: F.linear(x, w16))
            cells = []
            for elements in TILE_ELEMENTS:
                dense.DENSE_TILE_ELEMENTS = int4.NATIVE_BF16_TILE_ELEMENTS = elements
                cells.append(f"{elements >> 20}Mi {best_us(lambda: lin.run_tiles(x)):.0f}")
            t_whole = best_us(lambda: F.linear(x, lin.dequantize().to(torch.bfloat16)))
            dense.DENSE_TILE_ELEMENTS, int4.NATIVE_BF16_TILE_ELEMENTS = default, native_default
            print(f"  M={m:4d}: tile mm {t_mm:.0f} us | F.linear bf16 {t_lin:.0f} us | tiles {' '.join(cells)} us | "
                  f"whole dequant + F.linear {t_whole:.0f} us | kernel {best_us(lambda: lin.run_small_m(x)):.0f} us",
                  flush=True)


if __name__ == "__main__":
    main()
