"""Keys-on-M MLA decode on Hopper over an e4m3 cache, fast mode (compute="fp8"): S^T on the e4m3
wgmma with the page's bytes as its A operand, O^T as the ping-pong variant computes it.

The ping-pong variant (sm90_keysm_rs_decode.py) converts every page twice into f16 registers:
once as S^T's A (keys x latent, 144 conversions a thread) and once as O^T's A (V^T, 128). The
e4m3 wgmma takes e4m3 bytes as they are, so here

    S^T = K Q8^T      e4m3 wgmma m64nNk32, A (the page) from registers, loaded from the ring
                      and used as loaded (no conversion), B (Q8^T) from shared memory
    O^T += V^T P^T    unchanged: V^T converted exactly into f16 registers, P in f16

Q is quantized per query row (an S^T column) at each segment's start, by both consumer
warpgroups: q x 448 / amax (the row's largest |q|), rounded to nearest, saturating, as the
heads-on-M fast mode (sm90_decode.py, _quantize_q) does per row; each column's softmax scale
takes amax / 448. That is the only rounding this mode adds to exact mode: the cache's values,
P and the accumulation are as the ping-pong variant has them (P in f16, V exact, fp32 sums), so
its error is Q's e4m3 rounding (2^-4 relative a value) through the scores.

The ring is the ping-pong's (since session 22; this variant had it first): whole-line pages, one
TMA box of 144 rows x 256 bytes a page (64 rows of 576 bytes, as the cache holds it: 36 KB of
whole 128-byte lines), unswizzled. 64-byte-wide swizzled tiles read half lines, every other one
straddling two; loading alone, that ring was 4% slower (docs/kernels/keysm.md, "What bounds it").

Orders (tests/test_keysm_fast.py and test_keysm_rs.py check them against the DSL's fragments
and count bank conflicts):
  - S^T's row m is page row m. A thread (lane % 4 = q) loads 16 bytes of each 64-byte group c
    of its rows g, g + 8: rows 576 bytes apart alternate bank halves, so these loads are
    conflict-free. Its words 2 h and 2 h + 1 are its registers of k-step 2 c + h as they are,
    which fixes S^T's latent order (flat_latent_of); Q8 is written in it (q8_word).
  - O^T's k keeps the ping-pong's key order (k = page_row(key)), its loads at the page's 576-byte
    pitch (2-way conflicted: unswizzled rows give a phase two bank halves for its two d
    chunks); the consumer writes S^T's row m to P^T's key page_row(m) (_pt_key; page_row is an
    involution).

Limits: as the ping-pong variant (e4m3 cache, 8, 16 or 32 columns, page 64, d 576 / 512), with
bf16 or fp16 q (an e4m3 q runs the heads-on-M fast mode) and one KV head (a page's rows must
be contiguous: dispatch.keysm_columns). An inf in q makes its row NaN (as the heads-on-M fast
mode). Status: compiled for sm_90a (CI checks its PTX); run on the H200 in session 22
(tests/test_keysm_fast.py: grid, varlen, page edges, data, the zero query row, CUDA-graph
replays; compute-sanitizer memcheck; `fuzz_decode --fast`: every case it took passed), 32
columns in session 23 (the same checks); the dispatch's choice in fast mode where s_q * h_q
<= 16, and <= 32 from a batch of 4 (KEYSM_FAST_MIN_BATCH; TORCH_MLA_KEYSM_FAST=1: every batch,
=0: never). docs/kernels/keysm.md, "Fast mode on the ping-pong variant" and "Session 23", has
its speed.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..constants import D_QK, KEYSM_FAST_COLUMNS, PAGE_SIZE
from .decode_base import aligned
from .ptx import (
    e4m3_row_factors,
    e4m3x4,
    fence_operand,
    lds128,
    sts,
    unpack16x2,
)
from .sm90_keysm_decode import N_TILES, PAGE_ELEMS
from .sm90_keysm_rs_decode import NB_PAIR, MLADecodeSm90KeysMRS, q_unit


def sw64_offset(row, byte, rows):
    """Byte offset of Q8's (row, latent byte) (n = rows rows): the wgmma's K-major e4m3 layout
    with the 64-byte swizzle, 9 tiles of n rows x 64 bytes, the 16-byte unit ^= (row / 2) % 4."""
    tile, b = byte // 64, byte % 64
    return tile * rows * 64 + row * 64 + (((b // 16) ^ ((row >> 1) & 3)) * 16) + b % 16


def flat_latent_of(k):
    """The cache latent byte of S^T's logical k: a thread with lane % 4 = q loads bytes
    16 q .. 16 q + 15 of each 64-byte group c; its registers of k-step 2 c + h are words 2 h
    (k 4 q .. 4 q + 3) and 2 h + 1 (k 16 + 4 q ..) of that load."""
    c, rem = k // 64, k % 64
    h, r = rem // 32, rem % 32
    q, i = (r % 16) // 4, r % 4
    return 64 * c + 16 * q + 8 * h + 4 * (r // 16) + i


def q8_word(w):
    """Q8's word w of a 64-byte group (logical k 4 w .. 4 w + 3) is the run's latent word
    q8_word(w) (flat_latent_of, in words)."""
    return flat_latent_of(4 * w) // 4 % 16


class MLADecodeSm90KeysMFast(MLADecodeSm90KeysMRS):
    """Fast mode of the ping-pong keys-on-M kernel; see the module docstring."""

    def __init__(self, dtype, causal: bool, columns: int):
        # (ping-pong columns only: _q_ready converts one Q set shared by both warpgroups)
        assert columns in KEYSM_FAST_COLUMNS, columns
        super().__init__(dtype, causal, columns)

    def _more_smem(self) -> dict:
        n = self.n_wg
        return dict(
            sQ8=aligned(cutlass.Uint8, n * D_QK),  # Q in e4m3 (sw64_offset)
            sQScale=cute.struct.MemRange[Float32, n],  # each row's amax / 448
            sRunMax=cute.struct.MemRange[Float32, n * N_TILES],  # amax of (row, 64-wide group)
        )

    def _tiled_s(self):
        """S^T's tiled MMA: e4m3 x e4m3 -> fp32, A (the page) from registers, B (Q8^T) from
        shared memory."""
        f8 = cutlass.Float8E4M3FN
        kmode = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(f8, f8, kmode, kmode, Float32, (1, 1, 1),
                                                 (PAGE_SIZE, self.n_wg),
                                                 warpgroup.OperandSource.RMEM)

    @cute.jit
    def _s_operands(self, thr_s, sQ, wq, g, q):
        """S^T's: a register A fragment of two k-steps (a 64-byte group), Q8 (n, 576) K-major
        SW64 in shared memory; this thread's stage offsets (rows 16 wq + g, + 8; bytes 16 q of
        each group)."""
        f8 = cutlass.Float8E4M3FN
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, f8)
        q8 = cute.tile_to_shape(atom, (self.n_wg, D_QK), order=(0, 1))
        sQ8 = cute.make_tensor(
            cute.recast_ptr(self.d_storage.sQ8.data_ptr(), q8.inner, dtype=f8), q8.outer)
        rK = cute.make_rmem_tensor(thr_s.partition_shape_A((PAGE_SIZE, 64)), f8)  # (16, 1, 2)
        tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ8))  # (MMA, 1, 18)
        self.d_k_off = [self._stage_offset(16 * wq + 8 * h + g, 16 * q) for h in range(2)]
        return rK, tSrQ, None

    @cute.jit
    def _mma_s(self, ops, acc_S, s, ob, wq, lane):
        """S^T = K Q8^T over ring stage s: per 64-byte group c, the thread's two 16-byte loads
        (rows g, g + 8) are its A registers of k-steps 2 c and 2 c + 1 as they are (e4m3, in
        the latent order flat_latent_of); waits for the MMAs."""
        rK, tSrQ, _, _, _, _ = ops
        base = self.d_k8 + s * PAGE_ELEMS
        atom_s = cute.make_mma_atom(self.d_tiled_s.op)
        fence_operand(acc_S)
        b32 = cute.recast_tensor(rK, Int32)
        for c in cutlass.range_constexpr(N_TILES):
            x = [lds128(base + self.d_k_off[h] + 64 * c) for h in range(2)]
            if const_expr(c > 0):
                warpgroup.wait_group(0)  # group c - 1, the last reader of rK, is done
            for jj in cutlass.range_constexpr(2):
                # registers 0-3 of k-step jj: rows g, g + 8 of words 2 jj, then of 2 jj + 1
                b32[4 * jj] = x[0][2 * jj]
                b32[4 * jj + 1] = x[1][2 * jj]
                b32[4 * jj + 2] = x[0][2 * jj + 1]
                b32[4 * jj + 3] = x[1][2 * jj + 1]
            fence_operand(rK)
            warpgroup.fence()
            for jj in cutlass.range_constexpr(2):
                atom_s.set(warpgroup.Field.ACCUMULATE, c * 2 + jj != 0)
                cute.gemm(atom_s, acc_S, rK[None, None, jj], tSrQ[None, None, 2 * c + jj],
                          acc_S)
            warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_S)

    @cute.jit
    def _q_ready(self, wg, wq, lane, wtid, tidx) -> list:
        """Both consumer warpgroups, once Q has landed: Q (n x 576, 16-bit, as TMA landed it)
        -> Q8 in e4m3, each row times 448 / its largest |q|; returns the thread's columns'
        amax / 448 (their factors of the softmax scale; 1 at 32 columns, where _page_scale
        applies them). A thread takes a (row, 64-wide group)
        run (two at 32 columns, 288 runs: waves of 256): its amax to sRunMax, barrier 4, the
        row's amax from its 9 runs, the run quantized into Q8, barrier 4. Threads without a run
        read the last one and store nothing. Q8 and sQScale are written only after the first
        barrier 4, which both warpgroups meet after their last page of the previous segment
        (_page_scale reads sQScale every page)."""
        n = self.n_wg
        runs = n * N_TILES
        waves = (runs + 255) // 256  # (2 at 32 columns: 288 runs)
        bf16 = self.dtype == cutlass.BFloat16
        run_max = self.d_storage.sRunMax.get_tensor(cute.make_layout(runs))
        scales = self.d_storage.sQScale.get_tensor(cute.make_layout(n))
        held = []
        for wv in cutlass.range_constexpr(waves):
            run = cutlass.min(wv * 256 + tidx, runs - 1)
            row, c = run % n, run // n
            words = []
            for u in cutlass.range_constexpr(8):
                words += lds128(self.d_q_base + q_unit(row, c, u, n))
            if const_expr(waves == 1):  # (more waves read their runs again: registers)
                held.append(words)
            amax = Float32(0.0)
            for w in words:
                for v in unpack16x2(w, bf16):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(v, -v))
            if wv * 256 + tidx < runs:
                run_max[run] = amax
        cute.arch.barrier(barrier_id=NB_PAIR, number_of_threads=256)
        for wv in cutlass.range_constexpr(waves):
            run = cutlass.min(wv * 256 + tidx, runs - 1)
            row, c = run % n, run // n
            if const_expr(waves == 1):
                words = held[wv]
            else:
                words = []
                for u in cutlass.range_constexpr(8):
                    words += lds128(self.d_q_base + q_unit(row, c, u, n))
            amax = run_max[row]
            for t in cutlass.range_constexpr(1, N_TILES):
                amax = cute.arch.fmax(amax, run_max[t * n + row])
            inv, scale = e4m3_row_factors(amax)
            lat = []  # the run's 16 words of e4m3, latent order
            for i in cutlass.range_constexpr(16):
                a = unpack16x2(words[2 * i], bf16)
                b = unpack16x2(words[2 * i + 1], bf16)
                lat.append(e4m3x4(a[0] * inv, a[1] * inv, b[0] * inv, b[1] * inv))
            out = [lat[q8_word(w)] for w in range(16)]  # S^T's k order (flat_latent_of)
            if wv * 256 + tidx < runs:
                q8 = self.d_storage.sQ8.data_ptr().toint()
                for u in cutlass.range_constexpr(4):
                    sts(q8 + sw64_offset(row, 64 * c + 16 * u, n), out[4 * u:4 * u + 4])
                if c == 0:
                    scales[row] = scale
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=NB_PAIR, number_of_threads=256)
        if const_expr(n < 32):
            return [scales[self._col(jc, lane)] for jc in range(n // 4)]
        return [Float32(1.0)] * (n // 4)  # (at 32 columns _page_scale reads them: registers)

    def _col(self, jc, lane):
        """The thread's column jc (of n // 4)."""
        return 8 * (jc // 2) + 2 * (lane % 4) + jc % 2

    @cute.jit
    def _page_scale(self, scale_log2: list, lane) -> list:
        """At 32 columns the rows' Q scales are read from sQScale every page: eight scales held
        through a segment beside O^T (128 registers) made ptxas spill."""
        if const_expr(self.n_wg < 32):
            return scale_log2
        scales = self.d_storage.sQScale.get_tensor(cute.make_layout(self.n_wg))
        return [scale_log2[jc] * scales[self._col(jc, lane)] for jc in range(self.n_wg // 4)]


def decode_kernel(config, arch: str):
    """The kernel a registry config asks for (dtype, causal, columns); arch is sm_90a."""
    from ..contract import dsl_dtype

    return MLADecodeSm90KeysMFast(dsl_dtype(config.dtype), config.causal, config.columns)
