"""Portable MLA decode (SM80-class instructions, every GPU from sm_80 to sm_120), in CuTe DSL.

Problem: as sm90_decode.py. For each request r with L_r cached latents (576 = 512 + 64 wide)
and s_q * h_q query rows, out = softmax(scale * Q K^T) V with K = the latent, V = its first
512 columns. Same work split (torch_mla.scheduling: grid (m-blocks, parts), a part walks its
piece of the block stream request by request), same outputs: a request done by one part is
written in the output dtype with its lse; a request cut across parts writes fp32 partials
(outputs already divided by their own sums, log2-domain lse) into its workspace slots, which
combine.py merges.

Instructions: cp.async (16 bytes, L1 bypass) for Q and the cache, ldmatrix (.trans for V) from
swizzled shared memory, mma.sync m16n8k16 bf16/fp16 with fp32 accumulators, named barriers.
Nothing from SM90 on (no TMA, wgmma, mbarriers), so one source compiles for sm_80 ... sm_120.

CTA: block_m query rows x all keys of the segment, taken block_n keys (a stage) at a time;
warps in quads, one quad per 32 query rows (block_m / 32 quads, 8 warps for block_m = 64).
Output O (block_m x 512 fp32) is split by columns: warp `quarter` of a quad owns the quad's 32
rows x output columns [128 quarter, 128 quarter + 128) (2 m16 tiles x 16 n8 tiles, 128 fp32
registers a thread). S = Q K^T is split over keys and k: warp `quarter` computes partial S of the
quad's 32 rows (both row groups) against keys [half * block_n / 2, ...) of each stage (half =
quarter % 2) over half of the 36 k-steps (kh = quarter // 2: 4 of the 8 64-column atoms of the
latent and 2 k-steps of the rope atom); per k-step 2 Q + 2 K ldmatrix.x4 feed 8 mma at block_n
64 (0.5 a mma; 0.75 when a warp scored 16 rows over all k). The warps of a pair (same keys,
other kh) then add: warp kh keeps row group 2 quad + kh and hands the other's partial (16 x
block_n / 2 fp32) to its partner through shared memory (exchange_offsets: P's rows of the quad,
and the rope columns of the stage being scored, once every warp has done its rope k-steps: the
rope barriers, below).
Per stage:
    S partials = Q_quad K_half^T over k half kh (18 k-steps)   (ldmatrix Q and K, mma.sync)
    partial of the other row group -> smem, quad barrier, + the partner's: S of row group rg
    mask keys past each row's horizon (boundary stages only)
    row max -> smem, quad barrier; the max of both halves for all 32 rows -> running max,
        rescale O (every warp of the quad the same values), the sum of its own rows
    P = exp2(S * scale - max) -> smem (dtype), quad barrier
    O_quarter += P V[:, quarter]  (P of 32 rows from smem by ldmatrix, V by ldmatrix.trans, 64
        columns at a time: per k16 step 2 P + 8 V ldmatrix.x4 for 32 mma; a warp of a pair
        owning all 512 columns of 16 rows needed 1 P + 16 V)
Each warp keeps the row sum of its own rows and keys; the two halves are added in the epilogue.
Per 64-key stage and warp: 72 ldmatrix.x4 for S, 40 for P V (112; 148 with S over all k, 176
with pairs), and 2 KB of fp32 each way for the exchange.

Lag: where both quads of a CTA have rows (block_m 64, more than 32 rows), quad 1 runs the P V
of stage t after the barrier that opens stage t + 1 and quad 0 before it, so that quad 1's P V
(mma-bound) runs beside quad 0's Q K^T (ldmatrix-bound) and each quad's softmax and barriers
beside the other's MMAs (in step, the two quads' warps on an SM sub-partition wait for the same
resource). The buffer of stage t - 1 then refills only once quad 1's P V has read it: quad 1's
threads issue their copies of columns 0..511 after it, quad 0's after their S exchange and a
named barrier (LAG_BARRIER) that quad 1 arrives at after its P V; the rope columns (512..575),
which P V does not read, every thread issues at the turn's start. H200, same run
(docs/kernel-notes.md): 128x8192 h_q 64 522.8 -> 510.3 us, h_q 128 977.6 -> 943.5, s_q 2
causal 1906.6 -> 1730.6.

Rope barriers (block_m 64): the S exchange's k-half-1 slots overlay the rope columns of the
stage being scored, so a quad writes them only once every warp of the CTA has done its rope
k-steps: each warp arrives at the other quad's rope barrier (ROPE_BARRIER + other quad) after
those k-steps and waits at its own before the exchange; a quad without rows arrives and waits
in their place. Barriers whose warps meet from different instructions (the stage barrier's
two sites, the quads' and the lag's and the rope's) are barrier.sync / barrier.arrive without
.aligned (bar_sync, bar_arrive); only the segment's first __syncthreads is aligned.

Pipeline: `stages` shared-memory buffers of block_n keys x 576 (a stage is part of one page).
Stage t + stages - 1 is loaded (cp.async, one commit group per stage) while stage t is
computed; one __syncthreads per stage both publishes the landed stage and retires the one
about to be refilled (but for a late quad's P V, above). Turn t of the loop opens with the P V
of stage t - 1; a last turn holds only the last stage's. The block-table entry of the next
stage is read a stage ahead. Rows of a stage past L are zero-filled instead of loaded (the
cache may hold NaN there and 0 * NaN = NaN); their scores are masked. An early quad's copies of
columns 0..511 are issued later in the turn than the rest (see Lag), in the same commit group.
Q (block_m x 576) loads with the segment's first stage; query rows past s_q * h_q are
zero-filled; a quad with none of them skips the math, and a 16-row group of them
in a working quad skips its S and its P V mma.sync (predicated off); the S exchange still runs
(on zeros).

Tiles per arch (Sm80DecodeConfig.from_heuristic, from the shared memory a block may use; Q +
stages + P):
    227 KB (sm_90, sm_100, sm_103, sm_110): block_m 64, block_n 64, 2 stages: 72 + 144 + 8 KB
    163 KB (sm_80, sm_87):                  block_m 64, block_n 32, 2 stages: 72 + 72 + 4 KB
    99 KB (sm_86, sm_89, sm_120, sm_121):   block_m 32, block_n 16, 3 stages: 36 + 54 + 1 KB
All three ran on the H200 (forced; the smaller two with check_portable.py --tiles, session 3,
before the warp-quad tiling); none has run on its own arch. block_m 32
doubles the m-blocks of the grid (the schedule's parts assume 64-row m-blocks, so such a grid
takes more than one wave). Registers (ptxas 13.0): 255
(64x64x2, sm_90a, with 8 bytes of spill: two loop-invariant words stored once and reloaded 5
times a turn), 247 (32x16x3, sm_86, no spill); O alone is 128. The PTX has no local memory. The
S exchange needs no shared memory of its own (227 KB leave 1 KB spare at 64x64x2).

Masking and empty rows as sm90_decode.py: keys at or past a row's horizon (L, or
L - s_q + i + 1 for causal query token i) get -inf; a row that sees no key has sum 0: output 0,
lse +inf (lse -inf in a partial). The walk stops at the block table's width and page ids are
clamped into the cache, so bad inputs never read outside the cache or the table.

Limits: d_qk = 576, d_v = 512, page 64, bf16/fp16, s_q * h_q any, one latent head per launch
(h_kv > 1: one launch per head over a strided view). Compiled per (dtype, causal, arch);
batch, s_q, h_q, the cache size and its strides are runtime values.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from ..constants import D_QK, D_V, PAGE_SIZE
from . import softmax, splitkv
from .decode_base import DecodeKernel, Fp8Args, SplitKVTensors, aligned, shared_struct
from .ptx import bar_arrive, bar_sync

K_STEPS = D_QK // 16  # mma k-steps of Q K^T
QUARTER_V = D_V // 4  # output columns per warp
V_CHUNK = 64  # output columns per P @ V pass (bounds the live V fragments)
LAG_BARRIER = 3  # named barrier: the late quad released a buffer (ids 1, 2: the quads)
ROPE_BARRIER = 4  # 4 + quad: all reads of the rope columns that quad's exchange slots overlay

_SMEM_BYTES = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376,
               "sm_90": 232448, "sm_100": 232448, "sm_103": 232448, "sm_110": 232448,
               "sm_120": 101376, "sm_121": 101376}


def smem_per_block(arch: str) -> int:
    """Shared memory one block may use on arch ("sm_86", "sm_90a", ...), in bytes (CUDA's
    opt-in maximum); unknown arches get the smallest figure."""
    base = arch.rstrip("af") if arch[-1] in "af" and arch[-2].isdigit() else arch
    return _SMEM_BYTES.get(base, 101376)


@dataclasses.dataclass(frozen=True)
class Sm80DecodeConfig:
    """Tile shape and pipeline depth of the portable kernel."""

    block_m: int  # query rows per CTA: 64 or 32 (32 per quad of warps)
    block_n: int  # keys per stage: 64, 32 or 16 (divides the 64-key page)
    stages: int  # shared-memory buffers of block_n keys

    @classmethod
    def from_heuristic(cls, arch: str) -> "Sm80DecodeConfig":
        smem = smem_per_block(arch)
        # (The smaller shapes were timed on the H200 only, forced.) Each warp re-reads its Q
        # rows from shared memory every stage, so the widest stage that fits double-buffered
        # halves that traffic (70 KB of ldmatrix per warp and 64 keys against 88 KB at block_n
        # 32).
        if smem >= 224 * 1024:  # sm_90/100/103/110: 225 KB of 227
            return cls(64, 64, 2)
        if smem >= 160 * 1024:  # sm_80/87: 149 KB of 163
            return cls(64, 32, 2)
        return cls(32, 16, 3)  # sm_86/89/120/121: 92 KB of 99

    @property
    def num_threads(self) -> int:
        return self.block_m // 32 * 4 * 32  # a quad of warps per 32 rows

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        return (elem_bytes * (self.block_m * D_QK + self.stages * self.block_n * D_QK
                              + self.block_m * self.block_n) + 4 * 4 * self.block_m)

    def __post_init__(self):
        assert self.block_m in (32, 64) and self.block_n in (16, 32, 64), self
        assert self.stages >= 2, self
        # Global -> shared copies: rows of 8 threads must tile Q and a stage.
        assert self.num_threads // 8 <= self.block_n, self


def _smem_atom(cols: int):
    """Swizzled 8-row atom of `cols` 16-bit elements: ldmatrix reads of 8 rows x 16 bytes hit
    distinct banks."""
    bits = {64: 3, 32: 2, 16: 1, 8: 0}[cols]
    return cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0,
                                     cute.make_layout((8, cols), stride=(cols, 1)))


def smem_layouts(cfg: Sm80DecodeConfig):
    """Shared-memory layouts (element offsets): Q (block_m, 576), the stage buffers (block_n,
    576, stages) and P (block_m, block_n)."""
    bm, bn, st = cfg.block_m, cfg.block_n, cfg.stages
    sQ = cute.tile_to_shape(_smem_atom(64), (bm, D_QK), (0, 1))
    sK = cute.tile_to_shape(_smem_atom(64), (bn, D_QK, st), (0, 1, 2))
    # P from atoms block_n / 2 wide, so that the half each warp writes (a view at a runtime
    # offset) starts on an atom. A view at a runtime offset inside a swizzle atom gets the offset
    # twice, in its pointer and in its layout (nvidia-cutlass-dsl 4.8.1): with block_n-wide atoms
    # the second warp of a pair wrote its P block_n / 2 elements too far, partly over its
    # partner's, and P V read stale shared memory for its keys (H200: lse right, outputs wrong).
    sP = cute.tile_to_shape(_smem_atom(bn // 2), (bm, bn), (0, 1))
    return sQ, sK, sP


def warp_views(cfg: Sm80DecodeConfig, sK: cute.Tensor, sP: cute.Tensor, quarter):
    """The views of warp `quarter` (runtime 0..3) of a quad: the keys of every stage it scores
    (half = quarter % 2: (block_n / 2, 576, stages)), its columns of P (block_m, block_n / 2),
    and V^T of its output columns in 64-column chunks [(64, block_n, stages)] * 2. Each starts
    on a swizzle atom (see smem_layouts); sK and sP may also be identity tensors of those
    shapes (tests)."""
    bm, bn, st = cfg.block_m, cfg.block_n, cfg.stages
    half = quarter % 2
    sK_half = cute.local_tile(sK, (bn // 2, D_QK, st), (half, 0, 0))
    sP_half = cute.local_tile(sP, (bm, bn // 2), (0, half))
    # V^T (d, keys, stages) viewed in the K buffers.
    sVt = cute.composition(sK, cute.make_layout((D_V, bn, st), stride=(bn, 1, bn * D_QK)))
    n_chunks = QUARTER_V // V_CHUNK
    sV = [cute.local_tile(sVt, (V_CHUNK, bn, st), (quarter * n_chunks + c, 0, 0))
          for c in range(n_chunks)]
    return sK_half, sP_half, sV


def q_views(tSsQ: cute.Tensor):
    """ldmatrix sources of Q for the second row group of a quad from those of the first: 16 rows
    further is two whole swizzle atoms (1024 elements, above the swizzled bits), so one base
    address serves both with an immediate offset."""
    return [tSsQ, cute.make_tensor(tSsQ.iterator + 16 * 64, tSsQ.layout)]


def k_half_view(t: cute.Tensor, rows: int, kh) -> cute.Tensor:
    """A view of Q (rows = block_m) or K (rows = block_n), or a partition of one, 256 columns
    (4 swizzle atoms) further for kh = 1: k-step j of warp kh is k-step 16 kh + j there."""
    return cute.make_tensor(t.iterator + cute.assume(kh * 4 * rows * 64, divby=512), t.layout)


def exchange_offsets(cfg: Sm80DecodeConfig, quad, half, stage):
    """Byte offsets of the two slots through which the warps of pair (quad, key half `half`)
    hand each other the partial S of the other's row group (16 rows x block_n / 2 fp32 =
    32 block_n bytes each): the k-half-0 warp writes into sP at the first offset (the quad's rows
    of P's columns `half`: P is written only after the quad's row max barrier, which follows the
    reads), the k-half-1 warp into the K buffer `stage` at the second: the rope columns
    (512..575) of block_n / 4 keys of the stage being scored, once every warp that reads them
    has done its rope k-steps (the rope barriers, MLADecodeSm80._stage; P V reads columns
    0..511 only, and the buffer refills after the next stage barrier). The four slots of a CTA
    fill the stage's rope columns. Plain ints or runtime Int32 alike."""
    bm, bn = cfg.block_m, cfg.block_n
    in_p = 2 * (half * bm * (bn // 2) + quad * 32 * (bn // 2))
    key = (2 * quad + half) * (bn // 4)  # a slot is bn / 4 keys x 64 rope columns x 2 bytes
    in_k = 2 * (stage * bn * D_QK + (D_V // 64) * bn * 64 + key * 64)
    return in_p, in_k


def tiled_mmas(cfg: Sm80DecodeConfig, dtype):
    """The tiled MMAs of Q K^T and P V: one warp per 16 rows. In Q K^T the warps of a pair
    each use the tiling for their own keys; in P V a warp takes the places of the warps of both
    row groups of its quad (thread (2 quad + m) * 32 + lane)."""
    bm, bn = cfg.block_m, cfg.block_n
    mma_op = warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16))
    tiled_qk = cute.make_tiled_mma(mma_op, (bm // 16, 1, 1),
                                   permutation_mnk=(bm, min(16, bn // 2), 16))
    tiled_pv = cute.make_tiled_mma(mma_op, (bm // 16, 1, 1), permutation_mnk=(bm, 16, 16))
    return tiled_qk, tiled_pv


class KVSource(NamedTuple):
    """Where a stage's keys come from: the cache (num_blocks, 64, 576; a subclass's bytes), the
    table the walk reads (the block table; sparse decode's index rows), for kernels that mask
    entries (masks_entries) the per-stage key bias in shared memory (block_n, stages), else
    None, and the shared-memory byte address of the stage buffers (for stores that do not go
    through tKsK: sparse decode's FP8 gather)."""

    kv: cute.Tensor
    table: cute.Tensor
    bias: cute.Tensor | None
    k_base: Int32


class MLADecodeSm80(DecodeKernel):
    """Split-KV MLA decode on SM80-class instructions; see the module docstring."""

    # A subclass whose table can name no key for some entries (sparse decode) sets this: each
    # stage then has a bias row (0 or -inf per key, written by _load_kv) added to its scores.
    masks_entries = False

    def __init__(self, dtype, causal: bool, config: Sm80DecodeConfig, use_pdl: bool = False,
                 lag: bool = True):
        self.dtype = dtype
        self.causal = bool(causal)
        self.cfg = config
        # lag: with two working quads, quad 1 runs P V half a stage late (module docstring).
        self.lag = bool(lag) and config.block_m == 64
        # use_pdl (sm_90 and later): let the combine kernel (launched with programmatic
        # dependent launch) start early; it waits for this grid before reading the partials.
        self.use_pdl = bool(use_pdl)
        self.num_threads = config.num_threads
        self.block_m = config.block_m

    # ------------------------------------------------------------------------------------------
    # host side: layouts, copies, MMAs, shared storage (DecodeKernel.__call__ launches)
    # ------------------------------------------------------------------------------------------
    def _prepare(self, mQ: cute.Tensor, mKV: cute.Tensor, fp8: tuple):
        """(mQ, mKV) and the layouts, copies and MMAs the kernel takes; self.shared_storage
        (traced inside __call__: mQ, mKV are its arguments, or a subclass's views of the same
        shapes)."""
        dt = self.dtype
        bm = self.cfg.block_m
        bn, st = self.cfg.block_n, self.cfg.stages
        bias_len = bn * st if self.masks_entries else 0
        sQ_layout, sK_layout, sP_layout = smem_layouts(self.cfg)

        # Global -> shared: rows of 8 threads x 16 bytes (one 64-column swizzle atom).
        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                  dt, num_bits_per_copy=128)
        gmem_copy = cute.make_tiled_copy_tv(
            g2s, cute.make_ordered_layout((self.num_threads // 8, 8), order=(1, 0)),
            cute.make_layout((1, 8)))
        tiled_qk, tiled_pv = tiled_mmas(self.cfg, dt)

        self.shared_storage = shared_struct(
            sQ=aligned(dt, cute.cosize(sQ_layout)),
            sK=aligned(dt, cute.cosize(sK_layout)),
            sP=aligned(dt, cute.cosize(sP_layout)),
            sMax=cute.struct.MemRange[Float32, 2 * bm],
            sSum=cute.struct.MemRange[Float32, 2 * bm],
            # (key, stage): 0 or -inf; empty without masks_entries
            sBias=cute.struct.MemRange[Float32, bias_len],
        )
        # (fp8: kv_fp8 subclasses read its kv_scale, the cache's per-tensor scale)
        return (mQ, mKV), (fp8, sQ_layout, sK_layout, sP_layout, gmem_copy, tiled_qk, tiled_pv)

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def body(self, inputs: tuple, tensors: SplitKVTensors, scale_log2: Float32, fp8: Fp8Args,
             sQ_layout, sK_layout, sP_layout, gmem_copy, tiled_qk, tiled_pv):
        mQ, mKV = inputs  # the tensors themselves: the kernel copies with cp.async
        mKVScale = fp8.kv_scale  # kv_fp8: (1,) fp32, the cache's scale; else None
        mBlockTable, mSeqlens, mMeta, mNumSplits, mO, mLSE, mOacc, mLSEacc = tensors
        bm, bn, st = self.cfg.block_m, self.cfg.block_n, self.cfg.stages
        dt = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        m_block, part, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(tidx // 32)
        rg = warp_idx // 2  # S after the exchange: rows [16 rg, 16 rg + 16) of the CTA tile
        half = warp_idx % 2  # S: keys [half bn / 2, half bn / 2 + bn / 2) of a stage
        quad = warp_idx // 4  # O: rows [32 quad, 32 quad + 32), row groups 2 quad, 2 quad + 1
        quarter = warp_idx % 4  # O: columns [128 quarter, 128 quarter + 128)
        kh = quarter // 2  # S partials: k-steps [16 kh, 16 kh + 16) and 32 + 2 kh + {0, 1};
        # keeps row group 2 quad + kh
        lane = tidx % 32
        mma_tid = rg * 32 + lane  # this thread in its half's tiled MMA (Q K^T)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout)
        sK = storage.sK.get_tensor(sK_layout)  # (bn, 576, stages)
        sP = storage.sP.get_tensor(sP_layout)  # (bm, bn)
        sMax = storage.sMax.get_tensor(cute.make_layout((bm, 2)))  # (row, half)
        sSum = storage.sSum.get_tensor(cute.make_layout((bm, 2)))
        sBias = None
        if const_expr(self.masks_entries):
            sBias = storage.sBias.get_tensor(cute.make_layout((bn, st)))
        sP_base = storage.sP.data_ptr().toint()
        sK_base = storage.sK.data_ptr().toint()
        src = KVSource(mKV, mBlockTable, sBias, sK_base)
        if const_expr(self.kv_fp8):
            # A per-tensor scaled e4m3 cache lands as its exact e4m3 values: K's scale joins the
            # scores' and V's the epilogue's factor (as the SM90 kernels fold it).
            kv_scale = mKVScale[0]
            scale_log2 = scale_log2 * kv_scale
            self.d_v_scale = kv_scale

        if const_expr(self.use_pdl):
            # The combine kernel may start now; it waits for this grid before reading.
            cute.arch.griddepcontrol_launch_dependents()

        # Global -> shared partitions (every thread loads).
        thr_g2s = gmem_copy.get_slice(tidx)
        tQsQ = thr_g2s.partition_D(sQ)
        tQcQ = thr_g2s.partition_S(cute.make_identity_tensor((bm, D_QK)))
        tKsK = thr_g2s.partition_D(sK)  # (CPY, CPY_N, CPY_K, stages)
        tKcK = thr_g2s.partition_S(cute.make_identity_tensor((bn, D_QK)))

        sK_half, sP_half, sV = warp_views(self.cfg, sK, sP, quarter)

        # S = Q K_half^T: partials of the quad's two row groups (the thread stands in for lane
        # `lane` of the warp of row group 2 quad + m, m = 0, 1) x this warp's keys, over its half
        # of the k-steps; both share the K fragments.
        thr_qk = tiled_qk.get_slice(mma_tid)
        thr_q = tiled_qk.get_slice(2 * quad * 32 + lane)
        tSrQ = [thr_q.make_fragment_A(thr_q.partition_A(sQ)) for _ in range(2)]  # (MMA, 1, 36)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK_half[None, None, 0]))
        acc_S = [cute.make_rmem_tensor(thr_qk.partition_shape_C((bm, bn // 2)), Float32)
                 for _ in range(2)]
        tScS = thr_qk.partition_C(cute.make_identity_tensor((bm, bn // 2)))
        ld_Q = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), dt), tiled_qk
        ).get_slice(2 * quad * 32 + lane)
        ld_K = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4 if bn // 2 >= 16 else 2), dt),
            tiled_qk,
        ).get_slice(mma_tid)
        tSsQ = ld_Q.partition_S(sQ)
        # k-steps of this warp (kh = quarter // 2): [16 kh, 16 kh + 16), which is 4 swizzle
        # atoms of columns further for kh = 1 (a pointer offset: the addresses stay one base +
        # immediates, as with compile-time k), and 32 + 2 kh + {0, 1} of the rope atom (4
        # addresses a thread at a runtime k).
        tSsQ_lo = q_views(k_half_view(tSsQ, bm, kh))
        tSsQ = q_views(tSsQ)
        tSrQ_v = [ld_Q.retile(x) for x in tSrQ]
        tSsK = ld_K.partition_S(sK_half)  # (CPY, CPY_N, 36, stages)
        tSsK_lo = k_half_view(tSsK, bn, kh)
        tSrK_v = ld_K.retile(tSrK)

        # P: this warp's keys of its row group (accumulator order) -> smem; the quad's two row
        # groups, all keys, back as A: the thread stands in for lane `lane` of the warp of row
        # group 2 quad + m of the tiled MMA (m = 0, 1).
        st_P = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt, num_bits_per_copy=32), tiled_qk
        ).get_slice(mma_tid)
        tPsP = st_P.partition_D(sP_half)
        pv_tid = [(2 * quad + m) * 32 + lane for m in range(2)]
        thr_pv = [tiled_pv.get_slice(x) for x in pv_tid]
        ld_P = [cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), dt), tiled_pv
        ).get_slice(x) for x in pv_tid]
        tOrP = [thr.make_fragment_A(thr.partition_A(sP)) for thr in thr_pv]  # (MMA, 1, bn / 16)
        tOsP = [ld.partition_S(sP) for ld in ld_P]
        tOrP_v = [ld.retile(x) for ld, x in zip(ld_P, tOrP)]

        # O_quarter += P V, 64 output columns at a time; the B operand (V) does not depend on
        # the row group, so both row groups' MMAs share its fragments.
        ld_V = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), dt), tiled_pv
        ).get_slice(pv_tid[0])
        n_chunks = QUARTER_V // V_CHUNK
        tOsV = [ld_V.partition_S(x) for x in sV]  # (CPY, CPY_N, CPY_K, stages) per chunk
        tOrV = [thr_pv[0].make_fragment_B(thr_pv[0].partition_B(x[None, None, 0])) for x in sV]
        tOrV_v = [ld_V.retile(x) for x in tOrV]
        # acc_O[m][c]: rows of row group 2 quad + m, columns 128 quarter + 64 c + [0, 64)
        acc_O = [[cute.make_rmem_tensor(thr_pv[0].partition_shape_C((bm, V_CHUNK)), Float32)
                  for _ in range(n_chunks)] for _ in range(2)]
        tOcO = thr_pv[0].partition_C(cute.make_identity_tensor((bm, V_CHUNK)))

        rows = mO.shape[1]
        h_q = mLSE.shape[1]
        s_q = mLSE.shape[2]
        width = self._table_blocks(mBlockTable)
        num_pages = mKV.shape[0]
        # A quad with no query row skips the math, and in a quad whose second row group has
        # none that group's S and P V (h_q * s_q < 64: memory-bound rows).
        valid_rows = cutlass.min(rows - m_block * bm, bm)
        active = quad * 32 < valid_rows
        hi_on = quad * 32 + 16 < valid_rows
        # Both quads working: quad 1 lags (its P V of stage t runs at the start of stage t + 1)
        late = False
        early = False
        if const_expr(self.lag):
            lagging = cutlass.select_(valid_rows > 32, 1, 0)
            late = lagging * quad == 1
            early = lagging * (1 - quad) == 1
        r_a = rg * 16 + lane // 4  # the two S rows this thread holds: r_a and r_a + 8
        g_a = m_block * bm + r_a

        # running max (log2 domain) of the O rows this thread holds: 32 quad + lane // 4 +
        # 16 m + 8 h at index 2 m + h (the same in every warp of the quad)
        m_run = cute.make_rmem_tensor(4, Float32)
        l_run = cute.make_rmem_tensor(2, Float32)  # this thread's sum over its keys, S rows
        # block-table entries of the next stage [0] and of the one loading now [1]
        page_next = cute.make_rmem_tensor(2, Int32)

        walk = splitkv.read_part(mMeta, part)

        for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
            L = mSeqlens[r]
            lo, hi = splitkv.segment(walk, r, L, width, mNumSplits[r + 1] - mNumSplits[r])
            # (An empty cache has nothing to walk: page ids are clamped into it.)
            if num_pages == 0:
                hi = 0
            if lo < hi:
                key_lo = lo * PAGE_SIZE
                n_tiles = (cutlass.min(hi * PAGE_SIZE, L) - key_lo + bn - 1) // bn
                split_idx = splitkv.split_index(walk, r)
                slot = mNumSplits[r] + split_idx
                pieces = mNumSplits[r + 1] - mNumSplits[r]
                border_a = softmax.row_border(L, g_a, rows, h_q, s_q, self.causal)
                border_b = softmax.row_border(L, g_a + 8, rows, h_q, s_q, self.causal)
                min_border = softmax.row_border(L, m_block * bm, rows, h_q, s_q, self.causal)

                # Everyone is done with the previous segment's shared memory.
                cute.arch.sync_threads()
                self._load_q(mQ, r, m_block, rows, tQsQ, tQcQ, thr_g2s, gmem_copy)
                for s in cutlass.range_constexpr(st - 1):
                    if s < n_tiles:
                        page = self._page(mBlockTable, r, lo, hi, s, num_pages)
                        self._load_kv(src, page, key_lo, s, s, L, tKsK, tKcK, thr_g2s,
                                      gmem_copy)
                    cute.arch.cp_async_commit_group()
                page_next[0] = self._page(mBlockTable, r, lo, hi, st - 1, num_pages)
                for m in cutlass.range_constexpr(2):
                    for c in cutlass.range_constexpr(n_chunks):
                        acc_O[m][c].fill(0.0)
                m_run.fill(-Float32.inf)
                l_run.fill(0.0)

                # P V of stage t - 1 opens turn t (turn n_tiles has only that). A late quad
                # passes the stage barrier before it, every other quad after it.
                for t in cutlass.range(n_tiles + 1, unroll=1):
                    if late:
                        cute.arch.cp_async_wait_group(st - 2)
                        bar_sync(0, self.num_threads)
                    if active and t > 0:
                        self._pv((t - 1) % st, hi_on, ld_P, tOsP, tOrP, tOrP_v, ld_V, tOsV, tOrV,
                                 tOrV_v, acc_O, tiled_pv)
                    if not late:
                        cute.arch.cp_async_wait_group(st - 2)
                        # Stage t landed for every thread, and stage t - 1 (refilled next) is
                        # free but for a late quad's P V.
                        bar_sync(0, self.num_threads)
                    t_load = t + st - 1
                    if const_expr(self.lag):
                        if late:
                            # Its P V of stage t - 1 is done: P may take this stage's S
                            # exchange, and that stage's buffer may refill.
                            self._quad_barrier(quad)
                            if t_load < n_tiles:
                                bar_arrive(LAG_BARRIER, 2 * 128)
                    if t_load < n_tiles:
                        # (An early quad loads columns 0..511 of its rows after the late one's
                        # P V, in _stage; the rope columns P V does not read.)
                        self._load_kv(src, page_next[0], key_lo, t_load, t_load % st, L, tKsK,
                                      tKcK, thr_g2s, gmem_copy, (D_V // 64, 9))
                        if not early:
                            self._load_kv(src, page_next[0], key_lo, t_load, t_load % st, L,
                                          tKsK, tKcK, thr_g2s, gmem_copy, (0, D_V // 64))
                        page_next[1] = page_next[0]
                        page_next[0] = self._page(mBlockTable, r, lo, hi, t_load + 1,
                                                  num_pages)
                    if active and t < n_tiles:
                        x_p, x_k = exchange_offsets(self.cfg, quad, half, t % st)
                        self._stage(t % st, key_lo + t * bn, border_a, border_b, min_border,
                                    scale_log2, half, kh, rg, quad, hi_on, lane, r_a, acc_S,
                                    tScS, tSsQ, tSsQ_lo, tSrQ, tSrQ_v, tSsK, tSsK_lo, tSrK,
                                    tSrK_v, st_P, tPsP, ld_P, tOsP, tOrP, tOrP_v, ld_V, tOsV,
                                    tOrV, tOrV_v, acc_O, ld_Q, ld_K, tiled_qk, tiled_pv, sMax,
                                    m_run, l_run,
                                    sP_base + x_p, sK_base + x_k, t_load < n_tiles, src,
                                    page_next[1], key_lo, t_load, L, tKsK, tKcK, thr_g2s,
                                    gmem_copy, early)
                    if const_expr(self.cfg.block_m == 64):
                        if not active and t < n_tiles:
                            # Quad 1 without rows stands in at the rope barriers (_stage).
                            bar_arrive(ROPE_BARRIER, self.num_threads)
                            bar_sync(ROPE_BARRIER + 1, self.num_threads)
                    # One group a stage (an early quad's columns 0..511 issued in _stage).
                    cute.arch.cp_async_commit_group()
                if active:
                    self._epilogue(acc_O, tOcO, m_run, l_run, sSum, half, quad, quarter, lane,
                                   r_a, m_block, r, slot, pieces, rows, h_q, mO, mLSE, mOacc,
                                   mLSEacc)
            else:
                splitkv.empty_segment(walk, r, lo, L, mNumSplits[r + 1] - mNumSplits[r],
                                      mNumSplits[r], mO, mLSE, mLSEacc, m_block * bm,
                                      valid_rows, h_q, tidx, self.num_threads)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _page(self, mBlockTable, r: Int32, lo: Int32, hi: Int32, t: Int32,
              num_pages: Int32) -> Int32:
        """Cache page of stage t of the segment [lo, hi) of request r: the column is clamped
        into the segment (stages past its end read its last entry, unused) and the id into
        the cache, so that neither read leaves its tensor whatever the inputs hold."""
        col = cutlass.min(lo + t * self.cfg.block_n // PAGE_SIZE, hi - 1)
        page = mBlockTable[r, col]
        return cutlass.max(cutlass.min(page, num_pages - 1), 0)

    @cute.jit
    def _load_q(self, mQ, r: Int32, m_block: Int32, rows: Int32, tQsQ, tQcQ, thr_g2s,
                gmem_copy):
        """Q rows of this m-block -> sQ (cp.async, uncommitted); rows past `rows` -> 0."""
        bm = self.cfg.block_m
        gQ = cute.local_tile(mQ[r, None, None], (bm, D_QK), (m_block, 0))
        tQgQ = thr_g2s.partition_S(gQ)
        limit = rows - m_block * bm
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if tQcQ[0, m, 0][0] < limit:
                cute.copy(gmem_copy, tQgQ[None, m, None], tQsQ[None, m, None])
            else:
                tQsQ[None, m, None].fill(0.0)

    @cute.jit
    def _load_kv(self, src, page: Int32, key_lo: Int32, t: Int32, stage: Int32, L: Int32,
                 tKsK, tKcK, thr_g2s, gmem_copy, cols: cutlass.Constexpr = (0, 9)):
        """Keys [key_lo + t bn, + bn) of the segment (inside page `page`), 64-column tiles
        [cols[0], cols[1]) -> buffer `stage` (cp.async, uncommitted). Keys at or past L are
        zero-filled, never read."""
        bn = self.cfg.block_n
        key0 = key_lo + t * bn
        gK = cute.local_tile(src.kv[page, None, None], (bn, D_QK), ((key0 % PAGE_SIZE) // bn, 0))
        tKgK = thr_g2s.partition_S(gK)
        limit = L - key0
        for n in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
            for c in cutlass.range_constexpr(cols[0], cols[1]):
                if tKcK[0, n, 0][0] < limit:
                    cute.copy(gmem_copy, tKgK[None, n, c], tKsK[None, n, c, stage])
                else:
                    tKsK[None, n, c, stage].fill(0.0)

    @cute.jit
    def _quad_barrier(self, quad: Int32):
        # The four warps of quad `quad` (ids 1..2; 0 is __syncthreads).
        bar_sync(1 + quad, 128)

    @cute.jit
    def _stage(self, stage: Int32, key0: Int32, border_a: Int32, border_b: Int32,
               min_border: Int32, scale_log2: Float32, half: Int32, kh: Int32, rg: Int32,
               quad: Int32, hi_on, lane: Int32, r_a: Int32, acc_S, tScS, tSsQ, tSsQ_lo, tSrQ,
               tSrQ_v, tSsK, tSsK_lo, tSrK, tSrK_v, st_P, tPsP, ld_P, tOsP, tOrP, tOrP_v, ld_V,
               tOsV, tOrV, tOrV_v, acc_O, ld_Q, ld_K, tiled_qk, tiled_pv, sMax, m_run, l_run,
               x_p: Int32, x_k: Int32, refill, src, page: Int32, key_lo: Int32, t_load: Int32,
               L: Int32, tKsK, tKcK, thr_g2s, gmem_copy, early):
        """One stage (block_n keys from key0) for this warp: S and softmax, up to P in shared
        memory (its P V opens the next turn, kernel()). x_p, x_k: the shared-memory addresses
        of the S exchange slots (exchange_offsets). If `refill` and `early`, columns 0..511 of
        stage t_load (page `page`) are loaded once the late quad has released the buffer."""
        bn, st = self.cfg.block_n, self.cfg.stages
        half_k = K_STEPS // 2
        # Rope barrier of a quad: its warps wait there before the exchange, the other quad's
        # arrive once they have read the stage's rope columns (a quad without rows too,
        # kernel()). Every warp of the quad waits, not only the k-half-1 ones that write there
        # (a wait in a kh branch became a predicated BAR.SYNC). compute-sanitizer's racecheck
        # reports WAR hazards on this arrive -> wait pair (a rope ldmatrix before the arrive, an
        # exchange store after the wait), which the PTX model orders: a false positive that
        # a racecheck probe (a one-off tool since removed) reproduced with 8 warps, ldmatrix reads
        # and a barrier of the reading quad's own between its arrive and the store, as the lag
        # has here (none with the lag off; docs/log.md, session 7).
        n_rope = self.num_threads
        # S partials of both row groups: 2 x bn / 16 n8 tiles; `chains` interleaved partial sums
        # (k-steps round robin) give 4 independent mma.sync chains when there are fewer tiles.
        chains = max(1, 4 // (bn // 8))
        parts = [[acc_S[m]] + [cute.make_fragment_like(acc_S[m]) for _ in range(chains - 1)]
                 for m in range(2)]
        for m in cutlass.range_constexpr(2):
            for p in cutlass.range_constexpr(chains):
                parts[m][p].fill(0.0)
        # A row group of padding rows (the second, if not hi_on) scores 0, as its zero-filled Q
        # rows would; hi_on is warp-uniform and its branches small (predicated, as in _pv).
        for j in cutlass.range_constexpr(half_k):
            # See tSsQ_lo in kernel(). The two rope k-steps first: in the other order ptxas
            # spilled a few registers at 64x64x2 (sm_90a).
            src_K, src_Q, k = tSsK_lo, tSsQ_lo, j - 2
            if const_expr(j < 2):
                src_K, src_Q, k = tSsK, tSsQ, K_STEPS - 4 + 2 * kh + j
            cute.copy(ld_K, src_K[None, None, k, stage], tSrK_v[None, None, j])
            cute.copy(ld_Q, src_Q[0][None, None, k], tSrQ_v[0][None, None, j])
            acc = parts[0][j % chains]
            cute.gemm(tiled_qk, acc, tSrQ[0][None, None, j], tSrK[None, None, j], acc)
            if hi_on:
                cute.copy(ld_Q, src_Q[1][None, None, k], tSrQ_v[1][None, None, j])
                acc = parts[1][j % chains]
                cute.gemm(tiled_qk, acc, tSrQ[1][None, None, j], tSrK[None, None, j], acc)
            if const_expr(j == 1):
                # This warp has read its rope columns of the stage: the k-half-1 warps may
                # overwrite them with their exchange slots once all such reads are done.
                if const_expr(self.cfg.block_m == 64):
                    bar_arrive(ROPE_BARRIER + 1 - quad, n_rope)
        for m in cutlass.range_constexpr(2):
            for p in cutlass.range_constexpr(1, chains):
                acc_S[m].store(acc_S[m].load() + parts[m][p].load())

        # Exchange with the partner warp (quarter ^ 2: same keys, other k half): each keeps the
        # row group rg = 2 quad + kh and hands over the other's partial. A slot is 16 rows x
        # bn / 2 fp32 in the accumulator order, 4 consecutive values per lane (16-byte accesses
        # of 8 lanes cover 32 banks).
        n_val = cute.size(acc_S[0])
        x_layout = cute.make_layout(((4, n_val // 4), 32), stride=((1, 128), 4))
        a_mine, a_theirs = x_p, x_k
        if kh == 1:
            a_mine, a_theirs = x_k, x_p
        x_mine = cute.make_tensor(
            cute.make_ptr(Float32, a_mine, cute.AddressSpace.smem, assumed_align=16), x_layout)
        x_theirs = cute.make_tensor(
            cute.make_ptr(Float32, a_theirs, cute.AddressSpace.smem, assumed_align=16), x_layout)
        flat = cute.make_layout(n_val)
        s_own = cute.make_tensor(acc_S[0].iterator, flat)
        s_other = cute.make_tensor(acc_S[1].iterator, flat)
        # The quad's own rope reads are done too (each warp did its rope k-steps first).
        bar_sync(ROPE_BARRIER + quad, n_rope)
        if kh == 0:
            cute.autovec_copy(s_other, x_mine[None, lane])
        else:
            cute.autovec_copy(s_own, x_mine[None, lane])
        self._quad_barrier(quad)
        rX = cute.make_rmem_tensor(n_val, Float32)
        cute.autovec_copy(x_theirs[None, lane], rX)
        if kh == 0:
            s_own.store(s_own.load() + rX.load())
        else:
            s_own.store(s_other.load() + rX.load())
        acc_S = acc_S[0]
        if const_expr(self.lag):
            if refill:
                if early:
                    # The late quad's P V has read this buffer: columns 0..511 may refill.
                    bar_sync(LAG_BARRIER, 2 * 128)
                    self._load_kv(src, page, key_lo, t_load, t_load % st, L, tKsK, tKcK,
                                  thr_g2s, gmem_copy, (0, D_V // 64))

        if const_expr(self.masks_entries):
            # Keys no entry names (a subclass's table: sparse decode's -1 entries) score -inf.
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = acc_S[i] + src.bias[half * (bn // 2) + tScS[i][1], stage]
        # Keys at or past a row's horizon (only stages that reach the nearest one).
        if key0 + bn > min_border:
            softmax.mask_keys(acc_S, key0 + half * (bn // 2), border_a, border_b,
                              lambda i: tScS[i][1])

        # Row max over both halves of the keys, for the quad's 32 rows: through smem.
        m_loc = [softmax.row_max(acc_S, 0), softmax.row_max(acc_S, 1)]
        if lane % 4 == 0:
            sMax[r_a, half] = m_loc[0]
            sMax[r_a + 8, half] = m_loc[1]
        self._quad_barrier(quad)
        m_use = [Float32(0.0)] * 4
        scale = [Float32(0.0)] * 4
        for i in cutlass.range_constexpr(4):  # O row 32 quad + lane // 4 + 16 m + 8 h, i = 2 m + h
            row = quad * 32 + lane // 4 + 8 * i
            m_blk = cute.arch.fmax(sMax[row, 0], sMax[row, 1]) * scale_log2
            m_new, m_use[i], scale[i] = softmax.online_max(m_run[i], m_blk)
            m_run[i] = m_new
        # This warp's S rows are those of row group rg = 2 quad + rg % 2.
        hi = rg % 2
        m_use_s = [Float32(0.0)] * 2
        scale_s = [Float32(0.0)] * 2
        for h in cutlass.range_constexpr(2):
            m_use_s[h] = m_use[2 + h] if hi == 1 else m_use[h]
            scale_s[h] = scale[2 + h] if hi == 1 else scale[h]
        softmax.exp_rows(acc_S, m_use_s, [scale_log2, scale_log2], l_run, scale_s)
        # The max of a row rarely moves after the first stages: skip the 128 multiplies then
        # (exact: the factor is exactly 1).
        if scale[0] != 1.0 or scale[1] != 1.0 or scale[2] != 1.0 or scale[3] != 1.0:
            for m in cutlass.range_constexpr(2):
                for c in cutlass.range_constexpr(len(acc_O[m])):
                    softmax.scale_rows(acc_O[m][c], scale[2 * m: 2 * m + 2])

        # P (dtype) -> smem; after the barrier the quad's rows and keys are there. (sMax and sP
        # are single-buffered: the quad's reads of this stage precede their next barrier
        # arrival.)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        cute.copy(st_P, st_P.retile(rP), tPsP)
        self._quad_barrier(quad)

    @cute.jit
    def _pv(self, stage: Int32, hi_on, ld_P, tOsP, tOrP, tOrP_v, ld_V, tOsV, tOrV, tOrV_v,
            acc_O, tiled_pv):
        """O += P V for the quad's rows (the second row group only if hi_on) and this warp's
        columns."""
        # hi_on is warp-uniform and its branches are small: ptxas predicates them (sm_90a: the
        # mma.sync of the second row group are predicated HMMA, no branch in the loop). One
        # if/else around two copies of the loop spilled (392 bytes at 64x64x2).
        for k in cutlass.range_constexpr(self.cfg.block_n // 16):
            cute.copy(ld_P[0], tOsP[0][None, None, k], tOrP_v[0][None, None, k])
            if hi_on:
                cute.copy(ld_P[1], tOsP[1][None, None, k], tOrP_v[1][None, None, k])
            for c in cutlass.range_constexpr(len(tOsV)):
                cute.copy(ld_V, tOsV[c][None, None, k, stage], tOrV_v[c][None, None, k])
                cute.gemm(tiled_pv, acc_O[0][c], tOrP[0][None, None, k],
                          tOrV[c][None, None, k], acc_O[0][c])
                if hi_on:
                    cute.gemm(tiled_pv, acc_O[1][c], tOrP[1][None, None, k],
                              tOrV[c][None, None, k], acc_O[1][c])

    @cute.jit
    def _epilogue(self, acc_O, tOcO, m_run, l_run, sSum, half: Int32, quad: Int32,
                  quarter: Int32, lane: Int32, r_a: Int32, m_block: Int32, r: Int32,
                  slot: Int32, pieces: Int32, rows: Int32, h_q: Int32, mO, mLSE, mOacc,
                  mLSEacc):
        """Normalizes this warp's 32 x 128 of O and writes it (dtype, or the fp32 partial in
        workspace slot `slot` when the request has several pieces), and the lse."""
        bm = self.cfg.block_m
        own = [softmax.row_sum_quad(l_run[0]), softmax.row_sum_quad(l_run[1])]
        if lane % 4 == 0:
            sSum[r_a, half] = own[0]
            sSum[r_a + 8, half] = own[1]
        self._quad_barrier(quad)
        for i in cutlass.range_constexpr(4):  # O row 32 quad + lane // 4 + 16 m + 8 h, i = 2 m + h
            row = quad * 32 + lane // 4 + 8 * i
            total = sSum[row, 0] + sSum[row, 1]
            # A row that saw no key has sum 0: output 0 (and lse +inf below).
            inv = softmax.inv_sum(total)
            if const_expr(self.kv_fp8):
                inv = inv * self.d_v_scale  # V's scale (body())
            g = m_block * bm + row
            if g < rows:
                splitkv.store_result(
                    pieces, lambda t, j, dt, i=i, inv=inv, g=g: self._store_row(
                        acc_O[i // 2], tOcO, inv, i % 2, quarter, dt, t[j, g, None]),
                    mO, mOacc, r, slot, self.dtype)
                if quarter == 0:
                    if lane % 4 == 0:
                        splitkv.store_lse(mLSE, mLSEacc, r, slot, g, pieces, h_q, total,
                                          m_run[i])

    @cute.jit
    def _store_row(self, acc_O, tOcO, inv: Float32, h: cutlass.Constexpr[int], quarter: Int32,
                   out_dtype: cutlass.Constexpr, gRow: cute.Tensor):
        """Row lane // 4 + 8 h of a row group's part of this warp's output columns (acc_O: its
        chunks), times inv, -> gRow (512,) in pairs."""
        pair = cute.make_rmem_tensor(2, out_dtype)
        for c in cutlass.range_constexpr(len(acc_O)):
            for j in cutlass.range_constexpr(cute.size(acc_O[c]) // 4):
                for e in cutlass.range_constexpr(2):
                    pair[e] = (acc_O[c][e + 2 * h + 4 * j] * inv).to(out_dtype)
                col = quarter * QUARTER_V + c * V_CHUNK + tOcO[2 * h + 4 * j][1]
                cute.local_tile(gRow, (2,), (col // 2,)).store(pair.load())


# --- compile entry (ops/registry.py: DecodeStepConfig / DecodeConfig, backend "sm80") ---------


def decode_kernel(config, arch: str):
    """The portable decode kernel a registry config asks for (dtype, causal, tiles: else
    Sm80DecodeConfig.from_heuristic(arch)), for any arch from sm_80."""
    from ..contract import dsl_dtype, has_pdl

    tiles = (Sm80DecodeConfig(*config.tiles) if config.tiles
             else Sm80DecodeConfig.from_heuristic(arch))
    return MLADecodeSm80(dsl_dtype(config.dtype), config.causal, tiles, use_pdl=has_pdl(arch))
