"""Causal horizon, masking and online softmax on MMA accumulator fragments (decode kernels).

Fragment convention: for one 16-row slab of an fp32 (M, N) accumulator, a thread holds rows
r and r + 8 (r = lane // 4) and, for each 8-column block j, columns 8 j + 2 (lane % 4) + {0, 1}:
element c + 2 h + 4 j is row r + 8 h, column 8 j + 2 (lane % 4) + c. That is the C layout of
mma.sync m16n8k16 repeated along N (SM80 and later) and of one warp's slab of an SM90 wgmma
accumulator, so every decode kernel can use these helpers (sm90_decode.py still has its own
copies inline).

Scores stay raw in the fragments; maxima are kept in the log2 domain (scaled by
scale_log2 = softmax_scale * log2(e)). A row that has seen no visible key keeps max -inf and
sum 0 (its output is 0 and its lse +inf); the exponent then subtracts 0 instead of -inf, so no
NaN appears.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


@cute.jit
def row_border(L: Int32, g: Int32, rows: Int32, h_q: Int32, s_q: Int32,
               causal: cutlass.Constexpr[bool]) -> Int32:
    """Keys < the result are visible to query row g (rows are (token, head) flattened:
    g = token * h_q + head) of a request with L keys: L, or L - s_q + token + 1 if causal."""
    res = L
    if const_expr(causal):
        if g < rows:
            res = L - (s_q - 1 - g // h_q)
    return res


@cute.jit
def mask_keys(acc: cute.Tensor, tScS: cute.Tensor, key0: Int32, border_0: Int32,
              border_1: Int32):
    """acc[i] = -inf where key0 + (column of element i) >= the border of its row (border_0 for
    row r, border_1 for row r + 8). tScS: the identity-tensor partition of acc (coordinates)."""
    for i in cutlass.range_constexpr(cute.size(acc)):
        lim = border_0 if const_expr((i % 4) // 2 == 0) else border_1
        if key0 + tScS[i][1] >= lim:
            acc[i] = -Float32.inf


@cute.jit
def row_max(acc: cute.Tensor, h: cutlass.Constexpr[int]) -> Float32:
    """Max over the columns of row r + 8 h (raw scores), reduced over the 4 lanes of a row."""
    m = acc[2 * h]
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        for c in cutlass.range_constexpr(2):
            m = cute.arch.fmax(m, acc[c + 2 * h + 4 * j])
    return cute.arch.warp_reduction_max(m, threads_in_group=4)


@cute.jit
def row_sum_quad(x: Float32) -> Float32:
    """Sum over the 4 lanes that hold one row."""
    x += cute.arch.shuffle_sync_bfly(x, offset=1)
    x += cute.arch.shuffle_sync_bfly(x, offset=2)
    return x


@cute.jit
def exp_rows(acc: cute.Tensor, m_use, scale_log2: Float32, row_sum, row_scale):
    """acc = exp2(acc * scale_log2 - m_use[h]) in place; row_sum[h] = row_sum[h] * row_scale[h]
    + this thread's sum of the new values of row h."""
    for h in cutlass.range_constexpr(2):
        s = Float32(0.0)
        for j in cutlass.range_constexpr(cute.size(acc) // 4):
            for c in cutlass.range_constexpr(2):
                idx = c + 2 * h + 4 * j
                p = cute.math.exp2(acc[idx] * scale_log2 - m_use[h], fastmath=True)
                acc[idx] = p
                s += p
        row_sum[h] = row_sum[h] * row_scale[h] + s


@cute.jit
def scale_rows(acc: cute.Tensor, row_scale):
    """acc[row r + 8 h] *= row_scale[h]."""
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        for h in cutlass.range_constexpr(2):
            for c in cutlass.range_constexpr(2):
                idx = c + 2 * h + 4 * j
                acc[idx] = acc[idx] * row_scale[h]


@cute.jit
def online_max(m_old: Float32, m_blk: Float32):
    """(new running max, the max to subtract in the exponent, factor for the old sums and
    outputs), all in the log2 domain; m_blk is this block's scaled row max."""
    m_new = cute.arch.fmax(m_old, m_blk)
    m_use = Float32(0.0) if m_new == -Float32.inf else m_new
    return m_new, m_use, cute.math.exp2(m_old - m_use, fastmath=True)
