#!/usr/bin/env bash
# One batched GPU call: install the packages (no network: carried stevedore wheel), run the GPU tests,
# the native h200 matrix row and the CUDA end-to-end benchmark. Outputs land under $OUT.
#   device run: bash benchmarks/gpu_session.sh   (carry: .whl)
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/*.whl \
  -e ./quant -e . -e ./backends/cuda 2>&1 | grep -v -i warning | tail -3
python3 -m musecore.cli doctor 2>&1 | tail -8
timeout ${TEST_S:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -x backends/cuda/tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout ${MATRIX_S:-120} python3 -m musecore.cli matrix --rows h200 --tokens 4096 --op-sizes '' --json > "$OUT/matrix_h200.json" 2> "$OUT/matrix.err"; tail -3 "$OUT/matrix.err"; cat "$OUT/matrix_h200.json"
timeout ${BENCH_S:-150} python3 -m musecore.cli bench --backend cuda --case e2e --out-dir "$OUT" 2>&1 | tail -20
timeout 60 python3 -m musecore.cli generate --device h200 --prompt "def fibonacci(n):" --max-new-tokens 48 2>&1 | tail -5
