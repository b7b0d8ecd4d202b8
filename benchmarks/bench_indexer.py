"""DeepSeek-V3.2's lightning indexer (torch_mla.indexer_topk) alone, at its shape: time per call,
split into the logits and the top-k, against the floor.

    python benchmarks/bench_indexer.py                  # b 1, 32 x contexts 4096, 32768, 131072
    python benchmarks/bench_indexer.py --fp8            # over FP8 index keys (e4m3 + scale)
    python benchmarks/bench_indexer.py --configs 8,65536 --s-q 2

Per configuration (b requests of s_q query tokens, each request's context L cached): q
[b, s_q, 64, 128], weights float32 [b, s_q, 64], a paged index-key cache [pages, 64, 128] holding
random keys, a shuffled block table. Each column is one call captured in a CUDA graph and timed by
torch_mla.testing.graph_time_us (do_bench median):
    logits   torch_mla.indexer_logits (the kernel if find_indexer_kernel has one, else the
             reference)
    top-k    torch_mla.ops.indexer.select_slots on those logits (torch.topk, sorted, then the
             slot gather)
    sort     torch.sort of the whole logits row: what a top-k that sorted all L would cost
    total    torch_mla.indexer_topk
Floor: the larger of bytes / 4246 GB/s and FLOP / 679 TFLOP/s (fp8: 1244), with
    bytes = b * L * (128 * 2) (bf16 keys; fp8: 128 + 4)  +  b * s_q * L * 4 * 2 (logits out, in)
    FLOP  = 2 * b * s_q * L * 64 * 128  +  2 * b * s_q * L * 64 (the weighted relu sum)
"""

from __future__ import annotations

import argparse

import torch

import torch_mla
from torch_mla.ops.indexer import find_indexer_kernel, select_slots
from torch_mla.reference_indexer import quantize_index_keys
from torch_mla.testing import graph_time_us

COPY_GBPS, BF16_TFLOPS, FP8_TFLOPS = 4246.0, 679.0, 1244.0
HEADS, DIM, TOPK, PAGE = 64, 128, 2048, 64
DEFAULT_CONFIGS = "1,4096 1,32768 1,131072 32,4096 32,32768 32,131072"


def inputs(b: int, s_q: int, ctx: int, fp8: bool):
    pages = -(-ctx // PAGE)
    table = torch.randperm(b * pages, device="cuda").view(b, pages).int()
    keys = torch.randn(b * pages, PAGE, DIM, device="cuda")
    q = torch.randn(b, s_q, HEADS, DIM, device="cuda")
    w = torch.randn(b, s_q, HEADS, device="cuda") * DIM ** -0.5 * HEADS ** -0.5
    scale = None
    if fp8:
        keys, scale = quantize_index_keys(keys)
        q, q_scale = quantize_index_keys(q)
        w = w * q_scale
    else:
        keys, q = keys.bfloat16(), q.bfloat16()
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    return q, w, keys, scale, table, lens


def floor_us(b: int, s_q: int, ctx: int, fp8: bool) -> float:
    key_bytes = DIM + 4 if fp8 else 2 * DIM
    nbytes = b * ctx * key_bytes + b * s_q * ctx * 4 * 2
    flop = 2 * b * s_q * ctx * HEADS * DIM + 2 * b * s_q * ctx * HEADS
    tflops = FP8_TFLOPS if fp8 else BF16_TFLOPS
    return max(nbytes / (COPY_GBPS * 1e3), flop / (tflops * 1e6))


def run_config(b: int, s_q: int, ctx: int, fp8: bool) -> str:
    """One table row: the four timings and the floor of a (batch, context) configuration."""
    q, w, keys, scale, table, lens = inputs(b, s_q, ctx, fp8)
    logits = torch_mla.indexer_logits(q, w, keys, table, lens, index_scale=scale)
    t_logits = graph_time_us(lambda: torch_mla.indexer_logits(q, w, keys, table, lens,
                                                              index_scale=scale))
    t_topk = graph_time_us(lambda: select_slots(logits, table, lens, TOPK))
    t_sort = graph_time_us(lambda: torch.sort(logits, dim=-1, descending=True))
    t_total = graph_time_us(lambda: torch_mla.indexer_topk(q, w, keys, table, lens, TOPK,
                                                           index_scale=scale))
    fl = floor_us(b, s_q, ctx, fp8)
    return (f"| {b} | {ctx} | {t_logits:.1f} | {t_topk:.1f} | {t_sort:.1f} | {t_total:.1f} | "
            f"{fl:.1f} | {100 * fl / t_total:.3g}% |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="space-separated b,context pairs (default: %(default)s)")
    ap.add_argument("--s-q", type=int, default=1, help="query tokens a request (default 1)")
    ap.add_argument("--fp8", action="store_true", help="FP8 index keys (e4m3, a scale a token)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_indexer times CUDA graphs: it needs a GPU")
    probe = inputs(1, 1, PAGE, args.fp8)
    kernel = find_indexer_kernel(probe[0], probe[2]) is not None
    print(f"# torch_mla.indexer_topk, {torch.cuda.get_device_name()}: {HEADS} heads x {DIM}, "
          f"topk {TOPK}, s_q {args.s_q}, {'fp8' if args.fp8 else 'bf16'} keys; logits: "
          f"{'kernel' if kernel else 'reference'}")
    print("\n| b | context | logits us | top-k us | sort us | total us | floor us | % of floor |")
    print("|---|---|---|---|---|---|---|---|")
    for config in args.configs.split():
        b, ctx = (int(x) for x in config.split(","))
        print(run_config(b, args.s_q, ctx, args.fp8), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
