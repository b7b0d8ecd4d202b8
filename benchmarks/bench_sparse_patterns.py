"""Where the SM90 sparse kernel's time goes: the same problem under four index patterns.

    python benchmarks/bench_sparse_patterns.py     # on an H100/H200; FlashMLA beside it if built

b 128, s_q 1, topk 2048, s_k 32768, h_q 64 and 128; the SM90 sparse kernel
(TORCH_MLA_SPARSE_SM90=1) over a bf16 cache and the 656-byte FP8 rows, FlashMLA's sparse decode
over the same rows (when flash_mla imports). Patterns: random (benchmarks/bench_decode.py's
distinct random slots), sequential (each request's first topk slots in order: whole pages), one
page (every entry in the request's first page: cache hits), none (every entry -1: nothing is
read). A kernel whose "none" time is near its "random" time is bound by its own instructions,
not by the gather's memory traffic (docs/kernels/sparse.md, session 18).
"""

from __future__ import annotations

import os

import torch
from bench_decode import _flash_mla_sparse_us, _sparse_cache, _sparse_problem, _sparse_us

import torch_mla
from torch_mla.testing import load_flash_mla


def main() -> None:
    flash_mla = load_flash_mla()
    os.environ["TORCH_MLA_SPARSE_SM90"] = "1"
    os.environ["TORCH_MLA_SPARSE_KEYSM"] = "0"
    b, s_k, topk = 128, 32768, 2048
    print("| h_q | pattern | ours bf16 us | ours 656 B us | FlashMLA 656 B us |")
    print("|---|---|---|---|---|")
    for h_q in (64, 128):
        tokens, idx, q, _ = _sparse_problem(b, 1, h_q, topk, s_k)
        base = torch.arange(b, device="cuda").int()[:, None, None] * s_k
        keys = torch.arange(topk, device="cuda").int()[None, None]
        patterns = {"random": idx, "sequential": (keys + base).contiguous(),
                    "one page": (keys % 64 + base).contiguous(),
                    "none": torch.full_like(idx, -1)}
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
