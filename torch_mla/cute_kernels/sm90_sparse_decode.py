"""Sparse MLA decode (DeepSeek Sparse Attention) on the SM90 kernel (cp.async gather), CuTe DSL.

Problem (as sm80_sparse_decode.py): query token i of request r attends only to the cached
latents its row indices[r, i, :topk_length[r]] names (slots, page * 64 + row; -1 names none):
    out[r, i] = softmax(scale * q[r, i] K_sel^T) V_sel over the named slots.

Mapping onto the dense SM90 kernel (sm90_decode.py, whose walk, seesaw pipeline, softmax,
epilogue and combine run unchanged): each (request, query token) pair is one "request" of the walk
with h_q query rows and topk_length[r] keys, the entries in their order; a block of the walk is
64 consecutive entries instead of a page, and the schedule is the dense one over those one-token
requests (torch_mla.get_sparse_decode_schedule). The step and its views (tokens folded into the
request mode, topk_length broadcast over tokens, lse (b, h_q, s_q) as (b * s_q, h_q, 1)) are
sm80_sparse_decode's MLASparseDecodeStep, which takes any decode kernel.

What differs from the dense kernel:
  - the gather: the four warps of the warpgroup that refills a buffer half (load_warps; a
    quarter of the rows each, warp_steps) copy its tiles by 16-byte cp.async copies
    (gather_offsets: lanes 8 q .. 8 q + 7 take the 8 chunks of row q + 4 j of a tile, so
    one instruction moves four whole 128-byte lines of four key rows), each to its place in
    the 128-byte-swizzled tile the MMAs read. The lanes read the block's 64 entries (two each;
    at the start of the pair that loads it, so the read hides behind the softmax:
    _next_page) and shuffle each row's slot to the 8 lanes copying it.
    Each tile's mbarrier (4 x 33 arrivals) completes when every lane's copies have landed
    (cp.async.mbarrier.arrive.noinc) and one lane of each warp has arrived after the warp's
    stores (warp 0's bias row among them); a half's tiles complete together, so Q K^T waits
    for one a half. cp.async writes through the generic proxy: the warpgroups fence
    (fence.proxy.async) after those waits and before each P V, whose V half the other
    warpgroup may have waited for. The walk's "page" for block blk of one-token request r is
    r * blocks_per_row + blk (_page).
  - an entry that names no key (-1, at or past topk_length, or a slot outside [0, num_blocks *
    64)) reads nothing: its copies have source size 0, which zero-fills the row (no NaN of the
    cache enters P V), and
  - its score is -inf: each buffer has a bias row in shared memory (0 or -inf per key), written
    by warp 0 of the warpgroup that loads the buffer's left half before its plain arrival
    (release), added to the scores in _mask;
  - the FP8 caches (cache "e4m3", "fp8_ds_mla"): the gather copies each fp8 tile's bytes
    (gather8_offsets: 8 rows x 64 bytes an instruction) to where the dense kernel's kv_fp8
    TMA leaves them (fp8_tile_offset), and the dense kernel's _expand_half turns them into the
    16-bit tiles in shared memory. The 656-byte rows: their bf16 rope values are copied as a
    16-bit tile in place, and each row's four float32 scales (8 bytes a buffer half, by
    cp.async.ca) to the last 512 bytes of 16-bit tile 4 h + 1 (sm90_decode.group_scale_offset),
    which _expand_half (group_scales) reads before it overwrites them; each value is multiplied
    by its group's scale in fp32 and rounded once to bf16.

Limits: d_qk 576, d_v 512, 64-token pages, any page and row strides (16-byte multiples); bf16/
fp16 q over a cache of q's dtype or a float8_e4m3fn one (kv_scale), bf16 q over the 656-byte
rows; h_q any (64-row m-blocks of one token's heads), s_q any, topk any. Not causal. The
attention sink is applied by the host after the step (torch_mla.ops.sparse).

Status: correct on the H200 (tests over the three formats and memcheck, session 18;
FlashMLA's own sparse cases through compat in session 17, before the four-warp refill).
Sessions 14-15 gathered by one TMA box per row (0.09-0.70x FlashMLA,
slower than the portable kernel everywhere); the cp.async gather (session 17) from one warp
0.57-0.76x FlashMLA at b 128 over the same 656-byte rows; from four warps with one wait a half
(session 18) b 128, h_q 64 / 128 over bf16 121.3 / 200.8 us, FlashMLA over its 656-byte rows
123.5 / 179.3 (0.60-0.79x over the same rows). The dispatch takes it where
ops.sparse.sm90_sparse_pays (docs/kernels/sparse.md, "Kernel choice"), but at 64-128 heads over
the 16-bit cache and the 656-byte rows, where its split variant runs
(sm90_split_sparse_decode.py, sessions 30 and 39): by default over the e4m3 cache, at 33-63
heads and above 128.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..constants import BLOCK_M, D_QK, FP8_DS_MLA_ROPE_AT, FP8_DS_MLA_SCALES_AT, PAGE_SIZE
from .decode_base import aligned
from .ptx import cp_async8, cp_async16
from .sm80_sparse_decode import CACHE_FORMATS, MLASparseDecodeStep
from .sm90_decode import N_TILES, MLADecodeSm90, group_scale_offset, shared_storage

ROWS_PER_LANE = PAGE_SIZE // 4  # key rows a lane copies chunks of: 4 rows per warp instruction
TILE16 = PAGE_SIZE * 128  # bytes of a 64-key x 64-column 16-bit tile
TILE8 = PAGE_SIZE * 64  # bytes of its fp8 bytes


def gather_offsets(lane: int, j: int) -> tuple:
    """The copy of lane `lane` (0..31) at step j (0..15) of a 16-bit tile: (row, chunk, byte
    offset in the 64-key x 64-column tile). Lanes 8 q .. 8 q + 7 copy the 8 16-byte chunks of
    row q + 4 j, so one warp instruction moves 4 whole 128-byte lines; chunk c of row R sits at
    chunk c ^ (R % 8) of the row's 128-byte line (the 128-byte swizzle the MMAs' layout uses, a
    function of the shared address within a 1 KB-aligned tile)."""
    q, c = lane // 8, lane % 8
    row = q + 4 * j
    return row, c, row * 128 + ((c ^ (row % 8)) << 4)


def gather8_offsets(lane: int, j: int) -> tuple:
    """The copy of lane `lane` at step j (0..7) of an fp8 tile (64 keys x 64 bytes, unswizzled,
    as the dense kernel's kv_fp8 TMA leaves it for _expand_half): (row, chunk, byte offset).
    Lanes 4 q .. 4 q + 3 copy the 4 16-byte chunks of row q + 8 j: 8 whole rows an
    instruction."""
    q, c = lane // 4, lane % 4
    row = q + 8 * j
    return row, c, row * 64 + c * 16


def fp8_tile_offset(cache: str, t: int) -> int:
    """Byte offset, in a page buffer, of fp8 tile t's staging bytes: the upper part of its
    buffer half's 16-bit region (the dense kernel's kv_fp8 layout, _cache_partitions). The
    656-byte rows' half 1 stages 4 tiles (its rope tile is 16-bit: gathered in place), so its
    staging starts 4 KB lower than the e4m3 cache's 5."""
    t0, nt = (0, 4) if t < 4 else (4, 4 if cache == "fp8_ds_mla" else 5)
    return t0 * TILE16 + nt * TILE8 + (t - t0) * TILE8


@cute.jit
def request_length(mIdx, mLens, r: Int32) -> Int32:
    """One-token request r's valid entries: its topk_length within [0, topk]."""
    return cutlass.min(cutlass.max(mLens[r], 0), mIdx.shape[1])


@cute.jit
def block_entries(mIdx, mLens, num_slots: Int32, page: Int32, nb: Int32, length=None):
    """The slots of keys lane and lane + 32 of block `page` (one-token request page // nb,
    block page % nb; nb blocks a request), -1 for an entry that names no key (-1, at or past
    topk_length, or a slot outside [0, num_slots)). length: the request's entries
    (request_length), read here from mLens when None."""
    r = page // nb
    key0 = (page - r * nb) * PAGE_SIZE
    if const_expr(length is None):
        length = request_length(mIdx, mLens, r)
    limit = length - key0
    lane = cute.arch.lane_idx()
    slots = [None, None]
    for h in cutlass.range_constexpr(2):
        slot = Int32(-1)
        if lane + 32 * h < limit:
            slot = mIdx[r, key0 + lane + 32 * h]
        slots[h] = cutlass.select_((slot >= 0) & (slot < num_slots), slot, Int32(-1))
    return slots[0], slots[1]


@cute.jit
def row_source(base: Int64, row_stride: Int64, page_stride: Int64, slot: Int32):
    """(global address of cache slot `slot`'s row, 16), or (the cache's base, 0) for -1: a
    cp.async of source size 0 reads nothing and zero-fills."""
    ok = slot >= 0
    off = Int64(slot // PAGE_SIZE) * page_stride + Int64(slot % PAGE_SIZE) * row_stride
    return (base + cutlass.select_(ok, off, Int64(0)), cutlass.select_(ok, Int32(16), Int32(0)))


def warp_steps(steps: int, warp) -> list:
    """The steps (j, h) of a gather of `steps` steps (16 for a 16-bit tile, 8 for an fp8 one)
    that one warp issues: all of them (warp None), or with four warps sharing the copies, warp
    w's quarter, j = w + 4 i. h = j // (steps / 2): which of a lane's two entries (keys lane,
    lane + 32) names the step's rows; a compile-time value either way (w < 4)."""
    if warp is None:
        return [(j, j // (steps // 2)) for j in range(steps)]
    return [(warp + 4 * i, 4 * i // (steps // 2)) for i in range(steps // 4)]


@cute.jit
def gather16(slots, rows, tiles, warp=None):
    """One warp: the 16-bit tiles `tiles` ((shared address of a 64-key x 64-column tile, byte
    offset of its columns in a cache row)) of the 64 keys whose slots the lanes hold (slots:
    keys lane and lane + 32; rows: the cache's (base address, row stride, page stride) in
    bytes), each row's chunks to their swizzled places (gather_offsets); warp: this warp's
    quarter of the rows when four warps copy the tiles together (warp_steps), or None."""
    lane = cute.arch.lane_idx()
    for j, h in warp_steps(ROWS_PER_LANE, warp):
        row, c, dst = gather_offsets(lane, j)
        # Row `row`'s entry is slots[row // 32] (= h) of lane row % 32.
        src, size = row_source(*rows, cute.arch.shuffle_sync(slots[h], row % 32))
        for t in cutlass.range_constexpr(len(tiles)):
            cp_async16(tiles[t][0] + dst, src + tiles[t][1] + c * 16, size)


@cute.jit
def gather8(slots, rows, tiles, rope=None, warp=None):
    """gather16 for fp8 tiles (64 keys x 64 bytes, unswizzled: gather8_offsets); rope: the
    shared address of a 16-bit tile that takes the 656-byte rows' bf16 rope values (bytes
    FP8_DS_MLA_ROPE_AT on), two chunks a lane and row (c, c + 4) from the same row addresses,
    or None."""
    lane = cute.arch.lane_idx()
    for j, h in warp_steps(PAGE_SIZE // 8, warp):
        row, c, dst = gather8_offsets(lane, j)
        src, size = row_source(*rows, cute.arch.shuffle_sync(slots[h], row % 32))
        for t in cutlass.range_constexpr(len(tiles)):
            cp_async16(tiles[t][0] + dst, src + tiles[t][1] + c * 16, size)
        if const_expr(rope is not None):
            for k in cutlass.range_constexpr(2):
                cc = c + 4 * k
                cp_async16(rope + row * 128 + ((cc ^ (row % 8)) << 4),
                           src + FP8_DS_MLA_ROPE_AT + cc * 16, size)


class GatheredEntries:
    """What the SM90 sparse kernels (this one and its producer and split subclasses, the
    keys-on-M one and its ping-pong) change in their
    dense kernel's walk, as hooks of it: the walk's "page" is a block of 64 entries of a
    one-token request (_page, _table_blocks), the cache is read by the gathers as a plain
    tensor (no TMA: _cache_tma, _cache_partitions / _ring_partitions), each gathering warp's
    32 lanes arrive on a tile's or stage's full mbarrier when their copies land (cp.async ...
    noinc) and one lane after the warp's bias stores (release: k_arrivals), and the MMAs'
    reads are fenced for the async proxy (cp_async_tiles). Mixed in before the dense kernel."""

    k_arrivals = 33
    cp_async_tiles = True

    def _cache_tma(self, op, mKV_t: cute.Tensor, *layouts):
        """No TMA for the cache: the gathers address it as a plain tensor (64 rows, row width,
        pages), 16-bit values or bytes."""
        return None, mKV_t

    @cute.jit
    def _cache_partitions(self, tma_k, tma_mKV, sK_tma):
        """No TMA partitions: the gathers address the buffers and the cache themselves."""
        self.d_num_slots = tma_mKV.shape[2] * PAGE_SIZE
        return None, tma_mKV

    _ring_partitions = _cache_partitions  # (the keys-on-M kernel's name for it)

    def _table_blocks(self, mIdx) -> Int32:
        return (mIdx.shape[1] + PAGE_SIZE - 1) // PAGE_SIZE

    @cute.jit
    def _page(self, mIdx, r: Int32, blk: Int32) -> Int32:
        """Block blk of one-token request r, as one number for the gathers (which read the
        block's entries themselves)."""
        return r * self._table_blocks(mIdx) + blk

    @cute.jit
    def _entries(self, page: Int32, length=None):
        """This lane's two entries of block `page` (block_entries; length: its request's
        request_length, read from the lengths when None)."""
        return block_entries(self.d_tensors.block_table, self.d_tensors.seqlens,
                             self.d_num_slots, page, self._table_blocks(self.d_tensors.block_table),
                             length)

    @cute.jit
    def _cache_rows(self, mKV):
        """The cache as row_source addresses it: (base address, row stride, page stride), in
        bytes (mKV: (64 rows, row width, pages), 16-bit values or bytes)."""
        elem = mKV.element_type.width // 8
        return mKV.iterator.toint(), Int64(mKV.stride[0]) * elem, Int64(mKV.stride[2]) * elem

    @cute.jit
    def _write_bias(self, bias, at: Int32, slots, lane: Int32):
        """bias[at + key] for keys lane and lane + 32: 0, or -inf where the entry names no key."""
        for h in cutlass.range_constexpr(2):
            bias[at + lane + 32 * h] = cutlass.select_(slots[h] >= 0, Float32(0.0), -Float32.inf)

    @cute.jit
    def _arrive_gathered(self, bars):
        """The gathering warp's arrivals on the full mbarriers `bars` (k_arrivals each): every
        lane's, once its copies have landed, then one lane's after the warp's bias stores
        (release: those precede it in program order)."""
        for i in cutlass.range_constexpr(len(bars)):
            cute.arch.cp_async_mbarrier_arrive_noinc(bars[i])
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            for i in cutlass.range_constexpr(len(bars)):
                cute.arch.mbarrier_arrive(bars[i])


class MLASparseDecodeSm90(GatheredEntries, MLADecodeSm90):
    """The SM90 kernel over gathered entries; see the module docstring."""

    # The four warps of the warpgroup that refills a buffer half share its copies (a quarter
    # of the rows each): the refill sits between that warpgroup's MMAs. Each warp's lanes and
    # one elected lane arrive on the half's tile mbarriers.
    load_warps = 4
    k_arrivals = 4 * GatheredEntries.k_arrivals

    def __init__(self, dtype, cache: str = "plain"):
        """cache: one of sm80_sparse_decode.CACHE_FORMATS (the FP8 ones expanded in shared
        memory by the dense kernel's kv_fp8 path; the 656-byte rows with bf16 only)."""
        assert cache in CACHE_FORMATS, cache
        assert cache != "fp8_ds_mla" or dtype == cutlass.BFloat16, (cache, dtype)
        super().__init__(dtype, False, kv_fp8=cache != "plain")
        self.cache = cache
        self.group_scales = cache == "fp8_ds_mla"

    def _setup(self, mQ: cute.Tensor, mKV: cute.Tensor):
        """The dense kernel's Q atom and layouts (_cache_tma: no cache atom), and a bias row
        per buffer in shared memory."""
        loads, layouts = super()._setup(mQ, mKV)
        dt = self.dtype
        self.shared_storage = shared_storage(
            sQ=aligned(dt, BLOCK_M * D_QK),
            sK=aligned(dt, 2 * PAGE_SIZE * D_QK),
            sP0=aligned(dt, BLOCK_M * PAGE_SIZE),
            sBias=cute.struct.MemRange[Float32, 2 * PAGE_SIZE],  # (key, buffer): 0 or -inf
            **self._extra_storage(),
        )
        return loads, layouts

    def _extra_storage(self) -> dict:
        """More shared-memory fields (name=type) after the bias rows: a subclass's."""
        return {}

    @cute.jit
    def _next_page(self, mIdx, r: Int32, blk: Int32):
        """The block's number and this lane's two entries (_entries), read at the start of the
        pair that loads the block, so that their latency hides behind the softmax."""
        page = self._page(mIdx, r, blk)
        a, b = self._entries(page)
        return page, a, b

    @cute.jit
    def _load_tiles(self, tma_k, mKV, tKsK, barK, page, s: cutlass.Constexpr[int],
                    t_begin: cutlass.Constexpr[int], t_end: cutlass.Constexpr[int]):
        """The four warps of a warpgroup (load_warps), a quarter of the rows each (warp_steps):
        tiles [t_begin, t_end) of the 64 keys block `page` names (a number, or _next_page's
        (number, entries)) into buffer s, by cp.async copies: 16-bit tiles to
        their swizzled places (gather_offsets: 4 rows x 128 bytes an instruction), fp8 tiles
        to their staging bytes (gather8_offsets, fp8_tile_offset: 8 rows x 64 bytes), and for
        the 656-byte rows the half's two scales of each row (8 bytes, at group_scale_offset).
        An entry that names no key gets zero bytes and reads nothing. With tile 0, also buffer
        s's bias row (warp 0). Each tile's mbarrier completes when every lane's copies have
        landed and each warp has arrived after its stores (the bias row's among them)."""
        if const_expr(isinstance(page, tuple)):
            slots = [page[1], page[2]]
        else:
            slots = list(self._entries(page))
        lane = cute.arch.lane_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
        if const_expr(t_begin == 0):
            if warp == 0:
                self._write_bias(
                    self.d_storage.sBias.get_tensor(cute.make_layout(2 * PAGE_SIZE)),
                    s * PAGE_SIZE, slots, lane)
        buf = self.d_k_base.toint() + s * PAGE_SIZE * D_QK * 2
        rows = self._cache_rows(mKV)
        if const_expr(self.cache == "plain"):
            gather16(slots, rows, [(buf + t * TILE16, t * 128) for t in range(t_begin, t_end)],
                     warp)
        else:
            # The e4m3 tiles' bytes to their staging places; the 656-byte rows' rope tile (bf16
            # values at byte FP8_DS_MLA_ROPE_AT) to its 16-bit place.
            t8 = (t_begin, min(t_end, N_TILES if self.cache == "e4m3" else N_TILES - 1))
            rope = None
            if const_expr(self.cache == "fp8_ds_mla" and t_end == N_TILES):
                rope = buf + (N_TILES - 1) * TILE16
            gather8(slots, rows, [(buf + fp8_tile_offset(self.cache, t), t * 64)
                                  for t in range(t8[0], t8[1])], rope, warp)
        if const_expr(self.cache == "fp8_ds_mla"):
            # Each half's scales (groups 2 h, 2 h + 1) of rows lane and lane + 32 (warp 0).
            if warp == 0:
                for r in cutlass.range_constexpr(2):
                    src, size = row_source(*rows, slots[r])
                    for h in cutlass.range_constexpr(2):
                        if const_expr(t_begin < 4 * h + 4 and 4 * h < t_end):
                            cp_async8(buf + group_scale_offset(h) + 8 * (lane + 32 * r),
                                      src + FP8_DS_MLA_SCALES_AT + 8 * h, size // 2)
        self._arrive_gathered([barK + s * N_TILES + t for t in range(t_begin, t_end)])

    @cute.jit
    def _mask(self, acc_S, blk: Int32, border, min_border: Int32, c0: Int32,
              s: cutlass.Constexpr[int]):
        """Adds buffer s's bias row (-inf for entries that name no key, including those at or
        past topk_length, so the horizon needs no check of its own)."""
        bias = self.d_storage.sBias.get_tensor(cute.make_layout(2 * PAGE_SIZE))
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            acc_S[i] = acc_S[i] + bias[s * PAGE_SIZE + 8 * (i // 4) + c0 + i % 2]


# --- compile entry (ops/registry.py: SparseStepConfig, backend "sm90") ------------------------


def compile_sparse_step(config, arch: str):
    """The SM90 sparse decode step (dtype, cache format), compiled for arch (sm_90a)."""
    from ..contract import compile_sparse_step_kernel, dsl_dtype

    dtype = dsl_dtype(config.dtype)
    return compile_sparse_step_kernel(
        MLASparseDecodeStep(MLASparseDecodeSm90(dtype, config.cache), dtype, use_pdl=True),
        dtype, arch, config.cache)
