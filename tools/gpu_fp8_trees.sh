#!/usr/bin/env bash
# Two trees' FP8 paths side by side in one device call (session 28's conversion A/B): both
# trees' kernels compiled at once, each into its own cache; their outputs recorded and compared
# bit for bit (tools/record_outputs.py, the decode cases); the dense exact rows
# (bench_decode.py --fp8) and the sparse heads-on-M rows (tools/sparse_rows.py sm90 over the
# 656-byte rows and e4m3) with the trees' processes alternated ROUNDS times; the new tree's FP8
# GPU tests. Logs in $OUT, a summary and the rows printed last.
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_fp8_trees.sh OLD_DIR NEW_DIR
#
# A tree: torch_mla/, benchmarks/, tests/ and tools/ (`git archive COMMIT torch_mla benchmarks
# tests tools | tar -x -C .abtrees/NAME`; .abtrees is git-ignored); NEW_DIR may be ".".
# Env: DROWS (dense B,S_Q,S_K,H_Q rows), SROWS (sparse B,S_Q,H_Q rows), ROUNDS (default 3).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # $OUT, run, preamble, finish
(( $# == 2 )) || { echo "usage: gpu_fp8_trees.sh OLD_DIR NEW_DIR"; exit 2; }
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd)
DROWS=${DROWS:-"128,1,8192,128 128,2,8192,128 128,1,8192,64 32,1,8192,128"}
SROWS=${SROWS:-"128,1,64 128,1,128"}
ROUNDS=${ROUNDS:-3}
preamble flashmla-sm90-sparse
KS=step,fp8_step,fp8_fast,portable,schedule,append_kv,sparse
for t in old new; do
  if [[ $t == old ]]; then d=$OLD; else d=$NEW; fi
  (cd "$d" && PYTHONPATH="$d:${PYTHONPATH:-}" TORCH_MLA_CACHE_DIR=/tmp/c_$t timeout 300 \
    python -m torch_mla.precompile --arch sm_90a --kernels $KS --jobs 7 > "$OUT/pre_$t.log" 2>&1) &
done
wait
tail -n 1 "$OUT/pre_old.log" "$OUT/pre_new.log"
T_old=(env -C "$OLD" PYTHONPATH="$OLD:${PYTHONPATH:-}" TORCH_MLA_CACHE_DIR=/tmp/c_old)
T_new=(env -C "$NEW" PYTHONPATH="$NEW:${PYTHONPATH:-}" TORCH_MLA_CACHE_DIR=/tmp/c_new)
rec=$ROOT/tools/record_outputs.py
run rec_old 150 "${T_old[@]}" python "$rec" record /tmp/old.pt --only decode
run rec_new 150 "${T_new[@]}" python "$rec" record /tmp/new.pt --only decode
run compare 60 python "$rec" compare /tmp/old.pt /tmp/new.pt
for round in $(seq "$ROUNDS"); do
  for t in old new; do
    if [[ $t == old ]]; then T=("${T_old[@]}"); else T=("${T_new[@]}"); fi
    run "dense_${t}_$round" 90 "${T[@]}" python benchmarks/bench_decode.py --fp8 --no-check $DROWS
    run "sparse_${t}_$round" 90 "${T[@]}" TAG="r$round $t" sh -c \
      "python -m tools.sparse_rows sm90 656 $SROWS && python -m tools.sparse_rows sm90 e4m3 $SROWS"
  done
done
run bf16 60 "${T_new[@]}" python benchmarks/bench_decode.py --no-check $DROWS
run tests 240 "${T_new[@]}" python -m pytest -m cuda -q -p no:cacheprovider tests/test_fp8.py
finish
tail -n 1 "$OUT/compare.log"
for f in "$OUT"/dense_*.log "$OUT/bf16.log"; do grep -h "^| [0-9]" "$f" | sed "s|^|$(basename "$f" .log) |"; done
grep -h " us" "$OUT"/sparse_*.log
