"""Per-CTA timeline of the SM90 decode kernel (development tool, needs the H200).

    python -m tools.trace_decode [OUT_DIR] [B,S_Q,S_K,H_Q ...]

Builds TracedDecodeSm90 (the shipped MLADecodeSm90 with its trace points recording
%globaltimer, see MLADecodeSm90._stamp), runs it on the anchor workload of each configuration,
prints where the time goes (segment start-up, per-block loop time, epilogue, tail imbalance, the
duration of a pair of blocks by when it starts) and saves the raw stamps with the schedule to
OUT_DIR/trace_B_SQ_SK_HQ.pt for offline analysis. Also times the decode kernel alone, the
combine kernel alone and the whole op in CUDA graphs.
"""

from __future__ import annotations

import os
import sys

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, const_expr

import torch_mla
from torch_mla.cute_kernels.ptx import globaltimer
from torch_mla.cute_kernels.sm90_decode import MLADecodeSm90
from torch_mla.scheduling import walk_schedule
from torch_mla.testing import make_anchor_inputs

DEFAULT = ["128,1,4096,128", "32,1,4096,128", "8,1,4096,128", "64,1,2048,16", "128,1,8192,16"]

# The stamp table, (ctas, TRACE_SLOTS) int64 ns per CTA: slot 0 the kernel's start, TRACE_END
# its end; per segment k (the last slot set is reused past TRACE_SEGS segments) the
# TRACE_PER_SEG trace points 0-9 of MLADecodeSm90._stamp at 1 + TRACE_PER_SEG k; WG0's start
# of pair i of segment k (k < TRACE_PAIR_SEGS, i < TRACE_PAIRS, the last reused) at
# TRACE_PAIR0 + TRACE_PAIRS k + i.
TRACE_SLOTS, TRACE_PER_SEG, TRACE_SEGS, TRACE_END = 128, 10, 6, 63
TRACE_PAIR0, TRACE_PAIRS, TRACE_PAIR_SEGS = 64, 32, 2


class TracedDecodeSm90(MLADecodeSm90):
    """MLADecodeSm90 (bf16/fp16 cache) whose trace points write %globaltimer into a stamp
    table, one more argument after the stream: int64 (ctas, TRACE_SLOTS), CTA m + num_m_blocks
    * part. The stamps are global stores of the thread named at each point, so the timings
    are of a slightly different kernel."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mBlockTable: cute.Tensor,
                 mSeqlens: cute.Tensor, mMeta: cute.Tensor, mNumSplits: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mOacc: cute.Tensor, mLSEacc: cute.Tensor,
                 scale_log2: Float32, stream, mTrace: cute.Tensor):
        self.trace_table = mTrace
        MLADecodeSm90.__call__(self, mQ, mKV, mBlockTable, mSeqlens, mMeta, mNumSplits, mO,
                               mLSE, mOacc, mLSEacc, scale_log2, stream)

    @cute.jit
    def _stamp(self, event, who: int = 0, i=None) -> None:
        if const_expr(event == "start"):
            m_block, part, _ = cute.arch.block_idx()
            self.d_cta = part * cute.arch.grid_dim()[0] + m_block
            self.d_seg = cute.make_rmem_tensor(1, Int32)  # this CTA's segment count
            self.d_seg.fill(0)
            slot = Int32(0)
        elif const_expr(event == "end"):
            slot = Int32(TRACE_END)
        elif const_expr(event == "pair"):
            k = cutlass.min(self.d_seg[0], TRACE_PAIR_SEGS - 1)
            slot = TRACE_PAIR0 + TRACE_PAIRS * k + cutlass.min(i, TRACE_PAIRS - 1)
        else:
            slot = 1 + TRACE_PER_SEG * cutlass.min(self.d_seg[0], TRACE_SEGS - 1) + event
        tidx, _, _ = cute.arch.thread_idx()
        table, cta = self.d_trace, self.d_cta  # (locals: the runtime `if` may not carry self)
        if tidx == who:
            table[cta, slot] = globaltimer()
        if const_expr(event == TRACE_PER_SEG - 1):  # the segment's last point
            self.d_seg[0] = self.d_seg[0] + 1


def traced_kernel(causal: bool, dtype=cutlass.BFloat16):
    """The compiled trace build (sm_90a): the decode kernel's arguments, stream, stamp table."""
    from torch_mla.contract import compile_decode_kernel, fake_tensor

    stamps = fake_tensor(cutlass.Int64, (cute.sym_int(), TRACE_SLOTS), (TRACE_SLOTS, 1), 8)
    return compile_decode_kernel(TracedDecodeSm90(dtype, causal), dtype, "sm_90a", [stamps])


def summarize(stamps: torch.Tensor, segs: list[list[tuple[int, int]]], per_seg: int,
              max_segs: int) -> dict:
    """stamps: (ctas, slots) int64 ns (slot 0 start, 63 end); segs[cta]: (blocks, split?) per
    segment, in order; per_seg and max_segs: the kernel's TRACE_PER_SEG (the 10 slots unpacked
    below) and TRACE_SEGS.
    Means over segments, in us: start -> Q landed, -> first S, loop time per block, epilogue
    phases (sync of both warpgroups, staging, bulk-copy read wait, rest, WG1's end after WG0's),
    and the gap from the epilogue's end to the next segment's start."""
    t0 = stamps[:, 0].min().item()
    st = (stamps - t0).double() / 1e3  # us from the first CTA's start
    ends = st[:, 63]
    keys = ("q_latency", "first_s", "per_block", "epi_sync", "epi_stage", "epi_bulk", "epi_rest",
            "wg1_after", "epilogue", "gap_next")
    acc = {k: [] for k in keys}
    for c, ss in enumerate(segs):
        for k, (n, _split) in enumerate(ss[:max_segs]):
            v = st[c, 1 + per_seg * k: 1 + per_seg * (k + 1)].tolist()
            start, q, s0, l0, l1, e, e_sync, e_stage, e_bulk, e1 = v
            loop_end = max(l0, l1)
            acc["q_latency"].append(q - start)
            acc["first_s"].append(s0 - q)
            if n > 1:
                acc["per_block"].append((l0 - s0) / (n - 1))
            acc["epi_sync"].append(e_sync - loop_end)
            acc["epi_stage"].append(e_stage - e_sync)
            acc["epi_bulk"].append(e_bulk - e_stage)
            acc["epi_rest"].append(e - e_bulk)
            acc["wg1_after"].append(e1 - e)
            acc["epilogue"].append(max(e, e1) - loop_end)
            if k + 1 < min(len(ss), max_segs):
                acc["gap_next"].append(st[c, 1 + per_seg * (k + 1)].item() - max(e, e1))

    def avg(x):
        return sum(x) / max(1, len(x))

    return dict(span=ends.max().item(), start_skew=st[:, 0].max().item(),
                end_min=ends.min().item(), end_med=ends.median().item(), end_max=ends.max().item(),
                **{k: avg(v) for k, v in acc.items()},
                segs_per_cta=avg([len(s) for s in segs]))


def pair_times(stamps: torch.Tensor, segs: list[list[tuple[int, int]]], pair0: int, pairs: int,
               pair_segs: int, bucket_us: float = 10.0) -> dict:
    """Steady-state pair durations by when they start. stamps and segs as in summarize; pair0,
    pairs, pair_segs: the kernel's TRACE_PAIR0, TRACE_PAIRS, TRACE_PAIR_SEGS (WG0 stamps the
    start of pair i of segment k at pair0 + pairs * k + i). A pair's duration is the time to the
    next pair's start; a segment's last two pairs are left out (the tail and the epilogue's
    neighbourhood). Returns {bucket start in us from the first CTA's start: (median, count)}."""
    t0 = stamps[:, 0].min().item()
    st = (stamps - t0).double() / 1e3
    buckets: dict[float, list[float]] = {}
    for c, ss in enumerate(segs):
        # (the last slot set is reused by later segments: left out where it mixes them)
        for k, (n, _split) in enumerate(ss[:pair_segs - (len(ss) > pair_segs)]):
            npairs = min((n + 1) // 2, pairs)
            for i in range(npairs - 2):
                t = st[c, pair0 + pairs * k + i].item()
                dur = st[c, pair0 + pairs * k + i + 1].item() - t
                buckets.setdefault(t // bucket_us * bucket_us, []).append(dur)
    return {b: (sorted(v)[len(v) // 2], len(v)) for b, v in sorted(buckets.items())}


def trace_config(cfg: str, out_dir: str) -> None:
    from torch_mla.devtools import breakdown_us, kernel_args
    from torch_mla.testing import graph_time_us

    b, s_q, s_k, h_q = (int(x) for x in cfg.split(","))
    causal = s_q > 1
    inp = make_anchor_inputs(b, s_q, h_q, s_k)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    rows = s_q * h_q
    parts = sched.metadata.shape[0]
    m_blocks = -(-rows // 64)
    stamps = torch.zeros(parts * m_blocks, TRACE_SLOTS, dtype=torch.int64, device="cuda")
    traced = traced_kernel(causal)
    args = kernel_args(inp, sched)
    for _ in range(3):
        traced(*args, stamps)
    torch.cuda.synchronize()
    segs = [[] for _ in range(parts * m_blocks)]
    for p, _r, lo, hi, slot in walk_schedule(sched.metadata, sched.num_splits,
                                             inp.cache_seqlens):
        for m in range(m_blocks):
            segs[p * m_blocks + m].append((hi - lo, slot >= 0))
    summ = summarize(stamps.cpu(), segs, TRACE_PER_SEG, TRACE_SEGS)
    pairs = pair_times(stamps.cpu(), segs, TRACE_PAIR0, TRACE_PAIRS, TRACE_PAIR_SEGS)
    t_dec, t_comb = breakdown_us(inp, sched, causal)
    t_all = graph_time_us(lambda: torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table,
                                                  inp.cache_seqlens, sched, causal=causal))
    torch.save(dict(stamps=stamps.cpu(), meta=sched.metadata.cpu(),
                    num_splits=sched.num_splits.cpu(), seqlens=inp.cache_seqlens.cpu(),
                    cfg=(b, s_q, s_k, h_q), t_dec=t_dec, t_comb=t_comb, t_all=t_all),
               os.path.join(out_dir, f"trace_{b}_{s_q}_{s_k}_{h_q}.pt"))
    print(f"{cfg}: op {t_all:.1f} us = decode {t_dec:.1f} + combine {t_comb:.1f} (alone); "
          f"pieces {int(sched.num_splits[-1])}, parts {parts}")
    print("   traced run: " + ", ".join(f"{k} {v:.2f}" for k, v in summ.items()))
    print("   pair of blocks (us) by start time: " + "  ".join(
        f"{b:.0f}+: {med:.2f} (n {cnt})" for b, (med, cnt) in pairs.items()))
    sys.stdout.flush()


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
    torch_mla.set_value_checks(False)
    for cfg in sys.argv[2:] or DEFAULT:
        trace_config(cfg, out_dir)


if __name__ == "__main__":
    main()
