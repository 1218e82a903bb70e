#!/usr/bin/env bash
# GPU call for the decode GEMV work: linear/MoE GPU tests, the decode-kernel sweep (SWEEP_MS), then the linear
# (decode M), MoE and e2e benchmarks (CASES).
#   device run: bash benchmarks/cuda_gemv_session.sh   (carry: .whl)
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/*.whl \
  -e ./quant -e . -e ./backends/cuda 2>&1 | grep -v -i warning | tail -3
[ "${TEST_S:-150}" = 0 ] || timeout ${TEST_S:-150} python3 -m pytest -q -m gpu -p no:cacheprovider -x backends/cuda/tests/test_cuda_linear.py \
  backends/cuda/tests/test_cuda_moe.py 2>&1 | tee "$OUT/gpu_tests_gemv.log" | tail -8
[ -z "${SWEEP_MS:-}" ] || timeout ${SWEEP_S:-240} python3 benchmarks/cuda_gemv_sweep.py --ms "$SWEEP_MS" \
  --out "$OUT/cuda_gemv_sweep.json" 2>&1 | tee "$OUT/sweep.txt" | tail -40
for case in ${CASES:-linear moe e2e}; do
  timeout ${BENCH_S:-200} python3 benchmarks/cuda_bench.py --cases $case --ms ${MS:-1,2,4,8,16,64} --out-dir "$OUT" \
    > "$OUT/$case.txt" 2>&1; tail -${TAIL:-60} "$OUT/$case.txt"
done
