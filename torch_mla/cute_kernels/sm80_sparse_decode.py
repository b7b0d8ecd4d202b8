"""Sparse MLA decode (DeepSeek Sparse Attention) on the portable kernel, in CuTe DSL.

Problem: query token i of request r attends only to the cached latents its row
indices[r, i, :topk_length[r]] names (slots, page * 64 + row; -1 names none):
    out[r, i] = softmax(scale * q[r, i] K_sel^T) V_sel over the named slots (a slot named twice
    counts twice), K = the 576-wide latent, V its first 512 columns.

Mapping onto the dense portable kernel (sm80_decode.py, whose walk, pipeline, softmax and
epilogue run unchanged): each (request, query token) pair is one "request" of the walk with
h_q query rows and topk_length[r] keys, the entries in their order; the entry rows take the
block table's place, and the schedule is the dense one over those one-token requests
(torch_mla.get_sparse_decode_schedule). The step's arguments are the op's tensors; the views
(tokens flattened into the request mode, (s_q, b) with the caller's strides; topk_length
broadcast over the tokens with stride 0; lse (b, h_q, s_q) seen as (b * s_q, h_q, 1)) are
built inside the jit, so nothing is copied on the host.

What differs from the dense kernel:
  - a stage's keys are gathered row by row: the threads of a key row read its entry and issue
    the row's 16-byte cp.async copies from the slot it names (a dense stage copies a slice of
    one page). An entry that names no key (-1, at or past topk_length, or a slot past the
    cache) is never read: its row is zero-filled and
  - its score is -inf: each stage has a bias row in shared memory (0 or -inf per key, written
    with the rope columns' copies and published by the same stage barrier), added to the scores
    before the softmax (masks_entries).
  - the combine (always launched) checks topk_length and the used entries on the device and
    stops the launch with a message naming the first bad one (MLASparseCombine), as the dense
    combine checks lengths and page ids.

FP8 caches (cache="e4m3": float8_e4m3fn with a per-tensor kv_scale; cache="fp8_ds_mla":
DeepSeek-V3.2's 656-byte rows, 512 e4m3 latent values, four float32 scales, 64 bf16 rope
values), passed as bytes: the 8 threads of a key row read its bytes by 16-byte global loads
into registers (unit u = bytes [16 u, 16 u + 16), thread j of the row units 8 g + j, g = 0..3,
so that each unit of group g needs the row's scale g; fp8_units), a row's all issued before
its first conversion, convert them to the 16-bit type (cvt.rn.f16x2.e4m3x2 from SM89 on, integer ops
before; bf16 through f32) and store them where the 16-bit path's cp.async would have put them
(fp8_unit_offsets: two 16-byte chunks of the swizzled tile a unit). The 656-byte rows' values
are multiplied by their group's scale on the way (f32, one rounding to bf16: exact for the
power-of-two scales DeepSeek's quantizer writes) and their rope chunk goes by cp.async; an
e4m3 row's 64 rope values are units 32-35 (threads 0-3 of the row), and its kv_scale is
folded, not multiplied: the scores use scale_log2 * kv_scale and the epilogue multiplies O by
it (MLADecodeSm80.body, as the SM90 kernels fold it), the stored e4m3 values being exact in
16 bits. An entry that names no key reads nothing (its row is zero-filled, as above). The
register loads make each gathering thread wait for its bytes before its next instruction
(cp.async did not): with two quads the lag puts one quad's wait beside the other's MMAs.

Not causal (each token has its own entries). The attention sink is applied by the host after
the step (torch_mla.ops.sparse). Limits: bf16/fp16 q, d_qk 576, d_v 512, 64-token pages of
q's dtype, float8_e4m3fn + kv_scale, or the 656-byte rows (bf16 q only: the rope values are
bf16); the FP8 caches' rows 16-byte aligned (the host checks); h_q any (64-row m-blocks of one
token), s_q any, topk any (entries past topk_length are never read). The FP8 gather runs
on the H200 (session 15: the GPU tests, memcheck, FlashMLA's own sparse cases through compat).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..constants import (
    COMBINE_VARIANTS,
    D_QK,
    D_V,
    FP8_DS_MLA_ROPE_AT,
    FP8_DS_MLA_SCALES_AT,
    PAGE_SIZE,
)
from .combine import NO_COLUMN, MLACombine, first_outside
from .decode_step import MLADecodeStep
from .device_error import fail
from .ptx import e4m3_store16, ldg128
from .sm80_decode import MLADecodeSm80, Sm80DecodeConfig

ROPE_TILE = D_V // 64  # the 64-column tile of the rope values (copied by every thread first)
# Cache formats: the 16-bit cache, a float8_e4m3fn one with a per-tensor scale, DeepSeek-V3.2's
# 656-byte rows (registry.SparseStepConfig.cache).
CACHE_FORMATS = ("plain", "e4m3", "fp8_ds_mla")
# Entries a combine lane loads before comparing them (combine.first_outside): 512 a round trip,
# four for topk 2048, made by the request's first combine CTA after the decode kernel's last CTA
# leaves its SM. One round trip (64 registers of entries a lane) against four was no faster
# on any row (session 35, H100: 2,1,64 22.7 against 22.35 us, 32,1,64 61.45 against 61.0; its
# knob removed in session 49). Session 33 measured spreading the check over the request's CTAs
# instead: b 2 h_q 128 -4%, b 2 h_q 64 +4.5% (reverted).
CHECK_BATCH = 16


def fp8_units(cache: str, j: int, cols: tuple = (0, 9)) -> list:
    """The 16-byte units of an FP8 row that thread j (0..7) of the row's 8 gathers when tiles
    [cols[0], cols[1]) load: (unit u, its scale's index or None). Unit u is bytes
    [16 u, 16 u + 16) of the row, the e4m3 values of columns [16 u, 16 u + 16), which land in
    tile u // 4, 16-byte chunks 2 (u % 4) and 2 (u % 4) + 1 (fp8_unit_offsets). Thread j takes
    u = 8 g + j: groups g 0-3 are the 512 latent values, 128 each, so that a thread's unit of
    group g needs only scale g of a 656-byte row; an e4m3 row's 64 rope values are units 32-35
    (threads 0-3). A 656-byte row's rope values are bf16: they go by cp.async, chunk j of tile
    8, as in the 16-bit path (none here). j: a Python int (tests) or the DSL's Int32 (then the
    j < 4 condition is the caller's)."""
    units = []
    if cols[0] == 0:
        units += [(8 * g + j, g if cache == "fp8_ds_mla" else None) for g in range(D_V // 128)]
    if cols[1] > ROPE_TILE and cache == "e4m3":
        units.append((32 + j, None))
    return units


def fp8_unit_offsets(u, row, bn: int):
    """Element offsets, within a stage buffer (block_n keys x 576, smem_layouts' 8 x 64 atoms
    with the 3-bit swizzle), of the two 16-byte chunks unit u of key `row` fills: columns
    16 u + [0, 8) and 16 u + [8, 16). Chunk k of a row's 64-column tile sits at chunk k ^ (row
    % 8) of its 128-byte line. Python ints or the DSL's Int32 alike."""
    line = (u // 4) * bn * 64 + (row // 8) * 512 + (row % 8) * 64
    k = 2 * (u % 4)
    return line + (k ^ (row % 8)) * 8, line + ((k + 1) ^ (row % 8)) * 8


class MLASparseDecodeSm80(MLADecodeSm80):
    """The portable kernel over gathered entries; see the module docstring."""

    masks_entries = True

    def __init__(self, dtype, config: Sm80DecodeConfig, use_pdl: bool = False,
                 cache: str = "plain", hw_e4m3: bool = True):
        """cache: one of CACHE_FORMATS; hw_e4m3: the e4m3 cvt (SM89 on), else integer ops."""
        super().__init__(dtype, False, config, use_pdl)
        assert cache in CACHE_FORMATS, cache
        # The 656-byte rows' rope values are bf16, copied as they are.
        assert cache != "fp8_ds_mla" or dtype == cutlass.BFloat16, (cache, dtype)
        self.cache = cache
        self.hw_e4m3 = bool(hw_e4m3)
        self.kv_fp8 = cache == "e4m3"  # takes kv_scale (folded: MLADecodeSm80.body)

    def _table_blocks(self, mIdx) -> Int32:
        return (mIdx.shape[1] + PAGE_SIZE - 1) // PAGE_SIZE

    @cute.jit
    def _page(self, mIdx, r: Int32, lo: Int32, hi: Int32, t: Int32, num_pages: Int32) -> Int32:
        """The walk's per-stage table entry is the request's entry row: _load_kv reads each
        key's slot itself."""
        return r

    @cute.jit
    def _load_kv(self, src, page: Int32, key_lo: Int32, t: Int32, stage: Int32, L: Int32,
                 tKsK, tKcK, thr_g2s, gmem_copy, cols: cutlass.Constexpr = (0, 9)):
        """Keys [key_lo + t bn, + bn) of entry row `page` (the request), 64-column tiles
        [cols[0], cols[1]) -> buffer `stage` (cp.async, uncommitted), each row from the slot
        its entry names; with the rope tile, also the stage's bias (0, or -inf for an entry
        that names no key: zero-filled, never read)."""
        bn = self.cfg.block_n
        key0 = key_lo + t * bn
        limit = L - key0
        num_slots = src.kv.shape[0] * PAGE_SIZE
        # The layout of one thread's copy (the dense partition of a page; page 0 is not read).
        tKgK = None
        if const_expr(self.cache == "plain"):
            tKgK = thr_g2s.partition_S(cute.local_tile(src.kv[0, None, None], (bn, D_QK),
                                                       (0, 0)))
        for n in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
            row = tKcK[0, n, 0][0]
            slot = Int32(-1)
            if row < limit:
                slot = src.table[page, key0 + row]
            if slot >= num_slots:
                slot = Int32(-1)
            if slot >= 0:
                if const_expr(self.cache == "plain"):
                    gRow = src.kv[slot // PAGE_SIZE, slot % PAGE_SIZE, None]
                    for c in cutlass.range_constexpr(cols[0], cols[1]):
                        col = cute.assume(tKcK[0, n, c][1], divby=8)
                        gChunk = cute.make_tensor(gRow.iterator + col, tKgK[None, n, c].layout)
                        cute.copy(gmem_copy, gChunk, tKsK[None, n, c, stage])
                else:
                    self._gather_fp8(src, slot, row, tKcK[0, n, 0][1] // 8, stage,
                                     tKsK[None, n, ROPE_TILE, stage], gmem_copy, cols)
            else:
                for c in cutlass.range_constexpr(cols[0], cols[1]):
                    tKsK[None, n, c, stage].fill(0.0)
            if const_expr(cols[0] <= ROPE_TILE < cols[1]):
                if tKcK[0, n, 0][1] == 0:
                    bias = Float32(0.0)
                    if slot < 0:
                        bias = -Float32.inf
                    src.bias[row, stage] = bias

    @cute.jit
    def _gather_fp8(self, src, slot: Int32, row: Int32, j: Int32, stage: Int32, sRope,
                    gmem_copy, cols: cutlass.Constexpr):
        """Key `row` of buffer `stage` from FP8 cache slot `slot`, this thread's part (thread j
        of the row's 8; tiles [cols[0], cols[1])): its 16-byte units (fp8_units) by plain
        global loads, all issued before the first conversion (a thread's other rows wait:
        both rows' loads at once spilled 120 bytes at sm_90a), converted to the 16-bit type
        (times the unit's row scale in the 656-byte format) and stored where the 16-bit path's
        cp.async would put them (fp8_unit_offsets); a 656-byte row's bf16 rope chunk j by
        cp.async into sRope, this thread's chunk of the rope tile."""
        bn = self.cfg.block_n
        kv = src.kv
        base = (kv.iterator + cute.crd2idx((slot // PAGE_SIZE, slot % PAGE_SIZE, 0),
                                           kv.layout)).toint()  # the row's first byte
        buf = src.k_base + 2 * stage * bn * D_QK
        latent = fp8_units(self.cache, j, (cols[0], min(cols[1], ROPE_TILE)))
        if const_expr(len(latent) > 0):
            words = [ldg128(base + 16 * u) for u, _ in latent]
            scales = [None] * len(latent)
            if const_expr(self.cache == "fp8_ds_mla"):
                packed = ldg128(base + FP8_DS_MLA_SCALES_AT)  # the row's 4 float32 scales
                scales = [packed[g] for _, g in latent]
            for i in cutlass.range_constexpr(len(latent)):
                self._store_unit(buf, latent[i][0], row, words[i], scales[i])
        if const_expr(cols[1] > ROPE_TILE):
            if const_expr(self.cache == "e4m3"):
                if j < 4:  # 64 e4m3 values: units 32-35
                    (u, _), = fp8_units(self.cache, j, (ROPE_TILE, ROPE_TILE + 1))
                    self._store_unit(buf, u, row, ldg128(base + 16 * u), None)
            else:
                gChunk = cute.make_tensor(
                    cute.make_ptr(self.dtype, base + FP8_DS_MLA_ROPE_AT + 16 * j,
                                  cute.AddressSpace.gmem, assumed_align=16), sRope.layout)
                cute.copy(gmem_copy, gChunk, sRope)


    @cute.jit
    def _store_unit(self, buf: Int32, u: Int32, row: Int32, words, scale):
        """Unit u of key `row` (four words of e4m3 bytes) -> the stage buffer at byte address
        buf, in the 16-bit type, times scale (a float32 word) if given."""
        d0, d1 = fp8_unit_offsets(u, row, self.cfg.block_n)
        e4m3_store16(buf + 2 * d0, buf + 2 * d1, words, self.dtype == cutlass.BFloat16, scale,
                     self.hw_e4m3)


class MLASparseCombine(MLACombine):
    """The combine over sparse decode's one-token requests: checks topk_length and the used
    entries instead of lengths and page ids."""

    @cute.jit
    def check_request(self, mIdx, mLens, num_slots: Int32, r: Int32, lane: Int32):
        """One warp: 0 <= topk_length <= topk for one-token request r, and its entries below
        topk_length are -1 or slots of the cache; else a message naming the first bad one
        (request, token, position), and the launch stops. The decode kernel reads no entry
        past topk_length and no slot past the cache whatever these hold."""
        L = mLens[r]
        topk = mIdx.shape[1]
        s_q = mIdx.shape[0][0]
        if L < 0 or L > topk:
            if lane == 0:
                fail("torch_mla.mla_decode_sparse: topk_length[{}] = {}, but it must be in "
                     "[0, topk = {}]", r // s_q, L, topk)
        first = first_outside(mIdx[r, None], cutlass.min(L, topk), -1, num_slots, lane,
                              CHECK_BATCH)
        if first != NO_COLUMN:
            if lane == 0:
                fail("torch_mla.mla_decode_sparse: indices[{}, {}, {}] = {} is not a cache "
                     "slot: the entries below topk_length must be -1 or slots page * 64 + "
                     "row in [0, {})", r // s_q, r % s_q, first, mIdx[r, first], num_slots)

    @cute.jit
    def check_pieces(self, mLens, r: Int32, row: Int32, count: Int32, lane: Int32,
                     part: Int32):
        """As MLACombine.check_pieces, for a schedule made for other topk_length values."""
        if row == 0 and part == 0 and lane == 0:
            fail("torch_mla.mla_decode_sparse: the schedule cuts request-token {} into {} "
                 "pieces, which do not fit its topk_length ({} entries) now: it was computed "
                 "for other lengths; compute it again with torch_mla.get_sparse_decode_schedule",
                 r, count, mLens[r])


def _tokens(t: cute.Tensor, rest: int) -> cute.Tensor:
    """t (b, s_q, ...) as ((s_q, b), ...): request r of the result is token r % s_q of request
    r // s_q; `rest`: how many modes follow."""
    shape, stride = t.shape, t.stride
    return cute.make_tensor(t.iterator, cute.make_layout(
        ((shape[1], shape[0]),) + tuple(shape[2:2 + rest]),
        stride=((stride[1], stride[0]),) + tuple(stride[2:2 + rest])))


class MLASparseDecodeStep(MLADecodeStep):
    """Sparse decode, then the combine, behind one host call (the op's tensors; views of them
    as one-token requests, built here)."""

    def __init__(self, decode: MLASparseDecodeSm80, dtype, use_pdl: bool = True):
        super().__init__(decode, dtype, D_V, use_pdl)
        self.combines = [MLASparseCombine(dtype, D_V, w, use_pdl, u)
                         for w, u in COMBINE_VARIANTS]

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h_q, 576)
        mKV: cute.Tensor,  # (num_blocks, 64, 576), or uint8 (num_blocks, 64, 576 or 656)
        mIdx: cute.Tensor,  # (b, s_q, topk) int32
        mLens: cute.Tensor,  # (b,) int32: topk_length
        mMeta: cute.Tensor,  # (num_parts, 8) int32: the schedule over b * s_q requests
        mNumSplits: cute.Tensor,  # (b * s_q + 1,) int32
        mO: cute.Tensor,  # (b, s_q, h_q, 512)
        mLSE: cute.Tensor,  # (b, h_q, s_q) fp32
        mOacc: cute.Tensor,  # (slots, h_q, 512) fp32
        mLSEacc: cute.Tensor,  # (slots, h_q) fp32, log2 domain
        scale_log2: Float32,
        combine_variant: Int32,
        stream,
        mKVScale: cute.Tensor = None,  # an e4m3 cache's (1,) fp32 scale; else None
    ):
        b, s_q, h_q = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        q = _tokens(mQ, 2)
        idx = _tokens(mIdx, 1)
        out = _tokens(mO, 2)
        lens = cute.make_tensor(mLens.iterator,
                                cute.make_layout(((s_q, b),), stride=((0, mLens.stride[0]),)))
        lse = cute.make_tensor(mLSE.iterator, cute.make_layout(
            ((s_q, b), h_q, 1), stride=((mLSE.stride[2], mLSE.stride[0]), mLSE.stride[1], 0)))
        self.decode(q, mKV, idx, lens, mMeta, mNumSplits, out, lse, mOacc, mLSEacc, scale_log2,
                    stream, mKVScale)
        self.combine(combine_variant, (mNumSplits, mOacc, mLSEacc, out, lse, idx, lens,
                                       mKV.shape[0] * PAGE_SIZE, stream))


# --- compile entry (ops/registry.py: SparseStepConfig, backend "sm80") ------------------------


def compile_sparse_step(config, arch: str):
    """The sparse decode step (dtype, cache format; Sm80DecodeConfig.from_heuristic(arch)
    tiles), compiled for arch (the e4m3 cvt from sm_89 on)."""
    from ..contract import compile_sparse_step_kernel, dsl_dtype, has_e4m3_cvt, has_pdl

    dtype = dsl_dtype(config.dtype)
    decode = MLASparseDecodeSm80(dtype, Sm80DecodeConfig.from_heuristic(arch),
                                 use_pdl=has_pdl(arch), cache=config.cache,
                                 hw_e4m3=has_e4m3_cvt(arch))
    return compile_sparse_step_kernel(MLASparseDecodeStep(decode, dtype, has_pdl(arch)), dtype,
                                      arch, config.cache)
