"""Merges split-KV partial results of MLA decode (any architecture from SM80 up).

A request cut into k > 1 pieces has, per query row, k partial outputs O_i (fp32, already divided by
their own softmax sums) and log2-domain log-sum-exps lse_i. The merged result is
    lse = log2(sum_i 2^lse_i),   O = sum_i 2^(lse_i - lse) O_i,
written in the output dtype, with the natural-log lse. Pieces that saw no key have lse_i = -inf
and weight 0; a row with no key at all gets O = 0 and lse = +inf. Requests done in one piece were
written by the decode kernel and are skipped; requests with no key (k = 0) are written here.

Grid: (batch, rows), one CTA of d_v / 4 threads per query row: each thread owns 4 output columns
(one 16-byte load per piece), and the loop over pieces is unrolled so that several loads are in
flight (a row of a short request is cut into as many as ~60 pieces at batch 1). Launched with
programmatic dependent launch: the CTA starts while the decode kernel drains and waits for it
only before reading its results.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

LN_2 = math.log(2.0)
UNROLL = 8


class MLACombine:
    """Split-KV combine; compiled per (dtype, d_v); batch, s_q and h_q are runtime values."""

    def __init__(self, dtype, d_v: int = 512):
        assert d_v % 128 == 0, d_v
        self.dtype = dtype
        self.d_v = d_v
        self.threads = d_v // 4

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
            grid=[b, rows, 1], block=[self.threads, 1, 1], stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, mNumSplits, mOacc, mLSEacc, mO, mLSE):
        tidx, _, _ = cute.arch.thread_idx()
        r, row, _ = cute.arch.block_idx()
        nt = self.threads
        n_warps = nt // 32
        start = mNumSplits[r]
        count = mNumSplits[r + 1] - start
        h_q = mLSE.shape[1]
        red = cute.make_tensor(
            cute.arch.alloc_smem(Float32, 2 * n_warps), cute.make_layout(2 * n_warps)
        )
        sW = cute.make_tensor(cute.arch.alloc_smem(Float32, nt), cute.make_layout(nt))
        if count != 1:
            cute.arch.griddepcontrol_wait()  # the decode kernel's partials are complete
            acc = cute.make_rmem_tensor(4, Float32)
            acc.fill(0.0)
            lse_out = Float32.inf
            if count > 1:
                # max and sum of 2^lse over the pieces, across the CTA
                mx = -Float32.inf
                for i in cutlass.range(tidx, count, nt, unroll=1):
                    mx = cute.arch.fmax(mx, mLSEacc[start + i, row])
                mx = cute.arch.warp_reduction_max(mx)
                if tidx % 32 == 0:
                    red[tidx // 32] = mx
                cute.arch.sync_threads()
                mx = red[0]
                for w in cutlass.range_constexpr(1, n_warps):
                    mx = cute.arch.fmax(mx, red[w])
                if mx != -Float32.inf:
                    total = Float32(0.0)
                    for i in cutlass.range(tidx, count, nt, unroll=1):
                        total += cute.math.exp2(mLSEacc[start + i, row] - mx, fastmath=True)
                    total = cute.arch.warp_reduction_sum(total)
                    if tidx % 32 == 0:
                        red[n_warps + tidx // 32] = total
                    cute.arch.sync_threads()
                    total = Float32(0.0)
                    for w in cutlass.range_constexpr(n_warps):
                        total += red[n_warps + w]
                    lse2 = cute.math.log2(total, fastmath=False) + mx
                    lse_out = lse2 * LN_2
                    # Pieces in chunks of nt: weights to smem, then independent 16-byte loads.
                    for c0 in cutlass.range(0, count, nt, unroll=1):
                        n = cutlass.min(count - c0, nt)
                        if tidx < n:
                            sW[tidx] = cute.math.exp2(
                                mLSEacc[start + c0 + tidx, row] - lse2, fastmath=True)
                        cute.arch.sync_threads()
                        for i in cutlass.range(n, unroll=UNROLL):
                            src = cute.local_tile(mOacc[start + c0 + i, row, None], (4,),
                                                  (tidx,))
                            acc.store(acc.load() + sW[i] * src.load())
                        cute.arch.sync_threads()
            dst = cute.local_tile(mO[r, row, None], (4,), (tidx,))
            dst.store(acc.load().to(self.dtype))
            if tidx == 0:
                mLSE[r, row % h_q, row // h_q] = lse_out
