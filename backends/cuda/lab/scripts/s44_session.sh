#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 44 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. cuda_eager_probe.py at batch 1 and 8: where an eager decode step's ~40 ms go (host, syncs, cProfile);
#   2. cuda_moe_runs_probe.py at batch 4-16: where runs of one expert overtake one program per assignment;
#   3. musecore bench --backend cuda --case targets;
#   4. the whole GPU suite, SIGINT at its cap;
#   5. the GPU tests of this session's changes (TESTS, pytest node ids or files);
#   6. cuda_fused_ab.py: muse-small batch-1 decode with the fused blocks and with the separate ops, alternated;
#   7. cuda_profile_decode.py: the kernels of the (fused) decode step;
#   8. benchmarks/serve_bench.py in process (the engine, muse-small NVFP4);
#   9. cuda_merge_ab.py: the split keys' merge kernel against the PyTorch merge, decode at 32-4000 token prompts.
# Everything under $OUT is also packed into $OUT/s44.tgz (run_steps in device_prelude.sh).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=12] [TESTS="..."] bash backends/cuda/lab/scripts/s44_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-12}
source "$(dirname "$0")/device_prelude.sh"  # cap, install, gpu.txt, run_steps, targets_step, gpu_suite_step
step1() {
  for b in ${EAGER_BATCHES:-1 8}; do
    timeout $(cap 150) python3 backends/cuda/lab/scripts/cuda_eager_probe.py --batch $b \
      --out $OUT/cuda_eager_probe_b$b.json > $OUT/eager_probe_b$b.log 2>&1
    echo "1. eager probe batch $b at ${SECONDS}s (rc $?):"; grep -E "cache:|^ +[0-9]+ x" $OUT/eager_probe_b$b.log | head -24 | cut -c1-200
  done
}
step2() { BATCHES=${BATCHES:-4,6,8,12,16} runs_probe_step 2; }
step3() { targets_step 3; }
step4() { gpu_suite_step 4; }
step5() { tests_step 5; }
step6() { fused_ab_step 6; }
step7() { profile_step 7 profile_decode_fused.txt; }
step8() {
  timeout $(cap 240) python3 benchmarks/serve_bench.py --in-process --random-weights --model muse-small --device h200 \
    --checkpoint-format nvfp4 --passes 2 --out $OUT/serve_h200.json > $OUT/serve_bench.log 2>&1
  echo "8. serve bench at ${SECONDS}s (rc $?):"; tail -8 $OUT/serve_bench.log | cut -c1-200
}
step9() {
  timeout $(cap 200) python3 backends/cuda/lab/scripts/cuda_merge_ab.py --out $OUT/cuda_merge_ab.json > $OUT/merge_ab.log 2>&1
  echo "9. merge A/B at ${SECONDS}s (rc $?):"; grep "^prompt" $OUT/merge_ab.log | cut -c1-200
}
run_steps s44
