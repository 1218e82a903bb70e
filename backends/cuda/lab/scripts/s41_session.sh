#!/usr/bin/env bash
# One device call (<= 480 s, one H200) for issue 26, session 41 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. the GPU tests of the changed kernels: backends/cuda/tests/test_cuda_linear.py (the dequantize kernel now one
#      thread per 16-byte quad; GemvPlan.min_blocks) and test_cuda_moe.py;
#   2. cuda_occupancy_sweep.py: the dequantize kernel's bandwidth per 816B shape, then min_blocks for the decode
#      MoE (batch 1-16) and the linears at M = 1, 16 (outputs checked bit for bit): cuda_occupancy_sweep.json;
#   3. musecore bench --backend cuda --case targets (now with the "bound" rows: cuBLAS BF16 on the NVFP4 bytes).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=480] bash backends/cuda/lab/scripts/s41_session.sh
set -u
LIMIT=${LIMIT:-480}
export PYTHONUNBUFFERED=1
cap() { local left=$((LIMIT - SECONDS - 5)); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }  # a step's timeout
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
  .whl/stevedore-5.9.1-py3-none-any.whl -e ./quant -e . -e ./backends/triton -e ./backends/cuda -e ./backends/rocm \
  -e ./backends/xeon > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_linear.py \
  backends/cuda/tests/test_cuda_moe.py > $OUT/tests.log 2>&1; echo "rc=$?" >> $OUT/tests.log
echo "1. tests at ${SECONDS}s:"; grep -E "passed|failed|Error|assert" $OUT/tests.log | tail -8
timeout $(cap ${SWEEP_S:-170}) python3 backends/cuda/lab/scripts/cuda_occupancy_sweep.py --ms ${MS:-1,16} \
  --blocks ${BLOCKS:-1,2,3,4,6} --out $OUT/cuda_occupancy_sweep.json > $OUT/sweep.log 2>&1
echo "2. occupancy sweep at ${SECONDS}s (rc $?):"; cut -c1-200 $OUT/sweep.log | tail -32
timeout $(cap 170) musecore bench --backend cuda --case targets --out-dir $OUT > $OUT/bench_targets.txt 2>&1
echo "3. bench targets at ${SECONDS}s (rc $?):"; head -14 $OUT/bench_targets.txt | cut -c1-200
echo "done at ${SECONDS}s; load $(cat /proc/loadavg)"
