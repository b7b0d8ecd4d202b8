"""Times the decode op (CUDA graph, as bench_decode.py) under schedule and combine variants
(development tool, needs the GPU):
    python tools/sweep_schedule.py [--overheads=2,5,8] B,S_Q,S_K,H_Q ...

Variants: the per-request overhead charged by the split schedule (scheduling.OVERHEAD_BLOCKS)
and the number of warps per row of the combine kernel."""

from __future__ import annotations

import os
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


OVERHEADS = (5,)


def main():
    global OVERHEADS
    torch_mla.set_value_checks(False)
    if sys.argv[1].startswith("--overheads="):
        OVERHEADS = tuple(int(x) for x in sys.argv.pop(1).split("=")[1].split(","))
    for cfg in sys.argv[1:]:
        b, s_q, s_k, h_q = (int(x) for x in cfg.split(","))
        inp = make_anchor_inputs(b, s_q, h_q, s_k)
        res = {(ov, w): time_variant(inp, s_q, h_q, ov, w) for ov in OVERHEADS
               for w in (1, 4, 16)}
        best = min(res, key=res.get)
        print(f"{cfg}: " + "  ".join(f"ov{ov}/w{w} {us:.1f}" for (ov, w), us in res.items())
              + f"  | best ov{best[0]}/w{best[1]} {res[best]:.1f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
