"""Merges split-KV partial results of MLA decode (any architecture from SM80 up).

A request cut into k > 1 pieces has, per query row, k partial outputs O_i (fp32, already divided by
their own softmax sums) and log2-domain log-sum-exps lse_i. The merged result is
    lse = log2(sum_i 2^lse_i),   O = sum_i 2^(lse_i - lse) O_i,
written in the output dtype, with the natural-log lse. Pieces that saw no key have lse_i = -inf
and weight 0; a row with no key at all gets O = 0 and lse = +inf. Requests done in one piece were
written by the decode kernel and are skipped; requests with no key (k = 0) are written here.

It also checks the inputs of the step for every kernel that shares it: request r's length lies in
[0, width x 64] and the block-table entries it uses are pages of the cache, else it prints which
entry is wrong and stops the launch (check_request). Inside CUDA graphs too. The CTAs run it
before they wait for the decode kernel, but a decode kernel that fills every SM leaves them no
room until it ends, so its round trips can add to the step: first_outside batches its loads
(sparse decode's 2048 entries a token: ~8 us under ncu, 30 us unbatched; session 26).
A schedule made for other lengths stops the launch too (check_pieces): a piece whose lse is +inf
(the decode kernel found it past its request's end, splitkv.empty_segment), or a request with
keys that the schedule gave no piece.

Grid: (batch, rows / rows-per-CTA), CTAs of 4 warps (16 with 16 warps per row). A row is merged
by one warp (many short requests: few pieces each) or by 4 or 16 warps, which split the pieces
and add their sums through shared memory (few long requests cut into many pieces, e.g. batch 1:
~60 pieces per row).
Lane j loads lse of piece j (32 pieces at a time) and the warp reduces them with shuffles, so a
row costs two dependent global round trips (its lse values, then its partial rows); each lane
owns 4 x 4 output columns (16-byte loads, the warp reads 512 contiguous bytes per load) and the
loop over pieces is unrolled so that several pieces are in flight. Launched with programmatic
dependent launch: the decode kernel lets it start early, and a row waits for the decode kernel
only once it knows that it has something to merge. Before sm_90 (no griddepcontrol) it is
compiled with use_pdl=False and launched after the decode kernel as usual.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..constants import LN_2, PAGE_SIZE
from .device_error import fail

UNROLL = 4
# (Removed in session 49, their A/Bs lost: CHUNK, the merge's pieces 4 or 8 a step with no
# branch between them, 0.9 us faster at b 2 and 4-12 us slower at b 32 (session 35); MIN_CTAS,
# two CTAs an SM of the 16-warp variant by .minnctapersm, spilling (session 36): the (16, 2)
# variant reaches two CTAs an SM without it. Figures: docs/benchmarks-h100.md.)
NO_COLUMN = 1 << 30  # larger than any block-table width


class MLACombine:
    """Split-KV combine; compiled per (dtype, d_v, warps_per_row, unroll); batch, s_q and h_q
    are runtime values. warps_per_row: 1, 4 or 16 warps merge one row (see the module
    docstring); unroll: a warp's pieces loaded at once (their registers: 16 warps a row at 4
    take 80 a thread, one CTA an SM, at 2 59, two); use_pdl: launched as a programmatic
    dependent of the decode kernel (sm_90 and later)."""

    def __init__(self, dtype, d_v: int = 512, warps_per_row: int = 1, use_pdl: bool = True,
                 unroll: int = UNROLL):
        assert d_v % 128 == 0, d_v
        assert warps_per_row in (1, 4, 16), warps_per_row
        self.unroll = unroll
        self.dtype = dtype
        self.d_v = d_v
        self.n_vec = d_v // 128  # 16-byte vectors per lane
        self.wpr = warps_per_row
        self.warps = max(4, warps_per_row)
        self.rows_per_cta = self.warps // warps_per_row
        self.use_pdl = bool(use_pdl)

    @cute.jit
    def __call__(
        self,
        mNumSplits: cute.Tensor,  # (b + 1,) int32
        mOacc: cute.Tensor,  # (slots, rows, d_v) fp32
        mLSEacc: cute.Tensor,  # (slots, rows) fp32, log2 domain
        mO: cute.Tensor,  # (b, rows, d_v)
        mLSE: cute.Tensor,  # (b, h_q, s_q) fp32, natural log
        mBlockTable: cute.Tensor,  # (b, max_blocks) int32: checked, never used
        mSeqlens: cute.Tensor,  # (b,) int32: checked
        num_pages: Int32,  # pages of the cache the decode kernel read
        stream,
    ):
        b, rows = cute.size(mO, mode=[0]), mO.shape[1]  # (mode 0 may be nested: sparse)
        self.kernel(mNumSplits, mOacc, mLSEacc, mO, mLSE, mBlockTable, mSeqlens,
                    num_pages).launch(
            grid=[b, (rows + self.rows_per_cta - 1) // self.rows_per_cta, 1],
            block=[32 * self.warps, 1, 1], stream=stream, use_pdl=self.use_pdl,
        )

    @cute.kernel
    def kernel(self, mNumSplits, mOacc, mLSEacc, mO, mLSE, mBlockTable, mSeqlens, num_pages):
        tidx, _, _ = cute.arch.thread_idx()
        r, row_block, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        if row_block == 0 and warp == 0:
            self.check_request(mBlockTable, mSeqlens, num_pages, r, lane)
        row = row_block * self.rows_per_cta + warp // self.wpr
        part = warp % self.wpr  # this warp takes pieces part, part + wpr, ...
        start = mNumSplits[r]  # written before the decode kernel ran: safe before the wait
        count = mNumSplits[r + 1] - start
        sAcc = None
        if const_expr(self.wpr > 1):
            sAcc = cute.make_tensor(cute.arch.alloc_smem(Float32, self.warps * self.d_v, 16),
                                    cute.make_layout((self.d_v, self.warps)))
        if row < mO.shape[1] and count != 1:
            if const_expr(self.use_pdl):
                cute.arch.griddepcontrol_wait()  # the decode kernel's partials are complete
            acc = [cute.make_rmem_tensor(4, Float32) for _ in range(self.n_vec)]
            for k in cutlass.range_constexpr(self.n_vec):
                acc[k].fill(0.0)
            lse_out = Float32.inf
            mx = -Float32.inf
            for c in cutlass.range(0, count, 32, unroll=1):
                if c + lane < count:
                    mx = cute.arch.fmax(mx, mLSEacc[start + c + lane, row])
            mx = cute.arch.warp_reduction_max(mx)
            # (lse +inf: a piece past the request's end, splitkv.empty_segment; no piece at all
            # for a request with keys: the schedule saw it empty.)
            bad = mx == Float32.inf
            if count == 0:
                if mSeqlens[r] > 0:
                    bad = cutlass.Boolean(True)
            if mx != -Float32.inf:
                total = Float32(0.0)
                for c in cutlass.range(0, count, 32, unroll=1):
                    if c + lane < count:
                        total += cute.math.exp2(mLSEacc[start + c + lane, row] - mx,
                                                fastmath=True)
                total = cute.arch.warp_reduction_sum(total)
                lse2 = cute.math.log2(total, fastmath=False) + mx
                lse_out = lse2 * LN_2
                for c in cutlass.range(0, count, 32, unroll=1):
                    w = Float32(0.0)
                    if c + lane < count:
                        w = cute.math.exp2(mLSEacc[start + c + lane, row] - lse2, fastmath=True)
                    n = cutlass.min(count - c, 32)
                    for j in cutlass.range(part, n, self.wpr, unroll=self.unroll):
                        wj = cute.arch.shuffle_sync(w, j)
                        for k in cutlass.range_constexpr(self.n_vec):
                            src = cute.local_tile(mOacc[start + c + j, row, None], (4,),
                                                  (lane + 32 * k,))
                            acc[k].store(acc[k].load() + wj * src.load())
            if const_expr(self.wpr > 1):
                # Every warp of the CTA is here (the row and count are the CTA's).
                for k in cutlass.range_constexpr(self.n_vec):
                    for e in cutlass.range_constexpr(4):
                        sAcc[4 * (lane + 32 * k) + e, part] = acc[k][e]
                cute.arch.sync_threads()
            if part == 0:
                for k in cutlass.range_constexpr(self.n_vec):
                    if const_expr(self.wpr > 1):
                        for e in cutlass.range_constexpr(4):
                            col = 4 * (lane + 32 * k) + e
                            v = sAcc[col, 0]
                            for w in cutlass.range_constexpr(1, self.wpr):
                                v += sAcc[col, w]
                            acc[k][e] = v
                    dst = cute.local_tile(mO[r, row, None], (4,), (lane + 32 * k,))
                    dst.store(acc[k].load().to(self.dtype))
                if lane == 0:
                    h_q = mLSE.shape[1]
                    mLSE[r, row % h_q, row // h_q] = lse_out
            # Reported after the row is stored: the message's call then keeps no accumulator
            # alive across it (the call site inside the merge cost ~0.7 us at b 8, docs/log.md).
            if bad:
                self.check_pieces(mSeqlens, r, row, count, lane, part)
        if const_expr(self.use_pdl):
            if r == 0 and row_block == 0:
                # Rows of unsplit requests return at once, so this grid could end before the
                # decode kernel: one CTA waits for it, and the grid's completion (which later
                # kernels in the stream wait for) then implies the decode kernel's.
                cute.arch.griddepcontrol_wait()

    @cute.jit
    def check_pieces(self, mSeqlens, r: Int32, row: Int32, count: Int32, lane: Int32,
                     part: Int32):
        """The schedule was made for other lengths: a piece of request r holds lse +inf (the
        decode kernel found it past the request's end, splitkv.empty_segment), or the request
        has keys but no piece (the schedule saw it empty). The message comes once, from row
        0; the launch stops."""
        if row == 0 and part == 0 and lane == 0:
            fail("torch_mla.mla_decode: the schedule cuts request {} into {} pieces, which do "
                 "not fit its cache_seqlens ({} tokens) now: it was computed for other "
                 "lengths; compute it again with torch_mla.get_decode_schedule", r, count,
                 mSeqlens[r])

    @cute.jit
    def check_request(self, mBlockTable, mSeqlens, num_pages: Int32, r: Int32, lane: Int32):
        """One warp: request r's length is in [0, width x 64] and the block-table entries it
        uses are pages of the cache; else a message naming the entry, and the launch stops.

        The decode kernels read nothing outside the cache or the table whatever these hold (TMA
        zero-fills pages past the cache; walks stop at the table's width), but the result would
        be wrong: the error is reported here rather than there because a printf is a function
        call, and ptxas serialises every wgmma of a kernel that contains one (the SM90 decode
        went 2.5x slower with checks inside). Here it costs a few loads per request, issued
        before this grid waits for the decode kernel (PDL), so they overlap its tail."""
        L = mSeqlens[r]
        width = mBlockTable.shape[1]
        if L < 0 or L > width * PAGE_SIZE:
            if lane == 0:
                fail("torch_mla.mla_decode: cache_seqlens[{}] = {}, but lengths must be in "
                     "[0, {}] (block_table's width {} x {} tokens)", r, L, width * PAGE_SIZE, width,
                     PAGE_SIZE)
        n = (L + PAGE_SIZE - 1) // PAGE_SIZE
        first = first_outside(mBlockTable[r, None], n, 0, num_pages, lane)
        if first != NO_COLUMN:
            if lane == 0:
                fail("torch_mla.mla_decode: block_table[{}, {}] = {} is not a page of kv_cache "
                     "(num_blocks = {}): request {} has {} tokens, so its first {} entries must "
                     "be page ids in [0, {})", r, first, mBlockTable[r, first], num_pages, r, L,
                     n, num_pages)


@cute.jit
def first_outside(row: cute.Tensor, n: Int32, low: Int32, high: Int32, lane: Int32,
                  batch: cutlass.Constexpr[int] = 1) -> Int32:
    """One warp (lane 0..31): the first column c < n of row whose value is outside
    [low, high), in every lane; NO_COLUMN if none is.

    A lane loads `batch` values before it compares any, so a round trip to memory covers
    32 x batch columns (columns past n read column n - 1 again, which changes no answer). A
    loop that compared each value before the next load took one round trip per 32 columns:
    ~30 us for the 2048 entries of a sparse decode row (docs/kernels/sparse.md, session 26)."""
    first = Int32(NO_COLUMN)
    last = n - 1
    for c in cutlass.range(0, n, 32 * batch, unroll=1):
        cols, vals = [], []
        for u in cutlass.range_constexpr(batch):
            cols.append(cutlass.min(c + 32 * u + lane, last))
            vals.append(row[cols[u]])
        for u in cutlass.range_constexpr(batch):
            if vals[u] < low or vals[u] >= high:
                first = cutlass.min(first, cols[u])
    return cute.arch.warp_reduction_max(first, op=lambda a, b: cutlass.min(a, b))


# --- compile entry (ops/registry.py: CombineKernelConfig) -------------------------------------


def compile_combine(config, arch: str):
    """The combine alone (dtype, warps_per_row, unroll), compiled for arch."""
    from ..constants import D_V
    from ..contract import compile_combine_kernel, dsl_dtype, has_pdl

    dtype = dsl_dtype(config.dtype)
    return compile_combine_kernel(MLACombine(dtype, D_V, config.warps_per_row,
                                             use_pdl=has_pdl(arch), unroll=config.unroll),
                                  dtype, arch)
