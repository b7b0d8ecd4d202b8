#!/usr/bin/env bash
# The keys-on-M ping-pong variant over an e4m3 cache (cute_kernels/sm90_keysm_rs_decode.py) on
# the H200, in one device call (~5 min): logs in $OUT (few files: a run returns at most 10).
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_keysm_rs.sh [check|bench|bulk]
#
# check (default): precompile, tests, tests_rows, memcheck, fuzz; bench: precompile (a warm
# machine's cache makes it quick), bench_bf16, bench_fp8, ncu. Two device calls: together they
# pass the 600 s a call may take. bulk: the BULK knob's A/B (its comment, below).
#
# Stages (each has a timeout: a kernel whose mbarriers never complete hangs rather than fails):
#   precompile  the keys-on-M steps (8, 16, 32, 64 columns, both cache formats), the ping-pong
#               steps (64 columns: its column split, opt-in), schedule: parallel processes
#   tests       tests/test_keysm_rs.py on the GPU (grid, varlen, page edges, q range, graph
#               replays against the fp32 reference)
#   tests_rows  tests/test_keysm.py's test_more_rows_than_columns: TORCH_MLA_KEYSM=128 (a CTA
#               for each 64 rows above 64; bf16, the keys-on-M fp8 kernel, the column split)
#   memcheck    compute-sanitizer memcheck of tools/keysm_memcheck.py, TORCH_MLA_KEYSM_RS=1
#   fuzz        tools/fuzz_decode.py --fp8, 2000 cases, TORCH_MLA_KEYSM_RS=1
#   bench_bf16, bench_fp8
#               benchmarks/bench_decode.py --keysm (bf16), then --keysm --fp8 --rs, one process
#               each, same machine start: the memory-bound rows and the small-batch ones where the
#               variant loses (the dispatch takes it from a batch of 8, 32 at 32 columns), and
#               64 rows (the column split: against the heads-on-M exact mode's 1.12-1.13x
#               bf16, issue 31) and 128 (two CTAs of it: against its 1.12-1.17x); each row's
#               "ping-pong" line against its keys-on-M line (bench_decode --keysm runs it with
#               TORCH_MLA_KEYSM=128)
#   ncu         the b 128, s_k 8192, h_q 16 row's warp states and instruction mix
# Success: every stage rc=0, "N passed", "ERROR SUMMARY: 0 errors", rel err ~1e-4 or below.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # $OUT, run, preamble, memcheck, finish

mode=${1:-check}
if [[ $mode == bulk ]]; then
  # TORCH_MLA_DEV_KEYSM_BULK (session 48) against the defaults, same start: each build in its
  # own kernel cache (D, B), the ping-pong (rs) and fast mode (fast) at ROWS, two rounds
  # alternated, and the load-only ring under each in round 1; then (while time is left) the
  # ping-pong's and fast mode's GPU tests and memcheck on B. bf16 (our dispatch's kernel, for
  # the issue's ratio) and FlashMLA's bf16 decode once a round, from bench_decode.py.
  # QUICK=1 (for a short call): the ping-pong's A/B alone (no fast mode, load-only, bf16,
  # tests or memcheck).
  SECONDS=${ELAPSED:-0}
  quick=${QUICK:-0}
  preamble flashmla-sm90-sparse
  ROWS=${ROWS:-"128,1,8192,16 64,1,16384,16 128,2,8192,16"}
  for n in D B; do  # (D also the bf16 kernels bench_decode.py times)
    kb=(); ks=keysm_rs,keysm_fast,schedule; [[ $quick == 1 ]] && ks=keysm_rs,schedule
    [[ $n == B ]] && kb=(TORCH_MLA_DEV_KEYSM_BULK=1)
    [[ $n == D && $quick != 1 ]] && ks=$ks,keysm,step
    (env "${kb[@]}" TORCH_MLA_CACHE_DIR=/tmp/c$n timeout 200 python -m torch_mla.precompile \
      --arch sm_90a --kernels $ks --dtypes bf16 --jobs 8 > "$OUT/pre$n.log" 2>&1) &
  done
  wait
  tail -n 2 "$OUT"/pre*.log
  for round in 1 2; do
    for n in D B; do
      kb=(); [[ $n == B ]] && kb=(TORCH_MLA_DEV_KEYSM_BULK=1)
      ms="rs fast"; [[ $quick == 1 ]] && ms=rs
      for m in $ms; do
        # shellcheck disable=SC2086
        run "ab_${m}_${n}_$round" 60 env "${kb[@]}" TORCH_MLA_CACHE_DIR=/tmp/c$n \
          TAG="r$round $n" python -m tools.keysm_rows $m $ROWS
        stop_if_hung "ab_${m}_${n}_$round"
      done
      [[ $round == 2 || $quick == 1 ]] && continue  # (the load-only ring: once)
      run "lo_${n}_$round" 60 env "${kb[@]}" TORCH_MLA_CACHE_DIR=/tmp/clo$n \
        python -m tools.keysm_load_only pages 128,1,8192,16 64,1,16384,16
      stop_if_hung "lo_${n}_$round"
    done
    [[ $quick == 1 ]] && continue
    # shellcheck disable=SC2086
    run "bf16_$round" 90 env TORCH_MLA_CACHE_DIR=/tmp/cD python benchmarks/bench_decode.py \
      --no-check $ROWS
  done
  grep -h " us" "$OUT"/ab_*.log "$OUT"/lo_*.log 2>/dev/null | sort > "$OUT/ab_all.txt"
  cat "$OUT/ab_all.txt"
  [[ $quick == 1 ]] && { finish; exit; }
  if (( SECONDS < 420 )); then
    run tests 120 env TORCH_MLA_DEV_KEYSM_BULK=1 TORCH_MLA_CACHE_DIR=/tmp/cB python -m pytest \
      -m cuda -q -p no:cacheprovider tests/test_keysm_rs.py tests/test_keysm_fast.py
    stop_if_hung tests
  fi
  if (( SECONDS < 520 )); then
    TORCH_MLA_DEV_KEYSM_BULK=1 TORCH_MLA_CACHE_DIR=/tmp/cB TORCH_MLA_KEYSM_RS=1 \
      memcheck 60 python -m tools.keysm_memcheck
  fi
  finish; exit
fi
preamble flashmla-sm90
run precompile 150 python -m torch_mla.precompile --arch sm_90a \
  --kernels keysm,keysm64,keysm_rs,fp8_step,schedule
if [[ $mode == check ]]; then
  run tests 150 python -m pytest -m cuda -q -p no:cacheprovider tests/test_keysm_rs.py
  stop_if_hung tests
  run tests_rows 120 python -m pytest -m cuda -q -p no:cacheprovider tests/test_keysm.py \
    -k more_rows_than_columns
  stop_if_hung tests_rows
  TORCH_MLA_KEYSM_RS=1 memcheck 90 python -m tools.keysm_memcheck
  # (fp8 cases of every head count: those of up to 32 rows a KV head run the ping-pong kernel)
  TORCH_MLA_KEYSM_RS=1 run fuzz 150 python -m tools.fuzz_decode --fp8 --cases 2000 --seed 0
else
  ROWS="128,1,8192,16 128,1,8192,8 64,1,16384,16 128,2,8192,8 16,1,32768,16 64,1,2048,16
        32,1,4096,16 1,1,4096,16 128,1,8192,64 32,1,4096,64 128,4,8192,16 128,1,8192,128
        128,2,8192,64"
  # shellcheck disable=SC2086
  run bench_bf16 150 python benchmarks/bench_decode.py --keysm --no-check $ROWS
  # shellcheck disable=SC2086
  run bench_fp8 200 python benchmarks/bench_decode.py --keysm --fp8 --rs $ROWS
  TORCH_MLA_KEYSM_RS=1 run ncu 120 ncu --clock-control none --section SpeedOfLight \
    --section WarpStateStats --section InstructionStats --print-details all -k regex:KeysMRS \
    --launch-skip 1 -c 1 python -m tools.profile_one 128 1 8192 16 exact
fi
finish
