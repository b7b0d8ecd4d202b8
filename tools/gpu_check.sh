#!/usr/bin/env bash
# One device call: smoke test, GPU tests, benchmark. Logs go to $OUT (when set).
# Usage (after `source .devpkgs/b/setup.sh`): bash tools/gpu_check.sh [smoke|tests|bench|portable|all]
# (portable: the portable kernel's grid and speed, tools/check_portable.py; extra args pass on)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-all}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [[ $what == smoke || $what == all ]]; then
  timeout 300 python tools/smoke_sm90.py 2>&1 | tee "$OUT/smoke.log"
  rc=${PIPESTATUS[0]}; echo "smoke rc=$rc"
  [[ $rc != 0 ]] && exit $rc
fi
if [[ $what == tests || $what == all ]]; then
  timeout 600 python -m pytest -x -q -p no:logging tests/test_kernel_sm90.py tests/test_compile.py \
    2>&1 | tee "$OUT/tests.log" | tail -25
fi
if [[ $what == bench || $what == all ]]; then
  timeout 600 python benchmarks/bench_decode.py "${@:2}" 2>&1 | tee "$OUT/bench.log"
fi
if [[ $what == portable ]]; then
  timeout 600 python tools/check_portable.py "${@:2}" 2>&1 | tee "$OUT/portable.log"
  exit ${PIPESTATUS[0]}
fi
