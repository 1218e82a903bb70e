# Sourced by the issue-30 device scripts (issue30_amx_e2e.sh, issue30_amx_profile.sh): installs the carried wheel and
# the repository's packages offline, records lscpu, and sets T (threads for the CPU benchmark, cores 0..T-1), ncpu,
# OUT and start (seconds since the epoch, for the "done at" lines).
T=${THREADS:-12}
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} MUSECORE_CACHE=/tmp/musecore-cache
mkdir -p "$OUT"
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/stevedore-5.9.1-py3-none-any.whl \
  -e ./quant -e . -e ./backends/triton -e ./backends/cuda -e ./backends/rocm -e ./backends/xeon 2>&1 | grep -v -i warning | tail -3
lscpu > "$OUT/lscpu.txt" 2>&1
ncpu=$(nproc)
