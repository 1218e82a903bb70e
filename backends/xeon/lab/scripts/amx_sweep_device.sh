#!/usr/bin/env bash
# The AMX GEMM's blocking sweep on the GPU machine's Xeon host, one device call (carry: .whl/stevedore-5.9.1-py3-none-any.whl):
#   bash backends/xeon/lab/scripts/amx_sweep_device.sh     -> $OUT/tests.log, $OUT/amx_blocking_sweep.json, sweep.txt
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} MUSECORE_CACHE=/tmp/musecore-cache MUSECORE_NUM_THREADS=${THREADS:-16}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/stevedore-5.9.1-py3-none-any.whl \
  -e ./quant -e . -e ./backends/xeon 2>&1 | grep -v -i warning | tail -3
lscpu > "$OUT/lscpu.txt" 2>&1
timeout ${TEST_S:-60} python3 -m pytest -q -p no:cacheprovider backends/xeon/tests/test_int4.py -k amx 2>&1 | tail -5 > "$OUT/tests.log"
cat "$OUT/tests.log"
timeout ${SWEEP_S:-200} python3 backends/xeon/lab/scripts/amx_blocking_sweep.py --out "$OUT" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.txt"
