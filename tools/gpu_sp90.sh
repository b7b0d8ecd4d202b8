#!/usr/bin/env bash
# The SM90 sparse decode kernel's first H200 run, in one device call (at most 9.5 min, ~5 typical): logs in $OUT, a
# summary printed last.
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_sp90.sh
#
# Stages (each one's failure leaves the later ones running; each has a timeout, since a kernel
# whose TMA transactions never complete hangs rather than fails):
#   precompile  the sparse steps (portable and SM90), schedule and append_kv for sm_90a
#   smoke       one small case on the SM90 kernel (a hang shows here, in 150 s, not in the grid)
#   tests       tests/test_sparse_kernel.py's "sm90" cases (they set TORCH_MLA_SPARSE_SM90=1)
#   memcheck    compute-sanitizer memcheck of tools/sparse_memcheck.py on the SM90 kernel
#   bench       benchmarks/bench_decode.py --sparse on the SM90 kernel, FlashMLA's sparse decode
#               timed beside it when .peers/flashmla-sm90-sparse holds it
# Success: every stage rc=0; the tests log ends "N passed" (no failure); memcheck's log says
# "ERROR SUMMARY: 0 errors"; the bench log has "# sparse kernel: sm90" and a row per
# configuration.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # $OUT, run, preamble, memcheck, finish

preamble flashmla-sm90-sparse

run precompile 150 python -m torch_mla.precompile --arch sm_90a \
  --kernels sparse,schedule,append_kv
run smoke 90 python -m pytest -m cuda -x -q -p no:cacheprovider tests/test_sparse_kernel.py \
  -k "sm90 and (runs_not_the_reference or grid_matches_fp64 and 16-1-64)"
run tests 170 python -m pytest -m cuda -q -p no:cacheprovider tests/test_sparse_kernel.py -k sm90
TORCH_MLA_SPARSE_SM90=1 memcheck 60 python -m tools.sparse_memcheck
python -c "import flash_mla" 2>/dev/null || echo "(flash_mla does not import: no peer column)"
run bench 100 env TORCH_MLA_SPARSE_SM90=1 python benchmarks/bench_decode.py --sparse
finish
