"""Sparse MLA decode (DeepSeek Sparse Attention) on the keys-on-M SM90 kernel (cp.async
gather), CuTe DSL: the few-heads shape (h_q <= 32 a token), where the heads-on-M sparse kernel
(sm90_sparse_decode.py) computes 64-row tiles of padding.

Problem and mapping (as sm90_sparse_decode.py): each (request, query token) pair is one
"request" of the walk with h_q query rows and topk_length[r] keys; a block of the walk is 64
consecutive entries of the token's row (_page: r * blocks_per_row + blk), the schedule the
dense one over those one-token requests, the step and its views sm80_sparse_decode's
MLASparseDecodeStep. The kernel is sm90_keysm_decode.py's MLADecodeSm90KeysM (S^T = K Q^T,
O^T = V^T P^T, the query rows on wgmma's N: `columns` 8, 16 or 32, one consumer warpgroup, a
producer warp filling a ring of page stages), whose walk, softmax, MMAs and epilogue run
unchanged. What differs:
  - the producer warp fills a ring stage by cp.async (sm90_sparse_decode's gather16 /
    gather8: 16-bit tiles to their swizzled places, or an e4m3 page's bytes where the dense
    kernel's TMA leaves them for the consumers' expansion; the 656-byte rows' e4m3 bytes, bf16
    rope tile and scales to a 41 KB stage: ROPE_TILE_AT, GROUP_SCALES_AT, the expansion
    multiplying each value by its group's scale), reading the block's 64 entries
    first (two a lane) and shuffling each row's slot to the lanes that copy it. The stage's
    full mbarrier takes 33 arrivals: every lane's cp.async.mbarrier.arrive.noinc (when its
    copies land) and one plain arrival after the warp's bias stores. The consumers fence
    (fence.proxy.async) after the wait before the MMAs read a 16-bit stage (cp.async writes
    through the generic proxy).
  - an entry that names no key (-1, at or past topk_length, a slot outside the cache) reads
    nothing (source size 0: a zero row) and its score is -inf: each stage has a bias row in
    shared memory (0 or -inf per key), written by the producer, added in _mask_entries.

Limits: d_qk 576, d_v 512, 64-token pages, any page and row strides (16-byte multiples);
bf16/fp16 q over a cache of q's dtype or a float8_e4m3fn one (kv_scale, exact mode: expanded
by the consumers), bf16 q over the 656-byte rows; h_q <= 32 (one CTA per token and part), s_q
any, topk any. Not causal. The sink is applied by the host.

Status: correct on the H200 over the three formats (the sparse kernel tests it takes, among
them stage reuse over many blocks a part, CUDA-graph replays, the bad-entry message; memcheck
over each format); the dispatch's choice for h_q <= 32 on sm_90a (TORCH_MLA_SPARSE_KEYSM=0:
off). At b 128, s_q 1, h_q 16 (session 18, one run): 113.8 us over bf16 (the portable kernel
129.4), 94.1 over e4m3 (the SM90 kernel 135.5), 99.8 over the 656-byte rows (the SM90 kernel
153.9; FlashMLA at h_q 64 over the same rows 123.6); docs/kernels/sparse.md.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..constants import FP8_DS_MLA_SCALES_AT, PAGE_SIZE
from .ptx import cp_async16
from .sm80_sparse_decode import CACHE_FORMATS, MLASparseDecodeStep
from .sm90_keysm_decode import (
    GROUP_SCALES_AT,
    GROUP_STAGE_BYTES,
    N_TILES,
    PAGE_ELEMS,
    ROPE_TILE_AT,
    TILE_ELEMS,
    WG_COLUMNS,
    MLADecodeSm90KeysM,
    ring_slot,
)
from .sm90_sparse_decode import GatheredEntries, gather8, gather16, row_source


class EntryBias:
    """The stage bias rows of the keys-on-M sparse kernels (this one and the ping-pong's,
    sm90_keysm_rs_sparse_decode.py): one row of 64 floats a ring stage (0, or -inf for a key no
    entry names), written by the producer (GatheredEntries._write_bias), read by the consumers
    right after the stage's full wait and added to the scores. Mixed in first."""

    def _more_smem(self) -> dict:
        return {"sBias": cute.struct.MemRange[Float32, self.stages * PAGE_SIZE]}

    @cute.jit
    def _claim_stage(self, page, cnt, bar_empty):
        """The producer warp: the ring stage of use cnt[0] for block `page` once its last reader
        released it (the block's 64 entries read before the wait, their latency under it), its
        bias row written; returns (stage, this lane's two slots, lane)."""
        s, parity = ring_slot(cnt[0], self.stages)
        slots = list(self._entries(page))
        cute.arch.mbarrier_wait(bar_empty + s, parity ^ 1)
        lane = cute.arch.lane_idx()
        self._write_bias(self.d_storage.sBias.get_tensor(cute.make_layout(
            self.stages * PAGE_SIZE)), s * PAGE_SIZE, slots, lane)
        return s, slots, lane

    @cute.jit
    def _entry_bias(self, s, wq, lane):
        """This thread's two keys' values of ring stage s's bias row (0, or -inf for a key no
        entry names): key 16 wq + lane / 4 + 8 h of acc_S (acc_coord). Read right after the
        stage's full barrier: over an fp8 cache the consumers release the stage once it is
        expanded, and the producer may then write the bias row of the stage's next page."""
        bias = self.d_storage.sBias.get_tensor(cute.make_layout(self.stages * PAGE_SIZE))
        return [bias[s * PAGE_SIZE + 16 * wq + lane // 4 + 8 * h] for h in range(2)]

    @cute.jit
    def _mask_entries(self, acc_S, entry_bias):
        """Adds the stage's bias (_entry_bias) to the scores: -inf for keys no entry names
        (those at or past topk_length the horizon masks too). acc_S value idx is key
        16 wq + lane / 4 + 8 ((idx / 2) % 2)."""
        for idx in cutlass.range_constexpr(cute.size(acc_S)):
            acc_S[idx] = acc_S[idx] + entry_bias[(idx // 2) % 2]


class MLASparseDecodeKeysM(EntryBias, GatheredEntries, MLADecodeSm90KeysM):
    """The keys-on-M kernel over gathered entries; see the module docstring."""

    def __init__(self, dtype, columns: int, cache: str = "plain"):
        assert cache in CACHE_FORMATS, cache
        assert columns <= WG_COLUMNS, columns  # one consumer warpgroup
        assert cache != "fp8_ds_mla" or dtype == cutlass.BFloat16, (cache, dtype)
        super().__init__(dtype, False, columns, kv_fp8=cache != "plain")
        self.cache = cache
        if cache == "fp8_ds_mla":
            # A stage holds the 8 e4m3 tiles, the bf16 rope tile and the scales (41 KB):
            # 3 stages beside 16 columns' Q, 2 beside 32's.
            self.group_scales = True
            self.stage_bytes = GROUP_STAGE_BYTES
            self.stages = 3 if columns <= 16 else 2

    @cute.jit
    def _load_page(self, tma_k, mKV, tKsK, page, cnt, bar_full, bar_empty, page_bytes):
        """The producer warp: the 64 keys block `page` names into the ring stage of use cnt[0]
        (_claim_stage: its entries, the wait, its bias row), then the copies; cnt[0] += 1."""
        s, slots, lane = self._claim_stage(page, cnt, bar_empty)
        rows = self._cache_rows(mKV)
        tiles = range(PAGE_ELEMS // TILE_ELEMS)
        if cutlass.const_expr(self.cache == "fp8_ds_mla"):
            # 8 e4m3 tiles, the bf16 rope tile (swizzled, as the work buffer holds it) and
            # each row's 16 bytes of scales.
            stage = self.d_k8 + s * self.stage_bytes
            gather8(slots, rows, [(stage + t * TILE_ELEMS, t * 64) for t in range(N_TILES - 1)],
                    stage + ROPE_TILE_AT)
            for r in cutlass.range_constexpr(2):
                src, size = row_source(*rows, slots[r])
                cp_async16(stage + GROUP_SCALES_AT + 16 * (lane + 32 * r),
                           src + FP8_DS_MLA_SCALES_AT, size)
        elif cutlass.const_expr(self.kv_fp8):
            stage = self.d_k8 + s * PAGE_ELEMS
            gather8(slots, rows, [(stage + t * TILE_ELEMS, t * 64) for t in tiles])
        else:
            stage = self.d_k_base + s * PAGE_ELEMS * 2
            gather16(slots, rows, [(stage + t * TILE_ELEMS * 2, t * 128) for t in tiles])
        self._arrive_gathered([bar_full + s])
        cnt[0] = cnt[0] + 1

# --- compile entry (ops/registry.py: SparseStepConfig, backend "sm90_keysm") ------------------


def compile_sparse_step(config, arch: str):
    """The keys-on-M sparse decode step (dtype, cache format, columns), compiled for arch
    (sm_90a)."""
    from ..contract import compile_sparse_step_kernel, dsl_dtype

    dtype = dsl_dtype(config.dtype)
    decode = MLASparseDecodeKeysM(dtype, config.columns, config.cache)
    return compile_sparse_step_kernel(MLASparseDecodeStep(decode, dtype, use_pdl=True), dtype,
                                      arch, config.cache)
