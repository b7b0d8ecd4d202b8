"""Sparse MLA decode (DeepSeek Sparse Attention) on the keys-on-M ping-pong kernel over the FP8
caches (cp.async gather into the whole-line ring), CuTe DSL, SM90.

Problem and mapping: as sm90_keysm_sparse_decode.py (each (request, query token) pair is one
request of the walk with h_q query rows and topk_length[r] keys; a block of the walk is 64
consecutive entries of the token's row; the step and its views are sm80_sparse_decode's
MLASparseDecodeStep). The kernel is sm90_keysm_rs_decode.py's ping-pong variant (two consumer
warpgroups on alternate blocks, page operands converted from the fp8 ring into registers),
whose walk, MMAs, softmax, merge and epilogue run unchanged. What differs (the GatheredEntries
hooks of sm90_sparse_decode.py, as the keys-on-M sparse kernel takes them):
  - no TMA for the cache (_line_tma): the producer warp reads the block's 64 entries, writes the
    stage's bias row (0, or -inf for an entry that names no key) and copies each named row by
    cp.async (gather_lines): an e4m3 row's 576 bytes to where the TMA box would put them (row r
    at r x 576 of the stage); an entry that names no key reads nothing (source size 0: a zero
    row);
  - the stage's full mbarrier takes 33 arrivals (GatheredEntries.k_arrivals): every lane's
    cp.async.mbarrier.arrive.noinc, one after the warp's bias stores;
  - the scores get the stage's bias (_mask_entries), read right after the full wait.
The consumers read the stage with ld.shared (the generic proxy, as cp.async writes it): no
proxy fence.

The 656-byte rows (cache "fp8_ds_mla", bf16 q): a ring row is DS_ROW_BYTES (704) wide, its 512
e4m3 values and 16 bytes of scales where the cache row has them, its 128 bytes of bf16 rope at
576 (chunks swapped in odd rows: ds_rope_chunk); 44 KB a stage, 4 stages. The hooks of the
dense ping-pong's MMAs take the scales and the rope:
  - S^T: e4m3 groups 2 i and 2 i + 1 (latent columns 128 i ..) accumulate into accumulator i
    (four beside acc_S); the rope's 4 k-steps are bf16 MMAs (A: the rope words as loaded, no
    conversion; B: sQr, Q's rope tile in sQ, which _q_words leaves in bf16 times Q's factor
    instead of converting it to f16) into acc_S; then
    acc_S += each accumulator times its row's scale (float32: exact for power-of-two scales,
    _s_done). Q's e4m3 columns are f16 as in the dense kernel.
  - O^T: a thread's d values all lie in one scale group (wq: v_chunk), so its A values of a
    key pair are multiplied, in f16, by that pair's scales (one mul.rn.f16x2 a register;
    exact for power-of-two scales where the product is a normal f16). f16 bounds the
    dequantized values (|x| < 65504; the latent's are far below). The scales themselves are
    rounded to f16 here (S^T keeps them in float32): exact for DeepSeek's powers of two (at
    least 2^-13: append_kv floors the scale at 1e-4); an unrounded amax / 448 (vLLM's
    writer) is off by up to 2^-11 relative, below 2^-14 by more (a subnormal), and above
    65504 it would be inf.

Limits: bf16/fp16 q over an e4m3 cache (float8_e4m3fn with a per-tensor kv_scale), bf16 q over
the 656-byte rows; d_qk 576, d_v 512, 64-token pages (any page and row strides, 16-byte
multiples), any h_q: columns 8, 16, 32 or 64 (ops/sparse.py, keysm_rs_sparse_columns), above 64
heads a CTA for each 64 heads of a token (the grid's m-blocks; each gathers the token's rows:
the two are launched side by side, so the second may find them in L2; not measured). At 32
columns (a ping-pong of two warpgroups of 32) and 64 (the dense kernel's column split: two
warpgroups of 32, both reading every stage, 3 ring stages, no merge) the ping-pong's registers
leave the gathering producer warpgroup 24: at 32 its steps are a loop (rolled_gather; unrolled,
ptxas spilled 20 bytes there). Over the 656-byte rows S^T's A values are then multiplied by
their row's scale in f16 (fold_s_scales: the four scale-group accumulators do not fit beside
O^T's 128 registers), the scales read a scale group at a time. At 32 columns over the 656-byte
rows the four 44 KB stages leave the merge 21 rounds of 7 floats (merge_rounds), where ptxas
spills 20 bytes; at 64 it spills up to 20 outside the page loop (nvdisasm, session 25). Not
causal; the sink is applied by the host. One producer warp a ring stage (producer_warps: 4, or
3 at 64 columns).
Status: run on an H100 in session 26 over both FP8 formats: correct (the GPU tests at h_q
1-128, memcheck), slower than the default choice at h_q 64-128 and at small batches
(docs/kernels/sparse.md, "Session 26"). No spill at 8 and 16 columns. The dispatch never takes
it unless TORCH_MLA_SPARSE_KEYSM_RS=1 (or 32: at most 32 columns a CTA; ops/sparse.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from ..constants import D_QK, FP8_DS_MLA_ROPE_AT, FP8_DS_MLA_SCALES_AT, PAGE_SIZE
from .ptx import (
    bf16x2_to_f16x2,
    cp_async16,
    f16x2,
    fence_operand,
    int_as_f32,
    lds32,
    lds128,
)
from .sm80_sparse_decode import MLASparseDecodeStep
from .sm90_keysm_decode import N_TILES
from .sm90_keysm_rs_decode import MLADecodeSm90KeysMRS
from .sm90_keysm_sparse_decode import EntryBias
from .sm90_sparse_decode import GatheredEntries, gather8_offsets, row_source

# The 656-byte rows in a ring stage: row r at r x DS_ROW_BYTES (704 = 576 + 128: rows alternate
# bank halves as at 576, so S^T's and O^T's loads conflict as in the dense kernel): its 512 e4m3
# values at 0, its four float32 scales at DS_SCALES_AT (512, as in the cache), its 64 bf16 rope
# values at DS_ROPE_AT (576), 16-byte chunk u at chunk u ^ (r % 2) (ds_rope_chunk: S^T's rope
# loads are then conflict-free); bytes 528-575 unused.
DS_ROW_BYTES = D_QK + 128
DS_SCALES_AT = FP8_DS_MLA_SCALES_AT
DS_ROPE_AT = D_QK
DS_STAGE_BYTES = PAGE_SIZE * DS_ROW_BYTES  # 44 KB


def ds_rope_chunk(row: int, u: int) -> int:
    """The byte offset in ring row `row`'s slot of its rope chunk u (bf16 values 8 u .. 8 u + 7)."""
    return DS_ROPE_AT + 16 * (u ^ (row % 2))


def gather_lines_offsets(lane: int, j: int, t: int, ds: bool = False) -> tuple:
    """The copy of lane `lane` at step j (0..7), copy t of gather_lines: (row, which of the
    lane's entries names it (0: keys 0..31, 1: 32..63), byte offset in the cache row, byte
    offset in the stage). e4m3 rows (t 0..8): the 16-byte chunk lane % 4 of 64-byte group t,
    row r at r x 576. The 656-byte rows (ds; t 0..9): t < 8 the same chunks of the e4m3 values,
    t = 8, 9 rope chunks lane % 4 and lane % 4 + 4, row r at r x DS_ROW_BYTES (the scales:
    gather_ds_scales)."""
    row, c, _ = gather8_offsets(lane, j)  # row = lane / 4 + 8 j
    if not ds:
        byte = 64 * t + 16 * c
        return row, j // 4, byte, row * D_QK + byte  # (j // 4 = row // 32, known at compile time)
    if t < N_TILES - 1:
        byte = 64 * t + 16 * c
        return row, j // 4, byte, row * DS_ROW_BYTES + byte
    u = c + 4 * (t - (N_TILES - 1))
    return (row, j // 4, FP8_DS_MLA_ROPE_AT + 16 * u,
            row * DS_ROW_BYTES + ds_rope_chunk(row, u))


def gather_copies(ds: bool) -> int:
    """gather_lines' copies a lane and row step: 9 (e4m3), 10 (the 656-byte rows)."""
    return N_TILES + (1 if ds else 0)


@cute.jit
def gather_lines(slots, rows, stage, ds: cutlass.Constexpr = False,
                 rolled: cutlass.Constexpr = False):
    """One warp: the rows of the 64 keys whose slots the lanes hold (slots: keys lane and
    lane + 32; rows: the cache's (base address, row stride, page stride) in bytes) to shared
    address `stage` (gather_lines_offsets: 576-byte e4m3 rows as the whole-line ring holds
    them, or the 656-byte rows' values and rope). Step j: lanes 4 q .. 4 q + 3 copy row
    q + 8 j, 8 rows an instruction, 64 contiguous bytes a row. rolled: the 4 steps of each of
    a lane's two entries as a loop (fewer live addresses: a producer of 24 registers)."""
    lane = cute.arch.lane_idx()
    if const_expr(rolled):
        for h in cutlass.range_constexpr(2):
            for jj in cutlass.range(PAGE_SIZE // 16, unroll=1):
                _gather_step(lane, jj + 4 * h, h, slots, rows, stage, ds)
    else:
        for j in cutlass.range_constexpr(PAGE_SIZE // 8):
            _gather_step(lane, j, j // 4, slots, rows, stage, ds)


@cute.jit
def _gather_step(lane, j, h: cutlass.Constexpr, slots, rows, stage, ds: cutlass.Constexpr):
    """gather_lines' step j (h = j / 4: which of the lane's entries names its rows)."""
    row, _, _, _ = gather_lines_offsets(lane, j, 0, ds)
    # (row's entry is slots[h] of lane row % 32)
    src, size = row_source(*rows, cute.arch.shuffle_sync(slots[h], row % 32))
    for t in cutlass.range_constexpr(gather_copies(ds)):
        _, _, byte, dst = gather_lines_offsets(lane, j, t, ds)
        cp_async16(stage + dst, src + byte, size)


@cute.jit
def gather_ds_scales(slots, rows, stage):
    """One warp: the 656-byte rows' scales (16 bytes a row) of keys lane and lane + 32 (the
    lane's own entries) to their places in the stage (DS_SCALES_AT of the row's slot)."""
    lane = cute.arch.lane_idx()
    for h in cutlass.range_constexpr(2):
        src, size = row_source(*rows, slots[h])
        cp_async16(stage + (lane + 32 * h) * DS_ROW_BYTES + DS_SCALES_AT,
                   src + FP8_DS_MLA_SCALES_AT, size)


class MLASparseDecodeKeysMRS(EntryBias, GatheredEntries, MLADecodeSm90KeysMRS):
    """The keys-on-M ping-pong kernel over gathered entries of an e4m3 cache or the 656-byte
    rows; see the module docstring. (EntryBias: the keys-on-M sparse kernel's bias rows; S^T's
    row m is page row m here too.)"""

    def __init__(self, dtype, columns: int, cache: str = "e4m3"):
        assert cache in ("e4m3", "fp8_ds_mla"), cache
        assert cache == "e4m3" or dtype == cutlass.BFloat16, (cache, dtype)
        super().__init__(dtype, False, columns)
        self.cache = cache
        self.ds = cache == "fp8_ds_mla"
        if self.ds:
            self.row_bytes = DS_ROW_BYTES
            self.stage_bytes = DS_STAGE_BYTES
        # The producer warpgroup's warps gather, warp i into ring stage i (4; 3 at 64 columns):
        # one page's chain each (entries, wait, bias, copies), overlapping. One warp's chain
        # bounded the keys-on-M sparse kernel: 81-93% of its time with every entry -1
        # (sparse.md, session 19).
        self.producer_warps = self.stages
        # The gather's steps as a loop at 32 columns: its 24 registers then suffice (ptxas
        # spilled 20 bytes with them unrolled). At 64 columns the producer has 24 registers too,
        # and the 20 bytes ptxas spills there are not its: unrolled as before.
        self.rolled_gather = self.pingpong and self.n_wg == 32
        # 32 columns a warpgroup (32, 64 columns): the four scale-group accumulators would not fit
        # beside O^T; S^T's A values are multiplied by their row's scale instead (f16)
        self.fold_s_scales = self.ds and self.n_wg == 32

    def _more_smem(self) -> dict:
        return EntryBias._more_smem(self)

    def _line_tma(self, op, mKV: cute.Tensor):
        """No TMA for the cache: the gathers address it as (64 rows, row bytes, pages)."""
        return self._cache_tma(op, cute.make_tensor(
            mKV.iterator, cute.select(mKV.layout, mode=[1, 2, 0])))

    @cute.jit
    def _load_page(self, tma_k, mKV, tKsK, page, cnt, bar_full, bar_empty, page_bytes):
        """The producer warp: the 64 keys block `page` names into the ring stage of use cnt[0]
        (EntryBias._claim_stage: its entries, the wait, its bias row), then the copies;
        cnt[0] += 1."""
        s, slots, _ = self._claim_stage(page, cnt, bar_empty)
        rows = self._cache_rows(mKV)
        stage = self.d_k8 + s * self.stage_bytes
        gather_lines(slots, rows, stage, self.ds, self.rolled_gather)
        if const_expr(self.ds):
            gather_ds_scales(slots, rows, stage)
        self._arrive_gathered([bar_full + s])
        cnt[0] = cnt[0] + 1

    # ---- the 656-byte rows (ds): S^T's scales and rope, O^T's scales ---------------------------
    @cute.jit
    def _s_operands(self, thr_s, sQ, wq, g, q):
        """The ping-pong's S^T operands; with the 656-byte rows also the rope MMAs' (bf16, A
        from registers: the rope words as loaded; B: sQr, _q_words) and the four scale groups'
        accumulators (S^T's e4m3 groups 2 i and 2 i + 1 go to accumulator i)."""
        ops = MLADecodeSm90KeysMRS._s_operands(self, thr_s, sQ, wq, g, q)
        if const_expr(self.ds):
            n = self.n_wg
            bf16 = cutlass.BFloat16
            kmode = cute.nvgpu.OperandMajorMode.K
            self.d_tiled_r = sm90_utils.make_trivial_tiled_mma(
                bf16, bf16, kmode, kmode, Float32, (1, 1, 1), (PAGE_SIZE, n),
                warpgroup.OperandSource.RMEM)
            k_atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(
                cutlass.utils.LayoutEnum.ROW_MAJOR, bf16, 64), bf16)
            qr = cute.tile_to_shape(k_atom, (n, 64), order=(0, 1))
            # sQr: Q's rope tile (the warpgroup's column set's last 64-wide group, n x 64) in
            # bf16, where _q_words stored it
            qr_ptr = (self.d_storage.sQ.data_ptr() + self.d_qset * (n * D_QK)
                      + (N_TILES - 1) * (n * 64))
            sQr = cute.make_tensor(cute.recast_ptr(qr_ptr, qr.inner, cutlass.BFloat16), qr.outer)
            tidx, _, _ = cute.arch.thread_idx()
            thr_r = self.d_tiled_r.get_slice(tidx % 128)
            tSrQr = thr_r.make_fragment_B(thr_r.partition_B(sQr))  # (MMA, 1, 4)
            rows = [16 * wq + 8 * h + g for h in range(2)]
            self.d_k_row = [rows[h] * DS_ROW_BYTES for h in range(2)]
            # rope chunks 2 q, 2 q + 1 (ds_rope_chunk; a row's parity is g's)
            self.d_rope_off = [[self.d_k_row[h] + DS_ROPE_AT + 16 * ((2 * q + i) ^ (g % 2))
                                for i in range(2)] for h in range(2)]
            groups = []
            if const_expr(not self.fold_s_scales):
                groups = [cute.make_rmem_tensor(thr_s.partition_shape_C((PAGE_SIZE, n)),
                                                Float32) for _ in range(4)]
            ops = ops + (tSrQr, groups)
        return ops

    def _s_accs(self, ops, acc_S) -> list:
        """acc_S (the rope's scores, then the sum), then the scale groups' (ds; none where the
        scales are folded into S^T's A values)."""
        return [acc_S] + list(ops[7]) if self.ds else [acc_S]

    @cute.jit
    def _s_words(self, base, c):
        """The ds rope group (c = 8): the thread's 32 bytes (16 bf16 values) of rows g, g + 8.
        fold_s_scales: an even e4m3 group's words end with the row's scale of groups c, c + 1
        (loaded with them, a group ahead: two scale words live, not all eight)."""
        if const_expr(self.ds and c == N_TILES - 1):
            return [lds128(base + self.d_rope_off[h][0]) + lds128(base + self.d_rope_off[h][1])
                    for h in range(2)]
        words = MLADecodeSm90KeysMRS._s_words(self, base, c)
        if const_expr(self.fold_s_scales and c % 2 == 0):
            words = [words[h] + [lds32(base + self.d_k_row[h] + DS_SCALES_AT + 4 * (c // 2))]
                     for h in range(2)]
        return words

    @cute.jit
    def _s_group(self, ops, accs, c, cur, acc=None, first=0):
        """ds: e4m3 group c into its scale group's accumulator (accs[1 + c / 2]); the rope
        group (bf16 words straight into the A fragment: word 2 jj + e of a row is k-step jj's
        pair e, as latent_of orders Q) into acc_S."""
        if const_expr(not self.ds):
            MLADecodeSm90KeysMRS._s_group(self, ops, accs, c, cur)
        elif const_expr(c < N_TILES - 1 and self.fold_s_scales):
            if const_expr(c % 2 == 0):  # (the scale pair of groups c, c + 1: _s_words)
                self.d_s_scale = [f16x2(int_as_f32(cur[h][4]), int_as_f32(cur[h][4]))
                                  for h in range(2)]
            MLADecodeSm90KeysMRS._s_group(self, ops, accs, c, cur, scale=self.d_s_scale)
        elif const_expr(c < N_TILES - 1):
            MLADecodeSm90KeysMRS._s_group(self, ops, accs, c, cur, accs[1 + c // 2],
                                          2 * (c // 2))
        else:
            rK, tSrQr = ops[0], ops[6]  # (c even: buffer rKa, free since group c - 2 is done)
            b32 = cute.recast_tensor(rK, Int32)
            for jj in cutlass.range_constexpr(4):
                for e in cutlass.range_constexpr(2):
                    b32[4 * jj + 2 * e] = cur[0][2 * jj + e]
                    b32[4 * jj + 2 * e + 1] = cur[1][2 * jj + e]
            fence_operand(rK)
            warpgroup.fence()
            rR = cute.recast_tensor(rK, cutlass.BFloat16)
            atom_r = cute.make_mma_atom(self.d_tiled_r.op)
            for jj in cutlass.range_constexpr(4):  # (folded: onto the e4m3 groups' sum)
                atom_r.set(warpgroup.Field.ACCUMULATE, jj != 0 or self.fold_s_scales)
                cute.gemm(atom_r, accs[0], rR[None, None, jj], tSrQr[None, None, jj], accs[0])

    @cute.jit
    def _s_done(self, accs, base):
        """ds: S^T = rope scores + each scale group's scores times its row's scale (float32,
        exact as the rows' scales are powers of two)."""
        if const_expr(self.ds and not self.fold_s_scales):
            acc_S = accs[0]
            sc = [lds128(base + self.d_k_row[h] + DS_SCALES_AT) for h in range(2)]
            for idx in cutlass.range_constexpr(cute.size(acc_S)):
                h = (idx // 2) % 2  # acc_S value idx: row 16 wq + lane / 4 + 8 h
                v = acc_S[idx]
                for grp in cutlass.range_constexpr(4):
                    v = v + int_as_f32(sc[h][grp]) * accs[1 + grp][idx]
                acc_S[idx] = v

    @cute.jit
    def _v_scale_words(self, base, ks):
        """ds: the scales of the thread's group (its d values are all in 128-wide group wq:
        v_chunk) of its four keys of k-step ks, [e][o]."""
        if const_expr(not self.ds):
            return None
        wq = (cute.arch.thread_idx()[0] // 32) % 4
        return [[lds32(base + (16 * ks + 8 * e + self.d_v_row[o]) * DS_ROW_BYTES + DS_SCALES_AT
                       + 4 * wq) for o in range(2)] for e in range(2)]

    @cute.jit
    def _v_scales(self, words):
        """ds: per e the f16x2 pair of the scales of keys o = 0, 1 (the pair's order in the A
        words: prmt puts row o = 0's byte low)."""
        if const_expr(not self.ds):
            return None
        return [f16x2(int_as_f32(words[e][0]), int_as_f32(words[e][1])) for e in range(2)]

    @cute.jit
    def _q_words(self, c, words, mul):
        """ds: Q's rope run (c = 8) stays bf16, times Q's factor (exact: a power of two), for
        the rope's bf16 MMAs (their B operand, sQr, is this tile of sQ); the rest as the dense
        ping-pong converts it (c is known at run time only: both, then a select a word)."""
        out = MLADecodeSm90KeysMRS._q_words(self, c, words, mul)
        if const_expr(self.ds):
            rope = c == N_TILES - 1
            out = [Int32(cutlass.select_(rope, bf16x2_to_f16x2(x, mul, "bf16"), y))
                   for x, y in zip(words, out)]
        return out


# --- compile entry (ops/registry.py: SparseStepConfig, backend "sm90_keysm_rs") ---------------


def compile_sparse_step(config, arch: str):
    """The sparse ping-pong step (dtype, cache format, columns), compiled for arch (sm_90a)."""
    from ..contract import compile_sparse_step_kernel, dsl_dtype

    dtype = dsl_dtype(config.dtype)
    decode = MLASparseDecodeKeysMRS(dtype, config.columns, config.cache)
    return compile_sparse_step_kernel(MLASparseDecodeStep(decode, dtype, use_pdl=True), dtype,
                                      arch, config.cache)
