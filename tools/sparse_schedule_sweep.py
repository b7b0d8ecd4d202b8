"""Sparse decode's call time against its schedule's size (development tool, needs an SM90 GPU).

    python -m tools.sparse_schedule_sweep [B,S_Q,H_Q ...]   # the table below (ROWS by default)
    python -m tools.sparse_schedule_sweep --once B,S_Q,H_Q   # three eager calls (for ncu)

Over DeepSeek-V3.2's 656-byte rows (topk 2048, s_k 32768: benchmarks/bench_decode.py's sparse
problem), with the dispatch's environment as given (session 26 ran it with
TORCH_MLA_SPARSE_KEYSM_RS=1). Each row prints the CUDA-graph time (us, median) of one
mla_decode_sparse call: with the default schedule (topk_length None, then given; value checks
on, then off), then with the schedule sized for fewer SMs (num_sms 128, 120, 96, 66, 33: fewer
parts, so fewer requests cut in two and less for the combine to merge).

--once makes the problem and calls the op three times without a graph, so that
`ncu --metrics gpu__time_duration.sum python -m tools.sparse_schedule_sweep --once 2,1,16`
lists each kernel of a call (decode, combine) with its own time.
"""

from __future__ import annotations

import os
import sys

ROWS = ((128, 1, 16), (128, 2, 16), (128, 1, 32), (128, 1, 64), (2, 1, 16), (32, 1, 16))
SMS = (128, 120, 96, 66, 33)
TOPK, S_K = 2048, 32768


def _problem(b: int, s_q: int, h_q: int):
    """(q, the 656-byte cache, indices, default schedule, topk_length of TOPK each)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_decode as bd
    import torch

    tokens, idx, q, sched = bd._sparse_problem(b, s_q, h_q, TOPK, S_K)
    cache = bd._sparse_cache(b * S_K, torch.uint8, 656, tokens, None)
    lengths = torch.full((b,), TOPK, dtype=torch.int32, device="cuda")
    return q, cache, idx, sched, lengths


def once(spec: str) -> None:
    import torch

    import torch_mla

    b, s_q, h_q = (int(x) for x in spec.split(","))
    q, cache, idx, sched, lengths = _problem(b, s_q, h_q)
    for _ in range(3):
        torch_mla.mla_decode_sparse(q, cache, idx, schedule=sched, topk_length=lengths)
    torch.cuda.synchronize()
    print(f"parts {sched.metadata.shape[0]}, most pieces a token "
          f"{sched.num_splits.diff().max().item()}")


def _us(q, cache, idx, sched, lengths) -> float:
    """One mla_decode_sparse call's CUDA-graph time (us)."""
    import torch_mla
    from torch_mla.testing import graph_time_us

    return graph_time_us(lambda: torch_mla.mla_decode_sparse(q, cache, idx, schedule=sched,
                                                             topk_length=lengths))


def sweep(rows=ROWS) -> None:
    import torch_mla

    for b, s_q, h_q in rows:
        q, cache, idx, sched, lengths = _problem(b, s_q, h_q)
        us = []
        for checks in (True, False):
            torch_mla.set_value_checks(checks)
            us += [_us(q, cache, idx, sched, None), _us(q, cache, idx, sched, lengths)]
        torch_mla.set_value_checks(True)
        for n in SMS:
            us.append(_us(q, cache, idx, torch_mla.get_sparse_decode_schedule(idx, h_q, num_sms=n),
                          lengths))
        print(f"b {b} s_q {s_q} h {h_q} parts {sched.metadata.shape[0]}: default {us[0]:.1f}, "
              f"tl {us[1]:.1f}, nochecks {us[2]:.1f}, nochecks+tl {us[3]:.1f}; num_sms "
              f"{'/'.join(map(str, SMS))}: " + " / ".join(f"{x:.1f}" for x in us[4:]),
              flush=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--once"] and len(argv) == 2:
        once(argv[1])
    elif not argv or "--once" not in argv:
        sweep([tuple(int(x) for x in spec.split(",")) for spec in argv] or ROWS)
    else:
        raise SystemExit("usage: python -m tools.sparse_schedule_sweep [--once B,S_Q,H_Q | "
                         "B,S_Q,H_Q ...]")


if __name__ == "__main__":
    main(sys.argv[1:])
