"""Cuts of the FP4 decode MoE (``moe_decode_gemv``: gate+up+SwiGLU, down, then the finalize with the shared
scale-first post-expert norm) against the plans ``make_plan`` picks, with the 16-bit expert decode path
(``moe_decode_dense``) on BF16 experts of the same shape beside them, at batch 1. The layers are the presets'
(``MuseConfig.from_name``): experts ``gate/up [E, I, h]``, ``down [E, h, I]`` with h = ``moe_hidden_size``
(the pooler's width) and I = ``moe_intermediate_size``: muse-small 64 experts top-8, 768x768 (6 128-wide K
chunks each way, so ``make_plan`` does not split them and a step runs few warps; this measures whether
splitting helps); the 816B preset 256 experts top-8, 4096x4096. Tokens are routed by the sigmoid router with
its correction bias (``router_topk`` over the hidden width). Every cut is checked against the default plan's
output first. Weights rotate past L2::

    python backends/cuda/lab/scripts/cuda_moe_decode_cuts.py [--layers muse-small,816b]
        [--out backends/cuda/lab/results/cuda_moe_decode_cuts.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from musecore.benchmarking import cycle
from musecore.config import MuseConfig
from musecore.testing import nmse
from musecore_cuda import CudaBackend
from musecore_cuda.bench import _rotating, memory_ceiling_gbps, random_fp4, time_us
from musecore_triton.kernels.fp4_gemm import CHUNK_K
from musecore_cuda.kernels.fp4_gemv_cuda import GemvPlan, make_plan
from musecore_cuda.kernels.moe_decode import moe_decode_gemv
from musecore_triton.kernels.moe import moe_decode_dense

LAYERS = {"muse-small": "muse-small", "816b": "muse-spark-open-816b-a42b"}  # --layers name: preset


def cuts(k: int) -> list[GemvPlan]:
    chunks = k // CHUNK_K
    return [GemvPlan("mma", 1, 1, split_k=s, k_warps=kw, prefetch=pf) for s in (1, 2, 4) for kw in (1, 2, 4)
            for pf in (1, 2) if chunks % (s * kw) == 0 and chunks // (s * kw) >= pf]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="backends/cuda/lab/results/cuda_moe_decode_cuts.json")
    p.add_argument("--layers", default="muse-small,816b")
    args = p.parse_args()
    ceiling = memory_ceiling_gbps()["ceiling_gbps"]
    be = CudaBackend("cuda")
    rows = []
    for name in args.layers.split(","):
        cfg = MuseConfig.from_name(LAYERS[name])
        E, topk, H = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size
        width, inter, post_eps = cfg.moe_hidden_size, cfg.moe_intermediate_size, cfg.post_norm_eps
        make = lambda: be.prepare_experts(*(random_fp4("nvfp4", (E, *s))  # noqa: E731
                                            for s in ((inter, width), (inter, width), (width, inter))))
        stacks = _rotating(make, E * 3 * inter * width // 2)
        dense = _rotating(lambda: be.prepare_experts(*(torch.randn(E, *s, device="cuda", dtype=torch.bfloat16) * 0.02
                                                       for s in ((inter, width), (inter, width), (width, inter)))),
                          E * 3 * inter * width * 2)
        norm = (1 + 0.1 * torch.randn(width, device="cuda")).to(torch.bfloat16)  # the shared post-expert norm [h]
        z = torch.randn(1, width, device="cuda", dtype=torch.bfloat16)
        router = torch.randn(E, H, device="cuda") * H ** -0.5  # fp32, as the checkpoint keeps it
        bias = torch.randn(E, device="cuda") * 0.01
        weights, ids = be.router_topk(torch.randn(1, H, device="cuda", dtype=torch.bfloat16), router, bias, topk,
                                      cfg.output_multiplier, cfg.routed_scaling_factor)
        routed = topk * 3 * inter * width
        fp4_bytes, bf16_bytes = routed * 4.5 / 8, routed * 2

        def fp4(plans=None):
            return cycle(stacks, lambda w: moe_decode_gemv(z, weights, ids, w.gate, w.up, w.down, norm, post_eps,
                                                           plans))

        want = moe_decode_gemv(z, weights, ids, stacks[0].gate, stacks[0].up, stacks[0].down, norm, post_eps)
        t_default = time_us(fp4()) / len(stacks)
        t_dense = time_us(cycle(dense, lambda w: moe_decode_dense(z, weights, ids, w.gate, w.up, w.down, norm,
                                                                   post_eps))) / len(dense)
        default = (make_plan(1, inter, width, z.dtype, z.device, programs=topk, swiglu=True),
                   make_plan(1, width, inter, z.dtype, z.device, programs=topk))
        print(f"{name}: default {default[0]} / {default[1]}: {t_default:.2f} us "
              f"({100 * fp4_bytes / t_default / 1e3 / ceiling:.0f}% of {ceiling:.0f} GB/s); "
              f"BF16 experts through moe_decode_dense {t_dense:.2f} us")
        timed = []
        for up_plan in cuts(width):
            for down_plan in cuts(inter):
                got = moe_decode_gemv(z, weights, ids, stacks[0].gate, stacks[0].up, stacks[0].down, norm, post_eps,
                                      (up_plan, down_plan))
                err = nmse(want, got)
                if err > 1e-5:
                    raise AssertionError(f"{name} cut {up_plan} / {down_plan}: NMSE {err:.2e} against the default")
                timed.append((time_us(fp4((up_plan, down_plan))) / len(stacks), up_plan, down_plan))
        timed.sort(key=lambda r: r[0])
        for t, u, d in timed[:5]:
            print(f"  {t:7.2f} us  up (split {u.split_k}, k_warps {u.k_warps}, prefetch {u.prefetch})  "
                  f"down (split {d.split_k}, k_warps {d.k_warps}, prefetch {d.prefetch})")
        rows.append({"layer": name, "preset": LAYERS[name], "E": E, "topk": topk, "hidden": H, "width": width,
                     "inter": inter, "ceiling_gbps": ceiling,
                     "default_us": t_default, "default": [str(p) for p in default], "bf16_dense_us": t_dense,
                     "fp4_routed_bytes": fp4_bytes, "bf16_routed_bytes": bf16_bytes,
                     "cuts": [{"us": t, "up": str(u), "down": str(d)} for t, u, d in timed]})
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
