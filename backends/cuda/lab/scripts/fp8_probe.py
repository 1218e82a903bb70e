"""What torch's FP8 GEMMs accept on this GPU (lab probe, not part of the package): row-wise scales,
1x128 / 128x128 block scales (DeepSeek style) and the grouped FP8 GEMM, each tried once on a
4096^3 product and timed; prints one JSON object. Decides whether the h200-fp8 plan could use
block-scaled weights (it uses per-tensor weights with per-token activations, row-wise)."""

import json
import sys

import torch

M = N = K = 4096
out = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
a = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
b = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)


def timed(fn):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        fn()
    e.record()
    e.synchronize()
    us = s.elapsed_time(e) * 1e3 / 20
    return {"ok": True, "time_us": round(us, 1), "tflops": round(2 * M * N * K / us / 1e6, 1)}


def attempt(name, fn):
    try:
        out[name] = timed(fn)
    except Exception as exc:  # noqa: BLE001 - the probe reports what fails
        out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}


one = torch.ones((), device="cuda")
attempt("per_tensor", lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
attempt("rowwise", lambda: torch._scaled_mm(a, b.t(), scale_a=torch.ones(M, 1, device="cuda"),
                                            scale_b=torch.ones(1, N, device="cuda"), out_dtype=torch.bfloat16))
attempt("rowwise_fast_accum", lambda: torch._scaled_mm(a, b.t(), scale_a=torch.ones(M, 1, device="cuda"),
                                                       scale_b=torch.ones(1, N, device="cuda"),
                                                       out_dtype=torch.bfloat16, use_fast_accum=True))
attempt("blockwise_1x128_128x128", lambda: torch._scaled_mm(
    a, b.t(), scale_a=torch.ones(K // 128, M, device="cuda").t(), scale_b=torch.ones(N // 128, K // 128, device="cuda").t(),
    out_dtype=torch.bfloat16))
ab, bb = a.bfloat16(), b.bfloat16()
attempt("bf16", lambda: torch.mm(ab, bb.t()))
out["has_scaled_grouped_mm"] = hasattr(torch, "_scaled_grouped_mm")
out["has_F_scaled_mm"] = hasattr(torch.nn.functional, "scaled_mm")
json.dump(out, sys.stdout, indent=1)
print()
