"""The decode kernels' side of the split-KV schedule (torch_mla/scheduling.py), device code.

A CTA (m_block, part) reads its part's metadata row (read_part), walks requests
part.begin_req .. part.end_req, takes from each the key blocks segment() gives (a request's
piece in this part; empty where the part holds none of its blocks) and ends each non-empty
segment by writing its result (store_result, store_lse): in the output dtype with the
natural-log lse when the request is done in one piece, else as an fp32 partial (already divided
by its own sum) with a log2-domain lse in the workspace slot num_splits[r] + split_index(),
which combine.py merges. A segment with no block ends in empty_segment (nothing to do, unless
the schedule was made for other lengths).

Every kernel's arithmetic and order of operations stay its own: these helpers are traced inline
where they are called.
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..constants import (
    D_QK,
    D_V,
    LN_2,
    META_BEGIN_BLK,
    META_BEGIN_REQ,
    META_BEGIN_SPLIT,
    META_END_BLK,
    META_END_REQ,
    PAGE_SIZE,
)


def supports(dtype, d_qk: int, d_v: int, page: int) -> bool:
    """The problems every decode kernel takes (each kernel's can_implement): bf16/fp16 q and
    output, DeepSeek's latent widths, 64-token pages."""
    return (dtype in (cutlass.BFloat16, cutlass.Float16) and d_qk == D_QK and d_v == D_V
            and page == PAGE_SIZE)


class Part(NamedTuple):
    """One metadata row: requests begin_req .. end_req (inclusive), from block begin_blk of
    the first to block end_blk (exclusive) of the last; begin_split: the piece index of the
    first request's segment."""

    begin_req: Int32
    begin_blk: Int32
    end_req: Int32
    end_blk: Int32
    begin_split: Int32


@cute.jit
def read_part(mMeta: cute.Tensor, part: Int32) -> Part:
    """Row `part` of the metadata (num_parts, 8) int32."""
    row = mMeta[part, None]
    return Part(row[META_BEGIN_REQ], row[META_BEGIN_BLK], row[META_END_REQ], row[META_END_BLK],
                row[META_BEGIN_SPLIT])


@cute.jit
def num_blocks(L: Int32) -> Int32:
    """Key blocks (pages) of a request of L keys."""
    return (L + PAGE_SIZE - 1) // PAGE_SIZE


@cute.jit
def segment(p: Part, r: Int32, L: Int32, width: Int32, pieces: Int32):
    """(lo, hi): the key blocks [lo, hi) of request r (L keys, cut into `pieces` pieces) that
    part p computes; lo >= hi when it holds none. The walk stops at the block table's width: a
    length past it is an input error (the combine checks it on the device), and no block-table
    read may leave the request's row whatever the inputs hold.

    A request's last piece runs to the request's end now, wherever the part ends: for the
    lengths the schedule was made for that is the part's own end_blk, and a request that has
    grown since (a schedule made for shorter lengths) keeps its new blocks, which no other
    piece holds. Other pieces stop at end_blk, and at the request's last block (a schedule made
    for longer lengths may end a part past it; those blocks hold no key, and their block-table
    entries no page of it)."""
    nb_req = num_blocks(L)
    lo = p.begin_blk if r == p.begin_req else 0
    end = nb_req
    if r == p.end_req:
        # (p.end_blk <= lo: the part ends before the request's first block, inside the
        # overhead units the schedule charges a request start: it holds no piece of it.)
        if split_index(p, r) != pieces - 1 or p.end_blk <= lo:
            end = cutlass.min(p.end_blk, nb_req)
    hi = cutlass.min(end, width)
    return lo, hi


@cute.jit
def empty_segment(p: Part, r: Int32, lo: Int32, L: Int32, pieces: Int32, slot0: Int32,
                  mO: cute.Tensor, mLSE: cute.Tensor, mLSEacc: cute.Tensor, row0: Int32,
                  valid_rows: Int32, h_q: Int32, tidx: Int32, num_threads: int):
    """A segment of request r (L keys, `pieces` pieces, slots from slot0) with no block:
    the CTA's rows are [row0, row0 + valid_rows) and threads [0, num_threads) run this.

    In a schedule made for these lengths only the part's own cuts make one (a part that ends in
    the request's overhead units), and there is nothing to write. A schedule made for longer
    lengths can have given this part blocks [lo, ...) that lie past the request's end now:
      - one piece (then lo = 0: the request has no key now): its output is written here, 0
        with lse +inf, as for any request without keys;
      - several pieces: the piece's partial result, which the combine would merge, does not
        exist. Its lse slot gets +inf, which no partial can hold (a piece with keys has a
        finite lse, one without -inf); the combine reports the schedule and stops the launch
        (MLACombine.check_pieces). The decode kernels cannot print: a printf is a function
        call, and ptxas then serialises every wgmma of the kernel (device_error.py).
    Every thread runs the store loop the same number of times (the store is predicated): a
    loop whose trip count differs between threads, inside the SM90 walk's request loop, costs
    ptxas its proof that the walk is warp-convergent (a WARPSYNC before each barrier and MMA,
    the row-max shuffles behind divergence checks)."""
    if lo >= num_blocks(L) and pieces > 0:
        if r != p.end_req or lo < p.end_blk:
            if pieces > 1:
                if tidx < valid_rows:
                    mLSEacc[slot0 + split_index(p, r), row0 + tidx] = Float32.inf
            else:
                zero = mO.element_type(0.0)
                count = valid_rows * D_V
                for j in cutlass.range(0, (count + num_threads - 1) // num_threads, unroll=1):
                    i = j * num_threads + tidx
                    if i < count:
                        mO[r, row0 + i // D_V, i % D_V] = zero
                if tidx < valid_rows:
                    g = row0 + tidx
                    mLSE[r, g % h_q, g // h_q] = Float32.inf


@cute.jit
def split_index(p: Part, r: Int32) -> Int32:
    """Which piece of request r part p computes (its slot is num_splits[r] + this)."""
    return p.begin_split if r == p.begin_req else 0


@cute.jit
def store_result(pieces: Int32, store, mO: cute.Tensor, mOacc: cute.Tensor, r: Int32,
                 slot: Int32, dtype: cutlass.Constexpr):
    """The output of a segment of request r: store(tensor, index, dtype) writes the kernel's
    rows of tensor[index] in dtype; here tensor[index] is mOacc[slot] (fp32) when the request
    has several pieces, else mO[r] (the output dtype). mO (b, rows, 512), mOacc (slots, rows,
    512) fp32."""
    if pieces > 1:
        store(mOacc, slot, Float32)
    else:
        store(mO, r, dtype)


@cute.jit
def store_lse(mLSE: cute.Tensor, mLSEacc: cute.Tensor, r: Int32, slot: Int32, row: Int32,
              pieces: Int32, h_q: Int32, total: Float32, m: Float32, shift=None):
    """The lse of query row `row` (= token * h_q + head) of request r, whose softmax sum is
    total and max m (log2 domain; shift: subtracted from the log2 lse, SM90 fast mode's
    2^P_SHIFT factor): log2(total) + m into mLSEacc[slot, row] (slots, rows) fp32 when the
    request has several pieces (-inf for a piece that saw no key), else (log2(total) + m) ln 2
    into mLSE[r, head, token] (b, h_q, s_q) fp32 (+inf for a row that saw no key)."""
    if pieces > 1:
        lse2 = -Float32.inf
        if total > 0.0:
            lse2 = cute.math.log2(total, fastmath=False) + m
            if const_expr(shift is not None):
                lse2 = lse2 - shift
        mLSEacc[slot, row] = lse2
    else:
        lse = Float32.inf
        if total > 0.0:
            lse2 = cute.math.log2(total, fastmath=False) + m
            if const_expr(shift is not None):
                lse2 = lse2 - shift
            lse = lse2 * LN_2
        mLSE[r, row % h_q, row // h_q] = lse
