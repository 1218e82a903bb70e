#!/usr/bin/env bash
# Issue 30 end to end on the GPU machine's Xeon host (AMX), one device call: muse-small prefill (INT4 plan vs
# all-BF16) and decode beside llama.cpp at equal weight bytes, on CPU cores 0..THREADS-1; optionally the GPU suite
# alongside on the remaining cores (GPU_SUITE=1), so that one call does both.
#   carry: .whl/stevedore-5.9.1-py3-none-any.whl and .whl/peer.tar.xz (made by make_peer_tarball.sh: llama_cpp,
#   its libraries and libgomp, gguf, diskcache, yaml, from a host where `CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python
#   llama-cpp-python==0.3.36` built it: the device has no network; the whole tree must stay under 64 MiB)
# Outputs in $OUT: prefill.json/.txt, llama_cpp_peer_amx.json/.txt, lscpu.txt, gpu_suite.log.
set -u
source "$(dirname "$0")/amx_device_prelude.sh"
export MUSECORE_NUM_THREADS=$T
if [ -n "${GPU_SUITE:-}" ]; then
  (MUSECORE_NUM_THREADS=$((ncpu - T)) taskset -c $T-$((ncpu - 1)) timeout ${GPU_S:-330} python3 -m pytest -q -m gpu \
     -p no:cacheprovider ${GPU_TESTS:-backends/triton/tests backends/cuda/tests backends/cuda/lab/tests backends/rocm/tests tests} \
     > "$OUT/gpu_suite.log" 2>&1; echo "gpu suite rc=$? at $(( $(date +%s) - start )) s" >> "$OUT/gpu_suite.log") &
fi
taskset -c 0-$((T - 1)) timeout ${PREFILL_S:-120} python3 backends/xeon/lab/scripts/issue30_tables.py prefill --out "$OUT" \
  > "$OUT/prefill.txt" 2>&1; tail -6 "$OUT/prefill.txt"
echo "prefill done at $(( $(date +%s) - start )) s"
mkdir -p /tmp/peer && tar -xJf .whl/peer.tar.xz -C /tmp/peer
PYTHONPATH=/tmp/peer LD_LIBRARY_PATH=/tmp/peer/llama_cpp/lib taskset -c 0-$((T - 1)) timeout ${PEER_S:-200} python3 benchmarks/llama_cpp_peer.py --threads $T \
  --rounds 3 --new-tokens 64 --no-bf16 --out "$OUT/llama_cpp_peer_amx.json" > "$OUT/llama_cpp_peer_amx.txt" 2>&1
tail -8 "$OUT/llama_cpp_peer_amx.txt"
echo "peer done at $(( $(date +%s) - start )) s"
wait
tail -4 "$OUT/gpu_suite.log" 2>/dev/null
echo "all done at $(( $(date +%s) - start )) s"
