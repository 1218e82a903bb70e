#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 47 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. the tests named in TESTS, on the GPU (not only those marked gpu: the Triton kernel tests run natively);
#   2. cuda_fused_ab.py: fused blocks / the router and pooler apart / separate ops (muse-small batch-1 decode);
#   3. cuda_profile_decode.py at batch 1 and 16;
#   4. musecore bench --backend cuda --case targets;
#   5. the whole GPU suite, SIGINT at its cap;
#   6. benchmarks/serve_bench.py in process (muse-small NVFP4).
# (Step 7 of calls 3-4, cuda_moe_finalize_ab.py, went with the finalize in the down GEMV: git show 3389e50.)
# Everything under $OUT is also packed into $OUT/s47.tgz (run_steps in device_prelude.sh).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=123] [TESTS="..."] bash backends/cuda/lab/scripts/s47_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-123}
TESTS=${TESTS:-"backends/cuda/tests/test_cuda_fused.py backends/cuda/tests/test_cuda_moe.py
  backends/triton/tests/test_triton_elementwise.py backends/triton/tests/test_triton_gemm.py"}
source "$(dirname "$0")/device_prelude.sh"  # cap, install, gpu.txt, run_steps, targets_step, gpu_suite_step
step1() { TESTS_ALL=1 tests_step 1; }
step2() { fused_ab_step 2; }
step3() {
  profile_step 3 profile_decode.txt
  profile_b16_step 3
}
step4() { targets_step 4; }
step5() { gpu_suite_step 5; }
step6() { serve_step 6; }
run_steps s47
