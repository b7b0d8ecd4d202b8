#!/usr/bin/env bash
# The keys-on-M ping-pong variant over an e4m3 cache (cute_kernels/sm90_keysm_rs_decode.py) on
# the H200, in one device call (~5 min): logs in $OUT (few files: a run returns at most 10).
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_keysm_rs.sh [check|bench]
#
# check (default): precompile, tests, tests_rows, memcheck, fuzz; bench: precompile (a warm
# machine's cache makes it quick), bench_bf16, bench_fp8, ncu. Two device calls: together they
# pass the 600 s a call may take. costs: each 16-column step's fixed cost and streaming rate
# (tools/step_costs.py; COST_BUILDS and COST_ROWS override its builds and rows), with and
# without its combine. (Session 48-49's bulk mode, the BULK knob's A/B, went with the knob:
# docs/kernels/keysm.md, session 49.)
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
preamble flashmla-sm90-sparse  # (FlashMLA 9241ae3: its dense decode as well)
if [[ $mode != costs ]]; then  # (costs compiles each of its builds in a process of its own)
  run precompile 150 python -m torch_mla.precompile --arch sm_90a \
    --kernels step,keysm,keysm64,keysm_rs,keysm_fast,fp8_step,schedule
fi
if [[ $mode == costs ]]; then
  # Each 16-column step's fixed cost and streaming rate (tools/step_costs.py): the four kinds,
  # with and without the combine; the patched builds each in a kernel cache of their own,
  # compiled in parallel, then every build timed one after another (each times its rows twice).
  # COST_BUILDS: KIND or KIND:FLAG (a step_costs flag); a build's name is KIND_FLAG with the
  # flag's letters and digits only.
  # shellcheck disable=SC2206
  builds=(${COST_BUILDS:-bf16 bf16:--no-combine exact exact:--no-combine fast
    fast:--no-combine ring ring:--no-combine bf16:--check-batch=8 exact:--check-batch=8})
  # (A build whose kernels differ from the shipped ones has a kernel cache of its own;
  # step_costs's --overhead changes only the schedule, computed by torch ops.)
  # take BUILD: its kind, flag and name, and the cache directory of its own where it needs one.
  take() {
    kind=${1%%:*}; flag=${1#"$kind"}; flag=${flag#:}
    name=$kind${flag:+_${flag//[^a-z0-9]/}}
    unset TORCH_MLA_CACHE_DIR
    if [[ $kind == ring || ( -n $flag && $flag != --overhead=* ) ]]; then
      export TORCH_MLA_CACHE_DIR=$OUT/cache_$name
    fi
  }
  for b in "${builds[@]}"; do
    take "$b"
    # shellcheck disable=SC2086
    timeout 200 python -m tools.step_costs "$kind" $flag --warm > "$OUT/warm_$name.log" 2>&1 &
  done
  wait
  for b in "${builds[@]}"; do
    take "$b"
    # shellcheck disable=SC2086
    run "costs_$name" 90 python -m tools.step_costs "$kind" $flag \
      ${COST_ROWS:-128,1,4096,16 128,1,8192,16 128,1,16384,16}
  done
  unset TORCH_MLA_CACHE_DIR
  grep -h "fit over" "$OUT"/costs_*.log
  rm -rf "$OUT"/cache_*
elif [[ $mode == check ]]; then
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
