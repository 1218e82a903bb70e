"""The large-M FP4 linear (``fp4_dequant_linear``: dequantize to bf16, then cuBLAS) with its dequantize pipelined in
``pieces`` row blocks on a side stream (block i + 1 dequantized while cuBLAS multiplies block i) against one piece
(the path before) and BF16 cuBLAS on the same values, for the 816B linear shapes at large M. Each row is timed in
interleaved rounds (``bench.time_calls``), weights rotated past L2; every piece count's output is first compared
with one piece's (the same bf16 weight, cuBLAS per column block: equal bits unless cuBLAS picks another kernel for
the narrower GEMM) and with an fp32 product::

    python backends/cuda/lab/scripts/cuda_dequant_pieces_probe.py [--ms 512,1024,4096] [--pieces 1,2,4,8]
        [--shapes q_proj,k_proj,...] [--out cuda_dequant_pieces_probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from musecore_cuda import CudaBackend
from musecore_cuda.backend import fp4_dequant_linear
from musecore_cuda.bench import LINEAR_SHAPES, model_like_weights, time_calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="512,1024,4096")
    p.add_argument("--pieces", default="1,2,4,8")
    p.add_argument("--shapes", default=",".join(LINEAR_SHAPES))
    p.add_argument("--out", default="cuda_dequant_pieces_probe.json")
    args = p.parse_args()
    be = CudaBackend("cuda")
    pieces = [int(c) for c in args.pieces.split(",")]
    rows = []
    for name in args.shapes.split(","):
        n, k = LINEAR_SHAPES[name]
        bf16_ws, fp4 = model_like_weights(be, name, n, k, ("nvfp4",))
        ws = fp4["nvfp4"]
        for m in (int(c) for c in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            one = fp4_dequant_linear(x, ws[0])
            exact = x.float() @ bf16_ws[0].float().t()  # the values the FP4 weight quantizes
            check = {}
            for c in pieces:
                y = fp4_dequant_linear(x, ws[0], pieces=c)
                check[c] = {"equal_to_one_piece": bool(torch.equal(y, one)),
                            "max_abs_vs_one_piece": float((y.float() - one.float()).abs().max()),
                            "rel_err_vs_fp32_bf16_weight": float((y.float() - exact).norm() / exact.norm())}
                if check[c]["rel_err_vs_fp32_bf16_weight"] > 0.2:  # NVFP4's own error is ~0.1 on randn weights
                    raise AssertionError(f"{name} M={m} pieces={c}: {check[c]}")
            calls = {"bf16": (bf16_ws, lambda w: F.linear(x, w))}
            for c in pieces:
                calls[f"pieces{c}"] = (ws, lambda w, c=c: fp4_dequant_linear(x, w, pieces=c))
            times = time_calls(calls, interleave=True)
            row = {"shape": name, "n": n, "k": k, "m": m,
                   **{f"{key}_us": round(t, 2) for key, t in times.items()},
                   **{f"pieces{c}_vs_bf16": round(times["bf16"] / times[f"pieces{c}"], 3) for c in pieces},
                   "checks": check}
            rows.append(row)
            print({key: v for key, v in row.items() if key != "checks"},
                  {c: (v["equal_to_one_piece"], round(v["rel_err_vs_fp32_bf16_weight"], 4)) for c, v in check.items()},
                  flush=True)
        del bf16_ws, fp4, ws
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "command": "cuda_dequant_pieces_probe.py", "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
