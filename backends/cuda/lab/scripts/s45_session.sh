#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 45 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. the whole GPU suite, SIGINT at its cap;
#   2. benchmarks/serve_bench.py in process (muse-small NVFP4) with the engine's look-ahead, then without it;
#   3. musecore bench --backend cuda --case targets;
#   4. cuda_profile_decode.py with PDL off (each kernel's own time, no overlap) and on;
#   5. the GPU tests named in TESTS;
#   6. cuda_handoff_ab.py: the decode MoE's hand-off on and off (816B layer at batch 1-16, muse-small decode);
#   7. cuda_dense_gemv_sweep.py on muse-small's dense projections, and the kernels of a batch-16 decode step;
#   8. cuda_sort_probe.py (torch.sort against the lab's one-program sort of the MoE assignments) and its lab test.
# Everything under $OUT is also packed into $OUT/s45.tgz (run_steps in device_prelude.sh).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=12] [TESTS="..."] bash backends/cuda/lab/scripts/s45_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-12}
source "$(dirname "$0")/device_prelude.sh"  # cap, install, gpu.txt, run_steps, targets_step, gpu_suite_step
step1() { gpu_suite_step 1; }
step2() {
  for mode in ${MODES:-on off}; do
    flag=$([ $mode = off ] && echo --no-lookahead)
    timeout $(cap 150) python3 benchmarks/serve_bench.py --in-process --random-weights --model muse-small \
      --device h200 --checkpoint-format nvfp4 --passes 2 $flag --out $OUT/serve_h200_lookahead_$mode.json \
      > $OUT/serve_bench_$mode.log 2>&1
    echo "2. serve bench, look-ahead $mode, at ${SECONDS}s (rc $?):"; tail -4 $OUT/serve_bench_$mode.log | cut -c1-200
  done
}
step3() { targets_step 3; }
step4() {
  MUSECORE_CUDA_PDL=0 profile_step 4 profile_decode_pdl_off.txt
  profile_step 4 profile_decode.txt
}
step5() { tests_step 5; }
step6() {
  timeout $(cap 200) python3 backends/cuda/lab/scripts/cuda_handoff_ab.py --out $OUT/cuda_handoff_ab.json > $OUT/handoff_ab.log 2>&1
  echo "6. hand-off A/B at ${SECONDS}s (rc $?):"; grep -E "816B|median|Error|error" $OUT/handoff_ab.log | cut -c1-220
}
step7() {
  timeout $(cap 150) python3 backends/cuda/lab/scripts/cuda_dense_gemv_sweep.py --shapes small \
    --out $OUT/cuda_dense_gemv_sweep_small.json > $OUT/dense_sweep.log 2>&1
  echo "7. dense GEMV sweep at ${SECONDS}s (rc $?):"; cat $OUT/dense_sweep.log | cut -c1-160
  timeout $(cap 90) python3 backends/cuda/lab/scripts/cuda_profile_decode.py --batch 16 --rows 30 > $OUT/profile_decode_b16.txt 2>&1
  echo "7. batch-16 profile at ${SECONDS}s (rc $?):"; grep -E "replay|kernels per step|generate:" $OUT/profile_decode_b16.txt
}
step8() {
  timeout $(cap 60) python3 -m pytest -q -p no:cacheprovider backends/triton/tests/test_triton_sort.py \
    > $OUT/sort_tests.log 2>&1; echo "8. sort tests at ${SECONDS}s:"; tail -1 $OUT/sort_tests.log
  timeout $(cap 90) python3 backends/cuda/lab/scripts/cuda_sort_probe.py --out $OUT/cuda_sort_probe.json > $OUT/sort_probe.log 2>&1
  echo "8. sort probe at ${SECONDS}s (rc $?):"; cat $OUT/sort_probe.log | cut -c1-160
}
run_steps s45
