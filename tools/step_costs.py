"""A memory-bound decode step's fixed cost and streaming rate (development tool, needs a GPU).

    python -m tools.step_costs KIND [--no-combine] [--check-batch=N] [--overhead=N] [--warm]
                               [B,S_Q,S_K,H_Q ...]

KIND is the step timed (rows of <= 32 query rows a KV head, one KV head):
    bf16   the keys-on-M kernel over the bf16 cache (the dispatch's choice there)
    exact  over the e4m3 cache in exact mode (the ping-pong from a batch of 8)
    fast   over the e4m3 cache in fast mode (the keys-on-M fast variant)
    ring   fast mode's load-only variant (tools.keysm_load_only.LoadOnly: each page's ring
           stage released as soon as it lands; outputs are garbage)
    read   no decode: torch.amax over an int32 tensor of the row's e4m3 cache bytes (b s_k 576),
           the GPU's own fixed cost and read rate over the same byte counts
--no-combine drops the step's combine launch (decode_step.MLADecodeStep.combine): the outputs of
split requests are then garbage, the time is what the step costs without it. --check-batch=N:
the combine's block-table check (combine.check_request) loads N entries a lane before it
compares them (combine.first_outside's batch; 1 in the shipped dense step). --overhead=N: the
schedule charges each request N blocks (constants.OVERHEAD_BLOCKS, 5; schedule_with_overhead:
no kernel changes, so no cache of its own). A patched build (ring, --no-combine,
--check-batch) must have a TORCH_MLA_CACHE_DIR of its own: the kernel cache would otherwise
keep it under the shipped step's key. --warm compiles the step (one small
call) and exits, so that the builds can run in parallel processes before the timed ones run one
by one.

Each row is one decode call in a CUDA graph (benchmarks/bench_decode.run_config, no check),
every row timed twice (the rows in order, then again); bf16 times FlashMLA's bf16 decode
beside it where its build is importable.
The default rows are b 128, h_q 16 at s_k 4096, 8192 and 16384: the same length draws, scaled,
so the bytes double from one to the next while the requests, the schedule's pieces and the
combine's work stay. The least-squares line t = F + bytes / R through the rows gives F, the
step's cost that does not grow with the bytes (launch, the first loads, the tail, the
combine, each segment's start and end), and R, the rate it streams the cache at.
"""

from __future__ import annotations

import os
import sys

ROWS = ["128,1,4096,16", "128,1,8192,16", "128,1,16384,16"]
KINDS = ("bf16", "exact", "fast", "ring", "read")


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(F us, R GB/s) of the least-squares line us = F + bytes / R through (bytes, us)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx  # us per byte
    return my - slope * mx, 1e-3 / slope


def read_row(b: int, s_k: int) -> tuple[float, int]:
    """(us, bytes) of one torch.amax over b * s_k * 576 bytes (an int32 tensor), timed as the
    decode rows are (a CUDA graph of one call): a read with no decode around it."""
    import torch

    from torch_mla.testing import graph_time_us

    x = torch.empty(b * s_k * 576 // 4, dtype=torch.int32, device="cuda").random_()
    return graph_time_us(lambda: torch.amax(x)), x.numel() * 4


def schedule_with_overhead(units: int) -> None:
    """torch_mla.get_decode_schedule (what bench_decode calls) replaced by the schedule's torch
    ops (scheduling.compute_schedule, the same cuts as the schedule kernel) charging each
    request `units` blocks of overhead instead of constants.OVERHEAD_BLOCKS."""
    import torch_mla
    from torch_mla import scheduling
    from torch_mla.ops.schedule import DecodeSchedule

    scheduling.OVERHEAD_BLOCKS = units  # (compute_schedule and whole_request_cuts read it)

    def get_decode_schedule(seqlens, s_q, h_q, num_sms=None, *, h_kv=1):
        sms = num_sms or scheduling.default_num_sms(seqlens.device)
        parts = scheduling.DecodeSplitConfig.from_heuristic(s_q, h_q, sms, h_kv).num_parts
        return DecodeSchedule(*scheduling.compute_schedule(seqlens, parts))

    torch_mla.get_decode_schedule = get_decode_schedule


def main(argv: list[str]) -> None:
    args = [a for a in argv if not a.startswith("--")]
    flags = {a.split("=")[0]: a.partition("=")[2] for a in argv if a.startswith("--")}
    if not args or args[0] not in KINDS or set(flags) - {"--no-combine", "--warm",
                                                         "--check-batch", "--overhead"}:
        raise SystemExit(__doc__)
    kind, rows = args[0], args[1:] or ROWS
    if "--overhead" in flags:
        schedule_with_overhead(int(flags["--overhead"]))
    patched = kind == "ring" or "--no-combine" in flags or "--check-batch" in flags
    if patched and "TORCH_MLA_CACHE_DIR" not in os.environ:
        raise SystemExit("set TORCH_MLA_CACHE_DIR to a directory of this build's own")
    if kind == "ring":
        from torch_mla.cute_kernels import sm90_keysm_fast_decode as fast

        from .keysm_load_only import LoadOnly

        fast.MLADecodeSm90KeysMFast = LoadOnly  # (what decode_kernel builds)
    if "--no-combine" in flags:
        from torch_mla.cute_kernels.decode_step import MLADecodeStep

        MLADecodeStep.combine = lambda self, variant, args: None  # (traced: launches nothing)
    if "--check-batch" in flags:
        from torch_mla.cute_kernels import combine

        batch, check = int(flags["--check-batch"]), combine.first_outside

        def batched(*a, **k):  # (the sparse check passes its own batch)
            return check(*a, **{"batch": batch, **k})

        combine.first_outside = batched
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_decode

    from torch_mla.testing import load_flash_mla

    fp8 = kind != "bf16"
    compute = "fp8" if kind in ("fast", "ring") else "exact"
    if "--warm" in flags:
        if kind != "read":
            bench_decode.run_config(8, 1, 1024, 16, False, check=False, fp8=fp8,
                                    compute=compute)
        return
    name = kind + (" without the combine" if "--no-combine" in flags else "") + (
        f" (check batch {flags['--check-batch']})" if "--check-batch" in flags else "") + (
        f" (overhead {flags['--overhead']} blocks)" if "--overhead" in flags else "")
    # FlashMLA's bf16 decode beside the shipped bf16 step, where its build is importable.
    flash_mla = load_flash_mla() if kind == "bf16" and "--no-combine" not in flags else None
    for rep in (1, 2):  # (every row twice, in order: drift shows as a gap between the two)
        points = []
        for spec in rows:
            b, s_q, s_k, h_q = (int(x) for x in spec.split(","))
            if kind == "read":
                us, nbytes = read_row(b, s_k)
                points.append((nbytes, us))
                gbps, fm_us = nbytes / us / 1e3, float("nan")
            else:
                us, _, gbps, _, fm_us = bench_decode.run_config(
                    b, s_q, s_k, h_q, s_q > 1, check=False, flash_mla=flash_mla, fp8=fp8,
                    compute=compute)
                points.append((gbps * us * 1e3, us))
            fm = f", FlashMLA bf16 {fm_us:.1f} us" if flash_mla is not None else ""
            print(f"{name} ({rep}): {spec} {us:.1f} us, {points[-1][0] / 1e6:.0f} MB, "
                  f"{gbps:.0f} GB/s{fm}", flush=True)
        if len(points) > 1:
            f, r = fit(points)
            print(f"{name} ({rep}): fit over {len(points)} rows: F {f:.1f} us, R {r:.0f} GB/s",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
