#!/usr/bin/env bash
# The next device calls for this branch (FLASHMSA_BWD_ORDER sweeps on a 2-D grid): its GPU tests
# (the order test under memcheck too), then a rotated A/B against main's flashmsa_run and the
# head-interleaved selector (exp/select-interleave) as a side variant.
#   ab/run_main (main's flashmsa_run), ab/run_si (exp/select-interleave's) and scratch-gpu/ (this
#   branch, scripts/build_gpu_bundle.sh), both git-ignored: run with carry ["scratch-gpu", "ab"]. STAGES="tests", "aux", "ab", "layout", "stalls" or
#   "lanes" (one call each: tests ~4 minutes, aux ~5, the A/B ~8 at ROUNDS=2, layout ~6, stalls ~3,
#   lanes ~4; in that order of priority but ab last), ROUNDS (default 2), CONFIGS as in gpu_ab.sh.
# aux: branch exp/bwd-aux = exp/bwd-aux-vector (di_kernel and convert_acc_kernel vectorised) +
# exp/proxy-lse-wgmma (the student lse's partials on warpgroup MMA; FLASHMSA_PROXY_LSE=mma: the
# mma.sync form); ab/run_aux and its GPU tests ab/tests_aux, every other kernel's SASS identical to
# main's (its backward / workspace / graph tests run in the tests stage): main, aux and aux_mma (=
# the vectorised kernels alone). Predicted at m3/64k: aux_mma -0.5 to -0.7 ms on the backward (di 0.75 -> ~0.5,
# the converts 1.31 -> ~0.85), aux another -0.5 to -0.9 (the student lse 1.24 -> ~0.4-0.7).
# lanes (last, if time is left): the backward's student lse on a helper lane (branch
# exp/bwd-student-lane, not merged here; ab/run_sl = main + that change, device code identical to
# main's): main, sl, and sl with FLASHMSA_BWD_LANES=1 (should equal main). The mirror split (the
# per-row terms on the helper) measured nothing before (perf-notes): the proxy lse fills the SMs.
# layout: is the 1-D form's +1.0-1.5 ms (perf-notes) the distance between the consumers' hot loop
# and the producer's code (0xb6e0 bytes in main, 0x40 more in this branch and its 1-D form)? main
# and this branch with 4 / 8 / 12 producer nanosleeps (scripts/build_layout_variant.sh N
# ab/run_main_pN on main; 4 on this branch: ab/run_grid2d_p4, main's distance mod 128), and main
# with the forward's producer moved by 4 (KERNEL=forward ...: ab/run_main_f4; its hot loop is 11 KB,
# the backward's 36 KB).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/flashmsa-next}
mkdir -p "$OUT"
STAGES=${STAGES:-tests}
BIN=${BIN:-scratch-gpu}
for f in "$BIN"/*.xz ab/*.xz; do [ -f "$f" ] && xz -d -f -T4 "$f"; done
chmod +x "$BIN"/* ab/* 2>/dev/null
if [[ " $STAGES " == *" tests "* ]]; then
  timeout 240 "$BIN/flashmsa_gpu_tests" --gtest_brief=1 > "$OUT/tests.log" 2>&1
  echo "gpu tests: exit $?"; tail -n 3 "$OUT/tests.log"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/flashmsa_gpu_tests" --gtest_brief=1 \
    --gtest_filter='CudaBackward.TokenRowsGroupOf16FourGroups' > "$OUT/memcheck.log" 2>&1
  echo "memcheck: exit $?"; tail -n 3 "$OUT/memcheck.log"
  if [ -x ab/tests_aux ]; then  # exp/bwd-aux's own tests (its kernels and the workspace rule)
    timeout 150 ab/tests_aux --gtest_brief=1 --gtest_filter='CudaBackward.*:CudaWorkspace.*:CudaGraph.TrainingStep*' > "$OUT/tests_aux.log" 2>&1
    echo "aux tests: exit $?"; tail -n 3 "$OUT/tests_aux.log"
  fi
fi
if [[ " $STAGES " == *" ab "* ]]; then
  export ROUNDS=${ROUNDS:-2}
  export CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_8k:--seqlen 8192"}
  export VARIANTS=${VARIANTS:-"main=ab/run_main;grid2d=$BIN/flashmsa_run;order2=$BIN/flashmsa_run,FLASHMSA_BWD_ORDER=2;order1=$BIN/flashmsa_run,FLASHMSA_BWD_ORDER=group;si=ab/run_si"}
  OUT=$OUT bash scripts/gpu_ab.sh
fi
if [[ " $STAGES " == *" layout "* ]]; then
  export ROUNDS=${ROUNDS:-2}
  export CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536"}
  export VARIANTS=${VARIANTS:-"main=ab/run_main;main_p4=ab/run_main_p4;main_p8=ab/run_main_p8;main_p12=ab/run_main_p12;grid2d=$BIN/flashmsa_run;grid2d_p4=ab/run_grid2d_p4;main_f4=ab/run_main_f4"}
  OUT=$OUT bash scripts/gpu_ab.sh
fi
# stalls: ncu's stall reasons per issued instruction of one m3/64k backward launch, main against the
# slow 1-D build (ab/run_bgm1d, exp/bwd-group-major 578138f) and main_p4: more "no_instruction"
# stalls in the slow builds would put the cost on instruction fetch (code layout).
if [[ " $STAGES " == *" stalls "* ]]; then
  for b in ${STALL_BINS:-ab/run_main ab/run_bgm1d ab/run_main_p4}; do
    timeout 150 ncu --clock-control none -k regex:attn_bwd_wgmma_kernel --launch-count 1 \
      --metrics 'gpu__time_duration.sum,smsp__inst_executed.sum,smsp__average_warp_latency_per_inst_issued.ratio,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      "$b" --device cuda --seqlen 65536 --iters 1 --check-tokens 0 --quiet > "$OUT/stalls_$(basename "$b").log" 2>&1
    echo "== $b (exit $?)"
    grep -E "gpu__time|inst_executed|latency_per_inst|stalled_(no_instruction|long_scoreboard|barrier|wait|math|mio|lg_throttle|membar|short_scoreboard|branch|dispatch|sleeping|selected|not_selected|tex|drain|imc|misc)" "$OUT/stalls_$(basename "$b").log" | sed -E 's/ +/ /g'
  done
fi
if [[ " $STAGES " == *" lanes "* ]]; then
  export ROUNDS=${ROUNDS:-2}
  export CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2"}
  export VARIANTS=${VARIANTS:-"main=ab/run_main;sl=ab/run_sl;sl_one_lane=ab/run_sl,FLASHMSA_BWD_LANES=1"}
  OUT=$OUT bash scripts/gpu_ab.sh
fi
if [[ " $STAGES " == *" aux "* ]]; then
  export ROUNDS=${ROUNDS:-2}
  export CONFIGS=${CONFIGS:-"m3_64k:--seqlen 65536;m3_32k:--seqlen 32768;fm16k:--seqlen 16384 --heads 16 --kv-heads 2;m3_8k:--seqlen 8192"}
  export VARIANTS=${VARIANTS:-"main=ab/run_main;aux=ab/run_aux;aux_mma=ab/run_aux,FLASHMSA_PROXY_LSE=mma"}
  OUT=$OUT bash scripts/gpu_ab.sh
fi
