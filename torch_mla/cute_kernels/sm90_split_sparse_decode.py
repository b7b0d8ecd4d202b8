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
two 8-byte pieces, SECTORS), with one row address and one load of the half's two group scales
a key; all of them load before the release.

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
waiting for a half fences for the async proxy before its MMAs read it (half_has_copies; with
FENCE 0 too); that fence serves the producer's own stores as well, so with the pair the producer
does not fence before it arrives (PFENCE 0, session 32: -5% at b 128 h_q 128; without the
pair either since session 38, PFENCE 2: -1.6% at b 128 h_q 64). The releases to the peer and
the waits they complete (the producer's for a free half, WG0's for a filled one) are at CTA
scope since session 41, as CUTLASS's cluster pipelines and FlashMLA's pair have them; until
then they were cluster-scoped (ptx.mbarrier_wait_cluster), the PTX memory model's letter, which
session 30's review had asked for. CTA scope relies on what CUTLASS's and FlashMLA's pairs rely
on, not on that letter (SCOPE: the knob and what it orders).

Status: run on an H100 (sessions 28-30): the GPU tests of the kernel pass (114 in session
30), memcheck clean at h_q 16 and 100 over the 656-byte rows. Session 30 (c7ee36a, the
rewritten producer): at or below the heads-on-M kernel on every row of the 656-byte A/B
(b 128 s_q 1 h_q 64: 162.1 against 164.4 us; h_q 128: 277.6 against 299.6; b 32 h_q 64: 64.2
against 92.8), FlashMLA 129.2 / 184.1 in the same start. Later in session 30 (563a9a8): the
pair passed the split's GPU tests and memcheck (h_q 100) and took b 128 h_q 128 from 277.2 to
260.9 us; L2_PREFETCH 256 with FENCE 0 did nothing alone (164.1 against 162.1 at h_q 64), with
L1_EVICT evict_last 145.5 (FlashMLA 128.8): the defaults since 77c7264.
Session 31 (3e0fb34, H100): the loads ahead (AHEAD_PAIR 2) gained nothing at h_q 128 (258.5
against 256.7 us; FlashMLA 184.2); with every entry -1 the pair takes 227.6 us against 189.1
for one CTA an m-block (FlashMLA 146.2), and ncu finds its cluster-scope acquires compiled to
L1 invalidations (CCTL.IVALL): SCOPE's comment.
Session 32 (H100, same start as FlashMLA): without the producer's fences (PFENCE 0, the default
in sessions 32-37; PFENCE 2 since session 38) b 128 h_q 128 took 244.1 us against 256.2
(FlashMLA 184.3); CTA-scope waits (SCOPE cta) 1% less again with random entries (241.2), 10%
with nothing read (205.2 against 227.6), but the cluster scope stays: it is the memory model's
letter, and 1% does not decide the gap. The split's GPU tests passed at CTA scope (110) and,
at cluster scope (the default), its FP8 cases (29: every case the pair runs); memcheck (h_q 100
and 128) ran at CTA scope: clean.
Session 34 (H100): a per-block trace (tools/trace_sparse.py) found WG0 waiting 1.2-1.7 us a
block for half 1, ending ~1 us after the producer's thread 256 had arrived (the rope gather was
issued after the conversion): ROPE_FIRST (the default since) took b 128 h_q 128 from 242.0 to
238.1 us and h_q 64 from 146.5 to 140.0; ENTRY_LEN 1 (the producer's length read once a
segment) measured 228.0 and 134.3 but is not yet the default (its GPU tests did not run); the
pair's one-half lookahead (AHEAD_PAIR 1) was slower (251 us).
Session 35 (H100): ENTRY_LEN 1 passed the GPU tests and memcheck (the default since); with the
pair, both halves' loads of a block issued before the wait for half 0 (LOAD_BLOCK 1, the default
since) took b 128 h_q 128 from 228.5 to 219.6 us (FlashMLA 184.5); without the pair they were
slower (h_q 64), so only the pair does it.
The dispatch takes it in the SM90 sparse kernel's place at 64-128 heads over the 656-byte rows
and, since session 39, over the 16-bit cache (TORCH_MLA_SPARSE_PRODUCER=0: the SM90 kernel
itself; =split: wherever the SM90 kernel runs); the pair at h_q 65-128 over the 656-byte rows
unless TORCH_MLA_SPARSE_SPLIT_PAIR=0.
Session 41 (H200): at CTA scope the pair's producer loads the next block's chunks before it
converts this block's (AHEAD_PAIR 2): b 128 h_q 128 197.2-197.5 us against 215.6-216.0 with
the old defaults (FlashMLA 179.5-179.7), -6 to -8.5% at b 32 and 128, +1-2.4% at b 2; the
defaults since (AHEAD_PAIR's comment).
Session 43 (H100): with nothing read the pair's exchange cost its chain ~40 us at b 128 h_q 128
(192 against 152 without it; FlashMLA 147), mostly its stores' layout: each st.async wrote half
of 32 sectors. With the pair each thread now loads a key's values 8 q and 32 + 8 q of each 64
(SECTORS, the default since), so a store instruction writes whole sectors: 188.0 against 201.5
us at b 128 h_q 128 (FlashMLA 183.6), 359.8 against 388.9 at s_q 2; its GPU tests (123),
memcheck and FlashMLA's 246 sparse-decode cases through compat passed.
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
    bulk_s2cluster,
    e4m3_store16,
    ldg_or_zero,
    lds128,
    mapa_shared,
    mbarrier_wait_cluster,
    pack16x2,
    stg_b32,
    stg_b32x4,
    stg_f32x2,
    sts,
)
from .sm80_sparse_decode import MLASparseDecodeStep
from .sm90_decode import BLOCK_M, HALF_V, N_TILES, NB_P0, NB_SCALE1, STAGE_STRIDE, fence_operand
from .sm90_producer_sparse_decode import MLASparseDecodeSm90Producer
from .sm90_sparse_decode import TILE16, request_length, row_source


def _dev_knob(name: str, default, allowed: tuple):
    """Developer knob TORCH_MLA_DEV_SPLIT_<name>, read at import: one of `allowed` (their type),
    default when unset or empty."""
    raw = os.environ.get(f"TORCH_MLA_DEV_SPLIT_{name}") or ""
    value = type(default)(raw) if raw else default
    if value not in allowed:
        raise ValueError(f"TORCH_MLA_DEV_SPLIT_{name} takes one of {allowed}, not {raw!r}")
    return value


REGS = (128, 216, 160)  # (producer, WG0, WG1) registers a thread after setmaxnreg
# Buffer halves whose fp8 chunks the producer has in flight while it converts one (the
# 656-byte rows): 0 loads each half just before its own wait (one load latency a half exposed);
# 1 issues the next half's loads (the next block's half 0 across blocks) before converting this
# one; 2 a whole block ahead (the next block's two halves before converting this block's). The
# registers: a half's chunks are 18 a thread with pair, 36 without (2 without the pair holds
# ~144 words against the producer's 128 registers: ptxas spills 760 bytes). Session 29's EARLY 2
# (both halves of a block loaded at its start) was 2-5% slower than 0 and is gone.
# TORCH_MLA_DEV_SPLIT_AHEAD (one CTA an m-block) and TORCH_MLA_DEV_SPLIT_AHEAD_PAIR (the cluster
# pair) set it at import, developer knobs for the A/B (the cache key holds the knobs that are
# set since session 41; before, each build needed its own TORCH_MLA_CACHE_DIR).
# AHEAD_PAIR 2 is the default since session 41, with SCOPE "cta" (below): at cluster scope the
# pair's release chain bound the block and no load ahead could show (session 31: +0.7%); at CTA
# scope the pair's producers bind (session 40's trace: ~1.2 us a block waiting for half 0's
# chunks). Session 41 (H200, same start, two rounds, us; D the old defaults, C SCOPE cta alone,
# CA1 / CA2 C with AHEAD_PAIR 1 / 2; FlashMLA): 128,1,128 215.6 / 216.0, 212.8 / 212.4, 240.7 /
# 240.5, 197.5 / 197.2, FlashMLA 179.5 / 179.7; 128,2,128 417.2 / 417.8, 409.1 / 408.3, 467.8 /
# 467.9, 384.0 / 385.1, FlashMLA 352.7 / 353.6; 32,1,128 77.5 / 77.5, 78.1 / 78.2, 86.3 / 86.1,
# 72.9 / 72.6, FlashMLA 64.5 / 64.6. At b 2 CA2 is 1-2.4% slower (2,1,128 25.2 / 25.2 against
# 24.5 / 24.7; weak evidence: at 2,2,64, one kernel in both builds, they differed by 1.5%). The
# split's GPU tests (122), memcheck at h_q 100 and 64, and FlashMLA's own sparse-decode cases
# through torch_mla.compat passed on CA2 (246; the 38 at page size 64 ran this kernel, 21 of
# them the pair; the others, pages of 2-576 tokens, the reference).
AHEAD = _dev_knob("AHEAD", 0, (0, 1, 2))
AHEAD_PAIR = _dev_knob("AHEAD_PAIR", 2, (0, 1, 2))
# O_DIRECT 1 (developer knob TORCH_MLA_DEV_SPLIT_O_DIRECT): the epilogue writes O from the
# accumulators straight to global memory (st.global, 8 bytes a lane over the fp32 partials, 4
# over the output) instead of staging it in the page buffers for bulk copies, so the buffers are
# the producer's across a segment's end: every block releases its halves once read (a
# segment's last two too), the producer's first wait on each half passes at once (its parity
# starts at 1, the phase before a fresh mbarrier's first), and no segment start releases
# anything. The producer then fills the next segment's first two blocks during the epilogue.
# Session 42 (H100, same start, two rounds, us, D the defaults / O_DIRECT 1 / FlashMLA):
# 128,1,128 201.2, 200.8 / 208.9, 208.9 / 183.2, 183.0; 32,1,128 75.7, 75.9 / 74.8, 75.0; 2,1,128
# 26.7, 26.7 / 27.2, 27.2; 128,1,64 131.9, 131.8 / 136.1, 137.0; 2,1,64 22.6, 22.6 / 21.9, 22.2.
# Predicted -1 to -2% at b 128: +3.5 to +4% instead. Its trace: a later segment's block 0 is
# filled 0.45 us before the segment starts (1.89 after it with staging), but the epilogue takes
# 5.7 us (3.1 staged) and the first segment's 7.6 (3.7): 64 st.global a thread, each a warp's
# 8 rows of 32 bytes (fp32 partials; 16 over the output), cost more than the refill saves.
# Its GPU tests (123) and memcheck passed. Not the default. (Session 41's FIRST_LATE, the
# first block converted before the next one's loads, measured 3-9% slower on every row on an
# H100, session 42, and is gone.)
O_DIRECT = _dev_knob("O_DIRECT", 0, (0, 1))
# EPI_COPY 1 (developer knob TORCH_MLA_DEV_SPLIT_EPI_COPY; on in the short build: its comment
# below ENTRY_EARLY):
# O staged in the page buffers as by default, then copied out by the warpgroup's threads, 16
# bytes a lane (ld.shared.v4, st.global.v4: a warp writes 512 contiguous bytes an instruction),
# in place of a bulk copy a row (1 KB of fp32 partials, 512 B of output) and the wait for the
# bulk engine to read them. The 2,1,128 trace of session 45: 2.6 us of a 3.8 us epilogue
# waiting for 64 bulk copies a warpgroup to read 128 KB a CTA (~49 GB/s an SM). The threads
# need no such wait: their ld.shared reads come before the next segment's consumer barrier and
# release in program order, as every other read of the buffers does. O_DIRECT takes
# precedence. Predicted (session 45): -0.5 to -1.5 us at b 2, within 1% at b 32 and 128.
# Measured (session 46, H100, same start as FlashMLA, two rounds, us, defaults / EPI_COPY 1):
# 2,1,128 24.8, 24.9 / 24.0, 24.0; 2,1,64 22.9, 22.8 / 21.9, 21.9; but 2,2,128 27.7, 27.7 /
# 28.4, 28.5, 2,2,64 25.9, 26.0 / 26.4, 26.4; 32,1,128 70.8, 71.0 / 76.8, 76.6; 128,1,128
# 185.6, 186.2 / 202.8, 202.4 (8-9% slower at h_q 128 from b 32, more than the epilogues'
# count can cost: 16 blocks a part at 32,1,128, the blocks' code slower, not measured why);
# 128,1,64 131.9, 131.8 / 133.1, 133.1. Alone, not a default; see the short build's comment
# below ENTRY_EARLY.
EPI_COPY = _dev_knob("EPI_COPY", 0, (0, 1))
# META_EARLY 1 (developer knob TORCH_MLA_DEV_SPLIT_META_EARLY; on in the short build): the
# part's metadata row is loaded before the prologue's mbarrier setup, __syncthreads and (with
# the pair) the cluster sync, not after them (MLADecodeSm90.meta_early). The 2,1,128 trace of
# session 45: the segment is known 1.7 us after the post-sync start stamp (the metadata, then
# the request's length: two dependent loads). Predicted (session 45): 0 to -0.3 us at b 2, b 32
# and 128 within 0.5%. Measured (session 46, H100, same start, two rounds, us, 0 / 1): 2,1,128
# 24.8, 24.9 / 24.4, 24.4; 2,2,64 25.9, 26.0 / 25.9, 25.4; 32,1,128 70.8, 71.0 / 70.5, 70.4;
# 128,1,128 185.6, 186.2 / 186.3, 185.8; 128,1,64 131.9, 131.8 / 131.3, 131.5; no row slower
# by more than 0.4%. Only its smoke cases ran on the default build with it, so it is on in the
# short build (whose build passed the split's GPU tests and memcheck) and off by default.
META_EARLY = _dev_knob("META_EARLY", 0, (0, 1))
# Developer knobs of the session-30 A/B (in the cache key when set, as above):
# L2 prefetch size of the producer's fp8 loads (0: none; 256: FlashMLA's), their L1 eviction
# priority, and FENCE 0: WG0 skips the async-proxy fences its tiles do not need over the
# 656-byte rows (half 0 is written and fenced by the producer itself; P V reads half 0): only
# where the producer fences (PFENCE 0 without the pair, or 1); with PFENCE 2, the default, WG0
# fences half 0 after its wait.
# The defaults (L2 256, evict_last, FENCE 0) measured fastest (session 30's A/B: b 128 s_q 1
# h_q 64 145.5 us against 162.1 with none of them; L2 256 and FENCE 0 alone 164.1).
L2_PREFETCH = int(os.environ.get("TORCH_MLA_DEV_SPLIT_L2", "256"))
L1_EVICT = os.environ.get("TORCH_MLA_DEV_SPLIT_L1", "evict_last")
FENCE = int(os.environ.get("TORCH_MLA_DEV_SPLIT_FENCE", "0"))
# The scope of the pair's cross-CTA synchronisation: "cta" (the default since session 41, with
# AHEAD_PAIR 2: the releases to the peer and the waits they complete at CTA scope, as CUTLASS's
# cluster pipelines do, whose remote mbarrier.arrive.shared::cluster takes PTX's default
# .release.cta and whose waits acquire at CTA scope, and as FlashMLA's pair does) or "cluster"
# (the default until session 40: the PTX memory model's letter, the releases cluster-scoped and
# the waits they complete acquiring at cluster scope). Two hand-offs cross the CTAs: a release
# to the peer (after this CTA's wgmma reads of a half completed at their wait_group, or at a
# segment's start after the epilogue's bulk copies read the staged O) before the peer's
# st.async into the half; and the peer's st.async bytes, whose complete_tx on this CTA's
# mbarrier the PTX manual makes a cluster-scope release, before WG0's CTA-scope acquire. CTA
# scope relies on what CUTLASS's and FlashMLA's pairs rely on for both (TMA multicast lands the
# same way under CUTLASS's CTA-scope waits), not on the memory model's letter; tests, memcheck
# and bit-identical repeats cannot prove an ordering, only fail to find a race.
# Session 31's ncu of the pair (b 128 h_q 128): each cluster-scope
# acquire becomes a CCTL.IVALL (the whole L1 invalidated, the evict_last lines with it), the
# releases ERRBAR; 9.2% and ~2.4% of the warp samples. Session 32 (H100, same start, PFENCE 1):
# with every entry -1 228.2 us at cluster scope, 207.7 at cta (FlashMLA 147.3); random entries
# 257.7 / 256.8 against 253.4 / 256.2; with PFENCE 0 (another start) 243.9 / 244.3 against
# 241.4 / 241.0. TORCH_MLA_DEV_SPLIT_SCOPE (developer knob) picks
# it for an A/B.
SCOPE = _dev_knob("SCOPE", "cta", ("cluster", "cta"))
# PFENCE 0 (the default in sessions 32-37; developer knob TORCH_MLA_DEV_SPLIT_PFENCE, its own
# cache directory): with pair the producer skips its fence for the async proxy before it
# arrives on a tile mbarrier. Every reader of a half fences after its own wait there (WG0 after
# the tile wait, half_has_copies; WG1 before its P V, the fence of _pv), as it must for the
# peer's st.async writes anyway. The producer's two fences a block held 2.0% and 1.1% of the warp
# samples with nothing read (session 31's ncu of the pair). Session 32 (H100, same start as
# FlashMLA): b 128 s_q 1 h_q 128 243.9 / 244.3 us with PFENCE 0 against 256.1 / 256.3 with 1 at
# cluster scope (FlashMLA 183.7 / 184.9); at CTA scope, in another start, 240.2 / 241.6 against
# the one-CTA-lookahead build's 255.2 / 255.1 (the lookahead does not touch the pair).
# PFENCE 2 (the default since session 38; 0: the producer fences without the pair only, 1:
# always): without the pair too, the producer skips its fences and WG0 fences half 0 after its
# tile wait (half_has_copies), as with the pair. The producer's fence.proxy.async compiles to
# MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S (nvdisasm of the h_q 64 build), and the MEMBAR waits for
# the thread's loads in flight: half 0's arrival then waits for half 1's chunks (issued before
# it) to land. Session 38 (H100, same start as FlashMLA, two rounds, us; PFENCE 0 / 2 /
# FlashMLA): 128,1,64 134.9 / 132.8 / 130.0, 128,2,64 252.0 / 247.9 / 246.6, 32,1,64 61.0 /
# 60.7 / 58.7; the pair's rows the same (128,1,128 219.8 / 220.3). The split's GPU tests (122)
# and memcheck (h_q 100, 64) passed on PFENCE 2 with LOAD_PIN 1 (that knob, since removed,
# changed only the free wait's parity operand: parity ^ 0, and only over the 656-byte rows, so
# that run's 16-bit-cache cases are this build's); PFENCE 2 alone passed the A/B's 7 smoke cases,
# 2 of them without the pair (the fp8 grid at 64-1-2048, the entry kinds at 100 heads).
PFENCE = _dev_knob("PFENCE", 2, (0, 1, 2))
# (Session 39's PAIR_FREE "buffer", FlashMLA's one release a buffer with one producer wait a
# block, and ROPE_PAIR 1, the rope rows exchanged between the pair through st.async, measured
# 2-5% slower with random entries in session 40 (H100; with CTA scope together, F, within 1% of
# the defaults at b 128, 2.5% slower at b 32) and are gone: docs/kernel-notes.md, session 40.)
# ROPE_EARLY 1 (developer knob TORCH_MLA_DEV_SPLIT_ROPE_EARLY; the
# 656-byte rows without the pair): the rope tile gets its own "empty" mbarrier a buffer
# (barE[4 + s], one arrival), released by WG0 once its S of the buffer's block landed (only S
# reads the rope tile), so the producer issues a block's rope gather at the block's start, before
# half 0's wait, not once half 1 is free (ROPE_FIRST). Session 40 (H100, same start, two rounds):
# 128,1,64 131.2 us against 132.2, 128,2,64 245.9 against 248.2 (FlashMLA 129.6, 245.7); with the
# pair (the build took it then) +7.6% at cluster scope and +0.2% at CTA scope, hence without the
# pair only. The split's fp8 tests passed on it (32); memcheck not yet run, so not the default.
ROPE_EARLY = _dev_knob("ROPE_EARLY", 0, (0, 1))
# PVFENCE 0 (the default since session 33; developer knob TORCH_MLA_DEV_SPLIT_PVFENCE, its own
# cache directory): with pair WG0 skips its fence for the async proxy before its P V, which
# reads only half 0: WG0 fenced that half after its own wait for it (half_has_copies), as
# FENCE 0 reasons without the pair.
PVFENCE = _dev_knob("PVFENCE", 0, (0, 1))
# PARRIVE (developer knob TORCH_MLA_DEV_SPLIT_PARRIVE; default "late"
# since session 33): when WG0 tells WG1 that P and its scale are in shared memory (NB_P).
# "early": before WG0 issues its own P V; "late": right after it, as FlashMLA's WG0 does, so
# WG0's P V reaches the tensor pipe before WG1's. Session 33 (H100, same start, two rounds):
# the two together (VL) 241.6 / 242.0 us at b 128 s_q 1 h_q 128 against 244.2 / 244.0, 466.7 /
# 468.0 against 470.2 / 469.7 at s_q 2; the h_q 64 rows (no pair: PVFENCE does not apply)
# unchanged within 0.6%.
PARRIVE = _dev_knob("PARRIVE", "late", ("early", "late"))
# PIPE 1 (developer knob TORCH_MLA_DEV_SPLIT_PIPE; default 0): WG0
# queues block b + 1's Q K^T right behind its own P V of block b (its buffer half 0's tiles,
# then, once that P V is done and block b's half 0 released, the other half's), as the dense
# kernel's seesaw does; FlashMLA's sparse WG0 does not. Session 33 (same start as above):
# slower everywhere, 254.7-256.6 us at b 128 h_q 128 against 244.1 (B0) and 241.8 (VL), 147.4-
# 147.9 against ~146.1 at h_q 64, 25.2-25.6 against ~23.4 at b 2 h_q 64. Likely why (not
# measured): the next S enters the tensor pipe ahead of WG1's P V of the same block, which
# WG0's next NB_FREE then waits for. Correct (the split's GPU tests and memcheck passed with it).
PIPE = _dev_knob("PIPE", 0, (0, 1))
# ROPE_FIRST 1 (developer knob TORCH_MLA_DEV_SPLIT_ROPE_FIRST): over
# the 656-byte rows the producer issues half 1's rope tile gather (cp.async) right after its
# wait for the free half, before it converts the half's fp8 values, so the gather's DRAM
# latency runs under the conversion; 0 issues it after the conversion (sessions 29-33). Session
# 34's trace (tools/trace_sparse.py, blocks 8-11, b 128 s_q 1, H100): WG0's wait for half 1
# ended ~1 us after the producer's thread 256 had arrived on it (h_q 128 pair: 1377 ns into
# WG0's block against 394; h_q 64: 1922 against 986), of a ~3.9 us block. Measured (H100, same
# start as FlashMLA, two rounds): b 128 s_q 1 h_q 128 238.0 / 238.2 us against 242.0 / 242.0,
# h_q 64 139.9 / 140.1 against 146.5 / 146.4; every row faster or the same. The default since
# (the split's GPU tests and memcheck at h_q 100 and 64 passed on it). An L2 prefetch of the
# rope lines with half 0's loads on top of it changed nothing (238.8 / 238.5 against 239.4 /
# 239.2) and is not kept.
ROPE_FIRST = _dev_knob("ROPE_FIRST", 1, (0, 1))
# ENTRY_LEN 1 (developer knob TORCH_MLA_DEV_SPLIT_ENTRY_LEN): the
# producer reads its request's topk_length once a segment, where block_entries reads it with
# every block, a load whose result a branch needs before the block's entries load: a round trip
# at the start of each of the producer's blocks (at both head counts; the pair's cluster-scope
# waits also invalidate the L1 every block). Session 34's trace put ~0.78 us between the
# producer's block start and the end of its half 0 load issue at h_q 128 (pair), ~0.74 at h_q
# 64. Measured (H100, same start as FlashMLA, two rounds): b 128 s_q 1 h_q 128 228.0 / 227.9 us
# against 238.6 / 238.8, h_q 64 134.3 / 134.3 against 139.9 / 139.4, every row faster; session
# 35 (another start) 230.1 / 228.2 against 239.2 / 240.3 and 135.5 / 135.7 against 140.7 /
# 140.9. The default since session 35, whose run passed the split's GPU tests (111) and memcheck
# at h_q 100 and 64 on it.
ENTRY_LEN = _dev_knob("ENTRY_LEN", 1, (0, 1))
# ENTRY_EARLY 1 (developer knob TORCH_MLA_DEV_SPLIT_ENTRY_EARLY): the producer loads a segment's
# first block of entries before it reads the request's length and split count, at addresses
# clamped into the request's row (loads that cannot wait on the length), and applies the length
# afterwards. A segment's first block then needs one dependent DRAM round trip less before its
# rows can load (meta row -> length and entries at once -> rows); the later blocks' entries
# already load a block ahead. Session 43 (H100, same start): -0.6 us at 2,1,128 and -0.9 at
# 2,1,64, +0.7% at 128,1,128 and +6.6% at 128,1,64 (the pair-less build spills 16 / 48 bytes).
# Session 46 (H100, same start, two rounds, us, defaults / ENTRY_EARLY 1): 2,1,128 24.8, 24.9 /
# 23.8, 23.8; 2,1,64 22.9, 22.8 / 21.4, 21.3; 2,2,64 25.9, 26.0 / 24.8, 24.8; but 32,1,128
# 70.8, 71.0 / 75.4, 75.2, 128,1,128 185.6, 186.2 / 195.7, 195.8, 128,1,64 131.9, 131.8 /
# 139.8, 139.8 (at 2,2,128 27.7, 27.7 / 27.6, 27.6). Alone, not a default; see the short
# build's comment below.
ENTRY_EARLY = _dev_knob("ENTRY_EARLY", 0, (0, 1))
# ENTRY_EARLY2 1 (developer knob TORCH_MLA_DEV_SPLIT_ENTRY_EARLY2; session 46; on in the short
# build since session 47; where ENTRY_EARLY is on and the producer loads ahead, as with the
# pair): the segment's second block's entries loaded before the length too (the first
# block's where the segment has one). With a lookahead the producer issues block lo + 1's row
# loads before it converts block lo, so block lo's conversion waits on lo + 1's entries, which
# by default load only once the length has come (meta row -> length -> entries -> rows). The
# session-46 crossover: with the short build ours is 1.2 us behind FlashMLA at one block a
# part (2,1,128) and ~3 us from two (4,1,128 to 16,1,128). Session 47 (H100, same start as
# FlashMLA, two rounds, us, the short build / with ENTRY_EARLY2 / FlashMLA): 2,1,128 23.2, 22.9
# / 23.0, 22.8 / 21.7, 21.8; 2,2,128 26.9, 27.0 / 26.5, 26.4 / 23.8, 23.8; 4,1,128 27.3, 27.0 /
# 27.1, 26.8 / 24.3, 24.2; 8,1,128 34.5, 34.4 / 33.9, 33.8 / 31.8, 31.6 (32,1,128, the default
# build, which it leaves alone: 71.3, 70.8 / 71.1, 71.1). Its build passed the split's GPU tests
# (156) and memcheck (h_q 100 and 64).
ENTRY_EARLY2 = _dev_knob("ENTRY_EARLY2", 0, (0, 1))
# LIGHT 1 (developer knob TORCH_MLA_DEV_SPLIT_LIGHT, timing only: wrong values by construction;
# session 47): Q K^T issues one k-step of 16 of each 64-column tile and P V one of its four,
# a quarter of the MMAs (the FLOP a keys-on-M consumer at 16 columns would issue over the same
# producer). Session 47 (H100, same start, two rounds, us, defaults / LIGHT): 128,1,64 130.4,
# 130.7 / 123.1, 122.9; 128,2,64 244.5, 244.0 / 231.1, 230.5; 32,1,64 59.1, 58.8 / 57.4, 57.4;
# 2,1,64 21.6, 21.6 / 20.0, 20.2: the MMAs' issue does not bound the split at h_q 64
# (docs/kernels/sparse.md, session 47). Never a build the tests run (gpu_sparse.sh skips its
# smoke cases; do not name it first or TESTED in split_ab).
LIGHT = _dev_knob("LIGHT", 0, (0, 1))
# ROPE_AHEAD 1 (developer knob TORCH_MLA_DEV_SPLIT_ROPE_AHEAD; session 47, compiled, not yet run;
# with a lookahead, as with the pair, ROPE_FIRST 1 and O_DIRECT 0; elsewhere it does nothing):
# at a segment's start the consumers release both buffers at once (_load_tiles), so in its
# first step, once block lo + 1's row loads are issued, the producer waits for half 1 of the
# first two blocks' buffers and gathers their rope tiles (cp.async), instead of each after the
# block's half 0 conversion (ROPE_FIRST) and, for the second block, after the whole first
# block. Those two blocks' half-1 fills then skip their wait and their rope gather. Block lo's
# half-1 arrival (cp.async.mbarrier.arrive: all of the thread's earlier copies) then also
# waits for block lo + 1's rope, issued at about the same time. Session
# 46's reading beside FlashMLA (whose producer loads a block's rope with its chunks) and
# session 47's trace (2,1,128: WG0 has half 1 of block 0 1.0 us after half 0). Prediction:
# -0.3 to -0.8 us at 2,1,128, 2,2,128 and 4,1,128 in the short build; within 1% at b 32-128.
# ptxas on the CPU: the short pair build 168 registers, no spill; the default pair build 12 / 44
# bytes (as without it). The default and short builds' PTX unchanged (md5).
ROPE_AHEAD = _dev_knob("ROPE_AHEAD", 0, (0, 1))
# The short build (SparseStepConfig short=True; ops.sparse.split_short_parts picks it where a
# part holds few blocks): EPI_COPY, ENTRY_EARLY and META_EARLY on, and ENTRY_EARLY2 with the
# pair (since session 47: its comment). The first two alone are ~1
# us faster at b 2 s_q 1 and 5-9% slower from b 32 at h_q 128 (their comments: each figure);
# the three together (session 46, H100, same start as FlashMLA, two rounds, us, defaults / the
# three / FlashMLA): 2,1,128 24.8, 24.9 / 22.6, 22.7 / 21.7, 21.6; 2,2,128 27.7, 27.7 / 26.5,
# 26.7 / 23.7, 23.7; 2,1,64 22.9, 22.8 / 21.4, 21.7 / 24.2, 24.1; 2,2,64 25.9, 26.0 / 25.0,
# 25.1 / 24.2, 24.1; 32,1,128 70.8, 71.0 / 73.6, 73.7 / 67.1, 67.1; 128,1,128 185.6, 186.2 /
# 194.0, 193.2 / 183.7, 183.9; 128,1,64 131.9, 131.8 / 135.2, 134.9 / 130.1, 130.1: a build for
# short parts only. The three knobs' build passed the split's GPU tests (124) and memcheck
# (h_q 100 and 64); the short builds' PTX is that build's (md5, with the pair and without).
# The dispatch takes the short build over the 656-byte rows only, where it was measured.
# LOAD_BLOCK (developer knob TORCH_MLA_DEV_SPLIT_LOAD_BLOCK; with
# AHEAD / AHEAD_PAIR 0): 1 with the pair, 2 with and without it, the producer issues both
# halves' loads of a block before its wait for half 0, so half 1's load latency runs under half
# 0's conversion (FlashMLA's producer loads a whole block at once), holding 36 words a thread
# with the pair, 72 without (ptxas: no spill either way); 0 never.
# Session 34's trace (pair, b 128 h_q 128): each half's loads issued after the previous half's
# conversion, ~1 us of exposed latency a half. Session 35 (H100, same start as FlashMLA, two
# rounds, with ENTRY_LEN 1; LOAD_BLOCK 2 against 0): with the pair b 128 s_q 1 h_q 128 221.0 /
# 221.3 us against 230.1 / 228.2, s_q 2 424.5 / 422.6 against 438.8 / 439.5, b 32 80.4 / 81.1
# against 84.1 / 84.2; without it (h_q 64) slower, 140.1 / 140.4 against 135.5 / 135.7 and
# 261.3 / 261.9 against 252.2 / 252.3 at s_q 2 (twice the registers held, 72 words). Session
# 34's AHEAD_PAIR 1 (the next half's loads before this half's conversion, across blocks) was 5%
# slower; session 29's EARLY 2 (this order, before the pair) 2-5% slower at h_q 64. Then (same
# session, another start) LOAD_BLOCK 1 against 0: 219.6 / 219.6 against 228.8 / 228.3, 422.9 /
# 419.2 against 435.7 / 436.1, 80.4 / 80.4 against 84.1 / 83.8 (FlashMLA 184.7 / 184.3, 356.4,
# 66.9), the h_q 64 rows the same within 0.7% (the same code there); the split's GPU tests
# (111) and memcheck at h_q 100 and 64 passed on it: the default since.
LOAD_BLOCK = _dev_knob("LOAD_BLOCK", 1, (0, 1, 2))
# (ROPE_REGS, session 35: half 1's rope tile loaded into registers with its fp8 chunks and
# stored once the half is free, in place of the cp.async gather issued then: session 36, H100,
# slower with the pair, 128,1,128 233.0 / 231.1 us against 221.2 / 220.3, 32,1,128 85.4 against
# 81.0, the h_q 64 rows the same; its tests and memcheck passed. Removed.)
# CONVERT (developer knob TORCH_MLA_DEV_SPLIT_CONVERT; a timing
# experiment, never a default): the producer's e4m3 -> bf16 route over the 656-byte rows
# (ptx._e4m3_asm's route). "exact" (the default: the product in fp32, rounded once to bf16, as
# the reference dequantizes; 6 instructions a pair of values); "bf16mul" (FlashMLA's: the bf16
# value times the scale rounded to bf16, 5 a pair, rounded twice: inexact); "f16mul" (2 a
# pair: f16 bits where the MMAs read bf16, so wrong results: an upper bound on what a 2-
# instruction route with f16 MMAs could gain, docs/kernels/sparse.md session 35). Whether the
# producer's conversion bounds the h_q 64 block. Session 36 (H100, same start, exact / bf16mul
# / f16mul, us): h_q 64 128,1,64 135.7 / 134.5 / 129.2, 128,2,64 253.2 / 252.9 / 240.4, 32,1,64
# 60.2 / 60.3 / 58.2 (FlashMLA 129.8, 246.5, 58.3): it does, by ~5%; h_q 128 (the pair)
# 128,1,128 221.1 / 225.8 / 239.8, 32,1,128 81.4 / 82.7 / 87.6: slower (not explained yet).
CONVERT = _dev_knob("CONVERT", "exact", ("exact", "bf16mul", "f16mul"))
# LOAD_PIN and LOAD_SEL (sessions 37-38, removed): the producer's chunk loads pinned before its
# wait for a free half (the wait's parity xor a zero computed from loaded words; LOAD_SEL: the
# loads unpredicated, -1 entries' zeros selected at conversion). nvdisasm had shown ptxas
# issuing half 0's loads after that wait without the pair, and 6 of the pair's 8 after it in
# the f16mul build (docs/kernels/sparse.md, session 37). Session 38 (H100, same start, us):
# pinned, h_q 64 slower (128,1,64 142.4 with PFENCE 2 against 132.8 unpinned; 128,2,64 267.9
# against 247.9); with the pair 224.5 against 219.8 at 128,1,128, and the pinned f16mul bound
# 223.4 (the pin undoes f16mul's +8%, but a shorter conversion does not speed up the pair).
# Bytes of a buffer half the peer's producer stores into this CTA with pair: 32 keys x 256
# values x 2 bytes (the rope tile each CTA gathers itself).
PEER_BYTES = 32 * 256 * 2
# PEER 0 (developer knob TORCH_MLA_DEV_SPLIT_PEER; timing only, wrong values by construction):
# the pair's producers store nothing into the peer (no st.async; the tile mbarriers expect no
# peer bytes; the releases still cross), so each CTA reads half of every block's keys stale.
# ROPE 0 (TORCH_MLA_DEV_SPLIT_ROPE, the same kind): no rope gather (the rope tile stale; half
# 1's cp.async arrival still made). Session 42's trace (H100, 128,1,128, blocks 8-11) has WG0's
# wait for half 1 ending ~800 ns after its own producer's arrival there. Half 1's phase also
# waits for the peer's bytes and for this CTA's rope gather, issued right after the producer's
# wait for the free half (ROPE_FIRST), ~1.55 us before WG0's wait ends in every build traced,
# the pair-less one included: the two knobs tell the two apart. Session 43 (H100): with random
# entries both slower (PEER 0 +8.1%, ROPE 0 +3.0% at 128,1,128; PEER 0's producer schedule
# moved); with nothing read PEER 0 152.4 us against 192.4, ROPE 0 183.6 (kernel-notes).
PEER = _dev_knob("PEER", 1, (0, 1))
ROPE = _dev_knob("ROPE", 1, (0, 1))
# XBULK 1 (developer knob TORCH_MLA_DEV_SPLIT_XBULK; the pair): the exchange as four bulk copies
# a half in place of 8 st.async a producer thread. A CTA's 32 converted keys of a 64-row tile
# are rows 32 rank .. + 31, 4 KB of contiguous shared memory; once every producer thread has
# stored and fenced its chunks for the async proxy (a named barrier of the producer warpgroup,
# NB_PRODUCER), one thread copies the four tiles' rows to the same places in the peer,
# completing the same PEER_BYTES on the peer's tile mbarrier. The peer's release of the half
# follows its wait for those bytes, so the copies have read this CTA's rows before the
# producer may overwrite them. Built in session 42 beside PEER; measured 14% slower at b 32 and
# 128 (session 43, H100): it stays a knob, off.
XBULK = _dev_knob("XBULK", 0, (0, 1))
# (PLAYOUT, session 43, removed: a timing-only probe that sent the exchange's st.async stores to
# lane-contiguous addresses; with nothing read it took b 128 h_q 128 from 192 to 168 us, which
# led to SECTORS; kernel-notes, session 43.)
# SECTORS 1 (developer knob TORCH_MLA_DEV_SPLIT_SECTORS; the pair): each producer thread loads
# a key's values 64 d + 8 q .. + 7 and 64 d + 32 + 8 q .. + 7 (two 8-byte loads) in place of
# 64 d + 16 q .. + 15 (one 16-byte load), so that its two converted 16-byte chunks are chunks q
# and q + 4 of the 64-column tile (sector_store_offsets): the four lanes of a key then write
# chunks 0-3 in one store instruction and 4-7 in the next, whole 32-byte sectors, where
# token_store_offsets' chunks 2 q and 2 q + 1 share a sector written half by each instruction.
# Same values, same places in the MMAs' layout; the local stores stay conflict-free. Session 43:
# the exchange's half-sector st.async stores slowed the pair's chain (PLAYOUT above). SECTORS
# 1 measured (H100, same start): 188.0 against 201.5 us at 128,1,128 (-6.7%; FlashMLA 183.6),
# 359.8 against 388.9 at 128,2,128, 71.7 against 75.9 at 32,1,128; its GPU tests and memcheck
# passed. The default since session 43 (0: the old layout).
SECTORS = _dev_knob("SECTORS", 1, (0, 1))
NB_PRODUCER = 8  # the producer warpgroup only (XBULK)
NB_P = NB_P0  # WG0 -> WG1 (the seesaw's ids, unused by this split)
NB_FREE = NB_SCALE1  # WG1 -> WG0


def token_of_lane(warp: int, lane: int, u: int) -> tuple:
    """(key, q) of producer thread (warp, lane) in round u (0 or 1) of a buffer half's fill over
    the 656-byte rows: key 8 warp + lane % 8 + 32 u of the block; q = lane // 8, its chunks
    256 h + 64 d + 16 q of the row (d = 0..3: 4 of a half's 16 chunks of 16 bytes, values of
    group scales 2 h and 2 h + 1), or with SECTORS (the pair) the two 8-byte pieces
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
    """SECTORS 1: the addresses (row: the key's 656-byte row's; 0: offsets in the row) of the
    two 8-byte pieces of fp8 values producer lane q loads for tile 4 h + d: values
    256 h + 64 d + 8 q .. + 7 and 256 h + 64 d + 32 + 8 q .. + 7 (both of group scale
    2 h + d // 2). q, row: ints (tests) or the DSL's values."""
    at = row + 256 * h + 64 * d + 8 * q
    return at, at + 32


def sector_store_offsets(h: int, d: int, key, q) -> tuple:
    """SECTORS 1: byte offsets, from a page buffer's start, of the two 16-byte chunks that key
    `key`'s values at sector_load_offsets(h, d, q) become:
    16-bit tile 4 h + d, chunks q and q + 4 of the row in the 128-byte swizzle (chunk c of row
    R at c ^ (R % 8)), the places fp8_store_offsets gives those values. key, q: ints (tests)
    or the DSL's Int32."""
    tile = (4 * h + d) * TILE16 + key * 128
    return tile + ((q ^ (key % 8)) << 4), tile + (((q + 4) ^ (key % 8)) << 4)


class MLASparseDecodeSm90Split(MLASparseDecodeSm90Producer):
    """The SM90 sparse kernel with FlashMLA's split of the warpgroups; see the module
    docstring."""

    split = True
    regs = REGS
    rope_in_regs = False  # (Q's RoPE tile stays in shared memory: sP1 does not use it)

    def __init__(self, dtype, cache: str = "plain", pair: bool = False, short: bool = False):
        """pair: the two m-blocks of a token (h_q 65-128) as a cluster of two CTAs whose
        producers each convert half of every block's keys (rows 32 rank .. + 31) into both
        CTAs' buffers (the 656-byte rows only); see the module docstring. short: the build for
        parts of few blocks (EPI_COPY, ENTRY_EARLY, META_EARLY and, with the pair,
        ENTRY_EARLY2 on: the comment below LIGHT)."""
        assert not pair or cache == "fp8_ds_mla", cache
        super().__init__(dtype, cache)
        self.pair = pair
        self.cluster_m = 2 if pair else 1
        self.lookahead = AHEAD_PAIR if pair else AHEAD  # (halves loaded ahead: AHEAD's comment)
        self.o_direct = O_DIRECT == 1  # (its comment)
        self.xbulk = XBULK == 1 and pair and PEER == 1  # (its comment)
        self.sectors = SECTORS == 1 and pair  # (its comment)
        self.meta_early = META_EARLY == 1 or short  # (its comment)
        self.epi_copy = EPI_COPY == 1 or short  # (its comment; the short build's)
        self.entry_early = ENTRY_EARLY == 1 or short  # (likewise)
        self.entry_early2 = (ENTRY_EARLY2 == 1 or short) and self.entry_early and self.lookahead > 0
        if LIGHT == 1:
            self.qk_ksteps = self.pv_ksteps = 1
        self.producer_fences = PFENCE == 1 or PFENCE == 0 and not pair  # (PFENCE's comment)
        self.load_block = LOAD_BLOCK == 2 or LOAD_BLOCK == 1 and pair  # (LOAD_BLOCK's)
        self.rope_early = ROPE_EARLY == 1 and cache == "fp8_ds_mla" and not pair  # (its comment)
        assert not (self.rope_early and self.lookahead), "ROPE_EARLY takes AHEAD 0"
        # (its comment; the rope gathers it moves are ROPE_FIRST's)
        self.rope_ahead = (ROPE_AHEAD == 1 and cache == "fp8_ds_mla" and self.lookahead > 0
                           and ROPE_FIRST == 1 and not self.o_direct)
        assert not (self.rope_early and self.o_direct), "ROPE_EARLY takes O_DIRECT 0"

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

    @cute.jit
    def _clear_stale(self, k_base, tidx):
        """PEER 0 and ROPE 0 (timing only) leave parts of the page buffers unwritten: zeroed
        here once, so that the scores stay finite and the combine's checks (an lse of +inf
        stops the launch) pass in their timing runs. With the defaults: nothing."""
        if const_expr(PEER == 0 or ROPE == 0):
            base = k_base.toint()
            for i in cutlass.range(tidx * 16, 2 * PAGE_SIZE * D_QK * 2, self.num_threads * 16,
                                   unroll=1):
                sts(base + i, [Int32(0)] * 4)
            cute.arch.fence_view_async_shared()  # (the zeros seen by the wgmmas' async proxy)

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

    @cute.jit
    def _rope_ahead(self, rows, cur, nxt, first, more, parity, warp):
        """ROPE_AHEAD, in a segment's first step (first): once half 1 of buffer 0 and, where
        block lo + 1 exists (more), of buffer 1 is free (the consumers release a segment's first
        two buffers together), the rope gathers of block lo (the lanes' slots cur) and lo + 1
        (nxt) into them; those blocks' _fill then skips half 1's wait and gather."""
        if first:
            for s in cutlass.range_constexpr(2):
                if s == 0 or more:
                    self._take_half(2 * s + 1, parity)
                    self.rope_tile(rows, nxt if s else cur,
                                   self.d_k_base.toint() + s * (PAGE_SIZE * D_QK * 2), warp)

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
        """Over the 656-byte rows half 0 holds only the producer's own stores (fenced before it
        arrives where producer_fences: PFENCE 1, or 0 without the pair; else the waiting
        warpgroup fences them), half 1 also the rope tile's cp.async copies; with pair both
        halves hold the peer's st.async writes too (generic proxy, landing after its fence: the
        waiting warpgroup fences them)."""
        return (FENCE == 1 or self.cache != "fp8_ds_mla" or h == 1 or self.pair
                or not self.producer_fences)

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
        ahead of the half being converted (AHEAD), or with load_block both halves' rows before
        the wait for half 0 (LOAD_BLOCK)."""
        warp, mIdx, mLens, mNumSplits, width, rows = self._walk_inputs(mKV)
        parity = cute.make_rmem_tensor(1, Int32)  # bit 2 s + h: half h of buffer s's "empty"
        parity.fill(15 if self.o_direct else 0)  # (O_DIRECT: the first waits pass at once)
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
                        if const_expr(self.load_block):  # (both halves' loads first)
                            self._rope_early(rows, cur, s, parity, warp)
                            loaded = [self._load(rows, cur, h, warp) for h in range(2)]
                            for h in cutlass.range_constexpr(2):
                                self._fill(rows, cur, s, h, barK, parity, warp, loaded[h])
                        else:
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
                        ahead = None
                        if const_expr(self.rope_ahead):  # (half 1 waited for, rope issued)
                            ahead = blk < lo + 2
                        if const_expr(self.lookahead == 2):
                            for h in cutlass.range_constexpr(2):
                                self._stash(carry, h, self._load(rows, nx, h, warp, more))
                            if const_expr(self.rope_ahead):  # (after block lo + 1's row loads)
                                self._rope_ahead(rows, cur, nx, blk == lo, more, parity, warp)
                            for h in cutlass.range_constexpr(2):
                                self._fill(rows, cur, s, h, barK, parity, warp, held[h], ahead)
                        else:
                            half1 = self._load(rows, cur, 1, warp)
                            if const_expr(self.rope_ahead):
                                self._rope_ahead(rows, cur, nx, blk == lo, more, parity, warp)
                            self._fill(rows, cur, s, 0, barK, parity, warp, held[0])
                            self._stash(carry, 0, self._load(rows, nx, 0, warp, more))
                            self._fill(rows, cur, s, 1, barK, parity, warp, half1, ahead)
                        slots[0] = nx[0]
                        slots[1] = nx[1]
                    slots[2 * (self.lookahead > 0)] = nxt[0]
                    slots[2 * (self.lookahead > 0) + 1] = nxt[1]
                    self._stamp("filled", 256, blk - lo)
                self._stamp("produced", 256)

    def _block_entries(self, mIdx, r, blk, length):
        """This lane's two entries of block blk of request r (_entries), with the request's
        length read once a segment (ENTRY_LEN 1) or with every block (0)."""
        return self._entries(self._page(mIdx, r, blk), length if ENTRY_LEN == 1 else None)

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
        of its 2 keys (token_of_lane; with SECTORS each chunk two 8-byte pieces,
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
                    if const_expr(self.sectors):  # (SECTORS: values 8 q and 32 + 8 q of 64)
                        words.append([w for at in sector_load_offsets(h, d, q, row)
                                      for w in ldg_or_zero(2, at, ok, L1_EVICT, L2_PREFETCH)])
                    else:
                        words.append(ldg_or_zero(4, row + 256 * h + 64 * d + 16 * q, ok,
                                                 L1_EVICT, L2_PREFETCH))
                scales.append(ldg_or_zero(2, row + FP8_DS_MLA_SCALES_AT + 8 * h, ok, L1_EVICT))
        return words, scales

    @cute.jit
    def _fill(self, rows, slots, s, h: cutlass.Constexpr[int], barK, parity, warp, loaded,
              ahead=None):
        """Half h of buffer s (a runtime index) from the 64 keys whose slots the lanes hold (keys
        lane and lane + 32), once the consumers released it. The 656-byte rows: this thread's
        chunks and scales are already loaded (`loaded`: _load, issued before the wait); it stores
        each value times its scale, rounded to bf16 (ptx.e4m3_store16), to its swizzled place
        (token_store_offsets; with SECTORS sector_store_offsets). Over half 1 the bf16 rope tile
        by cp.async (gather16, the four warps sharing its rows; with rope_early issued already,
        at the block's start). The 16-bit cache: the half's tiles by cp.async once released. Warp
        0 writes buffer s's bias row with half 0. Every thread then fences its writes for the
        async proxy (where producer_fences: PFENCE) and arrives on the half's tile mbarrier
        (cp.async.mbarrier.arrive makes it wait for the copies too). ahead (ROPE_AHEAD, half
        1): the segment's first step waited for this half and gathered its rope tile."""
        lane = cute.arch.lane_idx()
        buf = self.d_k_base.toint() + s * (PAGE_SIZE * D_QK * 2)
        words, scales = loaded
        bit = 2 * s + h
        self._stamp(f"d_wait{h}", 256)  # (trace: this half's loads issued, its wait begins)
        # (with pair the peer's consumers release it too: _wait_half's acquire at SCOPE)
        rope_first = (self.cache == "fp8_ds_mla" and h == 1 and ROPE_FIRST == 1
                      and not self.rope_early)
        if const_expr(self.rope_ahead and h == 1):
            if not ahead:
                self._take_half(bit, parity)
                self.rope_tile(rows, slots, buf, warp)  # (ROPE_FIRST's place)
        else:
            self._take_half(bit, parity)
        self._stamp(f"d_free{h}", 256)  # (trace: half h free)
        if const_expr(h == 0):
            self._half0_bias(s, slots, warp)
        if const_expr(rope_first and not self.rope_ahead):  # (its DRAM latency under the
            self.rope_tile(rows, slots, buf, warp)  # conversion: ROPE_FIRST)
        bar = barK + s * N_TILES + 4 * h
        if const_expr(self.cache == "fp8_ds_mla"):
            peer = None
            if const_expr(self.pair and PEER == 1 and not self.xbulk):  # (the peer's places)
                other = 1 - cute.arch.block_idx_in_cluster()
                peer = (mapa_shared(buf, other) - buf, mapa_shared(bar.toint(), other))
            for i in cutlass.range_constexpr(self._rounds()):
                key, q = token_of_lane(warp, lane, self._round(i))
                for d in cutlass.range_constexpr(4):
                    places = sector_store_offsets if self.sectors else token_store_offsets
                    d0, d1 = places(h, d, key, q)
                    e4m3_store16(buf + d0, buf + d1, words[4 * i + d], True,
                                 scales[i][d // 2], early=True, peer=peer, route=CONVERT)
            if const_expr(self.xbulk):
                self._send_half(buf, bar, h, warp)
        self._copy_and_arrive(rows, slots, buf, h, bar, warp,
                              PEER_BYTES if self.pair and PEER == 1 else 0,
                              rope_issued=rope_first or self.rope_early)
        self._stamp(f"d_filled{h}", 256)  # (trace: half h stored, arrived on)

    @cute.jit
    def rope_tile(self, rows, slots, buf, warp):
        """The base class's rope gather, or with ROPE 0 none (timing only: the tile stale)."""
        if const_expr(ROPE == 1):
            MLASparseDecodeSm90Producer.rope_tile(self, rows, slots, buf, warp)

    @cute.jit
    def _send_half(self, buf, bar, h: cutlass.Constexpr[int], warp):
        """XBULK: this CTA's converted keys of half h of the buffer at buf (rows 32 rank .. + 31
        of tiles 4 h .. 4 h + 3) to the same places in the peer by four 4 KB bulk copies,
        completing PEER_BYTES on the peer's tile mbarrier (bar's place there), once every
        producer thread's stores are fenced for the async proxy and the warpgroup synced."""
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=NB_PRODUCER, number_of_threads=128)
        if warp == 0:
            if cute.arch.lane_idx() == 0:
                rank = cute.arch.block_idx_in_cluster()
                other = 1 - rank
                peer_bar = mapa_shared(bar.toint(), other)
                for d in cutlass.range_constexpr(4):
                    src = buf + (4 * h + d) * TILE16 + rank * (32 * 128)
                    bulk_s2cluster(mapa_shared(src, other), src, PEER_BYTES // 4, peer_bar)

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
        """Half h of buffer s, read by block b of the segment [lo, hi), back to the producer:
        with o_direct always; else unless b is one of the segment's last two blocks, whose
        buffers the epilogue stages O in (the next segment's start releases them: the base
        class's _load_tiles)."""
        if const_expr(self.o_direct):
            self._release(s, h, wtid)
        else:
            if b + 2 < hi:
                self._release(s, h, wtid)

    @cute.jit
    def _load_tiles(self, tma_k, mKV, tKsK, barK, page, s: cutlass.Constexpr[int],
                    t_begin: cutlass.Constexpr[int], t_end: cutlass.Constexpr[int]):
        """A segment's start: its first two blocks' buffers to the producer (the base class),
        but with o_direct nothing (the producer's first waits pass; each block releases its
        buffer itself)."""
        if const_expr(not self.o_direct):
            MLASparseDecodeSm90Producer._load_tiles(self, tma_k, mKV, tKsK, barK, page, s,
                                                    t_begin, t_end)

    @cute.jit
    def _stage_and_store(self, acc_O, inv, k_base, out_dtype: cutlass.Constexpr, gOut,
                         m_block, valid_rows, r0, c0, wg, wtid):
        """The dense kernel's epilogue store (O staged in the page buffers, bulk copies), with
        EPI_COPY the same staging copied out by the threads (_stage_and_copy), or with o_direct
        (which takes precedence over EPI_COPY) this thread's values of O * inv straight from
        the accumulators to rows [0, valid_rows) of gOut[m_block * 64 + row, 256 wg:]: columns
        8 j + c0 + {0, 1} of rows r0 and r0 + 8, one st.global of 8 bytes (fp32) or 4 (16-bit)
        a pair; a quad's four lanes write 32 or 16 contiguous bytes."""
        if const_expr(not self.o_direct and self.epi_copy):
            self._stage_and_copy(acc_O, inv, k_base, out_dtype, gOut, m_block, valid_rows, r0,
                                 c0, wg, wtid)
        elif const_expr(not self.o_direct):
            MLASparseDecodeSm90Producer._stage_and_store(
                self, acc_O, inv, k_base, out_dtype, gOut, m_block, valid_rows, r0, c0, wg,
                wtid)
        else:
            nbytes = out_dtype.width // 8
            for h in cutlass.range_constexpr(2):
                if r0 + 8 * h < valid_rows:
                    row = m_block * BLOCK_M + r0 + 8 * h
                    dst = gOut.iterator + cute.crd2idx((row, wg * HALF_V + c0), gOut.layout)
                    addr = dst.toint()
                    for j in cutlass.range_constexpr(HALF_V // 8):
                        lo = acc_O[2 * h + 4 * j] * inv[h]
                        hi = acc_O[1 + 2 * h + 4 * j] * inv[h]
                        if const_expr(nbytes == 4):
                            stg_f32x2(addr + 8 * j * nbytes, lo, hi)
                        else:
                            stg_b32(addr + 8 * j * nbytes,
                                    pack16x2(lo, hi, out_dtype == cutlass.BFloat16))

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
                   r0, c0, wtid, scale_log2, nxt: cutlass.Constexpr[bool] = False,
                   waited: cutlass.Constexpr[bool] = False):
        """WG0, block b of [lo, hi) in buffer s: S, the softmax, P and its scale to WG1, P V for
        O's left half; then half 0 of the buffer goes back to the producer. With PIPE, block b's
        S is in flight already (issued by the previous block or _split_blocks; waited: and
        landed), and with nxt (block b + 1 exists) this block issues block b + 1's."""
        self._stamp("block", 0, b - lo)  # (trace point: WG0 starts block b)
        if const_expr(not PIPE):
            self._qk(acc_S, tSrQ, tSrK, None, None, barK, phase, s, tuple(range(N_TILES)))
        if const_expr(not waited):
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
        if const_expr(PARRIVE == "early"):
            cute.arch.barrier_arrive(barrier_id=NB_P, number_of_threads=256)
        # (V: half 0, which this warpgroup waited for and fenced where it had copies)
        self._pv(self.d_tiled_pv_rs, acc_O, rP, tOrV[s][0], True,
                 fence=FENCE == 1 or (self.pair and PVFENCE == 1))
        if const_expr(PARRIVE == "late"):
            cute.arch.barrier_arrive(barrier_id=NB_P, number_of_threads=256)
        self._stamp("d_pv", 0, b - lo)  # (trace: P V issued, NB_P arrived)
        if const_expr(PIPE and nxt):
            # Block b + 1's S behind this P V: its half 0 tiles, then (P V done, this block's
            # half 0 released: the producer may go on) its half 1 tiles.
            self._qk(acc_S, tSrQ, tSrK, None, None, barK, phase, 1 - s, (0, 1, 2, 3),
                     last=False)
            warpgroup.wait_group(1)
            fence_operand(acc_O)
            self._release_read(b, hi, s, 0, wtid)
            self._qk(acc_S, tSrQ, tSrK, None, None, barK, phase, 1 - s, (4, 5, 6, 7, 8),
                     fresh=False)
        else:
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
        producer: at the segment's start, or with o_direct by the blocks before them and the
        producer's initial parity), two a loop step so that each block's buffer is a
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
        if const_expr(wg == 0 and PIPE):
            # (n >= 1.) The first block's S; each block then issues the next one's. A wgmma
            # issued inside a runtime branch and waited for outside it makes ptxas serialise
            # every wgmma (C7518: the first build issued the next S under `if b + 1 < hi`), so
            # loop steps whose two blocks and the next exist, then, after the last S landed,
            # the one or two last blocks under a branch.
            self._qk(acc_S, tSrQ, tSrK, None, None, barK, phase, 0, tuple(range(N_TILES)))
            n_full = (n - 1) // 2
            for i in cutlass.range(n_full, unroll=1):
                block(lo + 2 * i, s=0, nxt=True)
                block(lo + 2 * i + 1, s=1, nxt=True)
            warpgroup.wait_group(0)
            if n % 2 == 0:
                block(lo + 2 * n_full, s=0, nxt=True, waited=True)
                block(lo + 2 * n_full + 1, s=1)
            else:
                block(lo + 2 * n_full, s=0, waited=True)
        else:
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
