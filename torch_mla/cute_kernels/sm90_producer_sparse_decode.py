"""Sparse MLA decode on SM90 with a producer warpgroup that gathers and dequantizes, CuTe DSL.

Problem and mapping: sm90_sparse_decode.py's (the dense SM90 kernel's walk over blocks of 64
gathered entries, heads on the MMAs' M side, the seesaw of two consumer warpgroups over two
page buffers). What moves: in that kernel the consumer warpgroups issue each buffer half's
gather between their MMAs, and over an FP8 cache the warpgroup that computes a block's Q K^T
first expands the half's fp8 bytes to 16-bit values in shared memory, on its critical path.
Here a third warpgroup (WG2, the producer, 384 threads a CTA) does both, over the same walk
(splitkv.segment per request, blocks in order, block j of a segment into buffer j % 2):
  - warps 0-1 (gatherers): per buffer half, wait until the consumers released it (their
    _load_tiles call, now one arrival on the half's "empty" mbarrier), read the block's
    entries, and gather the half by cp.async (sm90_sparse_decode's _gather, its copies shared
    by the two warps: the fp8 bytes to their staging places, the 656-byte rows' rope tile and
    scales, the bias row); their lanes' cp.async.mbarrier.arrive.noinc complete the half's
    "landed" mbarrier;
  - warps 2-3 (expanders): per half in the same order, wait for "landed", expand the fp8
    bytes in place into the 128-byte-swizzled 16-bit tiles the MMAs read (the dense kernel's
    fp8_expand_schedule and fp8_expand_addrs, each of the 64 threads taking two of the 128
    lanes of a wave; over the 656-byte rows each value times its group's scale in fp32,
    rounded once to bf16, as the reference dequantizes), fence the writes for the async proxy,
    and arrive once on the tile mbarrier the consumers' Q K^T waits for (tile 0 or 4 of the
    buffer). Over the bf16/fp16 cache they only pass the half on.
A half is filled in the order the consumers' Q K^T reads it: tiles 0-3 then 4-8 for a block in
buffer 0 (WG0 computes its S), 4-8 then 0-3 in buffer 1 (WG1's order).

The consumers run the dense kernel's code unchanged but for that release, a barrier of their
256 threads instead of __syncthreads, and no expansion of their own (the producer flag of
sm90_decode.MLADecodeSm90). setmaxnreg gives the consumers 232 registers and the producer 40
(REGS: 168 a thread at launch).

Why (docs/kernels/sparse.md, "Toward h_q 64 and 128"): over the 656-byte rows the heads-on-M
kernel ran at 0.62-0.79x FlashMLA, its consumers expanding each half themselves; FlashMLA's
producer warpgroup dequantizes instead. Not yet run on a GPU: opt-in
(TORCH_MLA_SPARSE_PRODUCER=1, where the dispatch would take the SM90 sparse kernel).

Limits: as sm90_sparse_decode.py (h_q any, as 64-row m-blocks; s_q any; topk any; the three
cache formats, the 656-byte rows with bf16 q).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..constants import BLOCK_M, D_QK, PAGE_SIZE
from . import splitkv
from .decode_base import aligned
from .ptx import e4m3_store16, lds64, lds128
from .sm80_sparse_decode import CACHE_FORMATS, MLASparseDecodeStep
from .sm90_decode import (
    N_TILES,
    MLADecodeSm90,
    fp8_expand_addrs,
    fp8_expand_schedule,
    group_scale_offset,
    shared_storage,
)
from .sm90_sparse_decode import GatheredEntries, MLASparseDecodeSm90

REGS = (56, 224)  # (producer, consumer) registers a thread after setmaxnreg
GATHER_WARPS = 2  # producer warps 0-1 gather, 2-3 expand
EXPAND_THREADS = 64
NB_EXPAND = 8  # the expanders' named barrier (sm90_decode's ids end at 7)


def fill_order(s: int) -> tuple:
    """The order a block's two halves are filled in buffer s: the order the consumer
    warpgroup that computes its Q K^T waits for them (WG0: tiles 0-3 first, WG1: 4-8)."""
    return (0, 1) if s == 0 else (1, 0)


class MLASparseDecodeSm90Producer(MLASparseDecodeSm90):
    """The SM90 sparse kernel with a producer warpgroup; see the module docstring."""

    producer = True
    num_threads = 384
    regs = REGS
    # The consumers' _load_tiles: one elected lane of warp 0 of the releasing warpgroup.
    load_warps = 1
    # The consumers' tile mbarriers (tile 0 and 4 of each buffer are waited for): one arrival,
    # the expanders' after their fence and barrier.
    k_arrivals = 1
    cp_async_tiles = True

    def __init__(self, dtype, cache: str = "plain"):
        assert cache in CACHE_FORMATS, cache
        super().__init__(dtype, cache)

    def _setup(self, mQ: cute.Tensor, mKV: cute.Tensor):
        """sm90_sparse_decode's layouts and storage, and 8 more mbarriers: each buffer half's
        "empty" (the consumers' release) and "landed" (the gatherers' copies)."""
        loads, layouts = super()._setup(mQ, mKV)
        dt = self.dtype
        self.shared_storage = shared_storage(
            sQ=aligned(dt, BLOCK_M * D_QK),
            sK=aligned(dt, 2 * PAGE_SIZE * D_QK),
            sP0=aligned(dt, BLOCK_M * PAGE_SIZE),
            sBias=cute.struct.MemRange[Float32, 2 * PAGE_SIZE],
            barP=cute.struct.MemRange[cutlass.Int64, 8],
        )
        return loads, layouts

    def _init_barriers(self):
        """barP[2 s + h]: half h of buffer s is free (one arrival); barP[4 + 2 s + h]: its
        copies have landed (GATHER_WARPS x 33 arrivals: each lane's noinc, one lane's
        release)."""
        bar = self.d_storage.barP.data_ptr()
        for i in range(4):  # (thread 0, traced inline: a Python loop)
            cute.arch.mbarrier_init(bar + i, 1)
            cute.arch.mbarrier_init(bar + 4 + i, GATHER_WARPS * GatheredEntries.k_arrivals)

    # The consumers read no entries: the producer does.
    _next_page = MLADecodeSm90._next_page

    @cute.jit
    def _load_tiles(self, tma_k, mKV, tKsK, barK, page, s: cutlass.Constexpr[int],
                    t_begin: cutlass.Constexpr[int], t_end: cutlass.Constexpr[int]):
        """A consumer warp, where the kernel without a producer loads tiles [t_begin, t_end)
        of buffer s: one lane releases each buffer half those tiles cover to the producer."""
        bar = self.d_storage.barP.data_ptr()
        with cute.arch.elect_one():
            for h in cutlass.range_constexpr(2):
                if const_expr(t_begin <= 4 * h and 4 * h < t_end):
                    cute.arch.mbarrier_arrive(bar + 2 * s + h)

    @cute.jit
    def _produce(self, walk, mKV, barK):
        """The producer warpgroup: the consumers' walk, every block's two halves in
        fill_order; warps 0-1 gather, warps 2-3 expand (module docstring)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32) % 4
        mIdx, mLens, mNumSplits = (self.d_tensors.block_table, self.d_tensors.seqlens,
                                   self.d_tensors.num_splits)
        width = self._table_blocks(mIdx)
        bar = self.d_storage.barP.data_ptr()
        parity = cute.make_rmem_tensor(4, Int32)  # per buffer half: empty (gatherers), landed
        parity.fill(0)
        last = cute.size(mLens) - 1
        for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
            # (the consumers read a request's scalars at min(r, last) too: _load_request)
            rr = cutlass.min(r, last)
            lo, hi = splitkv.segment(walk, r, mLens[rr], width, mNumSplits[rr + 1] - mNumSplits[rr])
            for i in cutlass.range(cutlass.max(hi - lo + 1, 0) // 2, unroll=1):
                blk = lo + 2 * i
                if warp < GATHER_WARPS:
                    self._gather_block(mKV, mIdx, r, blk, 0, bar, parity, warp)
                    if blk + 1 < hi:
                        self._gather_block(mKV, mIdx, r, blk + 1, 1, bar, parity, warp)
                else:
                    self._expand_block(0, bar, barK, parity, tidx % 128 - 32 * GATHER_WARPS)
                    if blk + 1 < hi:
                        self._expand_block(1, bar, barK, parity,
                                           tidx % 128 - 32 * GATHER_WARPS)

    @cute.jit
    def _gather_block(self, mKV, mIdx, r, blk, s: cutlass.Constexpr[int], bar, parity, warp):
        """A gathering warp: block blk of one-token request r into buffer s, half by half
        (fill_order), each once the consumers released it."""
        slots = list(self._entries(self._page(mIdx, r, blk)))
        for h in fill_order(s):
            t0, t1 = (0, 4) if h == 0 else (4, N_TILES)
            cute.arch.mbarrier_wait(bar + 2 * s + h, parity[2 * s + h])
            parity[2 * s + h] = parity[2 * s + h] ^ 1
            self._gather(mKV, slots, s, t0, t1, warp, GATHER_WARPS)
            self._arrive_gathered([bar + 4 + 2 * s + h])

    @cute.jit
    def _expand_block(self, s: cutlass.Constexpr[int], bar, barK, parity, t):
        """An expanding thread (t: 0..63): the block in buffer s, half by half (fill_order):
        once its copies landed, its fp8 bytes expanded in place (_expand), the writes fenced for
        the async proxy, and one arrival on the tile mbarrier the consumers wait for."""
        for h in fill_order(s):
            cute.arch.mbarrier_wait(bar + 4 + 2 * s + h, parity[2 * s + h])
            parity[2 * s + h] = parity[2 * s + h] ^ 1
            if const_expr(self.cache != "plain"):
                self._expand(s, h, t)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=NB_EXPAND, number_of_threads=EXPAND_THREADS)
            if t == 0:
                cute.arch.mbarrier_arrive(barK + s * N_TILES + 4 * h)

    @cute.jit
    def _expand(self, s: cutlass.Constexpr[int], h: cutlass.Constexpr[int], t):
        """Half h of buffer s expanded in place by the 64 expanding threads, thread t taking
        lanes t and t + 64 of each wave of fp8_expand_schedule (whose barriers then order
        both); over the 656-byte rows each value times its row's scale of its group (read
        first: the expansion overwrites them, sm90_decode.group_scale_offset)."""
        t0, nt = (0, 4) if h == 0 else (4, 5)
        half = self.d_k_base.toint() + (s * PAGE_SIZE * D_QK + t0 * PAGE_SIZE * 64) * 2
        lanes = [t, t + EXPAND_THREADS]
        scales = None  # scales[k][2 (w // 4) + w % 2] for lane k's rows
        if const_expr(self.group_scales):
            nt = 4
            sc = self.d_k_base.toint() + s * PAGE_SIZE * D_QK * 2 + group_scale_offset(h)
            scales = [[None] * 4, [None] * 4]
            for k in cutlass.range_constexpr(2):
                for rb in cutlass.range_constexpr(2):
                    pair = lds64(sc + 8 * (32 * rb + lanes[k] // 4))
                    scales[k][rb], scales[k][2 + rb] = pair[0], pair[1]
            cute.arch.barrier(barrier_id=NB_EXPAND, number_of_threads=EXPAND_THREADS)
        words = {}
        for step, w in fp8_expand_schedule(nt):
            if const_expr(step == "bar"):
                cute.arch.barrier(barrier_id=NB_EXPAND, number_of_threads=EXPAND_THREADS)
            elif const_expr(step == "load"):
                for k in cutlass.range_constexpr(2):
                    words[(w, k)] = lds128(half + fp8_expand_addrs(nt, w, lanes[k])[0])
            else:
                for k in cutlass.range_constexpr(2):
                    _, d0, d1 = fp8_expand_addrs(nt, w, lanes[k])
                    scale = None
                    if const_expr(self.group_scales):
                        scale = scales[k][2 * (w // 4) + w % 2]
                    e4m3_store16(half + d0, half + d1, words[(w, k)],
                                 self.dtype == cutlass.BFloat16, scale)


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
