"""One sparse decode kernel choice timed over rows (development tool, needs an SM90 GPU).

    python -m tools.sparse_rows MODE FORMAT B,S_Q,H_Q[,TOPK[,S_K]] [...]

MODE picks the kernel through the dispatch's environment flags:
    keysm     the keys-on-M sparse kernel (TORCH_MLA_SPARSE_KEYSM_RS=0), where it takes the rows
    rs        its ping-pong variant (TORCH_MLA_SPARSE_KEYSM_RS=1: the FP8 formats, every h_q;
              64 columns a CTA from 33 heads)
    rs32      the same with at most 32 columns a CTA (TORCH_MLA_SPARSE_KEYSM_RS=32: h_q 64 as
              two CTAs of 32 columns, each a ping-pong, instead of one of two 32-column halves)
    sm90      the heads-on-M SM90 kernel (TORCH_MLA_SPARSE_KEYSM=0, TORCH_MLA_SPARSE_SM90=1,
              TORCH_MLA_SPARSE_PRODUCER=0: at 64-128 heads the split is the default)
    producer  its variant with a producer warpgroup (the same and TORCH_MLA_SPARSE_PRODUCER=1)
    split     the same with FlashMLA's warpgroup split (TORCH_MLA_SPARSE_PRODUCER=split)
    portable  the portable kernel (both 0)
    flashmla  FlashMLA's sparse decode (FORMAT 656 only; its build on PYTHONPATH, as
              shared/anchors/flashmla-sm90-sparse says): the same problem, for a same-start
              ratio beside ours
FORMAT: bf16, e4m3 (float8_e4m3fn with kv_scale) or 656 (DeepSeek-V3.2's 656-byte rows).
TOPK defaults to 2048 and S_K to 32768 (the issue's V3.2 shapes).
Each row: one mla_decode_sparse call (schedule made once, outside) captured in a CUDA graph, on
benchmarks/bench_decode.py's problem (each query token names TOPK distinct random slots of its
request's S_K tokens); us, GB/s of the rows named and % of the copy ceiling, and the kernel the
dispatch took (a mode whose kernel does not take the row says so). An A/B of two trees: run each
tree with PYTHONPATH=TREE and its own TORCH_MLA_CACHE_DIR, alternating; TAG (environment)
prefixes each line. NONE=1 (environment): every entry -1, so nothing is read (the kernel's own
chain: bench_sparse_patterns.py's "none"). SMS=N (environment): the schedule made for N SMs
(get_sparse_decode_schedule's num_sms: fewer, longer pieces), the grid with it.
"""

from __future__ import annotations

import os
import sys

MODES = {
    "keysm": {"TORCH_MLA_SPARSE_KEYSM_RS": "0"},
    "rs": {"TORCH_MLA_SPARSE_KEYSM_RS": "1"},
    "rs32": {"TORCH_MLA_SPARSE_KEYSM_RS": "32"},
    "sm90": {"TORCH_MLA_SPARSE_KEYSM": "0", "TORCH_MLA_SPARSE_SM90": "1",
             "TORCH_MLA_SPARSE_PRODUCER": "0"},
    "producer": {"TORCH_MLA_SPARSE_KEYSM": "0", "TORCH_MLA_SPARSE_SM90": "1",
                 "TORCH_MLA_SPARSE_PRODUCER": "1"},
    "split": {"TORCH_MLA_SPARSE_KEYSM": "0", "TORCH_MLA_SPARSE_SM90": "1",
              "TORCH_MLA_SPARSE_PRODUCER": "split"},
    "portable": {"TORCH_MLA_SPARSE_KEYSM": "0", "TORCH_MLA_SPARSE_SM90": "0"},
    "flashmla": {},
}
# the kernel each mode asks for (ops.sparse.sparse_backend's names)
KERNELS = {"keysm": "sm90_keysm", "rs": "sm90_keysm_rs", "rs32": "sm90_keysm_rs", "sm90": "sm90",
           "producer": "sm90_producer", "split": "sm90_split", "portable": "sm80",
           "flashmla": "flashmla"}
# bytes of a cache row, by format
ROW_BYTES = {"bf16": 1152, "e4m3": 576, "656": 656}


def parse_row(spec: str) -> tuple[int, int, int, int, int]:
    """'b,s_q,h_q[,topk[,s_k]]' -> (b, s_q, h_q, topk, s_k)."""
    vals = [int(x) for x in spec.split(",")]
    if not 3 <= len(vals) <= 5:
        raise SystemExit(f"a row is B,S_Q,H_Q[,TOPK[,S_K]], got {spec!r}")
    return tuple(vals + [2048, 32768][len(vals) - 3:])


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] not in MODES or argv[1] not in ROW_BYTES:
        raise SystemExit(f"usage: python -m tools.sparse_rows {{{','.join(MODES)}}} "
                         f"{{{','.join(ROW_BYTES)}}} B,S_Q,H_Q[,TOPK[,S_K]] [...]")
    mode, fmt = argv[0], argv[1]
    if mode == "flashmla" and fmt != "656":
        raise SystemExit("flashmla: FORMAT 656 (FlashMLA's sparse decode reads the 656-byte rows)")
    rows = [parse_row(spec) for spec in argv[2:]]
    os.environ.update(MODES[mode])
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import bench_decode as bd
    import torch

    from torch_mla.ops.sparse import sparse_backend

    dtype, width = {"bf16": (torch.bfloat16, 576), "e4m3": (torch.float8_e4m3fn, 576),
                    "656": (torch.uint8, 656)}[fmt]
    for spec, (b, s_q, h_q, topk, s_k) in zip(argv[2:], rows):
        tokens, idx, q, sched = bd._sparse_problem(b, s_q, h_q, topk, s_k)
        if os.environ.get("SMS"):
            import torch_mla

            sched = torch_mla.get_sparse_decode_schedule(idx, h_q, num_sms=int(os.environ["SMS"]))
        if os.environ.get("NONE") == "1":
            idx.fill_(-1)
        kv_scale = None
        if fmt == "e4m3":
            kv_scale = (torch.cat(tokens, 1).float().abs().amax() / 448).reshape(1)
        cache = bd._sparse_cache(b * s_k, dtype, width, tokens, kv_scale)
        line = f"{os.environ.get('TAG', '')} {mode} {fmt} {spec}:"
        if mode == "flashmla":
            import flash_mla

            taken = "flashmla"
            us = bd._flash_mla_sparse_us(flash_mla, q, cache, idx)
        else:
            taken = sparse_backend(q, cache, 512)[0]
            if taken != KERNELS[mode]:
                print(f"{line} not taken ({taken} would run)", flush=True)
                continue
            us = bd._sparse_us(q, cache, idx, sched, kv_scale)
        gbps = b * s_q * topk * ROW_BYTES[fmt] / us / 1e3
        print(f"{line} {us:.1f} us, {gbps:.0f} GB/s "
              f"({100 * gbps / bd.COPY_GBPS:.0f}% of the H200 copy), {taken}", flush=True)
        del cache, tokens


if __name__ == "__main__":
    main(sys.argv[1:])
