#!/bin/bash
# Issue 26's table of targets and the h200-fp8 option on one H200, in one device call:
#   GPU tests of the FP8 paths, the FP8 probe, `musecore bench --backend cuda --case targets`
#   (linear sweep, MoE decode, FP8 vs BF16 at high M), then, with FULL_FP8=1, `--case fp8` (the FP8
#   option over M and MoE batch sizes). JSON and logs go to $OUT (default ./out).
# Run from the repository root with the stevedore wheel in .whl/ (the GPU image lacks it).
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/*.whl \
  -e ./quant -e . -e ./backends/triton -e ./backends/cuda -e ./backends/rocm 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"
export PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -p no:cacheprovider backends/cuda/tests/test_cuda_fp8.py \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -40
timeout 30 python3 backends/cuda/lab/scripts/fp8_probe.py 2>&1 | tee "$OUT/fp8_probe.json"
timeout 230 musecore bench --backend cuda --case targets --out-dir "$OUT" 2>&1 | tee "$OUT/bench_targets.txt" | tail -30
[ -n "$FULL_FP8" ] && timeout 100 musecore bench --backend cuda --case fp8 --out-dir "$OUT" 2>&1 | tee "$OUT/bench_fp8.txt" | tail -50
