"""Times the decode op (CUDA graph, as bench_decode.py) under schedule and combine variants
(development tool, needs the GPU):
    python tools/sweep_schedule.py [--overheads=2,5,8] [--warps=1,4,16] [--rounds=1] CFG ...
(CFG: B,S_Q,S_K,H_Q)

Variants: the per-request overhead charged by the split schedule (scheduling.OVERHEAD_BLOCKS)
and the number of warps per row of the combine kernel. With --rounds=N every variant is timed N
times, the variants interleaved round by round (the small rows move by ~0.5 us between runs:
compare interleaved times, not single ones); the best variant is the one with the lowest
median."""

from __future__ import annotations

import os
import statistics
import sys

import torch_mla
from torch_mla import scheduling
from torch_mla.ops import dispatch
from torch_mla.testing import make_anchor_inputs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_decode import graph_time_us  # noqa: E402


def time_variant(inp, s_q, h_q, overhead, wpr):
    scheduling.OVERHEAD_BLOCKS = overhead
    dispatch.combine_warps_per_row = lambda b, parts, rows: wpr
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    return graph_time_us(lambda: torch_mla.mla_decode(
        inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched, causal=s_q > 1))


def main():
    opts = {"overheads": "5", "warps": "1,4,16", "rounds": "1"}
    args = sys.argv[1:]
    while args and args[0].startswith("--"):
        key, _, value = args.pop(0)[2:].partition("=")
        if key not in opts:
            raise SystemExit(f"unknown option --{key}; options: {', '.join(opts)}")
        opts[key] = value
    overheads = [int(x) for x in opts["overheads"].split(",")]
    warps = [int(x) for x in opts["warps"].split(",")]
    torch_mla.set_value_checks(False)
    for cfg in args:
        b, s_q, s_k, h_q = (int(x) for x in cfg.split(","))
        inp = make_anchor_inputs(b, s_q, h_q, s_k)
        res = {(ov, w): [] for ov in overheads for w in warps}
        for _ in range(int(opts["rounds"])):
            for (ov, w), ts in res.items():
                ts.append(time_variant(inp, s_q, h_q, ov, w))
        med = {v: statistics.median(ts) for v, ts in res.items()}
        best = min(med, key=med.get)
        print(f"{cfg}: " + "  ".join(f"ov{ov}/w{w} " + "/".join(f"{t:.1f}" for t in ts)
                                     for (ov, w), ts in res.items())
              + f"  | best ov{best[0]}/w{best[1]} {med[best]:.1f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
