#!/usr/bin/env bash
# Sparse decode on the H200, one kernel in one device call (at most ~9 min): logs in $OUT, a
# summary printed last.
#
#   source .devpkgs/b/setup.sh && bash tools/gpu_sparse.sh [MODE] (MODE: below)
#
#   portable  the portable kernel over 16-bit caches (TORCH_MLA_SPARSE_SM90=0 and
#             TORCH_MLA_SPARSE_KEYSM=0: every shape)
#   fp8       the FP8 caches (e4m3 + kv_scale, the 656-byte rows): the FP8 tests of every
#             kernel, memcheck on the default kernel (keys-on-M at h_q 16 on an H200)
#   sm90      the SM90 (wgmma) kernel (TORCH_MLA_SPARSE_SM90=1, TORCH_MLA_SPARSE_KEYSM=0,
#             TORCH_MLA_SPARSE_PRODUCER=0: every shape; by default the dispatch takes it where
#             ops.sparse.sm90_sparse_pays, but the split at 64-128 heads over the 16-bit cache
#             and the 656-byte rows)
#   keysm     the keys-on-M sparse kernel (h_q <= 32, every cache format; memcheck over the
#             656-byte rows; the tests' other shapes skip)
#   keysm_rs  its ping-pong variant (TORCH_MLA_SPARSE_KEYSM_RS=1: the FP8 caches, every h_q;
#             first run in session 26, H100): tests, memcheck over each format at h_q 16, the
#             656-byte rows at 24 (32 columns), 64 and 100 (two CTAs of 64 columns) and at 64
#             with TORCH_MLA_SPARSE_KEYSM_RS=32 (two of 32); no bench (keysm_rs_bench)
#   rs_ab     the dispatch's question for h_q <= 32 (and 64 heads under =32): the keys-on-M
#             sparse kernel against the ping-pong, same machine start, the two processes
#             alternated twice (tools/sparse_rows.py keysm / rs / rs32), b 2-128, s_q 1 and 2,
#             both FP8 formats; session 26 had them only in different processes at b 128
#   producer  the SM90 kernel's producer-warpgroup variant (TORCH_MLA_SPARSE_PRODUCER=1 with
#             TORCH_MLA_SPARSE_SM90=1: every shape it takes, the 16-bit cache and the 656-byte
#             rows): tests, an A/B against the SM90 kernel over the 656-byte rows
#             (tools/sparse_rows.py producer / sm90, alternated), memcheck over the 656-byte rows
#             at h_q 16 and 100; producer_bench: the bench with FlashMLA (a second call), with
#             and without the flag
#   split     the SM90 kernel's variant with FlashMLA's warpgroup split
#             (TORCH_MLA_SPARSE_PRODUCER=split, sm90_split_sparse_decode.py): an A/B over the
#             656-byte rows of the split and the SM90 kernel (tools/sparse_rows.py split / sm90,
#             alternated twice),
#             bench_sparse_patterns.py with the flag (FlashMLA beside it), then the tests,
#             memcheck over the 656-byte rows at h_q 16 and 100, and bench_decode.py
#             --sparse-kernels at h_q 64 and 128, b 2, 32, 128 (FlashMLA beside it)
#   verify    the defaults as they ship, one call: the sparse steps precompiled (16 jobs), the
#             split's GPU tests (tests/test_sparse_kernel.py -k sm90_split: both its builds),
#             memcheck over the 656-byte rows at h_q 100 and 64 (the short build, which
#             sparse_memcheck's shape takes) and at 100 on the default build
#             (TORCH_MLA_DEV_SPLIT_SHORT_BLOCKS=0), then the issue's bench (bench_decode.py
#             --sparse, FlashMLA beside); for a default changed without its full tests (session
#             38)
#   split_ab  an A/B of builds of the split with its developer knobs (BUILDS: entries NAME
#             or NAME:KNOB=V,KNOB=V,..., KNOB a TORCH_MLA_DEV_SPLIT_ suffix, e.g. "D
#             RE:ROPE_EARLY=1"; each build in its own cache directory; unnamed knobs their
#             defaults, and the dispatch's short build turns EPI_COPY, ENTRY_EARLY,
#             META_EARLY and, with the pair, ENTRY_EARLY2 on where a part holds few blocks,
#             whatever the build's knobs): the smoke cases of all but the first build (SMOKE=0:
#             none), the rows over the 656-byte rows (R64, R128; with R128 empty, NOPAIR=0)
#             alternated twice with the first build without its pair (NOPAIR=0: not) and with
#             FlashMLA (tools/sparse_rows.py split / flashmla), then the split's tests and
#             memcheck at h_q 100 and 64 on the first build (TESTED: another's NAME; TESTS_FIRST
#             1, the default: before the smoke cases and rows, 0: after them; TESTS=0: neither)
#             while time is left. By default D alone (the defaults).
#             EXTRA: a command run after the numbers (EXTRA_S: its timeout, 60 s; e.g.
#             EXTRA="python -m tools.sparse_kernel_times 2,1,64 2,2,64 2,1,128 2,2,128": the
#             small-batch rows' kernels one by one, ours and FlashMLA's). Sessions 31-47 ran
#             it with positional BUILDS entries over knobs since removed (their commands in
#             docs/benchmarks-h100.md; the knobs' figures in docs/kernel-notes.md)
#   plain     the 16-bit cache's kernel choice at 64-128 heads: the SM90 kernel, the split and the
#             portable kernel over the bf16 rows (ROWS), alternated twice (session 39)
#   (pair_free, session 39's mode for session 40's run of PAIR_FREE and ROPE_PAIR, left with
#             those knobs: docs/benchmarks-h100.md, session 40)
#   sms       the small-batch rows (b 2-32, the 656-byte rows, h_q 64 and 128) on the split under
#             schedules made for fewer SMs (tools/sparse_rows.py's SMS: 132, 64, 32, 16; fewer,
#             longer pieces and fewer CTAs), two rounds alternated with FlashMLA (its round
#             under TORCH_MLA_DEV_SPARSE_PIECES=flashmla went with that knob in session 45):
#             whether the small batches' time is the pieces' fixed cost (docs/kernels/sparse.md,
#             session 32)
#   pairmin   h_q 128 at 2-16 one-token requests (ROWS) with the cluster pair (the default) and
#             without it (TORCH_MLA_DEV_SPLIT_PAIR_MIN_TOKENS=16), two rounds alternated with
#             FlashMLA (session 45's plan, docs/kernel-notes.md)
#   short     the split's short build (TORCH_MLA_DEV_SPLIT_SHORT_BLOCKS: 1073741824, every
#             shape) against its default build (0, every shape) over the 656-byte rows (ROWS:
#             h_q 128 and 64, b 2-128), two rounds alternated with FlashMLA (session 46: where
#             ops.sparse.SPLIT_SHORT_BLOCKS should cut)
#   tree_ab   the current tree against .abtrees/old (a copy of an earlier commit's torch_mla,
#             benchmarks and tools, taken along), same start: both trees' split steps built at once, the
#             current tree's tests of TESTK (default: the combine's bad-entry messages through
#             the split), then
#             the rows (ROWS) alternated twice, old, new and FlashMLA
#   times     the small-batch rows (ROWS, default b 2 at s_q 1 and 2, h_q 64 and 128, and
#             32,2,64): each GPU kernel of one call, ours and FlashMLA's
#             (tools/sparse_kernel_times.py), then the rows under the default schedule,
#             alternated twice with FlashMLA
#   rope_early  session 40: the split's rope tile released apart (ROPE_EARLY; RE: builds among
#             D, C (SCOPE cta), E, CE, default "D E") against the defaults, smoke, the rows
#             alternated twice with FlashMLA, then the split's fp8 tests (ETESTS, default E);
#             since session 41 the pair's default is CTA scope, so C is that default with
#             SCOPE set again
#   trace     tools/trace_sparse.py (the split's per-CTA timeline from %globaltimer stamps; ROWS:
#             b,s_q,h_q rows, default 2,1,128 2,1,64 128,1,128 128,1,64), then 128,1,128 without
#             the pair and with the pair at cluster scope (SCOPE), and FlashMLA's times of the rows (DETAIL_FIRST=0: the detail
#             points on a segment's blocks 0-3, its ramp, instead of 8-11)
#   split_ncu  ncu of the split at b 128 h_q 64 (ROW: another b,s_q,h_q) over the 656-byte rows
#             (random entries, then every entry -1): stall samples by SASS instruction
#             (tools/ncu_sass.py), the CSVs gzipped into $OUT
#   keysm_rs_bench  the bench alone (a second device call), b 128 (BATCHES): --sparse-kernels
#             at h_q 16, 32, 64 and 128 with TORCH_MLA_SPARSE_KEYSM_RS=1 (its FP8 keys-on-M
#             columns are this kernel), at 64 with =32, then at every h_q without the flag
#
# Stages (each one's failure leaves the later ones running; each has a timeout, since a kernel
# whose copies never complete hangs rather than fails):
#   precompile  the sparse steps (every backend and cache format), schedule and append_kv
#   smoke       a few cases of the kernel (a hang shows here, not in the grid)
#   tests       the kernel's cases of tests/test_sparse_kernel.py, and tests/test_sparse.py
#   memcheck    compute-sanitizer memcheck of tools/sparse_memcheck.py on the kernel
#   bench       benchmarks/bench_decode.py --sparse, FlashMLA's sparse decode timed beside it
#               when .peers/flashmla-sm90-sparse holds it (ours over bf16 and the 656-byte rows)
# Success: every stage rc=0; the tests log ends "N passed" (no failure); memcheck's log says
# "ERROR SUMMARY: 0 errors"; the bench log has a row per configuration.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_run.sh"  # $OUT, run, preamble, memcheck, finish

# prebuild NAME KNOB=VALUE...: the split's steps and the schedule built in the background into
# their own cache directory /tmp/cNAME under the developer knobs given (the cache key holds the
# kernels' knobs that are set since session 41, so one directory would do), for the dtypes PREBUILD_DTYPES (default bf16); its log $OUT/preNAME.log. `wait`
# for it.
prebuild() {
  local n=$1; shift
  (env "$@" TORCH_MLA_CACHE_DIR="/tmp/c$n" timeout 240 python -m torch_mla.precompile \
    --arch sm_90a --kernels sparse_split,schedule --dtypes "${PREBUILD_DTYPES:-bf16}" --jobs 5 \
    > "$OUT/pre$n.log" 2>&1) &
}

# ab_rows PREFIX KNOBS ROWS VARIANT...: two rounds over the 656-byte rows (ROWS: b,s_q,h_q ...),
# each the split under every VARIANT (its environment: the words `KNOBS VARIANT` prints, its
# cache directory among them) then FlashMLA's decode; logs $OUT/PREFIXVARIANT_ROUND.log, every
# line sorted into $OUT/PREFIX_all.txt and printed.
ab_rows() {
  local pre=$1 knobs=$2 rows=$3 round v; shift 3
  for round in 1 2; do
    for v in "$@"; do
      run "$pre${v}_$round" 60 env TAG="r$round $v" $($knobs "$v") python -m tools.sparse_rows \
        split 656 $rows
      stop_if_hung "$pre${v}_$round"
    done
    run "fm_$round" 60 env TAG="r$round" python -m tools.sparse_rows flashmla 656 $rows
  done
  grep -h " us" "$OUT/$pre"*.log "$OUT"/fm_*.log | sort > "$OUT/${pre}_all.txt"
  cat "$OUT/${pre}_all.txt"
}

# the split's host knobs of the short and pairmin modes (ab_rows' KNOBS): the short build
# nowhere / everywhere; the cluster pair from 1 / 16 one-token requests
short_knobs() {
  echo "TORCH_MLA_DEV_SPLIT_SHORT_BLOCKS=$([[ $1 == short ]] && echo 1073741824 || echo 0)"
}
pair_knobs() {
  echo "TORCH_MLA_DEV_SPLIT_PAIR_MIN_TOKENS=$([[ $1 == nopair ]] && echo 16 || echo 1)"
}

kernel=${1:-portable}
flag=()  # the environment the kernel needs
groups=sparse,sparse_rs,schedule,append_kv  # what precompile builds
case $kernel in
  portable) sel=sm80; smoke="sm80 and (runs_not_the_reference or grid_matches_fp64 and 64-2-2048)"
            cache=bf16; flag=(TORCH_MLA_SPARSE_SM90=0 TORCH_MLA_SPARSE_KEYSM=0) ;;
  fp8)      sel=fp8; smoke="fp8_runs_the_kernel"; cache=fp8_ds_mla ;;
  sm90)     sel="(sm90 and not sm90_keysm)"
            smoke="$sel and (runs_not_the_reference or grid_matches_fp64 and 16-1-64)"
            cache=bf16; flag=(TORCH_MLA_SPARSE_SM90=1 TORCH_MLA_SPARSE_KEYSM=0
                              TORCH_MLA_SPARSE_PRODUCER=0) ;;
  keysm)    sel=sm90_keysm
            smoke="sm90_keysm and (runs_not_the_reference or grid_matches_fp64 and 16-1-64)"
            cache=fp8_ds_mla; flag=(TORCH_MLA_SPARSE_SM90=0) ;;
  keysm_rs) sel=sm90_keysm_rs; smoke="sm90_keysm_rs and fp8_runs_the_kernel"
            cache="e4m3 fp8_ds_mla"; flag=(TORCH_MLA_SPARSE_SM90=0 TORCH_MLA_SPARSE_KEYSM_RS=1) ;;
  keysm_rs_bench)
    preamble flashmla-sm90-sparse
    python -c "import flash_mla" 2>/dev/null || echo "(flash_mla does not import: no peer column)"
    run precompile 150 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse,sparse_rs,schedule,append_kv
    b=${BATCHES:-128}
    run bench 200 env TORCH_MLA_SPARSE_KEYSM_RS=1 python benchmarks/bench_decode.py \
      --sparse-kernels --heads 16,32,64,128 --batches "$b"
    run bench_32 120 env TORCH_MLA_SPARSE_KEYSM_RS=32 python benchmarks/bench_decode.py \
      --sparse-kernels --heads 64 --batches "$b"
    run bench_keysm 200 python benchmarks/bench_decode.py --sparse-kernels \
      --heads 16,32,64,128 --batches "$b"
    finish; exit ;;
  producer) sel=sm90_producer; smoke="sm90_producer and (runs_not_the_reference or grid_matches_fp64 and 64-1-2048)"
            cache="fp8_ds_mla"; groups=sparse,sparse_producer,schedule,append_kv
            flag=(TORCH_MLA_SPARSE_SM90=1 TORCH_MLA_SPARSE_KEYSM=0 TORCH_MLA_SPARSE_PRODUCER=1) ;;
  split)    sel=sm90_split; smoke="sm90_split and (runs_not_the_reference or grid_matches_fp64 and 64-1-2048)"
            cache="fp8_ds_mla"; groups=sparse,sparse_producer,sparse_split,schedule,append_kv
            flag=(TORCH_MLA_SPARSE_SM90=1 TORCH_MLA_SPARSE_KEYSM=0 TORCH_MLA_SPARSE_PRODUCER=split) ;;
  producer_bench)
    preamble flashmla-sm90-sparse
    python -c "import flash_mla" 2>/dev/null || echo "(flash_mla does not import: no peer column)"
    run precompile 150 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse,sparse_producer,schedule,append_kv
    b=${BATCHES:-2,32,128}
    run bench_producer 200 env TORCH_MLA_SPARSE_PRODUCER=1 python benchmarks/bench_decode.py \
      --sparse-kernels --heads 64,128 --batches "$b"
    run bench_sm90 200 python benchmarks/bench_decode.py --sparse-kernels --heads 64,128 \
      --batches "$b"
    finish; exit ;;
  verify)  # (ELAPSED: seconds the device call ran before this script; stages that would not
    # end by ~570 s are skipped, so the summary comes back within a 600 s call)
    SECONDS=${ELAPSED:-0}
    preamble flashmla-sm90-sparse
    run precompile 150 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse,sparse_split,schedule,append_kv --dtypes bf16 --jobs 16
    F=(TORCH_MLA_SPARSE_SM90=1 TORCH_MLA_SPARSE_KEYSM=0 TORCH_MLA_SPARSE_PRODUCER=split)
    run tests 150 env "${F[@]}" python -m pytest -m cuda -q -p no:cacheprovider \
      tests/test_sparse_kernel.py -k sm90_split
    stop_if_hung tests
    # (sparse_memcheck's shape takes the short build by default: "d", the default build there)
    for hq in 100 64 100d; do
      if (( SECONDS < 340 )); then
        MEMCHECK_NAME=memcheck_$hq memcheck 45 env "${F[@]}" \
          TORCH_MLA_DEV_SPLIT_SHORT_BLOCKS=$([[ $hq == *d ]] && echo 0) \
          python -m tools.sparse_memcheck --cache fp8_ds_mla --heads ${hq%d}
      else
        summary+=("memcheck_$hq     skipped: too little time left")
      fi
    done
    if (( SECONDS < 420 )); then
      run bench $((560 - SECONDS)) python benchmarks/bench_decode.py --sparse
    else
      summary+=("bench            skipped: too little time left")
    fi
    finish; exit ;;
  split_ab)  # (ELAPSED: seconds the device call ran before this script, for its budget)
    SECONDS=${ELAPSED:-0}
    preamble flashmla-sm90-sparse
    VS=(${BUILDS:-D})
    knobs() {  # the developer knobs of build $1 (a BUILDS entry NAME[:KNOB=V,...])
      local n=${1%%:*} k="" kv
      [[ $1 == *:* ]] && k=${1#*:}
      local IFS=,
      for kv in $k; do echo -n "TORCH_MLA_DEV_SPLIT_$kv "; done
      echo "TORCH_MLA_CACHE_DIR=/tmp/c$n"
    }
    # (a knob the kernel does not read would build the defaults under another cache key)
    known=$(grep -o '_dev_knob("[A-Z0-9_]*"' torch_mla/cute_kernels/sm90_split_sparse_decode.py |
      cut -d'"' -f2 | tr '\n' ' ')
    for v in "${VS[@]}"; do
      [[ $v == *:* ]] || continue
      IFS=, read -ra kvs <<< "${v#*:}"
      for kv in "${kvs[@]}"; do
        if [[ " $known" != *" ${kv%%=*} "* ]]; then
          echo "split_ab: no developer knob ${kv%%=*} in BUILDS entry $v (known: $known)"; exit 2
        fi
      done
    done
    for v in "${VS[@]}"; do
      prebuild "${v%%:*}" $(knobs "$v")
    done
    wait
    tail -n 2 "$OUT"/pre*.log
    F=(TORCH_MLA_SPARSE_SM90=1 TORCH_MLA_SPARSE_KEYSM=0 TORCH_MLA_SPARSE_PRODUCER=split)
    K="sm90_split and (fp8_grid and fp8_ds_mla and (64-1-2048 or 128) or entry_kinds and 100)"
    T=${VS[0]}  # (the build the tests and memcheck run: the first, or the entry named TESTED)
    for v in "${VS[@]}"; do [[ ${v%%:*} == "${TESTED:-}" ]] && T=$v; done
    split_tests() {  # the split's GPU tests, then memcheck at h_q 100 and 64, on build $T
      if (( SECONDS < 380 )); then
        local lim=$((560 - SECONDS - 90)); (( lim > 200 )) && lim=200  # (~75 s when they pass)
        run tests $lim env "${F[@]}" $(knobs "$T") python -m pytest -m cuda \
          -q -p no:cacheprovider tests/test_sparse_kernel.py -k "sm90_split"
        stop_if_hung tests
      else
        summary+=("tests            skipped: too little time left")
      fi
      for hq in 100 64; do
        if (( SECONDS < 520 )); then
          MEMCHECK_NAME=memcheck_$hq memcheck 45 env "${F[@]}" $(knobs "$T") \
            python -m tools.sparse_memcheck --cache fp8_ds_mla --heads $hq
        fi
      done
    }
    [[ ${TESTS:-1} == 0 ]] && split_tests() { summary+=("tests, memcheck  skipped: TESTS=0"); }
    if [[ ${TESTS_FIRST:-1} == 1 ]]; then split_tests; fi  # (before the numbers: session 34's
    # run reached its device-time limit in the tests it had left for last)
    for v in "${VS[@]:1}"; do  # (the first build: the reference, the defaults by default)
      [[ ${SMOKE:-1} == 0 ]] && continue
      run "smoke_${v%%:*}" 90 env "${F[@]}" $(knobs "$v") python -m pytest -m cuda -q -x \
        -p no:cacheprovider tests/test_sparse_kernel.py -k "$K"
      stop_if_hung "smoke_${v%%:*}"
    done
    R64=${R64-"2,1,64 32,1,64 128,1,64 128,2,64"}
    R128=${R128-"2,1,128 32,1,128 128,1,128 128,2,128"}
    for round in 1 2; do
      for v in "${VS[@]}"; do n=${v%%:*}
        run "ab_${n}_$round" 60 env TAG="r$round $n" $(knobs "$v") \
          python -m tools.sparse_rows split 656 $R128 $R64
        stop_if_hung "ab_${n}_$round"
      done
      if [[ ${NOPAIR:-1} == 1 ]]; then  # (the first build without its pair at h_q 128)
        run "ab_nopair_$round" 60 env TAG="r$round ${VS[0]%%:*} nopair" $(knobs "${VS[0]}") \
          TORCH_MLA_SPARSE_SPLIT_PAIR=0 python -m tools.sparse_rows split 656 $R128
        stop_if_hung "ab_nopair_$round"
      fi
      run "ab_fm_$round" 60 env TAG="r$round" python -m tools.sparse_rows flashmla 656 $R128 $R64
    done
    grep -h " us" "$OUT"/ab_*.log | sort -t: -k1,1 > "$OUT/ab_all.txt"
    if [[ -n ${EXTRA:-} ]]; then  # (a developer's command, after the numbers)
      run extra "${EXTRA_S:-60}" bash -c "$EXTRA"
    fi
    if [[ ${TESTS_FIRST:-1} != 1 ]]; then split_tests; fi
    finish; exit ;;
  tree_ab)  # (the current tree against .abtrees/old, e.g. `git archive COMMIT torch_mla tools
    # benchmarks | tar -x -C .abtrees/old`, taken along: the cache key holds a hash of each tree's kernel
    # sources, so neither loads the other's kernels)
    preamble flashmla-sm90-sparse
    OLDT="$ROOT/.abtrees/old"
    (timeout 200 python -m torch_mla.precompile --arch sm_90a --kernels sparse_split,schedule \
      --dtypes bf16 --jobs 4 > "$OUT/pre_new.log" 2>&1) &
    (cd "$OLDT" && PYTHONPATH="$OLDT:${PYTHONPATH:-}" timeout 200 python -m torch_mla.precompile \
      --arch sm_90a --kernels sparse_split,schedule --dtypes bf16 --jobs 4 > "$OUT/pre_old.log" 2>&1) &
    wait
    tail -n 2 "$OUT"/pre_*.log
    run tests 200 python -m pytest -m cuda -q -p no:cacheprovider tests/test_sparse_kernel.py \
      -k "${TESTK:-bad_entry and sm90_split}"
    R=${ROWS:-"2,1,128 2,1,64 8,1,128 32,1,128 128,1,128 128,1,64"}
    for round in 1 2; do
      run "new_$round" 60 env TAG="r$round new" python -m tools.sparse_rows split 656 $R
      stop_if_hung "new_$round"
      run "old_$round" 60 bash -c "cd '$OLDT' && PYTHONPATH='$OLDT:${PYTHONPATH:-}' TAG='r$round old' \
        python -m tools.sparse_rows split 656 $R"
      stop_if_hung "old_$round"
      run "fm_$round" 60 env TAG="r$round" python -m tools.sparse_rows flashmla 656 $R
    done
    finish; exit ;;
  plain)  # (the 16-bit cache's kernel choice at 64-128 heads: the SM90 kernel, the split and the
    # portable kernel over the bf16 rows (tools/sparse_rows.py sm90 / split / portable bf16),
    # alternated twice, one start; the split runs over that cache only when asked for, session 39)
    preamble flashmla-sm90-sparse
    run precompile 150 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse,sparse_split,schedule --dtypes bf16 --jobs 16
    stop_if_hung precompile
    R=${ROWS:-"2,1,64 2,2,64 8,1,64 32,1,64 32,2,64 128,1,64 128,2,64 2,1,128 2,2,128 8,1,128
      32,1,128 32,2,128 128,1,128 128,2,128 32,1,100 128,1,100"}
    for round in 1 2; do
      for m in sm90 split portable; do
        run "p${m}_$round" 60 env TAG="r$round" python -m tools.sparse_rows $m bf16 $R
        stop_if_hung "p${m}_$round"
      done
    done
    grep -h " us" "$OUT"/p*_[12].log | sort -t' ' -k4,4 -k1,1 > "$OUT/p_all.txt"
    cat "$OUT/p_all.txt"
    finish; exit ;;
  rope_early)  # (session 40: the rope tile's own release, TORCH_MLA_DEV_SPLIT_ROPE_EARLY=1, with
    # and without CTA scope: D the defaults, C SCOPE cta, E ROPE_EARLY, CE both; RE picks the
    # builds (default "D E": since session 40 ROPE_EARLY leaves the pair alone, so CE is C at 128
    # heads and E at 64); each ROPE_EARLY build's smoke cases at 64 and 128 heads, the rows (ROWS)
    # alternated twice with FlashMLA, then the split's fp8 tests on the builds of ETESTS (default
    # "E"; 0: none))
    preamble flashmla-sm90-sparse
    rek() {  # the environment of build $1
      case $1 in
        D) echo TORCH_MLA_CACHE_DIR=/tmp/cD ;;
        C) echo TORCH_MLA_DEV_SPLIT_SCOPE=cta TORCH_MLA_CACHE_DIR=/tmp/cC ;;
        E) echo TORCH_MLA_DEV_SPLIT_ROPE_EARLY=1 TORCH_MLA_CACHE_DIR=/tmp/cE ;;
        CE) echo TORCH_MLA_DEV_SPLIT_SCOPE=cta TORCH_MLA_DEV_SPLIT_ROPE_EARLY=1 \
              TORCH_MLA_CACHE_DIR=/tmp/cCE ;;
        *) echo "rope_early: unknown build $1" >&2; exit 2 ;;
      esac
    }
    RE=${RE:-"D E"}  # (the builds to run)
    for v in $RE; do rek $v > /dev/null || exit 2; done
    for v in $RE; do prebuild $v $(rek $v | sed 's/ *TORCH_MLA_CACHE_DIR=[^ ]*//'); done
    wait
    tail -n 2 "$OUT"/pre*.log
    F=(TORCH_MLA_SPARSE_SM90=1 TORCH_MLA_SPARSE_KEYSM=0 TORCH_MLA_SPARSE_PRODUCER=split)
    for v in $RE; do
      [[ $v == *E ]] || continue  # (the ROPE_EARLY builds)
      run "smoke_$v" 90 env "${F[@]}" $(rek $v) python -m pytest -m cuda -q -x \
        -p no:cacheprovider tests/test_sparse_kernel.py \
        -k "sm90_split and fp8_grid and fp8_ds_mla and (128 or 64)"
      stop_if_hung "smoke_$v"
    done
    ab_rows re rek "${ROWS:-32,1,64 128,1,64 128,2,64 32,1,128 128,1,128 128,2,128}" $RE
    ET=${ETESTS-E}
    [[ $ET == 0 ]] && ET=""
    for v in $ET; do
      [[ " $RE " == *" $v "* ]] || continue  # (only builds prebuilt above)
      run "tests_$v" 120 env "${F[@]}" $(rek $v) python -m pytest -m cuda -q \
        -p no:cacheprovider tests/test_sparse_kernel.py -k "sm90_split and fp8"
      stop_if_hung "tests_$v"
    done
    finish; exit ;;
  times)  # (where the small batches' time goes: each kernel of one call, ours and FlashMLA's,
    # under torch.profiler (tools/sparse_kernel_times.py), then the rows' CUDA-graph times under
    # the default schedule, alternated twice with FlashMLA)
    preamble flashmla-sm90-sparse
    run precompile 150 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse_split,schedule --dtypes bf16 --jobs 8
    stop_if_hung precompile
    R=${ROWS:-"2,1,64 2,2,64 2,1,128 2,2,128 32,2,64"}
    run kt 150 python -m tools.sparse_kernel_times $R
    stop_if_hung kt
    for round in 1 2; do
      run "tr_$round" 40 env TAG="r$round" python -m tools.sparse_rows split 656 $R
      stop_if_hung "tr_$round"
      run "tf_$round" 40 env TAG="r$round" python -m tools.sparse_rows flashmla 656 $R
    done
    grep -h " us" "$OUT"/t[rf]_*.log | sort > "$OUT/t_all.txt"
    finish; exit ;;
  trace)  # (tools/trace_sparse.py's per-CTA timeline of the split, ROWS or its default rows;
    # the raw stamps as .pt files in $OUT)
    preamble flashmla-sm90-sparse
    run trace 240 python -m tools.trace_sparse "$OUT" ${ROWS:-}
    # (h_q 128 without the pair, and the pair at cluster scope: SCOPE)
    run trace_nopair 90 env TORCH_MLA_SPARSE_SPLIT_PAIR=0 python -m tools.trace_sparse \
      "$OUT/nopair" 128,1,128
    run trace_cluster 120 env TORCH_MLA_DEV_SPLIT_SCOPE=cluster \
      TORCH_MLA_CACHE_DIR=/tmp/ccluster python -m tools.trace_sparse "$OUT/cluster" 128,1,128
    run fm 60 python -m tools.sparse_rows flashmla 656 ${ROWS:-2,1,128 2,1,64 128,1,128 128,1,64}
    finish; exit ;;
  sms)
    preamble flashmla-sm90-sparse
    run precompile 100 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse_split,schedule --dtypes bf16
    R="2,1,128 2,2,128 2,1,64 2,2,64 8,1,128 8,1,64 32,1,128 32,1,64"
    for round in 1 2; do
      for sms in 132 64 32 16; do
        run "sms_${sms}_$round" 40 env SMS=$sms TAG="r$round sms$sms" \
          python -m tools.sparse_rows split 656 $R
        stop_if_hung "sms_${sms}_$round"
      done
      run "fm_$round" 40 env TAG="r$round" python -m tools.sparse_rows flashmla 656 $R
    done
    grep -h " us" "$OUT"/sms_*.log "$OUT"/fm_*.log | sort > "$OUT/sms_all.txt"
    finish; exit ;;
  short|pairmin)  # (session 46: the short build's crossover; session 45's plan: the pair
    # against one CTA an m-block at few tokens, h_q 128)
    preamble flashmla-sm90-sparse
    run precompile 100 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse_split,schedule --dtypes bf16 --jobs 16
    if [[ $kernel == short ]]; then
      ab_rows sh short_knobs "${ROWS:-"2,1,128 2,2,128 4,1,128 4,2,128 8,1,128 16,1,128
        32,1,128 128,1,128 2,1,64 2,2,64 4,1,64 8,1,64 16,1,64 32,1,64 128,1,64"}" default short
    else
      ab_rows pm pair_knobs "${ROWS:-"2,1,128 2,2,128 4,1,128 8,1,128 16,1,128"}" pair nopair
    fi
    finish; exit ;;
  split_ncu)  # (ncu of the split at b 128 h_q 64 over the 656-byte rows, random entries and
    # every entry -1: the source page's CSV gzipped into $OUT, tools/ncu_sass.py's summary)
    preamble flashmla-sm90-sparse
    run precompile 150 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse_split,schedule --dtypes bf16
    for none in 0 1; do
      run "ncu_$none" 90 env NONE=$none ncu --clock-control none --section WarpStateStats \
        --section SourceCounters --section SpeedOfLight -k regex:Sm90Split --launch-skip 3 -c 1 \
        -o "/tmp/rep_$none" python -m tools.sparse_rows split 656 "${ROW:-128,1,64}"
      ncu -i "/tmp/rep_$none.ncu-rep" --page source --csv --print-source sass > "/tmp/sass_$none.csv"
      gzip -c "/tmp/sass_$none.csv" > "$OUT/sass_$none.csv.gz"
      python -m tools.ncu_sass "/tmp/sass_$none.csv" 30 > "$OUT/top_$none.txt"
      head -14 "$OUT/top_$none.txt"
    done
    finish; exit ;;
  rs_ab)
    preamble flashmla-sm90-sparse
    run precompile 150 python -m torch_mla.precompile --arch sm_90a \
      --kernels sparse,sparse_rs,schedule,append_kv
    ROWS="2,1,16 8,1,16 32,1,16 64,1,16 128,1,16 32,2,16 128,2,16 2,1,32 32,1,32 128,1,32 128,2,32"
    for round in 1 2; do
      for mode in keysm rs; do  # (one log a mode and round: a call returns few files)
        run "ab_${mode}_$round" 100 env TAG="r$round" sh -c \
          "python -m tools.sparse_rows $mode 656 $ROWS &&
           python -m tools.sparse_rows $mode e4m3 $ROWS"
      done
      run "ab_64_$round" 40 sh -c "python -m tools.sparse_rows rs 656 32,1,64 128,1,64 &&
        python -m tools.sparse_rows rs32 656 32,1,64 128,1,64"
    done
    finish; exit ;;
  *) echo "usage: gpu_sparse.sh [portable|fp8|sm90|keysm|keysm_rs|keysm_rs_bench|producer|producer_bench|split|verify|split_ab|tree_ab|plain|rope_early|times|trace|sms|split_ncu|rs_ab|pairmin|short]"; exit 2 ;;
esac

preamble flashmla-sm90-sparse
run precompile 150 python -m torch_mla.precompile --arch sm_90a --kernels "$groups"
wait
run smoke 90 python -m pytest -m cuda -x -q -p no:cacheprovider tests/test_sparse_kernel.py \
  -k "$smoke"
stop_if_hung smoke
if [[ $kernel == producer || $kernel == split ]]; then  # the A/B first: a number even if a
  # later stage hangs
  ROWS="2,1,64 32,1,64 128,1,64 128,2,64 2,1,128 32,1,128 128,1,128"
  modes="producer sm90"; [[ $kernel == split ]] && modes="split sm90"
  for round in 1 2; do
    for mode in $modes; do
      run "ab_${mode}_$round" 60 env TAG="r$round $mode" python -m tools.sparse_rows "$mode" \
        656 $ROWS
      stop_if_hung "ab_${mode}_$round"
    done
  done
  if [[ $kernel == split ]]; then  # (FlashMLA beside it, before the tests: numbers first)
    run pat 120 env "${flag[@]}" python benchmarks/bench_sparse_patterns.py
  fi
fi
run tests 240 python -m pytest -m cuda -q -p no:cacheprovider tests/test_sparse.py \
  tests/test_sparse_kernel.py -k "$sel or not (sm80 or sm90 or fp8)"
stop_if_hung tests
for c in $cache; do  # (memcheck_e4m3.log, ... where there are two)
  [[ $cache == "$c" ]] || MEMCHECK_NAME=memcheck_$c
  memcheck 60 env "${flag[@]}" python -m tools.sparse_memcheck --cache "$c"
done
if [[ $kernel == producer || $kernel == split ]]; then  # (two m-blocks a token, the second
  # with 36 heads)
  MEMCHECK_NAME=memcheck_100 memcheck 45 env "${flag[@]}" python -m tools.sparse_memcheck \
    --cache fp8_ds_mla --heads 100
  if [[ $kernel == split ]]; then  # (issue 29's rows, FlashMLA in the same process)
    run bench 150 env "${flag[@]}" python benchmarks/bench_decode.py --sparse-kernels \
      --heads 64,128 --batches 2,32,128
  fi
elif [[ $kernel == keysm_rs ]]; then  # (32 columns; 64: the two warpgroups split them; 100:
  # two CTAs of 64 a token; =32: 64 heads as two CTAs of 32)
  for h in 24 64 100; do
    MEMCHECK_NAME=memcheck_$h memcheck 45 env "${flag[@]}" python -m tools.sparse_memcheck \
      --cache fp8_ds_mla --heads $h
  done
  MEMCHECK_NAME=memcheck_64_32 memcheck 45 env "${flag[@]}" TORCH_MLA_SPARSE_KEYSM_RS=32 \
    python -m tools.sparse_memcheck --cache fp8_ds_mla --heads 64
else
  python -c "import flash_mla" 2>/dev/null || echo "(flash_mla does not import: no peer column)"
  run bench 100 env "${flag[@]}" python benchmarks/bench_decode.py --sparse
fi
finish
