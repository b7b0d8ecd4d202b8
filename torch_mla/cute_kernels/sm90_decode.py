"""MLA decode on Hopper (SM90): split-KV flash decoding over a paged latent cache, in CuTe DSL.

Problem: for each request r with L_r cached latents (576 = 512 + 64 wide) and s_q * h_q query rows,
    out = softmax(scale * Q K^T) V,   K = latent (all 576 columns), V = its first 512 columns.

Work split (torch_mla.scheduling): a grid of (num_m_blocks, num_parts) CTAs, one wave. CTA
(m, p) takes query rows [64 m, 64 m + 64) of every request segment in part p's piece of the
block stream; a request cut across parts writes fp32 partial results that combine.py merges.

CTA: 256 threads = two warpgroups (WG0, WG1), no producer warp: the warpgroup that finishes with a
shared-memory buffer issues the TMA that refills it. (A subclass may add a producer warpgroup,
WG2: then that point only releases the buffer half to it; sm90_producer_sparse_decode.py.)
Tiles: 64 query rows x 64 keys (one page). Output O (64 x 512 fp32) does not fit one
warpgroup's registers, so WG0 owns columns 0-255 and WG1 columns 256-511.

Pipeline ("seesaw", after FlashMLA's published schedule): pages go alternately to two buffers,
B0 (even blocks of the segment) and B1 (odd). WG0 computes S0 = Q K0^T, WG1 S1 = Q K1^T. Per pair:
    WG0: softmax(S0) against the running max -> scale0; O_L = O_L*scale0 + P0 V0L; publishes P0
         (rescaled by WG1's scale1) to smem; O_L = O_L*scale1 + P1 V1L; then S0' for the next pair.
    WG1: softmax(S1) after WG0 -> scale1; O_R = O_R*scale0*scale1 + P1 V1R + P0 V0R; then S1'.
so one warpgroup's softmax overlaps the other's tensor-core work. A buffer is released in halves
(columns 0-255 and 256-575) by the warpgroup that reads it last, which then issues the TMA for the
page two blocks ahead; QK^T waits per 64-column tile, so it starts on the tiles that land first.

Shared memory: Q 72 KB + B0, B1 72 KB each + P0 8 KB; P1 lives in Q's last 64-column tile, which
each warpgroup keeps in registers instead (the QK^T of that tile is register-sourced): ~226 KB.

Between segments (a CTA's part may hold several requests): the next request's scalars (length,
first pages, slots) are loaded a segment ahead, its Q loads during the epilogue, and each
warpgroup stages its half of O in the page buffers and writes it with one bulk copy per row.

Masking: keys at or past a row's horizon (L, or L - s_q + i + 1 for causal query token i) get
-inf scores; a row that sees no key keeps max = -inf and sum = 0 (output 0, lse +inf). Rows of V
past L in a request's last page are zeroed in shared memory before P V, since the cache may hold
anything (NaN) there and 0 * NaN = NaN.

Float8_e4m3fn cache: exact mode (kv_fp8=True) lands each page's bytes in its 16-bit buffer and
expands them in place (the MMAs stay 16-bit); fast mode (MLADecodeSm90Fast, compute="fp8") keeps
bytes in shared memory and runs both products on the e4m3 wgmma: Q quantized per row at each
segment's start, V^T built per warpgroup half, P in e4m3 (see that class).

Limits: d_qk = 576, d_v = 512, page 64, bf16/fp16, s_q * h_q any (rows padded to 64), one latent
head per launch (a cache of h_kv heads runs one launch per head over a strided view of it).
Compiled per (dtype, causal); batch, s_q, h_q, the cache size and its strides are runtime values.
"""

from __future__ import annotations

import struct
from functools import partial

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from ..constants import BLOCK_M, D_QK, D_V, PAGE_SIZE
from . import softmax, splitkv
from .decode_base import DecodeKernel, Fp8Args, SplitKVTensors, TmaLoads, aligned, shared_struct
from .ptx import (
    DITHER_FLOOR_BITS,
    DITHER_OFFSET,
    DITHER_STEP_BITS,
    L2_EVICT_FIRST,
    bulk_s2g,
    e4m3_dither,
    e4m3_row_factors,
    e4m3_store16,
    e4m3x4,
    fence_operand,
    ldg128,
    lds64,
    lds128,
    sts,
    unpack16x2,
)

N_TILES = D_QK // 64  # 64-column tiles of a page (8 of V + 1 of RoPE)
HALF_V = D_V // 2
# The epilogue's staged O: a warpgroup's 64 x HALF_V rows, this many elements apart (_stage_o).
STAGE_STRIDE = HALF_V + 8
# Fast mode's P is 2^P_SHIFT times the probabilities (at most 256 of e4m3's 448).
P_SHIFT = 8.0

# Named barrier ids (0 is __syncthreads).
NB_SCALE0 = 1  # WG0 -> WG1: running max and scale0 of this pair are in smem
NB_SCALE1 = 2  # WG1 -> WG0: scale1 is in smem
NB_P0 = 3  # WG0 -> WG1: P0 (rescaled) is in smem
NB_P1_ISSUED = 4  # WG1 -> WG0: P1 is in smem, and WG1 has issued its P0 @ V0R
NB_WG0 = 5  # WG0 only
NB_WG1 = 6  # WG1 only
NB_CONSUMERS = 7  # WG0 and WG1, where a producer warpgroup (WG2) runs beside them


def fp8_expand_schedule(n_tiles: int) -> list[tuple[str, int]]:
    """The in-place expansion of one page-buffer half of n_tiles 64-column tiles, as steps
    ("load", w), ("store", w) (wave w: 2 KB of fp8 = 16 bytes per thread of a warpgroup) and
    ("bar", -1) (a warpgroup barrier).

    The half's fp8 bytes lie in the upper half of its bf16 region (F = n_tiles * 4 KB from its
    start); fp8 byte x becomes bf16 bytes [2 x, 2 x + 2) (up to the swizzle, which permutes
    16-byte chunks inside a 128-byte row). So wave w's stores cover rows that held fp8 waves
    2 w - W and 2 w - W + 1 (W = 2 n_tiles waves): a wave may be stored once every thread has
    loaded those, which a barrier after their loads guarantees; the last wave overlaps itself
    (load, barrier, store). Every thread loads before it stores within a wave, and barriers
    are inserted only where a store would otherwise overrun a load of another thread."""
    W = 2 * n_tiles
    steps: list[tuple[str, int]] = []
    covered = -1  # the waves whose loads a barrier already ordered before what follows
    for w in range(W):
        need = 2 * w - W + 1  # the last fp8 wave this wave's output overlaps
        if need >= w:
            steps += [("load", w), ("bar", -1), ("store", w)]
            covered = w
            continue
        if need > covered:
            steps.append(("bar", -1))
            covered = w - 1
        steps += [("load", w), ("store", w)]
    return steps


def fp8_expand_addrs(n_tiles: int, w: int, i):
    """Byte offsets from a page-buffer half's start (1 KB aligned) for wave w, thread i of
    its in-place expansion: (the 16 fp8 bytes it reads, the 16-byte chunks it writes values
    0-7 and 8-15 to). Those bytes are tile w // 2, row 32 (w % 2) + i // 4, columns
    16 (i % 4) + [0, 16); the 16-bit row is 128 bytes, its chunks 2 (i % 4) and 2 (i % 4) + 1
    XORed with row % 8 (the 128-byte swizzle of TMA and wgmma: address bits 4-6 ^= bits 7-9).
    i: a Python int (tests) or the DSL's Int32."""
    src = n_tiles * PAGE_SIZE * 64 + w * 2048 + i * 16
    row_start = (w // 2) * PAGE_SIZE * 128 + ((w % 2) * 32 + i // 4) * 128
    q, sw = i % 4, (i // 4) % 8
    return src, row_start + ((2 * q) ^ sw) * 16, row_start + ((2 * q + 1) ^ sw) * 16


# ---- fast mode (compute="fp8"): layouts of e4m3 Q, P and V^T, modelled in Python ----------
# Python models of the layouts MLADecodeSm90Fast's device code follows (_to_P8, _store_P8,
# _transpose_v); the tests check them byte by byte (design: docs/log.md, 2026-12-01, "FP8
# fast mode, design and state").


def e4m3_dither_model(p: float) -> float:
    """ptx.e4m3_dither on the fp32 value p >= 0, step by step as its PTX (fma.rn: the product
    is exact in float64, the sum rounded once more to fp32 here, as the fma rounds)."""
    def bits(x):
        return struct.unpack("<i", struct.pack("<f", x))[0]

    def f32(i):
        return struct.unpack("<f", struct.pack("<i", i))[0]

    b = bits(p)
    step = f32((max(b, DITHER_FLOOR_BITS) & 0x7F800000) - DITHER_STEP_BITS)
    d = f32((((b & 0xFF00) ^ 0x8000) << 7) | 0x3F800000) + DITHER_OFFSET  # (exact)
    return f32(bits(d * step + f32(b)))


def sw64(row, col):
    """Byte offset of (row, col) in a K-major 8-bit tile with 64-byte rows and the 64-byte
    swizzle (the DSL's K_SW64 atom for 8-bit types: S<2,4,3> o (8,64):(64,1)), which TMA and
    wgmma both use: 16-byte chunk index (address bits 4-5) ^= row / 2 % 4 (bits 7-8)."""
    return row * 64 + ((col // 16) ^ ((row >> 1) & 3)) * 16 + col % 16


def fp8_pv_key(k):
    """The key (0..63 of a page) that column k of fast mode's P and V^T holds.

    The e4m3 wgmma's register A operand gives thread q (= lane % 4) of a quad the columns
    4 q + [0, 4) and 16 + 4 q + [0, 4) of each 32-column step, while the fp32 scores S leave it
    columns 8 j + 2 q + {0, 1}. Rather than exchange bytes between threads, P keeps S's
    registers in order and V^T's columns are permuted to match: the sum over keys does not care
    in which order they come, only that P and V^T agree."""
    base, i = k - k % 16, k % 16
    return base + 2 * (i // 4) + (i & 1) + 8 * ((i >> 1) & 1)


def fp8_p_fragment(kk: int, v: int) -> int:
    """Fast mode's P as a register A operand: value v (0..15) of k-step kk (0, 1; 32 keys each)
    of a thread's e4m3 fragment is its fp32 score accumulator's value fp8_p_fragment(kk, v).
    Fragment order (the DSL's tv_layout_A for e4m3, m64k32): v = i + 4 h + 8 u is row
    r0 + 8 h, column 16 u + 4 q + i; accumulator order (tv_layout_C): idx = c + 2 h + 4 j is
    row r0 + 8 h, key 8 j + 2 q + c. With fp8_pv_key the column holds key 32 kk + 16 u +
    2 q + (i & 1) + 8 (i >> 1), i.e. j = 4 kk + 2 u + (i >> 1), c = i & 1: no data movement."""
    i, h, u = v % 4, (v // 4) % 2, v // 8
    return (i & 1) + 2 * h + 4 * (4 * kk + 2 * u + (i >> 1))


def fp8_vt_unit(wtid: int, half: int):
    """Thread wtid (0..127) of the warpgroup that owns V half `half` (d in [256 half,
    256 half + 256)) transposes one 16-key x 8-d block of a page into V^T (256 d-rows x 64
    key-bytes, K-major, sw64, keys in fp8_pv_key order). Returns (loads, stores):
    loads: 16 (byte offset in the page's fp8 buffer (9 tiles of 64 keys x 64 bytes, sw64,
    4 KB apart), key) for 8-byte ld.shared, in register order; stores: 8 (byte offset in the
    V^T half, d, [16 (load index, byte in it)]) for 16-byte st.shared.

    Lanes: c = lane % 4 is the key block (keys 16 c..16 c + 15); the 8-d group is
    g = (lane / 4) ^ (4 (c / 2)) + 8 warp, so that a 16-lane phase of the loads reads both
    32-byte halves of the rows of key blocks c and c + 2 (which share a bank window and a
    swizzle phase). A lane takes its keys in the order s ^ (c % 2), so that key blocks c and
    c + 1 sit in rows of different parity (the other 64 bytes of the bank window), and
    stores its d's in the order e ^ (g % 2) (likewise): each swaps the inputs of one
    byte-permute stage (a per-lane prmt selector), and both the loads and the stores are
    conflict-free (the tests count the wavefronts)."""
    lane, warp_i = wtid % 32, wtid // 32
    c = lane % 4
    g = ((lane // 4) ^ (4 * (c // 2))) + 8 * warp_i
    d0 = 256 * half + 8 * g
    loads = []
    for s in range(16):
        key = 16 * c + (s ^ (c % 2))
        loads.append(((d0 // 64) * 4096 + sw64(key, d0 % 64), key))
    load_of_key = {key: n for n, (_, key) in enumerate(loads)}
    stores = []
    for e in range(8):
        dd = e ^ (g % 2)
        row = 8 * g + dd
        src = [(load_of_key[fp8_pv_key(16 * c + b)], dd) for b in range(16)]
        stores.append((sw64(row, 16 * c), d0 + dd, src))
    return loads, stores


def group_scale_offset(h: int) -> int:
    """Byte offset, in a page buffer, of the scales of the 656-byte rows' 128-column groups
    2 h and 2 h + 1 (64 rows x 8 bytes) that buffer half h's expansion reads: the last 512
    bytes of 16-bit tile 4 h + 1, which no fp8 byte occupies and which that expansion writes
    only after every thread has loaded them (_expand_half)."""
    return (4 * h + 2) * PAGE_SIZE * 128 - 512


def could_be(wg, which: int) -> bool:
    """Whether warpgroup index wg may be `which`: a runtime value may be any; a constant (a copy
    of the kernel body traced for one warpgroup: MLADecodeSm90.body) only itself. Code that only
    warpgroup `which` runs is left out of the other warpgroups' copies (const_expr)."""
    return not isinstance(wg, int) or wg == which


def shared_storage(**buffers):
    """The kernel's shared memory: `buffers` (name=type, in order: the operand tiles), then the
    softmax statistics and barriers of both modes: sM (running max), sScale0, sScale1 (the
    pair's rescale factors), sL (both warpgroups' row sums), barK (a mbarrier per tile of the
    two page buffers) and barQ."""
    return shared_struct(**buffers, sM=cute.struct.MemRange[Float32, BLOCK_M],
                         sScale0=cute.struct.MemRange[Float32, BLOCK_M],
                         sScale1=cute.struct.MemRange[Float32, BLOCK_M],
                         sL=cute.struct.MemRange[Float32, 2 * BLOCK_M],
                         barK=cute.struct.MemRange[cutlass.Int64, 2 * N_TILES],
                         barQ=cute.struct.MemRange[cutlass.Int64, 1])


class MLADecodeSm90(DecodeKernel):
    """Split-KV MLA decode for SM90; see the module docstring for the algorithm."""

    num_threads = 256

    # Fast mode (MLADecodeSm90Fast) sets these: e4m3 Q and P on the fp8 wgmma.
    fast = False
    q_fp8 = False
    p_dither = False
    # The trace build's stamp table (tools/trace_decode.py sets it), a kernel argument: None
    # here, so nothing is compiled for it (see _stamp).
    trace_table = None
    # Arrivals that complete a cache tile's mbarrier (its phase also waits for the tile's
    # bytes): TMA's expect_tx arrival. The sparse subclass fills tiles by cp.async instead
    # (generic-proxy writes: the warpgroups fence before their MMAs read them).
    k_arrivals = 1
    cp_async_tiles = False
    # Warps of a warpgroup that refill a buffer half together (_load_tiles): TMA needs one; the
    # sparse subclass's cp.async gather spreads its copies over the warpgroup's four.
    load_warps = 1
    # kv_fp8 over the 656-byte rows (the sparse subclass): see _expand_half.
    group_scales = False
    # A producer warpgroup (WG2, launched beside the two consumer warpgroups; the sparse
    # producer subclass): it fills the page buffers (and expands fp8 ones) over the same walk,
    # the consumers' _load_tiles only release buffer halves to it, and regs is the
    # (producer, consumer) register split setmaxnreg makes. Without one, the consumers load.
    producer = False
    consumer_threads = 256
    regs = None
    # The split subclass (a producer subclass too): WG0 runs every block's Q K^T and softmax
    # and O's left half, WG1 O's right half (_split_blocks).
    split = False
    # Q K^T's RoPE tile from registers (rQ8: its shared-memory tile holds P1); False: from
    # shared memory like the others (the split subclass, which has no P1).
    rope_in_regs = True
    # The part's metadata row loaded before the prologue's barrier setup and syncs (its
    # latency under theirs) rather than after them (the split subclass's META_EARLY knob).
    meta_early = False

    def _wait_half(self, bar, parity):
        """A wait on a buffer half's mbarrier: its tiles' before its MMAs (and a producer
        subclass's wait for its release; a subclass whose halves a peer CTA fills and frees
        picks the wait's scope: the split's SCOPE)."""
        cute.arch.mbarrier_wait(bar, parity)

    def half_has_copies(self, h: int) -> bool:
        """Whether buffer half h's tiles hold cp.async writes that the warpgroup waiting for them
        must fence for the async proxy (a writer that stores and fences itself needs none)."""
        return self.cp_async_tiles

    def __init__(self, dtype, causal: bool, kv_fp8: bool = False):
        self.dtype = dtype
        self.causal = bool(causal)
        # kv_fp8: the cache is float8_e4m3fn ("exact" mode): each page lands as fp8 bytes in
        # the upper half of its bf16 (fp16) buffer halves and the warpgroup that computes its
        # Q K^T expands it in place (_expand_half); the MMAs are the 16-bit kernel's. The
        # scales fold into the softmax scale and the epilogue (see _prepare).
        self.kv_fp8 = bool(kv_fp8)

    # ------------------------------------------------------------------------------------------
    # host side: layouts, TMA descriptors (DecodeKernel.__call__ launches)
    # ------------------------------------------------------------------------------------------
    def _prepare(self, mQ: cute.Tensor, mKV: cute.Tensor, fp8: tuple):
        """The TMA atoms and views (_setup), then what the kernel takes after the scale: the
        trace table, fp8 (kv_scale, q_scale, q_scaled: None unless kv_fp8) and the layouts and
        tiled MMAs.

        kv_fp8 builds: the scores use scale_log2 * kv_scale (* q_scale), and O and the partials
        Oacc are multiplied by kv_scale in the epilogue (the combine is unchanged): e4m3 values
        are exact in bf16/fp16, so the dequantization itself is a conversion."""
        tma, layouts = self._setup(mQ, mKV)
        size = self.shared_storage.size_in_bytes()
        assert size <= 227 * 1024, size
        return tma, (self.trace_table, fp8, *layouts)

    def _setup(self, mQ: cute.Tensor, mKV: cute.Tensor):
        """The TMA atoms and views (Q, cache), the shared-memory layouts and tiled MMAs the
        kernel takes, and self.shared_storage (traced inside __call__)."""
        dt = self.dtype
        k_atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, dt, 64), dt
        )
        mn_atom = warpgroup.make_smem_layout_atom(
            warpgroup.SmemLayoutAtomKind.MN_SW128, dt
        )
        self.sQ_layout = cute.tile_to_shape(k_atom, (BLOCK_M, D_QK), order=(0, 1))
        self.sK_layout = cute.tile_to_shape(k_atom, (PAGE_SIZE, D_QK, 2), order=(0, 1, 2))
        self.tile_layout = cute.tile_to_shape(k_atom, (64, 64), order=(0, 1))
        # V half (256 d-columns x 64 keys) seen MN-major inside a K-major page buffer: 64-column
        # chunks are 64 x 64 x 2 B = 8 KB apart, groups of 8 keys 1 KB apart.
        self.vhalf_layout = cute.tile_to_shape(mn_atom, (HALF_V, PAGE_SIZE), order=(1, 0))

        self.tiled_qk_ss = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (1, 1, 1), (BLOCK_M, PAGE_SIZE),
        )
        self.tiled_qk_rs = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (1, 1, 1), (BLOCK_M, PAGE_SIZE), warpgroup.OperandSource.RMEM,
        )
        self.tiled_pv_rs = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            (1, 1, 1), (BLOCK_M, HALF_V), warpgroup.OperandSource.RMEM,
        )
        self.tiled_pv_ss = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            (1, 1, 1), (BLOCK_M, HALF_V),
        )

        # TMA views: Q as (rows, 576, b), the cache as (64 keys, 576, pages).
        mQ_t = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        mKV_t = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(op, mQ_t, self.sQ_layout, (BLOCK_M, D_QK))
        tma_k, tma_mKV = self._cache_tma(op, mKV_t)

        self.shared_storage = shared_storage(
            sQ=aligned(dt, BLOCK_M * D_QK),
            sK=aligned(dt, 2 * PAGE_SIZE * D_QK),
            sP0=aligned(dt, BLOCK_M * PAGE_SIZE),
        )
        return TmaLoads(tma_q, tma_mQ, tma_k, tma_mKV), (
            self.sQ_layout, self.sK_layout, self.tile_layout, self.vhalf_layout,
            self.tiled_qk_ss, self.tiled_qk_rs, self.tiled_pv_rs, self.tiled_pv_ss)

    def _cache_tma(self, op, mKV_t: cute.Tensor):
        """The cache's TMA atom and view for 64-key x 64-column tiles of the cache seen as
        (64 keys, 576, pages)."""
        if self.kv_fp8:
            # fp8 tiles land unswizzled (64-byte rows): _expand_half reads them linearly.
            tile8 = cute.make_layout((PAGE_SIZE, 64), stride=(64, 1))
            return cpasync.make_tiled_tma_atom(op, mKV_t, tile8, (PAGE_SIZE, 64))
        return cpasync.make_tiled_tma_atom(op, mKV_t, self.tile_layout, (PAGE_SIZE, 64))

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def body(self, loads: TmaLoads, tensors: SplitKVTensors, scale_log2: Float32, mTrace,
             fp8: Fp8Args, sQ_layout, sK_layout, tile_layout, vhalf_layout, tiled_qk_ss,
             tiled_qk_rs, tiled_pv_rs, tiled_pv_ss):
        """The kernel (_body). The split subclass traces it once a warpgroup, with the
        warpgroup's index a constant: each copy keeps only that warpgroup's code, so ptxas
        allocates each for its own setmaxnreg count (one copy of code that every consumer runs
        would be allocated for the smallest)."""
        # (shared memory is allocated here, once: each traced copy's allocation would count)
        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        args = (storage, loads, tensors, scale_log2, mTrace, fp8, sQ_layout, sK_layout,
                tile_layout, vhalf_layout, tiled_qk_ss, tiled_qk_rs, tiled_pv_rs, tiled_pv_ss)
        if const_expr(self.split):
            tidx, _, _ = cute.arch.thread_idx()
            wg = cute.arch.make_warp_uniform(tidx // 128)
            if wg == 0:
                self._body(0, *args)
            elif wg == 1:
                self._body(1, *args)
            else:
                self._body(2, *args)
        else:
            self._body(None, *args)

    @cute.jit
    def _body(self, role: cutlass.Constexpr, storage, loads: TmaLoads, tensors: SplitKVTensors,
              scale_log2: Float32, mTrace, fp8: Fp8Args, sQ_layout, sK_layout, tile_layout,
              vhalf_layout, tiled_qk_ss, tiled_qk_rs, tiled_pv_rs, tiled_pv_ss):
        tma_q, tma_mQ, tma_k, tma_mKV = loads
        mKVScale, mQScale, q_scaled = fp8
        mBlockTable, mSeqlens, mMeta, mNumSplits, mO, mLSE, mOacc, mLSEacc = tensors
        tidx, _, _ = cute.arch.thread_idx()
        m_block, part, _ = cute.arch.block_idx()
        # (role: the warpgroup this copy runs as, a constant (body); None: any, from tidx)
        if const_expr(role is None):
            wg = cute.arch.make_warp_uniform(tidx // 128)
        else:
            wg = role
        wtid = tidx % 128  # thread index inside the warpgroup
        warp_in_wg = cute.arch.make_warp_uniform((tidx // 32) % 4)

        # (for the sparse subclass's hooks: its bias rows, topk_length)
        self.d_storage, self.d_tensors = storage, tensors
        sw = sQ_layout.inner
        # Device-side handles for the helper methods below (IR values of this kernel's region).
        self.d_swizzle = sw
        self.d_vhalf_layout = vhalf_layout
        self.d_tiled_qk_ss, self.d_tiled_qk_rs = tiled_qk_ss, tiled_qk_rs
        self.d_tiled_pv_rs, self.d_tiled_pv_ss = tiled_pv_rs, tiled_pv_ss
        q_base = storage.sQ.data_ptr()
        k_base = storage.sK.data_ptr()
        if const_expr(self.fast):
            # Byte buffers: TMA moves the cache's bytes, the MMAs read them as e4m3.
            f8 = cutlass.Float8E4M3FN
            sQ = cute.make_tensor(cute.recast_ptr(q_base, sw, dtype=f8), sQ_layout.outer)
            sK = cute.make_tensor(cute.recast_ptr(k_base, sw, dtype=f8), sK_layout.outer)
            sK_tma = cute.make_tensor(cute.recast_ptr(k_base, sw), sK_layout.outer)
            sP0 = cute.make_tensor(cute.recast_ptr(storage.sP0.data_ptr(), sw, dtype=f8),
                                   tile_layout.outer)
            sP1 = cute.make_tensor(cute.recast_ptr(storage.sP1.data_ptr(), sw, dtype=f8),
                                   tile_layout.outer)
            self.d_vt_base = storage.sVt.data_ptr().toint()
            self.d_p_base = [storage.sP0.data_ptr().toint(), storage.sP1.data_ptr().toint()]
            sQScale = storage.sQScale.get_tensor(cute.make_layout(BLOCK_M))
        else:
            sQ = cute.make_tensor(cute.recast_ptr(q_base, sw), sQ_layout.outer)
            sK = cute.make_tensor(cute.recast_ptr(k_base, sw), sK_layout.outer)
            sK_tma = sK
            sP0 = cute.make_tensor(
                cute.recast_ptr(storage.sP0.data_ptr(), sw), tile_layout.outer
            )
            # P1 shares its 8 KB with Q's RoPE tile, which both warpgroups hold in registers.
            sP1 = cute.make_tensor(
                cute.recast_ptr(q_base + (N_TILES - 1) * 4096, sw), tile_layout.outer
            )
        sM = storage.sM.get_tensor(cute.make_layout(BLOCK_M))
        sScale0 = storage.sScale0.get_tensor(cute.make_layout(BLOCK_M))
        sScale1 = storage.sScale1.get_tensor(cute.make_layout(BLOCK_M))
        sL = storage.sL.get_tensor(cute.make_layout(2 * BLOCK_M))
        barK = storage.barK.data_ptr()
        barQ = storage.barQ.data_ptr()

        if const_expr(self.meta_early):
            walk = splitkv.read_part(mMeta, part)
        if const_expr(could_be(wg, 0)):  # (thread 0 is WG0's)
            if tidx == 0:
                if const_expr(not self.fast):
                    cpasync.prefetch_descriptor(tma_q)
                if const_expr(tma_k is not None):
                    cpasync.prefetch_descriptor(tma_k)
                for i in cutlass.range_constexpr(2 * N_TILES):
                    cute.arch.mbarrier_init(barK + i, self.k_arrivals)
                cute.arch.mbarrier_init(barQ, 1)
                self._init_barriers()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if const_expr(self.cluster_m > 1):
            # (a peer CTA's mbarriers are initialized before this one arrives on them)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        # The combine kernel (launched with PDL) may start now: its CTAs wait for this grid to
        # finish before reading what it writes, so they only fill idle warp slots meanwhile.
        cute.arch.griddepcontrol_launch_dependents()
        self.d_trace = mTrace
        self._stamp("start")

        # Cache tiles (64 keys x 64 columns) of each page: the buffers' and the cache's views.
        self.d_k_base = k_base
        tKsK, tKgK = self._cache_partitions(tma_k, tma_mKV, sK_tma)
        q_scale = Float32(1.0)
        if const_expr(self.kv_fp8):
            # Folded scales (see _prepare): read once, no host synchronisation. (The sparse
            # kernel's 656-byte rows have no per-tensor scale and pass no q scale.)
            kv_scale = Float32(1.0)
            if const_expr(mKVScale is not None):
                kv_scale = mKVScale[0]
            if const_expr(q_scaled is not None):
                if q_scaled != 0:
                    q_scale = mQScale[0]
            scale_log2 = scale_log2 * kv_scale
            if const_expr(not self.fast):
                scale_log2 = scale_log2 * q_scale
            self.d_kv_scale = kv_scale
        self.d_wtid = wtid

        # MMA partitions (per warpgroup).
        thr_qk = tiled_qk_ss.get_slice(wtid)
        thr_qk_rs = tiled_qk_rs.get_slice(wtid)
        thr_pv = tiled_pv_rs.get_slice(wtid)
        thr_pv_ss = tiled_pv_ss.get_slice(wtid)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, 36) (fast: 18)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, 36, 2)
        tOrP0s = thr_pv_ss.make_fragment_A(thr_pv_ss.partition_A(sP0))
        tOrP1s = thr_pv_ss.make_fragment_A(thr_pv_ss.partition_A(sP1))
        if const_expr(self.fast):
            # Every Q K^T tile is shared-memory sourced; V is read as V^T (_transpose_v).
            tSrK_rs = rQ8 = None
            vt = storage.sVt.data_ptr()
            tOrV = [
                [
                    thr_pv.make_fragment_B(thr_pv.partition_B(cute.make_tensor(
                        cute.recast_ptr(vt + (2 * s + h) * HALF_V * PAGE_SIZE, sw, dtype=f8),
                        vhalf_layout.outer)))
                    for h in range(2)
                ]
                for s in range(2)
            ]
        else:
            tSrK_rs = thr_qk_rs.make_fragment_B(thr_qk_rs.partition_B(sK))
            rQ8 = thr_qk_rs.make_fragment_A(thr_qk_rs.partition_shape_A((BLOCK_M, 64)))
            # V halves: [buffer][half]
            tOrV = [
                [
                    thr_pv.make_fragment_B(thr_pv.partition_B(self._v_half(k_base, s, h)))
                    for h in range(2)
                ]
                for s in range(2)
            ]
        acc_S = cute.make_rmem_tensor(thr_qk.partition_shape_C((BLOCK_M, PAGE_SIZE)), Float32)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((BLOCK_M, HALF_V)), Float32)
        # P as the A operand
        rP = thr_pv.make_fragment_A(thr_pv.partition_shape_A((BLOCK_M, PAGE_SIZE)))

        if const_expr(self.fast):
            st_P = ld_Q8 = sQ8 = None  # P goes to smem by plain stores; Q stays in smem
        else:
            # P (registers, accumulator order) -> smem with stmatrix; Q's tile 8 -> registers.
            st_P = cute.make_tiled_copy_C(
                cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.dtype), tiled_qk_ss
            ).get_slice(wtid)
            ld_Q8 = cute.make_tiled_copy_A(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.dtype), tiled_qk_rs
            ).get_slice(wtid)
            sQ8 = cute.make_tensor(
                cute.recast_ptr(q_base + (N_TILES - 1) * 4096, sw), tile_layout.outer
            )

        # Rows this thread holds in the accumulators: r0 and r0 + 8; columns 8 j + c0 + {0, 1}.
        r0 = warp_in_wg * 16 + (wtid % 32) // 4
        c0 = (wtid % 32) % 4 * 2

        # Loop-carried state lives in registers tensors (the DSL carries tensors, not lists).
        phase = cute.make_rmem_tensor(3, Int32)  # parity to wait for next: buffer 0, 1, Q
        phase.fill(0)
        row_sum = cute.make_rmem_tensor(2, Float32)  # this thread's partial row sums

        # Query rows are (s_q, h_q) flattened: row = s * h_q + h.
        self.d_rows = mO.shape[1]
        self.d_h_q = mLSE.shape[1]
        self.d_s_q = mLSE.shape[2]
        if const_expr(not self.meta_early):
            walk = splitkv.read_part(mMeta, part)

        # With a producer warpgroup (WG2: the sparse producer subclass) it fills the page
        # buffers over the same walk, and the consumers below only release buffer halves.
        if const_expr(self.producer):
            is_producer = wg == 2
        else:
            is_producer = False
        if is_producer:  # (a constant False without a producer: traced, then folded away)
            if const_expr(self.producer):
                cute.arch.setmaxregister_decrease(self.regs[0])
                self._produce(walk, tKgK, barK)
        else:
            if const_expr(self.split):
                # (WG0, WG1 apart: the split subclass's consumers, regs = (producer, WG0, WG1),
                # summing to 3x the count at launch; wg is this copy's constant (body);
                # setmaxnreg.dec to a larger count is an illegal instruction, so each goes the
                # way its count lies from launch's)
                count = self.regs[1] if const_expr(wg == 0) else self.regs[2]
                if const_expr(count >= sum(self.regs) // 3):
                    cute.arch.setmaxregister_increase(count)
                else:
                    cute.arch.setmaxregister_decrease(count)
            elif const_expr(self.producer):
                cute.arch.setmaxregister_increase(self.regs[1])
            # Scalars of the request a segment works on (L, its first two pages, its slot range),
            # loaded one segment ahead so that their latency hides behind the previous segment.
            req = cute.make_rmem_tensor(5, Int32)
            self._load_request(req, mSeqlens, mBlockTable, mNumSplits,
                               cutlass.min(walk.begin_req, cute.size(mSeqlens) - 1),
                               walk.begin_blk)
            # 1: the next segment's Q is already loading; 2: a Q load is in flight for a segment
            # that had no block (a schedule made for other lengths): it lands before barQ is
            # reused.
            q_ready = cute.make_rmem_tensor(1, Int32)
            q_ready.fill(0)
            # The first segment's Q can load now, while the scalars above are still in flight. (A
            # part may lie wholly inside a request's overhead units: then it has no block at all.)
            if walk.begin_req < walk.end_req or (walk.begin_req == walk.end_req
                                                 and walk.begin_blk < walk.end_blk):
                q_ready[0] = 1
                if const_expr(could_be(wg, 0)):
                    if tidx < 32:
                        self._load_q(tma_q, tma_mQ, sQ, barQ, walk.begin_req, m_block)

            for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
                L = req[0]
                page_lo = req[1]
                page_lo1 = req[2]
                slot0 = req[3]
                pieces = req[4] - req[3]
                nb_req = splitkv.num_blocks(L)
                # Page ids need no clamp: TMA zero-fills boxes outside the cache tensor, so a bad
                # id never reads outside the cache.
                lo, hi = splitkv.segment(walk, r, L, self._table_blocks(mBlockTable), pieces)
                r_next = cutlass.min(r + 1, walk.end_req)
                self._load_request(req, mSeqlens, mBlockTable, mNumSplits, r_next, 0)
                if lo < hi:
                    n = hi - lo
                    split_idx = splitkv.split_index(walk, r)
                    if const_expr(not self.fast):
                        if q_ready[0] == 2:  # (see the else branch)
                            cute.arch.mbarrier_wait(barQ, phase[2])
                            phase[2] = phase[2] ^ 1
                            q_ready[0] = 0
                    # Everyone is done with the previous segment's buffers and smem statistics.
                    self._sync_consumers()
                    if const_expr(could_be(wg, 0)):
                        if tidx < 32:
                            if q_ready[0] == 0:
                                self._load_q(tma_q, tma_mQ, sQ, barQ, r, m_block)
                        if tidx < 32 * self.load_warps:
                            self._load_tiles(tma_k, tKgK, tKsK, barK, page_lo, 0, 0, N_TILES)
                            if n > 1:
                                self._load_tiles(tma_k, tKgK, tKsK, barK, page_lo1, 1, 0, N_TILES)
                        if tidx < BLOCK_M:
                            sM[tidx] = -Float32.inf
                    acc_O.fill(0.0)
                    row_sum.fill(0.0)
                    # Horizon of each of this thread's rows: keys < border are visible.
                    border = [self._row_border(L, m_block, r0),
                              self._row_border(L, m_block, r0 + 8)]
                    min_border = self._row_border(L, m_block, 0)
                    self._stamp(0)
                    if const_expr(self.fast):
                        # Q -> e4m3 in smem, each row with its own scale (folded into that row's
                        # softmax scale), while the first pages load.
                        self._quantize_q(tma_mQ, r, m_block, tidx, q_base.toint(), sQScale, q_scale)
                        cute.arch.fence_view_async_shared()
                        self._sync_consumers()
                        row_l2 = [scale_log2 * sQScale[r0], scale_log2 * sQScale[r0 + 8]]
                    else:
                        cute.arch.mbarrier_wait(barQ, phase[2])
                        phase[2] = phase[2] ^ 1
                        if const_expr(self.rope_in_regs):
                            cute.copy(ld_Q8, ld_Q8.partition_S(sQ8), ld_Q8.retile(rQ8))
                        row_l2 = [scale_log2, scale_log2]
                    self._stamp(1)

                    if const_expr(self.split):
                        # (the split subclass: WG0 computes every block's S and softmax, WG1
                        # only its half of O)
                        if wg == 0:
                            cute.arch.barrier(barrier_id=NB_WG0, number_of_threads=128)
                        self._split_blocks(
                            wg, n, lo, hi, border, min_border, acc_S, acc_O, rP, row_sum, tSrQ,
                            tSrK, tOrV, tOrP0s, st_P, sP0, sM, sScale0, barK, phase, r0, c0,
                            wtid, row_l2)
                    elif wg == 0:
                        cute.arch.barrier(barrier_id=NB_WG0, number_of_threads=128)  # sM reset seen
                        self._qk(acc_S, tSrQ, tSrK, tSrK_rs, rQ8, barK, phase, 0,
                                 (0, 1, 2, 3, 4, 5, 6, 7, 8))
                        if const_expr(self.fast):
                            # Each warpgroup transposes the V^T half its next P V reads while that
                            # page's Q K^T runs (see _wg0_pair).
                            self._transpose_v(0, 0, self._page_valid(lo, nb_req, L % PAGE_SIZE),
                                              NB_WG0, barK, phase, False)
                        warpgroup.wait_group(0)
                        fence_operand(acc_S)
                        self._stamp(2)
                        wg0 = partial(
                            self._wg0_pair, n=n, lo=lo, nb_req=nb_req, L=L, border=border,
                            min_border=min_border, acc_S=acc_S, acc_O=acc_O, rP=rP,
                            row_sum=row_sum, tSrQ=tSrQ, tSrK=tSrK, tSrK_rs=tSrK_rs, rQ8=rQ8,
                            tOrV=tOrV, tOrP1s=tOrP1s, st_P=st_P, sP0=sP0, sM=sM,
                            sScale0=sScale0, sScale1=sScale1,
                            k_base=k_base, barK=barK, phase=phase, tma_k=tma_k, tKgK=tKgK,
                            tKsK=tKsK, mBlockTable=mBlockTable, r=r, r0=r0, c0=c0, wtid=wtid,
                            scale_log2=row_l2,
                        )
                        # Pairs whose both blocks and the next block exist, then the last pair.
                        n_full = (n - 1) // 2
                        for i in cutlass.range(n_full, unroll=1):
                            wg0(i, has1=True, has2=True)
                        if n % 2 == 0:
                            wg0(n_full, has1=True, has2=False)
                        else:
                            wg0(n_full, has1=False, has2=False)
                        self._stamp(3)
                    else:
                        if n > 1:
                            self._qk(acc_S, tSrQ, tSrK, tSrK_rs, rQ8, barK, phase, 1,
                                     (4, 5, 6, 7, 8, 0, 1, 2, 3))
                            if const_expr(self.fast):
                                self._transpose_v(
                                    1, 1, self._page_valid(lo + 1, nb_req, L % PAGE_SIZE),
                                    NB_WG1, barK, phase, False)
                            warpgroup.wait_group(0)
                            fence_operand(acc_S)
                        wg1 = partial(
                            self._wg1_pair, n=n, lo=lo, nb_req=nb_req, L=L, border=border,
                            min_border=min_border, acc_S=acc_S, acc_O=acc_O, rP=rP,
                            row_sum=row_sum, tSrQ=tSrQ, tSrK=tSrK, tSrK_rs=tSrK_rs, rQ8=rQ8,
                            tOrV=tOrV, tOrP0s=tOrP0s, st_P=st_P, sP0=sP0, sP1=sP1, sM=sM,
                            sScale0=sScale0, sScale1=sScale1,
                            k_base=k_base, barK=barK, phase=phase, tma_k=tma_k, tKgK=tKgK,
                            tKsK=tKsK, mBlockTable=mBlockTable, r=r, r0=r0, c0=c0, wtid=wtid,
                            scale_log2=row_l2,
                        )
                        # Pairs followed by a whole next pair, then the one or two last pairs.
                        n_full = cutlass.max(n - 2, 0) // 2
                        for i in cutlass.range(n_full, unroll=1):
                            wg1(i, has1=True, has3=True)
                        if n % 2 == 0:
                            wg1(n_full, has1=True, has3=False)
                        else:
                            if n > 1:
                                wg1(n_full, has1=True, has3=False)
                                wg1(n_full + 1, has1=False, has3=False)
                            else:
                                wg1(n_full, has1=False, has3=False)
                        self._stamp(4, 128)
                    # The next segment's Q can load while this one's output is written.
                    next_q = cutlass.Boolean(False)
                    if r + 1 <= walk.end_req:
                        lo_next, hi_next = splitkv.segment(walk, r + 1, req[0],
                                                           self._table_blocks(mBlockTable),
                                                           req[4] - req[3])
                        next_q = lo_next < hi_next
                    q_ready[0] = 0
                    if next_q:
                        q_ready[0] = 1
                    self._epilogue(
                        acc_O, row_sum, sM, sL, k_base, mO, mLSE, mOacc, mLSEacc, r, m_block,
                        slot0 + split_idx, pieces, wg, wtid, r0, c0,
                        next_q, tma_q, tma_mQ, sQ, barQ, r + 1,
                    )
                    self._stamp(5)
                    self._stamp(9, 128)
                else:
                    # No wait here, and no loop whose trip count differs between threads
                    # (splitkv.empty_segment): either makes ptxas treat the whole walk as possibly
                    # divergent. (Only the first segment's Q is loaded before its length is known.)
                    if q_ready[0] == 1:
                        q_ready[0] = 2
                    splitkv.empty_segment(
                        walk, r, lo, L, pieces, slot0, mO, mLSE, mLSEacc, m_block * BLOCK_M,
                        cutlass.min(self.d_rows - m_block * BLOCK_M, BLOCK_M), self.d_h_q, tidx,
                        self.consumer_threads)
            if const_expr(not self.fast):
                if q_ready[0] == 2:
                    cute.arch.mbarrier_wait(barQ, phase[2])  # no TMA in flight when the CTA exits
            self._stamp("end")
        if const_expr(self.cluster_m > 1):
            # (no CTA leaves while its peer may still store into it or arrive on its mbarriers)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def _init_barriers(self):
        """Thread 0, after the page tiles' and Q's mbarriers: a producer subclass's own."""

    def _produce(self, walk, mKV, barK):
        """The producer warpgroup's walk (a producer subclass defines it)."""
        raise NotImplementedError

    def _split_blocks(self, *args):
        """A segment's blocks on the split subclass's consumers (it defines them)."""
        raise NotImplementedError

    @cute.jit
    def _sync_consumers(self):
        """A barrier of the two consumer warpgroups (__syncthreads where they are the CTA)."""
        if const_expr(self.producer):
            cute.arch.barrier(barrier_id=NB_CONSUMERS, number_of_threads=self.consumer_threads)
        else:
            cute.arch.sync_threads()

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _cache_partitions(self, tma_k, tma_mKV, sK_tma):
        """TMA partitions of the cache's copies, as _load_tiles indexes them: the buffers'
        tiles (TMA, 1, 9 tiles, 2 buffers; kv_fp8: one such per buffer half, fp8 tiles) and
        the cache's (TMA, 9 tiles, pages)."""
        gK_tiles = cute.local_tile(tma_mKV, (PAGE_SIZE, 64), (0, None, None))  # (64, 64, 9, pages)
        if const_expr(self.kv_fp8 and not self.fast):
            # Fp8 tile t of buffer s: 4 KB at byte s * 72 KB + half start + half size / 2 +
            # 4 KB (t - first tile of the half); one partition per half (tiles 0-3, 4-8).
            k8 = cute.recast_ptr(self.d_k_base, dtype=cutlass.Uint8)
            tKsK = []
            tKgK = None
            for h in cutlass.range_constexpr(2):
                t0, nt = (0, 4) if h == 0 else (4, 5)
                start = t0 * PAGE_SIZE * 64 * 2 + nt * PAGE_SIZE * 64
                sK8 = cute.make_tensor(k8 + start, cute.make_layout(
                    (PAGE_SIZE, 64, 1, nt, 2),
                    stride=(64, 1, 0, PAGE_SIZE * 64, 2 * PAGE_SIZE * D_QK)))
                tKsK_h, tKgK = cpasync.tma_partition(
                    tma_k, 0, cute.make_layout(1),
                    cute.group_modes(sK8, 0, 2), cute.group_modes(gK_tiles, 0, 2),
                )
                tKsK.append(tKsK_h)
            return tKsK, tKgK
        sK_tiles = cute.flat_divide(sK_tma, (PAGE_SIZE, 64))  # (64, 64, 1, 9, 2)
        return cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1),
            cute.group_modes(sK_tiles, 0, 2), cute.group_modes(gK_tiles, 0, 2),
        )

    # ------------------------------------------------------------------------------------------
    def _stamp(self, event, who: int = 0, i=None) -> None:
        """A trace point, a no-op here (nothing is emitted). The trace build
        (tools/trace_decode.py) has thread `who` record the time at each: event "start" and
        "end" of the kernel; per segment 0 start, 1 Q landed, 2 WG0's first S done, 3 WG0's
        loop done, 4 WG1's loop done, 5 epilogue done (WG0), inside the epilogue 6 both
        warpgroups synced, 7 WG0's half of O staged, 8 its bulk copies read, 9 WG1's epilogue
        done (the segment's last); "pair": WG0 starts pair i, i.e. S of its block 2 i is
        ready; "pair1": WG1 starts pair i. "ev" (i: the event's number) inside a warpgroup's
        pair: 1 its wait for the other warpgroup's row scale passed (WG0: NB_SCALE1, WG1:
        NB_SCALE0), 2 WG0 starts the next S, WG1 passed NB_P0; in the next S's Q K^T (_qk),
        3 / 5 the buffer's half 0 / 1 landed, 4 / 6 that half expanded (an e4m3 cache); 7 the
        next S done."""

    @cute.jit
    def _v_half(self, k_base, s: cutlass.Constexpr[int], h: cutlass.Constexpr[int]):
        # elements; 1 KB aligned, swizzle-phase safe
        off = s * PAGE_SIZE * D_QK + h * HALF_V * PAGE_SIZE
        return cute.make_tensor(cute.recast_ptr(k_base + off, self.d_swizzle),
                                self.d_vhalf_layout.outer)

    @cute.jit
    def _row_border(self, L: Int32, m_block: Int32, row: Int32) -> Int32:
        return softmax.row_border(L, m_block * BLOCK_M + row, self.d_rows, self.d_h_q,
                                  self.d_s_q, self.causal)

    @cute.jit
    def _load_q(self, tma_q, tma_mQ, sQ, barQ, r: Int32, m_block: Int32):
        # (Fast mode quantizes Q at each segment's start instead: _quantize_q.)
        if const_expr(not self.fast):
            gQ = cute.local_tile(tma_mQ[None, None, r], (BLOCK_M, D_QK), (m_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                cute.group_modes(gQ, 0, 2)
            )
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(barQ,
                                                        BLOCK_M * D_QK * self.dtype.width // 8)
            # Each CTA reads its Q tile once: evict_first as for the cache pages.
            cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=barQ,
                      cache_policy=cutlass.Int64(L2_EVICT_FIRST))

    @cute.jit
    def _load_tiles(self, tma_k, tKgK, tKsK, barK, page: Int32, s: cutlass.Constexpr[int],
                    t_begin: cutlass.Constexpr[int], t_end: cutlass.Constexpr[int]):
        """One warp: TMA tiles [t_begin, t_end) of cache page `page` into buffer s."""
        for t in cutlass.range_constexpr(t_begin, t_end):
            bar = barK + s * N_TILES + t
            if const_expr(self.fast):
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, PAGE_SIZE * 64)
                cute.copy(tma_k, tKgK[None, t, page], tKsK[None, 0, t, s], tma_bar_ptr=bar,
                          cache_policy=cutlass.Int64(L2_EVICT_FIRST))
            elif const_expr(self.kv_fp8):
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, PAGE_SIZE * 64)
                dst = tKsK[0][None, 0, t, s] if t < 4 else tKsK[1][None, 0, t - 4, s]
                cute.copy(tma_k, tKgK[None, t, page], dst, tma_bar_ptr=bar,
                          cache_policy=cutlass.Int64(L2_EVICT_FIRST))
            else:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar,
                                                            PAGE_SIZE * 64 * self.dtype.width // 8)
                cute.copy(tma_k, tKgK[None, t, page], tKsK[None, 0, t, s], tma_bar_ptr=bar,
                          cache_policy=cutlass.Int64(L2_EVICT_FIRST))

    @cute.jit
    def _qk(self, acc_S, tSrQ, tSrK, tSrK_rs, rQ8, barK, phase, s: cutlass.Constexpr[int],
            order: cutlass.Constexpr, fresh: cutlass.Constexpr[bool] = True,
            last: cutlass.Constexpr[bool] = True):
        """Issues S = Q K_s^T tile by tile as each TMA tile lands (one commit group). A product
        may be issued in several calls over parts of the tile order: fresh (the first part)
        starts S from zero, last flips buffer s's wait parity."""
        atom = cute.make_mma_atom(self.d_tiled_qk_ss.op)
        atom_rs = None
        if const_expr(not self.fast and self.rope_in_regs):
            atom_rs = cute.make_mma_atom(self.d_tiled_qk_rs.op)
        if const_expr(fresh):
            fence_operand(acc_S)
            if const_expr(not self.fast and self.rope_in_regs):
                fence_operand(rQ8)
        first = fresh
        for t in cutlass.range_constexpr(len(order)):
            tile = order[t]
            if const_expr(self.fast):
                # e4m3: k-steps of 32 columns, two a tile, all from shared memory.
                cute.arch.mbarrier_wait(barK + s * N_TILES + tile, phase[s])
                warpgroup.fence()
                for kk in cutlass.range_constexpr(2):
                    atom.set(warpgroup.Field.ACCUMULATE, not first)
                    cute.gemm(atom, acc_S, tSrQ[None, None, 2 * tile + kk],
                              tSrK[None, None, 2 * tile + kk, s], acc_S)
                    first = False
            else:
                if const_expr(self.kv_fp8 and not self.producer):
                    # Every call's order takes a buffer half's tiles together, starting at
                    # tile 0 or 4: the half is expanded (waiting for all of its tiles) first.
                    if const_expr(tile == 0 or tile == 4):
                        self._expand_half(barK, phase, s, 0 if tile == 0 else 1)
                elif const_expr(self.cp_async_tiles):
                    # The sparse gathers' tiles of a buffer half complete together (each lane
                    # arrives on all of them after all of its copies): one wait and one fence
                    # for the async proxy a half.
                    if const_expr(tile == 0 or tile == 4):
                        self._wait_half(barK + s * N_TILES + tile, phase[s])
                        if const_expr(self.half_has_copies(tile // 4)):
                            cute.arch.fence_view_async_shared()
                else:
                    cute.arch.mbarrier_wait(barK + s * N_TILES + tile, phase[s])
                    if const_expr(tile == 0 or tile == 4):
                        self._stamp("ev", 128 * s, 3 if tile == 0 else 5)
                warpgroup.fence()
                for kk in cutlass.range_constexpr(4):  # (k-steps of 16 a 64-column tile)
                    k = tile * 4 + kk
                    if const_expr(tile == N_TILES - 1 and self.rope_in_regs):
                        atom_rs.set(warpgroup.Field.ACCUMULATE, not first)
                        cute.gemm(atom_rs, acc_S, rQ8[None, None, kk],
                                  tSrK_rs[None, None, k, s], acc_S)
                    else:
                        atom.set(warpgroup.Field.ACCUMULATE, not first)
                        cute.gemm(atom, acc_S, tSrQ[None, None, k], tSrK[None, None, k, s],
                                  acc_S)
                    first = False
        warpgroup.commit_group()
        if const_expr(last):
            phase[s] = phase[s] ^ 1

    @cute.jit
    def _expand_half(self, barK, phase, s: cutlass.Constexpr[int], h: cutlass.Constexpr[int]):
        """kv_fp8: waits for half h of buffer s (tiles 0-3 or 4-8) and expands its fp8 bytes,
        in place, into the swizzled 16-bit tiles the MMAs read (fp8_expand_schedule says in
        what order); then fences them for the async proxy. The warpgroup that computes Q K_s^T
        (warpgroup s) runs it; its barriers are that warpgroup's."""
        t0, nt = (0, 4) if h == 0 else (4, 5)
        bar_id = NB_WG0 if s == 0 else NB_WG1
        for t in cutlass.range_constexpr(t0, t0 + nt):
            cute.arch.mbarrier_wait(barK + s * N_TILES + t, phase[s])
        self._stamp("ev", 128 * s, 3 + 2 * h)
        wtid = self.d_wtid
        # byte address
        half = self.d_k_base.toint() + (s * PAGE_SIZE * D_QK + t0 * PAGE_SIZE * 64) * 2
        scales = [None, None, None, None]  # by wave: scales[2 (w // 4) + w % 2]
        if const_expr(self.group_scales):
            # The 656-byte rows (sparse kernel): the rope tile is 16-bit already, and each
            # value is multiplied by its row's scale of its 128 columns (two per half, 8 bytes a
            # row at group_scale_offset(h), which the expansion overwrites: loaded first).
            nt = 4
            sc = self.d_k_base.toint() + s * PAGE_SIZE * D_QK * 2 + group_scale_offset(h)
            for r in cutlass.range_constexpr(2):
                pair = lds64(sc + 8 * (32 * r + wtid // 4))
                scales[r], scales[2 + r] = pair[0], pair[1]
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)
        words = [None] * (2 * nt)
        for step, w in fp8_expand_schedule(nt):
            if const_expr(step == "bar"):
                cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)
            elif const_expr(step == "load"):
                words[w] = lds128(half + fp8_expand_addrs(nt, w, wtid)[0])
            else:
                _, d0, d1 = fp8_expand_addrs(nt, w, wtid)
                scale = None
                if const_expr(self.group_scales):
                    scale = scales[2 * (w // 4) + w % 2]
                e4m3_store16(half + d0, half + d1, words[w], self.dtype == cutlass.BFloat16,
                             scale)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)
        self._stamp("ev", 128 * s, 4 + 2 * h)

    @cute.jit
    def _pv(self, tiled, acc_O, tA, tB, a_in_regs: cutlass.Constexpr[bool],
            fence: cutlass.Constexpr[bool] = True):
        atom = cute.make_mma_atom(tiled.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        if const_expr(self.cp_async_tiles and fence):
            # V may come from a buffer half the other warpgroup waited for (named barriers
            # ordered it before this point): the generic-proxy writes, then this MMA's reads.
            cute.arch.fence_view_async_shared()
        fence_operand(acc_O)
        if const_expr(a_in_regs):
            fence_operand(tA)
        warpgroup.fence()
        # (k16 steps; k32 with e4m3)
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(atom, acc_O, tA[None, None, k], tB[None, None, k], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _mask(self, acc_S, blk: Int32, border, min_border: Int32, c0: Int32,
              s: cutlass.Constexpr[int]):
        """-inf for keys at or past each row's horizon (only where this block reaches one);
        s: the buffer block blk is in (the sparse subclass masks by it)."""
        base = blk * PAGE_SIZE
        if base + PAGE_SIZE > min_border:
            softmax.mask_keys(acc_S, base, border[0], border[1],
                              lambda i: 8 * (i // 4) + c0 + i % 2)

    @cute.jit
    def _exp_rows(self, acc_S, m_use, scale_log2, row_sum, row_scale):
        """P = exp2(S * scale - m) in place (scale_log2: a row's scale per h); row_sum =
        row_sum * row_scale + sum(P). Fast mode computes 2^P_SHIFT P: e4m3 then keeps the
        small probabilities out of its subnormals; sums and O carry the same factor, and lse
        takes it out (_epilogue)."""
        softmax.exp_rows(acc_S, m_use, scale_log2, row_sum, row_scale,
                         P_SHIFT * int(self.fast))

    @cute.jit
    def _to_P(self, acc_S, rP, row_scale):
        """rP (dtype, A-operand order == accumulator order) = acc_S * per-row scale."""
        for h in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(PAGE_SIZE // 8):
                for c in cutlass.range_constexpr(2):
                    idx = c + 2 * h + 4 * j
                    rP[idx] = (acc_S[idx] * row_scale[h]).to(self.dtype)

    @cute.jit
    def _store_P(self, st_P, rP, sP):
        cute.copy(st_P, st_P.retile(rP), st_P.partition_D(sP))
        cute.arch.fence_view_async_shared()

    @cute.jit
    def _to_P8(self, acc_S, rP, row_scale):
        """Fast mode: rP (e4m3, the P V MMA's register A operand) = acc_S * per-row scale,
        converted in the scores' own register order (fp8_p_fragment): word h + 2 u + 4 kk
        holds row r0 + 8 h, keys 8 j + c0 + {0, 1} for j = 4 kk + 2 u and 4 kk + 2 u + 1."""
        rP32 = cute.recast_tensor(rP, Int32)
        for kk in cutlass.range_constexpr(2):
            for u in cutlass.range_constexpr(2):
                for h in cutlass.range_constexpr(2):
                    j = 4 * kk + 2 * u
                    x = [acc_S[2 * h + 4 * j] * row_scale[h],
                         acc_S[1 + 2 * h + 4 * j] * row_scale[h],
                         acc_S[2 * h + 4 * (j + 1)] * row_scale[h],
                         acc_S[1 + 2 * h + 4 * (j + 1)] * row_scale[h]]
                    if const_expr(self.p_dither):
                        x = [e4m3_dither(v) for v in x]
                    rP32[h + 2 * u + 4 * kk] = e4m3x4(x[0], x[1], x[2], x[3])

    @cute.jit
    def _store_P8(self, rP, p_base: Int32, r0: Int32, q: Int32):
        """Fast mode: this thread's P words (_to_P8) -> the 64 x 64 e4m3 tile at p_base (K-major,
        sw64, columns in fp8_pv_key order, as the SS P V MMA reads it), then fenced for the
        async proxy."""
        rP32 = cute.recast_tensor(rP, Int32)
        for kk in cutlass.range_constexpr(2):
            for u in cutlass.range_constexpr(2):
                for h in cutlass.range_constexpr(2):
                    row = r0 + 8 * h
                    chunk = ((row >> 1) & 3) ^ (2 * kk + u)
                    sts(p_base + row * 64 + chunk * 16 + 4 * q, [rP32[h + 2 * u + 4 * kk]])
        cute.arch.fence_view_async_shared()

    @cute.jit
    def _page_valid(self, blk: Int32, nb_req: Int32, tail: Int32) -> Int32:
        """Keys of block blk that exist: 64, or L % 64 in a request's last (partial) page."""
        valid = Int32(PAGE_SIZE)
        if blk == nb_req - 1:
            if tail != 0:
                valid = tail
        return valid

    @cute.jit
    def _transpose_v(self, s: cutlass.Constexpr[int], h: cutlass.Constexpr[int], valid: Int32,
                     bar_id: cutlass.Constexpr[int], barK, phase, wait: cutlass.Constexpr[bool]):
        """Fast mode: V half h (d in [256 h, 256 h + 256)) of the page in buffer s -> V^T
        (256 d-rows x 64 key-bytes, K-major, sw64, keys in fp8_pv_key order), as fp8_vt_unit
        models it: 16 keys x 8 d a thread, keys at or past `valid` zeroed (the cache may hold
        NaN there). The warpgroup that reads this V^T half runs it; wait: first wait for the
        half's tiles (the other warpgroup's buffer: this warpgroup's parity copy flips)."""
        if const_expr(wait):
            for t in cutlass.range_constexpr(4 * h, 4 * h + 4):
                cute.arch.mbarrier_wait(barK + s * N_TILES + t, phase[s])
            phase[s] = phase[s] ^ 1
        wtid = self.d_wtid
        lane = wtid % 32
        c = lane % 4
        c1 = c % 2
        g = ((lane // 4) ^ (4 * (c // 2))) + 8 * (wtid // 32)
        g1 = g % 2
        col = (8 * g) % 64  # byte of the key row (tile 4 h + g / 8) this thread starts at
        tile = self.d_k_base.toint() + s * PAGE_SIZE * D_QK + (4 * h + g // 8) * (PAGE_SIZE * 64)
        lo = [None] * 16
        hi = [None] * 16
        for st in cutlass.range_constexpr(16):
            key = 16 * c + (c1 ^ st)
            w = lds64(tile + key * 64 + (((col // 16) ^ ((key >> 1) & 3)) * 16) + col % 16)
            ok = key < valid
            lo[st] = cutlass.select_(ok, w[0], Int32(0))
            hi[st] = cutlass.select_(ok, w[1], Int32(0))
        # Stage 1 pairs keys (k, k + 1) byte by byte; a lane whose loads came key-swapped
        # (c odd) swaps them back by its selector. Stage 2 joins keys k, k + 1 with k + 8,
        # k + 9 (fp8_pv_key's order) for one d; a lane with g odd emits d's pairwise swapped,
        # matching its store order e ^ g1.
        selA0 = cutlass.select_(c1 == 0, Int32(0x5140), Int32(0x1504))
        selA1 = cutlass.select_(c1 == 0, Int32(0x7362), Int32(0x3726))
        selB0 = cutlass.select_(g1 == 0, Int32(0x5410), Int32(0x7632))
        selB1 = cutlass.select_(g1 == 0, Int32(0x7632), Int32(0x5410))
        vt = self.d_vt_base + (2 * s + h) * (HALF_V * PAGE_SIZE)
        # d 0-3 (the lo words) first, stored before d 4-7 are built: fewer live registers.
        for half_w in cutlass.range_constexpr(2):
            arr = lo if half_w == 0 else hi
            out = [[None] * 4 for _ in range(4)]
            for w4 in cutlass.range_constexpr(4):
                t0 = Int32(cute.arch.prmt(arr[2 * w4], arr[2 * w4 + 1], selA0))
                t1 = Int32(cute.arch.prmt(arr[2 * w4], arr[2 * w4 + 1], selA1))
                u0 = Int32(cute.arch.prmt(arr[2 * w4 + 8], arr[2 * w4 + 9], selA0))
                u1 = Int32(cute.arch.prmt(arr[2 * w4 + 8], arr[2 * w4 + 9], selA1))
                out[0][w4] = Int32(cute.arch.prmt(t0, u0, selB0))
                out[1][w4] = Int32(cute.arch.prmt(t0, u0, selB1))
                out[2][w4] = Int32(cute.arch.prmt(t1, u1, selB0))
                out[3][w4] = Int32(cute.arch.prmt(t1, u1, selB1))
            for k in cutlass.range_constexpr(4):
                row = 8 * g + (g1 ^ (4 * half_w + k))
                sts(vt + row * 64 + ((c ^ ((row >> 1) & 3)) * 16), out[k])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)

    @cute.jit
    def _quantize_q(self, mQ, r: Int32, m_block: Int32, tidx: Int32, q_base: Int32, sQScale,
                    q_scale: Float32):
        """Fast mode: Q rows [64 m_block, +64) of request r -> e4m3 in smem (64 x 576, sw64
        tiles of 64 columns, as the Q K^T MMA reads them) and each row's dequantization scale
        -> sQScale. Four threads a row, 144 columns each. A 16-bit q is scaled per row by
        448 / amax (rounded to nearest, saturating); an e4m3 q (q_fp8) is copied, its scale
        q_scale. Rows past s_q * h_q are zero."""
        row = tidx // 4
        part = tidx % 4
        g = m_block * BLOCK_M + row
        ok = g < self.d_rows
        src = (mQ.iterator + cute.crd2idx((r, cutlass.min(g, self.d_rows - 1), 144 * part),
                                          mQ.layout)).toint()
        words = []
        scale = q_scale
        if const_expr(self.q_fp8):
            for i in cutlass.range_constexpr(9):
                words += ldg128(src + 16 * i)
        else:
            bf16 = self.dtype == cutlass.BFloat16
            raw = []
            for i in cutlass.range_constexpr(18):
                raw += ldg128(src + 16 * i)
            amax = Float32(0.0)
            for w in raw:
                for v in unpack16x2(w, bf16):
                    amax = cute.arch.fmax(amax, cute.arch.fmax(v, -v))
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1))
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=2))
            inv, scale = e4m3_row_factors(amax)
            for i in cutlass.range_constexpr(36):  # (unpacked again: fewer live registers)
                a = unpack16x2(raw[2 * i], bf16)
                b = unpack16x2(raw[2 * i + 1], bf16)
                words.append(e4m3x4(a[0] * inv, a[1] * inv, b[0] * inv, b[1] * inv))
        for i in cutlass.range_constexpr(9):
            col = 144 * part + 16 * i
            chunk = ((col % 64) // 16) ^ ((row >> 1) & 3)
            sts(q_base + (col // 64) * (BLOCK_M * 64) + row * 64 + chunk * 16,
                 [cutlass.select_(ok, words[4 * i + k], Int32(0)) for k in range(4)])
        if part == 0:
            sQScale[row] = scale

    @cute.jit
    def _zero_v_tail(self, k_base, s: cutlass.Constexpr[int], h: cutlass.Constexpr[int],
                     valid: Int32, wtid: Int32, bar_id: cutlass.Constexpr[int]):
        """Zeroes keys [valid, 64) of V half h in buffer s (whole 128-byte rows, so the swizzle
        does not matter), then makes the stores visible to this warpgroup's wgmma."""
        base = cute.recast_ptr(k_base + s * PAGE_SIZE * D_QK + h * HALF_V * PAGE_SIZE,
                               dtype=Float32)
        words = cute.make_tensor(base, cute.make_layout(HALF_V * PAGE_SIZE // 2))
        n_words = (PAGE_SIZE - valid) * 32 * 4  # rows x 32 words x 4 column chunks
        for i in cutlass.range(wtid, n_words, 128, unroll=1):
            row = valid + i // 128
            rem = i % 128
            chunk = rem // 32
            w = rem % 32
            words[chunk * (PAGE_SIZE * 32) + row * 32 + w] = Float32(0.0)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=128)

    @cute.jit
    def _softmax_stats(self, acc_S, sM, r0, scale_log2):
        """Row max of this block (scaled, log2 domain; scale_log2 per h), old and new running
        max."""
        m_old = [sM[r0], sM[r0 + 8]]
        m_new = [None, None]
        m_use = [None, None]
        scale = [None, None]
        for h in cutlass.range_constexpr(2):
            m_blk = softmax.row_max(acc_S, h) * scale_log2[h]
            m_new[h], m_use[h], scale[h] = softmax.online_max(m_old[h], m_blk)
        return m_new, m_use, scale

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _wg0_pair(self, i, n, lo, nb_req, L, border, min_border, acc_S, acc_O, rP, row_sum,
                  tSrQ, tSrK, tSrK_rs, rQ8, tOrV, tOrP1s, st_P, sP0, sM, sScale0, sScale1,
                  k_base, barK, phase, tma_k, tKgK, tKsK, mBlockTable, r, r0, c0, wtid,
                  scale_log2, has1: cutlass.Constexpr[bool], has2: cutlass.Constexpr[bool]):
        """WG0's share of pair i (blocks 2i -> B0, 2i+1 -> B1). has1/has2: blocks 2i+1 and 2i+2
        exist. They are compile-time so that no wgmma sits in a runtime branch (ptxas would
        then serialize every wgmma of the kernel)."""
        blk0 = lo + 2 * i
        last = lo + n - 1
        self._stamp("pair", 0, i)
        # Cache pages of the next pair, read now so the global-load latency hides behind the
        # softmax instead of stalling the TMA issue (indices clamped to stay in the table row).
        page2 = self._next_page(mBlockTable, r, cutlass.min(blk0 + 2, last))
        page3 = self._next_page(mBlockTable, r, cutlass.min(blk0 + 3, last))
        tail = L % PAGE_SIZE
        self._mask(acc_S, blk0, border, min_border, c0, 0)
        m_new, m_use, scale0 = self._softmax_stats(acc_S, sM, r0, scale_log2)
        cute.arch.sync_warp()
        if wtid % 4 == 0:
            for h in cutlass.range_constexpr(2):
                sM[r0 + 8 * h] = m_new[h]
                sScale0[r0 + 8 * h] = scale0[h]
        softmax.scale_rows(acc_O, scale0)
        self._exp_rows(acc_S, m_use, scale_log2, row_sum, scale0)
        one = [Float32(1.0), Float32(1.0)]
        if const_expr(self.fast):
            self._to_P8(acc_S, rP, one)
        else:
            self._to_P(acc_S, rP, one)
        cute.arch.barrier_arrive(barrier_id=NB_SCALE0, number_of_threads=256)

        if const_expr(self.fast):
            # V0L^T was built while this page's Q K^T ran (at the end of the last pair, or at
            # the segment's start: H200, 128x8192 h_q 16 / 128, 64x2048 h_q 16: 254.3 / 476.4 /
            # 60.8 us against 265.8 / 476.6 / 63.0 building it here). Fast mode reads V from
            # V^T, so a buffer half is refilled once it is transposed and its Q K^T is done, not
            # after the P V that reads it: the next page has longer to land. (TMA prefetches of
            # the pages of the pair after next into L2 were slower: 300.6 / 539.7 / 65.1 us.)
            if const_expr(has2):
                if wtid < 32 * self.load_warps:
                    self._load_tiles(tma_k, tKgK, tKsK, barK, page2, 0, 0, 4)
        else:
            if blk0 == nb_req - 1:
                if tail != 0:
                    self._zero_v_tail(k_base, 0, 0, tail, wtid, NB_WG0)
        self._pv(self.d_tiled_pv_rs, acc_O, rP, tOrV[0][0], True)
        warpgroup.wait_group(0)
        fence_operand(acc_O)

        cute.arch.barrier(barrier_id=NB_SCALE1, number_of_threads=256)
        self._stamp("ev", 0, 1)
        if const_expr(has2 and not self.fast):
            if wtid < 32 * self.load_warps:
                self._load_tiles(tma_k, tKgK, tKsK, barK, page2, 0, 0, 4)
        scale1 = [sScale1[r0], sScale1[r0 + 8]]
        if const_expr(self.fast):
            self._to_P8(acc_S, rP, scale1)
            self._store_P8(rP, self.d_p_base[0], r0, wtid % 4)
        else:
            self._to_P(acc_S, rP, scale1)
            self._store_P(st_P, rP, sP0)
        cute.arch.barrier_arrive(barrier_id=NB_P0, number_of_threads=256)

        softmax.scale_rows(acc_O, scale1)
        for h in cutlass.range_constexpr(2):
            row_sum[h] = row_sum[h] * scale1[h]
        if const_expr(has1):
            if const_expr(self.fast):
                self._transpose_v(1, 0, self._page_valid(blk0 + 1, nb_req, tail), NB_WG0, barK,
                                  phase, True)
                if blk0 + 3 <= last:
                    if wtid < 32 * self.load_warps:
                        self._load_tiles(tma_k, tKgK, tKsK, barK, page3, 1, 0, 4)
            else:
                if blk0 + 1 == nb_req - 1:
                    if tail != 0:
                        self._zero_v_tail(k_base, 1, 0, tail, wtid, NB_WG0)
            cute.arch.barrier(barrier_id=NB_P1_ISSUED, number_of_threads=256)
            self._pv(self.d_tiled_pv_ss, acc_O, tOrP1s, tOrV[1][0], False)
        if const_expr(has2):
            # The next S0's first four tiles (B0's left half, refilled above) queue behind
            # P1 @ V1L, so the tensor cores do not idle while this warpgroup waits for it and
            # refills B1's left half; the other five tiles follow.
            self._stamp("ev", 0, 2)
            self._qk(acc_S, tSrQ, tSrK, tSrK_rs, rQ8, barK, phase, 0, (0, 1, 2, 3), True, False)
            warpgroup.wait_group(1)
            if const_expr(not self.fast):
                if blk0 + 3 <= last:
                    if wtid < 32 * self.load_warps:
                        self._load_tiles(tma_k, tKgK, tKsK, barK, page3, 1, 0, 4)
            self._qk(acc_S, tSrQ, tSrK, tSrK_rs, rQ8, barK, phase, 0, (4, 5, 6, 7, 8), False,
                     True)
            if const_expr(self.fast):
                # The next page's V0L^T, while its Q K^T runs (its tiles landed: the Q K^T
                # waited for them; P0 @ V0L, the last reader of V0L^T, is done).
                self._transpose_v(0, 0, self._page_valid(blk0 + 2, nb_req, tail), NB_WG0, barK,
                                  phase, False)
            warpgroup.wait_group(0)
            self._stamp("ev", 0, 7)
            fence_operand(acc_O)
            fence_operand(acc_S)
        elif const_expr(has1):
            warpgroup.wait_group(0)
            fence_operand(acc_O)

    @cute.jit
    def _wg1_pair(self, i, n, lo, nb_req, L, border, min_border, acc_S, acc_O, rP, row_sum,
                  tSrQ, tSrK, tSrK_rs, rQ8, tOrV, tOrP0s, st_P, sP0, sP1, sM, sScale0, sScale1,
                  k_base, barK, phase, tma_k, tKgK, tKsK, mBlockTable, r, r0, c0, wtid,
                  scale_log2, has1: cutlass.Constexpr[bool], has3: cutlass.Constexpr[bool]):
        """WG1's share of pair i; has1/has3: blocks 2i+1 and 2i+3 exist (compile-time)."""
        blk0 = lo + 2 * i
        last = lo + n - 1
        page2 = self._next_page(mBlockTable, r, cutlass.min(blk0 + 2, last))
        page3 = self._next_page(mBlockTable, r, cutlass.min(blk0 + 3, last))
        tail = L % PAGE_SIZE
        self._stamp("pair1", 128, i)
        cute.arch.barrier(barrier_id=NB_SCALE0, number_of_threads=256)
        self._stamp("ev", 128, 1)
        if const_expr(has1):
            self._mask(acc_S, blk0 + 1, border, min_border, c0, 1)
        else:
            acc_S.fill(-Float32.inf)
        m_new, m_use, scale1 = self._softmax_stats(acc_S, sM, r0, scale_log2)
        scale0 = [sScale0[r0], sScale0[r0 + 8]]
        cute.arch.sync_warp()
        if wtid % 4 == 0:
            for h in cutlass.range_constexpr(2):
                sM[r0 + 8 * h] = m_new[h]
                sScale1[r0 + 8 * h] = scale1[h]
        both = [scale0[0] * scale1[0], scale0[1] * scale1[1]]
        softmax.scale_rows(acc_O, both)
        self._exp_rows(acc_S, m_use, scale_log2, row_sum, both)
        cute.arch.barrier_arrive(barrier_id=NB_SCALE1, number_of_threads=256)

        if const_expr(has1):
            one = [Float32(1.0), Float32(1.0)]
            if const_expr(self.fast):
                self._to_P8(acc_S, rP, one)
                self._store_P8(rP, self.d_p_base[1], r0, wtid % 4)
                # (V1R^T was built while this page's Q K^T ran.)
                if const_expr(has3):
                    if wtid < 32 * self.load_warps:
                        self._load_tiles(tma_k, tKgK, tKsK, barK, page3, 1, 4, 9)
            else:
                self._to_P(acc_S, rP, one)
                self._store_P(st_P, rP, sP1)
                if blk0 + 1 == nb_req - 1:
                    if tail != 0:
                        self._zero_v_tail(k_base, 1, 1, tail, wtid, NB_WG1)
            self._pv(self.d_tiled_pv_rs, acc_O, rP, tOrV[1][1], True)
        if const_expr(self.fast):
            # B0's right half, while P1 @ V1R runs (WG0's Q K0^T waited for the tiles; this
            # warpgroup waits too, on its own parity copy).
            self._transpose_v(0, 1, self._page_valid(blk0, nb_req, tail), NB_WG1, barK, phase,
                              True)
            if blk0 + 2 <= last:
                if wtid < 32 * self.load_warps:
                    self._load_tiles(tma_k, tKgK, tKsK, barK, page2, 0, 4, 9)
        cute.arch.barrier(barrier_id=NB_P0, number_of_threads=256)
        self._stamp("ev", 128, 2)
        if const_expr(not self.fast):
            if blk0 == nb_req - 1:
                if tail != 0:
                    self._zero_v_tail(k_base, 0, 1, tail, wtid, NB_WG1)
        # P0 @ V0R queues behind P1 @ V1R; B1's right half is refilled once the latter is done.
        self._pv(self.d_tiled_pv_ss, acc_O, tOrP0s, tOrV[0][1], False)
        if const_expr(has1):
            cute.arch.barrier_arrive(barrier_id=NB_P1_ISSUED, number_of_threads=256)
        if const_expr(has3 and not self.fast):
            warpgroup.wait_group(1)
            if wtid < 32 * self.load_warps:
                self._load_tiles(tma_k, tKgK, tKsK, barK, page3, 1, 4, 9)
        warpgroup.wait_group(0)
        fence_operand(acc_O)
        if const_expr(not self.fast):
            if blk0 + 2 <= last:
                if wtid < 32 * self.load_warps:
                    self._load_tiles(tma_k, tKgK, tKsK, barK, page2, 0, 4, 9)
        if const_expr(has3):
            self._qk(acc_S, tSrQ, tSrK, tSrK_rs, rQ8, barK, phase, 1, (4, 5, 6, 7, 8, 0, 1, 2, 3))
            if const_expr(self.fast):
                self._transpose_v(1, 1, self._page_valid(blk0 + 3, nb_req, tail), NB_WG1, barK,
                                  phase, False)
            warpgroup.wait_group(0)
            self._stamp("ev", 128, 7)
            fence_operand(acc_S)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _epilogue(self, acc_O, row_sum, sM, sL, k_base, mO, mLSE, mOacc, mLSEacc, r, m_block,
                  slot, pieces, wg, wtid, r0, c0, next_q, tma_q, tma_mQ, sQ, barQ,
                  r_next: Int32):
        """Normalizes O and writes it (dtype) or the fp32 partial of a split request (slot).
        Once both warpgroups are past their last MMA, the next segment's Q starts loading
        (next_q); the output is staged in the page buffers and written by bulk copies (the split
        subclass's EPI_COPY: by its threads)."""
        tidx = wg * 128 + wtid
        for h in cutlass.range_constexpr(2):
            s = row_sum[h]
            s += cute.arch.shuffle_sync_bfly(s, offset=1)
            s += cute.arch.shuffle_sync_bfly(s, offset=2)
            row_sum[h] = s
        if wtid % 4 == 0:
            for h in cutlass.range_constexpr(2):
                sL[wg * BLOCK_M + r0 + 8 * h] = row_sum[h]
        self._sync_consumers()
        self._stamp(6)
        if next_q:
            if const_expr(could_be(wg, 0)):
                if tidx < 32:
                    self._load_q(tma_q, tma_mQ, sQ, barQ, r_next, m_block)
        total = [sL[r0] + sL[BLOCK_M + r0], sL[r0 + 8] + sL[BLOCK_M + r0 + 8]]
        # A row that saw no key has sum 0: output 0 (and lse +inf below).
        inv = [softmax.inv_sum(total[0]), softmax.inv_sum(total[1])]
        if const_expr(self.kv_fp8):
            inv = [inv[0] * self.d_kv_scale, inv[1] * self.d_kv_scale]  # V's scale
        valid_rows = cutlass.min(self.d_rows - m_block * BLOCK_M, BLOCK_M)
        shift = Float32(P_SHIFT * int(self.fast))  # (see _exp_rows)
        splitkv.store_result(
            pieces, lambda t, i, dt: self._stage_and_store(
                acc_O, inv, k_base, dt, t[i, None, None], m_block, valid_rows, r0, c0, wg, wtid),
            mO, mOacc, r, slot, self.dtype)
        if wg == 0:
            if wtid % 4 == 0:
                for h in cutlass.range_constexpr(2):
                    row = m_block * BLOCK_M + r0 + 8 * h
                    if row < self.d_rows:
                        splitkv.store_lse(mLSE, mLSEacc, r, slot, row, pieces, self.d_h_q,
                                          total[h], sM[r0 + 8 * h], shift)

    @cute.jit
    def _stage_and_store(self, acc_O, inv, k_base, out_dtype: cutlass.Constexpr, gOut,
                         m_block, valid_rows, r0, c0, wg, wtid):
        """This warpgroup's half of O (64 x 256) * inv staged in shared memory (_stage_o) ->
        rows [0, valid_rows) of gOut[m_block * 64 + row, 256 wg:] by one bulk copy per row.
        The issuing threads wait until the copies have read shared memory, so the buffers are
        free at the next __syncthreads."""
        nbytes = out_dtype.width // 8
        base = self._stage_o(acc_O, inv, k_base, out_dtype, r0, c0, wg)
        self._stamp(7)
        if wtid < valid_rows:
            row = m_block * BLOCK_M + wtid
            dst = gOut.iterator + cute.crd2idx((row, wg * HALF_V), gOut.layout)
            src = base + wtid * STAGE_STRIDE
            bulk_s2g(dst.toint(), src.toint(), HALF_V * nbytes)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        self._stamp(8)

    @cute.jit
    def _stage_o(self, acc_O, inv, k_base, out_dtype: cutlass.Constexpr, r0, c0, wg):
        """This warpgroup's half of O (64 x 256) * inv in out_dtype -> its own region of the
        page buffers, rows STAGE_STRIDE elements apart (padded by 8 so that the lanes of a store
        phase hit 32 distinct banks), fenced for the async proxy and then the warpgroup's
        barrier: the region's pointer (out_dtype elements)."""
        # Lane (k, m) = (lane // 4, lane % 4) stores at word k * stride_words + 2 m (fp32 pairs,
        # two 16-lane phases) or k * stride_words + m (16-bit pairs, one phase): a stride of
        # 8 words mod 32 (fp32) or 4 words mod 32 (16-bit) spreads them over all 32 banks.
        stride = STAGE_STRIDE
        base = cute.recast_ptr(k_base, dtype=out_dtype) + wg * (BLOCK_M * stride)
        sO = cute.make_tensor(base, cute.make_layout((BLOCK_M, HALF_V), stride=(stride, 1)))
        pair = cute.make_rmem_tensor(2, out_dtype)
        for h in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(HALF_V // 8):
                for c in cutlass.range_constexpr(2):
                    pair[c] = (acc_O[c + 2 * h + 4 * j] * inv[h]).to(out_dtype)
                cute.local_tile(sO[r0 + 8 * h, None], (2,), (4 * j + c0 // 2,)).store(
                    pair.load())
        cute.arch.fence_view_async_shared()
        if wg == 0:
            cute.arch.barrier(barrier_id=NB_WG0, number_of_threads=128)
        else:
            cute.arch.barrier(barrier_id=NB_WG1, number_of_threads=128)
        return base

    @cute.jit
    def _page(self, mBlockTable, r: Int32, blk: Int32) -> Int32:
        """What _load_tiles takes for block blk of request r: its cache page (the sparse
        subclass: the block itself, see there)."""
        return mBlockTable[r, blk]

    @cute.jit
    def _next_page(self, mBlockTable, r: Int32, blk: Int32):
        """_page for a block loaded later in the pair (the sparse subclass also reads the
        block's entries here, so that their latency hides behind the softmax)."""
        return self._page(mBlockTable, r, blk)

    @cute.jit
    def _load_request(self, req, mSeqlens, mBlockTable, mNumSplits, r: Int32, lo: Int32):
        """req <- (L, pages lo and lo + 1, slot range start and end) of request r (loads only:
        the values are read a segment later). Page indices are clamped to the table's row."""
        last_col = self._table_blocks(mBlockTable) - 1
        req[0] = mSeqlens[r]
        if last_col >= 0:
            req[1] = self._page(mBlockTable, r, cutlass.min(lo, last_col))
            req[2] = self._page(mBlockTable, r, cutlass.min(lo + 1, last_col))
        req[3] = mNumSplits[r]
        req[4] = mNumSplits[r + 1]


class MLADecodeSm90Fast(MLADecodeSm90):
    """Fast mode over a float8_e4m3fn cache (compute="fp8"): Q K^T and P V on the e4m3 wgmma.

    Same schedule, seesaw, split-KV partials and combine as MLADecodeSm90; what differs:
    - shared memory holds bytes: Q (64 x 576, quantized per row at each segment's start by
      _quantize_q), the two page buffers as TMA leaves them (9 tiles of 64 keys x 64 bytes,
      64-byte swizzle), V^T of each buffer (512 d-rows x 64 keys, written by _transpose_v:
      e4m3 wgmma operands are K-major, and the cache holds V token-major), and P0, P1;
    - P is 2^P_SHIFT x the probabilities, in e4m3, in the scores' register order; V^T's keys
      are permuted to match (fp8_pv_key), so no byte moves between threads;
    - the scores' scale is per row: softmax scale x kv_scale x the row's Q scale.
    q_fp8: q is e4m3 (its bytes are copied; q_scale is every row's scale).
    p_dither: P is dithered before its e4m3 rounding (ptx.e4m3_dither: by one e4m3 step's
    fraction taken from P's own fp32 bits 8-15), so its rounding error no longer correlates
    with V over long contexts (docs/kernels/keysm.md, "Fast mode's error"). Opt-in
    (TORCH_MLA_FAST_DITHER=1, ops/dispatch.py): its tests pass on an H100, 1.19-1.27x slower."""

    fast = True

    def __init__(self, dtype, causal: bool, q_fp8: bool = False, p_dither: bool = False):
        super().__init__(dtype, causal, kv_fp8=True)
        self.q_fp8 = bool(q_fp8)
        self.p_dither = bool(p_dither)

    def _setup(self, mQ: cute.Tensor, mKV: cute.Tensor):
        """As MLADecodeSm90._setup, for e4m3 operands: mQ is dtype, or uint8 (e4m3 bytes) when
        q_fp8; mKV uint8 (e4m3 bytes)."""
        f8 = cutlass.Float8E4M3FN
        kmode = cute.nvgpu.OperandMajorMode.K
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, f8)
        sQ_layout = cute.tile_to_shape(atom, (BLOCK_M, D_QK), order=(0, 1))
        sK_layout = cute.tile_to_shape(atom, (PAGE_SIZE, D_QK, 2), order=(0, 1, 2))
        tile_layout = cute.tile_to_shape(atom, (64, 64), order=(0, 1))
        vt_layout = cute.tile_to_shape(atom, (HALF_V, PAGE_SIZE), order=(0, 1))
        tiled_qk = sm90_utils.make_trivial_tiled_mma(
            f8, f8, kmode, kmode, Float32, (1, 1, 1), (BLOCK_M, PAGE_SIZE))
        tiled_pv_rs = sm90_utils.make_trivial_tiled_mma(
            f8, f8, kmode, kmode, Float32, (1, 1, 1), (BLOCK_M, HALF_V),
            warpgroup.OperandSource.RMEM)
        tiled_pv_ss = sm90_utils.make_trivial_tiled_mma(
            f8, f8, kmode, kmode, Float32, (1, 1, 1), (BLOCK_M, HALF_V))
        mKV_t = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
        tma_k, tma_mKV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKV_t, tile_layout, (PAGE_SIZE, 64))

        u8 = cutlass.Uint8
        self.shared_storage = shared_storage(
            sQ=aligned(u8, BLOCK_M * D_QK),
            # sK then sVt, adjacent: the epilogue stages fp32 O (132 KB) across both.
            sK=aligned(u8, 2 * PAGE_SIZE * D_QK),
            sVt=aligned(u8, 2 * D_V * PAGE_SIZE),
            sP0=aligned(u8, BLOCK_M * PAGE_SIZE),
            sP1=aligned(u8, BLOCK_M * PAGE_SIZE),
            sQScale=cute.struct.MemRange[Float32, BLOCK_M],
        )
        # (No Q TMA: the tma_q slot carries the cache's atom, unused; tma_mQ is q itself.)
        return TmaLoads(tma_k, mQ, tma_k, tma_mKV), (
            sQ_layout, sK_layout, tile_layout, vt_layout, tiled_qk, tiled_qk, tiled_pv_rs,
            tiled_pv_ss)


# --- compile entry (ops/registry.py: DecodeStepConfig / DecodeConfig, backend "sm90") ---------


def decode_kernel(config, arch: str):
    """The SM90 decode kernel a registry config asks for (dtype, causal, kv_fp8, compute,
    q_fp8); arch is sm_90a."""
    from ..contract import dsl_dtype

    dtype = dsl_dtype(config.dtype)
    if config.compute == "fp8":
        return MLADecodeSm90Fast(dtype, config.causal, q_fp8=config.q_fp8,
                                 p_dither=config.p_dither)
    return MLADecodeSm90(dtype, config.causal, kv_fp8=config.kv_fp8)
