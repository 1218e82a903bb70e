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

``nvidia-smi`` samples SM clock and power every 100 ms beside it (``--smi FILE``); ``--interleave 0`` times the
rows one after the other instead of in interleaved rounds::

    python backends/cuda/lab/scripts/cuda_large_m_probe.py [--ms 4096] [--shapes q_proj,k_proj,expert_down]
        [--out cuda_large_m_probe.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Optional

import torch
import torch.nn.functional as F

import musecore_quant
from musecore_cuda import CudaBackend
from musecore_cuda.backend import fp4_dequant_linear
from musecore_cuda.bench import LINEAR_SHAPES, _rotating, gpu_name, memory_ceiling_gbps, random_fp4, time_calls
from musecore_cuda.kernels import fp4_gemv_cuda


def dense_of(w, os: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W as bf16 times ``os`` (default: its per-tensor scale)."""
    out = torch.empty(w.out_features, w.in_features, dtype=torch.bfloat16, device="cuda")
    os = w.out_scale if os is None else os
    return fp4_gemv_cuda.dequantize(w.packed[0], w.scales[0], os, wfmt=w.wfmt, fold_log2=w.fold_log2,
                                    n=w.out_features, k=w.in_features, out=out)


def unscaled_alpha_linear(x: torch.Tensor, w, alpha: float, ones: torch.Tensor) -> torch.Tensor:
    """The dequant path with the per-tensor scale moved into cuBLAS's alpha (``alpha``: a host float)."""
    return torch.addmm(x.new_zeros(()), x, dense_of(w, ones).t(), beta=0, alpha=alpha)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default="4096")
    p.add_argument("--shapes", default="q_proj,k_proj,expert_down")
    p.add_argument("--out", default="cuda_large_m_probe.json")
    p.add_argument("--smi", default="")
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
                ref = fp4_dequant_linear(x, quantized).float()
                got = unscaled_alpha_linear(x, quantized, alpha_q, ones).float()
                nmse_alpha = float(((got - ref) ** 2).mean() / (ref ** 2).mean())
                times = time_calls(calls, interleave=bool(args.interleave))
                base = times["bf16 randn"]
                row = {"shape": f"{name} {k}->{n}", "M": m, "times_us": {a: round(t, 2) for a, t in times.items()},
                       "vs_bf16_randn": {a: round(base / t, 3) for a, t in times.items()},
                       "nmse_alpha_vs_dequant_path": float(f"{nmse_alpha:.3g}"),
                       "dequantize_pct_ceiling": round(100 * (randcode.nbytes + 2 * n * k) / times["dequantize"]
                                                       / 1e3 / ceiling["ceiling_gbps"], 1)}
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
