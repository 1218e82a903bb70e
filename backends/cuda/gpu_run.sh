#!/usr/bin/env bash
# One batched device call: GPU tests, benchmarks, and (optionally) the tile sweep. Outputs under $OUT.
export PYTHONPATH=.:quant:backends/cuda PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
timeout ${TEST_S:-200} python -m pytest -q --maxfail=8 -p no:cacheprovider backends/cuda/tests 2>&1 | tee "$OUT/tests.log" | tail -25
timeout ${BENCH_S:-280} python benchmarks/cuda_bench.py --cases ${CASES:-linear,moe,attention} --out-dir "$OUT" 2>&1 | tee "$OUT/bench.log"
