"""Sparse MLA decode (DeepSeek Sparse Attention) on the keys-on-M ping-pong kernel over an e4m3
cache (cp.async gather into the whole-line ring), CuTe DSL, SM90.

Problem and mapping: as sm90_keysm_sparse_decode.py (each (request, query token) pair is one
request of the walk with h_q query rows and topk_length[r] keys; a block of the walk is 64
consecutive entries of the token's row; the step and its views are sm80_sparse_decode's
MLASparseDecodeStep). The kernel is sm90_keysm_rs_decode.py's ping-pong variant (two consumer
warpgroups on alternate blocks, page operands converted from the fp8 ring into registers),
whose walk, MMAs, softmax, merge and epilogue run unchanged. What differs (the GatheredEntries
hooks of sm90_sparse_decode.py, as the keys-on-M sparse kernel takes them):
  - no TMA for the cache (_line_tma): the producer warp reads the block's 64 entries, writes the
    stage's bias row (0, or -inf for an entry that names no key) and copies each named row's
    576 bytes by cp.async to the place the TMA box would put it (row r at r x 576 bytes of the
    stage: gather_lines); an entry that names no key reads nothing (source size 0: a zero row);
  - the stage's full mbarrier takes 33 arrivals (GatheredEntries.k_arrivals): every lane's
    cp.async.mbarrier.arrive.noinc, one after the warp's bias stores;
  - the scores get the stage's bias (_mask_entries), read right after the full wait.
The consumers read the stage with ld.shared (the generic proxy, as cp.async writes it): no
proxy fence.

Limits: e4m3 cache (float8_e4m3fn with a per-tensor kv_scale), bf16/fp16 q, d_qk 576, d_v 512,
64-token pages, rows of 576 bytes (any page and row strides, 16-byte multiples), h_q <= 16 a
token (columns 8 and 16: at 32, ptxas spills 20 bytes, the gathering producer warpgroup having
24 registers). Not causal; the sink is applied by the host. One producer warp (the
design note in docs/kernels/sparse.md has four; the 656-byte rows are not taken yet).
Status: compiled for sm_90a (CPU, session 23); NOT yet run on a GPU. The dispatch never takes it
unless TORCH_MLA_SPARSE_KEYSM_RS=1 (ops/sparse.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ..constants import D_QK, PAGE_SIZE
from .ptx import cp_async16
from .sm80_sparse_decode import MLASparseDecodeStep
from .sm90_keysm_decode import N_TILES, PAGE_ELEMS
from .sm90_keysm_rs_decode import MLADecodeSm90KeysMRS
from .sm90_keysm_sparse_decode import EntryBias
from .sm90_sparse_decode import GatheredEntries, gather8_offsets, row_source


def gather_lines_offsets(lane: int, j: int, t: int) -> tuple:
    """The copy of lane `lane` at step j (0..7), 64-byte group t (0..8) of gather_lines: (row,
    which of the lane's entries names it (0: keys 0..31, 1: 32..63), byte offset in the row =
    in the cache row, byte offset in the stage)."""
    row, c, _ = gather8_offsets(lane, j)  # row = lane / 4 + 8 j
    byte = 64 * t + 16 * c
    return row, j // 4, byte, row * D_QK + byte  # (j // 4 = row // 32, known at compile time)


@cute.jit
def gather_lines(slots, rows, stage):
    """One warp: the 576-byte rows of the 64 keys whose slots the lanes hold (slots: keys lane
    and lane + 32; rows: the cache's (base address, row stride, page stride) in bytes) to
    shared address `stage`, row r at r x 576 (the whole-line ring's layout). Step j: lanes
    4 q .. 4 q + 3 copy the 16-byte chunks c of each 64-byte group of row q + 8 j
    (gather8_offsets), 8 rows an instruction, 64 contiguous bytes a row."""
    lane = cute.arch.lane_idx()
    for j in cutlass.range_constexpr(PAGE_SIZE // 8):
        row, h, _, _ = gather_lines_offsets(lane, j, 0)
        # (row's entry is slots[h] of lane row % 32)
        src, size = row_source(*rows, cute.arch.shuffle_sync(slots[h], row % 32))
        for t in cutlass.range_constexpr(N_TILES):
            _, _, byte, dst = gather_lines_offsets(lane, j, t)
            cp_async16(stage + dst, src + byte, size)


class MLASparseDecodeKeysMRS(EntryBias, GatheredEntries, MLADecodeSm90KeysMRS):
    """The keys-on-M ping-pong kernel over gathered entries of an e4m3 cache; see the module
    docstring. (EntryBias: the keys-on-M sparse kernel's bias rows; S^T's row m is page row m
    here too.)"""

    def __init__(self, dtype, columns: int):
        super().__init__(dtype, False, columns)

    def _line_tma(self, op, mKV: cute.Tensor):
        """No TMA for the cache: the gathers address it as (64 rows, 576 bytes, pages)."""
        return self._cache_tma(op, cute.make_tensor(
            mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0])))

    @cute.jit
    def _load_page(self, tma_k, mKV, tKsK, page, cnt, bar_full, bar_empty, page_bytes):
        """The producer warp: the 64 keys block `page` names into the ring stage of use cnt[0]
        (EntryBias._claim_stage: its entries, the wait, its bias row), then the copies;
        cnt[0] += 1."""
        s, slots, _ = self._claim_stage(page, cnt, bar_empty)
        gather_lines(slots, self._cache_rows(mKV), self.d_k8 + s * PAGE_ELEMS)
        self._arrive_gathered([bar_full + s])
        cnt[0] = cnt[0] + 1


# --- compile entry (ops/registry.py: SparseStepConfig, backend "sm90_keysm_rs") ---------------


def compile_sparse_step(config, arch: str):
    """The sparse ping-pong step (dtype, columns; e4m3 cache), compiled for arch (sm_90a)."""
    from ..contract import compile_sparse_step_kernel, dsl_dtype

    dtype = dsl_dtype(config.dtype)
    decode = MLASparseDecodeKeysMRS(dtype, config.columns)
    return compile_sparse_step_kernel(MLASparseDecodeStep(decode, dtype, use_pdl=True), dtype,
                                      arch, config.cache)
