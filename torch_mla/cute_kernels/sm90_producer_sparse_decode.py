"""Sparse MLA decode on SM90 with a producer warpgroup that gathers and dequantizes, CuTe DSL.

Problem and mapping: sm90_sparse_decode.py's (the dense SM90 kernel's walk over blocks of 64
gathered entries, heads on the MMAs' M side, the seesaw of two consumer warpgroups over two
page buffers). What moves: in that kernel the consumer warpgroups issue each buffer half's
gather between their MMAs, and over the 656-byte rows the warpgroup that computes a block's
Q K^T first expands the half's fp8 bytes to bf16 in shared memory, on its critical path. Here a
third warpgroup (WG2, the producer; 384 threads a CTA) does both, over the same walk
(splitkv.segment per request, blocks in order, block j of a segment into buffer j % 2, a
block's halves in the order its Q K^T reads them: fill_order). Per buffer half:
  - the 656-byte rows: each producer thread loads the first AHEAD (2) of its 8 chunks of 16
    fp8 bytes (two rows a warp and step, chunk_of_lane) and the rows' group scales into
    registers (ld.global.nc, none for an entry that names no key: zeros) and prefetches the
    other chunks' lines into L2, before it waits for the half to be released, so the loads
    are in flight meanwhile; after the wait each step loads the chunk AHEAD steps on. It
    multiplies each value by its
    scale in fp32, rounds once to bf16 (the reference's dequantization) and stores the values
    to their places in the 128-byte-swizzled tiles the MMAs read (fp8_store_offsets: a phase of
    8 lanes covers two adjacent rows, no bank conflict); over half 1 the bf16 rope tile goes
    by cp.async (sm90_sparse_decode.gather16, the four warps sharing its rows);
  - the bf16/fp16 cache: the half's tiles by cp.async once it is released.
The consumers' release is their _load_tiles call (where the kernel without a producer loads):
one elected lane arrives on the half's "empty" mbarrier. Every producer thread then fences its
stores for the async proxy and arrives on the tile mbarrier the consumers' Q K^T waits for
(tile 0 or 4 of the buffer; cp.async.mbarrier.arrive makes that phase wait for its copies too).
Warp 0 writes the buffer's bias row (-inf for an entry that names none) with half 0.

The consumers run the dense kernel's code unchanged but for that release, a barrier of their
256 threads instead of __syncthreads, and no expansion of their own (the producer flag of
sm90_decode.MLADecodeSm90). setmaxnreg gives the consumers 224 registers and the producer 56
(REGS: 168 a thread at launch).

History and status (sessions 27-28): the first version gathered the fp8 bytes by cp.async after
the release and had two of the producer's warps expand them in place (the dense kernel's
schedule, in waves with barriers): correct (146 GPU tests, memcheck clean), but 10% slower than
the heads-on-M kernel at b 128 (H100, h_q 64 over the 656-byte rows: 181.9 against 165.0 us),
and with every entry -1 (nothing read) 156.9 us against 93.5 over the bf16 cache: the in-place
expansion by 64 threads bound it. This version (registers, no in-place pass) ran in session 28
(H100): slower still at every row, more so the more steps it holds (b 128 h_q 64: 235 / 251 /
294 us at AHEAD 2 / 4 / 8 against the heads-on-M kernel's 165; FlashMLA ~130). ptxas spills
180 bytes in it at AHEAD 4 (0 without the conversion; 132 at AHEAD 2, 324 at 8): the
producer's 56 registers are the limit, and the consumers need their 224 (at 216 they spill).
FlashMLA's producer has 152, beside consumers of 192 and 160 (one computes S and the softmax);
see docs/kernel-notes.md. Kept opt-in as the base of that split.

Limits: as sm90_sparse_decode.py (h_q any, as 64-row m-blocks; s_q any; topk any), over the
bf16/fp16 cache or the 656-byte rows (bf16 q); the e4m3 cache takes the heads-on-M kernel.
Opt-in (TORCH_MLA_SPARSE_PRODUCER=1, where the dispatch would take the SM90 sparse kernel).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from ..constants import D_QK, FP8_DS_MLA_ROPE_AT, FP8_DS_MLA_SCALES_AT, PAGE_SIZE
from . import splitkv
from .ptx import (
    cp_async_mbarrier_arrive,
    e4m3_store16,
    ldg_or_zero,
    pin_b32,
    prefetch_l2,
)
from .sm80_sparse_decode import MLASparseDecodeStep
from .sm90_decode import N_TILES, MLADecodeSm90
from .sm90_sparse_decode import TILE16, MLASparseDecodeSm90, gather16, row_source

REGS = (56, 224)  # (producer, consumer) registers a thread after setmaxnreg
PRODUCER_THREADS = 128
# Steps (of 8, two rows a warp each) of a half's fp8 chunks a producer thread holds in
# registers across the wait for the half's release; the others' lines go to L2 meanwhile, and
# after the wait each stored step loads the one AHEAD steps on (the registers: REGS' 56). 2
# measured fastest of 2, 4 and 8 (session 28, docs/benchmarks-h100.md; its knob
# TORCH_MLA_DEV_AHEAD removed in session 49).
AHEAD = 2
CACHES = ("plain", "fp8_ds_mla")


def fill_order(s: int) -> tuple:
    """The order a block's two halves are filled in buffer s: the order the consumer
    warpgroup that computes its Q K^T waits for them (WG0: tiles 0-3 first, WG1: 4-8)."""
    return (0, 1) if s == 0 else (1, 0)


def chunk_of_lane(lane: int) -> tuple:
    """(p, k) of lane `lane` in the 656-byte rows' fp8 loads: at each step a warp reads two
    rows (p: 0 or 1, which of them) x 16 chunks of 16 bytes (k: the chunk of the half's 256
    bytes). Lanes 8 i + 4 p + c take chunk 4 i + c, so a phase of 8 lanes stores to two
    adjacent rows, whose swizzles differ in bit 0: 8 distinct 16-byte bank groups."""
    return (lane >> 2) & 1, (lane & 3) + 4 * (lane >> 3)


def fp8_store_offsets(h: int, row: int, k: int) -> tuple:
    """Byte offsets, from a page buffer's start, of the two 16-byte chunks that values 0-7 and
    8-15 of chunk k (0..15) of half h of the 656-byte row `row` become: 16-bit tile 4 h + k // 4,
    its columns 16 (k % 4) + [0, 16) in the 128-byte swizzle (chunk c of row R at c ^ (R % 8)).
    row: an int (tests) or the DSL's Int32."""
    tile = (4 * h + k // 4) * PAGE_SIZE * 128 + row * 128
    c8 = 2 * (k % 4)
    return tile + ((c8 ^ (row % 8)) << 4), tile + (((c8 + 1) ^ (row % 8)) << 4)


class MLASparseDecodeSm90Producer(MLASparseDecodeSm90):
    """The SM90 sparse kernel with a producer warpgroup; see the module docstring."""

    producer = True
    num_threads = 256 + PRODUCER_THREADS
    regs = REGS
    # The consumers' _load_tiles: one elected lane of warp 0 of the releasing warpgroup.
    load_warps = 1
    # The consumers' tile mbarriers (tile 0 and 4 of each buffer are waited for): one arrival a
    # producer thread after its stores and its fence (and its cp.async copies, tracked by
    # cp.async.mbarrier.arrive, which adds no expected arrival).
    k_arrivals = PRODUCER_THREADS

    # Steps of a half's fp8 chunks held across the release (the module's AHEAD) and the order
    # of a block's halves (a subclass with other consumers changes them).
    ahead = AHEAD
    fill_order = staticmethod(fill_order)
    # Whether the producer fences its writes for the async proxy before it arrives (a subclass
    # whose every reader fences after its wait may drop it).
    producer_fences = True

    def __init__(self, dtype, cache: str = "plain"):
        assert cache in CACHES, cache
        super().__init__(dtype, cache)

    def _extra_storage(self) -> dict:
        """An "empty" mbarrier a buffer half (the consumers' release)."""
        return {"barE": cute.struct.MemRange[cutlass.Int64, 4]}

    def _init_barriers(self):
        """barE[2 s + h]: half h of buffer s is free (one arrival: the consumers' release)."""
        bar = self.d_storage.barE.data_ptr()
        for i in range(4):  # (thread 0, traced inline: a Python loop)
            cute.arch.mbarrier_init(bar + i, 1)

    # The consumers read no entries: the producer does.
    _next_page = MLADecodeSm90._next_page

    @cute.jit
    def _load_tiles(self, tma_k, mKV, tKsK, barK, page, s: cutlass.Constexpr[int],
                    t_begin: cutlass.Constexpr[int], t_end: cutlass.Constexpr[int]):
        """A consumer warp, where the kernel without a producer loads tiles [t_begin, t_end)
        of buffer s: one lane releases each buffer half those tiles cover to the producer."""
        with cute.arch.elect_one():
            for h in cutlass.range_constexpr(2):
                if const_expr(t_begin <= 4 * h and 4 * h < t_end):
                    self._free(2 * s + h)
            if const_expr(t_begin == 0):
                self._release_rope(s)

    def _release_rope(self, s):
        """A subclass's release of buffer s's rope tile apart from its halves (the split's
        ROPE_EARLY); none here."""

    def _free(self, i: int):
        """Half i % 2 of buffer i // 2 to the producer (one lane: its "empty" mbarrier)."""
        cute.arch.mbarrier_arrive(self.d_storage.barE.data_ptr() + i)

    @cute.jit
    def _walk_inputs(self, mKV):
        """What a producer's walk reads: (this thread's warp of the warpgroup, the entries, the
        lengths, the split counts, the entries' blocks a request, the cache's rows as
        row_source takes them)."""
        tidx, _, _ = cute.arch.thread_idx()
        mIdx = self.d_tensors.block_table
        return (cute.arch.make_warp_uniform(tidx // 32) % 4, mIdx, self.d_tensors.seqlens,
                self.d_tensors.num_splits, self._table_blocks(mIdx), self._cache_rows(mKV))

    @cute.jit
    def _produce(self, walk, mKV, barK):
        """The producer warpgroup: the consumers' walk, every block's two halves in
        fill_order (_fill); each block's entries are read at the start of its pair."""
        warp, mIdx, mLens, mNumSplits, width, rows = self._walk_inputs(mKV)
        parity = cute.make_rmem_tensor(4, Int32)  # per buffer half, its "empty" mbarrier's
        parity.fill(0)
        last = cute.size(mLens) - 1
        for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
            # (the consumers read the first request's scalars at min(begin_req, last), the
            # others' at r: the schedule keeps end_req <= last, so the two agree; the clamp only
            # keeps a bad schedule from reading outside mLens)
            rr = cutlass.min(r, last)
            lo, hi = splitkv.segment(walk, r, mLens[rr], width,
                                     mNumSplits[rr + 1] - mNumSplits[rr])
            for i in cutlass.range(cutlass.max(hi - lo + 1, 0) // 2, unroll=1):
                blk = lo + 2 * i
                nxt = cutlass.min(blk + 1, hi - 1)
                slots0 = list(self._entries(self._page(mIdx, r, blk)))
                slots1 = list(self._entries(self._page(mIdx, r, nxt)))
                for h in self.fill_order(0):
                    self._fill(rows, slots0, 0, h, barK, parity, warp)
                if blk + 1 < hi:
                    for h in self.fill_order(1):
                        self._fill(rows, slots1, 1, h, barK, parity, warp)

    @cute.jit
    def _row_of(self, rows, src, warp, j: cutlass.Constexpr[int], p):
        """(address of row 16 warp + 2 j + p of the block, 16 or 0: whether its entry names a
        key), from src: lane i's entry of key 32 (warp // 2) + i."""
        return row_source(*rows, cute.arch.shuffle_sync(src, 16 * (warp % 2) + 2 * j + p))

    @cute.jit
    def _fill(self, rows, slots, s: cutlass.Constexpr[int], h: cutlass.Constexpr[int], barK,
              parity, warp):
        """Half h of buffer s from the 64 keys whose slots the lanes hold (keys lane and
        lane + 32), by the producer warpgroup, once the consumers released it. The 656-byte
        rows: each thread first loads the first AHEAD of its 8 chunks of 16 fp8 bytes (rows
        16 warp + 2 j + p, chunk k: chunk_of_lane) and two scale words into registers and
        prefetches the other chunks' lines into L2, so that the loads are in flight while the
        half is still in use; then waits, and stores each value times its row's scale (taken
        by shuffle), rounded to bf16 (ptx.e4m3_store16), to its swizzled place, loading the
        chunk AHEAD steps on as it goes;
        over half 1 the bf16 rope tile by cp.async (gather16). The 16-bit cache: the half's
        tiles by cp.async. Warp 0 writes buffer s's bias row with half 0. Every thread then
        fences its writes for the async proxy and arrives on the half's tile mbarrier, which
        also waits for its cp.async copies."""
        lane = cute.arch.lane_idx()
        buf = self.d_k_base.toint() + s * (PAGE_SIZE * D_QK * 2)
        words, scales = [], None
        p, k = chunk_of_lane(lane)
        if const_expr(self.cache == "fp8_ds_mla"):
            # Rows 16 warp + 2 j + p at step j: their addresses (_row_of), the first AHEAD
            # steps' chunks loaded into registers now, the others' lines prefetched into L2.
            src = cutlass.select_(warp < 2, slots[0], slots[1])  # rows 16 warp .. + 15
            for j in cutlass.range_constexpr(PAGE_SIZE // 8):
                row, ok = self._row_of(rows, src, warp, j, p)
                if const_expr(j < self.ahead):
                    words.append(ldg_or_zero(4, row + 256 * h + 16 * k, ok))
                else:
                    prefetch_l2(row + 256 * h + 16 * k, ok)
            # Lane i < 16 loads the half's two scales of row 16 warp + i (8 bytes); the lanes
            # take them by shuffles after the wait (two words a lane instead of eight).
            row, ok = row_source(*rows, cute.arch.shuffle_sync(src, 16 * (warp % 2) + lane % 16))
            # (lanes 16-31 load the same words as 0-15: predicating them off cost ptxas 32
            # more bytes of spill)
            scales = ldg_or_zero(2, row + FP8_DS_MLA_SCALES_AT + 8 * h, ok)
        cute.arch.mbarrier_wait(self.d_storage.barE.data_ptr() + 2 * s + h, parity[2 * s + h])
        parity[2 * s + h] = parity[2 * s + h] ^ 1
        if const_expr(h == 0):
            self._half0_bias(s, slots, warp)
        bar = barK + s * N_TILES + 4 * h
        if const_expr(self.cache == "fp8_ds_mla"):
            # (the rows' addresses again, not kept across the wait: pin_b32 keeps the compiler
            # from reusing the ones computed before it, which would hold ~20 more registers)
            src = pin_b32(src)
            for j in cutlass.range_constexpr(PAGE_SIZE // 8):
                if const_expr(j + self.ahead < PAGE_SIZE // 8):  # (a window of AHEAD steps)
                    row, ok = self._row_of(rows, src, warp, j + self.ahead, p)
                    words.append(ldg_or_zero(4, row + 256 * h + 16 * k, ok))
                row = 16 * warp + 2 * j + p
                pair = [cute.arch.shuffle_sync(scales[g], 2 * j + p) for g in range(2)]
                d0, d1 = fp8_store_offsets(h, row, k)
                e4m3_store16(buf + d0, buf + d1, words[j], True,
                             cutlass.select_(k < 8, pair[0], pair[1]), early=True)
        # (the rope tile last: its addresses would hold registers beside words)
        self._copy_and_arrive(rows, slots, buf, h, bar, warp)

    @cute.jit
    def _half0_bias(self, s, slots, warp):
        """With half 0 of buffer s: warp 0 writes the buffer's bias row (_write_bias) for the 64
        keys whose slots the lanes hold."""
        if warp == 0:
            self._write_bias(self.d_storage.sBias.get_tensor(cute.make_layout(2 * PAGE_SIZE)),
                             s * PAGE_SIZE, slots, cute.arch.lane_idx())

    @cute.jit
    def rope_tile(self, rows, slots, buf, warp):
        """The 656-byte rows' bf16 rope values of the 64 keys whose slots the lanes hold into
        the last 16-bit tile of the buffer at shared address buf (cp.async, the four warps
        sharing its rows; cp_async_mbarrier_arrive then tracks them)."""
        gather16(slots, rows, [(buf + (N_TILES - 1) * TILE16, FP8_DS_MLA_ROPE_AT)], warp)

    @cute.jit
    def _copy_and_arrive(self, rows, slots, buf, h: cutlass.Constexpr[int], bar, warp,
                         tx: cutlass.Constexpr[int] = 0,
                         rope_issued: cutlass.Constexpr[bool] = False):
        """The end of a half's fill (buffer at shared address buf, tile mbarrier bar): the
        half's cp.async copies (the 656-byte rows: the bf16 rope tile over half 1, unless
        rope_issued: the caller issued it already, rope_tile; the 16-bit cache: the half's
        tiles), tracked by bar; then this thread's writes fenced for the async proxy (where
        producer_fences) and its
        arrival on bar (tx: bytes a peer CTA's st.async completes on bar, which thread 0 of the
        warpgroup's arrival expects)."""
        if const_expr(self.cache == "fp8_ds_mla"):
            if const_expr(h == 1):
                if const_expr(not rope_issued):
                    self.rope_tile(rows, slots, buf, warp)
                cp_async_mbarrier_arrive(bar.toint())
        else:
            t0, t1 = (0, 4) if h == 0 else (4, N_TILES)
            gather16(slots, rows, [(buf + t * TILE16, t * 128) for t in range(t0, t1)], warp)
            cp_async_mbarrier_arrive(bar.toint())
        if const_expr(self.producer_fences):
            cute.arch.fence_view_async_shared()
        if const_expr(tx):
            if warp == 0 and cute.arch.lane_idx() == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, tx)
            else:
                cute.arch.mbarrier_arrive(bar)
        else:
            cute.arch.mbarrier_arrive(bar)


# --- compile entry (ops/registry.py: SparseStepConfig, backend "sm90_producer") ---------------


def compile_sparse_step(config, arch: str):
    """The SM90 sparse decode step with a producer warpgroup (dtype, cache format), compiled
    for arch (sm_90a)."""
    from ..contract import compile_sparse_step_kernel, dsl_dtype

    dtype = dsl_dtype(config.dtype)
    return compile_sparse_step_kernel(
        MLASparseDecodeStep(MLASparseDecodeSm90Producer(dtype, config.cache), dtype,
                            use_pdl=True),
        dtype, arch, config.cache)
