"""Causal horizon, masking and online softmax of the decode kernels, on their score registers.

Two register layouts:
- MMA fragments (sm80_decode.py, sm90_decode.py): for one 16-row slab of an fp32 (M, N)
  accumulator, a thread holds rows r and r + 8 (r = lane // 4) and, for each 8-column block j,
  columns 8 j + c0 + {0, 1} (c0 = 2 (lane % 4)): element c + 2 h + 4 j is row r + 8 h, column
  8 j + c0 + c. That is the C layout of mma.sync m16n8k16 repeated along N (SM80 and later) and
  of one warp's slab of an SM90 wgmma accumulator. A row is reduced over the 4 lanes that hold
  it.
- A row per thread (sm100_decode.py, scores loaded from tensor memory): a thread holds part of
  one row; its partner lane holds the rest (the caller reduces across them).

Scores stay raw in the registers; maxima are kept in the log2 domain (scaled by
scale_log2 = softmax_scale * log2(e)). A row that has seen no visible key keeps max -inf and
sum 0 (its output is 0 and its lse +inf); the exponent then subtracts 0 instead of -inf, so no
NaN appears. Every helper is traced inline where it is called: the kernels keep their own order
of floating-point operations by calling these in that order.
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
def mask_keys(acc: cute.Tensor, key0: Int32, border_0: Int32, border_1: Int32, col):
    """MMA fragment: acc[i] = -inf where key0 + (column of element i) >= the border of its row
    (border_0 for row r, border_1 for row r + 8). col(i): that column (an Int32, or a Python
    int plus a runtime lane offset), relative to key0."""
    for h in cutlass.range_constexpr(2):
        lim = (border_0 if const_expr(h == 0) else border_1) - key0
        for j in cutlass.range_constexpr(cute.size(acc) // 4):
            for c in cutlass.range_constexpr(2):
                idx = c + 2 * h + 4 * j
                if col(idx) >= lim:
                    acc[idx] = -Float32.inf


@cute.jit
def row_max(acc: cute.Tensor, h: cutlass.Constexpr[int]) -> Float32:
    """MMA fragment: max over the columns of row r + 8 h (raw scores), reduced over the 4
    lanes of a row."""
    m = acc[2 * h]
    for j in cutlass.range_constexpr(cute.size(acc) // 4):
        for c in cutlass.range_constexpr(2):
            m = cute.arch.fmax(m, acc[c + 2 * h + 4 * j])
    return cute.arch.warp_reduction_max(m, threads_in_group=4)


@cute.jit
def row_sum_quad(x: Float32) -> Float32:
    """MMA fragment: sum over the 4 lanes that hold one row."""
    x += cute.arch.shuffle_sync_bfly(x, offset=1)
    x += cute.arch.shuffle_sync_bfly(x, offset=2)
    return x


@cute.jit
def inv_sum(total: Float32) -> Float32:
    """1 / a row's softmax sum, the output's normalization: 0 for a row that saw no key (sum
    0), whose output is then 0."""
    return Float32(1.0) / total if total > 0.0 else Float32(0.0)


@cute.jit
def exp_scaled(x: Float32, scale_log2: Float32, m_use: Float32) -> Float32:
    """The softmax numerator of raw score x: 2^(x scale_log2 - m_use)."""
    return cute.math.exp2(x * scale_log2 - m_use, fastmath=True)


@cute.jit
def exp_rows(acc: cute.Tensor, m_use, scale_log2, row_sum, row_scale,
             shift: cutlass.Constexpr[float] = 0.0):
    """MMA fragment: acc = 2^(acc * scale_log2[h] - (m_use[h] - shift)) in place for row
    r + 8 h; row_sum[h] = row_sum[h] * row_scale[h] + this thread's sum of the new values of
    row h. scale_log2: a pair (one scale per row; the same value twice for a shared one).
    shift: a constant factor 2^shift on every value (SM90 fast mode keeps e4m3's small values
    out of its subnormals that way)."""
    for h in cutlass.range_constexpr(2):
        s = Float32(0.0)
        m_h = m_use[h]
        if const_expr(shift != 0.0):
            m_h = m_h - shift
        for j in cutlass.range_constexpr(cute.size(acc) // 4):
            for c in cutlass.range_constexpr(2):
                idx = c + 2 * h + 4 * j
                p = exp_scaled(acc[idx], scale_log2[h], m_h)
                acc[idx] = p
                s += p
        row_sum[h] = row_sum[h] * row_scale[h] + s


@cute.jit
def scale_rows(acc: cute.Tensor, row_scale):
    """MMA fragment: acc[row r + 8 h] *= row_scale[h] (an output accumulator's rescale)."""
    for h in cutlass.range_constexpr(2):
        for j in cutlass.range_constexpr(cute.size(acc) // 4):
            for c in cutlass.range_constexpr(2):
                idx = c + 2 * h + 4 * j
                acc[idx] = acc[idx] * row_scale[h]


@cute.jit
def online_max(m_old: Float32, m_blk: Float32, threshold: cutlass.Constexpr = None):
    """(new running max, the max to subtract in the exponent, factor for the old sums and
    outputs), all in the log2 domain; m_blk is this block's scaled row max. threshold: raise
    the running max only when m_blk exceeds it by more than that (sm100_decode.py: P stays
    <= 2^threshold and O is rescaled less often); None: always take the larger."""
    if const_expr(threshold is None):
        m_new = cute.arch.fmax(m_old, m_blk)
    else:
        m_new = m_old
        if m_blk > m_old + threshold:  # also: the first visible key (m_old = -inf)
            m_new = m_blk
    m_use = Float32(0.0) if m_new == -Float32.inf else m_new
    return m_new, m_use, cute.math.exp2(m_old - m_use, fastmath=True)


@cute.jit
def row_max_masked(rS: cute.Tensor, tScS: cute.Tensor, key0: Int32, border: Int32) -> Float32:
    """A row per thread: rS[k] = -inf where key0 + (column of element k) >= border (tScS: the
    identity-tensor partition of rS, (row, key) coordinates), and the max of this thread's
    part of the row (raw scores)."""
    m = -Float32.inf
    for k in cutlass.range_constexpr(cute.size(rS)):
        if key0 + tScS[k][1] >= border:
            rS[k] = -Float32.inf
        m = cute.arch.fmax(m, rS[k])
    return m


@cute.jit
def exp_row(rS: cute.Tensor, m_use: Float32, scale_log2: Float32, rP: cute.Tensor) -> Float32:
    """A row per thread: rP = 2^(rS * scale_log2 - m_use) in rP's dtype; returns this thread's
    fp32 sum of the values (before the conversion)."""
    part_sum = Float32(0.0)
    for k in cutlass.range_constexpr(cute.size(rS)):
        p = exp_scaled(rS[k], scale_log2, m_use)
        part_sum += p
        rP[k] = p.to(rP.element_type)
    return part_sum
