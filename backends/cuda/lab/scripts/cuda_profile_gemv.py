"""One NVFP4 linear (q_proj 8192->8192 of the 816B preset) at ``--m`` tokens for a profiler to look at, through
the path ``fp4_linear`` picks or, with ``--gemm-plan``, through the tiled CUDA GEMM cut so (``--wgmma-plan``: the
wgmma GEMM); with ``--moe-batch B`` the 816B MoE layer at decode batch B instead (its shapes from
``MuseConfig.from_name``: 256 experts top-8, h = I = 4096, routed by the sigmoid router with its correction bias).

    ncu --clock-control none -k regex:fp4_gem --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy python3 backends/cuda/lab/scripts/cuda_profile_gemv.py
"""

import argparse
import sys
from pathlib import Path

import torch

from musecore.config import MuseConfig
from musecore_cuda import CudaBackend
from musecore_cuda.backend import fp4_linear
from musecore_cuda.bench import LINEAR_SHAPES, random_fp4, seeded_moe_batch, seeded_router
from musecore_cuda.kernels import fp4_gemm_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # backends/cuda/lab: the wgmma GEMM
import fp4_gemm_wgmma  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--m", type=int, default=1)
parser.add_argument("--shape", default="q_proj", choices=list(LINEAR_SHAPES))
parser.add_argument("--gemm-plan", help="tile,split,stages,prefetch of fp4_gemm_cuda.GemmPlan")
parser.add_argument("--wgmma-plan", help="tokens,split,prefetch,stages,groups of fp4_gemm_wgmma.WgmmaPlan")
parser.add_argument("--moe-batch", type=int, help="instead: the 816B MoE layer (NVFP4) at this decode batch")
args = parser.parse_args()

n, k = LINEAR_SHAPES[args.shape]
if args.moe_batch:  # the MoE rows of `musecore bench`: the same seeded inputs, so the same experts as the targets
    cfg = MuseConfig.from_name("muse-spark-open-816b-a42b")
    E, topk, H = cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size
    width, inter = cfg.moe_hidden_size, cfg.moe_intermediate_size
    be = CudaBackend("cuda")
    experts = be.prepare_experts(*(random_fp4("nvfp4", (E, *shape)) for shape in ((inter, width), (inter, width),
                                                                                   (width, inter))))
    _, weights, ids, z = seeded_moe_batch(be.router_topk, seeded_router(E, H, "cuda"), args.moe_batch, topk, width)
    print(f"MoE batch {args.moe_batch}: {int(ids.unique().numel())} distinct experts", flush=True)
    norm = torch.ones(width, device="cuda", dtype=torch.bfloat16)
    call = lambda: be.moe(z, weights, ids, experts, norm, 1e-8)  # noqa: E731 (the bench's post-norm eps)
else:
    w = CudaBackend("cuda").prepare_weight(random_fp4("nvfp4", (n, k)), args.shape).data
    x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)
    call = lambda: fp4_linear(x, w)  # noqa: E731
    if args.wgmma_plan:
        tokens, split, prefetch, stages, groups = (int(v) for v in args.wgmma_plan.split(","))
        plan = fp4_gemm_wgmma.WgmmaPlan(tokens=tokens, split=split, prefetch=prefetch, stages=stages, groups=groups)
        call = lambda: fp4_gemm_wgmma.launch(x, w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt,  # noqa: E731
                                             fold_log2=w.fold_log2, n=n, k=k, out=out, plan=plan)
    elif args.gemm_plan:
        tile, split, stages, prefetch = (int(v) for v in args.gemm_plan.split(","))
        plan = fp4_gemm_cuda.GemmPlan(groups=min(8, -(-args.m // 8)), tile=tile, split=split, stages=stages,
                                      prefetch=prefetch)
        call = lambda: fp4_gemm_cuda.launch(x, w.packed[0], w.scales[0], w.out_scale, wfmt=w.wfmt,  # noqa: E731
                                            fold_log2=w.fold_log2, n=n, k=k, out=out, plan=plan)
for _ in range(6):
    call()
torch.cuda.synchronize()
