#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 46 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. the whole GPU suite, SIGINT at its cap;
#   2. cuda_dequant_pieces_probe.py: the large-M dequantize pipelined in pieces on a side stream (at $MS, $PIECES);
#   3. musecore bench --backend cuda --case targets;
#   4. cuda_sort_probe.py (torch.sort against the lab's one-program sort of the MoE assignments) and its lab test;
#   5. the GPU tests named in TESTS;
#   6. benchmarks/serve_bench.py in process (muse-small NVFP4);
#   7. cuda_profile_decode.py at batch 1 and 16.
# Everything under $OUT is also packed into $OUT/s46.tgz (run_steps in device_prelude.sh).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=241] [TESTS="..."] bash backends/cuda/lab/scripts/s46_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-241}
source "$(dirname "$0")/device_prelude.sh"  # cap, install, gpu.txt, run_steps, targets_step, gpu_suite_step
step1() { gpu_suite_step 1; }
step2() {
  timeout $(cap 200) python3 backends/cuda/lab/scripts/cuda_dequant_pieces_probe.py --ms ${MS:-1024,4096} \
    --pieces ${PIECES:-1,2,4,8} ${SHAPES:+--shapes $SHAPES} --out $OUT/cuda_dequant_pieces_probe.json \
    > $OUT/dequant_pieces.log 2>&1
  echo "2. dequantize pieces probe at ${SECONDS}s (rc $?):"; cut -c1-330 $OUT/dequant_pieces.log | tail -30
}
step3() { targets_step 3; }
step4() {
  timeout $(cap 60) python3 -m pytest -q -p no:cacheprovider backends/triton/tests/test_triton_sort.py \
    > $OUT/sort_tests.log 2>&1; echo "4. sort tests at ${SECONDS}s:"; tail -1 $OUT/sort_tests.log
  timeout $(cap 90) python3 backends/cuda/lab/scripts/cuda_sort_probe.py --out $OUT/cuda_sort_probe.json > $OUT/sort_probe.log 2>&1
  echo "4. sort probe at ${SECONDS}s (rc $?):"; cat $OUT/sort_probe.log | cut -c1-160
}
step5() { tests_step 5; }
step6() { serve_step 6; }
step7() {
  profile_step 7 profile_decode.txt
  profile_b16_step 7
}
run_steps s46
