"""Per-CTA timeline of the SM90 sparse decode split kernel (development tool, needs an H100/H200).

    python -m tools.trace_sparse [OUT_DIR] [B,S_Q,H_Q ...]
    python -m tools.trace_sparse --compile-only

Builds TracedSplit (the shipped MLASparseDecodeSm90Split, sm90_split_sparse_decode.py, with its
trace points recording %globaltimer, MLADecodeSm90._stamp's and the split's own, and inside four
blocks a CTA the DETAIL points' %clock64) inside the
sparse decode step, as the dispatch builds it over the 656-byte rows (the cluster pair at h_q
65-128: ops.sparse.split_pair_rows), runs it on tools/sparse_rows.py's problem (topk 2048 random
distinct slots of s_k 32768 tokens a request, bench_decode's _sparse_problem and _sparse_cache)
with the schedule of torch_mla.get_sparse_decode_schedule, prints where the time goes and saves
the raw stamps with the schedule to OUT_DIR/trace_sparse_B_SQ_HQ.pt. NONE=1 (environment): every
entry -1, so nothing is read (the block chain without memory latency). Also times the op itself
(mla_decode_sparse, CUDA graph) and the traced step the same way. The split's developer knobs
(TORCH_MLA_DEV_SPLIT_*, read at import) apply to the trace build as to the op's kernel (the
kernel cache's key holds the knobs that are set).

--compile-only (no GPU; CUTE_DSL_ARCH=sm_90a unless set, and unless CUTE_DSL_KEEP is set the
PTX kept in a fresh temporary CUTE_DSL_DUMP_DIR): builds the traced step with and without the
pair and counts the %globaltimer and %clock64 reads in its PTX (both required).

DETAIL's labels assume no lookahead: with the pair's (LOOKAHEAD_PAIR 2) the producer's
d_wait points no longer follow that half's own loads (its d_filled points, the arrivals,
still mark when a half is filled).
"""

from __future__ import annotations

import os
import sys

if "--compile-only" in sys.argv[1:]:  # (before cutlass is imported: the DSL reads these then)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    if not os.environ.get("CUTE_DSL_KEEP"):  # (the PTX kept, in a fresh folder, not the cwd)
        import tempfile

        os.environ.update(CUTE_DSL_KEEP="ptx",
                          CUTE_DSL_DUMP_DIR=tempfile.mkdtemp(prefix="trace_sparse_"))

import functools  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from cutlass import Int32, const_expr  # noqa: E402

from tools.trace_decode import pair_times  # noqa: E402
from torch_mla.cute_kernels.ptx import clock64, globaltimer  # noqa: E402
from torch_mla.cute_kernels.sm80_sparse_decode import MLASparseDecodeStep  # noqa: E402
from torch_mla.cute_kernels.sm90_split_sparse_decode import MLASparseDecodeSm90Split  # noqa: E402

DEFAULT = ["2,1,128", "2,1,64", "128,1,128", "128,1,64"]
TOPK, S_K = 2048, 32768

# The stamp table, (ctas, TRACE_SLOTS) int64 per CTA, ns (%globaltimer) but DETAIL's SM cycles
# (m-block m of part p: CTA m + m_blocks p; 0: never stamped): slot 0 the kernel's start,
# TRACE_END its end (WG0's thread 0); per segment k (the last slot set reused past TRACE_SEGS
# segments) the points of POINTS at 1 + TRACE_PER_SEG k + their index; WG0's start of block i
# of segment k (k < TRACE_BLOCK_SEGS, i < TRACE_BLOCKS, the last reused) at TRACE_BLOCK0 +
# TRACE_BLOCKS k + i; TRACE_JUNK takes the stamps not kept (tile waits after a segment's first
# block, producer blocks after its second). Segments are counted apart by the consumers (at
# point 9) and the producer (at its loop's end), so a segment's producer points are the
# producer's own segment k.
TRACE_SLOTS, TRACE_PER_SEG, TRACE_SEGS, TRACE_JUNK, TRACE_END = 288, 14, 4, 62, 63
TRACE_BLOCK0, TRACE_BLOCKS, TRACE_BLOCK_SEGS = 64, 64, 2
# Inside blocks DETAIL_FIRST .. + DETAIL_BLOCKS - 1 of a CTA's first segment, every point of
# DETAIL as %clock64 (SM cycles: the three warpgroups share the SM's clock) at DETAIL0 +
# len(DETAIL) (block - DETAIL_FIRST) + the point's index. DETAIL_FIRST (environment, default 8,
# steady state): e.g. 0 for the segment's ramp (the trace build compiles in each run, so no
# cache holds another value's build).
DETAIL0, DETAIL_BLOCKS = 192, 4
DETAIL_FIRST = int(os.environ.get("DETAIL_FIRST", "8"))
DETAIL = (
    "d_start",  # WG0 starts the block
    "d_tiles0",  # WG0's wait for half 0's tiles done
    "d_tiles1",  # ... half 1's
    "d_s",  # WG0: S landed (its wgmma wait)
    "d_softmax",  # WG0: P in registers (mask, softmax, O's left half rescaled)
    "d_nbfree",  # WG0: NB_FREE passed (WG1 done with the previous block's P)
    "d_pv",  # WG0: P and its scale stored, its P V issued, NB_P arrived
    "d_done",  # WG0: its P V landed, half 0 released
    "d_w1_p",  # WG1: NB_P passed
    "d_w1_pv",  # WG1: O's right half rescaled, its P V issued
    "d_w1_landed",  # WG1: its P V landed
    "d_w1_done",  # WG1: NB_FREE arrived, half 1 released
    "d_pstart",  # the producer starts the block (its loop step)
    "d_wait0",  # ... half 0's loads issued, its wait for the free half begins
    "d_free0",  # the producer: half 0 of the block's buffer free (its wait done)
    "d_filled0",  # ... half 0 converted, stored and arrived on
    "d_wait1",  # ... half 1's loads issued, its wait begins
    "d_free1",  # ... half 1 free
    "d_filled1",  # ... half 1 filled (thread 256, the producer's warp 0)
    "d_filled1_w1",  # ... half 1 filled, the producer's warp 1 (thread 288)
    "d_filled1_w2",  # ... warp 2 (thread 320)
    "d_filled1_w3",  # ... warp 3 (thread 352)
)
# The thread that records each point: WG0's 0, WG1's 128, the producer's 256 (its warp 0) and,
# for the other warps' half 1 arrivals, 288, 320, 352.
DETAIL_WHO = {p: 128 if p.startswith("d_w1") else 0 if DETAIL.index(p) < 8 else 256
              for p in DETAIL}
DETAIL_WHO.update({f"d_filled1_w{w}": 256 + 32 * w for w in range(1, 4)})
# A segment's points, by index; 0-9 are MLADecodeSm90._stamp's events (2, WG0's first S in the
# dense kernel, is not one of the split's: the split's first tile wait takes its place):
POINTS = (
    "seg",  # 0 segment start (WG0: past the consumers' barrier, blocks 0, 1 released)
    "q",  # 1 Q landed (WG0's wait on barQ done)
    "tiles0",  # 2 WG0's wait for half 0 (tiles 0-3) of the segment's first block done
    "wg0_loop",  # 3 WG0's block loop done (_split_blocks)
    "wg1_loop",  # 4 WG1's block loop done (thread 128)
    "epi",  # 5 WG0's epilogue done
    "epi_sync",  # 6 epilogue: both warpgroups' row sums in shared memory
    "epi_stage",  # 7 WG0's half of O staged in shared memory
    "epi_bulk",  # 8 WG0's bulk copies have read it
    "wg1_epi",  # 9 WG1's epilogue done (thread 128; the segment's last consumer point)
    "tiles1",  # 10 WG0's wait for half 1 (tiles 4-8) of the first block done: block 0 arrived
    "filled0",  # 11 the producer's thread 256 has filled (arrived on) the first block
    "filled1",  # 12 ... its second block
    "produced",  # 13 the producer's loop over the segment's blocks done
)
SPLIT_POINTS = {"tiles": (2, 10), "filled": (11, 12), "produced": 13}
# The order the summary prints a segment's points in (roughly their order in time).
ORDER = ("seg", "q", "filled0", "tiles0", "tiles1", "filled1", "wg0_loop", "wg1_loop",
         "produced", "epi_sync", "epi_stage", "epi_bulk", "epi", "wg1_epi")


class TracedSplit(MLASparseDecodeSm90Split):
    """MLASparseDecodeSm90Split whose trace points write %globaltimer into a stamp table (the
    step's last argument, TracedStep). The stamps are global stores of the thread named at each
    point (WG0 thread 0, WG1 128, the producer 256: sm90_decode.MLADecodeSm90.body gives
    warpgroup tidx // 128 its role), so the timings are of a slightly different kernel."""

    @cute.jit
    def _detail(self, point: str, i) -> None:
        """%clock64 at DETAIL point `point` of block i (of the CTA's current segment) by the
        point's thread, when the block is one of the detailed ones."""
        k = i - DETAIL_FIRST
        keep = (k >= 0) & (k < DETAIL_BLOCKS) & (self.d_seg[0] == 0)
        tidx, _, _ = cute.arch.thread_idx()
        table, cta = self.d_trace, self.d_cta
        if keep & (tidx == DETAIL_WHO[point]):  # (nothing read or stored elsewhere)
            table[cta, DETAIL0 + len(DETAIL) * k + DETAIL.index(point)] = clock64()

    @cute.jit
    def _stamp(self, event, who: int = 0, i=None) -> None:
        if const_expr(isinstance(event, str) and event.startswith("d_")):
            if const_expr(DETAIL_WHO[event] == 256):
                self._detail(event, self.d_blk[1])  # (the producer's block: "pblock")
                if const_expr(event == "d_filled1"):  # (the other producer warps' arrivals)
                    for w in cutlass.range_constexpr(1, 4):
                        self._detail(f"d_filled1_w{w}", self.d_blk[1])
            else:
                self._detail(event, i)
        elif const_expr(event == "pblock"):
            self.d_blk[1] = i
            self._detail("d_pstart", i)
        elif const_expr(event not in ("pair1", "ev")):  # (the dense pairs' events: none here)
            self._stamp_table(event, who, i)

    @cute.jit
    def _stamp_table(self, event, who: int, i) -> None:
        """The points of the stamp table but DETAIL's (%globaltimer)."""
        if const_expr(event == "start"):
            m_block, part, _ = cute.arch.block_idx()
            self.d_cta = part * cute.arch.grid_dim()[0] + m_block
            # (this warpgroup's copy: its segments done, WG0's tile waits in this segment)
            self.d_seg = cute.make_rmem_tensor(2, Int32)
            self.d_seg.fill(0)
            # (WG0's block and its tile waits in it; the producer's block)
            self.d_blk = cute.make_rmem_tensor(3, Int32)
            self.d_blk.fill(0)
            slot = Int32(0)
        elif const_expr(event == "end"):
            slot = Int32(TRACE_END)
        elif const_expr(event == "block"):
            self.d_blk[0] = i
            self.d_blk[2] = 0
            self._detail("d_start", i)
            k = cutlass.min(self.d_seg[0], TRACE_BLOCK_SEGS - 1)
            slot = TRACE_BLOCK0 + TRACE_BLOCKS * k + cutlass.min(i, TRACE_BLOCKS - 1)
        else:
            seg = 1 + TRACE_PER_SEG * cutlass.min(self.d_seg[0], TRACE_SEGS - 1)
            if const_expr(event == "tiles"):  # (wait n of the segment: n = 0, 1 kept)
                n = self.d_seg[1]
                w = self.d_blk[2]  # (wait w of WG0's block: its detail points)
                self._detail("d_tiles0", cutlass.select_(w == 0, self.d_blk[0], Int32(-1)))
                self._detail("d_tiles1", cutlass.select_(w == 1, self.d_blk[0], Int32(-1)))
                self.d_blk[2] = w + 1
                first, second = SPLIT_POINTS["tiles"]
                slot = cutlass.select_(n < 2, seg + first + (second - first) * n,
                                       Int32(TRACE_JUNK))
            elif const_expr(event == "filled"):  # (block i of the segment: i = 0, 1 kept)
                slot = cutlass.select_(i < 2, seg + SPLIT_POINTS["filled"][0] + i,
                                       Int32(TRACE_JUNK))
            elif const_expr(event == "produced"):
                slot = seg + SPLIT_POINTS["produced"]
            else:
                slot = seg + event
        tidx, _, _ = cute.arch.thread_idx()
        table, cta = self.d_trace, self.d_cta  # (locals: the runtime `if` may not carry self)
        if tidx == who:
            table[cta, slot] = globaltimer()
        if const_expr(event == 0):
            self.d_seg[1] = 0
        if const_expr(event == "tiles"):
            self.d_seg[1] = self.d_seg[1] + 1
        if const_expr(event == 9 or event == "produced"):  # (a segment's last point)
            self.d_seg[0] = self.d_seg[0] + 1


class TracedStep(MLASparseDecodeStep):
    """The sparse decode step (decode, then combine) with one more argument after the stream:
    the decode kernel's stamp table, int64 (ctas, TRACE_SLOTS)."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mKV: cute.Tensor, mIdx: cute.Tensor,
                 mLens: cute.Tensor, mMeta: cute.Tensor, mNumSplits: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mOacc: cute.Tensor, mLSEacc: cute.Tensor,
                 scale_log2: cutlass.Float32, combine_variant: Int32, stream,
                 mTrace: cute.Tensor):
        self.decode.trace_table = mTrace
        MLASparseDecodeStep.__call__(self, mQ, mKV, mIdx, mLens, mMeta, mNumSplits, mO, mLSE,
                                     mOacc, mLSEacc, scale_log2, combine_variant, stream)


@functools.lru_cache(maxsize=None)
def traced_step(pair: bool):
    """The compiled trace build (sm_90a, bf16 q over the 656-byte rows; pair: the cluster pair,
    SparseStepConfig columns 128): the sparse step's arguments (contract.sparse_step_args),
    then the stamp table."""
    from torch_mla import contract

    dtype = cutlass.BFloat16
    step = TracedStep(TracedSplit(dtype, "fp8_ds_mla", pair=pair), dtype, use_pdl=True)
    stamps = contract.fake_tensor(cutlass.Int64, (cute.sym_int(), TRACE_SLOTS), (TRACE_SLOTS, 1),
                                  8)
    args = contract.fake_args(contract.sparse_step_args("fp8_ds_mla"), dtype,
                              dims=contract.SPARSE_DIMS, kv_bytes=True)
    return contract.compile_kernel(step, args + [stamps], "sm_90a")


def segment_slot(k: int, point: str) -> int:
    """The slot of `point` (POINTS) of segment k (k < TRACE_SEGS)."""
    return 1 + TRACE_PER_SEG * k + POINTS.index(point)


def _median(xs) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    return xs[len(xs) // 2] if xs else math.nan


def summarize(stamps: torch.Tensor, segs: list[list[tuple[int, bool]]]) -> dict:
    """stamps: (ctas, TRACE_SLOTS) int64 ns (0: not stamped); segs[cta]: (blocks, split?) per
    segment, in order. In us from the first CTA's start:
      - "first": per point of a CTA's first segment (and the kernel's start "start", end "end",
        WG0's start of block 1 "block1"), the median over the CTAs that have it;
      - "slowest": the same points of the CTA that ends last;
      - "phases": medians over segments (k < TRACE_SEGS), a CTA's first segments apart from its
        later ones ("phases_later": a first segment starts with the kernel, a later one after
        the previous epilogue), of q_wait (Q landed after the segment's
        start), tiles (block 0 arrived after it), filled0 (the producer's first block after
        it), wg0_loop (WG0's loop after block 0 arrived), wg1_after (WG1's loop end after
        WG0's), p_ahead (WG0's loop end after the producer's), epilogue (both loops' end to
        both epilogues' end), gap_next (to the next segment's start);
      - "block": WG0's time a block in steady state (a block's start to the next's, a
        segment's first and last two blocks left out: median, count), and "block_by_time" the
        same by when the block starts (trace_decode.pair_times over single blocks);
      - span, end_min / end_med / end_max, start_skew (the last CTA's start)."""
    # (the difference in int64 first: %globaltimer's ~1.8e18 ns in a double are 256 ns apart)
    st = (stamps - stamps[:, 0][stamps[:, 0] > 0].min()).double() / 1e3
    st[stamps == 0] = math.nan

    def at(c: int, k: int, p: str) -> float:
        return st[c, segment_slot(k, p)].item()

    def points(c: int) -> dict:
        out = {"start": st[c, 0].item()}
        if segs[c]:
            out.update({p: at(c, 0, p) for p in ORDER})
            out["block1"] = st[c, TRACE_BLOCK0 + 1].item() if segs[c][0][0] > 1 else math.nan
        out["end"] = st[c, TRACE_END].item()
        return out

    per_cta = [points(c) for c in range(len(segs))]
    names = ["start", *ORDER[:2], "filled0", "tiles0", "tiles1", "block1", *ORDER[5:], "end"]
    first = {p: _median([d.get(p, math.nan) for d in per_cta]) for p in names}
    ends = st[:, TRACE_END]
    last = int(torch.nan_to_num(ends, nan=-1.0).argmax())
    slowest = {p: per_cta[last].get(p, math.nan) for p in names}

    names_phase = ("q_wait", "tiles", "filled0", "wg0_loop", "wg1_after", "p_ahead",
                   "epilogue", "gap_next")
    by_first = [{k: [] for k in names_phase} for _ in range(2)]  # (later segments, first)
    steady = []
    for c, ss in enumerate(segs):
        for k in range(min(len(ss), TRACE_SEGS)):
            phases = by_first[k == 0]
            v = {p: at(c, k, p) for p in POINTS}
            loop_end, epi_end = max(v["wg0_loop"], v["wg1_loop"]), max(v["epi"], v["wg1_epi"])
            phases["q_wait"].append(v["q"] - v["seg"])
            phases["tiles"].append(v["tiles1"] - v["seg"])
            phases["filled0"].append(v["filled0"] - v["seg"])
            phases["wg0_loop"].append(v["wg0_loop"] - v["tiles1"])
            phases["wg1_after"].append(v["wg1_loop"] - v["wg0_loop"])
            phases["p_ahead"].append(v["wg0_loop"] - v["produced"])
            phases["epilogue"].append(epi_end - loop_end)
            if k + 1 < min(len(ss), TRACE_SEGS):
                phases["gap_next"].append(at(c, k + 1, "seg") - epi_end)
    # (a CTA's last block slot set is reused by its later segments: with more segments than
    # sets, that set mixes segments and is left out)
    block_segs = [ss[:TRACE_BLOCK_SEGS - (len(ss) > TRACE_BLOCK_SEGS)] for ss in segs]
    for c, ss in enumerate(block_segs):
        for k, (n, _split) in enumerate(ss):
            row = st[c, TRACE_BLOCK0 + TRACE_BLOCKS * k:][:min(n, TRACE_BLOCKS)].tolist()
            steady += [b - a for a, b in zip(row[2:-2], row[3:-1])]
    # (pair_times takes pairs of blocks: a segment of n blocks passed as 2 n - 1 blocks has n
    # "pairs", each one block here)
    by_time = pair_times(stamps, [[(2 * n - 1, x) for n, x in ss] for ss in block_segs],
                         TRACE_BLOCK0, TRACE_BLOCKS, TRACE_BLOCK_SEGS)
    return dict(span=torch.nan_to_num(ends, nan=0.0).max().item(),
                start_skew=torch.nan_to_num(st[:, 0], nan=0.0).max().item(),
                end_min=ends.nan_to_num(nan=math.inf).min().item(),
                end_med=_median(ends.tolist()), end_max=ends.nan_to_num(nan=0.0).max().item(),
                first=first, slowest=slowest, slowest_cta=last,
                phases={k: _median(v) for k, v in by_first[1].items()},
                phases_later={k: _median(v) for k, v in by_first[0].items()},
                block=(_median(steady), len(steady)), block_by_time=by_time)


def detail_summary(stamps: torch.Tensor) -> dict:
    """The DETAIL points of blocks DETAIL_FIRST .. + DETAIL_BLOCKS - 1 (a CTA's first
    segment): per point, the median over (CTA, block) of its offset from the block's d_start
    in ns ("offset"); the median block (d_start to the next block's, "block_ns"); the SM clock
    in GHz from WG0's block starts (%clock64 against the %globaltimer block stamps); n, the
    blocks counted. Blocks with a point unstamped are left out."""
    d = stamps[:, DETAIL0:DETAIL0 + len(DETAIL) * DETAIL_BLOCKS].double()
    d = d.view(-1, DETAIL_BLOCKS, len(DETAIL))
    full = (d > 0).all(dim=2)  # (CTA, block) with every point stamped
    g = stamps[:, TRACE_BLOCK0 + DETAIL_FIRST:][:, :DETAIL_BLOCKS].double()
    ghz = []
    for c in range(d.shape[0]):
        if full[c, 0] and full[c, -1] and g[c, 0] > 0 and g[c, -1] > g[c, 0]:
            span = (stamps[c, TRACE_BLOCK0 + DETAIL_FIRST + DETAIL_BLOCKS - 1]
                    - stamps[c, TRACE_BLOCK0 + DETAIL_FIRST]).item()  # (int64: exact)
            ghz.append(((d[c, -1, 0] - d[c, 0, 0]) / span).item())
    clk = _median(ghz)
    if math.isnan(clk):
        return {}
    offs = {p: [] for p in DETAIL}
    block = []
    for c in range(d.shape[0]):
        for k in range(DETAIL_BLOCKS):
            if not full[c, k]:
                continue
            for j, p in enumerate(DETAIL):
                offs[p].append(((d[c, k, j] - d[c, k, 0]) / clk).item())
            if k + 1 < DETAIL_BLOCKS and full[c, k + 1]:
                block.append(((d[c, k + 1, 0] - d[c, k, 0]) / clk).item())
    return dict(offset={p: _median(v) for p, v in offs.items()}, block_ns=_median(block),
                ghz=clk, n=len(offs["d_start"]))


def _fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in d.items() if not math.isnan(v))


def trace_row(spec: str, out_dir: str) -> None:
    import bench_decode as bd

    import torch_mla
    from torch_mla.constants import LOG2_E
    from torch_mla.ops import dispatch
    from torch_mla.ops.sparse import fp8_cache_bytes, sparse_backend, split_pair_rows
    from torch_mla.scheduling import walk_schedule
    from torch_mla.testing import graph_time_us

    b, s_q, h_q = (int(x) for x in spec.split(","))
    tokens, idx, q, sched = bd._sparse_problem(b, s_q, h_q, TOPK, S_K)
    cache = bd._sparse_cache(b * S_K, torch.uint8, 656, tokens)
    del tokens
    if os.environ.get("NONE") == "1":  # (every entry -1: nothing read, as tools/sparse_rows.py)
        idx.fill_(-1)
    taken = sparse_backend(q, cache, 512)[0]
    pair = split_pair_rows(h_q, "fp8_ds_mla", b * s_q) > 0
    parts = sched.metadata.shape[0]
    m_blocks = -(-h_q // 64)
    slots = b * s_q + parts
    dev = q.device
    out = torch.empty(b, s_q, h_q, 512, dtype=q.dtype, device=dev)
    args = (q, fp8_cache_bytes(cache), idx, torch.full((b,), TOPK, dtype=torch.int32, device=dev),
            sched.metadata, sched.num_splits, out,
            torch.empty(b, h_q, s_q, dtype=torch.float32, device=dev),
            torch.empty(slots, h_q, 512, dtype=torch.float32, device=dev),
            torch.empty(slots, h_q, dtype=torch.float32, device=dev),
            576 ** -0.5 * LOG2_E, dispatch.combine_variant(b * s_q, parts, h_q,
                                                            dispatch.device_num_sms(dev)))
    stamps = torch.zeros(parts * m_blocks, TRACE_SLOTS, dtype=torch.int64, device=dev)
    traced = traced_step(pair)
    for _ in range(3):
        traced(*args, stamps)
    torch.cuda.synchronize()
    host = stamps.cpu()  # (the third eager run's: the graph timing below overwrites the table)
    ref = torch_mla.mla_decode_sparse(q, cache, idx, schedule=sched)[0]
    diff = (out.float() - ref.float()).abs().max().item()
    lengths = torch.full((b * s_q,), TOPK, dtype=torch.int32)
    segs = [[] for _ in range(parts * m_blocks)]
    for p, _r, lo, hi, slot in walk_schedule(sched.metadata, sched.num_splits, lengths):
        for m in range(m_blocks):
            segs[p * m_blocks + m].append((hi - lo, slot >= 0))
    summ = summarize(host, segs)
    t_op = graph_time_us(lambda: torch_mla.mla_decode_sparse(q, cache, idx, schedule=sched))
    t_traced = graph_time_us(lambda: traced(*args, stamps))
    torch.save(dict(stamps=host, meta=sched.metadata.cpu(),
                    num_splits=sched.num_splits.cpu(), lengths=lengths, cfg=(b, s_q, h_q),
                    topk=TOPK, s_k=S_K, pair=pair, m_blocks=m_blocks, points=POINTS,
                    layout=dict(slots=TRACE_SLOTS, per_seg=TRACE_PER_SEG, segs=TRACE_SEGS,
                                junk=TRACE_JUNK, end=TRACE_END, block0=TRACE_BLOCK0,
                                blocks=TRACE_BLOCKS, block_segs=TRACE_BLOCK_SEGS,
                                detail0=DETAIL0, detail=DETAIL, detail_first=DETAIL_FIRST,
                                detail_blocks=DETAIL_BLOCKS, detail_who=DETAIL_WHO),
                    t_op=t_op, t_traced=t_traced, backend=taken),
               os.path.join(out_dir, f"trace_sparse_{b}_{s_q}_{h_q}.pt"))
    blocks = sorted(sum(n for n, _ in ss) for ss in segs)
    nsegs = sorted(len(ss) for ss in segs)
    print(f"{spec}: op {t_op:.1f} us ({taken}), traced step {t_traced:.1f} us (decode + combine); "
          f"pair {pair}, parts {parts}, CTAs {len(segs)}, blocks a CTA {blocks[0]}/"
          f"{blocks[len(blocks) // 2]}/{blocks[-1]}, segments a CTA {nsegs[0]}/"
          f"{nsegs[len(nsegs) // 2]}/{nsegs[-1]} (min/med/max); out against the op's: max "
          f"|diff| {diff:.3g}")
    print(f"   kernel: span {summ['span']:.2f}, last start {summ['start_skew']:.2f}, end "
          f"min/med/max {summ['end_min']:.2f}/{summ['end_med']:.2f}/{summ['end_max']:.2f}")
    print("   first segment, median over CTAs (us from the first CTA's start): "
          + _fmt(summ["first"]))
    print(f"   slowest CTA ({summ['slowest_cta']}): " + _fmt(summ["slowest"]))
    print("   phases (median over first segments, us): " + _fmt(summ["phases"]))
    print("   phases (median over later segments, us): " + _fmt(summ["phases_later"]))
    det = detail_summary(host)
    if det:
        print(f"   inside blocks {DETAIL_FIRST}-{DETAIL_FIRST + DETAIL_BLOCKS - 1} (n {det['n']}, "
              f"SM clock {det['ghz']:.3f} GHz; ns from WG0's block start, median; block "
              f"{det['block_ns']:.0f} ns): " + ", ".join(
                  f"{p[2:]} {v:.0f}" for p, v in det["offset"].items()))
    med, cnt = summ["block"]
    if cnt:
        print(f"   WG0 block, steady state: {med:.3f} us (n {cnt}); by start time: " + "  ".join(
            f"{t:.0f}+: {m:.3f} (n {c})" for t, (m, c) in summ["block_by_time"].items()))
    sys.stdout.flush()


def compile_only() -> None:
    """Builds the trace step with and without the pair; prints each build's time and its
    %globaltimer reads (PTX: the compiled function's, else CUTE_DSL_DUMP_DIR's files)."""
    import glob

    for pair in (False, True):
        t = time.time()
        fn = traced_step(pair)
        ptx = getattr(fn, "__ptx__", None)
        where = "compiled function"
        if not ptx:
            files = glob.glob(os.path.join(os.environ.get("CUTE_DSL_DUMP_DIR", "."), "*.ptx"))
            ptx = open(max(files, key=os.path.getmtime)).read() if files else ""
            where = "dumped file"
        reads = ptx.count("%globaltimer")
        print(f"trace build, pair {pair}: compiled in {time.time() - t:.1f} s; PTX ({where}) "
              f"{len(ptx)} bytes, {reads} %globaltimer reads, {ptx.count('%clock64')} %clock64, "
              f"{ptx.count('wgmma.mma_async')} wgmma.mma_async", flush=True)
        if not reads or ptx.count("%clock64") < len(DETAIL):
            raise SystemExit("%globaltimer or %clock64 reads missing in the trace build's PTX")


def main():
    argv = [a for a in sys.argv[1:] if a != "--compile-only"]
    if len(argv) < len(sys.argv) - 1:
        compile_only()
        return
    out_dir = argv[0] if argv else os.environ.get("OUT", "/tmp")
    os.makedirs(out_dir, exist_ok=True)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    import torch_mla

    torch_mla.set_value_checks(False)
    for spec in argv[1:] or DEFAULT:
        trace_row(spec, out_dir)


if __name__ == "__main__":
    main()
