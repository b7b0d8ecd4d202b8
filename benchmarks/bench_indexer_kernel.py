"""DSA lightning-indexer logits benchmark (cute_kernels/sm90_indexer.py) on DeepSeek-V3.2 shapes:
H 64 index heads, D 128, pages of 64 tokens, every request of the batch at the full context.

    python benchmarks/bench_indexer_kernel.py                   # bf16 and e4m3, b 1..128, s_q 1-2,
                                                         # contexts 4096 / 32768 / 131072
    python benchmarks/bench_indexer_kernel.py --quick           # a few of them
    python benchmarks/bench_indexer_kernel.py --sweep           # also pages_per_cta around the
                                                         # heuristic's choice (calibration)
    python benchmarks/bench_indexer_kernel.py --out DIR         # also DIR/bench_indexer_kernel.csv

Per configuration: one launch (indexer_logits_sm90, fresh random inputs, a scattered block
table) captured in a CUDA graph and replayed under triton.testing.do_bench (warmup 50, rep 300,
median; torch_mla.testing.graph_time_us). Its logits are first checked against an fp32 torch
computation on the GPU (the first two requests; --no-check skips it). With L the context,
e = 2 bytes (bf16) or 1 (e4m3):
    bytes = b * (L * D * e            the keys, read once
                 + L * 4 (e4m3)       their scales
                 + s_q * H * (D * e + 4)   q and the weights
                 + L / 64 * 4         the block table
                 + s_q * L * 4)       the logits written
    FLOP  = 2 * b * s_q * H * D * L   (the MMA; relu and the weighted sum add 2 * b * s_q * H * L)
Ceilings (H200): 4246 GB/s device-to-device copy; 679 TFLOP/s bf16, 1244 TFLOP/s e4m3 matmul
(the repository's measured ceilings). "roof" = the larger of bytes / copy and FLOP / matmul,
as a percentage of the measured time (100 = at the roofline).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys

import torch

from torch_mla.constants import PAGE_SIZE
from torch_mla.ops.indexer_kernel import indexer_kernel_unsupported, indexer_logits_sm90
from torch_mla.scheduling import IndexerSplit, default_num_sms
from torch_mla.testing import graph_time_us

COPY_GBPS = 4246.0
MMA_TFLOPS = {"bf16": 679.0, "e4m3": 1244.0}
H, D = 64, 128
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (4096, 32768, 131072)
QUICK = [(1, 1, 4096), (1, 2, 131072), (8, 2, 32768), (32, 1, 32768), (128, 2, 32768),
         (128, 1, 131072)]


def make_inputs(b: int, s_q: int, ctx: int, dtype: str):
    """Fresh random V3.2-shaped inputs on the GPU: every request at ctx tokens, its pages
    scattered over the cache."""
    pages = ctx // PAGE_SIZE
    num_blocks = b * pages
    dev = "cuda"
    table = torch.randperm(num_blocks, device=dev, dtype=torch.int32).view(b, pages)
    keys = torch.randn(num_blocks, PAGE_SIZE, D, device=dev)
    q = torch.randn(b, s_q, H, D, device=dev)
    scale = None
    if dtype == "e4m3":
        scale = keys.abs().amax(-1) / 448.0
        keys = (keys / scale[..., None]).to(torch.float8_e4m3fn)
        q = (q * 8).to(torch.float8_e4m3fn)
    else:
        keys, q = keys.bfloat16(), q.bfloat16()
    weights = torch.randn(b, s_q, H, device=dev) / math.sqrt(H)
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    out = torch.empty(b, s_q, ctx, device=dev)
    return (q, weights, keys, scale, table, seqlens), out


def check(args, out, n: int = 2) -> float:
    """Worst |kernel - fp32 torch| / (1e-3 + sum_h |w| sum_d |q k|) over the first n requests
    (the magnitude bounds the rounding: tests/test_indexer_kernel.py); -inf exactly past each
    token's horizon."""
    q, weights, keys, scale, table, seqlens = args
    s_q, worst = q.shape[1], 0.0
    for r in range(min(n, q.shape[0])):
        L = int(seqlens[r])
        pages = table[r, :L // PAGE_SIZE].long()
        k = keys[pages].reshape(-1, D).float()
        if scale is not None:
            k = k * scale[pages].reshape(-1, 1)
        qr = q[r].float()
        ref = torch.einsum("th,thj->tj", weights[r], torch.einsum("thd,jd->thj", qr, k).relu())
        mag = torch.einsum("th,thj->tj", weights[r].abs(),
                           torch.einsum("thd,jd->thj", qr.abs(), k.abs()))
        for t in range(s_q):
            border = L - s_q + t + 1
            got = out[r, t]
            assert (got[border:] == -math.inf).all(), "a masked logit is not -inf"
            err = (got[:border] - ref[t, :border]).abs() / (1e-3 + mag[t, :border])
            worst = max(worst, float(err.max()))
    return worst


TOL = {"bf16": 1e-4, "e4m3": 2e-3}  # err bars (the tests' relative bounds)


def run(b: int, s_q: int, ctx: int, dtype: str, pages_per_cta: int | None, do_check: bool):
    args, out = make_inputs(b, s_q, ctx, dtype)
    why = indexer_kernel_unsupported(*args, out)
    if why:
        sys.exit(why)
    err = float("nan")
    if do_check:
        indexer_logits_sm90(*args, out, pages_per_cta)
        err = check(args, out)
    us = graph_time_us(lambda: indexer_logits_sm90(*args, out, pages_per_cta))
    e = 1 if dtype == "e4m3" else 2
    nbytes = b * (ctx * D * e + (ctx * 4 if dtype == "e4m3" else 0) + s_q * H * (D * e + 4)
                  + ctx // PAGE_SIZE * 4 + s_q * ctx * 4)
    flop = 2 * b * s_q * H * D * ctx
    gbps, tflops = nbytes / us / 1e3, flop / us / 1e6
    roof_us = max(nbytes / COPY_GBPS / 1e3, flop / MMA_TFLOPS[dtype] / 1e6)
    return {"us": us, "GB/s": gbps, "%copy": 100 * gbps / COPY_GBPS, "TFLOP/s": tflops,
            "%mma": 100 * tflops / MMA_TFLOPS[dtype], "%roof": 100 * roof_us / us, "err": err}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sweep", action="store_true",
                   help="also time pages_per_cta at 1/4, 1/2, 2 and 4 x the heuristic's")
    p.add_argument("--dtype", choices=["bf16", "e4m3", "both"], default="both")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--out", help="a directory for bench_indexer_kernel.csv")
    a = p.parse_args(argv)
    configs = QUICK if a.quick else [(b, s, c) for c in CONTEXTS for s in (1, 2) for b in BATCHES]
    dtypes = ["bf16", "e4m3"] if a.dtype == "both" else [a.dtype]
    sms = default_num_sms(torch.device("cuda"))
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; H {H}, D {D}; ceilings {COPY_GBPS:.0f} "
          f"GB/s, {MMA_TFLOPS['bf16']:.0f} / {MMA_TFLOPS['e4m3']:.0f} TFLOP/s bf16 / e4m3")
    head = (f"{'dtype':>5} {'b':>4} {'s_q':>3} {'ctx':>7} {'pages/cta':>9} {'us':>9} "
            f"{'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8} {'%mma':>5} {'%roof':>6} {'err':>8}")
    print(head)
    rows = []
    for dtype in dtypes:
        for b, s_q, ctx in configs:
            choice = IndexerSplit.from_heuristic(b, ctx // PAGE_SIZE, sms).pages_per_cta
            sizes = [choice]
            if a.sweep:
                sizes += sorted({max(1, choice // 4), max(1, choice // 2),
                                 min(ctx // PAGE_SIZE, choice * 2),
                                 min(ctx // PAGE_SIZE, choice * 4)} - {choice})
            for i, c in enumerate(sizes):
                res = run(b, s_q, ctx, dtype, c, not a.no_check and i == 0)
                mark = "" if c == choice else " (sweep)"
                print(f"{dtype:>5} {b:>4} {s_q:>3} {ctx:>7} {c:>9} {res['us']:>9.1f} "
                      f"{res['GB/s']:>7.0f} {res['%copy']:>6.1f} {res['TFLOP/s']:>8.1f} "
                      f"{res['%mma']:>5.1f} {res['%roof']:>6.1f} {res['err']:>8.1e}{mark}",
                      flush=True)
                rows.append({"dtype": dtype, "b": b, "s_q": s_q, "ctx": ctx,
                             "pages_per_cta": c, "heuristic": c == choice, **res})
            torch.cuda.empty_cache()
    bad = [r for r in rows if r["err"] > TOL[r["dtype"]]]
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bench_indexer_kernel.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if bad:
        print(f"FAILED: {len(bad)} configurations off the fp32 reference (err > {TOL})")
        return 1
    print("all checked configurations match the fp32 reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
