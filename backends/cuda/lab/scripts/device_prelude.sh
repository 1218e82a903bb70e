# Sourced by the lab's device-call scripts (gluon_route_session.sh, s41_session.sh): unbuffered Python, `cap N` (a
# step's timeout: N seconds or what is left of $LIMIT, whichever is less), the packages installed from the working
# tree unless SKIP_INSTALL is set (the caller installed them already), and the GPU's name, driver, clock and power
# limit in $OUT/gpu.txt. Needs OUT and LIMIT set.
export PYTHONUNBUFFERED=1
cap() { local left=$((LIMIT - SECONDS - 5)); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 )); }
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
  .whl/stevedore-5.9.1-py3-none-any.whl -e ./quant -e . -e ./backends/triton -e ./backends/cuda -e ./backends/rocm \
  -e ./backends/xeon > $OUT/install.log 2>&1 || { tail $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $OUT/gpu.txt 2>&1
