"""Keys-on-M MLA decode on Hopper over an e4m3 cache: page operands from registers, two consumer
warpgroups on alternate pages ("ping-pong").

The keys-on-M kernel (sm90_keysm_decode.py, docs/kernels/keysm.md) expands each fp8 page into a
16-bit work buffer that both MMAs then read from shared memory: ~300 KB of shared-memory traffic
a page, and the page's chain (expansion, S^T, column softmax, P^T, O^T) runs in one warpgroup.
Here neither happens:

  - no work buffer: each consumer thread converts its own A operands straight from the fp8 ring
    into registers (cvt.rn.f16x2.e4m3x2, exact) and the MMAs take A from registers (RS wgmma,
    f16): S^T's A is the page (keys x latent), O^T's A is V^T (d x keys). Shared-memory traffic
    a page: the fp8 page read twice (72 KB), Q^T (18 KB at 16 columns) and P^T.
  - two consumer warpgroups take the same query columns and alternate pages (the page count's
    parity), each with its own online softmax and O^T, merged through shared memory at the
    segment's end (the second warpgroup's O^T, maxima and sums; the first stores). One page's
    conversions and softmax run under the other warpgroup's MMAs, with no barrier between them
    within a segment.

The ring holds whole-line pages: one TMA box of 144 rows x 256 bytes lands a page (64 rows of
576 bytes, as the cache holds it: 36 KB of whole 128-byte lines), unswizzled. (Until session 22
it held 9 tiles of 64 rows x 64 bytes with TMA's 64-byte swizzle, every other one straddling two
lines: 3.6-4.1% slower on the memory-bound rows, docs/kernels/keysm.md "Session 22".)

Orders (tests/test_keysm_rs.py checks them against the DSL's fragment layouts and counts bank
conflicts):
  - Keys: S^T's row m is page row m; P^T's key (O^T's k) m is page row page_row(m) (bit 0 ^=
    bit 1, an involution: the consumer writes S^T's row m to P^T's key page_row(m), _pt_key).
    S^T's loads (rows g, g + 8, 576 bytes apart: rows alternate bank halves) are conflict-free;
    O^T's are 2-way conflicted, the least without a swizzle (4-way without page_row).
  - Latent (S^T's k): a thread's 16 bytes of a 64-wide group are four k-steps of its fragment
    (logical k 16 jj + 2 q + {0, 1, 8, 9} for k-step jj and lane % 4 = q), so Q is permuted to
    match (latent_of) when it is converted, once a segment.
  - d (O^T's rows): a thread's 16 bytes of a key row hold its two rows of each of the 8 m-tiles
    (d_of); the epilogue stores each value at its cache column.
Q: bf16 q is converted to f16 times a power of two (q_f16_factors, as the keys-on-M kernel does);
fp16 q is only permuted. P is written in f16.

Registers and shared memory by columns: at 8 and 16 a consumer thread has 232 registers and
the second warpgroup's O^T, maxima and sums go over in one merge round (two in the sparse
subclass over the 656-byte rows, whose stages are larger); at 32 (O^T alone 128
registers a thread) 240 registers, O^T's A operands of a k-step filled in two m-tile groups
(o_groups), the merge in three rounds of 48 floats (merge_rounds: what fits beside four ring
stages; five in fast mode, whose Q8 takes shared memory too: _prepare counts it).

64 columns (no ping-pong: `pingpong` False): the two warpgroups split the columns, 32 each (Q
column set and P^T slot wg), and both convert and read every page; a stage is released by both
(8 warp arrivals); no merge; 3 ring stages beside Q's 72 KB; Q converted by each warpgroup for
its own set (_q_ready, its own barrier); 240 registers, one epilogue copy a warpgroup
(epilogue_per_wg; ptxas spills 12 bytes). Opt-in (TORCH_MLA_KEYSM=1 and TORCH_MLA_KEYSM_RS=1):
run on an H100 in session 26, 0.82x bf16 at b 128, s_k 8192, h_q 64 (docs/benchmarks-h100.md).

Limits: e4m3 cache (exact mode), d_qk 576, d_v 512, page 64, 8, 16, 32 or 64 columns (query
rows a CTA); one KV head (a page's rows contiguous: the dispatch, keysm_kind, checks); in
ping-pong the ring has an even number of stages (RS_STAGES, merge_rounds).
Status: the whole-line version ran on the H200 in session 22 (GPU tests, memcheck, fuzz 2000
cases, CUDA-graph replays), 32 columns in session 23 (GPU tests, memcheck, fuzz 2000 cases); the
dispatch's choice in exact mode from a batch of KEYSM_RS_MIN_BATCH[columns] (8 at 8 and 16
columns, 32 at 32; TORCH_MLA_KEYSM_RS=1: every batch, =0: never): 0.73-0.79x the keys-on-M
kernel's time on the memory-bound rows, up to 1.19x it at b 1 (1.36x at 32 columns).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..constants import D_QK, D_V, KEYSM_RS_COLUMNS, PAGE_SIZE
from . import softmax
from .decode_base import TmaLoads, aligned, shared_struct
from .ptx import (
    L2_EVICT_FIRST,
    bar_arrive,
    bar_sync,
    bf16x2_to_f16x2,
    e4m3x4_f16,
    fence_operand,
    hmul2,
    int_as_f32,
    lds128,
    prmt,
    sts,
)
from .sm90_keysm_decode import (
    N_TILES,
    NB_WG,
    PAGE_ELEMS,
    MLADecodeSm90KeysM,
    finite_bf16_max,
    q_f16_factors,
    ring_slot,
    smem_layouts,
)

# Named barriers (1-3: the keys-on-M kernel's; 2 + wg is each warpgroup's own).
NB_PAIR = 4  # both consumer warpgroups: Q's largest magnitude shared, then Q converted
NB_MERGE = 5  # the second warpgroup's O^T, maxima, sums are in sMerge (it arrives, the first waits)
NB_MERGE_READ = 6  # the first warpgroup has read a merge round (it arrives, the second waits)


RS_STAGES = 4  # fp8 ring stages (36 KB each); an even number (merge_rounds)


def merge_floats(columns: int) -> int:
    """Floats a consumer thread hands over at a segment's end: the running max and partial sum
    of each of its columns, then its O^T values (512 x columns / 128)."""
    return columns // 2 + 4 * columns


def merge_round(k: int, rounds: int, columns: int) -> range:
    """The floats (merge_floats' order) of merge round k of `rounds`: sMerge holds one round's
    floats of every thread."""
    per = -(-merge_floats(columns) // rounds)
    return range(k * per, min((k + 1) * per, merge_floats(columns)))


def merge_rounds(columns: int) -> int:
    """The fewest merge rounds whose sMerge (128 threads x one round's floats) fits beside Q,
    two P^T tiles, the RS_STAGES ring stages and the column maxima in 227 KB (2 KB spare for
    the barriers and alignment): 1 at 8 and 16 columns, 3 at 32 (O^T alone is 64 KB there).
    _prepare adds rounds where a subclass's shared memory needs them (fast mode's Q8; the
    sparse ping-pong's 44 KB stages over the 656-byte rows: 2 at 16 columns, 21 at 32).

    The ring has an even number of stages: the warpgroups take pages by the page count's
    parity, so each stage then serves one warpgroup. With an odd ring a stage alternates
    between them and a warpgroup a lap ahead waits for its parity while the other's phase is
    still open: the wait passes on the phase before (tests/test_keysm.py,
    test_ring_protocol_pingpong; session 20's 5-stage variant failed on the H200). Session 22's
    5-stage ring with a full barrier per warpgroup was correct but slower (docs/kernels/keysm.md,
    "Five ring stages")."""
    fixed = (columns * D_QK * 2 + 2 * columns * PAGE_SIZE * 2 + RS_STAGES * PAGE_ELEMS
             + 16 * columns * 4 + 2048)
    for rounds in range(1, merge_floats(columns) + 1):
        if fixed + len(merge_round(0, rounds, columns)) * 128 * 4 <= 227 * 1024:
            return rounds
    raise ValueError(columns)


LINE_BOX = 256  # bytes of a page row of the TMA box (a page: 144 such rows, whole lines)
# (A page by one 1-D cp.async.bulk of its 36 KB instead of this box, session 48's BULK knob:
# the same time on an H100 at b 128 s_k 8192 and b 64 s_k 16384, h_q 16, and at s_q 2, in both
# modes and in the load-only ring (within 0.4%, session 49); removed.)


# ---- index arithmetic, modelled in Python (tests/test_keysm_rs.py checks it) ------------------


def page_row(m):
    """The page row of O^T's key m (its k index; P^T's key m): bit 0 ^= bit 1 (an involution).
    A load phase of O^T (lanes q = 0..3 on key rows 2 q + o) then reads rows of both parities:
    576-byte rows alternate bank halves, so the phase is 2-way conflicted instead of 4-way."""
    return m ^ ((m >> 1) & 1)


def latent_of(k):
    """The cache latent index whose value S^T's fragment takes at logical k: a thread with
    lane % 4 = q reads bytes 16 q .. 16 q + 15 of each 64-wide group, byte 4 jj + e being k-step
    jj's k = 2 q + (e % 2) + 8 (e // 2) of that step."""
    c, rem = k // 64, k % 64
    jj, r16 = rem // 16, rem % 16
    q, e = (r16 % 8) // 2, r16 % 2 + 2 * (r16 // 8)
    return 64 * c + 16 * q + 4 * jj + e


def v_chunk(wq, g):
    """The cache latent byte where thread (warp wq, lane / 4 = g)'s 16 d values start."""
    return 64 * (2 * wq + g // 4) + 16 * (g % 4)


def d_of(t, h, wq, g):
    """The cache column (d) of O^T's row 64 t + 16 wq + g + 8 h: byte 2 t + h of the thread's
    chunk."""
    return v_chunk(wq, g) + 2 * t + h


def q_byte(row, k, n):
    """Byte offset of element (row, k) of a 16-bit Q tile of n rows x 576 in the K-major
    128-byte-swizzled layout (8-row x 64-element atoms, rows first): chunk ^= row % 8."""
    o = 2 * ((row % 8) * 64 + (row // 8) * 512 + (k // 64) * 64 * n + k % 64)
    return o ^ (((o >> 7) & 7) << 4)


def q_unit(row, c, u, n):
    """q_byte of element (row, 64 c + 8 u): where the 16-byte unit u of the row's 64-wide group
    c lies (its 128-byte run is contiguous; the unit's place in it is u ^ row % 8)."""
    return 2 * ((row % 8) * 64 + (row // 8) * 512 + c * 64 * n) + ((u ^ (row % 8)) * 16)


class MLADecodeSm90KeysMRS(MLADecodeSm90KeysM):
    """Keys-on-M decode over an e4m3 cache with register page operands and two ping-pong consumer
    warpgroups; see the module docstring."""

    pingpong = True
    # P < 2^8 in f16; most pages then skip O^T's rescale (64 multiplies a thread at 16 columns)
    max_slack = 8.0

    def __init__(self, dtype, causal: bool, columns: int):
        assert columns in KEYSM_RS_COLUMNS, columns
        super().__init__(dtype, causal, columns, kv_fp8=True)
        # 64 columns: the two warpgroups split them (32 each, plan), both reading every page
        # (its stage released by 8 warps); no merge. Below: ping-pong on alternate pages.
        self.pingpong = self.consumers == 1
        self.epilogue_per_wg = not self.pingpong
        self.wgs = 2
        # + a producer warpgroup whose registers setmaxnreg gives to the consumers (REGS: with
        # 288 threads ptxas caps every thread at 168 registers and spills)
        self.num_threads = 3 * 128
        # 128 p + 256 c <= 168 x 384 (the launch's registers). At 32 columns ptxas serialises
        # the wgmmas below 240 (no spill at 24 then); at 8 and 16 the producer spilled at 24.
        self.regs = (24, 240) if self.n_wg == 32 else (40, 232)
        # (at 64 columns Q takes 72 KB: 3 stages fit, and an odd ring is fine without ping-pong)
        self.stages = RS_STAGES if self.pingpong else 3
        # (more in _prepare where _more_smem needs; none without ping-pong)
        self.merge_rounds = merge_rounds(columns) if self.pingpong else 0
        # O^T's A fragments per k-step in this many groups of m-tiles: a group's register
        # buffer is filled while the MMAs read the other's (two groups at 32 columns, where
        # O^T itself takes 128 registers a thread)
        self.o_groups = 2 if self.n_wg == 32 else 1
        self.buffers = 0  # no 16-bit page buffer

    def _prepare(self, mQ: cute.Tensor, mKV: cute.Tensor, fp8: tuple):
        n = self.n_wg
        self.q_f16 = self.dtype == cutlass.BFloat16
        dt = cutlass.Float16
        self.mma_dtype = dt
        q_tile, sQ_layout, sK_layout, sVt_layout, sPt_layout, _ = smem_layouts(dt, n, 2, 1)
        # (sQ_layout holds two column sets: the second is 64 columns' second warpgroup's)
        kmode, mnmode = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        tiled_o = sm90_utils.make_trivial_tiled_mma(dt, dt, kmode, mnmode, Float32, (1, 1, 1),
                                                    (PAGE_SIZE, n), rmem)
        mQ_t = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[1, 2, 0]))
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(op, mQ_t, q_tile, (n, D_QK))
        tma_k, tma_mKV = self._line_tma(op, mKV)
        i64 = cutlass.Int64
        while True:  # the fewest merge rounds that fit beside the subclass's _more_smem
            merge = {}
            if self.pingpong:
                merge["sMerge"] = aligned(Float32,
                                          128 * len(merge_round(0, self.merge_rounds, n)))
            self.shared_storage = shared_struct(
                sQ=aligned(dt, self.consumers * n * D_QK),
                sP=aligned(dt, 2 * n * PAGE_SIZE),
                sK8=aligned(cutlass.Uint8, self.stages * self.stage_bytes),
                **merge,
                sMax=cute.struct.MemRange[Float32, 2 * 2 * 4 * n],
                barFull=cute.struct.MemRange[i64, self.stages],
                barEmpty=cute.struct.MemRange[i64, self.stages],
                barQ=cute.struct.MemRange[i64, 2],
                sQmax=cute.struct.MemRange[Int32, 8],
                **self._more_smem(),
            )
            size = self.shared_storage.size_in_bytes()
            if size <= 227 * 1024 or not self.pingpong or self.merge_rounds == merge_floats(n):
                break
            self.merge_rounds += 1
        assert size <= 227 * 1024, size
        return TmaLoads(tma_q, tma_mQ, tma_k, tma_mKV), (
            fp8, sQ_layout, sK_layout, sVt_layout, sPt_layout, self._tiled_s(), tiled_o)

    def _line_tma(self, op, mKV: cute.Tensor):
        """The cache's TMA: one box of whole lines a page. The pages as (256 bytes, 144 rows,
        pages): a page's 64 rows must be contiguous, 576 bytes apart: a contiguous cache of one
        KV head (the ops check the first; the dispatch sends only h_kv 1 here,
        dispatch.keysm_kind)."""
        view = cute.make_tensor(mKV.iterator, cute.make_layout(
            (LINE_BOX, PAGE_ELEMS // LINE_BOX, mKV.shape[0]),
            stride=(1, LINE_BOX, mKV.layout.stride[0])))
        box = cute.make_layout((LINE_BOX, PAGE_ELEMS // LINE_BOX), stride=(1, LINE_BOX))
        return cpasync.make_tiled_tma_atom(op, view, box, (LINE_BOX, PAGE_ELEMS // LINE_BOX))

    def _tiled_s(self):
        """S^T's tiled MMA: f16, A (the page) from registers, B (Q^T) from shared memory."""
        dt = self.mma_dtype
        kmode = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(dt, dt, kmode, kmode, Float32, (1, 1, 1),
                                                 (PAGE_SIZE, self.n_wg),
                                                 warpgroup.OperandSource.RMEM)

    @cute.jit
    def _fp8_ring(self, storage):
        """The ring as the TMA writes it: (256 bytes, 144 rows, stages)."""
        k8 = cute.recast_ptr(storage.sK8.data_ptr(), dtype=cutlass.Uint8)
        return cute.make_tensor(k8, cute.make_layout(
            (LINE_BOX, PAGE_ELEMS // LINE_BOX, self.stages),
            stride=(1, LINE_BOX, self.stage_bytes)))

    @cute.jit
    def _ring_partitions(self, tma_k, tma_mKV, sK_tma):
        """The TMA partitions of the ring's stages (TMA, stages) and the cache's pages (TMA,
        pages): one box a page."""
        g = cute.local_tile(tma_mKV, (LINE_BOX, PAGE_ELEMS // LINE_BOX), (0, 0, None))
        return cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                     cute.group_modes(sK_tma, 0, 2), cute.group_modes(g, 0, 2))

    @cute.jit
    def _load_page(self, tma_k, tKgK, tKsK, page, cnt, bar_full, bar_empty, page_bytes):
        """The producer warp: cache page `page` into the ring stage of use cnt[0] (one box),
        once its last reader released it; cnt[0] += 1."""
        s, parity = ring_slot(cnt[0], self.stages)
        cute.arch.mbarrier_wait(bar_empty + s, parity ^ 1)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar_full + s, page_bytes)
        cute.copy(tma_k, tKgK[None, page], tKsK[None, s], tma_bar_ptr=bar_full + s,
                  cache_policy=cutlass.Int64(L2_EVICT_FIRST))
        cnt[0] = cnt[0] + 1

    # ---- the consumer's hooks -----------------------------------------------------------------
    @cute.jit
    def _operands(self, thr_s, thr_o, sQ, sK, sVt, sPt, wg):
        """S^T's operands (_s_operands), then O^T's: two register A fragments of a k-step (one
        is filled while the MMAs read the other) and P^T; this thread's ring offsets."""
        dt = self.mma_dtype
        d_group = D_V // self.o_groups  # O^T rows an m-tile group covers
        rVa = cute.make_rmem_tensor(thr_o.partition_shape_A((d_group, 16)), dt)  # (8, 8, 1)
        rVb = cute.make_rmem_tensor(thr_o.partition_shape_A((d_group, 16)), dt)
        self.d_o_group = thr_o.partition_shape_C((d_group, self.n_wg))
        tOrP = thr_o.make_fragment_B(thr_o.partition_B(sPt[None, None, wg]))  # (MMA, 1, 4)
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % 32
        wq = (tidx // 32) % 4
        g, q = lane // 4, lane % 4
        # O^T: rows 2 q + o (+ 16 ks + 8 e), the thread's d chunk
        v_row = [page_row(2 * q + o) for o in range(2)]
        self.d_v_row = v_row
        self.d_v_off = [self._stage_offset(v_row[o], v_chunk(wq, g)) for o in range(2)]
        # (Q's column set: the warpgroup's own at 64 columns, the shared one in ping-pong)
        self.d_qset = 0 if self.pingpong else wg
        s_ops = self._s_operands(thr_s, sQ[None, None, self.d_qset], wq, g, q)
        # (3 of them; a subclass's more last)
        return s_ops[:3] + (rVa, rVb, tOrP) + s_ops[3:]

    @cute.jit
    def _s_operands(self, thr_s, sQ, wq, g, q):
        """S^T's: two register A fragments (two of its four k-steps of a 64-wide group: one is
        filled while the MMAs read the other), Q^T (sQ: the warpgroup's column set, n x 576);
        this thread's ring offsets."""
        dt = self.mma_dtype
        rKa = cute.make_rmem_tensor(thr_s.partition_shape_A((PAGE_SIZE, 64)), dt)  # (8, 1, 4)
        rKb = cute.make_rmem_tensor(thr_s.partition_shape_A((PAGE_SIZE, 64)), dt)
        tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ))  # (MMA, 1, 36)
        # rows 16 wq + g (+ 8), bytes 16 q of each 64-byte group
        self.d_k_off = [self._stage_offset(16 * wq + 8 * h + g, 16 * q) for h in range(2)]
        return rKa, rKb, tSrQ

    # A ring stage is the page as the cache holds it: 64 rows of 576 bytes, unswizzled.
    row_bytes = D_QK

    def _stage_offset(self, row, byte):
        """Byte offset of (page row, latent byte) in a ring stage."""
        return row * self.row_bytes + byte

    def _pt_key(self, m):
        return page_row(m)

    @cute.jit
    def _prepare_stage(self, s, valid, tidx, lane, bar_empty):
        return s  # read in place; released after O^T

    @cute.jit
    def _mma_s(self, ops, acc_S, s, ob, wq, lane):
        """S^T = K Q^T: 9 groups of 4 k-steps; group c's A (its words: _s_words) is converted
        into one register buffer while the MMAs of group c - 1 read the other (_s_group); then
        _s_done."""
        base = self.d_k8 + s * self.stage_bytes
        accs = self._s_accs(ops, acc_S)
        for acc in accs:
            fence_operand(acc)
        x = self._s_words(base, 0)
        for c in cutlass.range_constexpr(N_TILES):
            cur = x
            if const_expr(c + 1 < N_TILES):
                x = self._s_words(base, c + 1)
            if const_expr(c >= 2):
                warpgroup.wait_group(1)  # group c - 2, the last reader of c's buffer, is done
            self._s_group(ops, accs, c, cur)
            warpgroup.commit_group()
        warpgroup.wait_group(0)
        for acc in accs:
            fence_operand(acc)
        self._s_done(accs, base)

    def _s_accs(self, ops, acc_S) -> list:
        """S^T's accumulators: acc_S alone (the 656-byte rows' subclass adds one a scale)."""
        return [acc_S]

    @cute.jit
    def _s_words(self, base, c):
        """The thread's A words of S^T's group c: 16 bytes of rows g and g + 8."""
        return [lds128(base + self.d_k_off[h] + c * 64) for h in range(2)]

    @cute.jit
    def _s_group(self, ops, accs, c, cur, acc=None, first=0, scale=None):
        """Group c's A (words `cur`, e4m3) converted into buffer c % 2 (each value of row g + 8 h
        times scale[h], an f16x2 pair, where given), then its 4 MMAs into acc (accs[0] unless
        given), the first of them overwriting it where the k-step count 4 (c - first) + jj is
        0."""
        rKa, rKb, tSrQ = ops[0], ops[1], ops[2]
        acc = accs[0] if const_expr(acc is None) else acc
        buf = rKa if const_expr(c % 2 == 0) else rKb
        b32 = cute.recast_tensor(buf, Int32)
        for jj in cutlass.range_constexpr(4):
            b32[4 * jj], b32[4 * jj + 2] = e4m3x4_f16(cur[0][jj])
            b32[4 * jj + 1], b32[4 * jj + 3] = e4m3x4_f16(cur[1][jj])
            if const_expr(scale is not None):
                for i in cutlass.range_constexpr(4):
                    b32[4 * jj + i] = hmul2(b32[4 * jj + i], scale[i % 2])
        fence_operand(buf)
        warpgroup.fence()
        atom_s = cute.make_mma_atom(self.d_tiled_s.op)
        for jj in cutlass.range_constexpr(4):
            atom_s.set(warpgroup.Field.ACCUMULATE, (c - first) * 4 + jj != 0)
            cute.gemm(atom_s, acc, buf[None, None, jj], tSrQ[None, None, 4 * c + jj], acc)

    @cute.jit
    def _s_done(self, accs, base):
        """After S^T's MMAs: nothing here (the 656-byte rows' scales)."""
        pass

    @cute.jit
    def _mma_o(self, ops, acc_O, s, ob, valid, wq, lane):
        """O^T += V^T P^T: per k-step of 16 keys, the thread's four key rows (2 q + {0, 1, 8,
        9}; rows at or past `valid` as 0: the cache may hold NaN there), loaded a k-step ahead,
        are paired by prmt into 8 m-tiles' A fragments in one register buffer while the MMAs of
        the last k-step read the other."""
        rVa, rVb, tOrP = ops[3], ops[4], ops[5]
        base = self.d_k8 + s * self.stage_bytes
        atom_o = cute.make_mma_atom(self.d_tiled_o.op)
        atom_o.set(warpgroup.Field.ACCUMULATE, True)
        # the four rows of a k-step (and their scale words: _v_scale_words), loaded one
        # k-step ahead
        raws = [cute.make_rmem_tensor(16, Int32), cute.make_rmem_tensor(16, Int32)]
        scale_words = [None, None]

        def load(ks):
            for e in cutlass.range_constexpr(2):
                for o in cutlass.range_constexpr(2):
                    w = lds128(base + self.d_v_off[o] + (16 * ks + 8 * e) * self.row_bytes)
                    for i in cutlass.range_constexpr(4):
                        raws[ks % 2][4 * (2 * e + o) + i] = w[i]
            scale_words[ks % 2] = self._v_scale_words(base, ks)

        groups = self.o_groups
        tiles = (D_V // 64) // groups  # m-tiles a group
        accs = [acc_O]
        if const_expr(groups > 1):  # views of acc_O's m-tiles (its layout is compact)
            accs = [cute.make_tensor(acc_O.iterator + gi * (cute.size(acc_O) // groups),
                                     cute.make_layout(self.d_o_group)) for gi in range(groups)]
        fence_operand(acc_O)
        load(0)
        for ks in cutlass.range_constexpr(PAGE_SIZE // 16):
            raw = raws[ks % 2]
            scales = self._v_scales(scale_words[ks % 2])
            if const_expr(ks + 1 < PAGE_SIZE // 16):
                load(ks + 1)
            if valid < PAGE_SIZE:
                for e in cutlass.range_constexpr(2):
                    for o in cutlass.range_constexpr(2):
                        if 16 * ks + 8 * e + self.d_v_row[o] >= valid:
                            for i in cutlass.range_constexpr(4):
                                raw[4 * (2 * e + o) + i] = Int32(0)
            for gi in cutlass.range_constexpr(groups):
                j = ks * groups + gi  # MMA group count: its buffer is j's parity
                buf = rVa if const_expr(j % 2 == 0) else rVb
                if const_expr(j >= 2):
                    warpgroup.wait_group(1)
                b32 = cute.recast_tensor(buf, Int32)
                for tl in cutlass.range_constexpr(tiles):
                    t = gi * tiles + tl
                    sel = 0x5140 if t % 2 == 0 else 0x7362
                    for e in cutlass.range_constexpr(2):
                        pair = prmt(raw[4 * (2 * e) + t // 2], raw[4 * (2 * e + 1) + t // 2], sel)
                        lo, hi = e4m3x4_f16(pair)
                        if const_expr(scales is not None):
                            lo = hmul2(lo, scales[e])
                            hi = hmul2(hi, scales[e])
                        b32[4 * tl + 2 * e] = lo
                        b32[4 * tl + 2 * e + 1] = hi
                fence_operand(buf)
                warpgroup.fence()
                cute.gemm(atom_o, accs[gi], buf[None, None, 0], tOrP[None, None, ks], accs[gi])
                warpgroup.commit_group()
        warpgroup.wait_group(0)
        fence_operand(acc_O)

    def _v_scale_words(self, base, ks):
        """What _v_scales takes for O^T's k-step ks (loaded a k-step ahead): nothing here."""
        return None

    def _v_scales(self, words):
        """The f16x2 factors of O^T's A values at a k-step, per e (a word: the keys of the
        thread's rows o = 0, 1; its d values are all in one 128-wide group, v_chunk), or None:
        none here (e4m3 is exact)."""
        return None

    @cute.jit
    def _q_ready(self, wg, wq, lane, wtid, tidx) -> list:
        """Both consumer warpgroups (ping-pong; at 64 columns each its own column set), once Q
        has landed: Q (n x 576) permuted in place to S^T's latent order (latent_of), bf16 q
        converted to f16 times the power of two q_f16_factors picks from the tile's largest |q|;
        returns that factor's inverse (1 for fp16 q), once for each of the thread's columns. A
        thread takes whole 128-byte runs (a row's 64-wide group), read into registers before
        the first barrier (4, or the warpgroup's own) and written after it: threads without a
        run read the last one (for the largest |q|; nothing else), so its owner writes it only
        once they are past. Up to two waves of runs a thread are held in registers; more (64
        columns: 3) are read again after the barrier."""
        n = self.n_wg
        runs = n * N_TILES
        threads = 256 if const_expr(self.pingpong) else 128
        tid = tidx if const_expr(self.pingpong) else wtid
        waves = (runs + threads - 1) // threads
        hold = waves <= 2
        base = self.d_q_base
        if const_expr(not self.pingpong):
            base = base + wg * (n * D_QK * 2)
        held = []
        big = Int32(0)
        for w in cutlass.range_constexpr(waves):
            run = cutlass.min(w * threads + tid, runs - 1)  # (idle threads read the last run)
            row, c = run % n, run // n
            words = []
            for u in cutlass.range_constexpr(8):
                words += lds128(base + q_unit(row, c, u, n))
            if const_expr(hold):
                held.append(words)
            if const_expr(self.q_f16):
                big = finite_bf16_max(big, words)
        inv = Float32(1.0)
        mul = Float32(1.0)
        if const_expr(self.q_f16):
            for off in cutlass.range_constexpr(5):
                big = cutlass.max(big, cute.arch.shuffle_sync_bfly(big, offset=1 << off))
            qmax = self.d_storage.sQmax.get_tensor(cute.make_layout(8))
            if lane == 0:
                qmax[4 * wg + wq] = big
        self._q_barrier(wg)
        if const_expr(self.q_f16):
            if const_expr(self.pingpong):
                for i in cutlass.range_constexpr(8):
                    big = cutlass.max(big, qmax[i])
            else:
                for i in cutlass.range_constexpr(4):
                    big = cutlass.max(big, qmax[4 * wg + i])
            mul_bits, inv_bits = q_f16_factors(big, cutlass.max)
            mul = int_as_f32(mul_bits)
            inv = int_as_f32(inv_bits)
        for w in cutlass.range_constexpr(waves):
            run = w * threads + tid
            if run < runs:
                row, c = run % n, run // n
                if const_expr(hold):
                    words = held[w]
                else:
                    words = []
                    for u in cutlass.range_constexpr(8):
                        words += lds128(base + q_unit(row, c, u, n))
                words = self._q_words(c, words, mul)
                # destination chunk 2 jj + e2 takes the pairs 8 q + 2 jj + e2, q = 0..3
                for jj in cutlass.range_constexpr(4):
                    for e2 in cutlass.range_constexpr(2):
                        sts(base + q_unit(row, c, 2 * jj + e2, n),
                            [words[8 * q + 2 * jj + e2] for q in range(4)])
        cute.arch.fence_view_async_shared()
        self._q_barrier(wg)
        return [inv] * (n // 4)

    def _q_barrier(self, wg):
        """_q_ready's barrier: both warpgroups (4) in ping-pong, else the warpgroup's own."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=NB_PAIR, number_of_threads=256)
        else:
            cute.arch.barrier(barrier_id=NB_WG + wg, number_of_threads=128)

    @cute.jit
    def _q_words(self, c, words, mul):
        """_q_ready's hook: the words to store of a run of Q's 64-wide group c (a thread's 16
        values of each unit as loaded: words 8 q .. 8 q + 7): f16 times Q's factor mul under
        bf16 q, else as loaded."""
        if const_expr(self.q_f16):
            words = [bf16x2_to_f16x2(x, mul) for x in words]
        return words

    @cute.jit
    def _merge_and_store(self, r, slot, pieces, col0, rows, h_q, cnt, wg, wq, lane, wtid, acc_O,
                         m_run, l_run, sMax, mO, mLSE, mOacc, mLSEacc):
        """The segment's end: the second warpgroup hands its maxima, partial sums and O^T over
        (sMerge, thread by thread, in merge_rounds rounds: named barrier 5 when a round is
        written, 6 when it has been read); the first merges them into its own (the split-KV
        rule: each side times 2^(its max - the larger)) and stores through _epilogue. The next
        segment's round 0 cannot overwrite sMerge early: the second warpgroup writes it after
        that segment's _q_ready, whose barrier 4 the first meets only after its last read."""
        ncol = self.n_wg // 4
        rounds = self.merge_rounds
        per = len(merge_round(0, rounds, self.n_wg))
        sM = self.d_storage.sMerge.get_tensor(cute.make_layout((per, 128), stride=(1, per)))
        n_o = cute.size(acc_O)
        per_tile = n_o // (D_V // 64)
        # each side's factor per column (registers: set in round 0, used in later ones)
        f0 = cute.make_rmem_tensor(ncol, Float32)
        f1 = cute.make_rmem_tensor(ncol, Float32)
        for k in cutlass.range_constexpr(rounds):
            part = merge_round(k, rounds, self.n_wg)
            if wg == 1:
                if const_expr(k > 0):
                    bar_sync(NB_MERGE_READ, 256)
                for x in cutlass.range_constexpr(part.start, part.stop):
                    if const_expr(x < ncol):
                        sM[x - part.start, wtid] = m_run[x]
                    elif const_expr(x < 2 * ncol):
                        sM[x - part.start, wtid] = l_run[x - ncol]
                    else:
                        sM[x - part.start, wtid] = acc_O[x - 2 * ncol]
                bar_arrive(NB_MERGE, 256)
            else:
                bar_sync(NB_MERGE, 256)
                for x in cutlass.range_constexpr(part.start, part.stop):
                    v = sM[x - part.start, wtid]
                    if const_expr(x < ncol):
                        m_new, m_use, f_own = softmax.online_max(m_run[x], v)
                        f0[x] = f_own
                        f1[x] = cute.math.exp2(v - m_use, fastmath=True)
                        m_run[x] = m_new
                        l_run[x] = l_run[x] * f0[x]
                    elif const_expr(x < 2 * ncol):
                        l_run[x - ncol] = l_run[x - ncol] + v * f1[x - ncol]
                    else:
                        i = x - 2 * ncol
                        jc = 2 * (i % per_tile // 4) + i % per_tile % 2
                        acc_O[i] = acc_O[i] * f0[jc] + v * f1[jc]
                if const_expr(k + 1 < rounds):
                    bar_arrive(NB_MERGE_READ, 256)
        if wg == 0:
            self._epilogue(r, slot, pieces, col0, rows, h_q, cnt, 0, wq, lane, acc_O, m_run,
                           l_run, sMax, mO, mLSE, mOacc, mLSEacc)

    @cute.jit
    def _store_o(self, acc_O, inv, gOut, out_dtype: cutlass.Constexpr, col0, rows, wq, lane):
        """gOut (rows, 512) of out_dtype: O^T's row 64 t + 16 wq + g + 8 h is cache column
        d_of(t, h, wq, g); each value scaled by its column's inv. The two rows h = 0, 1 of a
        thread are adjacent columns: one store."""
        per_tile = cute.size(acc_O) // (D_V // 64)
        g = lane // 4
        pair = cute.make_rmem_tensor(2, out_dtype)
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            v, mt = i % per_tile, i // per_tile
            if const_expr((v // 2) % 2 == 0):  # with its h = 1 partner, i + 2: d and d + 1
                jc = 2 * (v // 4) + v % 2
                row = col0 + 8 * (v // 4) + 2 * (lane % 4) + v % 2
                if row < rows:
                    pair[0] = (acc_O[i] * inv[jc]).to(out_dtype)
                    pair[1] = (acc_O[i + 2] * inv[jc]).to(out_dtype)
                    dst = cute.local_tile(gOut[row, None], (2,), (d_of(mt, 0, wq, g) // 2,))
                    dst.store(pair.load())


def decode_kernel(config, arch: str):
    """The kernel a registry config asks for (dtype, causal, columns); arch is sm_90a."""
    from ..contract import dsl_dtype

    return MLADecodeSm90KeysMRS(dsl_dtype(config.dtype), config.causal, config.columns)
