#!/usr/bin/env bash
# The keys-on-M SM90 decode kernel's first H200 run (issue 31), in one device call (at most
# ~9 min, ~5 typical): logs in $OUT, a summary printed last.
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_keysm.sh
#
# Stages (each one's failure leaves the later ones running; each has a timeout, since a kernel
# whose TMA transactions or mbarriers never complete hangs rather than fails):
#   precompile  the keys-on-M steps (every column count, both cache formats) and the current
#               SM90 steps they are timed beside, schedule and append_kv: parallel processes
#   smoke       one small case on the keys-on-M kernel (a hang shows here, in 90 s)
#   tests       tests/test_keysm.py on the GPU (the grid against the fp32 reference)
#   memcheck    compute-sanitizer memcheck of tools/keysm_memcheck.py
#   bench_bf16, bench_fp8
#               benchmarks/bench_decode.py --keysm on issue 31's memory-bound rows (b128 s_k 8192
#               h_q 16 and 32, b64 s_k 16384 h_q 16, b128 s_q 2 causal h_q 16): the current
#               kernel's row, FlashMLA beside it when .peers/flashmla-sm90 holds it, and a
#               "keys-on-M" line under it (us, % of the copy ceiling, ratio to the row above and
#               to FlashMLA, error against the reference)
# Success: every stage rc=0; the tests log ends "N passed" (no failure); memcheck's log says
# "ERROR SUMMARY: 0 errors"; each bench row has its keys-on-M line with rel err ~1e-3 or below.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # $OUT, run, preamble, memcheck, finish

preamble flashmla-sm90

run precompile 150 python -m torch_mla.precompile --arch sm_90a \
  --kernels keysm,step,fp8_step,schedule,append_kv

run smoke 90 python -m pytest -m cuda -x -q -p no:cacheprovider tests/test_keysm.py \
  -k "test_grid and bf16 and 16-1-False"
run tests 150 python -m pytest -m cuda -q -p no:cacheprovider tests/test_keysm.py
memcheck 60 python -m tools.keysm_memcheck
python -c "import flash_mla" 2>/dev/null || echo "(flash_mla does not import: no peer column)"
ROWS="128,1,8192,16 128,1,8192,32 64,1,16384,16 128,2,8192,16"
# shellcheck disable=SC2086
run bench_bf16 60 python benchmarks/bench_decode.py --keysm $ROWS
# shellcheck disable=SC2086
run bench_fp8 60 python benchmarks/bench_decode.py --keysm --fp8 $ROWS
finish
grep -h "keys-on-M" "$OUT"/bench_*.log
