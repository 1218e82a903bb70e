"""The large-M FP4 linear (``fp4_dequant_linear``: dequantize to bf16, then cuBLAS) with its dequantize pipelined in
``pieces`` row blocks on a side stream (block i + 1 dequantized while cuBLAS multiplies block i) against one piece
(the path before) and BF16 cuBLAS on the same values, for the 816B linear shapes at large M. Each row is timed in
interleaved rounds (``bench.time_calls``), weights rotated past L2; every piece count's output is first compared
with one piece's (the same bf16 weight, cuBLAS per column block: equal bits unless cuBLAS picks another kernel for
the narrower GEMM) and with an fp32 product. Measured slower at every piece count (session 46, lab NOTES): cuBLAS's
GEMM leaves no room on the SMs for the dequantize to overlap, so the pieces only add launches and narrower GEMMs::

    python backends/cuda/lab/scripts/cuda_dequant_pieces_probe.py [--ms 512,1024,4096] [--pieces 1,2,4,8]
        [--shapes q_proj,k_proj,...] [--out cuda_dequant_pieces_probe.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from musecore_cuda import CudaBackend
from musecore_cuda.kernels import fp4_gemv_cuda
from musecore_cuda.bench import LINEAR_SHAPES, model_like_weights, time_calls


def dequant_linear_pieces(x2: torch.Tensor, w, pieces: int = 1) -> torch.Tensor:
    """``fp4_dequant_linear`` (W dequantized to a transient bf16 copy, then cuBLAS); with ``pieces`` > 1 the output
    columns are cut into that many row blocks of W: block i + 1 is dequantized on a side stream while cuBLAS
    multiplies block i (each GEMM writes its column block of the output in place), so only the first block's
    dequantization would be exposed. Graph capture sees the side stream as a fork joined by events."""
    n, k = w.out_features, w.in_features
    dense = torch.empty(n, k, dtype=torch.bfloat16, device=x2.device)
    bounds = _piece_bounds(n, pieces)
    if len(bounds) == 1:
        fp4_gemv_cuda.dequantize(w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2, n=n,
                                 k=k, out=dense)
        return F.linear(x2, dense)
    out = torch.empty(x2.shape[0], n, dtype=x2.dtype, device=x2.device)
    main, side = torch.cuda.current_stream(x2.device), _side_stream(x2.device)
    side.wait_stream(main)  # dense's memory may still be read by work queued before this call
    ready = []
    with torch.cuda.stream(side):
        for a, b in bounds:
            fp4_gemv_cuda.dequantize(w.packed[0][a:b], w.scales[0][a:b], w.out_scale, wfmt=w.wfmt,
                                     fold_log2=w.fold_log2, n=b - a, k=k, out=dense[a:b])
            ready.append(torch.cuda.Event())
            ready[-1].record(side)
    for (a, b), event in zip(bounds, ready):
        main.wait_event(event)
        torch.mm(x2, dense[a:b].t(), out=out[:, a:b])
    return out


PIECE_ROWS = 128  # a piece of the pipelined dequantize holds whole 128-row blocks (cuBLAS's tile height)


def _piece_bounds(n: int, pieces: int) -> list[tuple[int, int]]:
    """Row ranges [a, b) of ``pieces`` near-equal blocks of ``n`` rows in whole :data:`PIECE_ROWS` (one range when
    ``n`` has too few blocks to cut)."""
    blocks = n // PIECE_ROWS
    pieces = max(1, min(pieces, blocks)) if n % PIECE_ROWS == 0 else 1
    edges = [PIECE_ROWS * (blocks * i // pieces) for i in range(pieces)] + [n]
    return list(zip(edges[:-1], edges[1:]))


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for the pipelined dequantize (made once: streams are not freed)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


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
            one = dequant_linear_pieces(x, ws[0])
            exact = x.float() @ bf16_ws[0].float().t()  # the values the FP4 weight quantizes
            check = {}
            for c in pieces:
                y = dequant_linear_pieces(x, ws[0], pieces=c)
                check[c] = {"equal_to_one_piece": bool(torch.equal(y, one)),
                            "max_abs_vs_one_piece": float((y.float() - one.float()).abs().max()),
                            "rel_err_vs_fp32_bf16_weight": float((y.float() - exact).norm() / exact.norm())}
                if check[c]["rel_err_vs_fp32_bf16_weight"] > 0.2:  # NVFP4's own error is ~0.1 on randn weights
                    raise AssertionError(f"{name} M={m} pieces={c}: {check[c]}")
            calls = {"bf16": (bf16_ws, lambda w: F.linear(x, w))}
            for c in pieces:
                calls[f"pieces{c}"] = (ws, lambda w, c=c: dequant_linear_pieces(x, w, pieces=c))
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
