"""DeepSeek Sparse Attention's lightning indexer on Hopper (SM90): the logits that top-k reads.

Problem (DeepSeek-V3.2's indexer, one decode step): for request r with L_r cached index keys
(one D-wide key a token, D = 128 in V3.2) and query token t < s_q of H index heads,
    logits[r, t, j] = sum_h w[r, t, h] * relu(q[r, t, h] . k_j)   (* scale_j for an e4m3 cache)
for keys j < L_r - s_q + t + 1 (causal: the step's own tokens are the last s_q of the L_r), and
-inf for every other j up to the output's width.

Mapping onto the MMA: keys on its M side. A CTA computes, per cache page of 64 keys,
    S^T [64 keys, N = s_q * H] = K_page [64 x D] (A, shared memory, K-major, as TMA lands it)
                                 x Q^T [D x N]   (B, shared memory, K-major: Q is stored [N, D])
with one wgmma chain (m64 nN, k16 steps in bf16, k32 in e4m3). Column n of S^T is head n % H of
query token n // H, so a thread's accumulator fragment holds, for its two key rows, columns
8 j + 2 q + {0, 1} (q = lane % 4); H a multiple of 8 puts each 8-column group j in one token.
The weighted sum over heads is then relu and an FMA per value (weights from shared memory) and a
quad shuffle: the reduction runs along N, inside the fragment. A key's row holds only that key's
products, so a NaN in a cache row past L (the last page's tail) stays in that row, which the
mask replaces with -inf. For e4m3, relu(scale_j x) = scale_j relu(x) since the per-token scales
are >= 0 (amax / 448 quantization scales): the row's sum is scaled once.

Work split: grid (chunks, b): CTA (c, r) takes pages [c * pages_per_cta, +pages_per_cta) of
request r's output row (pages_per_cta: a runtime argument, IndexerSplit.from_heuristic in
torch_mla/scheduling.py). Pages at or past ceil(L_r / 64) are never read (their block-table
entries may be garbage): the CTA writes -inf there. The kernel is memory-bound (each key is read
once: b * L * D bytes, against s_q * 4 bytes of output a key), so the grid has many small CTAs,
two resident per SM (shared memory <= 113 KB each), whose prologues and tails overlap.

CTA: 256 threads = two consumer warpgroups, no producer warp. Pages alternate between them
(page i of the CTA: warpgroup i % 2), each with one accumulator; while one warpgroup runs its
relu-weight-reduce epilogue the other's wgmma (and the other CTA's) keeps the tensor cores busy.
Pipeline: STAGES page buffers (even: warpgroup w owns the stages of its parity), each with a
full mbarrier (TMA transaction bytes: the page, and for e4m3 its 64 scales). Warp 0 loads Q and
the first STAGES pages (block ids read lane-parallel); afterwards the warpgroup that has consumed
page i (its wgmma done, a warpgroup barrier) issues the TMA of page i + STAGES into the same
buffer, its block id read at the start of the iteration, before the wait. Cache pages are loaded
with L2 evict_first (read once); Q with the default policy (every CTA of the request reads it).

Output: each quad's reduced value for (key row, token) is stored by one of its lanes (8
consecutive keys a warp store); rows past the output's width are skipped.

Limits: bf16 or float8_e4m3fn q and cache (both the same), D 64 or 128, H a multiple of 8 with
s_q * H <= 128 (one accumulator of s_q * H / 2 registers a thread; V3.2: H 64, s_q 1 or 2),
pages of 64 tokens, weights fp32 (for e4m3 the caller folds q's scale into them), any batch,
cache size, block-table width and output width (a multiple of 64 is the contract; any width is
written correctly). Compiled per (dtype, D, H, s_q); the rest are runtime sizes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..constants import PAGE_SIZE
from ..contract import indexer_unsupported
from .ptx import L2_EVICT_FIRST, fence_operand
from .softmax import row_sum_quad

# Shared memory for the page buffers: ~64 KB, with Q (<= 32 KB) under half the SM's 227 KB, so
# two CTAs share an SM (bf16 D 128: 4 stages; e4m3 D 128 and bf16 D 64: 8; e4m3 D 64: 16).
# 2 CTAs x 64 KB in flight cover an SM's share of HBM bandwidth (~17.5 B/cycle) over several
# microseconds of latency.
STAGE_BYTES = 64 * 1024
SCALE_BYTES = PAGE_SIZE * 4  # an e4m3 page's fp32 scales
NB_WG = 1  # named barriers 1 and 2: warpgroup 0's and 1's (0 is __syncthreads)


def can_implement(fp8: bool, head_dim: int, heads: int, s_q: int) -> bool:
    """The problems the kernel takes (either cache format; contract.indexer_unsupported)."""
    return indexer_unsupported(head_dim, heads, s_q) is None


def num_stages(fp8: bool, head_dim: int) -> int:
    """Page buffers: STAGE_BYTES worth, an even number (the two warpgroups' stages alternate)."""
    page = PAGE_SIZE * head_dim * (1 if fp8 else 2)
    return max(4, min(16, STAGE_BYTES // page)) // 2 * 2


class IndexerLogitsSm90:
    """The indexer's logits on SM90; see the module docstring for the algorithm."""

    num_threads = 256

    def __init__(self, fp8: bool, head_dim: int, heads: int, s_q: int):
        assert can_implement(fp8, head_dim, heads, s_q), (fp8, head_dim, heads, s_q)
        self.fp8 = bool(fp8)
        self.dtype = cutlass.Float8E4M3FN if self.fp8 else cutlass.BFloat16
        self.d = head_dim
        self.heads = heads
        self.s_q = s_q
        self.n = heads * s_q  # the MMA's N: (token, head) columns
        self.stages = num_stages(self.fp8, head_dim)
        self.elem_bytes = 1 if self.fp8 else 2
        self.page_bytes = PAGE_SIZE * head_dim * self.elem_bytes
        # Transaction bytes of one stage: the page, and for e4m3 its scales.
        self.stage_tx = self.page_bytes + (SCALE_BYTES if self.fp8 else 0)

    # ------------------------------------------------------------------------------------------
    # host side: layouts, TMA descriptors, launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q * H, D) bf16, or uint8 (e4m3 bytes); rows 16-byte aligned
        mW: cute.Tensor,  # (b, s_q * H) fp32
        mK: cute.Tensor,  # (num_blocks, 64, D) like q; rows 16-byte aligned
        mBlockTable: cute.Tensor,  # (b, max_blocks) int32
        mSeqlens: cute.Tensor,  # (b,) int32, this step's tokens included
        mOut: cute.Tensor,  # (b, s_q, max_len) fp32
        pages_per_cta: Int32,
        stream,
        mKScale: cute.Tensor = None,  # e4m3: (num_blocks, 64) fp32, rows 16-byte aligned
    ):
        dt = self.dtype
        D, N, S = self.d, self.n, self.stages
        k_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, dt, D), dt)
        sK_layout = cute.tile_to_shape(k_atom, (PAGE_SIZE, D, S), order=(0, 1, 2))
        page_layout = cute.tile_to_shape(k_atom, (PAGE_SIZE, D), order=(0, 1))
        sQ_layout = cute.tile_to_shape(k_atom, (N, D), order=(0, 1))
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (1, 1, 1), (PAGE_SIZE, N))

        # TMA views: Q as (N, D, b), the cache as (64 keys, D, pages), scales as (64, pages).
        # (A box row is at most the 128-byte swizzle row: bf16 D 128 takes two boxes a tile.)
        op = cpasync.CopyBulkTensorTileG2SOp()
        mQ_t = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        mK_t = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[1, 2, 0]))
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(op, mQ_t, sQ_layout, (N, D))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(op, mK_t, page_layout, (PAGE_SIZE, D))
        tma_s = tma_mS = None
        if const_expr(self.fp8):
            # (64 scales, pages): one 256-byte box a page
            mS_t = cute.make_tensor(mKScale.iterator,
                                    cute.select(mKScale.layout, mode=[1, 0]))
            tma_s, tma_mS = cpasync.make_tiled_tma_atom(
                op, mS_t, cute.make_layout((PAGE_SIZE, 1)), (PAGE_SIZE, 1))

        # e4m3 buffers hold the bytes TMA moves (q and the cache come as uint8); the MMAs read
        # them as e4m3.
        store = cutlass.Uint8 if self.fp8 else dt
        fields = dict(
            sQ=cute.struct.Align[cute.struct.MemRange[store, N * D], 1024],
            sK=cute.struct.Align[cute.struct.MemRange[store, PAGE_SIZE * D * S], 1024],
            sW=cute.struct.MemRange[Float32, N],
            barFull=cute.struct.MemRange[cutlass.Int64, S],
            barQ=cute.struct.MemRange[cutlass.Int64, 1],
        )
        if const_expr(self.fp8):
            fields["sScale"] = cute.struct.Align[cute.struct.MemRange[Float32, PAGE_SIZE * S],
                                                 128]
        self.shared_storage = cute.struct(
            type("SharedStorage", (), {"__annotations__": fields}))
        size = self.shared_storage.size_in_bytes()
        assert size <= 113 * 1024, size  # two CTAs an SM

        n_out_pages = (mOut.shape[2] + PAGE_SIZE - 1) // PAGE_SIZE
        self.kernel(
            tma_q, tma_mQ, tma_k, tma_mK, tma_s, tma_mS, mW, mBlockTable, mSeqlens, mOut,
            pages_per_cta, sQ_layout, sK_layout, tiled_mma,
        ).launch(
            grid=[(n_out_pages + pages_per_cta - 1) // pages_per_cta, mOut.shape[0], 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            # Two CTAs an SM: registers for both (<= 128 a thread), and all of the shared
            # memory carve-out (percent) so that both fit.
            min_blocks_per_mp=2,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(
        self,
        tma_q: cute.CopyAtom, tma_mQ: cute.Tensor,  # (TMA atom, its coordinate tensor) pairs
        tma_k: cute.CopyAtom, tma_mK: cute.Tensor,
        tma_s, tma_mS,  # e4m3: the scales (None for bf16)
        mW: cute.Tensor,
        mBlockTable: cute.Tensor,
        mSeqlens: cute.Tensor,
        mOut: cute.Tensor,
        pages_per_cta: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ):
        S, N = self.stages, self.n
        tidx, _, _ = cute.arch.thread_idx()
        chunk, r, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wtid = tidx % 128
        warp_in_wg = cute.arch.make_warp_uniform((tidx // 32) % 4)
        lane = tidx % 32

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sw = sQ_layout.inner
        q_base, k_base = storage.sQ.data_ptr(), storage.sK.data_ptr()
        # TMA writes the buffers in its element type (e4m3: bytes), the MMAs read dtype.
        sQ = cute.make_tensor(cute.recast_ptr(q_base, sw), sQ_layout.outer)
        sK = cute.make_tensor(cute.recast_ptr(k_base, sw), sK_layout.outer)
        sQ_mma = cute.make_tensor(cute.recast_ptr(q_base, sw, dtype=self.dtype), sQ_layout.outer)
        sK_mma = cute.make_tensor(cute.recast_ptr(k_base, sw, dtype=self.dtype), sK_layout.outer)
        sW = storage.sW.get_tensor(cute.make_layout(N))
        barFull = storage.barFull.data_ptr()
        barQ = storage.barQ.data_ptr()
        sScale = None
        if const_expr(self.fp8):
            sScale = storage.sScale.get_tensor(cute.make_layout((PAGE_SIZE, 1, S),
                                                                stride=(1, 0, PAGE_SIZE)))

        # This CTA's pages of the output row, and of them the ones that hold keys (read).
        L = mSeqlens[r]
        max_len = mOut.shape[2]
        first = chunk * pages_per_cta
        end = cutlass.min(first + pages_per_cta, (max_len + PAGE_SIZE - 1) // PAGE_SIZE)
        n_key_pages = cutlass.min((cutlass.max(L, 0) + PAGE_SIZE - 1) // PAGE_SIZE,
                                  mBlockTable.shape[1])
        n = cutlass.max(cutlass.min(end, n_key_pages) - first, 0)  # pages to read
        last_col = mBlockTable.shape[1] - 1

        if tidx == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            if const_expr(self.fp8):
                cpasync.prefetch_descriptor(tma_s)
            for s in cutlass.range_constexpr(S):
                cute.arch.mbarrier_init(barFull + s, 1)
            cute.arch.mbarrier_init(barQ, 1)
        if tidx < N:
            sW[tidx] = mW[r, tidx]
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # TMA partitions: Q (N x D), and page tiles (64 x D) of the cache into the S buffers.
        gQ = cute.local_tile(tma_mQ[None, None, r], (N, self.d), (0, 0))
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        gK = cute.local_tile(tma_mK, (PAGE_SIZE, self.d), (0, 0, None))  # (64, D, pages)
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                           cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tSsS = tSgS = None
        if const_expr(self.fp8):
            gS = cute.local_tile(tma_mS, (PAGE_SIZE, 1), (0, None))  # (64, 1, pages)
            tSsS, tSgS = cpasync.tma_partition(tma_s, 0, cute.make_layout(1),
                                               cute.group_modes(sScale, 0, 2),
                                               cute.group_modes(gS, 0, 2))
        load = (tma_k, tKgK, tKsK, tma_s, tSgS, tSsS, barFull)

        if tidx < 32:
            if n > 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(barQ, N * self.d * self.elem_bytes)
                cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=barQ)
                # The first S pages: their block ids read at once, one a lane.
                ids = mBlockTable[r, cutlass.min(first + lane, last_col)]
                for i in cutlass.range(cutlass.min(n, S), unroll=1):
                    self._load_page(load, cute.arch.shuffle_sync(ids, i), i)

        # MMA partitions (per warpgroup): A = the page buffers, B = Q.
        thr_mma = tiled_mma.get_slice(wtid)
        tCrK = thr_mma.make_fragment_A(thr_mma.partition_A(sK_mma))  # (MMA, 1, k-steps, S)
        tCrQ = thr_mma.make_fragment_B(thr_mma.partition_B(sQ_mma))  # (MMA, 1, k-steps)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((PAGE_SIZE, N)), Float32)
        mma_atom = cute.make_mma_atom(tiled_mma.op)

        # Accumulator rows (keys of the page) this thread holds: r0 and r0 + 8; columns
        # 8 j + c0 + {0, 1} (element c + 2 h + 4 j: row r0 + 8 h, column 8 j + c0 + c).
        r0 = warp_in_wg * 16 + lane // 4
        c0 = lane % 4 * 2

        count = (n - wg + 1) // 2  # this warpgroup's pages: i = 2 k + wg
        if count > 0:
            cute.arch.mbarrier_wait(barQ, 0)
        for k in cutlass.range(count, unroll=1):
            i = 2 * k + wg
            stage = i % S
            # The block id of the page that refills this stage, read before the waits.
            next_page = mBlockTable[r, cutlass.min(first + i + S, last_col)]
            cute.arch.mbarrier_wait(barFull + stage, (i // S) % 2)
            scale = [Float32(1.0), Float32(1.0)]
            if const_expr(self.fp8):
                # (read before the stage is released: the refill overwrites them)
                scale = [sScale[r0, 0, stage], sScale[r0 + 8, 0, stage]]

            fence_operand(acc)
            warpgroup.fence()
            for kk in cutlass.range_constexpr(cute.size(tCrK, mode=[2])):
                mma_atom.set(warpgroup.Field.ACCUMULATE, kk != 0)
                cute.gemm(mma_atom, acc, tCrK[None, None, kk, stage], tCrQ[None, None, kk], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            fence_operand(acc)

            # Every warp of this warpgroup is done reading the stage: refill it.
            cute.arch.barrier(barrier_id=NB_WG + wg, number_of_threads=128)
            if warp_in_wg == 0:
                if i + S < n:
                    self._load_page(load, next_page, stage)
            self._epilogue(acc, sW, scale, mOut, r, (first + i) * PAGE_SIZE + r0, L, max_len,
                           c0)

        # Pages of the output row past the keys: -inf, written by all 256 threads.
        key0 = (first + n) * PAGE_SIZE
        span = cutlass.max(cutlass.min(end * PAGE_SIZE, max_len) - key0, 0)
        for e in cutlass.range(tidx, span * self.s_q, self.num_threads, unroll=1):
            mOut[r, e // span, key0 + e % span] = -Float32.inf

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _load_page(self, load, page: Int32, stage: Int32):
        """One warp: TMA of cache page `page` (and its scales) into buffer `stage`."""
        tma_k, tKgK, tKsK, tma_s, tSgS, tSsS, barFull = load
        bar = barFull + stage
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.stage_tx)
        cute.copy(tma_k, tKgK[None, page], tKsK[None, stage], tma_bar_ptr=bar,
                  cache_policy=cutlass.Int64(L2_EVICT_FIRST))
        if const_expr(self.fp8):
            cute.copy(tma_s, tSgS[None, page], tSsS[None, stage], tma_bar_ptr=bar,
                      cache_policy=cutlass.Int64(L2_EVICT_FIRST))

    @cute.jit
    def _epilogue(self, acc, sW, scale, mOut, r: Int32, key_r0: Int32, L: Int32,
                  max_len: Int32, c0: Int32):
        """For this thread's key rows key_r0 and key_r0 + 8 and each token t: the weighted sum
        of relu over the token's H columns (this thread's 2 of every 8, then the quad), times
        the key's scale; -inf past the token's causal horizon L - s_q + t + 1; stored by lane
        (2 t + h) % 4 of the quad."""
        groups = self.heads // 8  # 8-column groups a token
        q4 = c0 // 2
        for t in cutlass.range_constexpr(self.s_q):
            part = [Float32(0.0), Float32(0.0)]
            for jj in cutlass.range_constexpr(groups):
                j = t * groups + jj
                w = [sW[8 * j + c0], sW[8 * j + c0 + 1]]
                for h in cutlass.range_constexpr(2):
                    for c in cutlass.range_constexpr(2):
                        x = cute.arch.fmax(acc[c + 2 * h + 4 * j], Float32(0.0))
                        part[h] = part[h] + x * w[c]
            border = L - self.s_q + t + 1
            for h in cutlass.range_constexpr(2):
                total = row_sum_quad(part[h]) * scale[h]
                key = key_r0 + 8 * h
                if q4 == (2 * t + h) % 4:
                    if key < max_len:
                        mOut[r, t, key] = cutlass.select_(key < border, total, -Float32.inf)


# --- compile entry (ops/registry.py: IndexerConfig) -------------------------------------------


def compile_indexer(config, arch: str):
    """The indexer kernel of an IndexerConfig (dtype "bf16" or "e4m3", head_dim, heads, s_q),
    compiled for arch (sm_90a)."""
    from ..contract import compile_indexer_kernel

    fp8 = config.dtype == "e4m3"
    kernel = IndexerLogitsSm90(fp8, config.head_dim, config.heads, config.s_q)
    return compile_indexer_kernel(kernel, fp8, config.head_dim, config.heads * config.s_q,
                                  config.s_q, arch)
