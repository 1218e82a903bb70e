#!/usr/bin/env bash
# Device call (one H200), session 49: ncu of the dense 16-bit GEMVs of muse-small's batch-1 decode step (the
# largest share of the step: ~40% at ~25% of the memory ceiling in the profile). Eager decode steps (no graph, no
# PDL: each kernel alone, L2 flushed before each by ncu's default cache control, boost clocks kept), the second
# step's first 6 dense_gemv launches (layer 0-1: the fused q/k/v/gate, o_proj with its residual norm, the unpooler
# with its residual norm) and the router + pooler kernel beside them.
# Usage: OUT=out bash backends/cuda/lab/scripts/dense_gemv_ncu.sh   (carry: .whl/stevedore-5.9.1-py3-none-any.whl)
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
  .whl/stevedore-5.9.1-py3-none-any.whl -e ./quant -e . -e ./backends/triton -e ./backends/cuda > $OUT/install.log 2>&1 \
  || { tail $OUT/install.log; exit 1; }
cat > /tmp/dense_driver.py <<'PY'
"""muse-small NVFP4, a 32-token prefill then 3 eager one-token decode steps (static cache: the fused blocks, no graph)."""
import torch
from musecore.api import load_random
model = load_random("muse-small", "h200", checkpoint_format="nvfp4")
cache = model.new_cache(1, 64, static=True)
model.forward(torch.randint(0, model.config.vocab_size, (1, 32), device="cuda"), cache=cache)
for _ in range(3):
    model.forward(torch.randint(0, model.config.vocab_size, (1, 1), device="cuda"), cache=cache)
    torch.cuda.synchronize()
PY
timeout 400 ncu --clock-control none -k regex:"dense_gemv_kernel|router_pooler_kernel" --launch-skip 68 --launch-count 8 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section MemoryWorkloadAnalysis python3 /tmp/dense_driver.py > $OUT/ncu_dense_gemv.txt 2>&1
echo "ncu at ${SECONDS}s (rc $?):"
grep -E "dense_gemv_kernel|router_pooler_kernel|Duration|DRAM Throughput|Memory Throughput|Grid Size|Waves Per SM|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots Busy|Registers Per" \
  $OUT/ncu_dense_gemv.txt | head -100
