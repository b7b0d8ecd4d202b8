"""The split-KV decode schedule (torch_mla.scheduling.compute_schedule) in one launch.

Computes exactly what compute_schedule computes, metadata int32 [num_parts, 8] and num_splits
int32 [b + 1], bit for bit, with one CTA: the schedule is a few hundred integers, and a single
CTA needs no grid-wide synchronisation for the two prefix sums over the batch.

Algorithm (notation of scheduling.py: nb_r pages of request r, units_r = nb_r + 5 or 0, end_r
the inclusive prefix sum of units, T = end_{b-1}, P parts, t = max(T, 1), Q = ceil(t / ceil(t /
P)) parts with work, cut(p) = min(p, Q) T / Q):
  pass 1  T = sum of units (block reduction); a negative length fails here (when ``check``);
          then Q (two int64 divisions, once).
  pass 2  over the batch in chunks of THREADS x ITEMS requests (each thread ITEMS consecutive
          ones): a block-wide exclusive scan of the units gives end_r for the chunk, kept in
          shared memory; each request's piece count nsplit_r (from its first and last part) is
          scanned likewise into num_splits. Then every part p whose first (a = cut(p)) or last
          (z - 1 = cut(p + 1) - 1) stream position falls in the chunk finds its request by a
          binary search over the chunk's end_r and writes its begin or end columns.
  whole   with one chunk (b <= 1024), after the units scan, unless the largest request (a max
          taken in pass 1) alone exceeds the bound below: each part's cuts snapped to the
          nearer request boundary (binary searches over end_r), the heaviest snapped part by a
          CTA-wide max; when it is at most OVERHEAD_BLOCKS above ceil(T / Q) every request
          counts one piece and each part writes its whole requests instead
          (scheduling.whole_request_cuts).
  rank    compute_schedule's cumulative count of non-empty parts has a closed form, so no third
          scan: the parts before Q are non-empty (T >= Q), the rest empty, so rank(p) = p for
          the parts p < Q that the rank is taken of.
  last    empty parts get (b, 0, b - 1, 0, 0) (zeros when b = 0), columns 5-7 get 0.
Stream positions and T are int64 (a batch of long requests passes 2^31 units). The divisions
(by Q and by t, about 25 per thread) are the costliest instructions: an int64 division is a
~70-instruction subroutine. Every numerator is at most (T + 6) Q + T <= (T + 6) P + T, so while
that is below 2^31 (T < 16M at P = 132: any realistic batch) they are 32-bit multiply-shifts by
the two divisors' precomputed magic numbers (cute.FastDivmodDivisorV2); past it, int64
divisions.

Tiles: THREADS = 256 threads x ITEMS = 4 requests per chunk (1024): a decode batch is one chunk,
so the lengths are read twice (the second time from L1) and the scans run once, and a thread
takes one part (P <= 256: h_q <= 64 gives P = the SM count). Shared memory: the chunk's end_r
(8 KB) and the per-warp totals of the scans. Limits: any batch size (chunks), any num_parts (a
thread loops over parts). Uses no arch-specific instruction: sm_80 and later.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

from ..constants import OVERHEAD_BLOCKS, PAGE_SIZE
from .device_error import fail

THREADS = 256
ITEMS = 4
CHUNK = THREADS * ITEMS
LOG2_CHUNK = CHUNK.bit_length() - 1
WARPS = THREADS // 32


class DecodeSchedule:
    """One-CTA schedule kernel; nothing is compiled in but the tile sizes (batch and num_parts
    are runtime values)."""

    @cute.jit
    def __call__(
        self,
        mSeqlens: cute.Tensor,  # (b,) int32
        mMeta: cute.Tensor,  # (num_parts, 8) int32, row-major
        mNumSplits: cute.Tensor,  # (b + 1,) int32
        check: Int32,  # nonzero: a negative length fails the launch
        stream,
    ):
        self.kernel(mSeqlens, mMeta, mNumSplits, check).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def block_scan(self, x, dtype: cutlass.Constexpr, sWarp: cute.Tensor, lane, warp):
        """(exclusive prefix of x over the CTA's threads, CTA total). sWarp: WARPS free entries;
        the caller separates two uses of one sWarp by a barrier."""
        x = dtype(x)
        zero = dtype(0)
        v = x
        for k in cutlass.range_constexpr(5):
            y = cute.arch.shuffle_sync_up(v, 1 << k)
            v = v + cutlass.select_(lane >= (1 << k), y, zero)
        if lane == 31:
            sWarp[warp] = Int64(v)
        cute.arch.sync_threads()
        before = zero
        total = zero
        # Every thread sums the warp totals itself (broadcast reads): no second barrier.
        for w in cutlass.range_constexpr(WARPS):
            tw = dtype(sWarp[w])
            before = before + cutlass.select_(w < warp, tw, zero)
            total = total + tw
        return before + v - x, total

    @cute.kernel
    def kernel(self, mSeqlens, mMeta, mNumSplits, check):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        b = mSeqlens.shape[0]
        P = mMeta.shape[0]
        P64 = Int64(P)
        sEnd = cute.make_tensor(cute.arch.alloc_smem(Int64, CHUNK, 16), cute.make_layout(CHUNK))
        # Four sets of warp totals: the reduction, the units scan, the splits scan, the largest
        # request.
        sWarp = cute.make_tensor(cute.arch.alloc_smem(Int64, 4 * WARPS, 16),
                                 cute.make_layout((WARPS, 4)))

        # Pass 1: T and the largest request's units.
        acc = Int64(0)
        top = Int64(0)
        for i in cutlass.range(tidx, b, THREADS, unroll=4):
            L = mSeqlens[i]
            if (check != 0) & (L < 0):
                fail("torch_mla.get_decode_schedule: cache_seqlens[%d] = %d, but lengths must "
                     "be >= 0", i, L)
            u = self.units(L)
            acc += u
            top = cutlass.max(top, u)
        acc = cute.arch.warp_reduction_sum(acc)
        top = cute.arch.warp_reduction_max(top)
        if lane == 0:
            sWarp[warp, 0] = acc
            sWarp[warp, 3] = top
        cute.arch.sync_threads()
        T = Int64(0)
        for w in cutlass.range_constexpr(WARPS):
            T += sWarp[w, 0]
            top = cutlass.max(top, sWarp[w, 3])
        t = cutlass.max(T, Int64(1))
        per_part = (t + P64 - 1) // P64
        Q = (t + per_part - 1) // per_part  # the parts with work (module docstring)
        # The largest numerator below is (T + 6) Q + T <= (T + 6) P + T (module docstring): the
        # bound taken with P, as compute_schedule's arithmetic does not depend on it.
        small = (T + OVERHEAD_BLOCKS + 1) * P64 + T < 2**31
        by_Q = (Q, cute.FastDivmodDivisorV2(Int32(Q)), small)
        by_t = (t, cute.FastDivmodDivisorV2(Int32(cutlass.select_(small, t, Int64(1)))), small)

        # Pass 2: chunk by chunk.
        whole = Int32(0)  # 1: parts take whole requests (a one-chunk batch)
        carry_units = Int64(0)  # end_r of the last request before the chunk
        carry_splits = Int32(0)
        for c0 in cutlass.range(0, b, CHUNK, unroll=1):
            i0 = c0 + tidx * ITEMS
            units = []
            for k in cutlass.range_constexpr(ITEMS):
                # Past b: a clamped (real) index, and units 0.
                u = self.units(mSeqlens[cutlass.min(i0 + k, b - 1)])
                units.append(cutlass.select_(i0 + k < b, u, Int64(0)))
            own = units[0]
            for k in cutlass.range_constexpr(1, ITEMS):
                own = own + units[k]
            before, chunk_units = self.block_scan(own, Int64, sWarp[None, 1], lane, warp)
            start = carry_units + before  # stream position where request i0 starts
            nsplit = []
            for k in cutlass.range_constexpr(ITEMS):
                # Entries past b get units 0, so end = the chunk's last end > any position that
                # the binary search below looks up in this chunk.
                sEnd[tidx * ITEMS + k] = start + units[k]
                nb = units[k] - OVERHEAD_BLOCKS
                last_part = self.div((start + OVERHEAD_BLOCKS + nb) * Q + t - 1, by_t) - 1
                n = (self.clamp_part(last_part, Q) - self.first_rank(start, Q, by_t) + 1)
                nsplit.append(cutlass.select_(units[k] > 0, n, Int32(0)))
                start = start + units[k]
            # Whole requests per part when that costs little (scheduling.whole_request_cuts):
            # sEnd published, then the heaviest part of the snapped cut, CTA-wide. Skipped
            # (uniform over the CTA) when the largest request alone is already too heavy.
            limit = self.div(T + Q - 1, by_Q) + OVERHEAD_BLOCKS
            if (b <= CHUNK) & (T > 0) & (top <= limit):
                cute.arch.sync_threads()
                largest = Int64(0)
                for p in cutlass.range(tidx, P, THREADS, unroll=1):
                    a = self.snap(sEnd, self.cut(p, T, by_Q), T)
                    largest = cutlass.max(largest, self.snap(sEnd, self.cut(p + 1, T, by_Q), T)
                                          - a)
                largest = cute.arch.warp_reduction_max(largest)
                if lane == 0:
                    sWarp[warp, 0] = largest  # (T's partial sums there were read before)
                cute.arch.sync_threads()
                for w in cutlass.range_constexpr(WARPS):
                    largest = cutlass.max(largest, sWarp[w, 0])
                if largest <= limit:
                    whole = Int32(1)
            for k in cutlass.range_constexpr(ITEMS):  # whole requests: one piece each
                nsplit[k] = cutlass.select_(whole != 0, Int32(units[k] > 0), nsplit[k])
            own_splits = nsplit[0]
            for k in cutlass.range_constexpr(1, ITEMS):
                own_splits = own_splits + nsplit[k]
            split_before, chunk_splits = self.block_scan(own_splits, Int32, sWarp[None, 2],
                                                         lane, warp)
            done = carry_splits + split_before
            for k in cutlass.range_constexpr(ITEMS):
                done = done + nsplit[k]
                if i0 + k < b:
                    mNumSplits[i0 + k + 1] = done
            # (block_scan's barriers also published sEnd.)
            lo = carry_units
            hi = carry_units + chunk_units
            if whole != 0:  # (one chunk: stream positions are sEnd's own)
                for p in cutlass.range(tidx, P, THREADS, unroll=1):
                    a = self.snap(sEnd, self.cut(p, T, by_Q), T)
                    z = self.snap(sEnd, self.cut(p + 1, T, by_Q), T)
                    first, last, last_nb = b, cutlass.max(b - 1, 0), Int32(0)
                    if a < z:
                        first = self.upper_bound(sEnd, a)
                        last = self.upper_bound(sEnd, z - 1)
                        last_nb = Int32(sEnd[last] - self.request_start(sEnd, last, Int64(0))
                                        - OVERHEAD_BLOCKS)
                    mMeta[p, 0] = first
                    mMeta[p, 1] = 0
                    mMeta[p, 2] = last
                    mMeta[p, 3] = last_nb
                    mMeta[p, 4] = 0
            else:
                for p in cutlass.range(tidx, P, THREADS, unroll=1):
                    a = self.cut(p, T, by_Q)
                    z = self.cut(p + 1, T, by_Q)
                    if a < z:
                        if (lo <= a) & (a < hi):
                            j = self.upper_bound(sEnd, a)
                            end = sEnd[j]
                            begin = self.request_start(sEnd, j, lo)
                            nb = end - begin - OVERHEAD_BLOCKS
                            blk = cutlass.min(
                                cutlass.max(a - begin - OVERHEAD_BLOCKS, Int64(0)), nb)
                            # rank(p) = p (a non-empty part)
                            split = cutlass.max(p - self.first_rank(begin, Q, by_t), 0)
                            mMeta[p, 0] = c0 + j
                            mMeta[p, 1] = Int32(blk)
                            mMeta[p, 4] = Int32(split)
                        if (lo <= z - 1) & (z - 1 < hi):
                            j = self.upper_bound(sEnd, z - 1)
                            end = sEnd[j]
                            begin = self.request_start(sEnd, j, lo)
                            nb = end - begin - OVERHEAD_BLOCKS
                            blk = cutlass.min(
                                cutlass.max(z - begin - OVERHEAD_BLOCKS, Int64(0)), nb)
                            mMeta[p, 2] = c0 + j
                            mMeta[p, 3] = Int32(blk)
            carry_units = hi
            carry_splits = carry_splits + chunk_splits
            cute.arch.sync_threads()  # sEnd and sWarp are rewritten by the next chunk

        if tidx == 0:
            mNumSplits[0] = 0
        for p in cutlass.range(tidx, P, THREADS, unroll=1):
            empty = self.cut(p, T, by_Q) == self.cut(p + 1, T, by_Q)
            if (whole == 0) & empty:
                mMeta[p, 0] = b
                mMeta[p, 1] = 0
                mMeta[p, 2] = cutlass.max(b - 1, 0)
                mMeta[p, 3] = 0
                mMeta[p, 4] = 0
            for c in cutlass.range_constexpr(5, 8):
                mMeta[p, c] = 0

    @cute.jit
    def units(self, L):
        """Pages + the per-request overhead, 0 for an empty request; negative lengths count as
        0 (compute_schedule's clamp: with the checks off they are not an error)."""
        nb = (cutlass.max(Int64(L), Int64(0)) + PAGE_SIZE - 1) // PAGE_SIZE  # int64: L + 63
        return cutlass.select_(nb > 0, nb + OVERHEAD_BLOCKS, Int64(0))

    @cute.jit
    def div(self, n, by):
        """floor(n / d) for 0 <= n <= (T + 6) Q + T; by = (d int64, its FastDivmodDivisorV2,
        whether every numerator fits 31 bits)."""
        d, fast, small = by
        q = Int64(0)
        if small:
            q = Int64(Int32(n) // fast)
        else:
            q = n // d
        return q

    @cute.jit
    def cut(self, p, T, by_Q):
        """Part p's first stream position, min(p, Q) T / Q (the parts from Q on are empty)."""
        return self.div(cutlass.min(Int64(p), by_Q[0]) * T, by_Q)

    @cute.jit
    def clamp_part(self, x, Q):
        """x clamped to the parts with work, 0..Q - 1, as an Int32: there its rank (module
        docstring)."""
        return Int32(cutlass.min(cutlass.max(x, Int64(0)), Q - 1))

    @cute.jit
    def first_rank(self, start, Q, by_t):
        """rank of the part holding the request's first page (it starts at stream position
        start, its pages after the overhead)."""
        t = by_t[0]
        first_part = self.div((start + OVERHEAD_BLOCKS + 1) * Q + t - 1, by_t) - 1
        return self.clamp_part(first_part, Q)

    @cute.jit
    def snap(self, sEnd, x, T):
        """The boundary of the request holding stream position x nearer to x (the lower on a
        tie), T for x >= T; one chunk (stream positions are sEnd's)."""
        r = T
        if x < T:
            j = self.upper_bound(sEnd, x)
            hi = sEnd[j]
            lo = self.request_start(sEnd, j, Int64(0))
            r = cutlass.select_(x - lo <= hi - x, lo, hi)
        return r

    @cute.jit
    def upper_bound(self, sEnd, x):
        """The number of chunk entries with end <= x (the entries are sorted, and the last one
        is > x): the index of the request holding stream position x."""
        pos = Int32(0)
        # Binary lifting: pos stays a multiple of 2 << k, so pos + (1 << k) <= CHUNK - 1.
        for k in cutlass.range_constexpr(LOG2_CHUNK - 1, -1, -1):
            pos = pos + cutlass.select_(sEnd[pos + (1 << k) - 1] <= x, Int32(1 << k), Int32(0))
        return pos

    @cute.jit
    def request_start(self, sEnd, j, lo):
        return cutlass.select_(j > 0, sEnd[cutlass.max(j - 1, 0)], lo)


# --- compile entry (ops/registry.py: ScheduleConfig) ------------------------------------------


def compile_schedule(config, arch: str):
    """The schedule kernel, compiled for arch."""
    from ..contract import compile_schedule_kernel

    return compile_schedule_kernel(DecodeSchedule(), arch)
