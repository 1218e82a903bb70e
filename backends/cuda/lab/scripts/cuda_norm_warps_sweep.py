"""Warps per program of the CUDA backend's row kernels (``musecore_triton.kernels.norms.WARPS``) at decode
shapes of the presets (``MuseConfig.from_name``: muse-small H=1536, 24/3 heads x 64; the 816B preset H=8192,
128/16 heads x 64, pooler width h=4096), one token and 32, on the real model's calls: the weighted ``rms_norm``
(input norms; the pooler's norm at width h), the gated ``residual_norm`` after attention (weightless post norm)
and after the MoE (scale-first post norm), ``qk_norm_rope`` on a RoPE layer and a NoPE layer, and the element-wise
``head_norm_gate``. Each setting is checked against the reference op, then timed as CUDA-graph replays of
``CALLS`` back-to-back launches (one launch alone is below the replay's own ~10 us overhead); the inputs stay in
L2: these kernels are latency-bound at decode. Prints a table and saves JSON::

    python backends/cuda/lab/scripts/cuda_norm_warps_sweep.py [--presets muse-small,muse-spark-open-816b-a42b]
        [--out backends/cuda/lab/results/cuda_norm_warps_sweep.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from musecore.config import MuseConfig
from musecore.ops import reference as ref
from musecore.ops import tolerance
from musecore.testing import nmse
from musecore_cuda.bench import time_us
from musecore_triton.kernels import norms

PRESETS = ("muse-small", "muse-spark-open-816b-a42b")
WARPS = (1, 2, 4, 8, 16)
CALLS = 64


def cases(cfg: MuseConfig, tokens: int, dev: str = "cuda") -> list[tuple]:
    """``(case, kernel, inputs, fn, reference)`` for each call of a decode step's row kernels at ``cfg``'s shapes."""
    H, h, nq, nkv, d = (cfg.hidden_size, cfg.moe_hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                        cfg.head_dim)
    eps, post_eps, bf = cfg.rms_norm_eps, cfg.post_norm_eps, torch.bfloat16
    x, r = (torch.randn(tokens, H, device=dev, dtype=bf) for _ in range(2))
    w = [(1 + 0.1 * torch.randn(H, device=dev)).to(bf) for _ in range(2)]  # centred norms: 1 + w folded in
    z = torch.randn(tokens, h, device=dev, dtype=bf)
    wh = (1 + 0.1 * torch.randn(h, device=dev)).to(bf)
    alpha, beta = ref.residual_gate_coefficients(torch.randn(H, device=dev), cfg.residual_gate_temperature)
    q = torch.randn(1, tokens, nq, d, device=dev, dtype=bf)
    k = torch.randn(1, tokens, nkv, d, device=dev, dtype=bf)
    angle = torch.rand(1, tokens, d // 2, device=dev) * 6.28
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)  # HF rotate_half tables [1,T,d]
    g = torch.randn(1, tokens, nq, d, device=dev, dtype=bf)  # one gate logit per output element
    q_scale = cfg.qk_scale_factor
    return [
        ("rms_norm", "rms_norm", (x, w[0], eps), norms.rms_norm, ref.rms_norm),
        ("rms_norm pooler h", "rms_norm", (z, wh, eps), norms.rms_norm, ref.rms_norm),
        ("residual_norm attn", "residual_norm", (x, r, None, alpha, beta, w[1], post_eps, eps),
         norms.residual_norm, ref.residual_norm),
        ("residual_norm mlp", "residual_norm", (x, r, w[0], alpha, beta, w[1], post_eps, eps),
         norms.residual_norm, ref.residual_norm),
        ("qk_norm_rope", "qk_norm_rope", (q, k, cos, sin, eps, q_scale), norms.qk_norm_rope, ref.qk_norm_rope),
        ("qk_norm nope", "qk_norm_rope", (q, k, None, None, eps, q_scale), norms.qk_norm_rope, ref.qk_norm_rope),
        ("head_norm_gate", "head_norm_gate", (q, g, eps), norms.head_norm_gate, ref.head_norm_gate),
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--out", default="backends/cuda/lab/results/cuda_norm_warps_sweep.json")
    args = p.parse_args()
    shipped = dict(norms.WARPS)  # None: Triton's default of 4 warps
    rows = []
    for preset in args.presets.split(","):
        cfg = MuseConfig.from_name(preset)
        for tokens in (1, 32):
            for case, kernel, inputs, fn, reference in cases(cfg, tokens):
                want = reference(*inputs)
                want = want if isinstance(want, tuple) else (want,)
                times = {}
                try:
                    for warps in WARPS:
                        norms.WARPS[kernel] = warps
                        got = fn(*inputs)
                        for a, b in zip(want, got if isinstance(got, tuple) else (got,)):
                            err = nmse(a.float(), b.float())
                            if err > tolerance(kernel):
                                raise AssertionError(f"{case} {preset} T={tokens} warps={warps}: NMSE {err:.2e}")
                        times[warps] = time_us(lambda: [fn(*inputs) for _ in range(CALLS)]) / CALLS
                finally:
                    norms.WARPS[kernel] = shipped[kernel]
                best = min(times, key=times.get)
                default = shipped[kernel] or 4
                print(f"{preset:25} T={tokens:<3} {case:18} " + "  ".join(f"{w}w {t:5.2f}" for w, t in times.items())
                      + f"   best {best} ({times[default] / times[best]:.2f}x the shipped {default})", flush=True)
                rows.append({"preset": preset, "tokens": tokens, "case": case, "kernel": kernel,
                             "hidden": cfg.hidden_size, "pooler_width": cfg.moe_hidden_size,
                             "heads": [cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim],
                             "us_by_warps": times, "best": best, "shipped": default})
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)

if __name__ == "__main__":
    main()
