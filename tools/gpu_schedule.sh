#!/usr/bin/env bash
# The schedule's part count (as few parts as keep the heaviest at ceil(T / P) units; built in
# session 44, run and merged in session 45) on an H100/H200, one device call: logs in $OUT, a
# summary printed last.
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_schedule.sh [MODE]
#
#   check   the schedule kernel against compute_schedule (tests/test_small_kernels.py -k
#           schedule), the sparse rows (ROWS) of the working tree and of .abtrees/old (a tree
#           to compare with; before the rule: `git archive 13cf9de torch_mla tools benchmarks |
#           tar -x -C .abtrees/old`, as run in session 45), each in its own kernel cache,
#           alternated twice with FlashMLA (tools/sparse_rows.py split / flashmla), then
#           tests/test_schedule_mismatch.py and the split's sparse tests
#           (tests/test_sparse_kernel.py -k sm90_split)
#   quick   check's steps for a short call: the working tree's rows and FlashMLA's, one round,
#           no old tree; the split's tests last
#   dense   tools/ab_trees.sh over the dense rows (DROWS), old=.abtrees/old new=. with FlashMLA
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/.peers/flashmla-sm90-sparse:${PYTHONPATH:-}"
ROWS=${ROWS:-"2,1,128 2,2,128 2,1,64 2,2,64 4,1,128 8,1,128 32,1,128 32,2,64 128,1,128"}
DROWS=${DROWS:-"1,1,4096,128 2,1,4096,128 4,1,4096,128 1,1,16384,128 8,1,4096,128 1,1,4096,16"}
summary=()
run() {  # NAME TIMEOUT CMD...: the command's output in $OUT/NAME.log, its status in the summary
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-10s rc %s  %s' "$name" "$rc" "$(tail -n 1 "$OUT/$name.log" | cut -c1-110)")")
}
case ${1:-check} in
  check)
    python -c "import cutlass" || { echo "no cutlass: source .devpkgs/b/setup.sh first"; exit 3; }
    [[ -d .abtrees/old/torch_mla ]] || { echo "no .abtrees/old"; exit 2; }
    F=(TORCH_MLA_SPARSE_SM90=1 TORCH_MLA_SPARSE_KEYSM=0 TORCH_MLA_SPARSE_PRODUCER=split)
    K=(--arch sm_90a --kernels sparse_split,schedule --dtypes bf16 --jobs 8)
    # (the mismatch tests' dense steps too)
    TORCH_MLA_CACHE_DIR=/tmp/cnew timeout 150 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse_split,schedule,step --causal both --dtypes bf16 --jobs 8 \
      > "$OUT/pre_new.log" 2>&1 &
    (cd .abtrees/old && TORCH_MLA_CACHE_DIR=/tmp/cold timeout 150 python -m torch_mla.precompile \
      "${K[@]}" > "$OUT/pre_old.log" 2>&1) &
    wait
    export TORCH_MLA_CACHE_DIR=/tmp/cnew
    run sched 120 python -m pytest -m cuda -q -p no:cacheprovider tests/test_small_kernels.py \
      -k schedule
    for i in 1 2; do
      TAG=new timeout 60 python -m tools.sparse_rows split 656 $ROWS
      (cd .abtrees/old && TORCH_MLA_CACHE_DIR=/tmp/cold TAG=old timeout 60 \
        python -m tools.sparse_rows split 656 $ROWS)
      TAG=fm timeout 60 python -m tools.sparse_rows flashmla 656 $ROWS
    done > "$OUT/rows.log" 2>&1
    run mismatch 100 python -m pytest -m cuda -q -p no:cacheprovider \
      tests/test_schedule_mismatch.py
    run split 170 env "${F[@]}" python -m pytest -m cuda -q -p no:cacheprovider \
      tests/test_sparse_kernel.py -k sm90_split
    grep -v "^#" "$OUT/rows.log" | cut -c1-110
    grep -h "passed\|failed" "$OUT"/sched.log "$OUT"/mismatch.log "$OUT"/split.log | tail -n 3 ;;
  quick)  # check's steps for a short call: no old tree, one round, the split's tests last
    python -c "import cutlass" || { echo "no cutlass: source .devpkgs/b/setup.sh first"; exit 3; }
    F=(TORCH_MLA_SPARSE_SM90=1 TORCH_MLA_SPARSE_KEYSM=0 TORCH_MLA_SPARSE_PRODUCER=split)
    export TORCH_MLA_CACHE_DIR=/tmp/cnew
    timeout 120 python -m torch_mla.precompile --arch sm_90a --kernels sparse_split,schedule,step \
      --causal both --dtypes bf16 --jobs 16 > "$OUT/pre_new.log" 2>&1
    run sched 90 python -m pytest -m cuda -q -p no:cacheprovider tests/test_small_kernels.py \
      -k schedule
    grep -h "passed\|failed" "$OUT/sched.log" | tail -n 1
    (TAG=new timeout 40 python -m tools.sparse_rows split 656 $ROWS
     TAG=fm timeout 40 python -m tools.sparse_rows flashmla 656 $ROWS) > "$OUT/rows.log" 2>&1
    grep -v "^#" "$OUT/rows.log" | cut -c1-90
    run mismatch 80 python -m pytest -m cuda -q -p no:cacheprovider \
      tests/test_schedule_mismatch.py
    grep -h "passed\|failed" "$OUT/mismatch.log" | tail -n 1
    run split 170 env "${F[@]}" python -m pytest -m cuda -q -p no:cacheprovider \
      tests/test_sparse_kernel.py -k sm90_split
    grep -h "passed\|failed" "$OUT/split.log" | tail -n 1 ;;
  dense)
    ROWS="$DROWS" PEER=1 timeout 520 bash tools/ab_trees.sh old=.abtrees/old new=. \
      > "$OUT/dense.log" 2>&1
    tail -n 30 "$OUT/dense.log" ;;
  *) echo "modes: check, quick, dense"; exit 2 ;;
esac
printf '%s\n' "${summary[@]}"
