#!/usr/bin/env bash
# One short GPU call after the architecture change (issue 20): the CUDA end-to-end tests on the retrained
# muse-tiny, then the kernel benchmarks whose shapes changed (816B: q/gate/o 8192x8192, k/v 8192->1024,
# pooler/unpooler 8192<->4096, experts h = I = 4096; attention 128/16 heads x 64), each under a time cap.
#   device run: bash backends/cuda/lab/scripts/cuda_arch_check.sh   (carry: .whl, holding stevedore and transformers wheels)
# Outputs under $OUT: cuda_e2e_tests.log, cuda_{linear,moe,attention}.json, cuda_bench.txt.
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/*.whl \
  -e ./quant -e . -e ./backends/triton -e ./backends/cuda 2>&1 | grep -v -i warning | tail -3
timeout ${TEST_S:-90} python3 -m pytest -q -m gpu -p no:cacheprovider backends/cuda/tests/test_cuda_e2e.py 2>&1 \
  | tee "$OUT/cuda_e2e_tests.log" | tail -3
timeout ${BENCH_S:-80} python3 backends/cuda/lab/scripts/cuda_bench.py --cases moe --out-dir "$OUT" >> "$OUT/cuda_bench.txt" 2>&1
timeout ${BENCH_S:-80} python3 backends/cuda/lab/scripts/cuda_bench.py --cases linear --ms ${MS:-1,16,256} --out-dir "$OUT" \
  >> "$OUT/cuda_bench.txt" 2>&1
timeout ${ATTN_S:-40} python3 backends/cuda/lab/scripts/cuda_bench.py --cases attention --out-dir "$OUT" >> "$OUT/cuda_bench.txt" 2>&1
cat "$OUT/cuda_bench.txt" | cut -c1-220
