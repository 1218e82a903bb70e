# Sourced by the lab's device-call scripts (gluon_route_session.sh, s41_session.sh, s42_session.sh): unbuffered Python, `cap N` (a
# step's timeout: N seconds or what is left of $LIMIT, whichever is less), the packages installed from the working
# tree unless SKIP_INSTALL is set (the caller installed them already), and the GPU's name, driver, clock and power
# limit in $OUT/gpu.txt. Needs OUT and LIMIT set. `run_steps TAG` runs step$n for each digit n of $STEPS, in order, then
# packs everything under $OUT into $OUT/TAG.tgz (the device returns the first 8 files by name: past 8, the loose
# logs are removed, the archive keeping them).
# Steps the session scripts share (argument: the step's number, for the log): `targets_step` (musecore bench --case
# targets into $OUT, capped at $TARGETS_S or 170 s), `gpu_suite_step` (the whole GPU suite, or the folders in $SUITE
# in that order, SIGINT at its cap of $SUITE_S or 330 s so pytest still prints the summary, across
# $SUITE_WORKERS processes when set; which tests ran in
# $OUT/gpu_suite.xml),
# `tests_step` (the GPU tests named in $TESTS; with TESTS_ALL=1 the unmarked ones too), `runs_probe_step`
# (cuda_moe_runs_probe.py, at $BATCHES when set),
# `fused_ab_step` (cuda_fused_ab.py, its --modes from $AB_MODES when set, more arguments in $AB_ARGS),
# `capture_probe_step` (cuda_capture_probe.py, more arguments in $CAPTURE_ARGS), `history_probe_step`
# (cuda_history_probe.py, its --sequence from $HISTORY when set, more arguments in $HISTORY_ARGS),
# `profile_step` (the kernels of the decode step, into $OUT/$2), `e2e_step` (bench_e2e alone: muse-small batch 1,
# NVFP4 and BF16, the targets case's decode row, in a fresh process),
# `profile_b16_step` (the same at batch 16), `serve_step` (benchmarks/serve_bench.py in process, muse-small NVFP4),
# `persistent_probe_step` (cuda_persistent_probe.py, more arguments in $PERSISTENT_ARGS), `gemlite_step`
# (musecore bench --case gemlite: the peer on every 816B shape, NVFP4 and MXFP4) and `ncu_misses_step` (ncu of the
# kernels behind each missed target's worst row, as session 41's step 4 did; $NCU_SPECS overrides the list).
export PYTHONUNBUFFERED=1
mkdir -p $OUT  # a sub-folder of the call's $OUT for a second session script in one call
cap() { local left=$((LIMIT - SECONDS - 5)); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
  .whl/stevedore-5.9.1-py3-none-any.whl -e ./quant -e . -e ./backends/triton -e ./backends/cuda -e ./backends/rocm \
  -e ./backends/xeon > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
# The peer (bench_gemlite; the targets case's gemlite rows) when its sdist is carried: `pip download
# gemlite==0.6.0.post2 --no-deps -d .whl` here, and `.whl/gemlite-0.6.0.post2.tar.gz` in the call's carry list.
if [ -z "${SKIP_INSTALL:-}" ] && ls .whl/gemlite-*.tar.gz > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/gemlite-*.tar.gz \
    >> $OUT/install.log 2>&1 || echo "gemlite did not install (its rows will say so): $(tail -2 $OUT/install.log)"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt 2>&1
echo "profilers: nsys $(command -v nsys || echo absent), ncu $(command -v ncu || echo absent)" >> $OUT/gpu.txt
run_steps() {
  for n in $(echo $STEPS | grep -o .); do step$n; done
  echo "done at ${SECONDS}s; load $(cat /proc/loadavg)"
  tar czf /tmp/$1.tgz -C $OUT . && mv /tmp/$1.tgz $OUT/
  # The device returns the first 8 files by name (run 139 lost tests.log and the archive): past 8, the logs go, as the
  # archive holds them.
  for f in $(ls $OUT/*.log 2>/dev/null); do
    [ $(ls $OUT | wc -l) -gt 8 ] || break
    rm -f $f && echo "only in $1.tgz: $(basename $f)"
  done
}
targets_step() {
  timeout $(cap ${TARGETS_S:-170}) musecore bench --backend cuda --case targets --out-dir $OUT \
    > $OUT/bench_targets.txt 2>&1
  echo "$1. bench targets at ${SECONDS}s (rc $?):"; head -14 $OUT/bench_targets.txt | cut -c1-200
}
gpu_suite_step() {
  # SUITE_WORKERS=N: N pytest-xdist processes on the one GPU (the device image has pytest-xdist; most of a Gluon test's
  # time is its kernels' compile on the CPU, as step c's five processes side by side showed)
  timeout -s INT $(cap ${SUITE_S:-330}) python3 -m pytest -q -m gpu -p no:cacheprovider --junitxml=$OUT/gpu_suite.xml \
    ${SUITE_WORKERS:+-n $SUITE_WORKERS} \
    ${SUITE:-backends/cuda/tests backends/cuda/lab/tests backends/triton/tests tests backends/rocm/tests} \
    > $OUT/gpu_suite.log 2>&1
  echo "rc=$?" >> $OUT/gpu_suite.log
  echo "$1. GPU suite at ${SECONDS}s:"; grep -E "passed|failed|FAILED|Error" $OUT/gpu_suite.log | tail -12
}
tests_step() {
  local mark="-m gpu"  # TESTS_ALL=1: every test named, not only those marked gpu (the Triton kernel tests run natively)
  [ -z "${TESTS_ALL:-}" ] || mark=""
  timeout $(cap 200) python3 -m pytest -q -p no:cacheprovider $mark -rs ${TESTS:-backends/triton/tests} > $OUT/tests.log 2>&1
  echo "rc=$?" >> $OUT/tests.log
  echo "$1. tests at ${SECONDS}s:"; grep -E "passed|failed|FAILED|Error|assert" $OUT/tests.log | tail -12
}
fused_ab_step() {
  timeout $(cap 200) python3 backends/cuda/lab/scripts/cuda_fused_ab.py --out $OUT/cuda_fused_ab.json \
    ${AB_MODES:+--modes $AB_MODES} ${AB_ARGS:-} > $OUT/fused_ab.log 2>&1
  echo "$1. fused A/B at ${SECONDS}s (rc $?):"; tail -4 $OUT/fused_ab.log | cut -c1-250
}
capture_probe_step() {
  (cd backends/cuda/lab/scripts && timeout $(cap 200) python3 cuda_capture_probe.py --out $OUT/capture_probe.json \
    ${CAPTURE_ARGS:-} > $OUT/capture_probe.log 2>&1)
  echo "$1. capture probe at ${SECONDS}s (rc $?):"
  grep -v "Warn\|warn_once" $OUT/capture_probe.log | tail -19 | cut -c1-200
}
history_probe_step() {
  (cd backends/cuda/lab/scripts && timeout $(cap 200) python3 cuda_history_probe.py --out $OUT/history_probe.json \
    ${HISTORY:+--sequence $HISTORY} ${HISTORY_ARGS:-} > $OUT/history_probe.log 2>&1)
  echo "$1. history probe at ${SECONDS}s (rc $?):"
  grep -v "Warn\|warn_once" $OUT/history_probe.log | tail -24 | cut -c1-250
}
e2e_step() {
  echo "$1. e2e alone from $(date +%T)"
  timeout $(cap 120) python3 -c 'from musecore_cuda.bench import bench_e2e
import json
for r in bench_e2e(batches=(1,)): print(json.dumps(r))' 2>&1 | grep -v Warn | cut -c1-330
}
profile_step() {
  timeout $(cap 120) python3 backends/cuda/lab/scripts/cuda_profile_decode.py --rows 40 > $OUT/$2 2>&1
  echo "$1. profile at ${SECONDS}s (rc $?):"; grep -E "replay|kernels per step|generate:" $OUT/$2
}
profile_b16_step() {
  timeout $(cap 90) python3 backends/cuda/lab/scripts/cuda_profile_decode.py --batch 16 --rows 30 > $OUT/profile_decode_b16.txt 2>&1
  echo "$1. batch-16 profile at ${SECONDS}s (rc $?):"; grep -E "replay|kernels per step|generate:" $OUT/profile_decode_b16.txt
}
serve_step() {
  timeout $(cap 150) python3 benchmarks/serve_bench.py --in-process --random-weights --model muse-small \
    --device h200 --checkpoint-format nvfp4 --passes 2 --out $OUT/serve_h200.json > $OUT/serve_bench.log 2>&1
  echo "$1. serve bench at ${SECONDS}s (rc $?):"; tail -4 $OUT/serve_bench.log | cut -c1-200
}
runs_probe_step() {
  timeout $(cap ${PROBE_S:-200}) python3 backends/cuda/lab/scripts/cuda_moe_runs_probe.py ${BATCHES:+--batches $BATCHES} \
    --out $OUT/cuda_moe_runs_probe.json > $OUT/moe_runs_probe.log 2>&1
  echo "$1. MoE runs probe at ${SECONDS}s (rc $?):"; tail -12 $OUT/moe_runs_probe.log | cut -c1-250
}
persistent_probe_step() {
  timeout $(cap ${PROBE_S:-200}) python3 backends/cuda/lab/scripts/cuda_persistent_probe.py \
    --out $OUT/cuda_persistent_probe.json ${PERSISTENT_ARGS:-} > $OUT/persistent_probe.log 2>&1
  echo "$1. persistent probe at ${SECONDS}s (rc $?):"; grep -v Warn $OUT/persistent_probe.log | tail -16 | cut -c1-250
}
gemlite_step() {
  timeout $(cap ${GEMLITE_S:-240}) musecore bench --backend cuda --case gemlite --out-dir $OUT \
    > $OUT/bench_gemlite.txt 2>&1
  echo "$1. gemlite at ${SECONDS}s (rc $?):"; grep -v Warn $OUT/bench_gemlite.txt | tail -24 | cut -c1-200
}
# One spec per missed target (run 58's worst row of each): "tag kernel-regex skip count cuda_profile_gemv.py args";
# cuda_profile_gemv.py calls the op 6 times, so skip = 3 calls' worth of matching launches.
NCU_MISSES="k_proj_m8 fp4_gemv 3 1 --shape k_proj --m 8;expert_down_m64 fp4_gluon 3 1 --shape expert_down --m 64;\
k_proj_m256 fp4_gluon 3 1 --shape k_proj --m 256;expert_up_m4096 fp4_dequant|nvjet|xmma 6 2 --shape expert_up --m 4096;\
moe_b1 fp4_gemv 6 2 --moe-batch 1"
# Session 57's question (NCU_SPECS=decode NCU_DETAIL=1): where the decode GEMV's cycles go. Its instructions
# would issue in ~7 us on the H200's 528 schedulers (q_proj M = 1: 512 tiles x 64 chunks x 206), it takes 18.6: so
# per-warp latency with ~4 warps per scheduler, not the issue rate, bounds it. The stall reasons (all of them, not
# only ncu's top hint) and the pipes' utilization say which latency: weight loads (long scoreboard), the shared B
# loads (short scoreboard / MIO), the ALU chain of the upcast (wait / math pipe throttle) or the mma.
NCU_DECODE="q_proj_m1 fp4_gemv 3 1 --shape q_proj --m 1;q_proj_m4 fp4_gemv 3 1 --shape q_proj --m 4;\
moe_b1 fp4_gemv 6 2 --moe-batch 1;moe_b16 fp4_gemv 6 2 --moe-batch 16"
# Session 59's question (NCU_SPECS=gluon NCU_DETAIL=1): why the Gluon GEMM's single consumer warpgroup per SM is
# stalled in 64-76% of cycles at M = 64 (run 71): every stall reason and the pipes, on the worst M = 64 shape and q_proj.
NCU_GLUON="expert_down_m64 fp4_gluon 3 1 --shape expert_down --m 64;q_proj_m64 fp4_gluon 3 1 --shape q_proj --m 64"
ncu_misses_step() {
  local n=$1 spec tag kern skip count args
  local sections="--section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis"
  [ "${NCU_DETAIL:-0}" = 1 ] && sections="$sections --section ComputeWorkloadAnalysis --section InstructionStats \
    --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,\
regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active"
  command -v ncu > /dev/null || { echo "$n. ncu: not installed on this machine"; return; }
  local list=${NCU_SPECS:-$NCU_MISSES}
  [ "$list" = decode ] && list=$NCU_DECODE
  [ "$list" = gluon ] && list=$NCU_GLUON
  IFS=';' read -ra specs <<< "$list"
  for spec in "${specs[@]}"; do
    read -r tag kern skip count args <<< "$spec"
    timeout $(cap ${NCU_S:-60}) ncu --clock-control none -k "regex:$kern" --launch-skip $skip --launch-count $count \
      $sections python3 backends/cuda/lab/scripts/cuda_profile_gemv.py $args > $OUT/ncu_$tag.txt 2>&1
    echo "$n. ncu $tag at ${SECONDS}s (rc $?):"; grep -E "^  [a-z_0-9]+.*\(|Duration|Registers Per|Achieved Occupancy|\
Theoretical Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|DRAM Throughput|Waves Per SM|stalled|pipe_" \
      $OUT/ncu_$tag.txt | cut -c1-160 | head -80
  done
}
