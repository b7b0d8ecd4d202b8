"""Whole-request schedules against the uniform cut (development tool, needs the GPU):

    python tools/ab_whole_schedule.py

For each row, mla_decode (CUDA graph, as bench_decode.py) with the schedule get_decode_schedule
makes (whole requests per part where scheduling.whole_request_cuts chooses them) and with the
uniform cut of compute_schedule with that choice turned off, in one run. The default schedule's
output is checked against the fp32 reference (lse within 1e-3, out's relative error printed).
Rows: batches of equal lengths (where whole requests are chosen, or not: 96 and 32 requests),
and two anchor rows (lengths of shared/anchors/README.md, where the uniform cut stays)."""

from __future__ import annotations

import os
import sys

import torch

import torch_mla
from torch_mla import scheduling
from torch_mla.reference import mla_decode_reference
from torch_mla.testing import DecodeInputs, make_anchor_inputs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_decode import graph_time_us  # noqa: E402


def equal_inputs(b: int, length: int, h_q: int) -> DecodeInputs:
    pages = -(-length // 64)
    q = (torch.randn(b, 1, h_q, 576, device="cuda") / 10).to(torch.bfloat16)
    table = torch.randperm(b * pages, device="cuda", dtype=torch.int32).view(b, -1)
    cache = (torch.randn(b * pages, 64, 1, 576, device="cuda") / 10).to(torch.bfloat16)
    return DecodeInputs(q, cache, table,
                        torch.full((b,), length, dtype=torch.int32, device="cuda"))


ROWS = [("128 x 4097, equal, h_q 128", lambda: equal_inputs(128, 4097, 128), 128),
        ("64 x 4097, equal, h_q 128", lambda: equal_inputs(64, 4097, 128), 128),
        ("96 x 4097, equal, h_q 128", lambda: equal_inputs(96, 4097, 128), 128),
        ("32 x 4097, equal, h_q 128", lambda: equal_inputs(32, 4097, 128), 128),
        ("128 x 8193, equal, h_q 16", lambda: equal_inputs(128, 8193, 16), 16),
        ("128 x 4096 anchor, h_q 128", lambda: make_anchor_inputs(128, 1, 128, 4096), 128),
        ("128 x 8192 anchor, h_q 64", lambda: make_anchor_inputs(128, 1, 64, 8192), 64)]


def uniform_schedule(lens: torch.Tensor, parts: int):
    saved = scheduling.WHOLE_MAX_BATCH
    scheduling.WHOLE_MAX_BATCH = 0  # (whole_request_cuts reads it at each call)
    try:
        meta, splits = scheduling.compute_schedule(lens.cpu(), parts)
    finally:
        scheduling.WHOLE_MAX_BATCH = saved
    return meta.to(lens.device), splits.to(lens.device)


def timed(args, schedule) -> float:
    return graph_time_us(lambda: torch_mla.mla_decode(*args, schedule))


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}: mla_decode us (CUDA graph replays), default "
          "schedule vs the uniform cut, one run")
    print("| row | default schedule | us | uniform cut us | uniform / default | rel err |\n"
          "|---|---|---|---|---|---|")
    for name, make, h_q in ROWS:
        x = make()
        args = (x.q, x.kv_cache, x.block_table, x.cache_seqlens)
        default = torch_mla.get_decode_schedule(x.cache_seqlens, 1, h_q)
        whole = int(default.num_splits[-1]) == int((x.cache_seqlens > 0).sum())
        uniform = uniform_schedule(x.cache_seqlens, default.metadata.shape[0])
        out, lse = torch_mla.mla_decode(*args, default)
        ref, ref_lse = mla_decode_reference(*args, 576**-0.5, False, 512)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4), name
        t_default, t_uniform = timed(args, default), timed(args, uniform)
        print(f"| {name} | {'whole requests' if whole else 'uniform cut'} | {t_default:.1f} | "
              f"{t_uniform:.1f} | {t_uniform / t_default:.3f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
