#!/usr/bin/env bash
# Issue 30 on the GPU machine's Xeon host (AMX): where a muse-small decode token goes at THREADS threads
# (benchmarks/xeon_decode_profile.py: per-op wall time and GB/s, the fixed-cost step, the fused MoE against one GEMV
# of its bytes), on CPU cores 0..THREADS-1. With GLUON=1 the Gluon W4A16 session (backends/cuda/lab) runs alongside on
# the remaining cores, so that one device call does both, and with GLUON_NCU="SHAPE M CUT" its ncu profile after it. Outputs in $OUT: decode_profile_amx.{json,txt}, lscpu.txt,
# and the Gluon session's files under $OUT/gluon.
set -u
source "$(dirname "$0")/amx_device_prelude.sh"
if [ -n "${GLUON:-}" ]; then
  mkdir -p "$OUT/gluon"
  (OUT="$OUT/gluon" LIMIT=${GLUON_S:-400} taskset -c $T-$((ncpu - 1)) bash backends/cuda/lab/scripts/gluon_session.sh \
     ${GLUON_MS:-64,256,4096,16} > "$OUT/gluon/session.log" 2>&1; echo "gluon rc=$? at $(( $(date +%s) - start )) s" \
     >> "$OUT/gluon/session.log"
   [ -n "${GLUON_NCU:-}" ] && OUT="$OUT/gluon" taskset -c $T-$((ncpu - 1)) bash backends/cuda/lab/scripts/gluon_ncu.sh \
     $GLUON_NCU > "$OUT/gluon/ncu.log" 2>&1) &
fi
# the crossovers pinned as the README says for comparable runs (timed at load they may differ between runs)
MUSECORE_XEON_INT4_CROSSOVER=16 MUSECORE_XEON_BF16_CROSSOVER=8 MUSECORE_XEON_BF16_GEMV_CROSSOVER=8 \
  taskset -c 0-$((T - 1)) timeout ${PROFILE_S:-300} python3 benchmarks/xeon_decode_profile.py --threads $T ${MORE_THREADS:-1} \
  --plans int4 --steps 64 --moe-vs-gemv --json "$OUT/decode_profile_amx.json" > "$OUT/decode_profile_amx.txt" 2>&1
echo "profile rc=$? at $(( $(date +%s) - start )) s"
wait
tail -5 "$OUT/gluon/session.log" 2>/dev/null
echo "all done at $(( $(date +%s) - start )) s"
