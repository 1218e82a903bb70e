# Sourced by the lab's device-call scripts (gluon_route_session.sh, s41_session.sh, s42_session.sh): unbuffered Python, `cap N` (a
# step's timeout: N seconds or what is left of $LIMIT, whichever is less), the packages installed from the working
# tree unless SKIP_INSTALL is set (the caller installed them already), and the GPU's name, driver, clock and power
# limit in $OUT/gpu.txt. Needs OUT and LIMIT set. `run_steps TAG` runs step$n for each digit n of $STEPS, in order, then
# packs everything under $OUT into $OUT/TAG.tgz (the device returns only a few files per call).
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
