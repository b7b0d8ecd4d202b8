#!/usr/bin/env bash
# Same-run A/B of whole trees on the H200: each tree's bench_decode.py over the same rows, the
# trees alternated ROUNDS times in one machine start, one table of medians at the end.
#
#   source .devpkgs/b/setup.sh && bash tools/ab_trees.sh [NAME=DIR ...]
#
# A tree is a directory holding torch_mla/ and benchmarks/ (its own bench script runs it).
# Default trees: old=.baseline, then every .abtrees/NAME in `ls` order (git-ignored; fill one
# with `git archive COMMIT torch_mla benchmarks | tar -x -C .abtrees/NAME`). Env: ROWS
# (default the four short-segment anchor rows), ROUNDS (2), PEER=0 leaves FlashMLA out (else it
# is timed beside each run when .peers/flashmla-sm90 exists: a same-run check on drift).
# Each tree's bf16 non-causal step and schedule kernel are compiled first, all trees at once,
# into the disk cache (its key holds a hash of the tree's kernel sources: no tree loads
# another's kernels). Logs and results.tsv in $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$(pwd)
ROWS=${ROWS:-"8,1,4096,128 32,1,4096,128 64,1,2048,16 1,1,4096,128"}
ROUNDS=${ROUNDS:-2}
export PYTHONUNBUFFERED=1
if [[ ${PEER:-1} != 0 && -d .peers/flashmla-sm90 ]]; then
  export PYTHONPATH="$ROOT/.peers/flashmla-sm90:${PYTHONPATH:-}"
fi

names=(); dirs=()
if (( $# )); then
  for a in "$@"; do names+=("${a%%=*}"); dirs+=("$ROOT/${a#*=}"); done
else
  [[ -d .baseline/torch_mla ]] && { names+=(old); dirs+=("$ROOT/.baseline"); }
  for d in .abtrees/*/; do
    [[ -d $d/torch_mla ]] && { names+=("$(basename "$d")"); dirs+=("$ROOT/${d%/}"); }
  done
fi
(( ${#names[@]} )) || { echo "no trees (.baseline, .abtrees/NAME)"; exit 2; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader

# Compile: one process per tree, all at once (a step is ~1 min of a core).
t0=$SECONDS; pids=()
for i in "${!names[@]}"; do
  (cd "${dirs[i]}" && PYTHONPATH="${dirs[i]}:${PYTHONPATH:-}" timeout 400 python -m \
     torch_mla.precompile --arch sm_90a --kernels step,schedule --dtypes bf16 --causal false) \
    > "$OUT/precompile_${names[i]}.log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  wait "${pids[i]}" || echo "precompile ${names[i]} failed: $OUT/precompile_${names[i]}.log"
done
echo "precompile: $((SECONDS - t0)) s for ${#names[@]} trees"

# Bench: rounds x trees, each tree's own script over its own package (run from the tree, so
# the tree is first on sys.path; each log's first line says which package was imported).
BENCH="import runpy, sys, torch_mla; print('# torch_mla from', torch_mla.__file__, flush=True)
sys.argv[0] = 'benchmarks/bench_decode.py'; runpy.run_path(sys.argv[0], run_name='__main__')"
for round in $(seq "$ROUNDS"); do
  for i in "${!names[@]}"; do
    log="$OUT/bench_${names[i]}_$round.log"
    (cd "${dirs[i]}" && PYTHONPATH="${dirs[i]}:${PYTHONPATH:-}" timeout 200 python -c "$BENCH" \
       --no-check $ROWS) > "$log" 2>&1 || echo "bench ${names[i]} round $round failed: $log"
    grep -m1 '^# torch_mla from' "$log"
  done
done

# The table. bench_decode's rows: | b | s_q | s_k | h_q | causal | us | ... | FlashMLA us
# (anchor), with "(x here)" when timed beside | ...
python - "$OUT" "$ROUNDS" "${names[@]}" <<'PY'
import re
import statistics
import sys
from collections import defaultdict

out, rounds, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
us, fm, rows = defaultdict(list), defaultdict(list), []
for n in names:
    for k in range(1, rounds + 1):
        try:
            lines = open(f"{out}/bench_{n}_{k}.log").read().splitlines()
        except OSError:
            continue
        for line in lines:
            f = [x.strip() for x in line.split("|")]
            if len(f) < 13 or not f[1].isdigit():
                continue
            row = f"{f[1]}x{f[3]} h{f[4]}"
            us[n, row].append(float(f[6]))
            m = re.search(r"\(([0-9.]+) here\)", f[11])
            if m:
                fm[row].append(float(m.group(1)))
            if row not in rows:
                rows.append(row)
with open(f"{out}/results.tsv", "w") as t:
    for (n, row), v in us.items():
        t.write("\t".join([n, row, *map(str, v)]) + "\n")
print("\nus: median (runs in round order); d_sum: sum of the row medians minus the first tree's")
print(f"{'tree':>12} | " + " | ".join(f"{r:>22}" for r in rows) + " |  d_sum")
base = None
for n in names:
    cells, total = [], 0.0
    for r in rows:
        v = us.get((n, r), [])
        m = statistics.median(v) if v else float("nan")
        total += m
        cells.append(f"{m:6.1f} ({', '.join(f'{x:.1f}' for x in v)})".rjust(22))
    base = total if base is None else base
    print(f"{n:>12} | " + " | ".join(cells) + f" | {total - base:+6.1f}")
if fm:
    print(f"{'FlashMLA':>12} | " + " | ".join(
        (f"{statistics.median(fm[r]):6.1f} (n={len(fm[r])})" if fm[r] else "").rjust(22)
        for r in rows) + " |")
PY
