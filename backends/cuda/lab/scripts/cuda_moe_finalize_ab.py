"""A/B of the decode MoE's finalize: in the down GEMV's last block of each token (``fp4_gemv_cuda.Finalize``) against
the Triton finalize kernel after it (``moe_decode_gemv(finalize_in_gemv=False)``), in one process, alternated rounds
of CUDA-graph replays (``musecore_cuda.bench.time_us``). Shapes: the 816B MoE layer (E 256, 4096 x 4096, top-8) at
batches 1-3 and muse-small's experts (E 64, 768 x 768, top-8) at batch 1::

    python backends/cuda/lab/scripts/cuda_moe_finalize_ab.py [--rounds 3] [--out cuda_moe_finalize_ab.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from musecore_cuda import CudaBackend
from musecore_cuda.bench import gpu_name, random_fp4, time_us
from musecore_cuda.kernels.moe_decode import moe_decode_gemv

CASES = (("816B", 256, 4096, 4096, 8, (1, 2, 3)), ("muse-small", 64, 768, 768, 8, (1,)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="cuda_moe_finalize_ab.json")
    args = p.parse_args()
    be = CudaBackend("cuda")
    rows = []
    for name, experts, width, inter, topk, batches in CASES:
        fp4 = be.prepare_experts(random_fp4("nvfp4", (experts, inter, width)),
                                 random_fp4("nvfp4", (experts, inter, width)),
                                 random_fp4("nvfp4", (experts, width, inter)))
        norm = torch.ones(width, device="cuda", dtype=torch.bfloat16)
        for t in batches:
            z = torch.randn(t, width, device="cuda", dtype=torch.bfloat16)
            weights = torch.rand(t, topk, device="cuda")
            ids = torch.stack([torch.randperm(experts, device="cuda")[:topk] for _ in range(t)])
            for r in range(args.rounds):
                for in_gemv in (True, False):
                    us = time_us(lambda: moe_decode_gemv(z, weights, ids, fp4.gate, fp4.up, fp4.down, norm, 1e-8,
                                                         finalize_in_gemv=in_gemv), reps=20)
                    row = {"case": name, "tokens": t, "round": r, "finalize": "gemv" if in_gemv else "kernel",
                           "time_us": round(us, 2)}
                    print(row)
                    rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"gpu": gpu_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
