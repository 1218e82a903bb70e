"""The portable dot_scaled MXFP4 kernels on an NVIDIA GPU through Triton's CUDA target, at the 816B shapes.

This checks numerics at scale on the one GPU machine reachable (an H200: SM90 has no FP4 MMA, so
``tl.dot_scaled`` is emulated by an upcast there), not AMD speed. Prints JSON rows: shape, M, mode,
NMSE against musecore's reference (the same MXFP4 weights, the emulated activation rule), whether the
quantized activations equal ``musecore_quant``'s bit for bit, and the kernel time next to BF16 cuBLAS
(an SM90 emulation time, recorded only to see that nothing is pathological).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

import musecore_quant
from musecore.ops import Weight
from musecore.ops import reference as ref
from musecore.testing import nmse
from musecore_triton.kernels.mx_gemm import mxfp4_linear, mxfp4_quantize_activation

SHAPES = {"q_proj": (8192, 8192), "k_proj": (1024, 8192), "pooler": (4096, 8192), "expert_gate_up": (8192, 4096),
          "expert_down": (4096, 4096)}


def time_us(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") * k ** -0.5
        qt = musecore_quant.quantize(w, "mxfp4")
        dense = musecore_quant.dequantize(qt)
        w_bf16 = dense.to(torch.bfloat16)
        for m in (1, 16, 256, 1024):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            packed, scales = mxfp4_quantize_activation(x)
            expected = musecore_quant.quantize(x.float(), "mxfp4")
            bits_equal = bool(torch.equal(packed, expected.data) and torch.equal(scales, expected.scale))
            t_bf16 = time_us(lambda: F.linear(x, w_bf16))
            for act in ("mxfp4", None):
                y = mxfp4_linear(x, qt.data, qt.scale, quantize_activations=act == "mxfp4")
                want = ref.linear(x, Weight(dense, "mxfp4", n, k, act_format=act))
                t = time_us(lambda: mxfp4_linear(x, qt.data, qt.scale, quantize_activations=act == "mxfp4"))
                rows.append({"shape": f"{name} {n}x{k}", "M": m, "mode": "W4A4" if act else "W4A16",
                             "nmse": nmse(want.float(), y.float()), "act_bits_equal": bits_equal,
                             "time_us": round(t, 2), "bf16_cublas_us": round(t_bf16, 2)})
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": __import__("triton").__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
