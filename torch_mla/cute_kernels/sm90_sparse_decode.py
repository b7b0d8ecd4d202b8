"""Sparse MLA decode (DeepSeek Sparse Attention) on the SM90 kernel (wgmma + TMA), in CuTe DSL.

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
  - the gather: a buffer half's tiles are filled by one TMA copy per key row and 64-column tile
    (a box of 1 row x 64 columns over the cache seen as (64 rows, 576, pages), 128-byte swizzle;
    a row's box lands at its row of the tile, 128 bytes apart, where the dense kernel's 64-row
    box would put it). Each tile's mbarrier still expects 8 KB: 64 rows of 128 bytes. The
    walk's "page" for block blk of one-token request r is r * blocks_per_row + blk (_page); the
    loading warp's lanes read the block's 64 entries (two each), and each lane issues its own
    two rows' copies (inline PTX: cute.copy of a TMA atom elects one lane; session 14 issued
    all 576 from one elected lane, with shuffles).
  - an entry that names no key (-1, at or past topk_length, or a slot outside [0, num_blocks *
    64)) gets the page coordinate num_blocks: its box lies wholly outside the tensor and TMA
    fills it with zeros (the transaction still counts its 128 bytes), so no such row is read
    and no NaN of the cache enters P V; and
  - its score is -inf: each buffer has a bias row in shared memory (0 or -inf per key), written
    by the warp that loads the buffer's left half before its mbarrier arrival (which releases
    it to the warpgroup that waits on the tiles), added to the scores in _mask.

Limits: bf16/fp16 q and cache (the dense kernel's 16-bit path), d_qk 576, d_v 512, 64-token
pages; h_q any (64-row m-blocks of one token's heads), s_q any, topk any. Not causal. The
attention sink is applied by the host after the step (torch_mla.ops.sparse).

Status: session 14's version (one lane issuing the 576 copies of a block) was correct on the
H200 (its tests, memcheck) but 0.09-0.52x FlashMLA. This version (every lane issues its own
rows' copies) is correct on the H200 too and 2.1x faster, 0.20-0.70x FlashMLA, still slower
than the portable kernel: opt-in, TORCH_MLA_SPARSE_SM90=1 (docs/kernels/sparse.md).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import AddressSpace, Float32, Int32, const_expr
from cutlass._mlir.dialects import cute as _cute_ir
from cutlass._mlir.dialects import cute_nvgpu as _cute_nvgpu_ir
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import T, dsl_user_op

from ..constants import BLOCK_M, D_QK, PAGE_SIZE
from .decode_base import TmaLoads, aligned
from .sm80_sparse_decode import MLASparseDecodeStep
from .sm90_decode import N_TILES, MLADecodeSm90, shared_storage

TILE_BYTES = PAGE_SIZE * 64  # elements of a 64-key x 64-column tile (x2 bytes)


@dsl_user_op
def _tma_desc_addr(atom, *, loc=None, ip=None):
    """The generic address of a TMA atom's descriptor."""
    ty = _cute_ir.PtrType.get(T.i8(), AddressSpace.generic, 64)
    exec_atom = _cute_nvgpu_ir.atom_make_exec_tma(atom._trait.value, loc=loc, ip=ip)
    return _cute_nvgpu_ir.get_tma_desc_addr(ty, exec_atom, loc=loc, ip=ip)


@dsl_user_op
def _tma_row(desc, dst: Int32, bar: Int32, c0: Int32, c1: Int32, c2: Int32, *, loc=None,
             ip=None):
    """One 3-d TMA tile load by the executing thread (no election): box at (c0, c1, c2) of
    descriptor desc into shared address dst, completing on the mbarrier at shared address bar."""
    args = [v.ir_value(loc=loc, ip=ip) for v in (desc, Int32(dst), Int32(bar), Int32(c0),
                                                Int32(c1), Int32(c2))]
    llvm.inline_asm(
        None, args, "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx"
        "::bytes [$1], [$0, {$3, $4, $5}], [$2];", "l,r,r,r,r,r", has_side_effects=True,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


class MLASparseDecodeSm90(MLADecodeSm90):
    """The SM90 kernel over gathered entries; see the module docstring."""

    def __init__(self, dtype):
        super().__init__(dtype, False)

    def _setup(self, mQ: cute.Tensor, mKV: cute.Tensor):
        """The dense kernel's atoms and layouts, with the cache's TMA atom for one key row of a
        64-column tile, and a bias row per buffer in shared memory."""
        (tma_q, tma_mQ, _, _), layouts = super()._setup(mQ, mKV)
        mKV_t = cute.make_tensor(mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0]))
        # One row of a swizzled (64, 64) tile: the TMA box (1, 64) with the 128-byte swizzle.
        row_layout = cute.make_composed_layout(self.tile_layout.inner, 0,
                                               cute.make_layout((1, 64), stride=(64, 1)))
        tma_k, tma_mKV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKV_t, row_layout, (1, 64))
        dt = self.dtype
        self.shared_storage = shared_storage(
            sQ=aligned(dt, BLOCK_M * D_QK),
            sK=aligned(dt, 2 * PAGE_SIZE * D_QK),
            sP0=aligned(dt, BLOCK_M * PAGE_SIZE),
            sBias=cute.struct.MemRange[Float32, 2 * PAGE_SIZE],  # (key, buffer): 0 or -inf
        )
        return TmaLoads(tma_q, tma_mQ, tma_k, tma_mKV), layouts

    @cute.jit
    def _cache_partitions(self, tma_k, tma_mKV, sK_tma):
        """Per-row TMA partitions: the buffers' rows (TMA, 64 rows, 9 tiles, 2 buffers) and the
        cache's (TMA, 64 rows, 9 tiles, pages)."""
        gK_rows = cute.local_tile(tma_mKV, (1, 64), (None, None, None))  # (1, 64, 64, 9, pages)
        sK_rows = cute.flat_divide(sK_tma, (1, 64))  # (1, 64, 64, 9, 2)
        return cpasync.tma_partition(
            tma_k, 0, cute.make_layout(1),
            cute.group_modes(sK_rows, 0, 2), cute.group_modes(gK_rows, 0, 2),
        )

    def _table_blocks(self, mIdx) -> Int32:
        return (mIdx.shape[1] + PAGE_SIZE - 1) // PAGE_SIZE

    @cute.jit
    def _page(self, mIdx, r: Int32, blk: Int32) -> Int32:
        """Block blk of one-token request r, as one number for _load_tiles (which reads the
        block's entries itself)."""
        return r * self._table_blocks(mIdx) + blk

    @cute.jit
    def _load_tiles(self, tma_k, tKgK, tKsK, barK, page: Int32, s: cutlass.Constexpr[int],
                    t_begin: cutlass.Constexpr[int], t_end: cutlass.Constexpr[int]):
        """One warp: tiles [t_begin, t_end) of the 64 keys block `page` (see _page) names into
        buffer s, row by row from the slots of its entries, each lane copying rows lane and
        lane + 32; an entry that names no key gets a
        zero row (a box outside the cache). With tile 0, also buffer s's bias row."""
        mIdx, mLens = self.d_tensors.block_table, self.d_tensors.seqlens
        nb = self._table_blocks(mIdx)
        r = page // nb
        key0 = (page - r * nb) * PAGE_SIZE
        topk = mIdx.shape[1]
        limit = cutlass.min(cutlass.max(mLens[r], 0), topk) - key0
        num_pages = tKgK.shape[3]
        lane = cute.arch.lane_idx()
        pg = [None, None]
        rw = [None, None]
        for h in cutlass.range_constexpr(2):
            row = lane + 32 * h
            slot = Int32(-1)
            if row < limit:
                slot = mIdx[r, key0 + row]
            ok = (slot >= 0) & (slot < num_pages * PAGE_SIZE)
            pg[h] = cutlass.select_(ok, slot // PAGE_SIZE, num_pages)
            rw[h] = cutlass.select_(ok, slot % PAGE_SIZE, Int32(0))
            if const_expr(t_begin == 0):
                bias = self.d_storage.sBias.get_tensor(cute.make_layout(2 * PAGE_SIZE))
                bias[s * PAGE_SIZE + row] = cutlass.select_(ok, Float32(0.0), -Float32.inf)
        if const_expr(t_begin == 0):
            # The bias stores precede the elected lane's arrivals (release) in program order.
            cute.arch.sync_warp()
        with cute.arch.elect_one():
            for t in cutlass.range_constexpr(t_begin, t_end):
                cute.arch.mbarrier_arrive_and_expect_tx(
                    barK + s * N_TILES + t, TILE_BYTES * self.dtype.width // 8)
        # Every lane issues its own two rows' copies (cute.copy of a TMA atom elects one lane,
        # so the instruction is inline PTX with the atom's descriptor).
        desc = _tma_desc_addr(tma_k).toint()
        for t in cutlass.range_constexpr(t_begin, t_end):
            bar = (barK + s * N_TILES + t).toint()
            for h in cutlass.range_constexpr(2):
                dst = tKsK[None, lane + 32 * h, t, s].iterator.toint()
                _tma_row(desc, dst, bar, Int32(64 * t), rw[h], pg[h])

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
    """The SM90 sparse decode step (dtype), compiled for arch (sm_90a)."""
    from ..contract import compile_sparse_step_kernel, dsl_dtype

    dtype = dsl_dtype(config.dtype)
    return compile_sparse_step_kernel(
        MLASparseDecodeStep(MLASparseDecodeSm90(dtype), dtype, use_pdl=True), dtype, arch)
