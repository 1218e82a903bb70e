#!/usr/bin/env bash
# One GPU call for the committed CUDA results: the whole GPU test suite, then every `musecore bench`
# case (linear over the full M sweep, MoE, attention, e2e), the native h200 matrix row and a generate.
#   device run: bash backends/cuda/lab/scripts/cuda_final_session.sh   (carry: .whl)
# Outputs: $OUT/cuda_results.tgz (one archive: the device tool returns at most 8 files; unpack it into
# benchmarks/results/) holding cuda_gpu_tests.log, cuda_{linear,moe,attention,e2e}.json,
# cuda_bench.txt (the tables), matrix_h200_native.json, cuda_gemm_sweep.json (the tiled GEMM's cuts),
# cuda_wgmma_sweep.json (the wgmma GEMM's cuts), cuda_dense_gemv_sweep.json, cuda_moe_decode_cuts.json, cuda_norm_warps_sweep.json, cuda_profile_decode_nvfp4_b1.txt.
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/*.whl \
  -e ./quant -e . -e ./backends/triton -e ./backends/cuda 2>&1 | grep -v -i warning | tail -3
timeout ${TEST_S:-240} python3 -m pytest -q -m gpu -p no:cacheprovider backends/cuda/tests 2>&1 \
  | tee "$OUT/cuda_gpu_tests.log" | tail -3
for case in linear moe e2e attention; do
  timeout ${BENCH_S:-150} python3 backends/cuda/lab/scripts/cuda_bench.py --cases $case --ms ${MS:-1,2,4,8,16,32,64,128,256,1024,4096} \
    --out-dir "$OUT" >> "$OUT/cuda_bench.txt" 2>&1
done
grep -A12 "== moe\|== e2e" "$OUT/cuda_bench.txt"
timeout ${SWEEP_S:-150} python3 backends/cuda/lab/scripts/cuda_gemm_sweep.py --ms 16,32,64,128 \
  --shapes q_proj,k_proj,o_proj,expert_down,expert_up --out "$OUT/cuda_gemm_sweep.json" 2>&1 | cut -c1-200
timeout ${SWEEP_S:-150} python3 backends/cuda/lab/scripts/cuda_wgmma_sweep.py --ms 64,128,256 \
  --shapes q_proj,expert_down,k_proj --out "$OUT/cuda_wgmma_sweep.json" 2>&1 | grep -v "^    best cut" | cut -c1-200
timeout ${SWEEP_S:-150} python3 backends/cuda/lab/scripts/cuda_dense_gemv_sweep.py --out "$OUT/cuda_dense_gemv_sweep.json" 2>&1 | tail -11
timeout ${SWEEP_S:-150} python3 backends/cuda/lab/scripts/cuda_moe_decode_cuts.py --layers muse-small \
  --out "$OUT/cuda_moe_decode_cuts.json" 2>&1 | head -3
timeout 90 python3 backends/cuda/lab/scripts/cuda_norm_warps_sweep.py --out "$OUT/cuda_norm_warps_sweep.json" 2>&1 | tail -16
timeout 90 python3 backends/cuda/lab/scripts/cuda_profile_decode.py > "$OUT/cuda_profile_decode_nvfp4_b1.txt" 2>&1
timeout ${MATRIX_S:-90} python3 -m musecore.cli matrix --rows h200 --tokens 4096 --op-sizes '' --json \
  > "$OUT/matrix_h200_native.json" 2> "$OUT/matrix.err"; tail -2 "$OUT/matrix.err"
timeout 60 python3 -m musecore.cli generate --device h200 --prompt "def fibonacci(n):" --max-new-tokens 48 2>&1 | tail -4
tar czf /tmp/cuda_results.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/cuda_results.tgz "$OUT/"
