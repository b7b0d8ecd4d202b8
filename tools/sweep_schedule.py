"""Times the decode op (CUDA graph, as benchmarks/bench_decode.py) under schedule and combine
variants (needs the GPU): the measurements behind scheduling.OVERHEAD_BLOCKS and
CombineConfig's heuristic (docs/kernel-notes.md).

    python -m tools.sweep_schedule [--overheads=2,5,8] [--warps=1,4,16] [--rounds=1] CFG ...
    (CFG: B,S_Q,S_K,H_Q; causal when S_Q > 1)

Variants: the per-request overhead charged by the split schedule (OVERHEAD_BLOCKS; the schedule
kernel has the default built in, so each variant's schedule is computed by
scheduling.compute_schedule on the CPU with that overhead, then copied to the GPU) and the number
of warps per row of the combine kernel. With --rounds=N every variant is timed N times, the
variants interleaved round by round (the small rows move by ~0.5 us between runs: compare
interleaved times, not single ones); the best variant is the one with the lowest median."""

from __future__ import annotations

import functools
import statistics
import sys

import torch_mla
from torch_mla import scheduling
from torch_mla.devtools import combine_warps
from torch_mla.testing import graph_time_us, make_anchor_inputs, parse_config


def variant_schedule(lens, num_parts: int, overhead: int):
    """compute_schedule's (metadata, num_splits) for these lengths with ``overhead`` blocks
    charged per request, on lens' device."""
    saved = scheduling.OVERHEAD_BLOCKS
    scheduling.OVERHEAD_BLOCKS = overhead  # (read by compute_schedule at each call)
    try:
        meta, splits = scheduling.compute_schedule(lens.cpu(), num_parts)
    finally:
        scheduling.OVERHEAD_BLOCKS = saved
    return meta.to(lens.device), splits.to(lens.device)


def main(argv: list[str]) -> None:
    opts = {"overheads": "5", "warps": "1,4,16", "rounds": "1"}
    args = list(argv)
    while args and args[0].startswith("--"):
        key, _, value = args.pop(0)[2:].partition("=")
        if key not in opts:
            raise SystemExit(f"unknown option --{key}; options: {', '.join(opts)}")
        opts[key] = value
    overheads = [int(x) for x in opts["overheads"].split(",")]
    warps = [int(x) for x in opts["warps"].split(",")]
    torch_mla.set_value_checks(False)
    for cfg in args:
        b, s_q, s_k, h_q = parse_config(cfg)
        inp = make_anchor_inputs(b, s_q, h_q, s_k)
        parts = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q).metadata.shape[0]
        scheds = {ov: variant_schedule(inp.cache_seqlens, parts, ov) for ov in overheads}
        res = {(ov, w): [] for ov in overheads for w in warps}
        for _ in range(int(opts["rounds"])):
            for (ov, w), ts in res.items():
                with combine_warps(w):
                    ts.append(graph_time_us(functools.partial(
                        torch_mla.mla_decode, inp.q, inp.kv_cache, inp.block_table,
                        inp.cache_seqlens, scheds[ov], causal=s_q > 1)))
        med = {v: statistics.median(ts) for v, ts in res.items()}
        best = min(med, key=med.get)
        print(f"{cfg}: " + "  ".join(f"ov{ov}/w{w} " + "/".join(f"{t:.1f}" for t in ts)
                                     for (ov, w), ts in res.items())
              + f"  | best ov{best[0]}/w{best[1]} {med[best]:.1f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
