#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 41 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. the GPU tests of the changed kernels (backends/cuda/tests/test_cuda_linear.py: the dequantize kernel at
#      one thread per 16-byte quad, since reverted; the Gluon GEMM at two CTAs per SM), test_cuda_moe.py, test_cuda_choices.py;
#   2. cuda_large_m_probe.py: where the dequant path's time goes at M = 4096 and whether weight values change
#      cuBLAS's time (nvidia-smi clocks and power sampled beside it);
#   3. musecore bench --backend cuda --case targets (with the "bound" rows: the NVFP4 bytes at the ceiling);
#   4. ncu of the kernels behind the missed targets: the decode MoE at batch 1 (gate+up+SwiGLU and down GEMVs), the
#      Gluon GEMM at expert_down M=64 and k_proj M=256, the dequantize kernel at q_proj M=4096;
#   5. the whole GPU suite (backends/{triton,cuda,rocm}/tests, backends/cuda/lab/tests, tests);
#   6. the Gluon GEMM at two CTAs per SM (GluonConfig.ctas_per_sm=2: 128 registers per thread at launch):
#      cuda_gluon_sweep.py with GLUON_CTAS=2 (both kinds of cut, the routed one) at M=64, 256;
#   7. split-K by workspace fixup (GluonConfig.fixup: the tile's last split sums the partials; no zeroed output, no
#      atomics, no cast kernel): its GPU tests, then cuda_gluon_sweep.py with GLUON_FIXUP=1 on the split-K shapes
#      (k_proj, pooler, expert_down) at M = 17-256. Written after the session's last device call: not yet run.
# Everything under $OUT is also packed into $OUT/s41.tgz (the device returns only a few files per call).
# Usage (STEPS: which steps, in that order): OUT=out [SKIP_INSTALL=1] [LIMIT=420] [STEPS=123] bash backends/cuda/lab/scripts/s41_session.sh
set -u
LIMIT=${LIMIT:-420}
STEPS=${STEPS:-123}
source "$(dirname "$0")/device_prelude.sh"  # cap, install, gpu.txt
step1() {
  timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_linear.py \
    backends/cuda/tests/test_cuda_moe.py backends/cuda/tests/test_cuda_choices.py > $OUT/tests.log 2>&1
  echo "rc=$?" >> $OUT/tests.log
  echo "1. tests at ${SECONDS}s:"; grep -E "passed|failed|Error|assert" $OUT/tests.log | tail -8
}
step2() {
  for il in 1 0; do
    timeout $(cap ${PROBE_S:-90}) python3 backends/cuda/lab/scripts/cuda_large_m_probe.py --ms ${MS:-4096} \
      --interleave $il --out $OUT/cuda_large_m_probe_il$il.json --smi $OUT/smi_probe_il$il.csv > $OUT/probe_il$il.log 2>&1
    echo "2. large-M probe (interleave $il) at ${SECONDS}s (rc $?):"; cut -c1-700 $OUT/probe_il$il.log | tail -8
  done
}
step3() { targets_step 3; }
step4() {
  SECTIONS="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis"
  for spec in "moe_b1 fp4_gemv 2 --moe-batch 1" "expert_down_m64 fp4_gluon 1 --shape expert_down --m 64" \
              "k_proj_m256 fp4_gluon 1 --shape k_proj --m 256" "q_proj_m4096 fp4_dequant 1 --shape q_proj --m 4096"; do
    set -- $spec; tag=$1 kern=$2 count=$3; shift 3
    timeout $(cap 60) ncu --clock-control none -k regex:$kern --launch-skip 3 --launch-count $count $SECTIONS \
      python3 backends/cuda/lab/scripts/cuda_profile_gemv.py "$@" > $OUT/ncu_$tag.txt 2>&1
    echo "4. ncu $tag at ${SECONDS}s:"; grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue \
Slots Busy|No Eligible|Warp Cycles Per Issued|DRAM Throughput|Compute \(SM\) Throughput|Waves Per SM" $OUT/ncu_$tag.txt | head -24
  done
}
step5() { gpu_suite_step 5; }
step6() {
  MUSECORE_CUDA_GLUON=0 GLUON_CTAS=2 timeout $(cap ${SWEEP_S:-240}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py \
    --ms ${MS:-64,256} --shapes ${SHAPES:-q_proj,k_proj,pooler,expert_up,expert_down} --precompile 12 \
    --out $OUT/cuda_gluon_sweep_2cta.json > $OUT/sweep_2cta.log 2>&1
  echo "6. 2-CTA sweep at ${SECONDS}s (rc $?):"; grep -v "^    " $OUT/sweep_2cta.log | cut -c1-260 | tail -14
}
step7() {
  timeout $(cap 120) python3 -m pytest -q -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_linear.py \
    -k "gluon" > $OUT/fixup_tests.log 2>&1; echo "rc=$?" >> $OUT/fixup_tests.log
  echo "7. gluon tests (fixup included) at ${SECONDS}s:"; grep -E "passed|failed|FAILED|Error|assert" $OUT/fixup_tests.log | tail -8
  MUSECORE_CUDA_GLUON=0 GLUON_FIXUP=1 timeout $(cap ${SWEEP_S:-240}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py \
    --ms ${MS:-17,32,64,128,256} --shapes ${SHAPES:-k_proj,pooler,expert_down} --precompile 12 \
    --out $OUT/cuda_gluon_sweep_fixup.json > $OUT/sweep_fixup.log 2>&1
  echo "7. fixup sweep at ${SECONDS}s (rc $?):"; grep -v "^    " $OUT/sweep_fixup.log | cut -c1-260 | tail -16
}
run_steps s41
