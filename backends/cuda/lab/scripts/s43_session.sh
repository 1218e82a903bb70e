#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 43 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. cuda_decode_host_probe.py and cuda_profile_decode.py: where muse-small's generated token spends the time
#      beyond the graph replay, and the replay's kernels;
#   2. cuda_moe_runs_probe.py (session 42's, never run): runs vs per assignment vs the grouped GEMM at batch 8-128;
#   3. musecore bench --backend cuda --case targets;
#   4. the whole GPU suite, SIGINT at its cap;
#   5. the GPU tests of this session's changes (TESTS, pytest node ids or files);
#   6. cuda_fused_ab.py: muse-small batch-1 decode with the fused blocks and with the separate ops, alternated;
#   7. cuda_profile_decode.py: the kernels of the (fused) decode step.
# Everything under $OUT is also packed into $OUT/s43.tgz (run_steps in device_prelude.sh).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=12] [TESTS="..."] bash backends/cuda/lab/scripts/s43_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-12}
source "$(dirname "$0")/device_prelude.sh"  # cap, install, gpu.txt, run_steps, targets_step, gpu_suite_step
step1() {
  timeout $(cap 150) python3 backends/cuda/lab/scripts/cuda_decode_host_probe.py --out $OUT/cuda_decode_host_probe.json \
    --trace /tmp/generate_trace.json > $OUT/host_probe.log 2>&1
  echo "1. host probe at ${SECONDS}s (rc $?):"; grep -v "^  \[" $OUT/host_probe.log | tail -40 | cut -c1-200
  gzip -c /tmp/generate_trace.json > $OUT/generate_trace.json.gz 2>/dev/null
  profile_step 1 profile_decode.txt
}
step2() { runs_probe_step 2; }
step3() { targets_step 3; }
step4() { gpu_suite_step 4; }
step5() { tests_step 5; }
step6() { fused_ab_step 6; }
step7() { profile_step 7 profile_decode_fused.txt; }
run_steps s43
