# Sourced by the GPU scripts (tools/gpu_check.sh, tools/gpu_sp90.sh, tools/gpu_keysm.sh), from
# the repository root: strict variables, $OUT (default /tmp/out, created), $ROOT (the working
# directory), unbuffered Python, and `run`, which records each stage's log in $OUT and its
# status and time in the array `summary`.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(pwd)
export PYTHONUNBUFFERED=1
summary=()

# run NAME TIMEOUT CMD...: CMD's output to $OUT/NAME.log (and its tail here), its status and
# time to the summary.
run() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "== $name: $*"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 15 "$OUT/$name.log"
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$OUT/$name.log")")
  return $rc
}
