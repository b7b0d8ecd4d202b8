"""MLA decode on Blackwell (SM100, sm_100a): split-KV flash decoding over a paged latent cache,
in CuTe DSL, with tcgen05 MMAs accumulating in tensor memory (TMEM). NOT YET RUN ON HARDWARE:
it is compile-checked on the CPU (tests/test_kernel_compile.py) and opt-in (TORCH_MLA_SM100=1);
docs/sm100-design.md has the design, the barrier protocol and the predicted times.

Problem and work split: as sm90_decode.py. For each request r with L_r cached latents (576 wide)
and s_q * h_q query rows, out = softmax(scale * Q K^T) V with K the whole latent and V its first
512 columns. A grid of (num_m_blocks, num_parts) CTAs (torch_mla.scheduling, unchanged): CTA
(m, p) takes query rows [64 m, 64 m + 64) of every request segment in part p's piece of the block
stream; a request cut across parts writes fp32 partials that combine.py (unchanged) merges.

CTA: 192 threads in three roles (warp specialization), one CTA per SM (shared memory):
    warps 0-3  softmax: S (TMEM) -> registers, mask, online softmax, P -> shared memory, O
               rescale in TMEM when a row's max grows, epilogue (O / sum -> global, lse).
               Warp w owns rows 16 w .. 16 w + 15, the TMEM lanes its warp may access.
    warp 4     MMA: allocates TMEM, issues S = Q K^T and O += P V (one thread issues; tcgen05).
    warp 5     load: TMA of Q (once per segment) and of each cache page (72 KB).

Tiles: 64 query rows x 64 keys (one page). tcgen05 MMAs are cta_group::1 with M = 64:
    S = Q K^T : (64 x 64) += (64 x 16) (16 x 64)^T, 36 k-steps over the 576 columns
    O += P V  : (64 x 512) as two N = 256 halves, 4 k-steps over the 64 keys
Why M = 64 and one CTA: the shared schedule cuts rows into 64-row blocks (one wave fills the
SMs), and O for 128 rows (128 x 512 fp32) would fill all 512 TMEM columns. An M = 64
accumulator takes lanes 0-15 of each 32-lane quadrant; the two halves of O interleave (half 0 in
lanes 0-15, half 1 in lanes 16-31 of the same 256 columns), so O fits in 256 columns.

TMEM columns (512 allocated: allocations are powers of two):
    [0, 256)    O, d_v 0-255 in lanes 16q .. 16q + 15 of quadrant q, d_v 256-511 in the other 16
    [256, 320)  S stage 0      [320, 384)  S stage 1      [384, 512) unused

Shared memory: Q 72 KB + two page buffers 144 KB + P 8 KB + barriers (~225 KB of 227 KB).
A page buffer holds a page K-major in 128-byte swizzled rows; P V reads its first 512 columns
as an MN-major V operand (the same bytes: sm100_utils' K-major B layout for QK^T and MN-major B
layout for P V map (key, d) to the same offset, checked at compile time).

Pipeline (every wait has its arrive; PipelineState objects track stage and phase):
    kv   TMA -> MMA   2 stages   full: TMA bytes; empty: tcgen05.commit after P V of the page
    q    TMA -> MMA   1 stage    full: TMA bytes; empty: commit after a segment's last QK^T
    s    MMA -> softmax 2 stages full: commit after QK^T; empty: 128 softmax threads
    p    softmax -> MMA 1 stage  full: 128 threads after P is stored and O rescaled;
                                 empty: commit after P V (sP free, O stable)
    o    MMA -> softmax 1 stage  full: commit after a segment's last P V; empty: 128 threads
The MMA warp issues QK^T of page j + 1 before P V of page j, so the tensor core computes the
next scores while the softmax warps work on these.

Softmax: one thread per (row, 32 of the 64 keys), the other half of the row in lane ^ 16. The
running max a row's exponents are taken against is raised only when a page's max exceeds it by
more than 8 (log2 units): P <= 2^8 then (exact in fp32 sums, safe in bf16/fp16), and O is
rescaled in TMEM (load, multiply, store) only by warps in which some row raised it.

Masking: keys at or past a row's horizon (L, or L - s_q + i + 1 for causal query token i) get
-inf scores; a row that sees no key keeps max -inf and sum 0 (output 0, lse +inf). Rows of V past
L in a request's last page are zeroed in shared memory before P V, since the cache may hold
anything (NaN) there and 0 * NaN = NaN. The walk stops at the block table's width.

Limits: d_qk = 576, d_v = 512, page 64, bf16/fp16, any s_q * h_q (rows padded to 64; tuned for
nothing yet), one latent head per launch (a cache of h_kv heads runs one launch per head over a
strided view of it). Compiled per (dtype, causal); batch, s_q, h_q, the cache size and its
strides are runtime values. Arguments and outputs are those of sm90_decode.MLADecodeSm90.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator

from ..constants import BLOCK_M, D_QK, D_V, PAGE_SIZE
from . import softmax, splitkv
from .decode_base import DecodeKernel, SplitKVTensors, TmaLoads, aligned, shared_struct
from .ptx import L2_EVICT_FIRST, tcgen05_after_sync, tcgen05_before_sync

HALF_V = D_V // 2
KV_STAGES = 2
S_STAGES = 2
# A row's reference max is raised only past this many log2 units (see the module docstring).
RESCALE_LOG2 = 8.0

SOFTMAX_WARPS = 4
MMA_WARP = 4
LOAD_WARP = 5
NUM_THREADS = 32 * (SOFTMAX_WARPS + 2)

# TMEM column map (fp32 columns); see the module docstring.
TMEM_O = 0
TMEM_O_COLS = HALF_V  # two interleaved 64 x 256 halves
TMEM_S = TMEM_O + TMEM_O_COLS
TMEM_S_COLS = PAGE_SIZE
TMEM_USED = TMEM_S + S_STAGES * TMEM_S_COLS
TMEM_ALLOC = 512
TMEM_CAPACITY = 512
SMEM_CAPACITY = 227 * 1024  # sm_100's per-block opt-in maximum (232448 bytes)


class MLADecodeSm100(DecodeKernel):
    """Split-KV MLA decode for SM100; see the module docstring for the algorithm."""

    num_threads = NUM_THREADS

    def __init__(self, dtype, causal: bool):
        self.dtype = dtype
        self.causal = bool(causal)
        # Compile-time budgets (shared memory is checked in _prepare, where the layouts exist).
        assert TMEM_USED <= TMEM_ALLOC <= TMEM_CAPACITY, (TMEM_USED, TMEM_ALLOC)
        assert TMEM_ALLOC & (TMEM_ALLOC - 1) == 0 and TMEM_ALLOC >= 32, TMEM_ALLOC

    # ------------------------------------------------------------------------------------------
    # host side: MMAs, layouts, TMA descriptors (DecodeKernel.__call__ launches)
    # ------------------------------------------------------------------------------------------
    def _prepare(self, mQ: cute.Tensor, mKV: cute.Tensor, fp8: tuple):
        """The TMA atoms and views of Q and the cache, then the MMAs and shared-memory layouts
        the kernel takes; self.shared_storage and the byte counts the pipelines expect (traced
        inside __call__)."""
        dt = self.dtype
        K, MN = OperandMajorMode.K, OperandMajorMode.MN
        one = tcgen05.CtaGroup.ONE
        qk_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, one,
                                                    (BLOCK_M, PAGE_SIZE))
        pv_mma = sm100_utils.make_trivial_tiled_mma(dt, dt, K, MN, Float32, one, (BLOCK_M, HALF_V))
        qk_tiler = (BLOCK_M, PAGE_SIZE, D_QK)
        pv_tiler = (BLOCK_M, D_V, PAGE_SIZE)
        sQ_layout = cute.select(sm100_utils.make_smem_layout_a(qk_mma, qk_tiler, dt, 1),
                                mode=[0, 1, 2])
        sK_layout = sm100_utils.make_smem_layout_b(qk_mma, qk_tiler, dt, KV_STAGES)
        sP_layout = cute.select(sm100_utils.make_smem_layout_a(pv_mma, pv_tiler, dt, 1),
                                mode=[0, 1, 2])
        sV_layout = cute.select(sm100_utils.make_smem_layout_b(pv_mma, pv_tiler, dt, 1),
                                mode=[0, 1, 2])
        self._check_v_aliases_k(sK_layout, sV_layout)

        # TMA views: Q as (rows, 576, b), the cache as (64 keys, 576, pages).
        mQ_t = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        mKV_t = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
        op = cpasync.CopyBulkTensorTileG2SOp(one)
        tma_q, tma_mQ = cute.nvgpu.make_tiled_tma_atom_A(op, mQ_t, sQ_layout, qk_tiler, qk_mma)
        tma_kv, tma_mKV = cute.nvgpu.make_tiled_tma_atom_B(
            op, mKV_t, cute.select(sK_layout, mode=[0, 1, 2]), qk_tiler, qk_mma)

        self.shared_storage = shared_struct(
            bar_kv=cute.struct.MemRange[cutlass.Int64, 2 * KV_STAGES],
            bar_q=cute.struct.MemRange[cutlass.Int64, 2],
            bar_s=cute.struct.MemRange[cutlass.Int64, 2 * S_STAGES],
            bar_p=cute.struct.MemRange[cutlass.Int64, 2],
            bar_o=cute.struct.MemRange[cutlass.Int64, 2],
            tmem_addr=Int32,
            sQ=aligned(dt, cute.cosize(sQ_layout)),
            sKV=aligned(dt, cute.cosize(sK_layout)),
            sP=aligned(dt, cute.cosize(sP_layout)),
        )
        self.smem_bytes = self.shared_storage.size_in_bytes()
        assert self.smem_bytes <= SMEM_CAPACITY, (self.smem_bytes, SMEM_CAPACITY)
        self.tma_bytes_q = cute.size_in_bytes(dt, sQ_layout)
        self.tma_bytes_page = cute.size_in_bytes(dt, cute.select(sK_layout, mode=[0, 1, 2]))
        assert self.tma_bytes_page == PAGE_SIZE * D_QK * dt.width // 8, self.tma_bytes_page

        return TmaLoads(tma_q, tma_mQ, tma_kv, tma_mKV), (qk_mma, pv_mma, sQ_layout, sK_layout,
                                                  sP_layout, sV_layout)

    @staticmethod
    def _check_v_aliases_k(sK_layout, sV_layout):
        """P V reads V out of the page buffers that QK^T reads K from: element (key, d) of the
        K-major page must sit where the MN-major V operand looks for (d, key). Both layouts are
        static, so this is checked on every compile, on a grid of coordinates."""
        assert sK_layout.inner == sV_layout.inner, (sK_layout.inner, sV_layout.inner)
        k_outer = cute.select(sK_layout.outer, mode=[0, 1, 2])  # ((64 n, 16 k), 1, (4, 9))
        v_outer = sV_layout.outer  # (((64, 4) n, 16 k), 2, 4)
        for key in (0, 1, 7, 8, 15, 16, 33, 63):
            for d in (0, 1, 15, 16, 63, 64, 100, 255, 256, 300, 511):
                k_off = cute.crd2idx(((key, d % 16), 0, d // 16), k_outer)
                v_off = cute.crd2idx(((d % HALF_V, key % 16), d // HALF_V, key // 16), v_outer)
                assert k_off == v_off, (key, d, k_off, v_off)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def body(self, loads: TmaLoads, tensors: SplitKVTensors, scale_log2: Float32, qk_mma,
             pv_mma, sQ_layout, sK_layout, sP_layout, sV_layout):
        tma_q, tma_mQ, tma_kv, tma_mKV = loads
        tidx, _, _ = cute.arch.thread_idx()
        m_block, part, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        storage = SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (MMA, 1, 36)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (.., stages)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)  # (MMA, 1, 4)
        # V of each page buffer: the same bytes as sK, stages a page (576 columns) apart.
        sV = cute.make_tensor(
            cute.recast_ptr(storage.sKV.data_ptr(), sV_layout.inner),
            cute.append(sV_layout.outer, cute.make_layout(KV_STAGES, stride=PAGE_SIZE * D_QK)),
        )  # (MMA, 2, 4, stages)

        if warp == MMA_WARP:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_kv)
        thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        softmax_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * SOFTMAX_WARPS)
        kv_pipe = pipeline.PipelineTmaUmma.create(
            num_stages=KV_STAGES, producer_group=thread, consumer_group=thread,
            tx_count=self.tma_bytes_page, barrier_storage=storage.bar_kv.data_ptr(),
            defer_sync=True)
        q_pipe = pipeline.PipelineTmaUmma.create(
            num_stages=1, producer_group=thread, consumer_group=thread,
            tx_count=self.tma_bytes_q, barrier_storage=storage.bar_q.data_ptr(), defer_sync=True)
        s_pipe = pipeline.PipelineUmmaAsync.create(
            num_stages=S_STAGES, producer_group=thread, consumer_group=softmax_threads,
            barrier_storage=storage.bar_s.data_ptr(), defer_sync=True)
        p_pipe = pipeline.PipelineAsyncUmma.create(
            num_stages=1, producer_group=softmax_threads, consumer_group=thread,
            barrier_storage=storage.bar_p.data_ptr(), defer_sync=True)
        o_pipe = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=thread, consumer_group=softmax_threads,
            barrier_storage=storage.bar_o.data_ptr(), defer_sync=True)

        if warp == MMA_WARP:
            cute.arch.alloc_tmem(TMEM_ALLOC, storage.tmem_addr)
            # One CTA per SM (shared memory): nobody else will want this SM's TMEM meanwhile.
            cute.arch.relinquish_tmem_alloc_permit()
        cute.arch.mbarrier_init_fence()
        tcgen05_before_sync()
        cute.arch.sync_threads()
        tcgen05_after_sync()
        # The combine kernel (launched with PDL) may start now: its CTAs wait for this grid to
        # finish before reading what it writes, so they only fill idle warp slots meanwhile.
        cute.arch.griddepcontrol_launch_dependents()
        tmem = cute.arch.retrieve_tmem_ptr(Float32, 16, storage.tmem_addr)
        tOtO = cute.make_tensor(
            tmem + TMEM_O, pv_mma.make_fragment_C(pv_mma.partition_shape_C((BLOCK_M, D_V))).layout
        )  # (MMA, 1, 2): two 64 x 256 halves, interleaved in lanes
        acc_S = qk_mma.make_fragment_C(qk_mma.partition_shape_C((BLOCK_M, PAGE_SIZE))).layout
        tStS = cute.make_tensor(
            tmem + TMEM_S, cute.append(acc_S, cute.make_layout(S_STAGES, stride=TMEM_S_COLS))
        )  # (MMA, 1, 1, stages)

        # Query rows are (s_q, h_q) flattened: row = s * h_q + h.
        walk = splitkv.read_part(tensors.metadata, part)

        if warp == LOAD_WARP:
            self._load(tma_q, tma_mQ, tma_kv, tma_mKV, sQ, sK, qk_mma, q_pipe, kv_pipe,
                       tensors, walk, m_block)
        if warp == MMA_WARP:
            self._mma(qk_mma, pv_mma, sQ, sK, sP, sV, tStS, tOtO, q_pipe, kv_pipe, s_pipe,
                      p_pipe, o_pipe, tensors, walk)
        if warp < SOFTMAX_WARPS:
            self._softmax(tStS, tOtO, sP, storage.sKV.data_ptr(), s_pipe, p_pipe, o_pipe,
                          tensors, scale_log2, walk, m_block, tidx)

        # Every TMEM reader and writer is done: the softmax warps waited for the last MMA (o
        # full) and for their own loads (tcgen05.wait::ld) before arriving here.
        tcgen05_before_sync()
        cute.arch.sync_threads()
        if warp == MMA_WARP:
            tcgen05_after_sync()
            cute.arch.dealloc_tmem(tmem, TMEM_ALLOC)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _segment(self, r: Int32, walk, t: SplitKVTensors):
        """(L, first block, block count) of request r's segment in this part; the count is
        <= 0 when the part holds none of its blocks. The walk stops at the block table's width
        (a length past it is an input error that the op checks on the device)."""
        L = t.seqlens[r]
        pieces = t.num_splits[r + 1] - t.num_splits[r]
        lo, hi = splitkv.segment(walk, r, L, t.block_table.shape[1], pieces)
        return L, lo, hi - lo

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _load(self, tma_q, tma_mQ, tma_kv, tma_mKV, sQ, sK, qk_mma, q_pipe, kv_pipe,
              t: SplitKVTensors, walk, m_block: Int32):
        """Warp 5: Q of each segment, then its pages, as the buffers free up."""
        thr = qk_mma.get_slice(0)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, KV_STAGES)
        policy = cutlass.Int64(L2_EVICT_FIRST)  # each page and Q tile is read once (sm90_decode)
        for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
            L, lo, n = self._segment(r, walk, t)
            if n > 0:
                gQ = cute.local_tile(tma_mQ[None, None, r], (BLOCK_M, D_QK), (m_block, 0))
                tQsQ, tQgQ = cpasync.tma_partition(
                    tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                    cute.group_modes(thr.partition_A(gQ), 0, 3))
                q_pipe.producer_acquire(q_state)
                cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=q_pipe.producer_get_barrier(q_state),
                          cache_policy=policy)
                q_state.advance()
                for i in cutlass.range(n, unroll=1):
                    page = t.block_table[r, lo + i]
                    tKsK, tKgK = cpasync.tma_partition(
                        tma_kv, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                        cute.group_modes(thr.partition_B(tma_mKV[None, None, page]), 0, 3))
                    kv_pipe.producer_acquire(kv_state)
                    cute.copy(tma_kv, tKgK, tKsK[None, kv_state.index],
                              tma_bar_ptr=kv_pipe.producer_get_barrier(kv_state),
                              cache_policy=policy)
                    kv_state.advance()
        # No TMA or commit may still be in flight towards this CTA's barriers when it exits.
        kv_pipe.producer_tail(kv_state)
        q_pipe.producer_tail(q_state)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _mma(self, qk_mma, pv_mma, sQ, sK, sP, sV, tStS, tOtO, q_pipe, kv_pipe, s_pipe, p_pipe,
             o_pipe, t: SplitKVTensors, walk):
        """Warp 4: per segment, S_0; then S_{i+1} before O += P_i V_i; then O is complete."""
        tSrQ = qk_mma.make_fragment_A(sQ)  # (MMA, 1, 36)
        tSrK = qk_mma.make_fragment_B(sK)  # (MMA, 1, 36, stages)
        tOrP = pv_mma.make_fragment_A(sP)  # (MMA, 1, 4)
        tOrV = pv_mma.make_fragment_B(sV)  # (MMA, 2, 4, stages)
        Consumer = pipeline.PipelineUserType.Consumer
        Producer = pipeline.PipelineUserType.Producer
        q_state = pipeline.make_pipeline_state(Consumer, 1)
        kv_state = pipeline.make_pipeline_state(Consumer, KV_STAGES)  # next page for QK^T
        pv_state = pipeline.make_pipeline_state(Consumer, KV_STAGES)  # next page for P V
        s_state = pipeline.make_pipeline_state(Producer, S_STAGES)
        p_state = pipeline.make_pipeline_state(Consumer, 1)
        o_state = pipeline.make_pipeline_state(Producer, 1)
        for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
            L, lo, n = self._segment(r, walk, t)
            if n > 0:
                q_pipe.consumer_wait(q_state)
                for i in cutlass.range(n, unroll=1):
                    kv_pipe.consumer_wait(kv_state)
                    s_pipe.producer_acquire(s_state)
                    tcgen05_after_sync()
                    # A fresh atom per product: its ACCUMULATE field is state the tracer
                    # would otherwise carry out of this loop body.
                    qk = cute.make_mma_atom(qk_mma.op)
                    for k in cutlass.range_constexpr(D_QK // 16):
                        qk.set(tcgen05.Field.ACCUMULATE, k != 0)
                        cute.gemm(qk, tStS[None, None, None, s_state.index],
                                  tSrQ[None, None, k], tSrK[None, None, k, kv_state.index],
                                  tStS[None, None, None, s_state.index])
                    s_pipe.producer_commit(s_state)
                    s_state.advance()
                    kv_state.advance()
                    if i > 0:
                        self._pv(pv_mma, tOrP, tOrV, tOtO, kv_pipe, p_pipe, o_pipe, pv_state,
                                 p_state, o_state, i == 1, i != 1)
                        pv_state.advance()
                        p_state.advance()
                # Q is read by no MMA after this segment's QK^T (the commit covers them all).
                q_pipe.consumer_release(q_state)
                q_state.advance()
                self._pv(pv_mma, tOrP, tOrV, tOtO, kv_pipe, p_pipe, o_pipe, pv_state, p_state,
                         o_state, n == 1, n != 1)
                pv_state.advance()
                p_state.advance()
                o_pipe.producer_commit(o_state)
                o_state.advance()

    @cute.jit
    def _pv(self, pv_mma, tOrP, tOrV, tOtO, kv_pipe, p_pipe, o_pipe, pv_state, p_state,
            o_state, first: Boolean, accumulate: Boolean):
        """O += P V for the page at pv_state (O = P V for a segment's first page, once the
        epilogue of the previous segment has read O); then frees the page and sP."""
        p_pipe.consumer_wait(p_state)
        if first:
            o_pipe.producer_acquire(o_state)
        tcgen05_after_sync()
        pv = cute.make_mma_atom(pv_mma.op)
        for k in cutlass.range_constexpr(PAGE_SIZE // 16):
            if const_expr(k == 0):
                pv.set(tcgen05.Field.ACCUMULATE, accumulate)
            else:
                pv.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(pv, tOtO, tOrP[None, None, k], tOrV[None, None, k, pv_state.index],
                      tOtO)
        kv_pipe.consumer_release(pv_state)
        p_pipe.consumer_release(p_state)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _softmax(self, tStS, tOtO, sP, kv_base, s_pipe, p_pipe, o_pipe, t: SplitKVTensors,
                 scale_log2: Float32, walk, m_block: Int32, tidx: Int32):
        """Warps 0-3: per page, P = softmax numerator of S (masked), O rescaled when needed;
        per segment, the epilogue. Thread (warp w, lane l) owns row 16 w + l % 16 and 32 of the
        64 keys (l // 16 picks which); its partner lane l ^ 16 holds the rest of the row."""
        mNumSplits, mO, mLSE, mOacc, mLSEacc = t.num_splits, t.out, t.lse, t.oacc, t.lseacc
        # S (64 x 64 fp32) -> 32 registers per thread; O is read and written in 64 x 64 chunks
        # with the same thread layout.
        ld_atom = cute.make_copy_atom(tcgen05.Ld16x32bx2Op(tcgen05.Repetition.x32), Float32)
        st_atom = cute.make_copy_atom(tcgen05.St16x32bx2Op(tcgen05.Repetition.x32), Float32)
        s_tile0 = tStS[(None, None), 0, 0, 0]
        ld_S = tcgen05.make_tmem_copy(ld_atom, s_tile0).get_slice(tidx)
        # (row, key) coordinates
        tScS = ld_S.partition_D(cute.make_identity_tensor((BLOCK_M, PAGE_SIZE)))
        rS = cute.make_rmem_tensor(tScS.shape, Float32)
        o_chunks = [
            cute.local_tile(tOtO[(None, None), 0, h], (BLOCK_M, 64), (0, c))
            for h in range(2) for c in range(HALF_V // 64)
        ]  # 8 x (64, 64): d_v columns 64 j .. 64 j + 63 for chunk j
        ld_O = tcgen05.make_tmem_copy(ld_atom, o_chunks[0]).get_slice(tidx)
        st_O = tcgen05.make_tmem_copy(st_atom, o_chunks[0]).get_slice(tidx)
        rO = cute.make_rmem_tensor(tScS.shape, Float32)
        # P (registers) -> sP, 16 bytes per store, in the thread layout of the S load.
        st_P = cute.make_tiled_copy_D(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            tcgen05.make_tmem_copy(ld_atom, s_tile0),
        ).get_slice(tidx)
        sP_mk = cute.composition(sP, cute.make_layout((BLOCK_M, PAGE_SIZE)))  # (row, key) view
        tPsP = st_P.partition_D(sP_mk)
        rP = cute.make_rmem_tensor(tScS.shape, self.dtype)

        row = tScS[0][0]  # this thread's row in the tile
        d_rows = mO.shape[1]
        h_q = mLSE.shape[1]
        s_q = mLSE.shape[2]
        g_row = m_block * BLOCK_M + row
        Consumer = pipeline.PipelineUserType.Consumer
        Producer = pipeline.PipelineUserType.Producer
        s_state = pipeline.make_pipeline_state(Consumer, S_STAGES)
        p_state = pipeline.make_pipeline_state(Producer, 1)
        o_state = pipeline.make_pipeline_state(Consumer, 1)
        kv_count = Int32(0)  # pages this CTA has consumed: the page buffer is kv_count % 2
        for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
            L, lo, n = self._segment(r, walk, t)
            if n > 0:
                # Horizon of this thread's row: keys < border are visible.
                border = softmax.row_border(L, g_row, d_rows, h_q, s_q, self.causal)
                last_blk = (L + PAGE_SIZE - 1) // PAGE_SIZE - 1
                m_ref = -Float32.inf  # the max this row's exponents are taken against
                row_sum = Float32(0.0)  # this thread's half of the row's sum
                for i in cutlass.range(n, unroll=1):
                    blk = lo + i
                    s_pipe.consumer_wait(s_state)
                    tcgen05_after_sync()
                    cute.copy(ld_S, ld_S.partition_S(tStS[(None, None), 0, 0, s_state.index]), rS)
                    cute.arch.fence_view_async_tmem_load()
                    tcgen05_before_sync()
                    s_pipe.consumer_release(s_state)
                    s_state.advance()

                    m_blk = softmax.row_max_masked(rS, tScS, blk * PAGE_SIZE, border)
                    m_blk = cute.arch.fmax(m_blk, cute.arch.shuffle_sync_bfly(m_blk, offset=16))
                    m_blk = m_blk * scale_log2
                    # (scale is 0 while m_ref = -inf)
                    m_new, m_use, scale = softmax.online_max(m_ref, m_blk, RESCALE_LOG2)
                    # O rows are exactly 0 while m_ref = -inf (P was 0): only finite m_ref needs
                    # a rescale, so a segment's first page (O not yet written) never does.
                    rescale = Boolean(False)
                    if m_ref != -Float32.inf:
                        rescale = m_new != m_ref
                    m_ref = m_new
                    part_sum = softmax.exp_row(rS, m_use, scale_log2, rP)
                    row_sum = row_sum * scale + part_sum

                    # P V of the previous page is done: sP is free and O is stable.
                    p_pipe.producer_acquire(p_state)
                    tcgen05_after_sync()
                    if cute.arch.vote_any_sync(rescale):
                        for j in cutlass.range_constexpr(len(o_chunks)):
                            cute.copy(ld_O, ld_O.partition_S(o_chunks[j]), rO)
                            cute.arch.fence_view_async_tmem_load()
                            for k in cutlass.range_constexpr(cute.size(rO)):
                                rO[k] = rO[k] * scale
                            cute.copy(st_O, rO, st_O.partition_D(o_chunks[j]))
                        cute.arch.fence_view_async_tmem_store()
                    if blk == last_blk:
                        if L % PAGE_SIZE != 0:
                            self._zero_v_tail(kv_base, kv_count % KV_STAGES, L % PAGE_SIZE, tidx)
                    cute.copy(st_P, st_P.retile(rP), tPsP)
                    cute.arch.fence_view_async_shared()  # sP and V rows -> the tensor core
                    tcgen05_before_sync()
                    p_pipe.producer_commit(p_state)
                    p_state.advance()
                    kv_count += 1

                # Epilogue: O of this segment is complete once o is full.
                total = row_sum + cute.arch.shuffle_sync_bfly(row_sum, offset=16)
                # A row that saw no key has sum 0: output 0 (and lse +inf below).
                inv = softmax.inv_sum(total)
                split_idx = splitkv.split_index(walk, r)
                slot = mNumSplits[r] + split_idx
                pieces = mNumSplits[r + 1] - mNumSplits[r]
                o_pipe.consumer_wait(o_state)
                tcgen05_after_sync()
                splitkv.store_result(
                    pieces, lambda t, j, dt, inv=inv: self._store_o(
                        ld_O, o_chunks, rO, inv, t[j, None, None], dt, m_block, g_row < d_rows,
                        tidx),
                    mO, mOacc, r, slot, self.dtype)
                tcgen05_before_sync()
                o_pipe.consumer_release(o_state)
                o_state.advance()
                if g_row < d_rows:
                    if tScS[0][1] == 0:  # one thread of the row's pair
                        splitkv.store_lse(mLSE, mLSEacc, r, slot, g_row, pieces, h_q, total,
                                          m_ref)
            else:
                splitkv.empty_segment(walk, r, lo, L, mNumSplits[r + 1] - mNumSplits[r],
                                      mNumSplits[r], mO, mLSE, mLSEacc, m_block * BLOCK_M,
                                      cutlass.min(d_rows - m_block * BLOCK_M, BLOCK_M), h_q,
                                      tidx, 32 * SOFTMAX_WARPS)
        # The last P V's commit must land before this CTA exits.
        p_pipe.producer_tail(p_state)

    @cute.jit
    def _store_o(self, ld_O, o_chunks, rO, inv: Float32, gOut, out_dtype: cutlass.Constexpr,
                 m_block: Int32, row_ok, tidx: Int32):
        """O * inv -> rows [64 m_block, +64) of gOut (rows, 512); each thread writes its 32
        consecutive columns of each 64-column chunk (rows past the problem are skipped)."""
        rOut = cute.make_rmem_tensor(rO.shape, out_dtype)
        for j in cutlass.range_constexpr(len(o_chunks)):
            cute.copy(ld_O, ld_O.partition_S(o_chunks[j]), rO)
            cute.arch.fence_view_async_tmem_load()
            for k in cutlass.range_constexpr(cute.size(rO)):
                rOut[k] = (rO[k] * inv).to(out_dtype)
            if row_ok:
                gChunk = cute.local_tile(gOut, (BLOCK_M, 64), (m_block, j))
                cute.autovec_copy(rOut, ld_O.partition_D(gChunk))

    @cute.jit
    def _zero_v_tail(self, kv_base, stage: Int32, valid: Int32, tidx: Int32):
        """Zeroes keys [valid, 64) of V (columns 0-511) in page buffer `stage`: whole 128-byte
        row pieces of each 64-column chunk, so the swizzle inside a piece does not matter. The
        caller fences these stores towards the tensor core."""
        base = cute.recast_ptr(kv_base + stage * (PAGE_SIZE * D_QK), dtype=Float32)
        words = cute.make_tensor(base, cute.make_layout(PAGE_SIZE * D_V // 2))
        n_words = (PAGE_SIZE - valid) * 32 * (D_V // 64)  # rows x 32 words x 8 column chunks
        for i in cutlass.range(tidx, n_words, 32 * SOFTMAX_WARPS, unroll=1):
            key = valid + i // (32 * (D_V // 64))
            rem = i % (32 * (D_V // 64))
            chunk = rem // 32
            w = rem % 32
            words[chunk * (PAGE_SIZE * 32) + key * 32 + w] = Float32(0.0)


# --- compile entry (ops/registry.py: DecodeStepConfig / DecodeConfig, backend "sm100") --------


def decode_kernel(config, arch: str):
    """The SM100 decode kernel a registry config asks for (dtype, causal); arch is sm_100a."""
    from ..contract import dsl_dtype

    return MLADecodeSm100(dsl_dtype(config.dtype), config.causal)
