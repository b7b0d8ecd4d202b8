#!/usr/bin/env bash
# The H200 check of a change, in one device call: full logs in $OUT, a summary printed last.
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_check.sh [STAGE ...]    # default: all stages
#
# Stages, in this order (each one's failure leaves the later ones running):
#   precompile  every kernel variant of this tree, and of .baseline/ when present, into the disk
#               cache: one `python -m torch_mla.precompile` per (kernels, dtype, causal), all in
#               parallel (timed; the record stage then loads instead of compiling)
#   record      tools/record_outputs.py on this tree and on .baseline/, then compare: every
#               variant's outputs bit for bit (exit 1 of compare: something differs)
#   bench       benchmarks/bench_decode.py, FlashMLA timed beside it when .peers/ holds it
#   bench_old   the same for the old tree (.baseline/benchmarks/bench_decode.py), on request
#   tests       python -m pytest -m cuda -q
#   trace       on request: tools/trace_decode.py over the 16-bit cache, then (--fp8) exact mode,
#               at TRACE_ROWS (default b 128, s_k 8192, h_q 128 and 64): each warpgroup's waits
#               in a pair and its next page's landing and expansion (docs/kernel-notes.md, "Exact
#               mode at 128 heads")
# Roughly 1.5 + 1.5 + 3 + 5 min on an H200 (a device call may run 10 min: give the stages over
# two calls if needed; the disk cache stays while the machine is warm).
#
# Carried along (git-ignored: list them in .git/info/exclude), beside .devpkgs/b:
#   .baseline/torch_mla   the old tree's package:  mkdir -p .baseline &&
#                         cp -r /work/baseline/torch_mla .baseline/   (~0.6 MB)
#   .peers/flashmla-sm90  FlashMLA, shared/anchors/flashmla-sm90/README.md (13 MB)
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # set -u, $OUT, $ROOT, run, summary
stages=${*:-precompile record bench tests}

# precompile_tree NAME DIR: every variant the record stage runs, of the torch_mla in DIR (run
# from DIR: `python -m` puts the working directory first on sys.path), one process per
# (kernels, dtype, causal), all at once; output in $OUT/NAME.log, status and time in summary.
precompile_tree() {
  local name=$1 dir=$2 log="$OUT/$1.log" pids=() t0=$SECONDS k d c p rc=0
  : > "$log"
  for k in step fp8_step fp8_fast portable; do
    for d in bf16 fp16; do
      for c in false true; do
        (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 400 python -m torch_mla.precompile \
           --arch sm_90a --kernels "$k" --dtypes "$d" --causal "$c") >> "$log" 2>&1 &
        pids+=($!)
      done
    done
  done
  for d in bf16 fp16; do
    (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH" timeout 400 python -m torch_mla.precompile \
       --arch sm_90a --kernels schedule,append_kv --dtypes "$d") >> "$log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  echo "$name: $(grep -c -E '^(built|cached)' "$log") variants built or cached, rc=$rc"
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) "$log")")
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
have_old=0; [[ -d .baseline/torch_mla ]] && have_old=1
if [[ -d .peers/flashmla-sm90 ]]; then export PYTHONPATH="$ROOT/.peers/flashmla-sm90:$PYTHONPATH"; fi
python -c "import torch_mla; print('torch_mla from', torch_mla.__file__)"

for stage in $stages; do
  case $stage in
    precompile)  # (the two trees one after the other: each already fills the 16 cores)
      # This tree: one precompile call, its own worker processes (--jobs: the CPU count).
      run precompile_new 400 python -m torch_mla.precompile --arch sm_90a \
        --kernels step,fp8_step,fp8_fast,keysm,keysm64,sparse,portable,schedule,append_kv
      (( have_old )) && precompile_tree precompile_old "$ROOT/.baseline"
      ;;
    record)
      run record_new 300 python tools/record_outputs.py record "$OUT/outputs_new.pt"
      if (( have_old )); then
        run record_old 300 env PYTHONPATH="$ROOT/.baseline:$PYTHONPATH" \
          python tools/record_outputs.py record "$OUT/outputs_old.pt"
        run compare 120 python tools/record_outputs.py compare "$OUT/outputs_old.pt" \
          "$OUT/outputs_new.pt"
      else
        summary+=("compare          skipped: no .baseline/torch_mla")
      fi
      ;;
    bench)
      python -c "import flash_mla" 2>/dev/null || echo "(flash_mla does not import: no peer column)"
      run bench 420 python benchmarks/bench_decode.py
      ;;
    bench_old)  # the old tree's own benchmark script (.baseline/benchmarks), same machine start
      if [[ -f .baseline/benchmarks/bench_decode.py ]]; then
        run bench_old 420 env PYTHONPATH="$ROOT/.baseline:$PYTHONPATH" \
          python .baseline/benchmarks/bench_decode.py
      else
        summary+=("bench_old        skipped: no .baseline/benchmarks/bench_decode.py")
      fi
      ;;
    tests)
      run tests 540 python -m pytest -m cuda -q -p no:cacheprovider tests
      ;;
    trace)
      # shellcheck disable=SC2086
      run trace 240 python -m tools.trace_decode "$OUT" ${TRACE_ROWS:-128,1,8192,128 128,1,8192,64}
      # shellcheck disable=SC2086
      run trace_fp8 240 python -m tools.trace_decode --fp8 "$OUT" \
        ${TRACE_ROWS:-128,1,8192,128 128,1,8192,64}
      ;;
    *) echo "unknown stage $stage (precompile, record, bench, bench_old, tests, trace)"
       summary+=("$stage unknown");;
  esac
done

echo; echo "== summary ($OUT)"
printf '%s\n' "${summary[@]}"
grep -h '^summary:' "$OUT/compare.log" 2>/dev/null
