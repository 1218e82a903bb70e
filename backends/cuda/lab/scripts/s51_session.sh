#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 51 (backends/cuda/lab/NOTES.md), each step time-boxed; nvidia-smi
# samples the SM clock, power and temperature every 200 ms into $OUT/smi.csv throughout:
#   1. cuda_decode_host_probe.py in a fresh process (replay, sampling, the work around each replay, the timeline);
#   2. bench_e2e alone (muse-small batch 1, fresh process);  3. bench_fp8 as the targets case runs it, then bench_e2e
#      (is the targets row's muse-small decode slower after the power-bound GEMMs?);
#   4. the tests named in TESTS (unmarked ones too);  5. cuda_fused_ab.py;  6. targets;  7. the GPU suite;
#   8. cuda_history_probe.py (the same model's decode after a BF16 model, a reload, a profiler session);
#   9. cuda_capture_probe.py (greedy graphs captured one after another: timed, then their kernels compared).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=123] [TESTS="..."] [AB_MODES=...]
#        [AB_ARGS="--rounds 6 --pad-mb 16"]
#        bash backends/cuda/lab/scripts/s51_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-123}
source "$(dirname "$0")/device_prelude.sh"
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 > $OUT/smi.csv 2>&1 &
E2E='from musecore_cuda.bench import bench_e2e, bench_fp8
import json, sys, time
if sys.argv[1] == "heat":
    t = time.time(); bench_fp8(ms=(256, 4096), moe_tokens=(1, 256, 8192)); print("fp8", time.time() - t)
for r in bench_e2e(batches=(1,)): print(time.strftime("%H:%M:%S"), json.dumps(r))'
step1() {
  timeout $(cap 120) python3 backends/cuda/lab/scripts/cuda_decode_host_probe.py --out $OUT/host_probe.json \
    > $OUT/host_probe.log 2>&1
  echo "1. host probe at ${SECONDS}s (rc $?):"; tail -5 $OUT/host_probe.log | cut -c1-200
}
step2() {
  echo "2. e2e alone from $(date +%T)"; timeout $(cap 120) python3 -c "$E2E" cold 2>&1 | grep -v Warn | cut -c1-330
}
step3() {
  echo "3. fp8 then e2e from $(date +%T)"; timeout $(cap 200) python3 -c "$E2E" heat 2>&1 | grep -v Warn | cut -c1-330
}
step4() { TESTS_ALL=1 tests_step 4; }
step5() { fused_ab_step 5; }
step6() { targets_step 6; }
step7() { gpu_suite_step 7; }
step8() { history_probe_step 8; }
step9() { capture_probe_step 9; }
run_steps s51
