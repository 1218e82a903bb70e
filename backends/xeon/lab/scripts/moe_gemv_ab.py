"""A/B of kernel builds at decode sizes: the fused MoE (muse-small: 8 of 64 experts, h = I = 768, T = 1) against one
GEMV streaming the same bytes, INT4 and BF16, and the BF16 / INT4 GEMV alone at given shapes; C called directly
through ctypes (no Python layer above it), weights cold (a pool of ``--pool-mb`` cycled), variants in alternating
rounds so a shared host's drift hits all of them alike; medians of the rounds.

A variant is a ``csrc`` directory (a copy of ``musecore_xeon/csrc``, e.g. the tree at an older commit) with optional
``-D`` macros after a colon: ``/tmp/old_csrc``, ``backends/xeon/musecore_xeon/csrc:BF16_PREFETCH_BYTES=8192``.

    python backends/xeon/lab/scripts/moe_gemv_ab.py moe --variants OLD NEW --threads 1 2 --fmt int4 bf16
    python backends/xeon/lab/scripts/moe_gemv_ab.py gemv --variants OLD NEW --fmt bf16 --shapes 18432x768 3456x1536
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from musecore_xeon.kernels import native

E, H, INTER, TOP_K, GROUP = 64, 768, 768, 8, 128
BUILD_DIR = Path(tempfile.gettempdir()) / "moe_gemv_ab"


def build(variant: str) -> ctypes.CDLL:
    src, _, macros = variant.partition(":")
    flags = native.compile_flags() + [f"-D{m}" for m in macros.split(",") if m]
    BUILD_DIR.mkdir(exist_ok=True)
    so = BUILD_DIR / f"k_{hashlib.md5((str(Path(src).resolve()) + str(flags)).encode()).hexdigest()[:12]}.so"
    subprocess.run([native.compiler(), *flags, "-o", str(so), str(Path(src) / "kernels.c"), "-lm"], check=True)
    return native.declare_signatures(ctypes.CDLL(str(so)))


def int4_weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random nibble-planar codes and fp16 (scale, zero = 8) pairs: the kernels' bytes, values irrelevant here."""
    sz = (torch.rand(n // 4, k // GROUP, 2, 4, generator=gen) * 0.01).half()
    sz[:, :, 1] = 8
    return torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int32, generator=gen), sz


def bf16_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)


def nbytes(w: Any) -> int:
    return sum(t.numel() * t.element_size() for t in w) if isinstance(w, tuple) else w.numel() * w.element_size()


def gemv_call(lib: ctypes.CDLL, fmt: str, w: Any, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    if fmt == "int4":
        codes, sz = w
        lib.musecore_int4_gemv(codes.data_ptr(), sz.data_ptr(), x.data_ptr(), 1, y.data_ptr(), 0, 1, x.shape[1], GROUP,
                               codes.shape[0], codes.shape[0], threads)
    else:
        lib.musecore_bf16_gemv(w.data_ptr(), x.data_ptr(), 1, y.data_ptr(), 0, 1, w.shape[0], x.shape[1], threads)


def rounds(libs: list[ctypes.CDLL], make: Callable[[ctypes.CDLL], Callable[[int], None]], calls: int,
           n_rounds: int) -> list[list[float]]:
    """us per call of each variant, one entry per round (variants alternate within a round)."""
    out: list[list[float]] = [[] for _ in libs]
    for _ in range(n_rounds):
        for i, lib in enumerate(libs):
            f = make(lib)
            for j in range(4):
                f(j)
            t0 = time.perf_counter()
            for j in range(calls):
                f(j)
            out[i].append((time.perf_counter() - t0) / calls * 1e6)
    return out


def moe_mode(args: argparse.Namespace, libs: list[ctypes.CDLL]) -> None:
    gen = torch.Generator().manual_seed(0)
    z, post = torch.randn(1, H).to(torch.bfloat16), torch.ones(H, dtype=torch.bfloat16)
    weights, y_moe, y = torch.full((1, TOP_K), 1 / TOP_K), torch.empty(1, H), torch.empty(1, 3 * INTER * TOP_K)
    ids = [torch.randperm(E, generator=gen)[:TOP_K][None].contiguous() for _ in range(64)]
    for fmt in args.fmt:
        make_w = int4_weight if fmt == "int4" else bf16_weight
        per_expert = nbytes(make_w(2 * INTER, H, gen)) + nbytes(make_w(H, INTER, gen))
        n_layers = max(2, args.pool_mb * 10 ** 6 // (E * per_expert))
        layers = []
        for _ in range(n_layers):
            gu, dn = [make_w(2 * INTER, H, gen) for _ in range(E)], [make_w(H, INTER, gen) for _ in range(E)]
            table = [[w[0].data_ptr() for w in gu], [w[1].data_ptr() for w in gu], [w[0].data_ptr() for w in dn],
                     [w[1].data_ptr() for w in dn]] if fmt == "int4" else [[w.data_ptr() for w in gu],
                                                                          [w.data_ptr() for w in dn]]
            ptr = torch.tensor(table, dtype=torch.int64)
            layers.append((gu, dn, ptr, [ptr.data_ptr() + r * ptr.stride(0) * 8 for r in range(ptr.shape[0])]))
        gemvs = [make_w(TOP_K * 3 * INTER, H, gen) for _ in range(n_layers * E // TOP_K)]
        mb = TOP_K * per_expert / 1e6
        calls = 2 * len(gemvs)
        for threads in args.threads:
            def make_moe(lib: ctypes.CDLL) -> Callable[[int], None]:
                def call(i: int) -> None:
                    rows, idx = layers[i % n_layers][3], ids[i % 64]
                    common = (z.data_ptr(), 1, idx.data_ptr(), weights.data_ptr(), post.data_ptr(), 1, 1e-6,
                              y_moe.data_ptr(), 1, TOP_K, E, H, INTER)
                    status = (lib.musecore_int4_moe(*rows, *common, GROUP, GROUP, 2 * INTER, H, threads) if fmt == "int4"
                              else lib.musecore_bf16_moe(*rows, *common, threads))
                    assert status == 0, status
                return call

            def make_gemv(lib: ctypes.CDLL) -> Callable[[int], None]:
                return lambda i: gemv_call(lib, fmt, gemvs[i % len(gemvs)], z, y, threads)

            moe_us = rounds(libs, make_moe, calls, args.rounds)
            gemv_us = rounds(libs, make_gemv, calls, args.rounds)
            for variant, m, g in zip(args.variants, moe_us, gemv_us):
                mm, gm = statistics.median(m), statistics.median(g)
                print(f"{fmt} threads={threads} {variant}: moe {mm:.1f} us ({mb * 1e3 / mm:.1f} GB/s) | one GEMV "
                      f"{TOP_K * 3 * INTER}x{H} {gm:.1f} us ({mb * 1e3 / gm:.1f} GB/s) | moe/GEMV {mm / gm:.3f}", flush=True)


def gemv_mode(args: argparse.Namespace, libs: list[ctypes.CDLL]) -> None:
    gen = torch.Generator().manual_seed(0)
    for fmt in args.fmt:
        make_w = int4_weight if fmt == "int4" else bf16_weight
        for shape in args.shapes:
            n, k = map(int, shape.split("x"))
            per = nbytes(make_w(n, k, gen))
            pool = [make_w(n, k, gen) for _ in range(max(2, args.pool_mb * 10 ** 6 // per))]
            x, y = torch.randn(1, k).to(torch.bfloat16), torch.empty(1, n)
            for threads in args.threads:
                us = rounds(libs, lambda lib: lambda i: gemv_call(lib, fmt, pool[i % len(pool)], x, y, threads),
                            max(8, 2 * len(pool)), args.rounds)
                print(f"{fmt} {shape} threads={threads} {per / 1e6:.2f} MB: " + " | ".join(
                    f"{v}: {statistics.median(u):.1f} us {per / statistics.median(u) / 1e3:.1f} GB/s"
                    for v, u in zip(args.variants, us)), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("moe", "gemv"))
    p.add_argument("--variants", nargs="+", required=True, help="csrc directories, each with optional :MACRO=V,...")
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--fmt", nargs="+", default=["int4", "bf16"], choices=("int4", "bf16"))
    p.add_argument("--shapes", nargs="+", default=["18432x768", "3456x1536", "1536x1536", "1536x768", "768x1536"])
    p.add_argument("--pool-mb", type=int, default=180, help="weights cycled per variant (cold: above the caches)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    libs = [build(v) for v in args.variants]
    print(f"load average before: {os.getloadavg()}")
    (moe_mode if args.mode == "moe" else gemv_mode)(args, libs)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
