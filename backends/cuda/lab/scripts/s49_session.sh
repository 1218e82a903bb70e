#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 49 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. cuda_decode_host_probe.py: where generate's token time goes beyond the graph replay (events around every
#      greedy replay; the greedy graph alone, with the token's copy between replays, and with the copy inside);
#   2. the tests named in TESTS (unmarked ones too);
#   3. cuda_fused_ab.py;  4. musecore bench --backend cuda --case targets;  5. the GPU suite to its cap;
#   6. benchmarks/serve_bench.py in process;
#   7. cuda_l2_prefetch_ab.py: the next sublayer's dense weights prefetched into L2 on a side stream (A/B);
#   8. dense_gemv_ncu.sh: ncu of the dense decode GEMVs and the router + pooler kernel.
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=1] [TESTS="..."] bash backends/cuda/lab/scripts/s49_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-1}
source "$(dirname "$0")/device_prelude.sh"
step1() {
  timeout $(cap 200) python3 backends/cuda/lab/scripts/cuda_decode_host_probe.py --out $OUT/cuda_decode_host_probe.json \
    > $OUT/host_probe.log 2>&1
  echo "1. host probe at ${SECONDS}s (rc $?):"; grep -v "^  \[" $OUT/host_probe.log | tail -40 | cut -c1-200
}
step2() { TESTS_ALL=1 tests_step 2; }
step3() { fused_ab_step 3; }
step4() { targets_step 4; }
step5() { gpu_suite_step 5; }
step6() { serve_step 6; }
step7() {
  timeout $(cap 240) python3 backends/cuda/lab/scripts/cuda_l2_prefetch_ab.py --out $OUT/cuda_l2_prefetch_ab.json \
    > $OUT/l2_prefetch_ab.log 2>&1
  echo "7. L2 prefetch A/B at ${SECONDS}s (rc $?):"; grep -v "^{" $OUT/l2_prefetch_ab.log | tail -12 | cut -c1-250
}
step8() {
  timeout $(cap 200) bash backends/cuda/lab/scripts/dense_gemv_ncu.sh > $OUT/dense_gemv_ncu.log 2>&1
  echo "8. dense GEMV ncu at ${SECONDS}s (rc $?):"
  grep -E "dense_gemv_kernel|router_pooler_kernel|Duration" $OUT/ncu_dense_gemv.txt | cut -c1-60 | paste - - | head -10
}
run_steps s49
