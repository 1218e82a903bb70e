#!/usr/bin/env bash
# Issue 30 on the GPU machine's Xeon host (AMX + AVX512_BF16), one device call: the AVX512_BF16 GEMM's tests (it
# compiles there), the linear table (INT4 vs PyTorch BF16, M = 1..256, 816B + muse-small shapes; the INT4 dense path
# is AMX or the AVX512_BF16 GEMM, whichever measured faster at load) and, time permitting, muse-small prefill.
#   device run: bash backends/xeon/lab/scripts/issue30_device.sh   (carry: .whl/stevedore-5.9.1-py3-none-any.whl)
# Outputs in $OUT: tests.log, linear.json / linear.txt, prefill.json / prefill.txt, lscpu.txt.
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} MUSECORE_CACHE=/tmp/musecore-cache MUSECORE_NUM_THREADS=${THREADS:-16}
mkdir -p "$OUT"
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/stevedore-5.9.1-py3-none-any.whl \
  -e ./quant -e . -e ./backends/xeon 2>&1 | grep -v -i warning | tail -3
lscpu > "$OUT/lscpu.txt" 2>&1
timeout ${TEST_S:-40} python3 -m pytest -q -p no:cacheprovider backends/xeon/tests/test_bf16dot.py 2>&1 | tail -3 > "$OUT/tests.log"
cat "$OUT/tests.log"
echo "setup+tests $(( $(date +%s) - start )) s"
timeout ${LINEAR_S:-110} python3 backends/xeon/lab/scripts/issue30_tables.py linear --out "$OUT" ${SHAPES:+--shapes $SHAPES} \
  > "$OUT/linear.txt" 2>&1
tail -14 "$OUT/linear.txt"
echo "linear done at $(( $(date +%s) - start )) s"
[ -n "${SKIP_PREFILL:-}" ] || timeout ${PREFILL_S:-60} python3 backends/xeon/lab/scripts/issue30_tables.py prefill --out "$OUT" \
  > "$OUT/prefill.txt" 2>&1; tail -5 "$OUT/prefill.txt"
echo "all done at $(( $(date +%s) - start )) s"
