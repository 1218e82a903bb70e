#!/bin/bash
# Issue 26's table of targets and the h200-fp8 option on one H200, in one device call:
#   GPU tests of the FP8 paths, the FP8 probe, then `musecore bench --backend cuda --case targets`
#   (linear sweep, MoE decode, FP8 vs BF16 at high M), JSON and logs written to $OUT (default ./out).
# Run from the repository root with the wheels in .whl/ (stevedore; the GPU image lacks it).
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/*.whl \
  -e ./quant -e . -e ./backends/triton -e ./backends/cuda -e ./backends/rocm 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"
export PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider backends/cuda/tests/test_cuda_fp8.py \
  backends/cuda/tests/test_cuda_backend.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
timeout 60 python3 backends/cuda/lab/scripts/fp8_probe.py 2>&1 | tee "$OUT/fp8_probe.json"
timeout 420 musecore bench --backend cuda --case targets --out-dir "$OUT" 2>&1 | tee "$OUT/bench_targets.txt" | tail -60
