"""Per-CTA timeline of the SM90 decode kernel (development tool, needs an H100/H200).

    python -m tools.trace_decode [--fp8] [OUT_DIR] [B,S_Q,S_K,H_Q ...]

Builds TracedDecodeSm90 (the shipped MLADecodeSm90 with its trace points recording
%globaltimer, see MLADecodeSm90._stamp), runs it on the anchor workload of each configuration,
prints where the time goes (segment start-up, per-block loop time, epilogue, tail imbalance, the
duration of a pair of blocks by when it starts, and inside a pair each warpgroup's waits and
its next S: pair_events) and saves the raw stamps with the schedule to
OUT_DIR/trace_B_SQ_SK_HQ[_fp8].pt for offline analysis. Also times the decode kernel alone, the
combine kernel alone (16-bit cache) and the whole op in CUDA graphs. --fp8: the cache quantized
to float8_e4m3fn (amax / 448), the kernel in exact mode (each page expanded in place to 16 bits
by the warpgroup whose Q K^T reads it).
"""

from __future__ import annotations

import dataclasses
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
# Events inside the pairs of a CTA's first segment (MLADecodeSm90._stamp's "pair", "pair1" and
# "ev" points): warpgroup w's event k of pair i < EV_PAIRS at EV0 + (EV_PAIRS w + i) EV_KINDS + k
# (k 0: the pair's start).
TRACE_SLOTS, TRACE_PER_SEG, TRACE_SEGS, TRACE_END = 384, 10, 6, 63
TRACE_PAIR0, TRACE_PAIRS, TRACE_PAIR_SEGS = 64, 32, 2
EV0, EV_PAIRS, EV_KINDS = 128, 16, 8


class TracedDecodeSm90(MLADecodeSm90):
    """MLADecodeSm90 (16-bit cache, or exact mode over an e4m3 one) whose trace points write
    %globaltimer into a stamp table, one more argument after the stream: int64 (ctas,
    TRACE_SLOTS), CTA m + num_m_blocks * part; then, with kv_fp8, the cache's arguments
    (kv_scale, q_scale, q_scaled). The stamps are global stores of the thread named at each
    point, so the timings are of a slightly different kernel."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mBlockTable: cute.Tensor,
                 mSeqlens: cute.Tensor, mMeta: cute.Tensor, mNumSplits: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mOacc: cute.Tensor, mLSEacc: cute.Tensor,
                 scale_log2: Float32, stream, mTrace: cute.Tensor, mKVScale: cute.Tensor = None,
                 mQScale: cute.Tensor = None, q_scaled=None):
        self.trace_table = mTrace
        MLADecodeSm90.__call__(self, mQ, mKV, mBlockTable, mSeqlens, mMeta, mNumSplits, mO,
                               mLSE, mOacc, mLSEacc, scale_log2, stream, mKVScale, mQScale,
                               q_scaled)

    @cute.jit
    def _stamp(self, event, who: int = 0, i=None) -> None:
        if const_expr(event in ("pair", "pair1", "ev")):
            self._pair_event(event, who, i)
        if const_expr(event not in ("pair1", "ev")):
            self._point(event, who, i)

    @cute.jit
    def _pair_event(self, event, who: int, i) -> None:
        """A pair event of the CTA's first segment, by thread `who`: "pair" / "pair1" (the
        pair's start, event 0; the thread keeps the pair index i) or "ev" (event i of the
        pair the thread last started), at EV0 + (EV_PAIRS w + pair) EV_KINDS + event for
        warpgroup w = who // 128, pairs below EV_PAIRS only."""
        tidx, _, _ = cute.arch.thread_idx()
        pair, seg, table, cta = self.d_pair, self.d_seg, self.d_trace, self.d_cta
        k = i if event == "ev" else 0
        if tidx == who:
            if const_expr(event != "ev"):
                pair[0] = i
            p = pair[0]
            if seg[0] == 0 and p >= 0 and p < EV_PAIRS:
                table[cta, EV0 + (EV_PAIRS * (who // 128) + p) * EV_KINDS + k] = globaltimer()

    @cute.jit
    def _point(self, event, who: int, i) -> None:
        """The segment and kernel points (the slot layout above)."""
        if const_expr(event == "start"):
            m_block, part, _ = cute.arch.block_idx()
            self.d_cta = part * cute.arch.grid_dim()[0] + m_block
            self.d_seg = cute.make_rmem_tensor(1, Int32)  # this CTA's segment count
            self.d_seg.fill(0)
            self.d_pair = cute.make_rmem_tensor(1, Int32)  # the recording thread's pair
            self.d_pair.fill(-1)
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


def traced_kernel(causal: bool, dtype=cutlass.BFloat16, kv_fp8: bool = False):
    """The compiled trace build (sm_90a): the decode kernel's arguments, stream, stamp table,
    and with kv_fp8 (exact mode over the cache's e4m3 bytes) kv_scale, q_scale, q_scaled."""
    from torch_mla.contract import (
        DECODE_DIMS,
        DECODE_KERNEL_ARGS,
        FP8_ARGS,
        compile_kernel,
        fake_args,
        fake_tensor,
    )

    stamps = fake_tensor(cutlass.Int64, (cute.sym_int(), TRACE_SLOTS), (TRACE_SLOTS, 1), 8)
    args = fake_args(DECODE_KERNEL_ARGS, dtype, dims=DECODE_DIMS, kv_bytes=kv_fp8) + [stamps]
    if kv_fp8:
        args += fake_args(FP8_ARGS, dtype)
    return compile_kernel(TracedDecodeSm90(dtype, causal, kv_fp8=kv_fp8), args, "sm_90a")


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


# What each pair event marks, by warpgroup (MLADecodeSm90._stamp): its times are reported from
# the pair's start (event 0), and the spans below.
EVENTS = {0: ("SCALE1 passed", "next S issued", "half 0 landed", "half 0 expanded",
              "half 1 landed", "half 1 expanded", "next S done"),
          1: ("SCALE0 passed", "P0 passed", "half 0 landed", "half 0 expanded", "half 1 landed",
              "half 1 expanded", "next S done")}
SPANS = (("start to the other's scale", 0, 1), ("expand half 0", 3, 4),
         ("expand half 1", 5, 6))


def pair_events(stamps: torch.Tensor, first: int = 1, last: int = EV_PAIRS - 2) -> dict:
    """Medians over CTAs and pairs first..last of the first segment (pairs whose start and
    event were both stamped, the event after the start), in us: {warpgroup: {"t<k>": event k
    after the pair's start (k 1-7), span name: its duration (SPANS), "pair": the time to the
    next pair's start}}. stamps: (ctas, TRACE_SLOTS) int64 ns."""
    ev = stamps[:, EV0:EV0 + 2 * EV_PAIRS * EV_KINDS].reshape(-1, 2, EV_PAIRS, EV_KINDS)
    ev = ev.double() / 1e3

    def median(x):
        x = sorted(x)
        return x[len(x) // 2] if x else float("nan")

    out = {}
    for w in (0, 1):
        e = ev[:, w, first:last + 1]
        res = {}
        for k in range(1, EV_KINDS):
            ok = (e[..., 0] > 0) & (e[..., k] >= e[..., 0])
            res[f"t{k}"] = median((e[..., k] - e[..., 0])[ok].tolist())
        for name, a, b in SPANS:
            ok = (e[..., a] > 0) & (e[..., b] >= e[..., a]) & (e[..., 0] > 0)
            res[name] = median((e[..., b] - e[..., a])[ok].tolist())
        nxt = ev[:, w, first + 1:last + 2, 0]
        ok = (e[..., 0] > 0) & (nxt > e[..., 0])
        res["pair"] = median((nxt - e[..., 0])[ok].tolist())
        out[w] = res
    return out


def trace_config(cfg: str, out_dir: str, fp8: bool = False) -> None:
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
    traced = traced_kernel(causal, kv_fp8=fp8)
    extra, kw = (None, None, None), {}
    if fp8:
        from torch_mla.testing import quantize_per_tensor

        cache, kv_scale = quantize_per_tensor(inp.kv_cache)
        inp = dataclasses.replace(inp, kv_cache=cache)
        extra, kw = (kv_scale, kv_scale, 0), {"kv_scale": kv_scale}
    args = kernel_args(inp, sched)
    if fp8:  # (the kernel takes the cache's bytes)
        args = (args[0], args[1].view(torch.uint8), *args[2:])
    for _ in range(3):
        traced(*args, stamps, *extra)
    stamps.zero_()  # (the stamps of one run only: nothing kept from the warm-up runs)
    traced(*args, stamps, *extra)
    torch.cuda.synchronize()
    segs = [[] for _ in range(parts * m_blocks)]
    for p, _r, lo, hi, slot in walk_schedule(sched.metadata, sched.num_splits,
                                             inp.cache_seqlens):
        for m in range(m_blocks):
            segs[p * m_blocks + m].append((hi - lo, slot >= 0))
    summ = summarize(stamps.cpu(), segs, TRACE_PER_SEG, TRACE_SEGS)
    pairs = pair_times(stamps.cpu(), segs, TRACE_PAIR0, TRACE_PAIRS, TRACE_PAIR_SEGS)
    events = pair_events(stamps.cpu())
    # (the decode kernel alone is built for 16-bit caches: registry.DecodeConfig)
    t_dec, t_comb = breakdown_us(inp, sched, causal) if not fp8 else (float("nan"),) * 2
    t_all = graph_time_us(lambda: torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table,
                                                  inp.cache_seqlens, sched, causal=causal, **kw))
    name = f"trace_{b}_{s_q}_{s_k}_{h_q}" + ("_fp8" if fp8 else "")
    torch.save(dict(stamps=stamps.cpu(), meta=sched.metadata.cpu(),
                    num_splits=sched.num_splits.cpu(), seqlens=inp.cache_seqlens.cpu(),
                    cfg=(b, s_q, s_k, h_q), fp8=fp8, t_dec=t_dec, t_comb=t_comb, t_all=t_all),
               os.path.join(out_dir, name + ".pt"))
    print(f"{cfg}{' fp8 exact' if fp8 else ''}: op {t_all:.1f} us = decode {t_dec:.1f} + "
          f"combine {t_comb:.1f} (alone); pieces {int(sched.num_splits[-1])}, parts {parts}")
    print("   traced run: " + ", ".join(f"{k} {v:.2f}" for k, v in summ.items()))
    print("   pair of blocks (us) by start time: " + "  ".join(
        f"{b:.0f}+: {med:.2f} (n {cnt})" for b, (med, cnt) in pairs.items()))
    for w, res in events.items():
        times = ", ".join(f"{EVENTS[w][k - 1]} {res[f't{k}']:.2f}" for k in range(1, EV_KINDS))
        spans = ", ".join(f"{name} {res[name]:.2f}" for name, _, _ in SPANS)
        print(f"   WG{w} in a pair (us from its start, medians): {times}; {spans}; "
              f"pair {res['pair']:.2f}")
    sys.stdout.flush()


def main():
    args = [a for a in sys.argv[1:] if a != "--fp8"]
    fp8 = "--fp8" in sys.argv[1:]
    out_dir = args[0] if args else os.environ.get("OUT", "/tmp")
    torch_mla.set_value_checks(False)
    for cfg in args[1:] or DEFAULT:
        trace_config(cfg, out_dir, fp8)


if __name__ == "__main__":
    main()
