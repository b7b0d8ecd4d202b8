# Sourced by the GPU scripts (tools/gpu_check.sh, tools/gpu_sparse.sh, tools/gpu_keysm.sh), from
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
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1  # (-k: SIGKILL 10 s after SIGTERM)
  local rc=$?
  tail -n 15 "$OUT/$name.log"
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$OUT/$name.log")")
  return $rc
}

# preamble PEER: the GPU and its clocks, .peers/PEER on PYTHONPATH when it is there (a FlashMLA
# build to time beside ours), the torch_mla this run imports.
preamble() {
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
  if [[ -d ".peers/$1" ]]; then export PYTHONPATH="$ROOT/.peers/$1:${PYTHONPATH:-}"; fi
  python -c "import torch_mla; print('torch_mla from', torch_mla.__file__)"
}

# memcheck TIMEOUT CMD...: stage "memcheck" ($MEMCHECK_NAME where set), CMD under compute-sanitizer's memcheck (skipped,
# with a summary line, where compute-sanitizer is not on PATH). API errors are not reported: the
# DSL's compiles probe the driver (cuGetProcAddress) and would count as errors in its summary.
memcheck() {
  local limit=$1; shift
  if command -v compute-sanitizer > /dev/null; then
    run "${MEMCHECK_NAME:-memcheck}" "$limit" compute-sanitizer --tool memcheck --report-api-errors no "$@"
  else
    summary+=("memcheck         skipped: no compute-sanitizer on PATH")
  fi
}

# finish: the summary, memcheck's error count and the tests' last pass/fail line; every log and
# text file under $OUT also in $OUT/0_logs.tgz (the device call returns only the first few files
# of $OUT by name, session 34: this one sorts first).
finish() {
  (cd "$OUT" && find . -type f \( -name '*.log' -o -name '*.txt' \) -print0 |
    tar --null -czf 0_logs.tgz -T -) 2>/dev/null
  echo; echo "== summary ($OUT)"
  printf '%s\n' "${summary[@]}"
  grep -H "ERROR SUMMARY" "$OUT"/memcheck*.log 2>/dev/null
  grep -h -E "passed|failed" "$OUT/tests.log" 2>/dev/null | tail -1
}

# stop_if_hung NAME: after `run NAME ...` (its status in $?), a timed-out stage (124, or 137
# when killed) means a hang: print the summary and leave, since every later stage would wait
# out its own timeout past the device call's 600 s.
stop_if_hung() {
  local rc=$?
  if [[ $rc == 124 || $rc == 137 ]]; then
    echo "$1 timed out: a hang; the later stages skipped"; finish; exit 1
  fi
}
