#!/usr/bin/env bash
# One device call (<= 400 s, one H200) for fp4_linear's "gluon" path (backends/cuda/lab/NOTES.md, session 40), in
# order of importance, each step time-boxed so the later ones cannot starve the earlier ones:
#   1. the path's GPU tests (backends/cuda/tests/test_cuda_linear.py -k gluon), then the whole file's GPU tests;
#   2. the routed launch at every (shape, M) next to BF16 cuBLAS and today's path (MUSECORE_CUDA_GLUON=0 makes
#      "fp4_linear" the path before this one): cuda_gluon_sweep_routed.json;
#   3. musecore bench --backend cuda --case targets (the default path is now gluon at M=64/256; "gluon" also
#      listed beside tiled/dequant/gemm at the other M);
#   4. with the time left, every packed cut of the sweep plus the routed one: cuda_gluon_sweep_cuts.json (each row's
#      "config", the point's "best", and on the routed row "best_config" / "routed_vs_best").
# Usage: OUT=out [SKIP_INSTALL=1] bash backends/cuda/lab/scripts/gluon_route_session.sh [MS]   (SKIP_INSTALL: the
# caller installed the packages already)
set -u
MS=${1:-17,32,64,128,256}
SHAPES=q_proj,k_proj,expert_up,expert_down
LIMIT=${LIMIT:-390}
source "$(dirname "$0")/device_prelude.sh"  # cap, install, gpu.txt
unset MUSECORE_CUDA_GLUON
timeout $(cap 120) python3 -m pytest -q -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_linear.py -k gluon \
  > $OUT/gluon_path_tests.log 2>&1; echo "rc=$?" >> $OUT/gluon_path_tests.log
echo "1. gluon path tests at ${SECONDS}s:"; tail -4 $OUT/gluon_path_tests.log
timeout $(cap 60) python3 -m pytest -q -p no:cacheprovider -m gpu backends/cuda/tests/test_cuda_linear.py -k "not gluon" \
  > $OUT/linear_tests.log 2>&1; echo "rc=$?" >> $OUT/linear_tests.log
echo "1b. other linear GPU tests at ${SECONDS}s:"; tail -2 $OUT/linear_tests.log
MUSECORE_CUDA_GLUON=0 timeout $(cap 120) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py --ms $MS --shapes $SHAPES \
  --routed-only --out $OUT/cuda_gluon_sweep_routed.json > $OUT/sweep_routed.log 2>&1
echo "2. routed sweep at ${SECONDS}s:"; grep -v "^    " $OUT/sweep_routed.log | cut -c1-250 | tail -25
timeout $(cap 150) musecore bench --backend cuda --case targets --out-dir $OUT > $OUT/bench_targets.txt 2>&1
echo "3. bench targets at ${SECONDS}s (rc $?):"; head -14 $OUT/bench_targets.txt | cut -c1-200
LEFT=$((LIMIT - SECONDS))
if [ $LEFT -gt 60 ]; then
  MUSECORE_CUDA_GLUON=0 GLUON_UPCAST=packed timeout $LEFT python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py \
    --ms $MS --shapes $SHAPES --precompile 12 --out $OUT/cuda_gluon_sweep_cuts.json > $OUT/sweep_cuts.log 2>&1
  echo "4. cut sweep at ${SECONDS}s:"; grep -v "^    " $OUT/sweep_cuts.log | cut -c1-250 | tail -22
fi
echo "done at ${SECONDS}s; load $(cat /proc/loadavg)"
