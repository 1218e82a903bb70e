#!/usr/bin/env bash
# Device calls (one H200) for issue 26, session 56 (backends/cuda/lab/NOTES.md), each step time-boxed:
#   1. cuda_large_m_probe.py: the large-M dequant path with the NVFP4 per-tensor scale left out of the bf16 copy
#      and applied as cuBLAS's alpha (LARGE_M_ARGS, e.g. "--shapes q_proj,unpooler --ms 4096");
#   2. the persistent probe's lab tests (the holding kernel's input load made volatile);
#   3. the GPU suite (SUITE, SUITE_S);  4. targets (TARGETS_S);
#   5. cuda_gemv_ab.py: the decode GEMV of this session against session 55's, same process (GEMV_AB_ARGS);
#   6. the decode kernels' GPU tests (linear, MoE, PDL, choices);
#   7. (session 57) ncu of the decode GEMVs with every stall reason and the pipes (NCU_SPECS=decode NCU_DETAIL=1 by
#      default here; device_prelude.sh's NCU_DECODE).
#   8. (session 59) the grouped Gluon MoE GEMM: its GPU tests (with the Gluon linears' and the grouped conformance
#      cases), then cuda_gluon_moe_probe.py (its token tiles against
#      the grouped Triton GEMM and the BF16 experts at prefill sizes; GLUON_MOE_ARGS, GLUON_MOE_S; GLUON_MOE_TESTS=0:
#      the probe alone).
#   9. (session 59) the Gluon GEMM at large M with two consumer warpgroups (block_n 128, block_m 256: half the
#      activation tiles' L2 reads of block_n 64), each also on a persistent grid, against dequantize + cuBLAS and
#      BF16: cuda_gluon_sweep.py with GLUON_BLOCK_NS=128 GLUON_PERSISTENT=1 (LARGE_GLUON_ARGS, default --ms 1024,4096 on the four 816B shapes; LARGE_GLUON_S).
#   a. (session 60) split-K "finish" (16-byte atomics into a zeroed workspace, the tile's last split stores bf16: no
#      cast kernel): its GPU tests, then cuda_gluon_sweep.py with GLUON_FINISH=1 GLUON_BLOCK_NS=64 against the atomic
#      split cuts (FINISH_ARGS, default the small-N and K=4096 shapes at M 16 / 64 / 256; FINISH_S).
#   b. (session 60) paired ring stages (one ready/empty mbarrier pair per two stages) and late release (a stage freed
#      right before a later wait): 3 -> 1.5 / 2 / 1 CTA barriers per chunk in the consumer, and the scale words two
#      chunks ahead; the Gluon linear GPU tests, then cuda_gluon_sweep.py with GLUON_PAIR=1 GLUON_LATE=1 GLUON_AHEAD=1
#      GLUON_BLOCK_NS=64 (PAIR_ARGS, default every 816B
#      shape at M 16 / 64 / 256; PAIR_S).
#   c. (session 61) the Gluon linear GPU tests of the routed consumer variants (paired stages, late release, scale
#      words two chunks ahead: the same bits as the plain launch, the 816B shapes through pick_config, every code, a
#      CUDA-graph replay; five pytest processes side by side, VARIANT_TESTS_S).
#   d. (session 61) the routed cut beside two consumer warpgroups at its split and twice it, or, where it is such a
#      launch, beside the one-warpgroup launch it replaced (GLUON_WIDE=1; WIDE_ARGS, WIDE_S; e.g. WIDE_ARGS="--ms
#      24,32,48 --shapes pooler,expert_down" for the points routed wide but not measured in run 89). (session 62)
#      GLUON_MEMSET=1: each routed finish cut also with one more memset of its workspace per call (what the memset
#      node costs in the graph's chain); GLUON_REZERO=1: each routed finish cut also with its workspace kept zeroed
#      by the kernel (no memset per launch).
#   e. (session 62) split-K finish with its workspace kept zeroed by the kernel (rezero, routed): the GPU tests (eager
#      and in a graph scope), then the routed finish cuts against the same launch with a memset per call (REZERO_ARGS,
#      REZERO_S).
#   f. (session 63) literal cuts beside the routed one (cuda_gluon_sweep.py --cuts; CUTS, CUTS_ARGS, CUTS_S): by
#      default the two-warpgroup cuts pick_config does not rank (block_n 128 at 64 tokens split 4, at 128 tokens split
#      1-8) at M 48-256 on every 816B shape.
#   g. (session 63) muse-small's linears (weights under 8M elements; on the GEMV at M 1-8 until run 96 measured them,
#      now the Gluon GEMM from M = 2) at M 1-8: the routed launch ("now") against the Gluon GEMM's pick (SMALL_ARGS,
#      SMALL_S).
#   h. (session 64) the Gluon linear launched with PDL (its loader waits before its first load): its GPU tests (a dependent chain in a PDL graph and eagerly; the Gluon linear tests and
#      the PDL policy tests with MUSECORE_CUDA_PDL=1, three processes), then cuda_pdl_ab.py (PDL off / waits only /
#      early GEMVs, each in its own process: PDL_AB_ARGS, PDL_AB_S).
#   i. (session 70) the residual norm in every program of the consumer GEMV against the producer's last program:
#      the prologue probe's tests (natively), then cuda_prologue_probe.py (PROLOGUE_ARGS, PROLOGUE_S); (session 72)
#      also the MoE finalize in every program of the unpooler GEMV against its own launch (PROLOGUE_ARGS="--chains
#      finalize" for that chain alone).
#   j. (session 73) the same finalize in muse-small's decode step: cuda_fused_ab.py (AB_MODES, default
#      fused,fin_apart,fin_4x4,fin_8x8; since session 75 the product runs the finalize in the unpooler GEMV at 16 x 16,
#      fin_apart is it switched off).
# Usage: OUT=out [SKIP_INSTALL=1] [LIMIT=580] [STEPS=123] [LARGE_M_ARGS=...] [SUITE=...] [SUITE_S=...]
#        bash backends/cuda/lab/scripts/s56_session.sh
set -u
LIMIT=${LIMIT:-580}
STEPS=${STEPS:-123}
source "$(dirname "$0")/device_prelude.sh"
step1() {
  timeout $(cap ${LARGE_M_S:-240}) python3 backends/cuda/lab/scripts/cuda_large_m_probe.py --out $OUT/cuda_large_m_probe.json \
    --smi $OUT/smi_large_m.csv ${LARGE_M_ARGS:-} > $OUT/large_m.log 2>&1
  echo "1. large-M probe at ${SECONDS}s (rc $?):"; tail -c 3000 $OUT/large_m.log
}
step2() { TESTS="backends/cuda/lab/tests/test_persistent_probe.py" TESTS_ALL=1 tests_step 2; }
step3() { gpu_suite_step 3; }
step4() { targets_step 4; }
step5() {
  timeout $(cap ${AB_S:-200}) python3 backends/cuda/lab/scripts/cuda_gemv_ab.py --out $OUT/cuda_gemv_ab.json ${GEMV_AB_ARGS:-} \
    > $OUT/gemv_ab.log 2>&1
  echo "5. GEMV A/B at ${SECONDS}s (rc $?):"; tail -c 4000 $OUT/gemv_ab.log
}
step6() {
  TESTS="backends/cuda/tests/test_cuda_linear.py backends/cuda/tests/test_cuda_moe.py backends/cuda/tests/test_cuda_pdl.py
         backends/cuda/tests/test_cuda_choices.py" tests_step 6
}
step7() { NCU_SPECS=${NCU_SPECS:-decode} NCU_DETAIL=${NCU_DETAIL:-1} ncu_misses_step 7; }
step8() {
  [ "${GLUON_MOE_TESTS:-1}" = 0 ] || step8_tests
  timeout $(cap ${GLUON_MOE_S:-300}) python3 backends/cuda/lab/scripts/cuda_gluon_moe_probe.py \
    --out $OUT/cuda_gluon_moe_probe.json ${GLUON_MOE_ARGS:-} > $OUT/gluon_moe_probe.log 2>&1
  echo "8. grouped Gluon MoE probe at ${SECONDS}s (rc $?):"; tail -c 4000 $OUT/gluon_moe_probe.log
}
step8_tests() {
  timeout $(cap 180) python3 -m pytest -q -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_moe.py \
    backends/cuda/tests/test_cuda_conformance.py backends/cuda/tests/test_cuda_linear.py -k "gluon or grouped" \
    > $OUT/gluon_moe_tests.log 2>&1
  echo "8. grouped Gluon MoE tests at ${SECONDS}s (rc $?):"; grep -E "passed|failed|FAILED|Error|assert" \
    $OUT/gluon_moe_tests.log | tail -12
}
step9() {
  GLUON_BLOCK_NS=128 GLUON_PERSISTENT=1 timeout $(cap ${LARGE_GLUON_S:-240}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py \
    --out $OUT/cuda_gluon_sweep_large_m.json ${LARGE_GLUON_ARGS:---ms 1024,4096} > $OUT/gluon_large_m.log 2>&1
  echo "9. large-M Gluon sweep at ${SECONDS}s (rc $?):"; tail -c 3000 $OUT/gluon_large_m.log
}
stepa() {
  timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_linear.py \
    -k "split_k" > $OUT/finish_tests.log 2>&1
  echo "a. split-K tests at ${SECONDS}s (rc $?):"; grep -E "passed|failed|FAILED|Error|assert" $OUT/finish_tests.log | tail -8
  GLUON_FINISH=1 GLUON_BLOCK_NS=64 timeout $(cap ${FINISH_S:-240}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py \
    --precompile 12 --out $OUT/cuda_gluon_sweep_finish.json \
    ${FINISH_ARGS:---ms 16,64,256 --shapes k_proj,expert_down,pooler,unpooler} > $OUT/gluon_finish.log 2>&1
  echo "a. finish sweep at ${SECONDS}s (rc $?):"; grep -v "^ " $OUT/gluon_finish.log | tail -c 3000
}
stepb() {
  timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_linear.py \
    -k "${PAIR_TESTS_K:-gluon}" > $OUT/pair_tests.log 2>&1
  echo "b. Gluon linear tests at ${SECONDS}s (rc $?):"; grep -E "passed|failed|FAILED|Error|assert" $OUT/pair_tests.log | tail -8
  GLUON_PAIR=1 GLUON_LATE=1 GLUON_AHEAD=1 GLUON_BLOCK_NS=64 timeout $(cap ${PAIR_S:-240}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py \
    --precompile 12 --out $OUT/cuda_gluon_sweep_pair.json \
    ${PAIR_ARGS:---ms 16,64,256 --shapes q_proj,k_proj,o_proj,pooler,unpooler,expert_up,expert_down} \
    > $OUT/gluon_pair.log 2>&1
  echo "b. paired-stage sweep at ${SECONDS}s (rc $?):"; grep -v "^ " $OUT/gluon_pair.log | tail -c 4000
}
stepc() {  # five pytest processes side by side: each Gluon test spends ~18 s compiling its kernels (run 88)
  local groups=("paired_stages and (cut0 or cut2 or cut3 or cut4 or cut5 or cut6)"
                "paired_stages and (cut1 or cut7 or cut8 or cut9)" "816b_shapes and proj" "816b_shapes and expert"
                "every_code or cuda_graph or choices or two_warpgroups or rezero")
  for i in 0 1 2 3 4; do
    timeout $(cap ${VARIANT_TESTS_S:-240}) python3 -m pytest -v -p no:cacheprovider -m gpu -rs \
      backends/cuda/tests/test_cuda_linear.py backends/cuda/tests/test_cuda_choices.py -k "${groups[$i]}" \
      > $OUT/variant_tests_$i.log 2>&1 &
  done
  wait
  echo "c. routed-variant tests at ${SECONDS}s:"
  grep -hE "PASSED|FAILED|passed|failed|Error|assert" $OUT/variant_tests_*.log | grep -v "^backends.*PASSED" | tail -16
  echo "c. $(grep -h PASSED $OUT/variant_tests_*.log | wc -l) tests passed"
}
stepd() {  # (session 61) the routed cut beside two consumer warpgroups (cuda_gluon_sweep.wide)
  GLUON_WIDE=1 timeout $(cap ${WIDE_S:-200}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py --precompile 12 \
    --routed-only --out $OUT/cuda_gluon_sweep_wide.json ${WIDE_ARGS:---ms 16,64,256 --shapes \
    q_proj,k_proj,o_proj,pooler,unpooler,expert_up,expert_down} > $OUT/gluon_wide.log 2>&1
  echo "d. wide sweep at ${SECONDS}s (rc $?):"; grep -v "^ " $OUT/gluon_wide.log | tail -c 5000
}
stepe() {  # (session 62) split-K finish's kept workspace (rezero): its GPU tests, then the routed finish cuts (rezero)
  # against the same launch zeroing a workspace per call, each in a CUDA graph (bench's graph scope)
  timeout $(cap 150) python3 -m pytest -v -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_linear.py \
    -k "rezero or (split_k and finish)" > $OUT/rezero_tests.log 2>&1
  echo "e. rezero / split-K tests at ${SECONDS}s (rc $?):"
  grep -hE "FAILED|passed|failed|Error|assert" $OUT/rezero_tests.log | tail -10
  GLUON_REZERO=1 timeout $(cap ${REZERO_S:-150}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py --precompile 12 \
    --routed-only --out $OUT/cuda_gluon_sweep_rezero.json ${REZERO_ARGS:---ms 16,64,128,256 --shapes \
    q_proj,k_proj,pooler,expert_down} > $OUT/gluon_rezero.log 2>&1
  echo "e. rezero sweep at ${SECONDS}s (rc $?):"; grep -v "^ " $OUT/gluon_rezero.log | tail -c 4000
}
CUTS=${CUTS:-"128,64,4,8,packed,1,finish,pair,late,ahead2,rezero;128,64,2,8,packed,1,finish,pair,late,ahead2,rezero;\
128,128,1,4,packed,1,late;128,128,2,4,packed,1,finish,late,rezero;128,128,4,4,packed,1,finish,late,rezero;\
128,128,8,4,packed,1,finish,late,rezero"}
stepf() {
  timeout $(cap ${CUTS_S:-200}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py --precompile 12 --routed-only \
    --cuts "$CUTS" --out $OUT/cuda_gluon_sweep_cuts.json ${CUTS_ARGS:---ms 48,64,128,256 --shapes \
    q_proj,k_proj,o_proj,pooler,unpooler,expert_up,expert_down} > $OUT/gluon_cuts.log 2>&1
  echo "f. literal cuts at ${SECONDS}s (rc $?):"; grep -v "^ " $OUT/gluon_cuts.log | tail -c 6000
}
stepg() {
  timeout $(cap ${SMALL_S:-120}) python3 backends/cuda/lab/scripts/cuda_gluon_sweep.py --precompile 12 --routed-only \
    --out $OUT/cuda_gluon_sweep_small.json ${SMALL_ARGS:---ms 1,2,4,8 --shapes \
    1536x1536,192x1536,768x1536,1536x768,3072x1536,1536x3072} > $OUT/gluon_small.log 2>&1
  echo "g. muse-small's linears at ${SECONDS}s (rc $?):"; grep -v "^ " $OUT/gluon_small.log | tail -c 3000
}
steph() {
  local groups=("chain_with_pdl or replays or rezero" "gluon and (816b_shapes or every_code)" "gluon and split_k")
  local pdl_env=("-u MUSECORE_CUDA_PDL" "MUSECORE_CUDA_PDL=1" "MUSECORE_CUDA_PDL=1")  # the chain test sets its own
  for i in 0 1 2; do
    env ${pdl_env[$i]} timeout $(cap ${PDL_TESTS_S:-200}) python3 -m pytest -v \
      -p no:cacheprovider -m gpu -rs backends/cuda/tests/test_cuda_linear.py backends/cuda/tests/test_cuda_pdl.py \
      -k "${groups[$i]}" > $OUT/pdl_tests_$i.log 2>&1 &
  done
  wait
  echo "h. PDL tests at ${SECONDS}s:"
  grep -hE "FAILED|passed|failed|Error|assert" $OUT/pdl_tests_*.log | grep -v "^backends.*PASSED" | tail -16
  timeout $(cap ${PDL_AB_S:-300}) python3 backends/cuda/lab/scripts/cuda_pdl_ab.py --settings off,waits,early \
    --out $OUT/cuda_pdl_ab.json ${PDL_AB_ARGS:---cases linear,e2e --e2e-batches 1,4,16 --linear-ms 1,2,8,16,64,256 \
    --linear-shapes q_proj,k_proj,pooler,expert_up,expert_down} > $OUT/pdl_ab.log 2>&1
  echo "h. PDL A/B at ${SECONDS}s (rc $?):"; grep -v "^ " $OUT/pdl_ab.log | tail -c 7000
}
stepi() {  # (session 70) the residual norm in the consumer GEMV's prologue against the producer's last program
  timeout $(cap 120) python3 -m pytest -q -p no:cacheprovider backends/cuda/lab/tests/test_prologue_probe.py \
    > $OUT/prologue_tests.log 2>&1
  echo "i. prologue tests at ${SECONDS}s (rc $?):"; tail -3 $OUT/prologue_tests.log
  timeout $(cap ${PROLOGUE_S:-150}) python3 backends/cuda/lab/scripts/cuda_prologue_probe.py \
    --out $OUT/cuda_prologue_probe.json ${PROLOGUE_ARGS:-} > $OUT/prologue_probe.log 2>&1
  echo "i. prologue probe at ${SECONDS}s (rc $?):"; tail -c 4000 $OUT/prologue_probe.log
}
stepj() { AB_MODES=${AB_MODES:-fused,fin_apart,fin_4x4,fin_8x8} fused_ab_step j; }
run_steps s56
