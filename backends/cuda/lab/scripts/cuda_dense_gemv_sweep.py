"""The Triton 16-bit GEMV (``musecore_triton.kernels.dense_gemv``) against cuBLAS at M = 1, on the dense
projections of a decode step (muse-small and the 816B preset, shapes from ``MuseConfig.from_name``, after the
model's input-projection fusion: q/k/v/gate as one linear; the pooler H->h and unpooler h->H of the MoE; the
dense-MLP layers' gate/up and down where a preset has any; the router is an fp32 product of its own), over its
block sizes and warps. Each configuration is checked against an fp32 product first;
times are CUDA-graph replays with weights rotated past L2 (as ``musecore bench``). Prints a table and
saves JSON; ``DENSE_GEMV_MAX_BYTES`` in the kernel module is read off it::

    python backends/cuda/lab/scripts/cuda_dense_gemv_sweep.py [--shapes small] [--chain] [--out sweep.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from musecore.benchmarking import cycle
from musecore.config import MuseConfig
from musecore.ops import tolerance
from musecore.testing import nmse
from musecore_cuda.bench import _rotating, memory_ceiling_gbps, time_us
from musecore_triton.kernels.dense_gemv import NUM_WARPS, dense_gemv, gemv_blocks

PRESETS = {"small": "muse-small", "816b": "muse-spark-open-816b-a42b"}


def decode_shapes() -> dict[str, tuple[int, int]]:
    """name: (N, K) of each dense projection a decode step runs, per preset."""
    shapes = {}
    for label, preset in PRESETS.items():
        cfg = MuseConfig.from_name(preset)
        H, h = cfg.hidden_size, cfg.moe_hidden_size
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        shapes[f"{label} attn q/k/v/gate"] = (2 * q + 2 * kv, H)
        if label == "816b":
            shapes[f"{label} k_proj"] = (kv, H)  # unfused (a quantized q/k/v/gate that does not stack)
        shapes[f"{label} o_proj"] = (H, q)
        shapes[f"{label} pooler"] = (h, H)
        shapes[f"{label} unpooler"] = (H, h)
        if any(not cfg.is_sparse(i) for i in range(cfg.num_hidden_layers)):
            shapes[f"{label} mlp gate/up"] = (2 * cfg.intermediate_size, H)
            shapes[f"{label} mlp down"] = (H, cfg.intermediate_size)
        if label == "small":
            shapes[f"{label} lm_head"] = (cfg.vocab_size, H)
    return shapes


SHAPES = decode_shapes()
# (BLOCK_N, BLOCK_K, warps, K's chunks unrolled: dense_gemv's K_STATIC, session 50)
CONFIGS = [(bn, bk, nw, u) for bn in (1, 2, 4, 8) for bk in (256, 512, 1024, 2048) for nw in (2, 4)
           for u in (False, True)]


def chained(n: int, k: int):
    """``link(gemv)``: ``gemv`` of the first ``k`` values of a buffer, its ``n`` outputs copied back into the buffer:
    each GEMV of a timed cycle waits for the one before it (through the copy), as a decode step's do. With PDL the
    back-to-back launches of one independent GEMV overlap instead (each one's programs start while the last one's
    finish), which times throughput, not the latency a decode step pays."""
    buf = torch.randn(1, max(n, k), device="cuda", dtype=torch.bfloat16)
    return lambda gemv: buf[:, :n].copy_(gemv(buf[:, :k]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="backends/cuda/lab/results/cuda_dense_gemv_sweep.json")
    p.add_argument("--shapes", default="", help="only the shapes whose name contains this (e.g. 'small')")
    p.add_argument("--chain", action="store_true",
                   help="time each GEMV as a link of a dependent chain (its input copied from the previous one's "
                        "output), as in a decode step, instead of back to back (session 50: the two disagreed)")
    args = p.parse_args()
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    rows = []
    print(f"ceiling {ceiling:.0f} GB/s")
    print(f"{'shape':24} {'MB':>7} {'cuBLAS us':>9} {'auto us':>8} {'auto cfg':>14} {'best us':>8} {'best cfg':>14} "
          f"{'auto/cuBLAS':>11}")
    for name, (n, k) in SHAPES.items():
        if args.shapes not in name:
            continue
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w0 = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
        want = x.float() @ w0.float().T
        ws = _rotating(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, n * k * 2)
        link = chained(n, k) if args.chain else lambda gemv: gemv(x)
        t_cublas = time_us(cycle(ws, lambda w: link(lambda a: F.linear(a, w)))) / len(ws)
        bn0, bk0, ks0 = gemv_blocks(k)
        auto = (bn0, bk0, NUM_WARPS, ks0)
        timed = {}
        for bn, bk, nw, ks in [(bn, bk, nw, k if u else 0) for bn, bk, nw, u in CONFIGS] + [auto]:
            if bn * bk > 16384 or (bn, bk, nw, ks) in timed or (ks and not bk < k <= 16 * bk):
                continue
            got = dense_gemv(x, w0, blocks=(bn, bk, ks), num_warps=nw).float()
            err = nmse(want, got)
            if err > tolerance("linear"):
                raise AssertionError(f"{name} BLOCK_N={bn} BLOCK_K={bk} warps={nw} K_STATIC={ks}: NMSE {err:.2e} > "
                                     f"{tolerance('linear')}")
            timed[(bn, bk, nw, ks)] = time_us(cycle(ws, lambda w, c=(bn, bk, ks), nw=nw: link(
                lambda a: dense_gemv(a, w, blocks=c, num_warps=nw)))) / len(ws)
        best = min(timed, key=timed.get)
        t_auto = timed[auto]
        mb = n * k * 2 / 1e6
        print(f"{name:24} {mb:7.1f} {t_cublas:9.2f} {t_auto:8.2f} {str(auto):>14} {timed[best]:8.2f} "
              f"{str(best):>14} {t_cublas / t_auto:10.2f}x")
        rows.append({"shape": name, "N": n, "K": k, "weight_bytes": n * k * 2, "cublas_us": t_cublas,
                     "auto": list(auto), "auto_us": t_auto, "best": list(best), "best_us": timed[best],
                     "cublas_pct_ceiling": 100 * n * k * 2 / t_cublas / 1e3 / ceiling,
                     "auto_pct_ceiling": 100 * n * k * 2 / t_auto / 1e3 / ceiling,
                     "all": {str(c): t for c, t in timed.items()}})
    with open(args.out, "w") as f:
        json.dump({"ceiling_gbps": ceiling, "chain": args.chain, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
