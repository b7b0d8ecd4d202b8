"""Where the SM90 sparse kernel's time goes: the same problem under four index patterns, and
small batches under schedules of more or fewer parts.

    python benchmarks/bench_sparse_patterns.py          # on an H100/H200; FlashMLA if built
    python benchmarks/bench_sparse_patterns.py --parts  # the schedule's split, small batches
    python benchmarks/bench_sparse_patterns.py --heads 16,32  # the keys-on-M kernel

b 128, s_q 1, topk 2048, s_k 32768, h_q 64 and 128; the SM90 sparse kernel
(TORCH_MLA_SPARSE_SM90=1) over a bf16 cache and the 656-byte FP8 rows (over those its split
variant, the dispatch's choice there, unless TORCH_MLA_SPARSE_PRODUCER=0), FlashMLA's sparse decode
over the same rows (when flash_mla imports). Patterns: random (benchmarks/bench_decode.py's
distinct random slots), sequential (each request's first topk slots in order: whole pages), one
page (every entry in the request's first page: cache hits), none (every entry -1: nothing is
read). A kernel whose "none" time is near its "random" time is bound by its own instructions,
not by the gather's memory traffic (docs/kernels/sparse.md, session 18).

--parts: b 2 and 32, s_q 1, h_q 64 and 128, the default kernel over bf16 and the 656-byte rows
with the schedule built for num_sms = 33 .. 264 (get_sparse_decode_schedule's num_sms: the
parts a 64-head block's entries are cut into is num_sms / ceil(h_q / 64); 132 is the H200's
default): more parts cut each token's entries finer (more partials to write and combine),
fewer leave SMs idle. FlashMLA beside each row (its own schedule).
"""

from __future__ import annotations

import os
import sys

import torch
from bench_decode import _flash_mla_sparse_us, _sparse_cache, _sparse_problem, _sparse_us

import torch_mla
from torch_mla.testing import load_flash_mla


def main_parts(flash_mla) -> None:
    s_k, topk, sms = 32768, 2048, (33, 66, 99, 132, 198, 264)
    print("| b | h_q | cache | " + " | ".join(f"num_sms {n} us" for n in sms)
          + " | FlashMLA 656 B us |")
    print("|" + "---|" * (len(sms) + 4))
    for b in (2, 32):
        for h_q in (64, 128):
            tokens, idx, q, _ = _sparse_problem(b, 1, h_q, topk, s_k)
            c8 = _sparse_cache(b * s_k, torch.uint8, 656, tokens)
            fm = float("nan")
            if flash_mla is not None:
                fm = _flash_mla_sparse_us(flash_mla, q, c8, idx)
            for name, cache in (("bf16", _sparse_cache(b * s_k, torch.bfloat16, 576, tokens)),
                                ("656 B", c8)):
                times = [_sparse_us(q, cache, idx, torch_mla.get_sparse_decode_schedule(
                    idx, h_q, num_sms=n), None) for n in sms]
                print(f"| {b} | {h_q} | {name} | " + " | ".join(f"{t:.1f}" for t in times)
                      + f" | {fm:.1f} |", flush=True)


def main_keysm(heads) -> None:
    """The keys-on-M sparse kernel (the dispatch's choice at h_q <= 32) under the four
    patterns over bf16, e4m3 and the 656-byte rows: its "none" time is its own chain (gather
    issue, expansion, MMAs, softmax) with no bytes read."""
    b, s_k, topk = 128, 32768, 2048
    print("| h_q | pattern | ours bf16 us | ours e4m3 us | ours 656 B us |")
    print("|---|---|---|---|---|")
    for h_q in heads:
        tokens, idx, q, _ = _sparse_problem(b, 1, h_q, topk, s_k)
        c16 = _sparse_cache(b * s_k, torch.bfloat16, 576, tokens)
        scale = torch.tensor([0.05], device="cuda")
        ce = _sparse_cache(b * s_k, torch.float8_e4m3fn, 576, tokens, kv_scale=scale)
        c8 = _sparse_cache(b * s_k, torch.uint8, 656, tokens)
        for name, ix in _patterns(idx, b, s_k, topk).items():
            sched = torch_mla.get_sparse_decode_schedule(ix, h_q)
            print(f"| {h_q} | {name} | {_sparse_us(q, c16, ix, sched, None):.1f} | "
                  f"{_sparse_us(q, ce, ix, sched, scale):.1f} | "
                  f"{_sparse_us(q, c8, ix, sched, None):.1f} |", flush=True)


def _patterns(idx, b, s_k, topk) -> dict:
    """The four index patterns of the module docstring, random being idx."""
    base = torch.arange(b, device="cuda").int()[:, None, None] * s_k
    keys = torch.arange(topk, device="cuda").int()[None, None]
    return {"random": idx, "sequential": (keys + base).contiguous(),
            "one page": (keys % 64 + base).contiguous(), "none": torch.full_like(idx, -1)}


def main() -> None:
    flash_mla = load_flash_mla()
    if "--parts" in sys.argv[1:]:
        return main_parts(flash_mla)
    if "--heads" in sys.argv[1:]:
        return main_keysm([int(h) for h in sys.argv[sys.argv.index("--heads") + 1].split(",")])
    os.environ["TORCH_MLA_SPARSE_SM90"] = "1"
    os.environ["TORCH_MLA_SPARSE_KEYSM"] = "0"
    b, s_k, topk = 128, 32768, 2048
    print("| h_q | pattern | ours bf16 us | ours 656 B us | FlashMLA 656 B us |")
    print("|---|---|---|---|---|")
    for h_q in (64, 128):
        tokens, idx, q, _ = _sparse_problem(b, 1, h_q, topk, s_k)
        patterns = _patterns(idx, b, s_k, topk)
        c16 = _sparse_cache(b * s_k, torch.bfloat16, 576, tokens)
        c8 = _sparse_cache(b * s_k, torch.uint8, 656, tokens)
        for name, ix in patterns.items():
            sched = torch_mla.get_sparse_decode_schedule(ix, h_q)
            fm = float("nan")
            if flash_mla is not None:
                fm = _flash_mla_sparse_us(flash_mla, q, c8, ix)
            print(f"| {h_q} | {name} | {_sparse_us(q, c16, ix, sched, None):.1f} | "
                  f"{_sparse_us(q, c8, ix, sched, None):.1f} | {fm:.1f} |", flush=True)


if __name__ == "__main__":
    main()
