#!/usr/bin/env bash
# One device call for the swap-AB GEMM (backends/cuda/lab/NOTES.md, session 10): the GPU suite in the background
# while the sweep's kernels compile, the SM90 TTGIR/PTX of a few cuts, then the timed sweep (after the suite, so
# that the timings run alone). Results under $OUT. Usage: OUT=out bash backends/cuda/lab/scripts/swapab_session.sh [MS] [SHAPES] [SUITE]
set -u
MS=${1:-16,64,256,1024,4096}
SHAPES=${2:-q_proj,k_proj,expert_up,expert_down}
SUITE=${3:-full}
LIMIT=${LIMIT:-560}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/stevedore-5.9.1-py3-none-any.whl \
  -e ./quant -e . -e ./backends/triton -e ./backends/cuda -e ./backends/rocm > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
if [ "$SUITE" = full ]; then
  T="backends/triton/tests backends/cuda/tests backends/cuda/lab/tests backends/rocm/tests tests"
else
  T="$SUITE"
fi
(timeout 340 python3 -m pytest -q -p no:cacheprovider -m gpu $T > $OUT/gpu_suite_full.log 2>&1; echo "rc=$?" >> $OUT/gpu_suite_full.log) &
SUITE_PID=$!
mkdir -p /tmp/ir
python3 backends/cuda/lab/scripts/swapab_ttgir.py --cuts "128,64,4,4;128,64,4,4,1;64,16,4,4;64,16,4,4,1;256,128,3,8,1" --out /tmp/ir > /tmp/ir/summary.txt 2>&1
tar czf $OUT/ir.tgz -C /tmp ir
python3 backends/cuda/lab/scripts/cuda_swapab_sweep.py --ms $MS --shapes $SHAPES --precompile 12 --only-precompile > $OUT/precompile.log 2>&1
wait $SUITE_PID
tail -40 $OUT/gpu_suite_full.log > $OUT/gpu_suite.log
rm $OUT/gpu_suite_full.log
echo "suite done at ${SECONDS}s; $(tail -2 $OUT/gpu_suite.log | head -1)"
cat /tmp/ir/summary.txt | cut -c1-400
timeout $((LIMIT - SECONDS)) python3 backends/cuda/lab/scripts/cuda_swapab_sweep.py --ms $MS --shapes $SHAPES \
  --out $OUT/cuda_swapab_sweep.json 2>&1 | tee $OUT/sweep.log | grep -v "^    skip"
echo "done at ${SECONDS}s; load $(cat /proc/loadavg)"
