#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 52 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. cuda_capture_probe.py (greedy graphs captured one after another: timed, kernels compared; CAPTURE_ARGS, e.g.
#      "--dump $OUT/dots" for each graph's DOT and its diff to the first's);
#   2. cuda_history_probe.py (--sequence from HISTORY, e.g. fresh,again,pad,pad);
#   3. the tests named in TESTS (unmarked ones too);  4. cuda_fused_ab.py (AB_MODES, AB_ARGS);  5. targets;
#   6. the GPU suite (SUITE, SUITE_S);  7. bench_e2e alone (the targets' muse-small row);
#   since session 53: 8. cuda_persistent_probe.py (PERSISTENT_ARGS);  9. musecore bench --case gemlite (needs
#   .whl/gemlite-0.6.0.post2.tar.gz carried). TARGETS_S caps step 5 (170 s; with the carried gemlite ~330).
#   since session 54: 0. ncu of the kernels behind each missed target's worst row (device_prelude.sh's NCU_MISSES).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=12] [CAPTURE_ARGS=...] [HISTORY=...] [TESTS="..."]
#        [AB_MODES=...] [AB_ARGS="--rounds 6 --pad-mb 16"] bash backends/cuda/lab/scripts/s52_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-12}
source "$(dirname "$0")/device_prelude.sh"
step1() { capture_probe_step 1; }
step2() { history_probe_step 2; }
step3() { TESTS_ALL=1 tests_step 3; }
step4() { fused_ab_step 4; }
step5() { targets_step 5; }
step6() { gpu_suite_step 6; }
step7() { e2e_step 7; }
step8() { persistent_probe_step 8; }
step9() { gemlite_step 9; }
step0() { ncu_misses_step 0; }
run_steps s52
