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
step1() {
  timeout $(cap 200) python3 -m pytest -q -p no:cacheprovider -rs $TESTS > $OUT/tests.log 2>&1
  echo "rc=$?" >> $OUT/tests.log
  echo "1. tests at ${SECONDS}s:"; grep -E "passed|failed|FAILED|Error|assert" $OUT/tests.log | tail -12
}
step2() { fused_ab_step 2; }
step3() {
  profile_step 3 profile_decode.txt
  timeout $(cap 90) python3 backends/cuda/lab/scripts/cuda_profile_decode.py --batch 16 --rows 30 > $OUT/profile_decode_b16.txt 2>&1
  echo "3. batch-16 profile at ${SECONDS}s (rc $?):"; grep -E "replay|kernels per step|generate:" $OUT/profile_decode_b16.txt
}
step4() { targets_step 4; }
step5() { gpu_suite_step 5; }
step6() {
  timeout $(cap 150) python3 benchmarks/serve_bench.py --in-process --random-weights --model muse-small \
    --device h200 --checkpoint-format nvfp4 --passes 2 --out $OUT/serve_h200.json > $OUT/serve_bench.log 2>&1
  echo "6. serve bench at ${SECONDS}s (rc $?):"; tail -4 $OUT/serve_bench.log | cut -c1-200
}
run_steps s47
