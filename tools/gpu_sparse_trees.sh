#!/usr/bin/env bash
# Sparse decode trees side by side on the H200, one device call: each tree's sparse steps
# compiled (all trees at once), its GPU tests and memcheck, then each tree's
# `benchmarks/bench_decode.py --sparse-kernels` in turn, FlashMLA's sparse decode beside every
# row (when .peers/flashmla-sm90-sparse holds it). Logs in $OUT, a summary printed last.
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_sparse_trees.sh main=. p4=.abtrees/p4 ...
#
# A tree is a directory holding torch_mla/, benchmarks/, tests/ and tools/ (fill one with
# `git archive BRANCH torch_mla benchmarks tests tools | tar -x -C .abtrees/NAME`; .abtrees is
# git-ignored). Every command runs from the tree with the tree first on PYTHONPATH, so each
# imports its own torch_mla (the logs' first lines say which); each tree compiles into its own
# kernel cache directory.
# Env: HEADS (--heads of the bench; default 16,32), SEL (pytest -k of the tests; default
# "sm90_keysm or many_blocks"), CACHES (memcheck's cache formats; default "e4m3 fp8_ds_mla"),
# FLAGS (environment of the tests and memcheck, e.g. "TORCH_MLA_SPARSE_SM90=1
# TORCH_MLA_SPARSE_KEYSM=0"; default none), ROUNDS (bench rounds over the trees; default 1).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # $OUT, $ROOT, summary, preamble

HEADS=${HEADS:-16,32}
SEL=${SEL:-"sm90_keysm or many_blocks"}
CACHES=${CACHES:-"e4m3 fp8_ds_mla"}
read -r -a FLAGS <<< "${FLAGS:-}"
ROUNDS=${ROUNDS:-1}
(( $# )) || { echo "usage: gpu_sparse_trees.sh NAME=DIR ..."; exit 2; }
names=(); dirs=()
for a in "$@"; do names+=("${a%%=*}"); dirs+=("$(cd "${a#*=}" && pwd)"); done
preamble flashmla-sm90-sparse
base_path=${PYTHONPATH:-}

# in_tree I LIMIT CMD...: CMD (at most LIMIT seconds) from tree I, its own package first on the
# path and its own kernel cache.
in_tree() {
  local i=$1 limit=$2; shift 2
  (cd "${dirs[i]}" && PYTHONPATH="${dirs[i]}:$base_path" \
     TORCH_MLA_CACHE_DIR="/tmp/torch_mla_cache_${names[i]}" timeout "$limit" "$@")
}

# trun NAME I LIMIT CMD...: gpu_run.sh's `run` for a command in tree I.
trun() {
  local name=$1 i=$2 limit=$3; shift 3
  local t0=$SECONDS
  echo "== $name: $*"
  in_tree "$i" "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$OUT/$name.log"
  summary+=("$(printf '%-24s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$OUT/$name.log")")
}

t0=$SECONDS; pids=()
for i in "${!names[@]}"; do
  in_tree "$i" 300 python -m torch_mla.precompile --arch sm_90a \
    --kernels sparse,schedule,append_kv --jobs 8 > "$OUT/precompile_${names[i]}.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[i]}" || echo "precompile ${names[i]} failed: $OUT/precompile_${names[i]}.log"
done
summary+=("$(printf '%-16s %4ss  %s trees' precompile $((SECONDS - t0)) "${#names[@]}")")

for i in "${!names[@]}"; do
  n=${names[i]}
  trun "tests_$n" "$i" 240 env "${FLAGS[@]}" python -m pytest -m cuda -q \
    -p no:cacheprovider tests/test_sparse_kernel.py tests/test_sparse.py -k "$SEL"
  for c in $CACHES; do
    if command -v compute-sanitizer > /dev/null; then
      trun "memcheck_${n}_$c" "$i" 60 compute-sanitizer --tool memcheck \
        env "${FLAGS[@]}" python -m tools.sparse_memcheck --cache "$c"
    fi
  done
done
for r in $(seq "$ROUNDS"); do
  for i in "${!names[@]}"; do
    trun "bench_${names[i]}_$r" "$i" 200 python -c "import runpy, sys, torch_mla
print('# torch_mla from', torch_mla.__file__, flush=True)
sys.argv[0] = 'benchmarks/bench_decode.py'
runpy.run_path(sys.argv[0], run_name='__main__')" --sparse-kernels --heads "$HEADS"
  done
done
echo; echo "== summary ($OUT)"
printf '%s\n' "${summary[@]}"
grep -H "ERROR SUMMARY" "$OUT"/memcheck_*.log 2>/dev/null
for f in "$OUT"/tests_*.log; do echo "$f: $(grep -E 'passed|failed' "$f" | tail -1)"; done
