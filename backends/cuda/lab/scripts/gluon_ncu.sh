#!/usr/bin/env bash
# GPU call: ncu of the Gluon W4A16 GEMM (speed of light, warp states, occupancy, launch) at one cut per argument.
# Usage: OUT=out bash backends/cuda/lab/scripts/gluon_ncu.sh SHAPE M CUT [CUT...]   (CUT = block_n,block_m,split_k,stages[,upcast]; packed by default)
set -u
export PYTHONUNBUFFERED=1
SHAPE=$1; M=$2; shift 2
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/stevedore-5.9.1-py3-none-any.whl \
  -e ./quant -e . -e ./backends/triton -e ./backends/cuda > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
for CUT in "$@"; do
  F=$OUT/ncu_gluon_${SHAPE}_m${M}_${CUT//,/_}.txt
  timeout 120 ncu --clock-control none -k regex:fp4_gluon --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py --ms $M --shapes $SHAPE --profile-cut $CUT > $F 2>&1
  echo "== $CUT"; grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Memory Throughput|DRAM Throughput|Compute \(SM\)|Stall|Waves|Shared Memory Configuration Size|Dynamic Shared" $F | head -30
done
echo "done at ${SECONDS}s"
