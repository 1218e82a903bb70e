#!/usr/bin/env bash
# Device call (one H200) for issue 26, session 42 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. the GPU tests of what changed: test_cuda_moe.py (the decode MoE's runs of one expert: same bits as one program
#      per assignment, graph replay), the Gluon tests of test_cuda_linear.py (now routed from M=9), test_cuda_choices.py;
#   2. musecore bench --backend cuda --case targets;
#   3. cuda_gluon_sweep.py at M = 8, 12, 16 with MUSECORE_CUDA_GLUON=0 ("now" is the CUDA C++ GEMV / GEMM that M 9-16
#      took before): the evidence for routing M 9-16 to the Gluon GEMM, and whether it also wins at M=8;
#   4. the whole GPU suite (backends/{triton,cuda,rocm}/tests, backends/cuda/lab/tests, tests), SIGINT at its cap;
#   5. cuda_moe_runs_probe.py: the decode MoE with runs vs per assignment vs the grouped GEMM at batch 8-128 (whether
#      use_gemv may take more than E assignments now). Written after the session's last device call: not yet run.
# Everything under $OUT is also packed into $OUT/s42.tgz (run_steps in device_prelude.sh).
# Usage (STEPS: which steps, in that order): OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=1234] bash backends/cuda/lab/scripts/s42_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-1234}
source "$(dirname "$0")/device_prelude.sh"  # cap, install, gpu.txt
step1() {
  timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_moe.py \
    backends/cuda/tests/test_cuda_choices.py "backends/cuda/tests/test_cuda_linear.py::test_fp4_linear_gluon_path_matches_reference_at_816b_shapes" \
    "backends/cuda/tests/test_cuda_linear.py::test_fp4_linear_gluon_path_is_switched_off_by_env_and_skips_mxfp4" \
    "backends/cuda/tests/test_cuda_linear.py::test_fp4_linear_gluon_path_replays_from_a_cuda_graph" > $OUT/tests.log 2>&1
  echo "rc=$?" >> $OUT/tests.log
  echo "1. tests at ${SECONDS}s:"; grep -E "passed|failed|FAILED|Error|assert" $OUT/tests.log | tail -10
}
step2() { targets_step 2; }
step3() {
  MUSECORE_CUDA_GLUON=0 timeout $(cap ${SWEEP_S:-100}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py \
    --ms ${MS:-8,12,16} --shapes ${SHAPES:-q_proj,k_proj,pooler,expert_up,expert_down} --precompile 12 \
    --out $OUT/cuda_gluon_sweep_small_m.json > $OUT/sweep_small_m.log 2>&1
  echo "3. small-M sweep at ${SECONDS}s (rc $?):"; grep -v "^    " $OUT/sweep_small_m.log | cut -c1-230 | tail -16
}
step4() { gpu_suite_step 4; }
step5() {
  timeout $(cap ${PROBE_S:-200}) python3 backends/cuda/lab/scripts/cuda_moe_runs_probe.py \
    --out $OUT/cuda_moe_runs_probe.json > $OUT/moe_runs_probe.log 2>&1
  echo "5. MoE runs probe at ${SECONDS}s (rc $?):"; tail -12 $OUT/moe_runs_probe.log | cut -c1-250
}
run_steps s42
