"""The grouped Gluon W4A16 GEMM (``moe_prefill.moe_forward_gluon``, session 59) against the grouped Triton GEMM it
replaced and the BF16 experts, on one full-size 816B MoE layer (NVFP4, E 256, top-8, h = I = 4096), in one process.
Per T: the Triton path (``moe_forward``), the Gluon path at the config ``pick_moe_config`` picks (always, whatever
``--block-ms`` / ``--block-ns`` say) and at every other tile (``--block-ms``, ``--block-ns``), the BF16 experts
through the CUDA backend, (session 64) the backend's default path for the FP4 experts at T, with each row's % of the
memory ceiling over the routed experts' bytes (the MoE decode target's measure), and (session 65, since the grouped
Gluon GEMM takes decode batches) the decode GEMVs themselves up to ``moe_decode.RUNS_MAX_ASSIGNMENTS`` assignments
(``gemv_us``, each cut's ``vs_gemv``). Each Gluon output is checked against the Triton path's (NMSE) before it is
timed, and a cut that fails to compile or run is recorded with its error. It decided the grouped Gluon GEMM's default
(prefill, then decode batches from 4 tokens) and the token tiles the model picks::

    python backends/cuda/lab/scripts/cuda_gluon_moe_probe.py [--tokens 256,1024,4096,8192]
        [--block-ms 16,32,64,128,256] [--block-ns 64,128] [--layer 816b|small] [--out cuda_gluon_moe_probe.json]

``--layer small`` (session 65) runs muse-small's MoE layer (E 64, h = I = 768) instead; ``--align-ab`` times each
cut also with ``align_assignments``' PyTorch ops (before its one-program kernel); ``--cuts`` (session 67) times
literal launches too (``GluonConfig`` labels separated by ``;``: the linear's consumer variants, deeper rings).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from musecore.testing import nmse
from musecore_cuda.bench import time_us
from musecore_cuda.kernels import fp4_gluon_plan, moe_prefill
from musecore_cuda.kernels.moe_decode import RUNS_MAX_ASSIGNMENTS, moe_decode_gemv
from musecore_triton.kernels import moe as triton_moe
from musecore_triton.kernels.moe import moe_forward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_moe_runs_probe import Layer816B, LayerSmall  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="256,1024,4096,8192")
    p.add_argument("--block-ms", default="16,32,64,128,256")
    p.add_argument("--block-ns", default="64,128", help="weight rows per program (128: two consumer warpgroups "
                   "sharing each activation tile, half the L2 reads of 64)")
    p.add_argument("--layer", choices=("816b", "small"), default="816b", help="small: muse-small's MoE layer")
    p.add_argument("--align-ab", action="store_true", help="each cut also with align_assignments' PyTorch ops (the "
                   "path before session 65's one-program kernel): torch_align_us")
    p.add_argument("--cuts", type=lambda v: [c for c in v.split(";") if c], default=[],
                   help="more launches: GluonConfig labels separated by ';' "
                   "(e.g. 128,16,1,8,packed,1,pair,late,ahead2)")
    p.add_argument("--out", default="cuda_gluon_moe_probe.json")
    args = p.parse_args()
    layer = LayerSmall() if args.layer == "small" else Layer816B()
    fp4, norm, E, topk = layer.fp4, layer.norm, layer.experts, layer.topk
    bf16 = layer.be.prepare_experts(*(torch.randn(E, a, b, device="cuda", dtype=torch.bfloat16) * 0.02
                                      for a, b in ((layer.inter, layer.width),) * 2 + ((layer.width, layer.inter),)))
    sms = fp4_gluon_plan.sm_count(torch.cuda.current_device())
    rows = []
    for t in map(int, args.tokens.split(",")):
        z, weights, ids = layer.route(t)
        flops = 2 * t * topk * 3 * layer.width * layer.inter

        def triton_path() -> torch.Tensor:
            return moe_forward(z, weights, ids, fp4.gate, fp4.up, fp4.down, E, norm, 1e-8)
        want = triton_path()
        t_triton = time_us(triton_path, reps=10)
        t_bf16 = time_us(lambda: layer.be.moe(z, weights, ids, bf16, norm, 1e-8), reps=10)
        t_default = time_us(lambda: layer.be.moe(z, weights, ids, fp4, norm, 1e-8), reps=10)
        t_gemv = (time_us(lambda: moe_decode_gemv(z, weights, ids, fp4.gate, fp4.up, fp4.down, norm, 1e-8), reps=10)
                  if t * topk <= RUNS_MAX_ASSIGNMENTS else None)  # the decode GEMVs, whatever the default is
        picked = fp4_gluon_plan.pick_moe_config(t * topk, E, 2 * layer.inter, layer.width, sms)
        row = {"T": t, "assignments": t * topk, "routed_experts": int(ids.unique().numel()),
               "triton_us": round(t_triton, 1), "bf16_experts_us": round(t_bf16, 1),
               "triton_vs_bf16": round(t_bf16 / t_triton, 3), "default_fp4_us": round(t_default, 1),
               "default_pct_ceiling": layer.pct_ceiling(ids, t_default), "picked": picked.label(), "cuts": [],
               "gemv_us": t_gemv and round(t_gemv, 1)}
        tiles = list(itertools.product(map(int, args.block_ns.split(",")), map(int, args.block_ms.split(","))))
        tiles += [] if (picked.block_n, picked.block_m) in tiles else [(picked.block_n, picked.block_m)]  # always timed
        cfgs = [fp4_gluon_plan.GluonConfig(bn, bm, 1, fp4_gluon_plan.ring_stages(bm, bn), upcast="packed")
                for bn, bm in tiles] + [fp4_gluon_plan.GluonConfig.parse(c) for c in args.cuts]
        for cfg in cfgs:
            block_n, block_m = cfg.block_n, cfg.block_m

            def gluon() -> torch.Tensor:
                return moe_prefill.moe_forward_gluon(z, weights, ids, fp4.gate, fp4.up, fp4.down, E, norm, 1e-8,
                                                     cfg=cfg)
            cut = {"config": cfg.label(), "picked": cfg == picked}
            try:
                cut["nmse_vs_triton"] = float(nmse(want, gluon()))
                us = time_us(gluon, reps=10)
                if args.align_ab:
                    moe_prefill.align_assignments = triton_moe._align_torch
                    try:
                        cut["torch_align_us"] = round(time_us(gluon, reps=10), 1)
                    finally:
                        moe_prefill.align_assignments = triton_moe.align_assignments
                cut.update(us=round(us, 1), vs_triton=round(t_triton / us, 3), vs_bf16=round(t_bf16 / us, 3),
                           vs_default=round(t_default / us, 3), vs_gemv=t_gemv and round(t_gemv / us, 3),
                           pct_ceiling=layer.pct_ceiling(ids, us),
                           tflops=round(flops / us / 1e6, 1),
                           predicted_gate_up_us=round(fp4_gluon_plan.predicted_moe_us(
                               t * topk, E, 2 * layer.inter, layer.width, block_m, sms, block_n), 1))
            except Exception as exc:  # a cut that does not compile or run is a result of the probe
                cut["error"] = f"{type(exc).__name__}: {exc}"[:400]
            row["cuts"].append(cut)
            print(json.dumps({"T": t, **cut}), flush=True)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "cuts"}), flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "sms": sms, "layer": args.layer,
                                          "ceiling_gbps": layer.ceiling, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
