"""Per-kernel GPU times of one sparse decode call, ours and FlashMLA's (development tool, needs an
SM90 GPU; FlashMLA's sparse build on PYTHONPATH, as shared/anchors/flashmla-sm90-sparse says).

    python -m tools.sparse_kernel_times B,S_Q,H_Q [...]

Each row: bench_decode.py's sparse problem over the 656-byte rows (topk 2048, s_k 32768), one
mla_decode_sparse call (the dispatch's kernel, schedule made once, outside) and one FlashMLA
flash_mla_with_kvcache call, each run 20 times eagerly under torch.profiler after a warm-up.
Prints, per call, every GPU kernel that ran once a call with its mean time (us) and their sum,
then the schedule's part count: where the small-batch rows' time goes (the decode kernel, the
combine, anything else), which a CUDA-graph total (tools/sparse_rows.py) does not show.
"""

from __future__ import annotations

import os
import sys

CALLS = 20


def kernel_times(fn) -> list[tuple[str, float]]:
    """(kernel name, mean us a call) of the GPU kernels fn launches once a call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
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
            times = kernel_times(calls[name])
            parts = " | ".join(f"{k[:60]} {us:.1f}" for k, us in times)
            print(f"{spec} {name}: {sum(us for _, us in times):.1f} us | {parts}", flush=True)
        print(f"{spec} schedule parts: {calls['parts']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
