"""Per-kernel GPU times of one sparse decode call, ours and FlashMLA's (development tool, needs an
SM90 GPU; FlashMLA's sparse build on PYTHONPATH, as shared/anchors/flashmla-sm90-sparse says).

    python -m tools.sparse_kernel_times B,S_Q,H_Q [...]

Each row: bench_decode.py's sparse problem over the 656-byte rows (topk 2048, s_k 32768), one
mla_decode_sparse call (the dispatch's kernel, schedule made once, outside) and one FlashMLA
flash_mla_with_kvcache call, each run 20 times eagerly under torch.profiler after a warm-up.
Prints, per call, every GPU kernel that ran once a call with its mean time (us) and their sum,
then the schedule's part count: where the small-batch rows' time goes (the decode kernel, the
combine, anything else), which a CUDA-graph total (tools/sparse_rows.py) does not show.
A second line per call gives the call's timeline: each kernel's mean start and end (us) from
the call's first kernel start, so a programmatic dependent's span (the combine starts while
the decode kernel runs) reads as its tail after the kernel before it.
"""

from __future__ import annotations

import os
import sys

CALLS = 20


def kernel_times(fn, timeline: list | None = None) -> list[tuple[str, float]]:
    """(kernel name, mean us a call) of the GPU kernels fn launches once a call; if timeline
    is a list, appended to it: (kernel name, mean start, mean end), us from each call's first
    kernel start, in start order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    if timeline is not None:
        kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                         key=lambda e: e.time_range.start)
        per_call = len(kernels) // CALLS
        if per_call * CALLS == len(kernels):
            for i in range(per_call):
                calls = [kernels[c * per_call:(c + 1) * per_call] for c in range(CALLS)]
                starts = [k[i].time_range.start - k[0].time_range.start for k in calls]
                ends = [k[i].time_range.end - k[0].time_range.start for k in calls]
                timeline.append((calls[0][i].name, sum(starts) / CALLS, sum(ends) / CALLS))
    return [(e.key, e.device_time_total / CALLS) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.count >= CALLS]


def row_calls(spec: str) -> dict:
    """{"ours": call, "flashmla": call} on row spec's problem over the 656-byte rows, and the
    schedule's part count under "parts"."""
    import bench_decode as bd
    import flash_mla
    import torch

    import torch_mla

    b, s_q, h_q = (int(x) for x in spec.split(","))
    tokens, idx, q, sched = bd._sparse_problem(b, s_q, h_q, 2048, 32768)
    rows = bd._sparse_cache(b * 32768, torch.uint8, 656, tokens)
    return {
        "ours": lambda: torch_mla.mla_decode_sparse(q, rows, idx, schedule=sched),
        "flashmla": bd.flash_mla_sparse_call(flash_mla, q, rows, idx),
        "parts": sched.metadata.shape[0],
    }


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m tools.sparse_kernel_times B,S_Q,H_Q [...]")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    for spec in argv:
        calls = row_calls(spec)
        for name in ("ours", "flashmla"):
            timeline = []
            times = kernel_times(calls[name], timeline)
            parts = " | ".join(f"{k[:60]} {us:.1f}" for k, us in times)
            print(f"{spec} {name}: {sum(us for _, us in times):.1f} us | {parts}", flush=True)
            spans = " | ".join(f"{k[:40]} {a:.1f}-{b:.1f}" for k, a, b in timeline)
            print(f"{spec} {name} timeline: {spans or 'not one kernel list a call'}", flush=True)
        print(f"{spec} schedule parts: {calls['parts']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
