"""Warps per program of the CUDA backend's row kernels (``musecore_cuda.kernels.norms.WARPS``) at decode
shapes: muse-small (H=1536, 16/4 heads) and the 816B preset (H=8192, 80/8 heads), one token and 32.
Each setting is checked against the reference op, then timed as CUDA-graph replays of ``CALLS`` back-to-back
launches (one launch alone is below the replay's own ~10 us overhead); the inputs stay in L2: these kernels are
latency-bound at decode. Prints a table and saves JSON::

    python benchmarks/cuda_norm_warps_sweep.py [--out benchmarks/results/cuda_norm_warps_sweep.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore.testing import nmse
from musecore_cuda.bench import time_us
from musecore_cuda.kernels import norms

SHAPES = {"muse-small": (1536, 16, 4), "816b": (8192, 80, 8)}  # hidden, q heads, kv heads (head dim 128)
WARPS = (1, 2, 4, 8, 16)
CALLS = 64


def cases(hidden: int, nq: int, nkv: int, tokens: int) -> dict:
    d, dev, bf = 128, "cuda", torch.bfloat16
    x, r = (torch.randn(tokens, hidden, device=dev, dtype=bf) for _ in range(2))
    w = [torch.randn(hidden, device=dev, dtype=bf) for _ in range(3)]
    q = torch.randn(1, tokens, nq, d, device=dev, dtype=bf)
    k = torch.randn(1, tokens, nkv, d, device=dev, dtype=bf)
    hw = [torch.randn(d, device=dev, dtype=bf) for _ in range(2)]
    cos, sin = torch.rand(1, tokens, d, device=dev), torch.rand(1, tokens, d, device=dev)
    g = torch.randn(1, tokens, nq, device=dev, dtype=bf)
    return {
        "rms_norm": ((x, w[0], 1e-6), norms.rms_norm, ref.rms_norm),
        "residual_norm": ((x, r, w[0], w[1], w[2], 1e-6), norms.residual_norm, ref.residual_norm),
        "qk_norm_rope": ((q, k, hw[0], hw[1], cos, sin, 1e-6), norms.qk_norm_rope, ref.qk_norm_rope),
        "head_norm_gate": ((q, hw[0], g, 1e-6), norms.head_norm_gate, ref.head_norm_gate),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results/cuda_norm_warps_sweep.json")
    args = p.parse_args()
    rows = []
    for preset, (hidden, nq, nkv) in SHAPES.items():
        for tokens in (1, 32):
            for kernel, (inputs, fn, reference) in cases(hidden, nq, nkv, tokens).items():
                want = reference(*inputs)
                want = want if isinstance(want, tuple) else (want,)
                times = {}
                for warps in WARPS:
                    norms.WARPS[kernel] = warps
                    got = fn(*inputs)
                    for a, b in zip(want, got if isinstance(got, tuple) else (got,)):
                        err = nmse(a.float(), b.float())
                        if err > tolerance(kernel):
                            raise AssertionError(f"{kernel} {preset} T={tokens} warps={warps}: NMSE {err:.2e}")
                    times[warps] = time_us(lambda: [fn(*inputs) for _ in range(CALLS)]) / CALLS
                norms.WARPS[kernel] = None
                best = min(times, key=times.get)
                print(f"{preset:10} T={tokens:<3} {kernel:15} " + "  ".join(f"{w}w {t:5.2f}" for w, t in times.items())
                      + f"   best {best} ({times[4] / times[best]:.2f}x the default 4)")
                rows.append({"preset": preset, "tokens": tokens, "kernel": kernel, "us_by_warps": times, "best": best})
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
