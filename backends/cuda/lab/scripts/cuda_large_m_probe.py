"""Where the time of NVFP4 at large M goes (the "dequant" path: dequantize to bf16, then cuBLAS), and whether the
weights' values change cuBLAS's time (a power-limited GPU runs data with fewer toggling bits at higher clocks).
Per 816B shape at M (default 4096), all in one process, timed like ``musecore bench`` (graph replays, weights
rotated past L2)::

    bf16 randn          cuBLAS on the benchmark's BF16 weights (randn, as ``musecore bench`` uses)
    bf16 model-like     cuBLAS on randn * 0.02 (a trained weight's scale)
    bf16 = nvfp4 values cuBLAS on the dequantized NVFP4 quantization of the model-like weights
    bf16 = random codes cuBLAS on the dequantized random-code weight ``musecore bench`` times NVFP4 with
    dequantize          the dequantize kernel alone (random codes), and its bandwidth
    dequant path        fp4_dequant_linear on the random-code weight (what ``musecore bench`` reports)
    dequant path, q     fp4_dequant_linear on the quantized model-like weight
    bf16 = nvfp4 unscaled  cuBLAS on the quantized model-like weight dequantized without its per-tensor scale
                        (code * group scale * 2**-fold: at most 6 significant bits, exact)
    unscaled + alpha    that dequantize, then ``torch.addmm(beta=0, alpha=out_scale)``: cuBLAS applies the
                        per-tensor scale to the fp32 sums (random codes; ", q": the quantized weight)
    chunked /C          (session 64, ``--chunks``) the dequant path in C slices of the output features: each slice
                        dequantized into one reused bf16 scratch (small enough to stay in L2 while cuBLAS reads it)
                        and multiplied straight into its columns of the output (``torch.mm(out=)``, ldc = N)
    chunked /C, 2 streams  the same with two scratch slices: slice c+1 dequantized on a side stream while cuBLAS
                        multiplies slice c (the dequantize's memory traffic under the compute-bound GEMM)
    pieces /C           the control: session 46's pipelining (``cuda_dequant_pieces_probe.py``: every piece
                        dequantized ahead on the side stream into one whole bf16 copy; slower in run 21)
    gluon               the Gluon GEMM at ``pick_config``'s launch for M (``fp4_gluon_linear``), where it runs

``nvidia-smi`` samples SM clock and power every 100 ms beside it (``--smi FILE``); ``--interleave 0`` times the
rows one after the other instead of in interleaved rounds::

    python backends/cuda/lab/scripts/cuda_large_m_probe.py [--ms 4096] [--shapes q_proj,k_proj,expert_down]
        [--chunks 2,4,8] [--rows "bf16 randn,dequant path,chunked,pieces,gluon"] [--out cuda_large_m_probe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Optional

import torch
import torch.nn.functional as F

import musecore_quant
from musecore_cuda import CudaBackend
from musecore_cuda.backend import fp4_dequant_linear, fp4_gluon_linear
from musecore_cuda.bench import LINEAR_SHAPES, _rotating, gpu_name, memory_ceiling_gbps, random_fp4, time_calls
from musecore_cuda.kernels import fp4_gemv_cuda, fp4_gluon_plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_dequant_pieces_probe import _side_stream, dequant_linear_pieces  # noqa: E402  (a lab script beside this)


def dense_of(w, os: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W as bf16 times ``os`` (default: its per-tensor scale)."""
    out = torch.empty(w.out_features, w.in_features, dtype=torch.bfloat16, device="cuda")
    os = w.out_scale if os is None else os
    return fp4_gemv_cuda.dequantize(w.packed[0], w.scales[0], os, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                    n=w.out_features, k=w.in_features, out=out)


def unscaled_alpha_linear(x: torch.Tensor, w, alpha: float, ones: torch.Tensor) -> torch.Tensor:
    """The dequant path with the per-tensor scale moved into cuBLAS's alpha (``alpha``: a host float)."""
    return torch.addmm(x.new_zeros(()), x, dense_of(w, ones).t(), beta=0, alpha=alpha)


def chunked_linear(x: torch.Tensor, w, scratch: list, side: Optional[torch.cuda.Stream]) -> torch.Tensor:
    """``x @ W.T`` in ``len`` slices of W's rows (output features), each dequantized into a scratch slice
    (``scratch``: one or two bf16 [rows, K] tensors) and multiplied into its output columns; with ``side`` (and two
    scratch slices) slice c+1 is dequantized on ``side`` while slice c is multiplied on the current stream."""
    n, k = w.out_features, w.in_features
    rows = scratch[0].shape[0]
    out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device)
    cur = torch.cuda.current_stream()
    if side is not None:
        side.wait_stream(cur)
    done, used = [], []
    for c in range(n // rows):
        part = slice(c * rows, (c + 1) * rows)
        buf = scratch[c % len(scratch)]
        with torch.cuda.stream(side if side is not None else cur):
            if side is not None and c >= len(scratch):
                side.wait_event(used[c - len(scratch)])
            fp4_gemv_cuda.dequantize(w.packed[0][part], w.scales[0][part], w.out_scale, wfmt=w.wfmt,
                                     fold_log2=w.fold_log2, n=rows, k=k, out=buf)
            done.append(torch.cuda.Event())
            done[-1].record()
        cur.wait_event(done[-1])
        torch.mm(x, buf.t(), out=out[:, part])
        used.append(torch.cuda.Event())
        used[-1].record(cur)
    if side is not None:
        cur.wait_stream(side)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="4096")
    p.add_argument("--shapes", default="q_proj,k_proj,expert_down")
    p.add_argument("--out", default="cuda_large_m_probe.json")
    p.add_argument("--smi", default="")
    p.add_argument("--chunks", default="", help="comma list of slice counts C for the chunked rows (empty: none)")
    p.add_argument("--rows", default="",
                   help="comma list of row-label prefixes to time, _ for a space (empty: every row)")
    p.add_argument("--interleave", type=int, default=1, help="1: interleaved rounds (bench.time_us_interleaved); "
                   "0: one after the other, as musecore bench timed every row before session 41")
    args = p.parse_args()
    smi = (subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                             "--format=csv", "-lms", "100"], stdout=open(args.smi, "w"))
           if args.smi else None)
    be = CudaBackend("cuda")
    ceiling = memory_ceiling_gbps()
    rows = []
    try:
        for name in args.shapes.split(","):
            n, k = LINEAR_SHAPES[name]
            model_like = torch.randn(n, k, device="cuda") * 0.02
            quantized = be.prepare_weight(musecore_quant.quantize(model_like, "nvfp4"), name).data
            randcode = be.prepare_weight(random_fp4("nvfp4", (n, k)), name).data
            dense = {"bf16 randn": lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
                     "bf16 model-like": lambda: model_like.to(torch.bfloat16),
                     "bf16 = nvfp4 values": lambda: dense_of(quantized),
                     "bf16 = random codes": lambda: dense_of(randcode),
                     "bf16 = nvfp4 unscaled": lambda: dense_of(quantized, torch.ones(1, device="cuda"))}
            for m in [int(v) for v in args.ms.split(",")]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                calls = {label: (_rotating(make, n * k * 2), lambda w: F.linear(x, w)) for label, make in dense.items()}
                rc = _rotating(lambda: be.prepare_weight(random_fp4("nvfp4", (n, k)), name).data, n * k // 2)
                out = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
                calls["dequantize"] = (rc, lambda w: fp4_gemv_cuda.dequantize(
                    w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt, fold_log2=w.fold_log2, n=n, k=k, out=out))
                calls["dequant path"] = (rc, lambda w: fp4_dequant_linear(x, w))
                calls["dequant path, q"] = ([quantized], lambda w: fp4_dequant_linear(x, w))
                ones = torch.ones(1, device="cuda")
                alpha_rc, alpha_q = float(rc[0].out_scale[0]), float(quantized.out_scale[0])  # (rc: one global scale)
                calls["unscaled + alpha"] = (rc, lambda w: unscaled_alpha_linear(x, w, alpha_rc, ones))
                calls["unscaled + alpha, q"] = ([quantized], lambda w: unscaled_alpha_linear(x, w, alpha_q, ones))
                side = _side_stream(x.device)
                for c in [int(v) for v in args.chunks.split(",") if v]:
                    one = [torch.empty(n // c, k, dtype=torch.bfloat16, device="cuda")]
                    two = one + [torch.empty_like(one[0])]
                    calls[f"chunked /{c}"] = (rc, lambda w, one=one: chunked_linear(x, w, one, None))
                    calls[f"chunked /{c}, 2 streams"] = (rc, lambda w, two=two: chunked_linear(x, w, two, side))
                    calls[f"pieces /{c}"] = (rc, lambda w, c=c: dequant_linear_pieces(x, w, pieces=c))
                if fp4_gluon_plan.available(x.device):
                    calls["gluon"] = (rc, lambda w: fp4_gluon_linear(x, w))
                keep = [r.replace("_", " ") for r in args.rows.split(",") if r]
                calls = {a: c for a, c in calls.items() if not keep or any(a.startswith(r) for r in keep)}
                ref = fp4_dequant_linear(x, quantized).float()
                chunk_err = {}
                for label, (_, fn) in calls.items():
                    if label.startswith(("chunked", "pieces", "gluon")):
                        got = fn(quantized).float()
                        torch.cuda.synchronize()
                        chunk_err[label] = float(((got - ref) ** 2).mean() / (ref ** 2).mean())
                got = unscaled_alpha_linear(x, quantized, alpha_q, ones).float()
                nmse_alpha = float(((got - ref) ** 2).mean() / (ref ** 2).mean())
                times = time_calls(calls, interleave=bool(args.interleave))
                base = times.get("bf16 randn", 1.0)
                row = {"shape": f"{name} {k}->{n}", "M": m, "times_us": {a: round(t, 2) for a, t in times.items()},
                       "vs_bf16_randn": {a: round(base / t, 3) for a, t in times.items()},
                       "nmse_alpha_vs_dequant_path": float(f"{nmse_alpha:.3g}"),
                       "nmse_chunked_vs_dequant_path": {a: float(f"{e:.3g}") for a, e in chunk_err.items()},
                       "dequantize_pct_ceiling": round(100 * (randcode.nbytes + 2 * n * k) / times["dequantize"]
                                                       / 1e3 / ceiling["ceiling_gbps"], 1) if "dequantize" in times
                       else None}
                rows.append(row)
                print(json.dumps(row), flush=True)
                torch.cuda.empty_cache()
    finally:
        if smi:
            smi.terminate()
    with open(args.out, "w") as f:
        json.dump({"meta": {"gpu": gpu_name(), "torch": torch.__version__, **ceiling}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
