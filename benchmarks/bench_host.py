"""Host time of one eager call of each op (CPU microseconds to issue it), beside FlashMLA's.

    python benchmarks/bench_host.py            # on a GPU; FlashMLA too when `flash_mla` imports

A decode step at small batch is bounded by how fast the host issues kernels, not by the GPU. Here
the GPU is first held busy (``torch.cuda._sleep``) so that nothing waits for it, then N calls are
issued and the CPU time per call is taken (median of several rounds); the GPU work queued behind
the sleep is then drained. Value checks stay on (the defaults). Shapes: batch 4, 1 query token,
128 heads, lengths ~1000 (the host path does not depend on them).
"""

from __future__ import annotations

import statistics
import time

import torch

import torch_mla
from torch_mla.testing import make_decode_inputs

# At most ~1000 launches may wait in a stream's queue before a launch blocks the host: a round
# issues few enough calls (the torch-op schedule alone is ~40 kernels) to stay below that.
ROUNDS, CALLS = 31, 10


def host_us(fn) -> float:
    for _ in range(10):  # compile, load, warm up
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU spin: the queue never drains meanwhile
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main():
    b, s_q, h_q = 4, 1, 128
    inp = make_decode_inputs([900, 1000, 1100, 1200], s_q, h_q, device="cuda")
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    kv_c = torch.randn(b, 512, dtype=torch.bfloat16, device="cuda")
    k_pe = torch.randn(b, 64, dtype=torch.bfloat16, device="cuda")
    slots = torch_mla.slot_mapping(inp.block_table, inp.cache_seqlens - 1, 1)
    cache = inp.kv_cache.clone()
    rows = [
        ("get_decode_schedule", lambda: torch_mla.get_decode_schedule(inp.cache_seqlens, s_q,
                                                                      h_q)),
        ("mla_decode (schedule given)", lambda: torch_mla.mla_decode(
            inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched)),
        ("mla_decode (schedule inside)", lambda: torch_mla.mla_decode(
            inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens)),
        ("append_kv", lambda: torch_mla.append_kv(cache, kv_c, k_pe, slots)),
        ("slot_mapping", lambda: torch_mla.slot_mapping(inp.block_table, inp.cache_seqlens, 1)),
    ]
    try:
        import flash_mla

        meta, _ = flash_mla.get_mla_metadata()

        def fm():
            return flash_mla.flash_mla_with_kvcache(inp.q, inp.kv_cache, inp.block_table,
                                                    inp.cache_seqlens, 512, meta, None)

        rows.append(("FlashMLA flash_mla_with_kvcache (metadata reused)", fm))
    except ImportError:
        pass
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: host us per eager call "
          f"(median of {ROUNDS} rounds x {CALLS} calls)")
    print("| call | host us |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {host_us(fn):.1f} |")


if __name__ == "__main__":
    main()
