#!/usr/bin/env bash
# The heads-on-M fast mode with P dithered (TORCH_MLA_FAST_DITHER=1, MLADecodeSm90Fast.p_dither;
# compiled only until this runs) on the H200, in one device call (~7 min): logs in $OUT.
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_fast_dither.sh
#
# Stages (each has a timeout):
#   precompile  the heads-on-M fast steps with and without the dither, schedule
#   tests       tests/test_fp8.py's fast-mode cases with the flag (check_fast_mode's bound:
#               2.5 e_store; TORCH_MLA_KEYSM_FAST=0, so every shape runs the heads-on-M kernel)
#   fuzz        tools/fuzz_decode.py --fast, 2000 cases with the flag (session 23: 49 of 2000
#               failed without it, all above 32 rows, on this kernel)
#   error       tools/fast_mode_error.py with the flag: the kernel's error beside the float64
#               emulations (its "dithered by low bits" column is what the kernel now does)
#   bench       tools/keysm_rows.py fast0 then dither on the h_q 128 and 64 rows (the dither's
#               cost where the softmax's instructions count)
# Success: every stage rc=0, "N passed", the fuzz's "0 failed".
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # $OUT, run, preamble, memcheck, finish

preamble flashmla-sm90
export TORCH_MLA_KEYSM_FAST=0
run precompile 120 python -m torch_mla.precompile --arch sm_90a \
  --kernels fp8_fast,fp8_dither,schedule
run tests 180 env TORCH_MLA_FAST_DITHER=1 python -m pytest -m cuda -q -p no:cacheprovider \
  tests/test_fp8.py -k "not exact"
stop_if_hung tests
run fuzz 150 env TORCH_MLA_FAST_DITHER=1 python -m tools.fuzz_decode --fast --cases 2000 --seed 0
stop_if_hung fuzz
run error 90 env TORCH_MLA_FAST_DITHER=1 python -m tools.fast_mode_error
ROWS=${ROWS:-"128,1,8192,128 128,2,8192,128 128,1,8192,64 1,1,4096,128"}
# (one round each: the row times of one process, then the other, on one machine start)
# shellcheck disable=SC2086
run bench_fast0 60 python -m tools.keysm_rows fast0 $ROWS
# shellcheck disable=SC2086
run bench_dither 60 python -m tools.keysm_rows dither $ROWS
finish
