"""The portable (SM80-class) decode kernel on this GPU: correctness grid, then speed vs SM90.

    python -m tools.check_portable                      # grid + every anchor row (H200: ~5 min)
    python -m tools.check_portable --quick              # trimmed grid + benchmarks' QUICK rows
    python -m tools.check_portable --tiles 64,64,2 --tiles 32,16,3   # also these tile shapes
    python -m tools.check_portable --no-bench / --no-grid

Grid: the cases of tests/test_kernel_sm90.py (heads x query tokens x causal, varlen batches,
page edges, fp16, long context with a small scale) plus s_q = 8, h_kv = 4 and a CUDA-graph
replay on new lengths, on fresh inputs poisoned as in the tests (NaN past every length and in
spare pages, huge ids in unused block-table entries), against the fp32 reference with the
tests' tolerances. Per group: passed / run, the worst error as a fraction of the tolerance
(<= 1 passes), the worst lse error; every failing case is printed. ``--tiles`` repeats the grid
with other (block_m, block_n, stages) shapes compiled for this GPU's arch: on an H200 that
checks, e.g., the 32x16x3 tiles that 99 KB GPUs (sm_86/89/120) run.

Bench: the anchor rows of benchmarks/bench_decode.py, timed as there (one call captured in a
CUDA graph, triton do_bench median), the SM90 kernel (on an SM90 GPU) and the portable one in
the same process; speed ratio = SM90 us / portable us, against the issue's targets (>= 0.7 for
h_q <= 64, >= 0.4 for h_q = 128) and the Triton column of shared/anchors/README.md.
Exit status 1 when a grid case fails.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch

import torch_mla
from torch_mla.devtools import portable_kernel
from torch_mla.reference import mla_decode_reference
from torch_mla.testing import (
    ANCHORS,
    QUICK_ANCHORS,
    capture_graph,
    decode_errors,
    graph_time_us,
    make_anchor_inputs,
    make_decode_inputs,
    varlen_seqlens,
)

# shared/anchors/README.md, Triton split-KV decode (vLLM-style) on the H200, us.
TRITON_US = {(128, 1, 4096, 128): 2124, (128, 1, 8192, 128): 4095, (128, 1, 16384, 128): 7645,
             (128, 1, 32768, 128): 14977, (128, 1, 8192, 16): 620, (128, 1, 8192, 32): 1084,
             (128, 1, 8192, 64): 2042, (1, 1, 4096, 128): 56, (8, 1, 4096, 128): 177,
             (32, 1, 4096, 128): 521, (64, 1, 2048, 16): 121}


def grid(quick: bool):
    """(group, label, lens, s_q, h_q, causal, dtype, scale, h_kv)."""
    bf16 = torch.bfloat16
    heads = [1, 3, 16, 64, 128] if quick else [1, 3, 9, 16, 63, 64, 126, 128]
    for h_q in heads:
        for s_q, causal in [(1, False), (2, True), (4, True), (2, False)]:
            yield ("heads x tokens", f"h_q={h_q} s_q={s_q} causal={causal}",
                   [20, 140, 4096, 0, 1, 65], s_q, h_q, causal, bf16, None, 1)
    for h_q in [16, 128]:
        for causal in (True, False):
            yield ("s_q 8", f"h_q={h_q} causal={causal}", [300, 7, 8, 2000], 8, h_q, causal, bf16,
                   None, 1)
    for b in ([1, 6, 128] if quick else [1, 2, 6, 64, 128]):
        lens = varlen_seqlens(b)
        yield ("varlen batches", f"b={b} s_q=2 h_q=128 causal", lens, 2, 128, True, bf16, None, 1)
        yield ("varlen batches", f"b={b} s_q=1 h_q=16", lens, 1, 16, False, bf16, None, 1)
    for L in ([1, 64, 65, 129] if quick else [1, 63, 64, 65, 127, 128, 129, 191, 192, 193]):
        lens = [L, L + 1, max(L - 1, 0)]
        yield ("page edges", f"L={L} s_q=1 h_q=64", lens, 1, 64, False, bf16, None, 1)
        yield ("page edges", f"L={L} s_q=3 h_q=32 causal", lens, 3, 32, True, bf16, None, 1)
    yield ("fp16", "s_q=2 h_q=64 causal", [20, 140, 4096, 0], 2, 64, True, torch.float16, None, 1)
    yield ("fp16", "s_q=1 h_q=128", [20, 140, 4096, 0], 1, 128, False, torch.float16, None, 1)
    yield ("long context", "L=32768 h_q=128 scale=0.01", [32768, 5], 1, 128, False, bf16, 0.01, 1)
    yield ("h_kv heads", "h_kv=4 s_q=2 h_q=16 causal", [20, 140, 0, 65], 2, 16, True, bf16, None,
           4)


def run_case(lens, s_q, h_q, causal, dtype, scale, h_kv):
    inp = make_decode_inputs(lens, s_q, h_q, dtype=dtype, device="cuda", h_kv=h_kv)
    scale = scale or 576**-0.5
    out, lse = torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                    softmax_scale=scale, causal=causal)
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table,
                                            inp.cache_seqlens, scale, causal, 512)
    return decode_errors(out, lse, ref_out, ref_lse, dtype)


def graph_case():
    """A CUDA graph of schedule + decode captured once and replayed on three new inputs."""
    steps = [make_decode_inputs(lens, 2, 64, device="cuda", max_blocks=6, num_blocks=14)
             for lens in ([70, 3, 300], [129, 64, 0], [5, 250, 190])]
    static = [steps[0].q.clone(), steps[0].kv_cache.clone(), steps[0].block_table.clone(),
              steps[0].cache_seqlens.clone()]

    def step(q, kv, table, lens):
        sched = torch_mla.get_decode_schedule(lens, 2, 64)
        return torch_mla.mla_decode(q, kv, table, lens, sched, causal=True)

    torch_mla.set_value_checks(False)
    try:
        g, (out, lse) = capture_graph(step, static)
        worst = (0.0, 0.0, False)
        for inp in steps:
            for dst, src in zip(static, [inp.q, inp.kv_cache, inp.block_table,
                                         inp.cache_seqlens]):
                dst.copy_(src)
            g.replay()
            torch.cuda.synchronize()
            ref = mla_decode_reference(*static, 576**-0.5, True, 512)
            e = decode_errors(out, lse, *ref, torch.bfloat16)
            worst = (max(worst[0], e[0]), max(worst[1], e[1]), worst[2] or e[2])
        return worst
    finally:
        torch_mla.set_value_checks(True)


def check_grid(quick: bool, tiles) -> int:
    name = "x".join(map(str, tiles)) if tiles else "default tiles"
    major, minor = torch.cuda.get_device_capability()
    print(f"\n## correctness, portable kernel, {name} (compute capability {major}.{minor})")
    groups: dict[str, list] = {}
    failed = 0
    cases = list(grid(quick)) + [("graph replay", "s_q=2 h_q=64 causal, 3 replays", None, 2, 64,
                                  True, torch.bfloat16, None, 1)]
    with portable_kernel(tiles):
        for group, label, lens, s_q, h_q, causal, dtype, scale, h_kv in cases:
            try:
                if lens is None:
                    ratio, lse_ratio, nan = graph_case()
                else:
                    ratio, lse_ratio, nan = run_case(lens, s_q, h_q, causal, dtype, scale, h_kv)
                ok = ratio <= 1 and lse_ratio <= 1 and not nan
                why = f"out err/tol {ratio:.3g}, lse err/tol {lse_ratio:.3g}, NaN {nan}"
            except Exception as e:  # a launch or compile error is a failed case, not a crash
                ok, ratio, lse_ratio, why = False, float("inf"), float("inf"), repr(e)[:300]
            g = groups.setdefault(group, [0, 0, 0.0, 0.0])
            g[0] += ok
            g[1] += 1
            g[2], g[3] = max(g[2], ratio), max(g[3], lse_ratio)
            if not ok:
                failed += 1
                print(f"FAIL {group}: {label}: {why}", flush=True)
    print("| group | passed | worst out err / tol | worst lse err / tol |")
    print("|---|---|---|---|")
    for group, (ok, n, r, lr) in groups.items():
        print(f"| {group} | {ok}/{n} | {r:.3f} | {lr:.3f} |")
    total = sum(g[1] for g in groups.values())
    print(f"{total - failed}/{total} passed, {failed} failed", flush=True)
    return failed


def bench(quick: bool, tiles_list) -> None:
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    names = ["default" if t is None else "x".join(map(str, t)) for t in tiles_list]
    print(f"\n## speed, {torch.cuda.get_device_name()}: us per call (decode + combine, CUDA "
          "graph replay); ratio = SM90 us / portable us")
    head = "| b | s_q | s_k | h_q | causal | SM90 us | " + " | ".join(
        f"portable {n} us | ratio" for n in names) + " | target | Triton us |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    # (--quick adds the anchor row nearest its target: 128 x 8192, h_q 64)
    for cfg in (QUICK_ANCHORS + [(128, 1, 8192, 64, False)] if quick else list(ANCHORS)):
        b, s_q, s_k, h_q, causal = cfg
        inp = make_anchor_inputs(b, s_q, h_q, s_k)
        sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
        call = functools.partial(torch_mla.mla_decode, inp.q, inp.kv_cache, inp.block_table,
                                 inp.cache_seqlens, sched, causal=causal)
        base = float("nan")
        if sm90:
            with portable_kernel(on=False):
                base = graph_time_us(call)
        cells = []
        for t in tiles_list:
            with portable_kernel(t):
                us = graph_time_us(call)
            cells.append(f"{us:.1f} | {base / us:.2f}")
        target = 0.4 if h_q * s_q > 64 else 0.7
        triton = TRITON_US.get((b, s_q, s_k, h_q), float("nan"))
        print(f"| {b} | {s_q} | {s_k} | {h_q} | {'yes' if causal else 'no'} | {base:.1f} | "
              + " | ".join(cells) + f" | >= {target} | {triton:.0f} |", flush=True)
        del inp, call, sched
        torch.cuda.empty_cache()  # the next row's cache may be several GB


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="trimmed grid, benchmarks' QUICK rows")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--tiles", action="append", default=[], metavar="BM,BN,STAGES",
                    help="also these tile shapes (repeatable), e.g. 64,64,2 or 32,16,3")
    args = ap.parse_args(argv)
    tiles_list = [None] + [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    print(f"# {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
          f"torch {torch.__version__}")
    t0 = time.time()
    failed = 0
    if not args.no_grid:
        for tiles in tiles_list:
            failed += check_grid(args.quick, tiles)
    if not args.no_bench:
        bench(args.quick, tiles_list)
    print(f"\n{time.time() - t0:.0f} s; grid failures: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
