"""Sparse MLA decode on SM90 with FlashMLA's split of the warpgroups, CuTe DSL.

Problem and mapping: sm90_producer_sparse_decode.py's (64 heads of a token a CTA, blocks of 64
gathered entries in two page buffers, a producer warpgroup WG2 that gathers and dequantizes
them, filling each buffer half once the consumers release it). What changes is the consumers'
split. There (the dense kernel's seesaw) both consumer warpgroups compute Q K^T and the
softmax of alternate blocks and each holds its S and Q's RoPE tile beside its half of O: 224
registers each, which leaves the producer 56 (setmaxnreg), too few to keep its fp8 loads in
flight (session 28: 1.4x the heads-on-M kernel at b 128). Here, as in FlashMLA's sparse FP8
decode (read at 9241ae3; nothing copied):
  - WG0, every block j (buffer j % 2): S = Q K^T (all nine 64-column tiles from shared memory,
    Q's RoPE tile included), the mask and the online softmax, O's columns 0-255 += P V (P from
    registers); it hands P (shared memory, sP0) and the block's row scale (sScale0) to WG1.
  - WG1: O's columns 256-511 rescaled, += P V (P from shared memory).
  - A buffer half is released when its last reader is done: columns 0-255 (half 0) by WG0
    after its P V, columns 256-575 (half 1) by WG1 after its P V (WG0's Q K^T read the RoPE
    tile before it handed P over). The producer fills both halves in order (fill_order).
  - Named barriers (256 threads): NB_P (WG0 -> WG1: P and the scale of block j are in shared
    memory) and NB_FREE (WG1 -> WG0: block j's P V is done, sP0 may be overwritten; only
    between blocks of a segment, so every arrival meets its sync).
setmaxnreg: WG0 216, WG1 160, the producer 128 (REGS: their sum is 3 x 168, the registers a
thread at launch, since the increases take what the decreases free), which holds all 8 of a
thread's fp8 chunks of a half across the release (_fill). The kernel body is traced once a
warpgroup with the warpgroup's index a constant (sm90_decode.MLADecodeSm90.body), so each
consumer's segment loop and epilogue are its own code and ptxas allocates each for its own
count; with one copy shared by both consumers it allocated it for the smaller count (session
28: WG0 192 with WG1 160 spilled 2084 bytes, so both had 216 and the producer 72). ptxas
spills 8 bytes at (128, 216, 160) over the 656-byte rows (16-48 with the base class's
producer, varying between builds of the same code), none over the 16-bit cache; WG0 at 192
(FlashMLA's) spilled 200.

The producer (its own _produce and _fill, session 29): one block a loop step, the buffer a
runtime index, so each half's fill is inlined once (the base class inlines four fills a pair
of blocks: 64 KB of code, whose instruction fetch was its largest stall with nothing to read).
Over the 656-byte rows a thread converts 4 of a half's 16 chunks of 16 fp8 bytes of each of 2
keys (token_of_lane: FlashMLA's producer's map, four lanes a key; with the pair each chunk is
two 8-byte pieces: sector_load_offsets), with one row address and one load of the half's two
group scales a key; all of them load before the release.

The row sums live in WG0 only (WG1's stay zero: the epilogue adds both warpgroups'); the
running max in sM as before. The epilogue, the segments and the split-KV writes are the dense
kernel's.

The cluster pair (pair=True: SparseStepConfig columns 128, the dispatch's
ops.sparse.split_pair_rows; h_q 65-128 over the 656-byte rows): a token's two 64-row m-blocks
launch as a cluster of two CTAs walking the same blocks. Each producer converts keys
32 rank .. 32 rank + 31 of every block half (one round of token_of_lane) and stores each chunk
both here and, by st.async, at the same place in the peer, completing bytes on the peer's tile
mbarrier (thread 0's arrival expects PEER_BYTES); the rope tile and the bias row each CTA
writes itself, for all 64 keys. A half is free when both CTAs' consumers released it ("empty"
mbarriers of count 2; each release also arrives on the peer's); the cluster
syncs after the mbarriers' set-up and at the end, so no CTA exits while its peer may still
store into it. FlashMLA's h_q 128 kernel shares its conversion across a pair the same way.
st.async writes are generic-proxy writes that land after the peer's fence, so the warpgroup
waiting for a half fences for the async proxy before its MMAs read it (half_has_copies); that
fence serves the producer's own stores as well, so the producer does not fence before it
arrives (producer_fences False). The releases to the peer and the waits they complete (the
producer's for a free half, WG0's for a filled one) are at CTA scope, as CUTLASS's cluster
pipelines and FlashMLA's pair have them (SCOPE: the knob, and what CTA scope relies on).

Status: the dispatch's kernel at 64-128 heads over the 656-byte rows and the 16-bit cache
where the SM90 kernel pays or from 2 one-token requests, b s_q (ops.sparse.split_sparse_pays),
the pair at h_q 65-128 over the
656-byte rows (TORCH_MLA_SPARSE_SPLIT_PAIR=0: off), the short build where a part holds few
blocks. Run on H100s and an H200 (sessions 28-47): the GPU tests, memcheck and FlashMLA's own
sparse-decode cases through torch_mla.compat pass. How each piece came to be, with the
measurements that decided it: docs/kernels/sparse.md (sessions 28-47) and the developer
knobs' comments below.
"""

from __future__ import annotations

import os
from functools import partial

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import warpgroup

from ..constants import D_QK, FP8_DS_MLA_SCALES_AT, PAGE_SIZE
from . import softmax, splitkv
from .ptx import (
    e4m3_store16,
    ldg_or_zero,
    lds128,
    mapa_shared,
    mbarrier_wait_cluster,
    stg_b32x4,
)
from .sm80_sparse_decode import MLASparseDecodeStep
from .sm90_decode import BLOCK_M, HALF_V, N_TILES, NB_P0, NB_SCALE1, STAGE_STRIDE, fence_operand
from .sm90_producer_sparse_decode import MLASparseDecodeSm90Producer
from .sm90_sparse_decode import TILE16, request_length, row_source


def _dev_knob(name: str, default, allowed: tuple):
    """Developer knob TORCH_MLA_DEV_SPLIT_<name>, read at import: one of `allowed` (their type),
    default when unset or empty. A knob that is set is part of the kernel cache's key."""
    raw = os.environ.get(f"TORCH_MLA_DEV_SPLIT_{name}") or ""
    value = type(default)(raw) if raw else default
    if value not in allowed:
        raise ValueError(f"TORCH_MLA_DEV_SPLIT_{name} takes one of {allowed}, not {raw!r}")
    return value


REGS = (128, 216, 160)  # (producer, WG0, WG1) registers a thread after setmaxnreg
# The producer's fp8 loads (the 656-byte rows): FlashMLA's 256-byte L2 prefetch and an L1
# evict_last hint (session 30: 145.5 us at b 128 s_q 1 h_q 64 against 162.1 with neither).
L2_PREFETCH = 256
L1_EVICT = "evict_last"
# Buffer halves whose fp8 chunks the producer has loaded ahead of the half it converts (_produce):
# with the pair 2 (the next block's two halves before this block's conversion; session 41: -6
# to -8.5% at b 32 and 128 h_q 128), without it 0 (each half's chunks load just before the wait
# for it is free; 2 would hold ~144 words a thread against the producer's 128 registers).
# _produce's lookahead branch is written for 2 (both halves of the next block).
LOOKAHEAD_PAIR = 2
# Measured and removed (figures in docs/kernel-notes.md and docs/benchmarks-h100.md, by
# session): one half ahead (AHEAD_PAIR 1, session 34: 5% slower); both halves' loads before the
# wait without a lookahead (LOAD_BLOCK 2, session 35: slower without the pair, 72 words held);
# the length read with every block (ENTRY_LEN 0) and the rope gather after the conversion
# (ROPE_FIRST 0), the old orders (session 34); the producer's own fences (PFENCE 0/1, sessions
# 32 and 38) and WG0's before P V (PVFENCE 1, FENCE 1); P handed over before WG0's P V
# (PARRIVE early) and the next S queued behind P V (PIPE 1, session 33: slower); O written from
# the accumulators (O_DIRECT, session 42: +3.5-4%); the exchange by bulk copies (XBULK, session
# 43: +14%); the pair's old half-sector store layout (SECTORS 0, session 43: +7%); FlashMLA's
# bf16 conversion route (CONVERT bf16mul, session 36: 1% faster at h_q 64, 2% slower with the
# pair, inexact); and the timing-only
# probes LIGHT (a quarter of the MMAs, session 47), PEER 0, ROPE 0 (session 43) and CONVERT
# f16mul (session 36), whose questions their sessions answered. ROPE_AHEAD (session 47: a
# segment's first two blocks' rope gathers issued together once their halves 1 were free),
# measured in session 49 (H100, same start as FlashMLA, two rounds): slower at every small row,
# 2,1,128 22.6, 22.8 -> 23.1, 23.5 us, 2,2,128 26.3, 26.4 -> 27.1, 27.1, 8,1,128 33.6, 33.7 ->
# 35.0, 34.8 (predicted 0.3-0.8 us faster); removed.
# The scope of the pair's cross-CTA synchronisation: "cta" (the default since session 41: the
# releases to the peer and the waits they complete at CTA scope, as CUTLASS's cluster
# pipelines do, whose remote mbarrier.arrive.shared::cluster takes PTX's default .release.cta
# and whose waits acquire at CTA scope, and as FlashMLA's pair does) or "cluster" (the PTX
# memory model's letter: the releases cluster-scoped and the waits they complete acquiring at
# cluster scope). Two hand-offs cross the CTAs: a release to the peer (after this CTA's wgmma
# reads of a half completed at their wait_group, or at a segment's start after the epilogue's
# bulk copies read the staged O) before the peer's st.async into the half; and the peer's
# st.async bytes, whose complete_tx on this CTA's mbarrier the PTX manual makes a cluster-scope
# release, before WG0's CTA-scope acquire. CTA scope relies on what CUTLASS's and FlashMLA's
# pairs rely on for both (TMA multicast lands the same way under CUTLASS's CTA-scope waits),
# not on the memory model's letter; tests, memcheck and bit-identical repeats cannot prove an
# ordering, only fail to find a race, so the knob stays for a suspected one. Session 31's ncu:
# each cluster-scope acquire becomes a CCTL.IVALL (the whole L1 invalidated). Session 32 (H100):
# with every entry -1 228.2 us at cluster scope, 207.7 at cta; random entries within 1%.
SCOPE = _dev_knob("SCOPE", "cta", ("cluster", "cta"))
# ROPE_EARLY 1 (developer knob TORCH_MLA_DEV_SPLIT_ROPE_EARLY; the 656-byte rows without the
# pair): the rope tile gets its own "empty" mbarrier a buffer (barE[4 + s], one arrival),
# released by WG0 once its S of the buffer's block landed (only S reads the rope tile), so the
# producer issues a block's rope gather at the block's start, before half 0's wait, not once
# half 1 is free. Session 40 (H100, same start, two rounds): 128,1,64 131.2 us against 132.2,
# 128,2,64 245.9 against 248.2 (FlashMLA 129.6, 245.7); with the pair +7.6% at cluster scope
# and +0.2% at CTA scope, hence without the pair only. The split's fp8 tests passed on it (32);
# memcheck not yet run, so not the default.
ROPE_EARLY = _dev_knob("ROPE_EARLY", 0, (0, 1))
# EPI_COPY 1 (developer knob TORCH_MLA_DEV_SPLIT_EPI_COPY; on in the short build): O staged in
# the page buffers as by default, then copied out by the warpgroup's threads, 16 bytes a lane
# (ld.shared.v4, st.global.v4: a warp writes 512 contiguous bytes an instruction), in place of
# a bulk copy a row and the wait for the bulk engine to read them (session 45's 2,1,128 trace:
# 2.6 us of a 3.8 us epilogue). The threads need no such wait: their ld.shared reads come
# before the next segment's consumer barrier and release in program order. Session 46 (H100,
# same start, two rounds, us, defaults / EPI_COPY 1): 2,1,128 24.8, 24.9 / 24.0, 24.0; 2,1,64
# 22.9, 22.8 / 21.9, 21.9; but 2,2,128 27.7 / 28.4, 32,1,128 70.8 / 76.8, 128,1,128 185.6 /
# 202.8 (8-9% slower at h_q 128 from b 32, not explained). Alone, not a default; see the short
# build's comment below.
EPI_COPY = _dev_knob("EPI_COPY", 0, (0, 1))
# META_EARLY 1 (developer knob TORCH_MLA_DEV_SPLIT_META_EARLY; on in the short build): the
# part's metadata row is loaded before the prologue's mbarrier setup, __syncthreads and (with
# the pair) the cluster sync (MLADecodeSm90.meta_early). Session 46 (H100, same start, two
# rounds, us, 0 / 1): 2,1,128 24.8, 24.9 / 24.4, 24.4; 32,1,128 70.8 / 70.5; 128,1,128 185.6 /
# 186.3; 128,1,64 131.9 / 131.3: no row slower by more than 0.4%. Only its smoke cases ran on
# the default build with it, so it is on in the short build and off by default.
META_EARLY = _dev_knob("META_EARLY", 0, (0, 1))
# ENTRY_EARLY 1 (developer knob TORCH_MLA_DEV_SPLIT_ENTRY_EARLY; on in the short build): the
# producer loads a segment's first block of entries before it reads the request's length and
# split count, at addresses clamped into the request's row (loads that cannot wait on the
# length), and applies the length afterwards: one dependent DRAM round trip less before a
# segment's first rows can load (the later blocks' entries already load a block ahead).
# Session 46 (H100, same start, two rounds, us, defaults / ENTRY_EARLY 1): 2,1,128 24.8 /
# 23.8; 2,1,64 22.9 / 21.4; 2,2,64 25.9 / 24.8; but 32,1,128 70.8 / 75.4, 128,1,128 185.6 /
# 195.7, 128,1,64 131.9 / 139.8. Alone, not a default; see the short build's comment below.
ENTRY_EARLY = _dev_knob("ENTRY_EARLY", 0, (0, 1))
# ENTRY_EARLY2 1 (developer knob TORCH_MLA_DEV_SPLIT_ENTRY_EARLY2; on in the short build since
# session 47; where ENTRY_EARLY is on and the producer loads ahead, as with the pair): the
# segment's second block's entries loaded before the length too (the first block's where the
# segment has one), since with a lookahead block lo's conversion waits on block lo + 1's row
# loads. Session 47 (H100, same start as FlashMLA, two rounds, us, the short build / with
# ENTRY_EARLY2 / FlashMLA): 2,1,128 23.2, 22.9 / 23.0, 22.8 / 21.7, 21.8; 2,2,128 26.9, 27.0 /
# 26.5, 26.4 / 23.8, 23.8; 4,1,128 27.3, 27.0 / 27.1, 26.8 / 24.3, 24.2; 8,1,128 34.5, 34.4 /
# 33.9, 33.8 / 31.8, 31.6. Its build passed the split's GPU tests (156) and memcheck.
ENTRY_EARLY2 = _dev_knob("ENTRY_EARLY2", 0, (0, 1))
# The short build (SparseStepConfig short=True; ops.sparse.split_short_parts picks it where a
# part holds few blocks): EPI_COPY, ENTRY_EARLY and META_EARLY on, and ENTRY_EARLY2 with the
# pair. The first two alone are ~1 us faster at b 2 s_q 1 and 5-9% slower from b 32 at h_q 128;
# the three together (session 46, H100, same start as FlashMLA, two rounds, us, defaults / the
# three / FlashMLA): 2,1,128 24.8, 24.9 / 22.6, 22.7 / 21.7, 21.6; 2,2,128 27.7, 27.7 / 26.5,
# 26.7 / 23.7, 23.7; 2,1,64 22.9, 22.8 / 21.4, 21.7 / 24.2, 24.1; 2,2,64 25.9, 26.0 / 25.0,
# 25.1 / 24.2, 24.1; 32,1,128 70.8, 71.0 / 73.6, 73.7 / 67.1, 67.1; 128,1,128 185.6, 186.2 /
# 194.0, 193.2 / 183.7, 183.9; 128,1,64 131.9, 131.8 / 135.2, 134.9 / 130.1, 130.1: a build for
# short parts only, over the 656-byte rows, where it was measured.
# Bytes of a buffer half the peer's producer stores into this CTA with pair: 32 keys x 256
# values x 2 bytes (the rope tile each CTA gathers itself).
PEER_BYTES = 32 * 256 * 2
NB_P = NB_P0  # WG0 -> WG1 (the seesaw's ids, unused by this split)
NB_FREE = NB_SCALE1  # WG1 -> WG0


def token_of_lane(warp: int, lane: int, u: int) -> tuple:
    """(key, q) of producer thread (warp, lane) in round u (0 or 1) of a buffer half's fill over
    the 656-byte rows: key 8 warp + lane % 8 + 32 u of the block; q = lane // 8, its chunks
    256 h + 64 d + 16 q of the row (d = 0..3: 4 of a half's 16 chunks of 16 bytes, values of
    group scales 2 h and 2 h + 1), or with the pair the two 8-byte pieces
    sector_load_offsets names. Four lanes share a key, eight keys a warp and round."""
    return 8 * warp + lane % 8 + 32 * u, lane // 8


def token_store_offsets(h: int, d: int, key, q) -> tuple:
    """Byte offsets, from a page buffer's start, of the two 16-byte chunks that values 0-7 and
    8-15 of chunk 256 h + 64 d + 16 q of key `key`'s row become: 16-bit tile 4 h + d, columns
    16 q + [0, 16) in the 128-byte swizzle (chunk c of row R at c ^ (R % 8)); the same places as
    sm90_producer_sparse_decode.fp8_store_offsets(h, key, 4 d + q). A store phase of 8 lanes (one
    q, keys 8 w + t for t = 0..7) covers 8 distinct 16-byte bank groups. key, q: ints (tests)
    or the DSL's Int32."""
    tile = (4 * h + d) * TILE16 + key * 128
    return tile + (((2 * q) ^ (key % 8)) << 4), tile + (((2 * q + 1) ^ (key % 8)) << 4)


def sector_load_offsets(h: int, d: int, q, row=0) -> tuple:
    """The pair's loads: the addresses (row: the key's 656-byte row's; 0: offsets in the row) of the
    two 8-byte pieces of fp8 values producer lane q loads for tile 4 h + d: values
    256 h + 64 d + 8 q .. + 7 and 256 h + 64 d + 32 + 8 q .. + 7 (both of group scale
    2 h + d // 2). q, row: ints (tests) or the DSL's values."""
    at = row + 256 * h + 64 * d + 8 * q
    return at, at + 32


def sector_store_offsets(h: int, d: int, key, q) -> tuple:
    """The pair's stores: byte offsets, from a page buffer's start, of the two 16-byte chunks
    that key `key`'s values at sector_load_offsets(h, d, q) become: 16-bit tile 4 h + d,
    chunks q and q + 4 of the row in the 128-byte swizzle (chunk c of row R at c ^ (R % 8)),
    the places fp8_store_offsets gives those values. key, q: ints (tests) or the DSL's
    Int32."""
    tile = (4 * h + d) * TILE16 + key * 128
    return tile + ((q ^ (key % 8)) << 4), tile + (((q + 4) ^ (key % 8)) << 4)


class MLASparseDecodeSm90Split(MLASparseDecodeSm90Producer):
    """The SM90 sparse kernel with FlashMLA's split of the warpgroups; see the module
    docstring."""

    split = True
    regs = REGS
    rope_in_regs = False  # (Q's RoPE tile stays in shared memory: sP1 does not use it)
    # The producer arrives on a half's tile mbarrier without fencing its stores for the async
    # proxy; the warpgroup waiting for the half fences after its wait (half_has_copies), as
    # it must for the pair's st.async writes anyway (session 32: -5% at b 128 h_q 128 with the
    # pair; session 38: -1.6% at b 128 h_q 64 without it).
    producer_fences = False

    def __init__(self, dtype, cache: str = "plain", pair: bool = False, short: bool = False):
        """pair: the two m-blocks of a token (h_q 65-128) as a cluster of two CTAs whose
        producers each convert half of every block's keys (rows 32 rank .. + 31) into both
        CTAs' buffers (the 656-byte rows only); see the module docstring. short: the build for
        parts of few blocks (EPI_COPY, ENTRY_EARLY, META_EARLY and, with the pair,
        ENTRY_EARLY2 on: the comment below ENTRY_EARLY2)."""
        assert not pair or cache == "fp8_ds_mla", cache
        super().__init__(dtype, cache)
        self.pair = pair
        self.cluster_m = 2 if pair else 1
        self.lookahead = LOOKAHEAD_PAIR if pair else 0  # (halves loaded ahead: its comment)
        self.meta_early = META_EARLY == 1 or short  # (its comment)
        self.epi_copy = EPI_COPY == 1 or short  # (its comment; the short build's)
        self.entry_early = ENTRY_EARLY == 1 or short  # (likewise)
        self.entry_early2 = (ENTRY_EARLY2 == 1 or short) and self.entry_early and self.lookahead > 0
        self.rope_early = ROPE_EARLY == 1 and cache == "fp8_ds_mla" and not pair  # (its comment)

    def _extra_storage(self) -> dict:
        """barE: an "empty" mbarrier a buffer half, and with rope_early one a rope tile."""
        return {"barE": cute.struct.MemRange[cutlass.Int64, 6 if self.rope_early else 4]}

    def _init_barriers(self):
        """barE[2 s + h]: half h of buffer s is free: one release, or with pair two (this CTA's
        consumers' and the peer's: the producers write into both CTAs' buffers); with rope_early
        barE[4 + s], buffer s's rope tile is free (WG0's one release)."""
        bar = self.d_storage.barE.data_ptr()
        for i in range(4):
            cute.arch.mbarrier_init(bar + i, 2 if self.pair else 1)
        if const_expr(self.rope_early):
            for i in range(4, 6):
                cute.arch.mbarrier_init(bar + i, 1)

    def _release_rope(self, s):
        """With rope_early, buffer s's rope tile to this CTA's producer (the calling lane)."""
        if const_expr(self.rope_early):
            cute.arch.mbarrier_arrive(self.d_storage.barE.data_ptr() + 4 + s)

    @cute.jit
    def _rope_early(self, rows, slots, s, parity, warp):
        """With rope_early, at the producer's block start: once buffer s's rope tile is free,
        its gather (rope_tile; half 1's cp_async_mbarrier_arrive tracks it)."""
        if const_expr(self.rope_early):
            bit = 4 + s
            cute.arch.mbarrier_wait(self.d_storage.barE.data_ptr() + bit, (parity[0] >> bit) & 1)
            parity[0] = parity[0] ^ (1 << bit)
            self.rope_tile(rows, slots, self.d_k_base.toint() + s * (PAGE_SIZE * D_QK * 2), warp)

    def _free(self, i: int):
        """Half i % 2 of buffer i // 2 released to this CTA's producer and, with pair, to the
        peer's (a release at SCOPE, CTA by default: the peer's producer then overwrites the
        half here)."""
        bar = self.d_storage.barE.data_ptr() + i
        cute.arch.mbarrier_arrive(bar)
        if const_expr(self.pair):
            scope = nvvm.MemScopeKind.CLUSTER if SCOPE == "cluster" else nvvm.MemScopeKind.CTA
            cute.arch.mbarrier_arrive(bar, 1 - cute.arch.block_idx_in_cluster(), scope=scope)

    def _wait_half(self, bar, parity):
        """With pair the peer also fills a half (st.async) and frees it (its consumers'
        release): an acquire at CTA scope, where CUTLASS's cluster pipelines wait (SCOPE
        "cluster": a cluster-scope acquire, the PTX memory model's letter)."""
        if const_expr(self.pair and SCOPE == "cluster"):
            mbarrier_wait_cluster(bar.toint(), parity)
        else:
            cute.arch.mbarrier_wait(bar, parity)
        self._stamp("tiles")  # (trace point: thread 0's, WG0's waits for a block's tiles)

    def _take_half(self, bit, parity):
        """The producer: wait until half `bit` (2 s + h: half h of buffer s) is free, at its
        parity bit in parity[0], then flip that bit."""
        self._wait_half(self.d_storage.barE.data_ptr() + bit, (parity[0] >> bit) & 1)
        parity[0] = parity[0] ^ (1 << bit)

    def half_has_copies(self, h: int) -> bool:
        """Every half: the producer does not fence its own stores for the async proxy before it
        arrives (producer_fences False), so the waiting warpgroup fences them, with half 1's
        rope-tile cp.async copies and, with pair, the peer's st.async writes (generic proxy,
        landing after its fence)."""
        return True

    @staticmethod
    def fill_order(s: int) -> tuple:
        """WG0 computes every block's Q K^T, tiles 0-8 in order: half 0 first."""
        return (0, 1)

    @cute.jit
    def _produce(self, walk, mKV, barK):
        """The producer warpgroup: the consumers' walk, one block a loop step (block j of a
        segment into buffer j % 2, a runtime index, so that each half's fill is one copy of
        code for both buffers: the producer's code is half that of two blocks a step), both
        halves in order; the entries load a block ahead of the block whose rows load (with a
        lookahead, two ahead of the block being converted), the rows self.lookahead halves
        ahead of the half being converted (LOOKAHEAD_PAIR: the next block's both halves with
        the pair; without it each half's just before its wait)."""
        warp, mIdx, mLens, mNumSplits, width, rows = self._walk_inputs(mKV)
        parity = cute.make_rmem_tensor(1, Int32)  # bit 2 s + h: half h of buffer s's "empty"
        parity.fill(0)
        slots = cute.make_rmem_tensor(4, Int32)  # this lane's entries: this block's, the next's
        carry = cute.make_rmem_tensor(max(self.lookahead, 1) * self._half_words(), Int32)
        last = cute.size(mLens) - 1
        for r in cutlass.range(walk.begin_req, walk.end_req + 1, unroll=1):
            rr = cutlass.min(r, last)  # (as the base class's walk)
            early = early2 = None
            if const_expr(self.entry_early):  # (segment()'s lo, which needs no length)
                lo0 = cutlass.select_(r == walk.begin_req, walk.begin_blk, Int32(0))
                early = self._raw_entries(mIdx, rr, lo0)
                if const_expr(self.entry_early2):
                    early2 = self._raw_entries(mIdx, rr, lo0 + 1)
            lo, hi = splitkv.segment(walk, r, mLens[rr], width,
                                     mNumSplits[rr + 1] - mNumSplits[rr])
            length = request_length(mIdx, mLens, rr)
            if lo < hi:
                if const_expr(self.entry_early):
                    first = self._entries_of(early, lo, length)
                else:
                    first = self._block_entries(mIdx, r, lo, length)
                slots[0] = first[0]
                slots[1] = first[1]
                if const_expr(self.lookahead > 0):
                    if const_expr(self.entry_early2):  # (block lo + 1, or lo where it is last)
                        two = lo + 1 < hi
                        second = self._entries_of(
                            [cutlass.select_(two, early2[h], early[h]) for h in range(2)],
                            cutlass.min(lo + 1, hi - 1), length)
                    else:
                        second = self._block_entries(mIdx, r, cutlass.min(lo + 1, hi - 1),
                                                     length)
                    slots[2] = second[0]
                    slots[3] = second[1]
                    for h in cutlass.range_constexpr(self.lookahead):
                        self._stash(carry, h, self._load(rows, first, h, warp))
                for blk in cutlass.range(lo, hi, unroll=1):
                    self._stamp("pblock", 256, blk - lo)  # (trace: the producer's block)
                    cur = [slots[0], slots[1]]
                    s = (blk - lo) % 2
                    if const_expr(self.lookahead == 0):
                        nxt = self._block_entries(mIdx, r, cutlass.min(blk + 1, hi - 1), length)
                        self._rope_early(rows, cur, s, parity, warp)
                        for h in cutlass.range_constexpr(2):
                            self._fill(rows, cur, s, h, barK, parity, warp,
                                       self._load(rows, cur, h, warp))
                    else:
                        # (the next block's entries arrived during this one's; the one after's
                        # load now, for the next step)
                        nx = [slots[2], slots[3]]
                        nxt = self._block_entries(mIdx, r, cutlass.min(blk + 2, hi - 1), length)
                        more = blk + 1 < hi
                        held = [self._unstash(carry, h) for h in range(self.lookahead)]
                        for h in cutlass.range_constexpr(2):
                            self._stash(carry, h, self._load(rows, nx, h, warp, more))
                        for h in cutlass.range_constexpr(2):
                            self._fill(rows, cur, s, h, barK, parity, warp, held[h])
                        slots[0] = nx[0]
                        slots[1] = nx[1]
                    slots[2 * (self.lookahead > 0)] = nxt[0]
                    slots[2 * (self.lookahead > 0) + 1] = nxt[1]
                    self._stamp("filled", 256, blk - lo)
                self._stamp("produced", 256)

    def _block_entries(self, mIdx, r, blk, length):
        """This lane's two entries of block blk of request r (_entries), with the request's
        length read once a segment."""
        return self._entries(self._page(mIdx, r, blk), length)

    @cute.jit
    def _raw_entries(self, mIdx, r, blk):
        """ENTRY_EARLY: this lane's two entries (keys lane and lane + 32) of block blk of
        one-token request r as stored, loaded whatever the request's length (the key clamped
        into the row: nothing is read outside mIdx, and block_entries' checks follow in
        _entries_of), by loads the compiler cannot move past the length's."""
        n = mIdx.shape[1]
        out = []
        for h in cutlass.range_constexpr(2):
            key = cutlass.min(cutlass.max(blk, 0) * PAGE_SIZE + cute.arch.lane_idx() + 32 * h,
                              cutlass.max(n - 1, 0))
            addr = (mIdx.iterator + cute.crd2idx((r, key), mIdx.layout)).toint()
            # (topk 0: no entry to read, none read)
            out.append(ldg_or_zero(1, addr, Int32(n > 0), "evict_normal")[0])
        return out

    @cute.jit
    def _entries_of(self, raw, blk, length):
        """_raw_entries' words as block_entries returns them for block blk: -1 at or past
        length, or where the entry names no slot of the cache."""
        lane = cute.arch.lane_idx()
        slots = []
        for h in cutlass.range_constexpr(2):
            ok = (blk * PAGE_SIZE + lane + 32 * h < length) & (raw[h] >= 0) & (
                raw[h] < self.d_num_slots)
            slots.append(cutlass.select_(ok, raw[h], Int32(-1)))
        return slots

    def _half_words(self) -> int:
        """32-bit words of one buffer half's loaded chunks and scales a producer thread holds
        (_load): 18 a round of keys (4 chunks of 4 words, 2 scale words); 1 (unused) over the
        16-bit cache, whose fills load nothing ahead."""
        return 18 * self._rounds() if self.cache == "fp8_ds_mla" else 1

    def _stash(self, carry, k: int, loaded):
        """Half `loaded` (_load's lists) into slot k of the register array carry (across a
        loop step)."""
        words, scales = loaded
        flat = [w for chunk in words for w in chunk] + [w for pair in scales for w in pair]
        for i, w in enumerate(flat):
            carry[k * self._half_words() + i] = w

    def _unstash(self, carry, k: int):
        """_stash's inverse: (words, scales) as _load returns them."""
        if const_expr(self.cache != "fp8_ds_mla"):
            return [], []
        base = k * self._half_words()
        n = 4 * self._rounds()
        words = [[carry[base + 4 * c + i] for i in range(4)] for c in range(n)]
        scales = [[carry[base + 4 * n + 2 * c + i] for i in range(2)]
                  for c in range(self._rounds())]
        return words, scales

    @cute.jit
    def _load(self, rows, slots, h: cutlass.Constexpr[int], warp, more=None):
        """Over the 656-byte rows, this thread's part of half h of the block whose slots the
        lanes hold (keys lane and lane + 32) into registers: 4 chunks of 16 fp8 bytes of each
        of its 2 keys (token_of_lane; with pair each chunk two 8-byte pieces,
        sector_load_offsets) and each key's 2 group scales of the half, one row address a key
        (no shuffle a chunk). (words, scales): 8 lists of 4 words, 2 of 2; both
        empty over the 16-bit cache."""
        lane = cute.arch.lane_idx()
        words, scales = [], []
        if const_expr(self.cache == "fp8_ds_mla"):
            for i in cutlass.range_constexpr(self._rounds()):
                u = self._round(i)
                key, q = token_of_lane(warp, lane, u)
                src = slots[i]
                if const_expr(self.pair):
                    src = cutlass.select_(u == 0, slots[0], slots[1])
                # (key's entry: lane key - 32 u's entry u)
                row, ok = row_source(*rows, cute.arch.shuffle_sync(src, key - 32 * u))
                if const_expr(more is not None):  # (no block to load ahead: no read)
                    ok = cutlass.select_(more, ok, Int32(0))
                for d in cutlass.range_constexpr(4):
                    if const_expr(self.pair):  # (values 8 q and 32 + 8 q of 64: whole sectors)
                        words.append([w for at in sector_load_offsets(h, d, q, row)
                                      for w in ldg_or_zero(2, at, ok, L1_EVICT, L2_PREFETCH)])
                    else:
                        words.append(ldg_or_zero(4, row + 256 * h + 64 * d + 16 * q, ok,
                                                 L1_EVICT, L2_PREFETCH))
                scales.append(ldg_or_zero(2, row + FP8_DS_MLA_SCALES_AT + 8 * h, ok, L1_EVICT))
        return words, scales

    @cute.jit
    def _fill(self, rows, slots, s, h: cutlass.Constexpr[int], barK, parity, warp, loaded):
        """Half h of buffer s (a runtime index) from the 64 keys whose slots the lanes hold (keys
        lane and lane + 32), once the consumers released it. The 656-byte rows: this thread's
        chunks and scales are already loaded (`loaded`: _load, issued before the wait); it stores
        each value times its scale, rounded to bf16 (ptx.e4m3_store16), to its swizzled place
        (token_store_offsets; with pair sector_store_offsets). Over half 1 the bf16 rope tile
        by cp.async (gather16, the four warps sharing its rows; with rope_early issued already,
        at the block's start). The 16-bit cache: the half's tiles by cp.async once released. Warp
        0 writes buffer s's bias row with half 0. Every thread then fences its writes for the
        async proxy (where producer_fences, never here) and arrives on the half's tile mbarrier
        (cp.async.mbarrier.arrive makes it wait for the copies too)."""
        lane = cute.arch.lane_idx()
        buf = self.d_k_base.toint() + s * (PAGE_SIZE * D_QK * 2)
        words, scales = loaded
        bit = 2 * s + h
        self._stamp(f"d_wait{h}", 256)  # (trace: this half's loads issued, its wait begins)
        # (with pair the peer's consumers release it too: _wait_half's acquire at SCOPE)
        rope_first = self.cache == "fp8_ds_mla" and h == 1 and not self.rope_early
        self._take_half(bit, parity)
        self._stamp(f"d_free{h}", 256)  # (trace: half h free)
        if const_expr(h == 0):
            self._half0_bias(s, slots, warp)
        if const_expr(rope_first):  # (its DRAM latency under the conversion)
            self.rope_tile(rows, slots, buf, warp)
        bar = barK + s * N_TILES + 4 * h
        if const_expr(self.cache == "fp8_ds_mla"):
            peer = None
            if const_expr(self.pair):  # (the peer's places)
                other = 1 - cute.arch.block_idx_in_cluster()
                peer = (mapa_shared(buf, other) - buf, mapa_shared(bar.toint(), other))
            for i in cutlass.range_constexpr(self._rounds()):
                key, q = token_of_lane(warp, lane, self._round(i))
                for d in cutlass.range_constexpr(4):
                    places = sector_store_offsets if self.pair else token_store_offsets
                    d0, d1 = places(h, d, key, q)
                    e4m3_store16(buf + d0, buf + d1, words[4 * i + d], True,
                                 scales[i][d // 2], early=True, peer=peer)
        self._copy_and_arrive(rows, slots, buf, h, bar, warp, PEER_BYTES if self.pair else 0,
                              rope_issued=rope_first or self.rope_early)
        self._stamp(f"d_filled{h}", 256)  # (trace: half h stored, arrived on)

    def _rounds(self) -> int:
        """Rounds of 32 keys a producer thread converts a buffer half (token_of_lane's u): 2,
        or with pair 1 (the peer converts the other)."""
        return 1 if self.pair else 2

    def _round(self, i: int):
        """Round i's u: i, or with pair this CTA's rank in the cluster (keys 32 rank ..)."""
        return cute.arch.block_idx_in_cluster() if self.pair else i

    @cute.jit
    def _release(self, s: cutlass.Constexpr[int], h: cutlass.Constexpr[int], wtid):
        """Half h of buffer s to the producer: one elected lane of the warpgroup's warp 0."""
        if wtid < 32:
            with cute.arch.elect_one():
                self._free(2 * s + h)

    @cute.jit
    def _release_read(self, b, hi, s: cutlass.Constexpr[int], h: cutlass.Constexpr[int], wtid):
        """Half h of buffer s, read by block b of the segment [lo, hi), back to the producer
        unless b is one of the segment's last two blocks, whose buffers the epilogue stages O
        in (the next segment's start releases them: the base class's _load_tiles)."""
        if b + 2 < hi:
            self._release(s, h, wtid)

    @cute.jit
    def _stage_and_store(self, acc_O, inv, k_base, out_dtype: cutlass.Constexpr, gOut,
                         m_block, valid_rows, r0, c0, wg, wtid):
        """The dense kernel's epilogue store (O staged in the page buffers, bulk copies), or
        with epi_copy the same staging copied out by the threads (_stage_and_copy)."""
        if const_expr(self.epi_copy):
            self._stage_and_copy(acc_O, inv, k_base, out_dtype, gOut, m_block, valid_rows, r0,
                                 c0, wg, wtid)
        else:
            MLASparseDecodeSm90Producer._stage_and_store(
                self, acc_O, inv, k_base, out_dtype, gOut, m_block, valid_rows, r0, c0, wg,
                wtid)

    @cute.jit
    def _stage_and_copy(self, acc_O, inv, k_base, out_dtype: cutlass.Constexpr, gOut, m_block,
                        valid_rows, r0, c0, wg, wtid):
        """EPI_COPY: O staged as by default (_stage_o), then rows [0, valid_rows) of the
        warpgroup's 64 x 256 copied to gOut[m_block * 64 + row, 256 wg:] by its 128 threads, 16
        bytes a lane a step: chunk i of the region is row i // per_row, bytes 16 (i % per_row)
        of it, so a warp reads 512 contiguous bytes of a staged row (no bank conflict) and
        writes 512 contiguous bytes of the output row. No wait after: the reads come before the
        next segment's consumer barrier and release of these buffers in program order. The loop
        has the same trip count in every thread (a predicated body), so ptxas keeps its proof
        that the walk is warp-convergent (splitkv.empty_segment's reason)."""
        nbytes = out_dtype.width // 8
        per_row = HALF_V * nbytes // 16  # 16-byte chunks of a row: 64 (fp32) or 32 (16-bit)
        base = self._stage_o(acc_O, inv, k_base, out_dtype, r0, c0, wg)
        self._stamp(7)
        src0 = base.toint()
        total = valid_rows * per_row
        for j in cutlass.range((total + 127) // 128, unroll=4):
            i = j * 128 + wtid
            if i < total:
                row = i // per_row
                col = (i % per_row) * 16
                words = lds128(src0 + row * (STAGE_STRIDE * nbytes) + col)
                dst = gOut.iterator + cute.crd2idx((m_block * BLOCK_M + row, wg * HALF_V),
                                                   gOut.layout)
                stg_b32x4(dst.toint() + col, words)
        self._stamp(8)

    @cute.jit
    def _wg0_block(self, b, lo, hi, s: cutlass.Constexpr[int], border, min_border, acc_S,
                   acc_O, rP, row_sum, tSrQ, tSrK, tOrV, st_P, sP0, sM, sScale0, barK, phase,
                   r0, c0, wtid, scale_log2):
        """WG0, block b of [lo, hi) in buffer s: S, the softmax, P and its scale to WG1, P V for
        O's left half (NB_P arrived right after it is issued, as FlashMLA's WG0 does, so it
        reaches the tensor pipe before WG1's); then half 0 of the buffer goes back to the
        producer."""
        self._stamp("block", 0, b - lo)  # (trace point: WG0 starts block b)
        self._qk(acc_S, tSrQ, tSrK, None, None, barK, phase, s, tuple(range(N_TILES)))
        warpgroup.wait_group(0)
        self._stamp("d_s", 0, b - lo)  # (trace: S landed)
        if const_expr(self.rope_early):  # (only S reads the rope tile: ROPE_EARLY)
            if b + 2 < hi:
                if wtid < 32:
                    with cute.arch.elect_one():
                        self._release_rope(s)
        fence_operand(acc_S)
        self._mask(acc_S, b, border, min_border, c0, s)
        m_new, m_use, scale = self._softmax_stats(acc_S, sM, r0, scale_log2)
        cute.arch.sync_warp()  # (the quad read sM: now one lane writes it)
        if wtid % 4 == 0:
            for h in cutlass.range_constexpr(2):
                sM[r0 + 8 * h] = m_new[h]
        # (and the quad's next read of sM after that write: no barrier orders them between a
        # segment's first two blocks, where WG0 does not wait for NB_FREE)
        cute.arch.sync_warp()
        softmax.scale_rows(acc_O, scale)
        self._exp_rows(acc_S, m_use, scale_log2, row_sum, scale)
        self._to_P(acc_S, rP, [Float32(1.0), Float32(1.0)])
        self._stamp("d_softmax", 0, b - lo)  # (trace: P in registers)
        if b > lo:  # WG1 is done with the previous block's P and scale
            cute.arch.barrier(barrier_id=NB_FREE, number_of_threads=256)
        self._stamp("d_nbfree", 0, b - lo)  # (trace: NB_FREE passed)
        if wtid % 4 == 0:
            for h in cutlass.range_constexpr(2):
                sScale0[r0 + 8 * h] = scale[h]
        self._store_P(st_P, rP, sP0)
        # (V: half 0, which this warpgroup waited for and fenced after its wait: no fence here)
        self._pv(self.d_tiled_pv_rs, acc_O, rP, tOrV[s][0], True, fence=False)
        cute.arch.barrier_arrive(barrier_id=NB_P, number_of_threads=256)
        self._stamp("d_pv", 0, b - lo)  # (trace: P V issued, NB_P arrived)
        warpgroup.wait_group(0)
        fence_operand(acc_O)
        self._release_read(b, hi, s, 0, wtid)
        self._stamp("d_done", 0, b - lo)  # (trace: P V landed, half 0 released)

    @cute.jit
    def _wg1_block(self, b, lo, hi, s: cutlass.Constexpr[int], acc_O, tOrV, tOrP0s, sScale0,
                   r0, wtid):
        """WG1, block b of [lo, hi) in buffer s: O's right half rescaled, += P V; then half 1
        of the buffer goes back to the producer."""
        cute.arch.barrier(barrier_id=NB_P, number_of_threads=256)
        self._stamp("d_w1_p", 128, b - lo)  # (trace: NB_P passed)
        softmax.scale_rows(acc_O, [sScale0[r0], sScale0[r0 + 8]])
        self._pv(self.d_tiled_pv_ss, acc_O, tOrP0s, tOrV[s][1], False)
        self._stamp("d_w1_pv", 128, b - lo)  # (trace: P V issued)
        warpgroup.wait_group(0)
        fence_operand(acc_O)
        self._stamp("d_w1_landed", 128, b - lo)  # (trace: P V landed)
        if b + 1 < hi:
            cute.arch.barrier_arrive(barrier_id=NB_FREE, number_of_threads=256)
        self._release_read(b, hi, s, 1, wtid)
        self._stamp("d_w1_done", 128, b - lo)  # (trace: half 1 released)

    @cute.jit
    def _split_blocks(self, wg, n, lo, hi, border, min_border, acc_S, acc_O, rP, row_sum,
                      tSrQ, tSrK, tOrV, tOrP0s, st_P, sP0, sM, sScale0, barK, phase, r0, c0,
                      wtid, scale_log2):
        """A segment's blocks [lo, hi) (n of them, the first two already released to the
        producer at the segment's start), two a loop step so that each block's buffer is a
        compile-time index; the second only where it exists (two inlined block sites, not
        three: less code to fetch)."""
        if const_expr(wg == 0):  # (wg: this copy's constant, MLADecodeSm90.body)
            block = partial(self._wg0_block, lo=lo, hi=hi, border=border,
                            min_border=min_border, acc_S=acc_S, acc_O=acc_O, rP=rP,
                            row_sum=row_sum, tSrQ=tSrQ, tSrK=tSrK, tOrV=tOrV, st_P=st_P,
                            sP0=sP0, sM=sM, sScale0=sScale0, barK=barK, phase=phase, r0=r0,
                            c0=c0, wtid=wtid, scale_log2=scale_log2)
        else:
            block = partial(self._wg1_block, lo=lo, hi=hi, acc_O=acc_O, tOrV=tOrV, tOrP0s=tOrP0s,
                            sScale0=sScale0, r0=r0, wtid=wtid)
        for i in cutlass.range((n + 1) // 2, unroll=1):
            block(lo + 2 * i, s=0)
            if lo + 2 * i + 1 < hi:
                block(lo + 2 * i + 1, s=1)
        # (trace points: WG0's, WG1's loop done, MLADecodeSm90._stamp's 3 and 4)
        if const_expr(wg == 0):
            self._stamp(3)
        else:
            self._stamp(4, 128)


# --- compile entry (ops/registry.py: SparseStepConfig, backend "sm90_split") -------------------


def compile_sparse_step(config, arch: str):
    """The SM90 sparse decode step with FlashMLA's warpgroup split (dtype, cache format; columns
    128: the cluster pair), compiled for arch (sm_90a)."""
    from ..contract import compile_sparse_step_kernel, dsl_dtype

    dtype = dsl_dtype(config.dtype)
    decode = MLASparseDecodeSm90Split(dtype, config.cache, pair=config.columns > 0,
                                      short=config.short)
    return compile_sparse_step_kernel(
        MLASparseDecodeStep(decode, dtype, use_pdl=True),
        dtype, arch, config.cache)
