#!/usr/bin/env bash
# Issue 30 on the GPU machine's Xeon host (AMX), one device call: the one-call attention and MoE blocks (musecore_xeon/fused.py) A/B
# in one process (fused_blocks_ab.py: decode ms/token with it on and off, alternating, after a bit-equality check), then
# decode beside llama.cpp at equal weight bytes (benchmarks/llama_cpp_peer.py, the shipped default: fused), both on
# cores 0..THREADS-1. SIDE="command" runs alongside on the remaining cores (e.g. a GPU session), its output in
# $OUT/side.log. Carry .whl/stevedore-5.9.1-py3-none-any.whl and .whl/peer.tar.xz (make_peer_tarball.sh).
# Outputs in $OUT: fused_blocks_ab_amx.{json,txt}, llama_cpp_peer_amx.{json,txt}, lscpu.txt, side.log.
set -u
source "$(dirname "$0")/amx_device_prelude.sh"
export MUSECORE_NUM_THREADS=$T
if [ -n "${SIDE:-}" ]; then
  (taskset -c $T-$((ncpu - 1)) bash -c "$SIDE" > "$OUT/side.log" 2>&1; echo "side rc=$? at $(( $(date +%s) - start )) s" \
     >> "$OUT/side.log") &
fi
export MUSECORE_XEON_INT4_CROSSOVER=16 MUSECORE_XEON_BF16_CROSSOVER=8 MUSECORE_XEON_BF16_GEMV_CROSSOVER=8
taskset -c 0-$((T - 1)) timeout ${AB_S:-150} python3 backends/xeon/lab/scripts/fused_blocks_ab.py --threads $T \
  --rounds ${ROUNDS:-7} --steps 64 --json "$OUT/fused_blocks_ab_amx.json" > "$OUT/fused_blocks_ab_amx.txt" 2>&1
grep -v USDT "$OUT/fused_blocks_ab_amx.txt" | tail -4
echo "A/B done at $(( $(date +%s) - start )) s"
mkdir -p /tmp/peer && tar -xJf .whl/peer.tar.xz -C /tmp/peer
PYTHONPATH=/tmp/peer LD_LIBRARY_PATH=/tmp/peer/llama_cpp/lib taskset -c 0-$((T - 1)) timeout ${PEER_S:-200} \
  python3 benchmarks/llama_cpp_peer.py --threads $T --rounds 3 --new-tokens 64 --no-bf16 \
  --out "$OUT/llama_cpp_peer_amx.json" > "$OUT/llama_cpp_peer_amx.txt" 2>&1
tail -6 "$OUT/llama_cpp_peer_amx.txt"
echo "peer done at $(( $(date +%s) - start )) s"
wait
tail -30 "$OUT/side.log" 2>/dev/null
echo "all done at $(( $(date +%s) - start )) s"
