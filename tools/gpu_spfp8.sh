#!/usr/bin/env bash
# The portable sparse kernel over the FP8 caches (float8_e4m3fn + kv_scale, DeepSeek-V3.2's
# 656-byte rows): its first GPU run, in one device call (at most 6 min, ~4 typical); logs in
# $OUT, a summary printed last.
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_spfp8.sh
#
# Stages (each one's failure leaves the later ones running; each has a timeout):
#   precompile  the sparse steps (every cache format), schedule and append_kv for sm_90a, in
#               parallel processes
#   smoke       the FP8 formats' "runs the kernel" cases, then two 16-bit cases (the portable
#               kernel's shared code changed: a kernel parameter, the stage buffers' address)
#   tests       tests/test_sparse_kernel.py's fp8 cases
#   memcheck    compute-sanitizer memcheck of tools/sparse_memcheck.py over the 656-byte rows
#   bench       benchmarks/bench_decode.py --sparse: ours over bf16 and over the 656-byte rows,
#               FlashMLA's sparse decode beside them when .peers/flashmla-sm90-sparse holds it
# Success: every stage rc=0; the tests log ends "N passed" (no failure); memcheck's log says
# "ERROR SUMMARY: 0 errors" and "ok fp8_ds_mla ... True True"; the bench log has
# "# over the 656-byte cache: sm80" and a number in the "ours 656 B us" column of each row.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # $OUT, run, preamble, memcheck, finish

preamble flashmla-sm90-sparse

run precompile 90 python -m torch_mla.precompile --arch sm_90a \
  --kernels sparse,schedule,append_kv
run smoke 40 python -m pytest -m cuda -x -q -p no:cacheprovider tests/test_sparse_kernel.py \
  -k "fp8_runs_the_kernel or (sm80 and (runs_not_the_reference or grid_matches_fp64 and 64-2-2048))"
run tests 80 python -m pytest -m cuda -q -p no:cacheprovider tests/test_sparse_kernel.py -k fp8
memcheck 45 python -m tools.sparse_memcheck --cache fp8_ds_mla
python -c "import flash_mla" 2>/dev/null || echo "(flash_mla does not import: no peer column)"
run bench 85 python benchmarks/bench_decode.py --sparse
finish
