#!/usr/bin/env bash
# One device call for the Gluon W4A16 GEMM (backends/cuda/lab/NOTES.md, session 11): the lab's GPU tests in the
# background while the sweep's kernels compile, then the timed sweep alone. Results under $OUT.
# Usage: [GLUON_UPCAST=...] OUT=out bash backends/cuda/lab/scripts/gluon_session.sh [MS] [SHAPES]
# (GLUON_UPCAST = packed (default), int16, asm, both, all or a comma list: the upcasts the sweep times, besides the
# routed config per point; the GPU tests always cover all three. The kernel: musecore_cuda/kernels/fp4_gemm_gluon.py)
set -u
MS=${1:-16,64,256,1024,4096}
SHAPES=${2:-q_proj,k_proj,expert_up,expert_down}
LIMIT=${LIMIT:-400}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/stevedore-5.9.1-py3-none-any.whl \
  -e ./quant -e . -e ./backends/triton -e ./backends/cuda > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
# a hang (a barrier never completing) or a wrong result stops the call here, before the sweep
SMOKE="every_code and int16"
case "${GLUON_UPCAST:-packed}" in *packed*|all) SMOKE="every_code and (int16 or packed)";; esac
timeout 90 python3 -m pytest -x -q -p no:cacheprovider -m gpu backends/cuda/lab/tests/test_gluon_w4a16.py \
  -k "$SMOKE" > $OUT/smoke.log 2>&1 || { echo "smoke failed at ${SECONDS}s"; tail -30 $OUT/smoke.log; exit 1; }
echo "smoke passed at ${SECONDS}s"
(timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu backends/cuda/lab/tests/test_gluon_w4a16.py \
   > $OUT/gluon_gpu_tests.log 2>&1; echo "rc=$?" >> $OUT/gluon_gpu_tests.log) &
TESTS=$!
timeout 200 python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py --ms $MS --shapes $SHAPES --precompile 12 \
  --only-precompile > $OUT/precompile.log 2>&1
wait $TESTS
echo "tests+precompile done at ${SECONDS}s"; tail -3 $OUT/gluon_gpu_tests.log; cat $OUT/precompile.log | cut -c1-300
timeout $((LIMIT - SECONDS)) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py --ms $MS --shapes $SHAPES \
  --out $OUT/cuda_gluon_sweep.json 2>&1 | tee $OUT/sweep.log | grep -v "^    skip"
echo "done at ${SECONDS}s; load $(cat /proc/loadavg)"
