"""Keys-on-M MLA decode on Hopper over an e4m3 cache, fast mode (compute="fp8"): S^T on the e4m3
wgmma straight from the ring, O^T as the ping-pong variant computes it.

The ping-pong variant (sm90_keysm_rs_decode.py) converts every page twice into f16 registers:
once as S^T's A (keys x latent, 144 conversions a thread) and once as O^T's A (V^T, 128). S^T's
operands are both K-major in the latent, which the e4m3 wgmma takes from shared memory as they
are: the ring stage as TMA lands it (9 tiles of 64 keys x 64 bytes, 64-byte swizzle, the
canonical K-major SW64 layout of 8-bit operands) and Q quantized to e4m3. So here

    S^T = K Q8^T      e4m3 wgmma m64nNk32, A (the page) and B (Q8^T) from shared memory:
                      18 instructions a page, no conversion, no register operand
    O^T += V^T P^T    unchanged: V^T converted exactly into f16 registers, P in f16

Q is quantized per query row (an S^T column) at each segment's start, by both consumer
warpgroups: q x 448 / amax (the row's largest |q|), rounded to nearest, saturating, as the
heads-on-M fast mode (sm90_decode.py, _quantize_q) does per row; each column's softmax scale
takes amax / 448. That is the only rounding this mode adds to exact mode: the cache's values,
P and the accumulation are as the ping-pong variant has them (P in f16, V exact, fp32 sums), so
its error is Q's e4m3 rounding (2^-4 relative a value) through the scores.

Orders: S^T's row m is page row m (the ring's own order); O^T's k keeps the ping-pong
variant's order (k = page_row(key), conflict-free V^T loads), so the consumer writes S^T's row
m to P^T's key page_row(m) (_pt_key; page_row is an involution).

Limits: as the ping-pong variant (e4m3 cache, 8 or 16 columns, page 64, d 576 / 512), with
bf16 or fp16 q (an e4m3 q runs the heads-on-M fast mode). An inf in q makes its row NaN (as
the heads-on-M fast mode). Status: compiled for sm_90a (CI checks its PTX); run on the H200
in session 21 (GPU tests, test_fp8's fast-mode cases, memcheck, CUDA-graph replays); the
dispatch's choice in fast mode where s_q * h_q <= 16 (TORCH_MLA_KEYSM_FAST=0: never), 0.69-0.72x
the heads-on-M fast mode's time on the rows measured, the exact ping-pong's time
(docs/kernels/keysm.md, "Fast mode on the ping-pong variant").
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.cute.nvgpu import warpgroup

from ..constants import D_QK, PAGE_SIZE
from .decode_base import aligned
from .ptx import e4m3x4, lds128, sts, unpack16x2
from .sm90_keysm_decode import N_TILES, MLADecodeSm90KeysM
from .sm90_keysm_rs_decode import NB_PAIR, MLADecodeSm90KeysMRS, page_row, q_unit, ring_offset

E4M3_MAX = 448.0  # the largest finite e4m3 value


class MLADecodeSm90KeysMFast(MLADecodeSm90KeysMRS):
    """Fast mode of the ping-pong keys-on-M kernel; see the module docstring."""

    def _more_smem(self) -> dict:
        n = self.n_wg
        return dict(
            sQ8=aligned(cutlass.Uint8, n * D_QK),  # Q in e4m3 (ring_offset with n rows)
            sQScale=cute.struct.MemRange[Float32, n],  # each row's amax / 448
            sRunMax=cute.struct.MemRange[Float32, n * N_TILES],  # amax of (row, 64-wide group)
        )

    def _tiled_s(self):
        """S^T's tiled MMA: e4m3 x e4m3 -> fp32, both operands K-major from shared memory."""
        f8 = cutlass.Float8E4M3FN
        kmode = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(f8, f8, kmode, kmode, Float32, (1, 1, 1),
                                                 (PAGE_SIZE, self.n_wg))

    @cute.jit
    def _s_operands(self, thr_s, sQ, wq, g, q):
        """S^T's shared-memory fragments: the ring's stages as e4m3 (64 keys, 576, stages) and
        Q8 (n, 576), both K-major SW64."""
        f8 = cutlass.Float8E4M3FN
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, f8)
        ring = cute.tile_to_shape(atom, (PAGE_SIZE, D_QK, self.stages), order=(0, 1, 2))
        q8 = cute.tile_to_shape(atom, (self.n_wg, D_QK), order=(0, 1))
        sK8 = cute.make_tensor(
            cute.recast_ptr(self.d_storage.sK8.data_ptr(), ring.inner, dtype=f8), ring.outer)
        sQ8 = cute.make_tensor(
            cute.recast_ptr(self.d_storage.sQ8.data_ptr(), q8.inner, dtype=f8), q8.outer)
        tSrK = thr_s.make_fragment_A(thr_s.partition_A(sK8))  # (MMA, 1, 18, stages)
        tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ8))  # (MMA, 1, 18)
        return tSrK, tSrQ, None

    def _key_row(self, key):
        return key

    def _pt_key(self, m):
        return page_row(m)

    # S^T from shared memory, as the keys-on-M kernel's (ops: K's and Q8's fragments; the
    # stage is the page buffer: _prepare_stage returns it)
    _mma_s = MLADecodeSm90KeysM._mma_s

    @cute.jit
    def _q_ready(self, wg, wq, lane, wtid, tidx) -> list:
        """Both consumer warpgroups, once Q has landed: Q (n x 576, 16-bit, as TMA landed it)
        -> Q8 in e4m3, each row times 448 / its largest |q|; returns the thread's columns'
        amax / 448 (their factors of the softmax scale). A thread takes a (row, 64-wide group)
        run: its amax to sRunMax, barrier 4, the row's amax from its 9 runs, the run quantized
        into Q8, barrier 4. Threads without a run read the last one and store nothing."""
        n = self.n_wg
        runs = n * N_TILES
        run = cutlass.min(tidx, runs - 1)
        row, c = run % n, run // n
        bf16 = self.dtype == cutlass.BFloat16
        run_max = self.d_storage.sRunMax.get_tensor(cute.make_layout(runs))
        scales = self.d_storage.sQScale.get_tensor(cute.make_layout(n))
        words = []
        for u in cutlass.range_constexpr(8):
            words += lds128(self.d_q_base + q_unit(row, c, u, n))
        amax = Float32(0.0)
        for w in words:
            for v in unpack16x2(w, bf16):
                amax = cute.arch.fmax(amax, cute.arch.fmax(v, -v))
        if tidx < runs:
            run_max[run] = amax
        cute.arch.barrier(barrier_id=NB_PAIR, number_of_threads=256)
        amax = run_max[row]
        for t in cutlass.range_constexpr(1, N_TILES):
            amax = cute.arch.fmax(amax, run_max[t * n + row])
        inv = Float32(0.0)
        if amax > 0.0:
            inv = Float32(E4M3_MAX) / amax
        out = []
        for i in cutlass.range_constexpr(16):
            a = unpack16x2(words[2 * i], bf16)
            b = unpack16x2(words[2 * i + 1], bf16)
            out.append(e4m3x4(a[0] * inv, a[1] * inv, b[0] * inv, b[1] * inv))
        if tidx < runs:
            q8 = self.d_storage.sQ8.data_ptr().toint()
            for u in cutlass.range_constexpr(4):
                sts(q8 + ring_offset(row, 64 * c + 16 * u, n), out[4 * u:4 * u + 4])
            if c == 0:
                scales[row] = amax * Float32(1.0 / E4M3_MAX)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=NB_PAIR, number_of_threads=256)
        return [scales[8 * (jc // 2) + 2 * (lane % 4) + jc % 2] for jc in range(n // 4)]


def decode_kernel(config, arch: str):
    """The kernel a registry config asks for (dtype, causal, columns); arch is sm_90a."""
    from ..contract import dsl_dtype

    return MLADecodeSm90KeysMFast(dsl_dtype(config.dtype), config.causal, config.columns)
