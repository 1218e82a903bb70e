#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 50 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. cuda_dense_gemv_sweep.py: the 16-bit decode GEMV's cuts, K's chunks unrolled or not (dense_gemv.K_STATIC;
#      CHAIN=1: each GEMV waiting for the one before, as in a decode step);
#   2. the tests named in TESTS (unmarked ones too);  3. cuda_fused_ab.py;
#   4. musecore bench --backend cuda --case targets;  5. the GPU suite to its cap ($SUITE, $SUITE_S);
#   6. benchmarks/serve_bench.py in process;  7. cuda_profile_decode.py (the decode step's kernels).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=1] [TESTS="..."] [SHAPES=small] [AB_MODES=fused,unroll]
#        bash backends/cuda/lab/scripts/s50_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-1}
source "$(dirname "$0")/device_prelude.sh"
step1() {
  timeout $(cap 240) python3 backends/cuda/lab/scripts/cuda_dense_gemv_sweep.py --shapes "${SHAPES:-}" \
    ${CHAIN:+--chain} --out $OUT/cuda_dense_gemv_sweep.json > $OUT/dense_gemv_sweep.log 2>&1
  echo "1. dense GEMV sweep at ${SECONDS}s (rc $?):"; tail -14 $OUT/dense_gemv_sweep.log | cut -c1-160
}
step2() { TESTS_ALL=1 tests_step 2; }
step3() { fused_ab_step 3; }
step4() { targets_step 4; }
step5() { gpu_suite_step 5; }
step6() { serve_step 6; }
step7() { profile_step 7 profile_decode.txt; }
run_steps s50
