"""Where the time of a small INT4 linear goes on this CPU: the same call with its weight hot (one copy, called
back to back: in cache) and cold (copies totalling twice the L3, cycled: from DRAM), per thread count, M = 1::

    python3 backends/xeon/lab/scripts/xeon_small_shape_probe.py                         # 1 and 2 threads, muse-small's shapes
    python3 backends/xeon/lab/scripts/xeon_small_shape_probe.py --threads 1 2 4 8 16 --shapes 768x768 4096x4096
    python3 backends/xeon/lab/scripts/xeon_small_shape_probe.py --preset muse-spark-open-816b-a42b

If hot is close to cold, the call is bound by the kernel's own rate and per-call cost, not by memory. On a
many-core host the thread sweep shows from which size each extra thread pays for its share of the fork/join.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from musecore.config import MuseConfig
from musecore_xeon import XeonBackend
from musecore_xeon.bench import clone_int4, random_int4_linear, rotating

CALLS, ROUNDS = 2000, 5


def preset_shapes(preset: str) -> list[str]:
    """``NxK`` (out x in) of a preset's INT4 linears at decode: the experts' gate/up ``[I, h]`` and down ``[h, I]``,
    the pooler ``[h, H]`` and unpooler ``[H, h]`` (h = ``moe_hidden_size``, I = ``moe_intermediate_size``)."""
    cfg = MuseConfig.from_name(preset)
    H, h, inter = cfg.hidden_size, cfg.moe_hidden_size, cfg.moe_intermediate_size
    return list(dict.fromkeys(f"{n}x{k}" for n, k in ((inter, h), (h, inter), (h, H), (H, h))))


def best_us(fn, calls: int) -> float:
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--preset", default="muse-small", help="whose shapes (without --shapes)")
    parser.add_argument("--shapes", nargs="+", default=None, help="NxK (out x in); default: the preset's")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    be, rows = XeonBackend(), []
    for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes or preset_shapes(args.preset)):
        hot = random_int4_linear(be, n, k)
        copies = [hot] + rotating(lambda: clone_int4(hot), hot.nbytes)[1:]
        x = torch.randn(1, k, dtype=torch.bfloat16)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for _ in range(200):
                hot(x)
            t_hot = best_us(lambda: [hot(x) for _ in range(CALLS)], CALLS)
            t_cold = best_us(lambda: [w(x) for w in copies], len(copies))
            rows.append({"shape": f"{n}x{k}", "threads": threads, "hot_us": t_hot, "cold_us": t_cold,
                         "bytes": hot.nbytes, "cold_gbs": hot.nbytes / t_cold / 1e3, "copies": len(copies)})
            print(f"threads {threads:2d} {n}x{k}: hot {t_hot:7.2f} us, cold {t_cold:7.2f} us "
                  f"({hot.nbytes / 1e3:.0f} KB: {hot.nbytes / t_cold / 1e3:.1f} GB/s cold)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
