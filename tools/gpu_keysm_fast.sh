#!/usr/bin/env bash
# Fast mode of the keys-on-M ping-pong variant (cute_kernels/sm90_keysm_fast_decode.py) on the
# H200, in one device call (~6 min): logs in $OUT (few files: a run returns at most 10).
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_keysm_fast.sh
#
# Stages (each has a timeout: a kernel whose mbarriers never complete hangs rather than fails):
#   precompile  the keys-on-M steps, the ping-pong and fast steps, the heads-on-M fp8 steps
#               (exact and fast), schedule: parallel processes
#   tests       tests/test_keysm_fast.py on the GPU, then tests/test_fp8.py's fast-mode cases
#               (the dispatch's default: those of <= 16 rows a KV head run this kernel, <= 32 from a batch of 4)
#   memcheck    compute-sanitizer memcheck of tools/keysm_memcheck.py, fast mode
#   fuzz        tools/fuzz_decode.py --fast, 2000 cases (fast mode's bounds)
#   bench_bf16, bench_fp8
#               benchmarks/bench_decode.py --keysm (bf16), then --keysm --fp8 --rs --fast, one
#               process each, same machine start
# Success: every stage rc=0, "N passed", "ERROR SUMMARY: 0 errors".
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # $OUT, run, preamble, memcheck, finish

preamble flashmla-sm90

run precompile 200 python -m torch_mla.precompile --arch sm_90a \
  --kernels keysm,keysm_rs,keysm_fast,fp8_step,fp8_fast,schedule
run tests 200 python -m pytest -m cuda -q -p no:cacheprovider tests/test_keysm_fast.py
run tests_fp8 200 python -m pytest -m cuda -q -p no:cacheprovider \
  tests/test_fp8.py -k "not exact"
TORCH_MLA_KEYSM_FAST=1 memcheck 90 python -m tools.keysm_memcheck
run fuzz 200 python -m tools.fuzz_decode --fast --cases 2000 --seed 0
ROWS=${ROWS:-"128,1,8192,16 128,1,8192,8 64,1,16384,16 128,2,8192,8 16,1,32768,16 64,1,2048,16
      32,1,4096,16 1,1,4096,16"}
# shellcheck disable=SC2086
run bench_bf16 120 python benchmarks/bench_decode.py --keysm --no-check $ROWS
# shellcheck disable=SC2086
run bench_fp8 200 python benchmarks/bench_decode.py --keysm --fp8 --rs --fast $ROWS
finish
