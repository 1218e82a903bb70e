# Sourced by the lab's device-call scripts (gluon_route_session.sh, s41_session.sh, s42_session.sh): unbuffered Python, `cap N` (a
# step's timeout: N seconds or what is left of $LIMIT, whichever is less), the packages installed from the working
# tree unless SKIP_INSTALL is set (the caller installed them already), and the GPU's name, driver, clock and power
# limit in $OUT/gpu.txt. Needs OUT and LIMIT set. `run_steps TAG` runs step$n for each digit n of $STEPS, in order, then
# packs everything under $OUT into $OUT/TAG.tgz (the device returns only a few files per call).
# Steps both session scripts take (argument: the step's number, for the log): `targets_step` (musecore bench --case
# targets into $OUT) and `gpu_suite_step` (the whole GPU suite, SIGINT at its cap so pytest still prints the summary).
export PYTHONUNBUFFERED=1
cap() { local left=$((LIMIT - SECONDS - 5)); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
  .whl/stevedore-5.9.1-py3-none-any.whl -e ./quant -e . -e ./backends/triton -e ./backends/cuda -e ./backends/rocm \
  -e ./backends/xeon > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt 2>&1
run_steps() {
  for n in $(echo $STEPS | grep -o .); do step$n; done
  echo "done at ${SECONDS}s; load $(cat /proc/loadavg)"
  tar czf /tmp/$1.tgz -C $OUT . && mv /tmp/$1.tgz $OUT/
}
targets_step() {
  timeout $(cap 170) musecore bench --backend cuda --case targets --out-dir $OUT > $OUT/bench_targets.txt 2>&1
  echo "$1. bench targets at ${SECONDS}s (rc $?):"; head -14 $OUT/bench_targets.txt | cut -c1-200
}
gpu_suite_step() {
  timeout -s INT $(cap 330) python3 -m pytest -q -m gpu -p no:cacheprovider backends/cuda/tests \
    backends/cuda/lab/tests backends/triton/tests tests backends/rocm/tests > $OUT/gpu_suite.log 2>&1
  echo "rc=$?" >> $OUT/gpu_suite.log
  echo "$1. GPU suite at ${SECONDS}s:"; grep -E "passed|failed|FAILED|Error" $OUT/gpu_suite.log | tail -12
}
