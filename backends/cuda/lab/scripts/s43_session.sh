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
  timeout $(cap 120) python3 backends/cuda/lab/scripts/cuda_profile_decode.py --rows 40 > $OUT/profile_decode.txt 2>&1
  echo "   profile at ${SECONDS}s (rc $?):"; grep -E "replay|kernels per step|generate:" $OUT/profile_decode.txt
}
step2() {
  timeout $(cap ${PROBE_S:-200}) python3 backends/cuda/lab/scripts/cuda_moe_runs_probe.py \
    --out $OUT/cuda_moe_runs_probe.json > $OUT/moe_runs_probe.log 2>&1
  echo "2. MoE runs probe at ${SECONDS}s (rc $?):"; tail -12 $OUT/moe_runs_probe.log | cut -c1-250
}
step3() { targets_step 3; }
step4() { gpu_suite_step 4; }
step5() {
  timeout $(cap 200) python3 -m pytest -q -p no:cacheprovider -m gpu -rs ${TESTS:-backends/triton/tests} > $OUT/tests.log 2>&1
  echo "rc=$?" >> $OUT/tests.log
  echo "5. tests at ${SECONDS}s:"; grep -E "passed|failed|FAILED|Error|assert" $OUT/tests.log | tail -12
}
step6() {
  timeout $(cap 200) python3 backends/cuda/lab/scripts/cuda_fused_ab.py --out $OUT/cuda_fused_ab.json > $OUT/fused_ab.log 2>&1
  echo "6. fused A/B at ${SECONDS}s (rc $?):"; tail -4 $OUT/fused_ab.log | cut -c1-250
}
step7() {
  timeout $(cap 120) python3 backends/cuda/lab/scripts/cuda_profile_decode.py --rows 40 > $OUT/profile_decode_fused.txt 2>&1
  echo "7. profile at ${SECONDS}s (rc $?):"; grep -E "replay|kernels per step|generate:" $OUT/profile_decode_fused.txt
}
run_steps s43
