#!/usr/bin/env bash
# GPU call: an ncu profile of a CUDA FP4 kernel (speed of light, warp stalls, occupancy).
#   device run: bash backends/cuda/lab/scripts/cuda_ncu_session.sh [cuda_profile_gemv.py arguments]   (carry: .whl)
#   e.g. `bash backends/cuda/lab/scripts/cuda_ncu_session.sh --m 64 --gemm-plan 2,4,3,1`; output in $OUT/ncu_gemv.txt
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/*.whl \
  -e ./quant -e . -e ./backends/triton -e ./backends/cuda 2>&1 | grep -v -i warning | tail -3
timeout ${NCU_S:-150} ncu --clock-control none -k regex:fp4_gem --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  python3 backends/cuda/lab/scripts/cuda_profile_gemv.py "$@" > "$OUT/ncu_gemv.txt" 2>&1
grep -v "^==PROF==" "$OUT/ncu_gemv.txt" | tail -70
