"""One NVFP4 decode linear (q_proj 8192->10240, M=1) for a profiler to look at.

    ncu --clock-control none -k regex:fp4_gemv --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy python3 benchmarks/cuda_profile_gemv.py
"""

import torch

from musecore_cuda import CudaBackend
from musecore_cuda.backend import fp4_linear
from musecore_cuda.bench import LINEAR_SHAPES, random_fp4

n, k = LINEAR_SHAPES["q_proj"]
w = CudaBackend("cuda").prepare_weight(random_fp4("nvfp4", (n, k)), "q_proj").data
x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
for _ in range(6):
    fp4_linear(x, w)
torch.cuda.synchronize()
