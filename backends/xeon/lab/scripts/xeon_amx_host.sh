#!/usr/bin/env bash
# The xeon backend on an Intel Xeon with AVX-512 VNNI and AMX (the GPU machine's host CPU: 16 cores of a
# 5th-gen Xeon), in one call: the backend's tests, the linear shapes for each ISA level in ISAS (MUSECORE_XEON_ISA
# caps the build: amx = the INT4 AMX GEMM above the crossover, avx512_vnni / avx2 = dequantized tiles there), the
# muse-small MoE layer and end-to-end decode, the native xeon6 matrix rows and a generate on device="xeon6".
#   device run: bash backends/xeon/lab/scripts/xeon_amx_host.sh   (carry: .whl; ISAS, SHAPES, MS, SKIP_E2E, SKIP_MATRIX narrow it)
# Outputs: $OUT/xeon_amx_host.tgz (one archive: the device tool returns at most 8 files; unpack it into
# backends/xeon/lab/results/xeon_amx_host/) holding tests.log, linear_<isa>.{json,txt},
# moe_e2e.{json,txt}, matrix_xeon6_native.json, generate.txt.
set -u
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} MUSECORE_CACHE=${MUSECORE_CACHE:-$HOME/.cache/musecore}
THREADS=${THREADS:-16}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir .whl/*.whl \
  -e ./quant -e . -e ./backends/xeon 2>&1 | grep -v -i warning | tail -3
timeout ${TEST_S:-120} python3 -m pytest -q -p no:cacheprovider -rs backends/xeon/tests 2>&1 \
  | grep -v "conformance.py:55" > "$OUT/tests.log"; tail -3 "$OUT/tests.log"
for isa in ${ISAS:-amx avx512_vnni}; do
  MUSECORE_XEON_ISA=$isa timeout ${LINEAR_S:-150} python3 backends/xeon/lab/scripts/xeon_bench.py --cases linear --threads $THREADS \
    --shapes ${SHAPES:-4096x8192 8192x4096 4096x4096 768x768 768x1536} --ms ${MS:-1 2 4 16 64 256} --repeats 3 \
    --out "$OUT/linear_$isa.json" > "$OUT/linear_$isa.txt" 2>&1
  grep -E "^linear .* 1 +xeon-int4|^memory|native isa" "$OUT/linear_$isa.txt"
done
[ -n "${SKIP_E2E:-}" ] || timeout ${E2E_S:-200} python3 backends/xeon/lab/scripts/xeon_bench.py --cases moe e2e --presets muse-small --ms 1 4 16 64 --repeats 3 \
  --threads $THREADS --out "$OUT/moe_e2e.json" > "$OUT/moe_e2e.txt" 2>&1; grep -A8 "== e2e" "$OUT/moe_e2e.txt"
[ -n "${SKIP_MATRIX:-}" ] || timeout ${MATRIX_S:-90} python3 -m musecore.cli matrix --rows xeon6 --tokens 2048 --op-sizes '' --json \
  > "$OUT/matrix_xeon6_native.json" 2> "$OUT/matrix.err"; tail -2 "$OUT/matrix.err"
timeout 60 python3 -m musecore.cli generate --device xeon6 --prompt "def fibonacci(n):" --max-new-tokens 48 \
  > "$OUT/generate.txt" 2>&1; tail -4 "$OUT/generate.txt"
tar czf /tmp/xeon_amx_host.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/xeon_amx_host.tgz "$OUT/"
