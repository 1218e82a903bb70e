#!/usr/bin/env bash
# Device call (one H200): why the decode MoE's finalize in the down GEMV's last block of each token measured slower
# (816B layer at batch 1: 144-159 us against 99-101 with the finalize kernel; lab NOTES, sessions 46-47). It applies
# backends/cuda/lab/patches/finalize_in_down_gemv.patch (the reverted code, 3389e50) to this copy of the tree -- the
# device's copy is thrown away after the call -- then:
#   1. cuda_moe_finalize_ab.py (from the patch): graph replays of moe_decode_gemv, finalize in the GEMV or after it;
#   2. ncu of the 816B layer's gate/up and down GEMVs at batch 1, eager, in both modes (speed of light, warp stalls,
#      scheduler, source counters): does the extra time sit in every block (the per-block MEMBAR.ALL.GPU + ticket)
#      or in the last block's two passes?
# Usage: OUT=out bash backends/cuda/lab/scripts/finalize_ncu.sh   (carry: .whl/stevedore-5.9.1-py3-none-any.whl)
set -u
export PYTHONUNBUFFERED=1
PATCH=backends/cuda/lab/patches/finalize_in_down_gemv.patch
if command -v patch > /dev/null; then patch -p1 < $PATCH; else git apply $PATCH; fi > $OUT/patch.log 2>&1 \
  || { cat $OUT/patch.log; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
  .whl/stevedore-5.9.1-py3-none-any.whl -e ./quant -e . -e ./backends/triton -e ./backends/cuda > $OUT/install.log 2>&1 \
  || { tail $OUT/install.log; exit 1; }
timeout 150 python3 backends/cuda/lab/scripts/cuda_moe_finalize_ab.py --rounds 2 --out $OUT/cuda_moe_finalize_ab.json \
  > $OUT/moe_finalize_ab.log 2>&1
echo "1. finalize A/B at ${SECONDS}s:"; cut -c1-110 $OUT/moe_finalize_ab.log | tail -16
cat > /tmp/fin_driver.py <<'PY'
"""moe_decode_gemv on 8 assignments of the 816B expert shape, 6 eager calls; argv[1]: 1 = finalize in the GEMV."""
import sys
import torch
from musecore_cuda import CudaBackend
from musecore_cuda.bench import random_fp4
from musecore_cuda.kernels.moe_decode import moe_decode_gemv
be = CudaBackend("cuda")
fp4 = be.prepare_experts(*(random_fp4("nvfp4", s) for s in ((16, 4096, 4096),) * 3))
z = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
weights, ids = torch.rand(1, 8, device="cuda"), torch.randperm(16, device="cuda")[:8].view(1, 8)
norm = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
for _ in range(6):
    moe_decode_gemv(z, weights, ids, fp4.gate, fp4.up, fp4.down, norm, 1e-8, finalize_in_gemv=sys.argv[1] == "1")
    torch.cuda.synchronize()
PY
for mode in 1 0; do
  timeout 150 ncu --clock-control none -k regex:fp4_gemv_mma --launch-skip 8 --launch-count 2 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    --section SourceCounters python3 /tmp/fin_driver.py $mode > $OUT/ncu_finalize_$mode.txt 2>&1
  echo "2. ncu, finalize in the GEMV = $mode, at ${SECONDS}s:"
  grep -E "fp4_gemv_mma|Duration|Warp Cycles Per Issued|Stall|Achieved Occupancy|Issue Slots Busy" $OUT/ncu_finalize_$mode.txt | head -24
done
