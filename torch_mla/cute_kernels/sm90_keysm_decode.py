"""MLA decode on Hopper with the keys on the wgmma's M side, for few query rows (s_q * h_q <= 64).

Problem (as sm90_decode.py): for each request r with L_r cached latents and s_q * h_q query rows,
    out = softmax(scale * Q K^T) V,   K = latent (576 columns), V = its first 512 columns.

Why another kernel: the heads-on-M kernel (sm90_decode.py) pads the query rows to wgmma's M = 64,
so at h_q 16 three quarters of its tensor work is padding, and its FP8 exact mode expands each page
in place on the critical path (issue 31: 1.12x the bf16 time at h_q 16 while reading half the
bytes). Here a CTA computes the transposed products, with the query rows ("columns") on N, which
wgmma allows from 8 up:

    S^T = K Q^T        A = the page (64 keys x 576, K-major: the latent is contiguous), from smem
                       B = Q^T (N columns x 576, K-major: q rows are contiguous), from smem
    softmax per column (a query row's maximum and sum run over the 64 keys = over M)
    O^T += V^T P^T     A = V^T (512 x 64 keys), MN-major: the same page tile read transposed
                       (allowed for 16-bit wgmma); B = P^T (N x 64 keys), MN-major, written to smem
                       by the consumer in the S^T accumulator's own order

Tiles: a CTA takes N = `columns` query rows (8, 16, 32 or 64; rows padded to N, the padding
columns are zero (TMA fills rows past q's end) and never stored). A consumer warpgroup owns up
to 32 columns: O^T (512 x 32 fp32) is 128 registers a thread; 64 columns are two consumer
warpgroups, each with its own 32 columns, its own softmax and O^T, both reading the same page
(the columns are independent: nothing else is exchanged). One producer warp issues the TMA
(at 64 columns the first warp of a producer warpgroup whose registers go to the consumers).

Pipeline: a ring of `stages` page buffers filled by the producer warp (full mbarrier: TMA
transaction count; empty mbarrier: one arrival per consumer warp). Per page, each consumer
warpgroup: S^T (36 wgmma m64nNk16), mask, column max (lanes, the two row halves, then the 4
warps through smem), online softmax, P^T -> smem (16-bit), O^T (32 wgmma: 8 m-tiles x 4 k-steps),
release the buffer. Q (N x 576) is loaded by the producer per segment (q_full / q_empty).
  - bf16/fp16 cache: TMA lands each 64 x 64 tile in the 128-byte-swizzled layout the MMAs read;
    2 stages (3 do not fit beside Q at 32 columns).
  - float8_e4m3fn cache (exact mode, kv_fp8): the ring holds the fp8 bytes (3 stages of 36 KB at
    <= 32 columns, 2 at 64); the consumer threads expand a page into one 16-bit work buffer
    (exact conversions, keys past the request's length written as 0) before its S^T, and release
    the ring stage right after, so the TMA of later pages runs under the MMAs. kv_scale (and
    q_scale) fold into the softmax scale and the epilogue, as in sm90_decode.py. This class has
    no fp8-MMA mode: e4m3 wgmma takes both operands K-major, fine for S^T but V^T would need
    a transposed copy of every page; fast mode (sm90_keysm_fast_decode.py) runs S^T on e4m3
    and keeps O^T in f16.
  - f16 MMAs (q_f16: bf16 q over an e4m3 cache): every e4m3 value is exact in f16, whose
    conversion is one cvt a pair (bf16 takes four: e4m3 -> f16 -> 2 x f32 -> bf16). Q, as TMA
    lands it, is converted in place once a segment, times the power of two q_f16_factors picks
    from the tile's largest |q| (no f16 overflow; values within 2^-29 of it exact), whose
    inverse multiplies the segment's softmax scale; P is written in f16. Not over the 656-byte
    rows (their rope tile is bf16).

Epilogue (per segment): column sums over lanes and warps, O^T / sum written from the accumulator
registers straight to global memory (a warp's store covers 8 consecutive d of 4 columns; the
output is 1/64 of the bytes a request reads at s_k 8192), fp32 partials and a
log2 lse for a split request (splitkv.py), the combine merges them.

Masking, empty rows, bad inputs: as sm90_decode.py. Keys at or past a column's horizon get -inf;
rows of the page past L in a request's last page are zeroed in smem before the MMAs (the cache
may hold NaN there, 0 * NaN = NaN); TMA zero-fills page ids outside the cache; no printf.

Limits: d_qk 576, d_v 512, page 64, bf16/fp16 q and cache or an e4m3 cache (exact mode; f16 MMAs
under bf16 q), one latent head per launch. Any s_q * h_q runs (a CTA per N rows and part), but the
schedule gives a part per SM only for <= 64 rows. The dispatch uses it where s_q * h_q <= 32 (up to
64 with TORCH_MLA_KEYSM=1, up to 128 with =128, a CTA for each 64, never with =0:
dispatch.keysm_columns); over an e4m3 cache its ping-pong subclass from KEYSM_RS_MIN_BATCH
requests, and in fast mode sm90_keysm_fast_decode.py (dispatch.keysm_kind). f16 MMAs: one factor
per Q tile, so a row whose magnitude is below 2^-29 of the tile's largest loses bits (not a case
seen in models).
Status: verified on the H200 (tests, memcheck, fuzz); docs/kernels/keysm.md has its speed.
The f16 MMAs ran there (session 19), with their exclusion of inf / NaN from the tile's factor
in session 20 (no GPU test feeds an inf; tests/test_keysm.py checks the factors on the CPU).
The ping-pong subclass (sm90_keysm_rs_decode.py) replaces the consumer's hooks (_operands,
_q_ready, _mma_s, _mma_o, _prepare_stage, _pt_key, _store_o) and adds _merge_and_store,
which the consumer calls when pingpong; its fast subclass also replaces _page_scale.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..constants import D_QK, D_V, KEYSM_COLUMNS, PAGE_SIZE
from . import softmax, splitkv
from .decode_base import DecodeKernel, Fp8Args, SplitKVTensors, TmaLoads, aligned, shared_struct
from .ptx import (
    L2_EVICT_FIRST,
    bf16x2_to_f16x2,
    e4m3_store16,
    fence_operand,
    int_as_f32,
    lds64,
    lds128,
    sts,
)

WG_COLUMNS = 32  # at most a consumer warpgroup's columns: O^T 512 x 32 fp32 = 128 registers
N_TILES = D_QK // 64  # 64-column tiles of a page (8 of V + 1 of RoPE)
TILE_ELEMS = PAGE_SIZE * 64  # elements of a 64-key x 64-column tile
PAGE_ELEMS = PAGE_SIZE * D_QK
# group_scales (the sparse subclass's 656-byte rows): an fp8 ring stage holds the 8 e4m3 tiles
# (32 KB, as the e4m3 cache's first 8), then the rope tile as the work buffer holds it (16-bit,
# swizzled, 8 KB), then each key's four float32 scales (16 bytes a key).
ROPE_TILE_AT = (N_TILES - 1) * TILE_ELEMS
GROUP_SCALES_AT = ROPE_TILE_AT + 2 * TILE_ELEMS
GROUP_STAGE_BYTES = GROUP_SCALES_AT + 16 * PAGE_SIZE

# Named barrier ids (0 is __syncthreads).
NB_CONSUMERS = 1  # every consumer thread: a page buffer prepared (expanded, tail zeroed)
NB_WG = 2  # + consumer warpgroup index: its column maxima / sums exchanged, its P^T written
# setmaxnreg with two consumer warpgroups (384 threads, 168 registers each at launch): (producer,
# consumers), 128 p + 256 c = 168 x 384, by cache format (kv_fp8): the fp8 consumers' expansion
# needs 240 and their producer 24 suffices; the 16-bit producer spills below 56 (ptxas, no spill
# either way).
REGS = {False: (56, 224), True: (24, 240)}


def plan(columns: int) -> tuple[int, int]:
    """(consumer warpgroups, columns each) of a CTA taking `columns` query rows."""
    n_wg = min(columns, WG_COLUMNS)
    return columns // n_wg, n_wg


def stages(columns: int, kv_fp8: bool) -> int:
    """Ring stages that fit in 227 KB beside Q (columns x 576), P^T and the work buffer: 16-bit
    pages (72 KB) 2; fp8 pages (36 KB, plus one 72 KB work buffer) 3, or 2 at 64 columns."""
    if not kv_fp8:
        return 2
    return 2 if columns > WG_COLUMNS else 3


# ---- index arithmetic, modelled in Python (tests/test_keysm.py checks it) ---------------------


def acc_coord(lane, warp, idx):
    """(m, n) of value idx of a wgmma m64nN fp32 accumulator held by lane `lane` of warp `warp`
    (0..3) of the warpgroup: m = 16 warp + lane / 4 + 8 h, n = 8 j + 2 (lane % 4) + c for
    idx = c + 2 h + 4 j (the DSL's tv_layout_C; softmax.py's MMA fragment). Here m is a key of
    the page (S^T) or a d row of an m-tile (O^T), n a query column."""
    c, h, j = idx % 2, (idx // 2) % 2, idx // 4
    return 16 * warp + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + c


def pt_offset(key, col, n_wg: int):
    """Element offset of P^T[col][key] in a consumer's P^T tile (n_wg columns x 64 keys,
    MN-major: the column index contiguous), the DSL's MN_INTER / MN_SW32 / MN_SW64 atom for
    n_wg = 8 / 16 / 32 tiled over the keys: linear col + n_wg key, then the atom's swizzle
    Swizzle<log2(n_wg / 8), 4, 3>, which (as TMA and wgmma) acts on byte addresses: 16-byte
    chunk bits 4.. ^= bits 7.., i.e. element bits 3.. ^= bits 6... Adjacent columns 2q, 2q + 1
    stay adjacent (a 32-bit store)."""
    bits = {8: 0, 16: 1, 32: 2}[n_wg]
    o = col + n_wg * key
    return o ^ ((o >> 3) & (((1 << bits) - 1) << 3))


def ring_slot(count, stages: int):
    """The ring stage of the count-th use (page or segment) and the parity of its full barrier's
    phase that use waits for; the producer waits for the empty barrier's other parity (a fresh
    barrier passes it: the first lap never waits). tests/test_keysm.py runs the protocol."""
    return count % stages, (count // stages) % 2


def fp8_unit(u):
    """The u-th 16-byte unit (0..2303) of a page's fp8 expansion: (byte offset of its 16 e4m3
    values in the ring stage (9 tiles of 64 keys x 64 bytes, unswizzled, 4 KB apart), byte
    offsets of the two 16-byte chunks its values 0-7 and 8-15 go to in the 16-bit page buffer
    (9 tiles of 64 keys x 128 bytes, 8 KB apart, 128-byte swizzle: chunk ^= key % 8), key).
    Consecutive units are consecutive source bytes (conflict-free 16-byte loads); the 8 lanes of
    a store phase write rows key, key + 1 in chunks {0, 2, 4, 6} ^ key and ^ (key + 1), which
    are distinct banks."""
    tile, rem = u // 256, u % 256
    key, part = rem // 4, rem % 4
    row = tile * (PAGE_SIZE * 128) + key * 128
    return (tile * (PAGE_SIZE * 64) + key * 64 + part * 16,
            row + ((2 * part) ^ (key % 8)) * 16, row + ((2 * part + 1) ^ (key % 8)) * 16, key)


BF16_INF = 0x7F80  # bits of a bf16 infinity: magnitudes at or above it are inf or NaN


def finite_bf16_max(big, words):
    """q_f16: big raised to the largest finite magnitude, as bf16 bits (non-negative floats sort
    as their bits), of the bf16 pairs in `words` (32-bit words, traced inline). An inf or NaN is
    left out: it would shrink every row's factor to 2^-114, zeroing the tile's other rows; it
    converts as itself instead."""
    for x in words:
        a = x & 0x7FFF7FFF
        for h in (a & 0xFFFF, a >> 16):
            big = cutlass.max(big, cutlass.select_(h < BF16_INF, h, Int32(0)))
    return big


def q_f16_factors(big, imax=max):
    """q_f16: for `big` the largest finite |q| of a Q tile as bf16 bits (non-negative floats
    sort as their bits; inf and NaN left out, they convert as themselves), the float32 bits of
    (mul, inv): q x mul goes to f16, inv = 1 / mul is the segment's factor of the softmax
    scale. |q| < 2^(E - 126) for the bf16 exponent field E, so |q| mul < 2^15 with
    mul = 2^(141 - E): f16's range, values within 2^-29 of the largest normal in f16 (exact:
    bf16's 8 mantissa bits fit in f16's 11), the rest below f16's rounding of the products'
    sum. E at least 15 keeps both factors normal floats (and an all-zero Q finite). imax: max
    of the caller's integers (cutlass.max in the kernel); tests/test_keysm.py checks these
    claims."""
    e = imax(big >> 7, 15)
    return (268 - e) << 23, (e - 14) << 23


def smem_layouts(dt, n_wg: int, consumers: int, buffers: int):
    """The shared-memory layouts (called while tracing; tests/test_keysm.py checks them against
    the models above): the Q TMA tile (n_wg x 576) and Q (n_wg, 576, consumers), K-major with
    the 128-byte swizzle; the 16-bit page buffers (64 keys, 576, buffers), likewise; V^T of
    them, (512 d, 64 keys, buffers), MN-major, the same bytes (the buffer's swizzle); P^T
    (n_wg, 64 keys, consumers), MN-major (pt_offset); a 64 x 64 page tile (TMA)."""
    k_atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(cutlass.tensor_utils.LayoutEnum.ROW_MAJOR, dt, 64), dt)
    mn_atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.MN_SW128, dt)
    p_kind = {8: warpgroup.SmemLayoutAtomKind.MN_INTER,
              16: warpgroup.SmemLayoutAtomKind.MN_SW32,
              32: warpgroup.SmemLayoutAtomKind.MN_SW64}[n_wg]
    p_atom = warpgroup.make_smem_layout_atom(p_kind, dt)
    q_tile = cute.tile_to_shape(k_atom, (n_wg, D_QK), order=(0, 1))
    sQ_layout = cute.tile_to_shape(k_atom, (n_wg, D_QK, consumers), order=(0, 1, 2))
    sK_layout = cute.tile_to_shape(k_atom, (PAGE_SIZE, D_QK, buffers), order=(0, 1, 2))
    # V^T of a buffer: (512 d, 64 keys), d contiguous inside a K-major page tile: 64-column
    # tiles 8 KB apart, groups of 8 keys 1 KB apart; buffers a page apart.
    vt = cute.tile_to_shape(mn_atom, (D_V, PAGE_SIZE), order=(1, 0))
    sVt_layout = cute.append(vt.outer, cute.make_layout(buffers, stride=PAGE_ELEMS))
    sPt_layout = cute.tile_to_shape(p_atom, (n_wg, PAGE_SIZE, consumers), order=(0, 1, 2))
    tile_layout = cute.tile_to_shape(k_atom, (PAGE_SIZE, 64), order=(0, 1))
    return q_tile, sQ_layout, sK_layout, sVt_layout, sPt_layout, tile_layout


class MLADecodeSm90KeysM(DecodeKernel):
    """Split-KV MLA decode for SM90 with keys on M; see the module docstring."""

    # Arrivals that complete a ring stage's full mbarrier (the producer's expect_tx arrival;
    # the sparse subclass gathers by cp.async: its lanes' arrivals too).
    k_arrivals = 1
    # The ring filled through the generic proxy (cp.async): a proxy fence before the MMAs
    # read a 16-bit stage.
    cp_async_tiles = False
    # Warps that fill the ring (ping-pong: of the producer warpgroup), warp i the stages s with
    # s % producer_warps == i (a divisor of the stage count): one warp's chain per page
    # (entries, wait, copies) overlaps the others' (the sparse ping-pong's gather: 4).
    producer_warps = 1
    # kv_fp8 over the 656-byte rows (the sparse subclass): see _expand.
    group_scales = False
    # Two consumer warpgroups on alternate pages of the same columns, merged at a segment's end
    # (sm90_keysm_rs_decode.py).
    pingpong = False
    # One epilogue copy a consumer warpgroup, its index a constant in each (the ping-pong
    # kernel's 64 columns: ptxas spilled 104 bytes with one copy, 12 with two; the 16-bit
    # keys-on-M kernel's 64 columns the reverse, 0 and 32).
    epilogue_per_wg = False
    # softmax.online_max's threshold: a column's max is raised only past it (log2 units; P then
    # stays below 2^max_slack) and O^T is rescaled only where a warp's max moved; None: always.
    max_slack = None

    @property
    def own_count(self) -> int:
        """The index in the consumer's counters of the pages its warpgroup took: all pages
        (0), or with ping-pong its own (2)."""
        return 2 if self.pingpong else 0

    def __init__(self, dtype, causal: bool, columns: int, kv_fp8: bool = False):
        assert columns in KEYSM_COLUMNS, columns
        self.dtype = dtype
        self.causal = bool(causal)
        self.kv_fp8 = bool(kv_fp8)
        self.block_m = columns  # query rows a CTA (DecodeKernel's grid)
        self.consumers, self.n_wg = plan(columns)
        # consumer warpgroups: one per n_wg columns here; the ping-pong subclass has two on the
        # same columns, taking alternate pages (self.pingpong)
        self.wgs = self.consumers
        self.regs = REGS[self.kv_fp8]  # (producer, consumer) registers where wgs > 1
        # + the producer warp; with two consumer warpgroups a whole producer warpgroup, whose
        # registers setmaxnreg hands to the consumers (REGS: 288 threads would cap every thread
        # at 168 registers, and O^T alone takes 128).
        self.num_threads = 128 * self.consumers + (32 if self.consumers == 1 else 128)
        self.stages = stages(columns, self.kv_fp8)
        # 16-bit page buffers the MMAs read: the ring itself, or one work buffer (fp8)
        self.buffers = 1 if self.kv_fp8 else self.stages
        # Bytes of an fp8 ring stage (the sparse subclass's 656-byte rows take more).
        self.stage_bytes = PAGE_ELEMS

    # ------------------------------------------------------------------------------------------
    # host side
    # ------------------------------------------------------------------------------------------
    def _prepare(self, mQ: cute.Tensor, mKV: cute.Tensor, fp8: tuple):
        """TMA atoms and views (Q, cache), then what the kernel takes after the scale: fp8
        (kv_scale, q_scale, q_scaled: None unless kv_fp8), the shared-memory layouts and the
        two tiled MMAs; sets self.shared_storage (traced inside DecodeKernel.__call__)."""
        n_wg, C = self.n_wg, self.consumers
        # The MMAs' 16-bit type: q's, or f16 for bf16 q over an e4m3 cache (module docstring,
        # "f16 MMAs"; not over the 656-byte rows, whose rope tile is bf16).
        self.q_f16 = (self.kv_fp8 and self.dtype == cutlass.BFloat16
                      and not self.group_scales)
        dt = cutlass.Float16 if self.q_f16 else self.dtype
        self.mma_dtype = dt
        q_tile, sQ_layout, sK_layout, sVt_layout, sPt_layout, tile_layout = smem_layouts(
            dt, n_wg, C, self.buffers)

        kmode, mnmode = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tiled_s = sm90_utils.make_trivial_tiled_mma(dt, dt, kmode, kmode, Float32, (1, 1, 1),
                                                    (PAGE_SIZE, n_wg))
        tiled_o = sm90_utils.make_trivial_tiled_mma(dt, dt, mnmode, mnmode, Float32, (1, 1, 1),
                                                    (PAGE_SIZE, n_wg))

        # TMA views: Q as (rows, 576, b), the cache as (64 keys, 576, pages).
        mQ_t = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        mKV_t = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(op, mQ_t, q_tile, (n_wg, D_QK))
        tma_k, tma_mKV = self._cache_tma(op, mKV_t, tile_layout)

        i64 = cutlass.Int64
        fields = dict(
            sQ=aligned(dt, C * n_wg * D_QK),
            sK=aligned(dt, self.buffers * PAGE_ELEMS),
            sP=aligned(dt, C * n_wg * PAGE_SIZE),
        )
        if const_expr(self.kv_fp8):
            fields["sK8"] = aligned(cutlass.Uint8, self.stages * self.stage_bytes)
        # Column maxima (two blocks' worth: one barrier a block suffices), reused for the sums.
        fields["sMax"] = cute.struct.MemRange[Float32, 2 * C * 4 * n_wg]
        fields["barFull"] = cute.struct.MemRange[i64, self.stages]
        fields["barEmpty"] = cute.struct.MemRange[i64, self.stages]
        fields["barQ"] = cute.struct.MemRange[i64, 2]  # full, empty
        if const_expr(self.q_f16):
            fields["sQmax"] = cute.struct.MemRange[Int32, 4 * C]  # _q_to_f16's warp maxima
        fields.update(self._more_smem())
        self.shared_storage = shared_struct(**fields)
        size = self.shared_storage.size_in_bytes()
        assert size <= 227 * 1024, size
        return TmaLoads(tma_q, tma_mQ, tma_k, tma_mKV), (
            fp8, sQ_layout, sK_layout, sVt_layout, sPt_layout, tiled_s, tiled_o)

    def _cache_tma(self, op, mKV_t: cute.Tensor, tile_layout):
        """The cache's TMA atom and view for 64-key x 64-column tiles of (64 keys, 576,
        pages)."""
        if const_expr(self.kv_fp8):
            # fp8 tiles land unswizzled (64-byte rows): the expansion reads them linearly.
            tile8 = cute.make_layout((PAGE_SIZE, 64), stride=(64, 1))
            return cpasync.make_tiled_tma_atom(op, mKV_t, tile8, (PAGE_SIZE, 64))
        return cpasync.make_tiled_tma_atom(op, mKV_t, tile_layout, (PAGE_SIZE, 64))

    @cute.jit
    def _fp8_ring(self, storage):
        """kv_fp8: the ring as the TMA writes it, (64 keys, 64 bytes, 1, 9 tiles, stages),
        unswizzled."""
        k8 = cute.recast_ptr(storage.sK8.data_ptr(), dtype=cutlass.Uint8)
        return cute.make_tensor(k8, cute.make_layout(
            (PAGE_SIZE, 64, 1, N_TILES, self.stages),
            stride=(64, 1, 0, TILE_ELEMS, self.stage_bytes)))

    def _more_smem(self) -> dict:
        """Shared-memory fields a subclass adds after the barriers."""
        return {}

    # ------------------------------------------------------------------------------------------
    # device side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def body(self, loads: TmaLoads, tensors: SplitKVTensors, scale_log2: Float32, fp8: Fp8Args,
             sQ_layout, sK_layout, sVt_layout, sPt_layout, tiled_s, tiled_o):
        tma_q, tma_mQ, tma_k, tma_mKV = loads
        mKVScale, mQScale, q_scaled = fp8
        tidx, _, _ = cute.arch.thread_idx()
        m_block, part, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        sw = sK_layout.inner
        sQ = cute.make_tensor(cute.recast_ptr(storage.sQ.data_ptr(), sw), sQ_layout.outer)
        sK, sVt = None, None
        if const_expr(self.buffers > 0):
            sK = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), sw), sK_layout.outer)
            sVt = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), sw), sVt_layout)
        sPt = cute.make_tensor(cute.recast_ptr(storage.sP.data_ptr(), sPt_layout.inner),
                               sPt_layout.outer)
        bar_full = storage.barFull.data_ptr()
        bar_empty = storage.barEmpty.data_ptr()
        bar_q = storage.barQ.data_ptr()
        if tidx == 0:
            cpasync.prefetch_descriptor(tma_q)
            if const_expr(tma_k is not None):
                cpasync.prefetch_descriptor(tma_k)
            for i in cutlass.range_constexpr(self.stages):
                cute.arch.mbarrier_init(bar_full + i, self.k_arrivals)
                cute.arch.mbarrier_init(bar_empty + i, 4 * self.consumers)
            cute.arch.mbarrier_init(bar_q, 1)
            cute.arch.mbarrier_init(bar_q + 1, 4 * self.wgs)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        # The combine (PDL) may launch now: it waits for this grid before reading its results.
        cute.arch.griddepcontrol_launch_dependents()

        # Device-side handles for the helper methods (IR values of this kernel's region).
        self.d_storage, self.d_tensors = storage, tensors
        if const_expr(self.buffers > 0):
            self.d_k_base = storage.sK.data_ptr().toint()
        self.d_q_base = storage.sQ.data_ptr().toint()
        self.d_p_base = storage.sP.data_ptr().toint()
        self.d_tiled_s, self.d_tiled_o = tiled_s, tiled_o
        if const_expr(self.kv_fp8):
            # Folded scales (see sm90_decode.py): read once, no host synchronisation.
            kv_scale = Float32(1.0)  # (the 656-byte rows carry their own scales)
            if const_expr(mKVScale is not None):
                kv_scale = mKVScale[0]
            q_scale = Float32(1.0)
            if const_expr(q_scaled is not None):  # (the sparse step passes no q scale)
                if q_scaled != 0:
                    q_scale = mQScale[0]
            scale_log2 = scale_log2 * kv_scale * q_scale
            self.d_kv_scale = kv_scale
            self.d_k8 = storage.sK8.data_ptr().toint()
        sMax = storage.sMax.get_tensor(cute.make_layout(
            (4, self.n_wg, self.wgs, 2),
            stride=(self.n_wg, 1, 4 * self.n_wg, 4 * self.n_wg * self.wgs)))

        walk = splitkv.read_part(tensors.metadata, part)
        if const_expr(self.wgs > 1):
            # setmaxnreg moves registers within what the launch gave the CTA (the per-thread cap
            # times the threads); asking for more blocks the increase forever (a hang, not an
            # error: the 32-column ping-pong's first try, session 23)
            cap = 65536 // self.num_threads // 8 * 8
            assert (self.num_threads - 128 * self.wgs) * self.regs[0] \
                + 128 * self.wgs * self.regs[1] <= cap * self.num_threads, self.regs
        if warp >= 4 * self.wgs:
            if const_expr(self.wgs > 1):
                cute.arch.setmaxregister_decrease(self.regs[0])
            if warp < 4 * self.wgs + self.producer_warps:
                # TMA destinations: the ring's tiles (TMA, 1, 9 tiles, stages).
                if const_expr(self.kv_fp8):
                    sK_tma = self._fp8_ring(storage)
                else:
                    sK_tma = cute.flat_divide(sK, (PAGE_SIZE, 64))  # (64, 64, 1, 9, stages)
                self._producer(walk, tensors, m_block, tma_q, tma_mQ, tma_k, tma_mKV, sQ, sK_tma,
                               bar_full, bar_empty, bar_q, warp - 4 * self.wgs)
        else:
            if const_expr(self.wgs > 1):
                cute.arch.setmaxregister_increase(self.regs[1])
            self._consumer(walk, tensors, scale_log2, m_block, tidx, warp, sQ, sK, sVt, sPt,
                           sMax, bar_full, bar_empty, bar_q)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _producer(self, walk, tensors: SplitKVTensors, m_block, tma_q, tma_mQ, tma_k, tma_mKV,
                  sQ, sK_tma, bar_full, bar_empty, bar_q, pw):
        """Producer warp pw (of producer_warps): the same walk as the consumers; per non-empty
        segment its first page, Q (once the consumers released the last segment's), then its
        other pages, each into the next ring stage once its last reader released it. With
        several producer warps, warp pw loads the pages of the stages it owns and warp 0 Q."""
        mBlockTable, mSeqlens, mNumSplits = tensors.block_table, tensors.seqlens, tensors.num_splits
        assert self.stages % self.producer_warps == 0, (self.stages, self.producer_warps)
        tKsK, tKgK = self._ring_partitions(tma_k, tma_mKV, sK_tma)
        elem_bytes = 1 if const_expr(self.kv_fp8) else self.dtype.width // 8
        page_bytes = PAGE_ELEMS * elem_bytes
        q_bytes = self.consumers * self.n_wg * D_QK * self.dtype.width // 8
        width = self._table_blocks(mBlockTable)
        cnt = cute.make_rmem_tensor(2, Int32)  # blocks issued, segments issued
        cnt.fill(0)
        for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
            L = mSeqlens[r]
            pieces = mNumSplits[r + 1] - mNumSplits[r]
            lo, hi = splitkv.segment(walk, r, L, width, pieces)
            # The segment's first page goes before its Q: a ring stage frees up before the
            # last segment's Q does, so one page loads across the segment boundary.
            for blk in cutlass.range(lo, hi, unroll=1):
                if const_expr(self.producer_warps == 1):
                    self._load_page(tma_k, tKgK, tKsK, self._page(mBlockTable, r, blk), cnt,
                                    bar_full, bar_empty, page_bytes)
                elif cnt[0] % self.producer_warps == pw:
                    self._load_page(tma_k, tKgK, tKsK, self._page(mBlockTable, r, blk), cnt,
                                    bar_full, bar_empty, page_bytes)
                else:
                    cnt[0] = cnt[0] + 1
                if blk == lo:  # (warp 0: its Q)
                    if const_expr(self.producer_warps == 1):
                        self._load_q(tma_q, tma_mQ, sQ, r, m_block, cnt, bar_q, q_bytes)
                    elif pw == 0:
                        self._load_q(tma_q, tma_mQ, sQ, r, m_block, cnt, bar_q, q_bytes)

    @cute.jit
    def _load_q(self, tma_q, tma_mQ, sQ, r, m_block, cnt, bar_q, q_bytes):
        """Request r's Q tile into sQ once the consumers released the last segment's (one
        producer warp); cnt[1] += 1."""
        cute.arch.mbarrier_wait(bar_q + 1, ring_slot(cnt[1], 1)[1] ^ 1)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar_q, q_bytes)
        for c in cutlass.range_constexpr(self.consumers):
            gQ = cute.local_tile(tma_mQ[None, None, r], (self.n_wg, D_QK),
                                 (m_block * self.consumers + c, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_q, 0, cute.make_layout(1),
                cute.group_modes(sQ[None, None, c], 0, 2), cute.group_modes(gQ, 0, 2))
            cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=bar_q,
                      cache_policy=cutlass.Int64(L2_EVICT_FIRST))
        cnt[1] = cnt[1] + 1

    @cute.jit
    def _ring_partitions(self, tma_k, tma_mKV, sK_tma):
        """The TMA partitions of the ring's tiles (TMA, 1, 9 tiles, stages) and the cache's
        (TMA, 9 tiles, pages)."""
        gK = cute.local_tile(tma_mKV, (PAGE_SIZE, 64), (0, None, None))  # (64, 64, 9, pages)
        return cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                     cute.group_modes(sK_tma, 0, 2), cute.group_modes(gK, 0, 2))

    @cute.jit
    def _page(self, mBlockTable, r: Int32, blk: Int32) -> Int32:
        """What _load_page takes for block blk of request r: its cache page."""
        return mBlockTable[r, blk]

    @cute.jit
    def _load_page(self, tma_k, tKgK, tKsK, page, cnt, bar_full, bar_empty, page_bytes):
        """The producer warp: cache page `page` into the ring stage of use cnt[0], once its
        last reader released it; cnt[0] += 1."""
        s, parity = ring_slot(cnt[0], self.stages)
        cute.arch.mbarrier_wait(bar_empty + s, parity ^ 1)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar_full + s, page_bytes)
        # Each page is read once by one CTA: evict_first (sm90_decode.py, ptx.py).
        for t in cutlass.range_constexpr(N_TILES):
            cute.copy(tma_k, tKgK[None, t, page], tKsK[None, 0, t, s], tma_bar_ptr=bar_full + s,
                      cache_policy=cutlass.Int64(L2_EVICT_FIRST))
        cnt[0] = cnt[0] + 1

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _consumer(self, walk, tensors: SplitKVTensors, scale_log2: Float32, m_block, tidx, warp,
                  sQ, sK, sVt, sPt, sMax, bar_full, bar_empty, bar_q):
        """A consumer warpgroup (wg): columns [n_wg wg, n_wg (wg + 1)) of the CTA's N."""
        mBlockTable, mSeqlens, mNumSplits = tensors.block_table, tensors.seqlens, tensors.num_splits
        mO, mLSE, mOacc, mLSEacc = tensors.out, tensors.lse, tensors.oacc, tensors.lseacc
        n_wg = self.n_wg
        wg = warp // 4
        wq = warp % 4
        wtid = tidx % 128
        lane = tidx % 32
        rows = mO.shape[1]
        h_q = mLSE.shape[1]
        s_q = mLSE.shape[2]
        self.d_rows, self.d_h_q, self.d_s_q = rows, h_q, s_q
        width = self._table_blocks(mBlockTable)

        thr_s = self.d_tiled_s.get_slice(wtid)
        thr_o = self.d_tiled_o.get_slice(wtid)
        ops = self._operands(thr_s, thr_o, sQ, sK, sVt, sPt, wg)
        acc_S = cute.make_rmem_tensor(thr_s.partition_shape_C((PAGE_SIZE, n_wg)), Float32)
        acc_O = cute.make_rmem_tensor(thr_o.partition_shape_C((D_V, n_wg)), Float32)
        rP = cute.make_rmem_tensor(cute.size(acc_S), self.mma_dtype)

        ncol = n_wg // 4  # columns a thread holds: jc = 2 j + c is column 8 j + 2 (lane % 4) + c
        m_run = cute.make_rmem_tensor(ncol, Float32)  # running max per column (log2 domain)
        l_run = cute.make_rmem_tensor(ncol, Float32)  # this thread's partial sums per column
        # pages walked, segments walked, pages this warpgroup took (its sMax slot's parity)
        cnt = cute.make_rmem_tensor(3, Int32)
        cnt.fill(0)
        # the query row of this warpgroup's column 0 (ping-pong: both take the same columns)
        col0 = m_block * self.block_m + (0 if const_expr(self.pingpong) else wg * n_wg)

        for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
            L = mSeqlens[r]
            slot0 = mNumSplits[r]
            pieces = mNumSplits[r + 1] - slot0
            lo, hi = splitkv.segment(walk, r, L, width, pieces)
            if lo < hi:
                min_border = softmax.row_border(L, m_block * self.block_m, rows, h_q, s_q,
                                                self.causal)
                m_run.fill(-Float32.inf)
                l_run.fill(0.0)
                acc_O.fill(0.0)
                cute.arch.mbarrier_wait(bar_q, ring_slot(cnt[1], 1)[1])
                # per column jc of the thread: the softmax scale times Q's factor
                seg_scale = [scale_log2 * f for f in self._q_ready(wg, wq, lane, wtid, tidx)]
                nb_req = splitkv.num_blocks(L)
                for blk in cutlass.range(lo, hi, unroll=1):
                    valid = Int32(PAGE_SIZE)
                    if blk == nb_req - 1:
                        if L % PAGE_SIZE != 0:
                            valid = L % PAGE_SIZE
                    if const_expr(self.pingpong):
                        if cnt[0] % 2 == wg:
                            self._block(blk, valid, L, col0, min_border, seg_scale, cnt, tidx,
                                        wg, wq, lane, ops, acc_S, acc_O, rP, m_run, l_run, sMax,
                                        bar_full, bar_empty)
                        else:
                            cnt[0] = cnt[0] + 1
                    else:
                        self._block(blk, valid, L, col0, min_border, seg_scale, cnt, tidx, wg,
                                    wq, lane, ops, acc_S, acc_O, rP, m_run, l_run, sMax,
                                    bar_full, bar_empty)
                # Q is free once every consumer warp is past its last S^T.
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.mbarrier_arrive(bar_q + 1)
                cnt[1] = cnt[1] + 1
                slot = slot0 + splitkv.split_index(walk, r)
                if const_expr(self.pingpong):
                    self._merge_and_store(r, slot, pieces, col0, rows, h_q, cnt, wg, wq, lane,
                                          wtid, acc_O, m_run, l_run, sMax, mO, mLSE, mOacc,
                                          mLSEacc)
                elif const_expr(not self.epilogue_per_wg):
                    self._epilogue(r, slot, pieces, col0, rows, h_q, cnt, wg, wq, lane, acc_O,
                                   m_run, l_run, sMax, mO, mLSE, mOacc, mLSEacc)
                else:
                    for w in cutlass.range_constexpr(self.consumers):
                        if wg == w:
                            self._epilogue(r, slot, pieces, col0, rows, h_q, cnt, w, wq, lane,
                                           acc_O, m_run, l_run, sMax, mO, mLSE, mOacc, mLSEacc)
            else:
                # (ping-pong: the first warpgroup's threads)
                if (not self.pingpong) or tidx < 128 * self.consumers:
                    splitkv.empty_segment(
                        walk, r, lo, L, pieces, slot0, mO, mLSE, mLSEacc,
                        m_block * self.block_m,
                        cutlass.min(rows - m_block * self.block_m, self.block_m), h_q, tidx,
                        128 * self.consumers)

    # ---- hooks of the consumer (the ping-pong subclass replaces them) -------------------------
    @cute.jit
    def _operands(self, thr_s, thr_o, sQ, sK, sVt, sPt, wg):
        """The MMAs' operand fragments: (K, Q^T, V^T, P^T) from shared memory."""
        tSrK = thr_s.make_fragment_A(thr_s.partition_A(sK))  # (MMA, 1, 36, buffers)
        tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ[None, None, wg]))  # (MMA, 1, 36)
        tOrV = thr_o.make_fragment_A(thr_o.partition_A(sVt))  # (MMA, 8, 4, buffers)
        tOrP = thr_o.make_fragment_B(thr_o.partition_B(sPt[None, None, wg]))  # (MMA, 1, 4)
        return tSrK, tSrQ, tOrV, tOrP

    @cute.jit
    def _q_ready(self, wg, wq, lane, wtid, tidx) -> list:
        """Once Q has landed: the segment's factor of the softmax scale for each of the
        thread's columns jc (q_f16: Q converted, _q_to_f16; one factor for all here)."""
        f = Float32(1.0)
        if const_expr(self.q_f16):
            f = self._q_to_f16(wg, wq, lane, wtid)
        return [f] * (self.n_wg // 4)

    def _key_row(self, key):
        """The page row (key) of S^T's row `key` and P^T's key `key`: the same here."""
        return key

    def _pt_key(self, m):
        """P^T's key (O^T's k) that S^T's row m is written to: m (the two share their key
        order) unless a subclass orders S^T's rows and O^T's k differently."""
        return m

    @cute.jit
    def _mma_s(self, ops, acc_S, s, ob, wq, lane):
        """S^T = K Q^T over page buffer ob (ops[0], ops[1]: K's and Q^T's shared-memory
        fragments): its k-steps (9 tiles x 4 of 16; the fast mode's 18 of 32); waits for it."""
        tSrK, tSrQ = ops[0], ops[1]
        atom_s = cute.make_mma_atom(self.d_tiled_s.op)
        fence_operand(acc_S)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            atom_s.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(atom_s, acc_S, tSrK[None, None, k, ob], tSrQ[None, None, k], acc_S)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_S)

    @cute.jit
    def _mma_o(self, ops, acc_O, s, ob, valid, wq, lane):
        """O^T += V^T P^T over page buffer ob: 4 k-steps of 16 keys x 8 m-tiles of 64 d;
        waits for it."""
        _, _, tOrV, tOrP = ops
        atom_o = cute.make_mma_atom(self.d_tiled_o.op)
        atom_o.set(warpgroup.Field.ACCUMULATE, True)
        fence_operand(acc_O)
        warpgroup.fence()
        for k in cutlass.range_constexpr(PAGE_SIZE // 16):
            cute.gemm(atom_o, acc_O, tOrV[None, None, k, ob], tOrP[None, None, k], acc_O)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_O)

    @cute.jit
    def _prepare_stage(self, s, valid, tidx, lane, bar_empty):
        """Before S^T, ring stage s (its full barrier passed): fp8: expanded into the work
        buffer, then released; 16-bit: the keys past `valid` zeroed. Returns the page buffer the
        MMAs read."""
        n_cons = 128 * self.consumers
        ob = s
        if const_expr(self.kv_fp8):
            ob = 0
            # Every consumer warpgroup is past the previous page's O^T (its wait_group(0)):
            # the work buffer may be overwritten.
            cute.arch.barrier(barrier_id=NB_CONSUMERS, number_of_threads=n_cons)
            self._expand(s, valid, tidx)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=NB_CONSUMERS, number_of_threads=n_cons)
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(bar_empty + s)  # the fp8 stage is free already
        else:
            if valid < PAGE_SIZE:
                self._zero_tail(s, valid, tidx)
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=NB_CONSUMERS, number_of_threads=n_cons)
        return ob

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _block(self, blk, valid, L, col0, min_border, scale_log2, cnt, tidx, wg, wq, lane, ops,
               acc_S, acc_O, rP, m_run, l_run, sMax, bar_full, bar_empty):
        """One page: wait for its ring stage, prepare it (_prepare_stage), S^T, the column
        softmax, P^T, O^T; release the stage (unless _prepare_stage did). Loop-carried state
        lives in the register tensors (cnt, acc_O, m_run, l_run)."""
        n_wg = self.n_wg
        ncol = n_wg // 4
        s, parity = ring_slot(cnt[0], self.stages)
        cute.arch.mbarrier_wait(bar_full + s, parity)
        # (read while the stage is ours: an fp8 stage is released before the mask below)
        entry_bias = self._entry_bias(s, wq, lane)
        if const_expr(self.cp_async_tiles and not self.kv_fp8):
            cute.arch.fence_view_async_shared()
        ob = self._prepare_stage(s, valid, tidx, lane, bar_empty)
        self._mma_s(ops, acc_S, s, ob, wq, lane)

        # Keys at or past each column's horizon: -inf (only where this page reaches one; the
        # horizons are computed here, not kept: registers are short beside O^T).
        key0 = blk * PAGE_SIZE
        if key0 + PAGE_SIZE > min_border:
            border = [softmax.row_border(L, col0 + 8 * (jc // 2) + 2 * (lane % 4) + jc % 2,
                                         self.d_rows, self.d_h_q, self.d_s_q, self.causal)
                      for jc in range(ncol)]
            for idx in cutlass.range_constexpr(cute.size(acc_S)):
                jc = 2 * (idx // 4) + idx % 2
                key = self._key_row(16 * wq + lane // 4 + 8 * ((idx // 2) % 2))
                if key0 + key >= border[jc]:
                    acc_S[idx] = -Float32.inf
        self._mask_entries(acc_S, entry_bias)

        scale_log2 = self._page_scale(scale_log2, lane)
        # Column maxima: the two row halves, then the column's lanes and warps (_across_keys;
        # smem slot: the parity of this warpgroup's page count; its next write to it is two of
        # its pages later, past a barrier every reader meets after reading).
        p = cnt[self.own_count] % 2
        m_thr = [cute.arch.fmax(acc_S[jc % 2 + 4 * (jc // 2)], acc_S[jc % 2 + 4 * (jc // 2) + 2])
                 for jc in range(ncol)]
        m_col = self._across_keys(m_thr, cute.arch.fmax, sMax, p, wg, wq, lane)
        m_use = [None] * ncol
        factor = [None] * ncol
        rescale = Boolean(False)
        for jc in cutlass.range_constexpr(ncol):
            m_blk = m_col[jc]
            m_old = m_run[jc]
            m_new, m_use[jc], factor[jc] = softmax.online_max(m_old, m_blk * scale_log2[jc],
                                                              self.max_slack)
            if const_expr(self.max_slack is not None):
                # O^T's columns are 0 while their max is -inf (P was 0): only a finite max
                # that moved needs a rescale
                if m_old != -Float32.inf:
                    rescale = rescale | (m_new != m_old)
            m_run[jc] = m_new

        # P = 2^(S scale - m); partial column sums; O^T columns rescaled.
        part_sum = [Float32(0.0)] * ncol
        for idx in cutlass.range_constexpr(cute.size(acc_S)):
            jc = 2 * (idx // 4) + idx % 2
            pv = softmax.exp_scaled(acc_S[idx], scale_log2[jc], m_use[jc])
            acc_S[idx] = pv
            part_sum[jc] = part_sum[jc] + pv
        for jc in cutlass.range_constexpr(ncol):
            l_run[jc] = l_run[jc] * factor[jc] + part_sum[jc]
        if const_expr(self.max_slack is None):
            self._rescale(acc_O, factor)
        elif cute.arch.vote_any_sync(rescale):
            self._rescale(acc_O, factor)

        # P^T -> smem in 16 bits: word h + 2 j holds key 16 wq + lane / 4 + 8 h, columns
        # 8 j + 2 (lane % 4) + {0, 1} (adjacent in the MN-major tile).
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            rP[i] = acc_S[i].to(self.mma_dtype)
        rP32 = cute.recast_tensor(rP, Int32)
        p_base = self.d_p_base + wg * (n_wg * PAGE_SIZE * 2)
        for w in cutlass.range_constexpr(cute.size(rP32)):
            h, j = w % 2, w // 2
            key = self._pt_key(16 * wq + lane // 4 + 8 * h)
            sts(p_base + 2 * pt_offset(key, 8 * j + 2 * (lane % 4), n_wg), [rP32[w]])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=NB_WG + wg, number_of_threads=128)

        self._mma_o(ops, acc_O, s, ob, valid, wq, lane)
        # (a stage the MMAs read in place: released now; an expanded fp8 one was already)
        if const_expr(not self.kv_fp8 or self.buffers == 0):
            cute.arch.sync_warp()
            if lane == 0:
                cute.arch.mbarrier_arrive(bar_empty + s)
        cnt[0] = cnt[0] + 1
        if const_expr(self.pingpong):
            cnt[2] = cnt[2] + 1

    @cute.jit
    def _rescale(self, acc_O, factor):
        """O^T's columns times their factors (the online softmax's new max)."""
        per_tile = cute.size(acc_O) // (D_V // 64)
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            v = i % per_tile
            acc_O[i] = acc_O[i] * factor[2 * (v // 4) + v % 2]

    def _page_scale(self, scale_log2: list, lane) -> list:
        """The softmax scale of each of the thread's columns for a page, from the segment's
        (the list _q_ready's factors made): the same here (fast mode's per-row Q scales)."""
        return scale_log2

    @cute.jit
    def _entry_bias(self, s, wq, lane):
        """What _mask_entries adds for this thread's keys of ring stage s, read from the stage
        before it is released: nothing here (the sparse subclass)."""
        return None

    @cute.jit
    def _mask_entries(self, acc_S, entry_bias):
        """Keys that no entry names: none here (the sparse subclass)."""
        pass

    @cute.jit
    def _across_keys(self, part, op, sMax, p, wg, wq, lane):
        """op over a column's 64 keys: part[jc] is this thread's value for its column jc (its
        rows combined); op over the column's 8 lanes (butterflies on lane bits 2-4), then over
        the 4 warps through sMax slot p (one warpgroup barrier). Returns the column values, in
        the same order on every thread that holds the column."""
        out = []
        for jc in cutlass.range_constexpr(len(part)):
            v = part[jc]
            for off in cutlass.range_constexpr(3):
                v = op(v, cute.arch.shuffle_sync_bfly(v, offset=4 << off))
            if lane < 4:
                sMax[wq, 8 * (jc // 2) + 2 * lane + jc % 2, wg, p] = v
        cute.arch.barrier(barrier_id=NB_WG + wg, number_of_threads=128)
        for jc in cutlass.range_constexpr(len(part)):
            col = 8 * (jc // 2) + 2 * (lane % 4) + jc % 2
            out.append(op(op(sMax[0, col, wg, p], sMax[1, col, wg, p]),
                          op(sMax[2, col, wg, p], sMax[3, col, wg, p])))
        return out

    @cute.jit
    def _expand(self, s, valid, tidx):
        """kv_fp8: ring stage s (9 tiles of 64 keys x 64 e4m3 bytes) -> the 16-bit work buffer
        in the swizzled layout the MMAs read (fp8_unit), keys at or past `valid` as 0. Every
        consumer thread takes units tidx + 128 C w, loads before stores in groups of 6 (4).
        group_scales (the 656-byte rows): tiles 0-7 only, each value times its row's scale of
        its 128 columns (GROUP_SCALES_AT in the stage: 16 bytes a key), and the rope tile,
        16-bit already (ROPE_TILE_AT, the work buffer's swizzle), copied as it is."""
        n_cons = 128 * self.consumers
        units = PAGE_ELEMS // 16
        if const_expr(self.group_scales):
            units = (N_TILES - 1) * PAGE_SIZE * 4
        waves = units // n_cons
        src = self.d_k8 + s * self.stage_bytes
        dst = self.d_k_base
        bf16 = self.mma_dtype == cutlass.BFloat16
        group = 4 if self.group_scales else 6  # (with the scales, 6 spill at 32 columns)
        for g in cutlass.range_constexpr(0, waves, group):
            words = []
            scales = []
            for w in cutlass.range_constexpr(g, min(g + group, waves)):
                a, _, _, key = fp8_unit(w * n_cons + tidx)
                x = lds128(src + a)
                words.append([cutlass.select_(key < valid, x[i], Int32(0)) for i in range(4)])
                if const_expr(self.group_scales):
                    # The wave's tile, the same for every thread (n_cons divides a tile's 256
                    # units), and its 128-column group.
                    grp = (w * n_cons // (PAGE_SIZE * 4)) // 2
                    pair = lds64(src + GROUP_SCALES_AT + key * 16 + (grp // 2) * 8)
                    scales.append(pair[grp % 2])
                else:
                    scales.append(None)
            for w in cutlass.range_constexpr(g, min(g + group, waves)):
                _, d0, d1, _ = fp8_unit(w * n_cons + tidx)
                e4m3_store16(dst + d0, dst + d1, words[w - g], bf16, scales[w - g])
        if const_expr(self.group_scales):
            rope = (N_TILES - 1) * TILE_ELEMS * 2
            for w in cutlass.range_constexpr(TILE_ELEMS * 2 // 16 // n_cons):
                c = (w * n_cons + tidx) * 16
                sts(dst + rope + c, lds128(src + ROPE_TILE_AT + c))

    @cute.jit
    def _q_to_f16(self, wg, wq, lane, wtid) -> Float32:
        """q_f16: warpgroup wg's Q tile (n_wg x 576 bf16, as TMA landed it) -> f16 in place,
        times the power of two q_f16_factors picks from its largest |q|; returns the factor's
        inverse, for the segment's softmax scale. Two passes over the thread's own 16-byte
        units (the largest magnitude, then the conversion): no thread writes what another
        reads."""
        units = self.n_wg * D_QK // 8
        base = self.d_q_base + wg * (units * 16)
        waves = (units + 127) // 128
        big = Int32(0)  # the largest bf16 magnitude, as bits (non-negative floats sort as ints)
        for w in cutlass.range_constexpr(waves):
            u = w * 128 + wtid
            if u < units:
                big = finite_bf16_max(big, lds128(base + u * 16))
        for off in cutlass.range_constexpr(5):
            big = cutlass.max(big, cute.arch.shuffle_sync_bfly(big, offset=1 << off))
        qmax = self.d_storage.sQmax.get_tensor(cute.make_layout(4 * self.consumers))
        if lane == 0:
            qmax[4 * wg + wq] = big
        cute.arch.barrier(barrier_id=NB_WG + wg, number_of_threads=128)
        big = cutlass.max(cutlass.max(qmax[4 * wg], qmax[4 * wg + 1]),
                          cutlass.max(qmax[4 * wg + 2], qmax[4 * wg + 3]))
        mul_bits, inv_bits = q_f16_factors(big, cutlass.max)
        mul = int_as_f32(mul_bits)
        for w in cutlass.range_constexpr(waves):
            u = w * 128 + wtid
            if u < units:
                x = lds128(base + u * 16)
                sts(base + u * 16, [bf16x2_to_f16x2(x[i], mul) for i in range(4)])
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=NB_WG + wg, number_of_threads=128)
        return int_as_f32(inv_bits)

    @cute.jit
    def _zero_tail(self, s, valid, tidx):
        """16-bit cache: keys [valid, 64) of ring stage s -> 0 in every tile (whole 128-byte
        rows: the swizzle does not matter)."""
        n_cons = 128 * self.consumers
        chunks = N_TILES * PAGE_SIZE * 8  # 16-byte chunks of a page
        base = self.d_k_base + s * (PAGE_ELEMS * 2)
        zero = [Int32(0)] * 4
        for w in cutlass.range_constexpr(chunks // n_cons):
            i = w * n_cons + tidx
            key = (i // 8) % PAGE_SIZE
            if key >= valid:
                sts(base + (i // (8 * PAGE_SIZE)) * (TILE_ELEMS * 2) + key * 128 + (i % 8) * 16,
                    zero)

    # ------------------------------------------------------------------------------------------
    @cute.jit
    def _epilogue(self, r, slot, pieces, col0, rows, h_q, cnt, wg, wq, lane, acc_O, m_run,
                  l_run, sMax, mO, mLSE, mOacc, mLSEacc):
        """Column sums over lanes and warps (through the sMax slot of the segment's last page,
        whose readers all passed that page's P^T barrier); O^T / sum (dtype, or the fp32
        partial) and the lse of every real column."""
        ncol = self.n_wg // 4
        total = self._across_keys([l_run[jc] for jc in range(ncol)], lambda a, b: a + b, sMax,
                                  (cnt[self.own_count] + 1) % 2, wg, wq, lane)
        inv = [None] * ncol
        for jc in cutlass.range_constexpr(ncol):
            inv[jc] = softmax.inv_sum(total[jc])
            if const_expr(self.kv_fp8):
                inv[jc] = inv[jc] * self.d_kv_scale  # V's scale
        splitkv.store_result(
            pieces, lambda t, i, dt: self._store_o(acc_O, inv, t[i, None, None], dt, col0, rows,
                                                   wq, lane),
            mO, mOacc, r, slot, self.dtype)
        if wq == 0:
            if lane < 4:
                for jc in cutlass.range_constexpr(ncol):
                    row = col0 + 8 * (jc // 2) + 2 * lane + jc % 2
                    if row < rows:
                        splitkv.store_lse(mLSE, mLSEacc, r, slot, row, pieces, h_q, total[jc],
                                          m_run[jc])

    @cute.jit
    def _store_o(self, acc_O, inv, gOut, out_dtype: cutlass.Constexpr, col0, rows, wq, lane):
        """gOut (rows, 512) of out_dtype: row col0 + column, d of each O^T value (acc_coord per
        64-row m-tile), scaled by the column's inv."""
        per_tile = cute.size(acc_O) // (D_V // 64)
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            v, mt = i % per_tile, i // per_tile
            jc = 2 * (v // 4) + v % 2
            row = col0 + 8 * (v // 4) + 2 * (lane % 4) + v % 2
            d = 64 * mt + 16 * wq + lane // 4 + 8 * ((v // 2) % 2)
            if row < rows:
                gOut[row, d] = (acc_O[i] * inv[jc]).to(out_dtype)


# --- compile entry (ops/registry.py: DecodeStepConfig, backend "sm90_keysm") -------------------


def decode_kernel(config, arch: str):
    """The keys-on-M kernel a registry config asks for (dtype, causal, kv_fp8, columns); arch
    is sm_90a."""
    from ..contract import dsl_dtype

    return MLADecodeSm90KeysM(dsl_dtype(config.dtype), config.causal, config.columns,
                              kv_fp8=config.kv_fp8)
