"""Merges split-KV partial results of MLA decode (any architecture from SM80 up).

A request cut into k > 1 pieces has, per query row, k partial outputs O_i (fp32, already divided by
their own softmax sums) and log2-domain log-sum-exps lse_i. The merged result is
    lse = log2(sum_i 2^lse_i),   O = sum_i 2^(lse_i - lse) O_i,
written in the output dtype, with the natural-log lse. Pieces that saw no key have lse_i = -inf
and weight 0; a row with no key at all gets O = 0 and lse = +inf. Requests done in one piece were
written by the decode kernel and are skipped; requests with no key (k = 0) are written here.

Grid: (batch, ceil(rows / 4)); 128 threads, one warp per query row, each lane owning 16 of the
512 output columns (four 16-byte loads per piece).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

ROWS_PER_CTA = 4
LN_2 = math.log(2.0)


class MLACombine:
    """Split-KV combine; compiled per (dtype, d_v); batch, s_q and h_q are runtime values."""

    def __init__(self, dtype, d_v: int = 512):
        assert d_v % 32 == 0, d_v
        self.dtype = dtype
        self.d_v = d_v
        self.cols_per_lane = d_v // 32

    @cute.jit
    def __call__(
        self,
        mNumSplits: cute.Tensor,  # (b + 1,) int32
        mOacc: cute.Tensor,  # (slots, rows, d_v) fp32
        mLSEacc: cute.Tensor,  # (slots, rows) fp32, log2 domain
        mO: cute.Tensor,  # (b, rows, d_v)
        mLSE: cute.Tensor,  # (b, h_q, s_q) fp32, natural log
        stream,
    ):
        b, rows = mO.shape[0], mO.shape[1]
        self.kernel(mNumSplits, mOacc, mLSEacc, mO, mLSE).launch(
            grid=[b, (rows + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1],
            block=[32 * ROWS_PER_CTA, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mNumSplits, mOacc, mLSEacc, mO, mLSE):
        tidx, _, _ = cute.arch.thread_idx()
        r, rb, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = rb * ROWS_PER_CTA + tidx // 32
        start = mNumSplits[r]
        count = mNumSplits[r + 1] - start
        h_q = mLSE.shape[1]
        if row < mO.shape[1]:
            if count != 1:
                n = self.cols_per_lane
                acc = cute.make_rmem_tensor(n, Float32)
                acc.fill(0.0)
                lse_out = Float32.inf
                if count > 1:
                    mx = -Float32.inf
                    for i in cutlass.range(lane, count, 32, unroll=1):
                        mx = cute.arch.fmax(mx, mLSEacc[start + i, row])
                    mx = cute.arch.warp_reduction_max(mx)
                    if mx != -Float32.inf:
                        total = Float32(0.0)
                        for i in cutlass.range(lane, count, 32, unroll=1):
                            total += cute.math.exp2(mLSEacc[start + i, row] - mx, fastmath=True)
                        total = cute.arch.warp_reduction_sum(total)
                        lse2 = cute.math.log2(total, fastmath=False) + mx
                        lse_out = lse2 * LN_2
                        for i in cutlass.range(count, unroll=1):
                            w = cute.math.exp2(mLSEacc[start + i, row] - lse2, fastmath=True)
                            src = cute.local_tile(mOacc[start + i, row, None], (n,), (lane,))
                            acc.store(acc.load() + w * src.load())
                dst = cute.local_tile(mO[r, row, None], (n,), (lane,))
                dst.store(acc.load().to(self.dtype))
                if lane == 0:
                    mLSE[r, row % h_q, row // h_q] = lse_out
