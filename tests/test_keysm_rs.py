"""The ping-pong keys-on-M kernel over an e4m3 cache (cute_kernels/sm90_keysm_rs_decode.py):
its operand orders modelled in Python and checked against the DSL's fragment layouts, its
shared-memory loads counted for bank conflicts, the registry entry and the dispatch's flag; on an
SM90 GPU the kernel against the fp32 reference (TORCH_MLA_KEYSM_RS=1)."""


import pytest
import torch
from expecttest import assert_expected_inline
from test_keysm import BYTE_OF, keysm, sm90, wrong_lines  # noqa: F401 (keysm: a fixture)
from test_keysm import run_and_check as keysm_check

from torch_mla.constants import KEYSM_RS_COLUMNS, KEYSM_RS_MIN_BATCH
from torch_mla.cute_kernels.sm90_keysm_rs_decode import (
    d_of,
    latent_of,
    merge_round,
    merge_rounds,
    page_row,
    q_byte,
    q_unit,
    v_chunk,
)
from torch_mla.ops import dispatch, registry

LANES = [(wq, lane) for wq in range(4) for lane in range(32)]


def test_orders_are_bijections():
    assert all(page_row(page_row(m)) == m for m in range(64))
    assert sorted(latent_of(k) for k in range(576)) == list(range(576))
    assert sorted(d_of(t, h, wq, lane // 4) for t in range(8) for h in range(2)
                  for wq, lane in LANES if lane % 4 == 0) == list(range(512))


def rs_kernels():
    """The ping-pong kernel and its fast subclass, as objects (their index hooks are Python)."""
    import cutlass

    from torch_mla.cute_kernels.sm90_keysm_fast_decode import MLADecodeSm90KeysMFast
    from torch_mla.cute_kernels.sm90_keysm_rs_decode import MLADecodeSm90KeysMRS

    return [cls(cutlass.BFloat16, False, 16) for cls in (MLADecodeSm90KeysMRS,
                                                          MLADecodeSm90KeysMFast)]


def test_s_operand_reads_its_fragment():
    """S^T's A, word w of k-step j = 4 c + jj (the fragment's row m = 16 wq + g + 8 (w % 2),
    k = 16 j + 2 q + 8 (w // 2) + {0, 1}): the kernel loads 16 bytes at _stage_offset(16 wq +
    8 h + g, 16 q) plus 64 c (_s_operands, _mma_s) and takes half w // 2 of word jj; that is
    the cache's latent_of(k) of S^T's row m's page row (_key_row)."""
    kern = rs_kernels()[0]
    for wq, lane in LANES:
        g, q = lane // 4, lane % 4
        for w in range(4):
            m = 16 * wq + g + 8 * (w % 2)
            load = kern._stage_offset(m, 16 * q)
            for j in range(36):
                c, jj = j // 4, j % 4
                for i in range(2):
                    k = 16 * j + 2 * q + 8 * (w // 2) + i
                    at = load + 64 * c + 4 * jj + 2 * (w // 2) + i
                    assert at == kern._stage_offset(kern._key_row(m), latent_of(k))


def test_q_permutation_stores():
    """_q_ready: destination chunk 2 jj + e2 of a 64-wide group takes the source pairs
    8 q + 2 jj + e2 (q = 0..3) as its words q: logical pair 4 (2 jj + e2) + q holds the cache's
    pair latent_of of it."""
    for jj in range(4):
        for e2 in range(2):
            for q in range(4):
                logical = 4 * (2 * jj + e2) + q
                assert latent_of(2 * logical) == 2 * (8 * q + 2 * jj + e2)
                assert latent_of(2 * logical + 1) == 2 * (8 * q + 2 * jj + e2) + 1


@pytest.mark.parametrize("n", sorted({min(n, 32) for n in KEYSM_RS_COLUMNS}))  # (Q set rows)
def test_q_units(n):
    """_q_ready's 16-byte units (q_unit) hold the elements q_byte places there."""
    for row in range(n):
        for c in range(9):
            for u in range(8):
                for i in range(8):
                    assert q_unit(row, c, u, n) + 2 * i == q_byte(row, 64 * c + 8 * u + i, n)


def test_v_operand_rows_and_columns():
    """O^T's A for k-step ks, m-tile t: words 2 e + hh are (d row g + 8 hh, keys 2 q + 8 e +
    {0, 1}); the kernel pairs byte 2 t + hh of its loads at d_v_off[o] (_stage_offset of page
    row page_row(2 q + o), the thread's chunk) plus (16 ks + 8 e) row_bytes: the page row
    page_row(16 ks + 8 e + 2 q + o) at cache column d_of(t, hh), as the epilogue stores it."""
    kern = rs_kernels()[0]
    for wq, lane in LANES:
        g, q = lane // 4, lane % 4
        for o in range(2):
            base = kern._stage_offset(page_row(2 * q + o), v_chunk(wq, g))
            for ks in range(4):
                for e in range(2):
                    row = page_row(16 * ks + 8 * e + 2 * q + o)
                    for t in range(8):
                        for hh in range(2):
                            at = base + (16 * ks + 8 * e) * kern.row_bytes + 2 * t + hh
                            assert at == kern._stage_offset(row, d_of(t, hh, wq, g))


def test_pt_key_pairs_s_rows_with_v_rows():
    """S^T's row m is written to P^T's key _pt_key(m); O^T's key k reads page row page_row(k);
    that must be S^T's row m's page row (_key_row), in both variants."""
    for kern in rs_kernels():
        assert all(page_row(kern._pt_key(m)) == kern._key_row(m) for m in range(64))
        assert [kern._key_row(m) for m in range(64)] == list(range(64))


def bank_groups(addresses):
    """The 16-byte bank groups (0..7) of one 8-lane phase of 16-byte loads."""
    return [(a // 16) % 8 for a in addresses]


def test_stage_loads_bank_conflicts():
    """The page rows are 576 bytes (144 words: rows alternate bank halves). S^T's loads (rows
    g, g + 8 of a warp's 16, bytes 16 q of a group) are conflict-free; O^T's (rows
    page_row(2 q + o) + 8 e + 16 ks, the thread's d chunk) are 2-way conflicted, the least
    without a swizzle: a phase's lanes hold two d chunks (g) and the rows bring two bank
    halves. Without page_row (rows 2 q + o, all of one parity) they would be 4-way."""
    for wq in range(4):
        for phase in range(4):
            lanes = range(8 * phase, 8 * phase + 8)
            for h in range(2):
                for c in range(9):
                    got = bank_groups((16 * wq + 8 * h + ln // 4) * 576 + 64 * c + 16 * (ln % 4)
                                      for ln in lanes)
                    assert sorted(got) == list(range(8))
            for o in range(2):
                got = bank_groups(page_row(2 * (ln % 4) + o) * 576 + v_chunk(wq, ln // 4)
                                  for ln in lanes)
                assert max(got.count(x) for x in got) == 2
                plain = bank_groups((2 * (ln % 4) + o) * 576 + v_chunk(wq, ln // 4)
                                    for ln in lanes)
                assert max(plain.count(x) for x in plain) == 4


def test_ds_stage_loads_bank_conflicts():
    """The sparse ping-pong's 656-byte rows in a ring stage (sm90_keysm_rs_sparse_decode.py,
    DS_ROW_BYTES 704 = 576 + 128): S^T's e4m3 loads conflict as at 576 (none), O^T's likewise
    (2-way); the rope loads (chunks 2 q, 2 q + 1 of rows g, g + 8, each chunk at u ^ (row % 2):
    ds_rope_chunk) are conflict-free, and would be 2-way without the xor; S^T's scale loads
    (rows g, g + 8: four lanes a row) touch two bank groups; O^T's scale words (ld.shared.b32,
    the whole warp one phase: four keys a warp, 176 words apart) are 2-way conflicted."""
    from torch_mla.cute_kernels.sm90_keysm_rs_sparse_decode import (
        DS_ROPE_AT,
        DS_ROW_BYTES,
        DS_SCALES_AT,
        ds_rope_chunk,
    )

    rb = DS_ROW_BYTES
    for wq in range(4):
        for phase in range(4):
            lanes = range(8 * phase, 8 * phase + 8)
            for h in range(2):
                rows = [16 * wq + 8 * h + ln // 4 for ln in lanes]
                for c in range(8):
                    got = bank_groups(r * rb + 64 * c + 16 * (ln % 4) for r, ln in zip(rows, lanes))
                    assert sorted(got) == list(range(8))
                for i in range(2):
                    got = bank_groups(r * rb + ds_rope_chunk(r, 2 * (ln % 4) + i)
                                      for r, ln in zip(rows, lanes))
                    assert sorted(got) == list(range(8))
                    plain = bank_groups(r * rb + DS_ROPE_AT + 16 * (2 * (ln % 4) + i)
                                        for r, ln in zip(rows, lanes))
                    assert max(plain.count(x) for x in plain) == 2
                scales = {r * rb + DS_SCALES_AT for r in rows}  # (4 lanes a row: one address)
                assert len(scales) == len(set(bank_groups(scales))) == 2
            for o in range(2):
                got = bank_groups(page_row(2 * (ln % 4) + o) * rb + v_chunk(wq, ln // 4)
                                  for ln in lanes)
                assert max(got.count(x) for x in got) == 2
        for ks in range(4):
            for e in range(2):
                for o in range(2):
                    words = {((16 * ks + 8 * e + page_row(2 * (ln % 4) + o)) * rb + DS_SCALES_AT
                              + 4 * wq) // 4 for ln in range(32)}
                    banks = [w % 32 for w in words]
                    assert len(words) == 4 and max(banks.count(b) for b in banks) == 2


def test_ds_rope_operand_matches_q_order():
    """The rope k-steps over the 656-byte rows: the thread's words (chunks 2 q, 2 q + 1 of its
    row's rope: bf16 values 16 q .. 16 q + 15, word w = values 16 q + 2 w, + 1) give k-step jj's
    register pair e as word 2 jj + e, and the value at logical k 16 jj + 2 q + (0, 1 | 8, 9) is
    then rope value latent_of(512 + k) - 512: the order Q's rope has in sQr (and sQ)."""
    for q in range(4):
        for jj in range(4):
            for e in range(2):
                w = 2 * jj + e
                values = [16 * q + 2 * w, 16 * q + 2 * w + 1]
                ks = [16 * jj + 2 * q + 8 * e, 16 * jj + 2 * q + 8 * e + 1]
                assert values == [latent_of(512 + k) - 512 for k in ks]


def test_merge_rounds_and_registry():
    """One merge round at 8 and 16 columns, three at 32 (O^T's 128 floats a thread); the rounds
    cover each float once, maxima and sums first (round 0 computes the factors). 64 columns
    (two warpgroups of 32 split them: no merge) is a registry variant; fast mode is not."""
    assert KEYSM_RS_COLUMNS == (8, 16, 32, 64)
    pingpong = KEYSM_RS_COLUMNS[:3]
    assert [merge_rounds(n) for n in pingpong] == [1, 1, 3]
    for n in pingpong:
        k = merge_rounds(n)
        got = [x for r in range(k) for x in merge_round(r, k, n)]
        assert got == list(range(n // 2 + 4 * n))
        assert n // 2 <= len(merge_round(0, k, n))  # (the maxima and sums in round 0)
    c = registry.DecodeStepConfig("sm90_keysm_rs", "bf16", True, kv_fp8=True, columns=32)
    assert (c.name, c.key()) == ("step_sm90_keysm_rs", {"dtype": "bf16", "causal": True,
                                                         "kv": "e4m3", "columns": 32})
    for bad in (dict(columns=16), dict(columns=0, kv_fp8=True)):
        with pytest.raises(ValueError):
            registry.DecodeStepConfig("sm90_keysm_rs", "bf16", False, **bad)
    with pytest.raises(ValueError):  # (fast mode: 8, 16 and 32 columns)
        registry.DecodeStepConfig("sm90_keysm_fast", "bf16", False, kv_fp8=True, compute="fp8",
                                  columns=64)
    got = registry.variants(("bf16",), (False,), ("keysm_rs",))
    assert sorted(v.config.columns for v in got) == [8, 16, 32]
    got = registry.variants(("bf16",), (False,), ("keysm_rs", "keysm64"))
    assert sorted(v.config.columns for v in got if v.config.backend == "sm90_keysm_rs") == [
        8, 16, 32, 64]
    got = registry.variants(("bf16",), (False,), ("keysm_fast",))
    assert sorted(v.config.columns for v in got) == [8, 16, 32]


LAYOUT_SCRIPT = r"""
import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup, OperandMajorMode
from torch_mla.cute_kernels.sm90_keysm_decode import smem_layouts
from torch_mla.cute_kernels.sm90_keysm_rs_decode import q_byte
""" + BYTE_OF + r"""

@cute.jit
def check(n: cutlass.Constexpr):
    dt = cutlass.Float16
    _, sQ, _, _, _, _ = smem_layouts(dt, n, 2, 1)
    bad_q = sum(byte(sQ, (r, k, 0)) != q_byte(r, k, n) for r in range(n) for k in range(0, 576, 5))
    # register A: word w of a k-step is (m g + 8 (w % 2), k 2 q + 8 (w // 2) + {0, 1})
    bad_a = 0
    mma = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN,
                                            cutlass.Float32, (1, 1, 1), (64, n),
                                            warpgroup.OperandSource.RMEM)
    tv = mma.tv_layout_A_tiled
    for t in cutlass.range_constexpr(128):
        for v in cutlass.range_constexpr(8):
            w, i = v // 2, v % 2
            m = 16 * (t // 32) + (t % 32) // 4 + 8 * (w % 2)
            k = 2 * (t % 4) + 8 * (w // 2) + i
            bad_a += cute.crd2idx((t, v), tv) != m + 64 * k
    print(f"n {n}: Q {bad_q}, A {bad_a} wrong")

for n in (8, 16, 32):
    check(n)
"""


def test_layouts_match_the_models(tmp_path):
    """q_byte is the DSL's Q layout; the register A fragment's order is the one the kernel
    fills (word w: rows g + 8 (w % 2), k 2 q + 8 (w // 2))."""
    assert_expected_inline(wrong_lines(tmp_path, LAYOUT_SCRIPT), """\
n 8: Q 0, A 0 wrong
n 16: Q 0, A 0 wrong
n 32: Q 0, A 0 wrong""")


def test_dispatch_choice(monkeypatch):
    """An e4m3 cache's keys-on-M steps of 8, 16 or 32 columns and one KV head run this kernel
    from a batch of KEYSM_RS_MIN_BATCH[columns] (8, 8, 32; read at each call:
    TORCH_MLA_KEYSM_RS=1 at any batch, =0 never); at 64 columns only with
    TORCH_MLA_KEYSM_RS=1; over a 16-bit cache or several KV heads the keys-on-M steps run."""
    monkeypatch.delenv("TORCH_MLA_KEYSM_RS", raising=False)
    rs = ["sm90_keysm", "sm90_keysm_rs"] * 3 + ["sm90_keysm", "sm90_keysm_fp8"]
    plain = ["sm90_keysm", "sm90_keysm_fp8"] * 4

    def kinds(batch):
        return [dispatch.keysm_kind(n, f, "exact", 1, batch) for n in (8, 16, 32, 64)
                for f in (False, True)]

    assert KEYSM_RS_MIN_BATCH == {8: 8, 16: 8, 32: 32}
    assert kinds(32) == kinds(128) == rs
    assert kinds(7) == kinds(1) == plain
    # between the two thresholds: 8 and 16 columns only
    assert kinds(8) == kinds(31) == rs[:4] + plain[4:]
    assert all(k in dispatch.STEPS for k in rs + plain)
    # (a cache of several KV heads interleaves a page's rows: the keys-on-M fp8 step)
    assert dispatch.keysm_kind(16, True, "exact", 2, 128) == "sm90_keysm_fp8"
    monkeypatch.setenv("TORCH_MLA_KEYSM_RS", "1")
    assert kinds(1) == kinds(128) == ["sm90_keysm", "sm90_keysm_rs"] * 4
    monkeypatch.setenv("TORCH_MLA_KEYSM_RS", "0")
    assert kinds(128) == plain


def test_launch_choice(monkeypatch):
    """run_split_kv's step (dispatch.step_kind) over an e4m3 cache, 16 rows a KV head: the
    ping-pong from a batch of 8 with one KV head, the keys-on-M fp8 step below it or with two;
    fast mode's own; 40 rows the heads-on-M step."""
    monkeypatch.delenv("TORCH_MLA_KEYSM_RS", raising=False)
    for name in ("TORCH_MLA_KEYSM", "TORCH_MLA_KEYSM_FAST"):
        monkeypatch.delenv(name, raising=False)

    def kind(rows, h_kv, batch, compute="exact"):
        key = "sm90_fp8" if compute == "exact" else "sm90_fp8_fast"
        return dispatch.step_kind("sm90", key, rows, compute, h_kv, batch, True)

    assert kind(16, 1, 8) == ("sm90_keysm_rs", 16)
    assert kind(8, 1, 128) == ("sm90_keysm_rs", 8)
    assert kind(32, 1, 128) == kind(32, 1, 32) == ("sm90_keysm_rs", 32)
    assert kind(32, 1, 31) == ("sm90_keysm_fp8", 32)
    assert kind(32, 1, 4, "fp8") == ("sm90_keysm_fast", 32)
    assert kind(32, 1, 3, "fp8") == ("sm90_fp8_fast", 0)
    assert kind(40, 1, 128, "fp8") == ("sm90_fp8_fast", 0)
    assert kind(16, 1, 7) == kind(16, 2, 128) == ("sm90_keysm_fp8", 16)
    assert kind(16, 1, 1, "fp8") == ("sm90_keysm_fast", 16)
    assert kind(40, 1, 128) == ("sm90_fp8", 0)
    assert dispatch.step_kind("sm90", "sm90", 16, "exact", 1, 128, False) == ("sm90_keysm", 16)


# ---- on an SM90 GPU (test_keysm.py's fixture and check, with TORCH_MLA_KEYSM_RS=1) ------------


@pytest.fixture
def rs(keysm, monkeypatch):  # noqa: F811 (the fixture imported above)
    """test_keysm.py's launch count, with TORCH_MLA_KEYSM_RS=1."""
    monkeypatch.setenv("TORCH_MLA_KEYSM_RS", "1")
    return keysm


def run_and_check(launched, lens, s_q, h_q, causal, dtype=torch.bfloat16, **kw):
    """test_keysm.py's check over an e4m3 cache (kw: its q_scale, scale), which this kernel
    took."""
    sched = keysm_check(launched, lens, s_q, h_q, causal, fp8=True, dtype=dtype, **kw)
    assert {kind for kind, _ in launched} == {"sm90_keysm_rs"}, launched
    return sched


LENS = [20, 140, 4096, 0, 1, 65, 1000]


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("h_q,s_q,causal", [(8, 1, False), (16, 1, False), (8, 2, True),
                                            (4, 3, True), (3, 1, False), (32, 1, False),
                                            (16, 2, True), (10, 3, True), (17, 1, False),
                                            (64, 1, False), (33, 1, False), (16, 4, True),
                                            (21, 3, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_grid(rs, h_q, s_q, causal, dtype):
    sched = run_and_check(rs, LENS, s_q, h_q, causal, dtype)
    assert sched.num_splits[-1].item() > len(LENS)  # split requests: partials and the combine


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("b", [1, 6, 128, 300])
def test_varlen_batches(rs, b):
    from test_keysm import varlen_seqlens

    run_and_check(rs, varlen_seqlens(b), 1, 16, False)
    run_and_check(rs, varlen_seqlens(b), 2, 8, True)
    run_and_check(rs, varlen_seqlens(b), 1, 32, False)
    run_and_check(rs, varlen_seqlens(b), 1, 64, False)


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("L", [1, 63, 64, 65, 127, 128, 129, 191, 193])
def test_page_boundaries(rs, L):
    run_and_check(rs, [L, L + 1, max(L - 1, 0)], 1, 16, False)
    run_and_check(rs, [L, L + 1, max(L - 1, 0)], 1, 32, False)
    run_and_check(rs, [L, L + 1, max(L - 1, 0)], 2, 32, True)


@pytest.mark.cuda
@sm90
def test_whole_requests_and_q_range(rs):
    parts = torch.cuda.get_device_properties(0).multi_processor_count
    lens = [640 - 7] * (2 * parts)
    sched = run_and_check(rs, lens, 1, 16, False)
    assert sched.num_splits[-1].item() == len(lens), "premise: no request split"
    # the f16 factor keeps tiny q exact (the scale makes up for it: ordinary scores) and large q
    # (peaky scores: maxima that move by more than 2^8, O^T rescaled)
    run_and_check(rs, LENS, 1, 16, False, q_scale=1e-20, scale=576**-0.5 * 1e20)
    run_and_check(rs, LENS, 1, 16, False, q_scale=3e4)
    run_and_check(rs, LENS, 1, 32, False, q_scale=3e4)
    run_and_check(rs, LENS, 1, 64, False, q_scale=3e4)
    # 64 columns: each warpgroup's own f16 factor (rows 32-63 2^10 larger than rows 0-31; one
    # factor for both would overflow the second half or lose the first)
    halves = torch.cat([torch.ones(32), torch.full((32,), 2.0**10)]).view(64, 1).cuda()
    run_and_check(rs, LENS, 1, 64, False, q_scale=halves)


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("s_q,h_q", [(2, 8), (1, 8), (1, 5), (2, 16), (2, 32)])
def test_graph_replays_with_new_lengths(rs, s_q, h_q):
    from test_keysm import graph_replays

    graph_replays(s_q, h_q, True)
    assert set(rs) == {("sm90_keysm_rs", dispatch.keysm_columns_for(s_q * h_q, 64))}


def test_rows_tool_modes(monkeypatch):
    """tools/keysm_rows.py: each mode's flags make the dispatch pick the kernel its docstring
    names at 32 rows and a batch of 1 (below both batch thresholds), "dither" with P
    dithered; a bad mode stops."""
    from tools import keysm_rows

    want = {"bf16": ("sm90_keysm", 32), "exact": ("sm90_keysm_fp8", 32),
            "rs": ("sm90_keysm_rs", 32), "fast": ("sm90_keysm_fast", 32),
            "fast0": ("sm90_fp8_fast", 0), "dither": ("sm90_fp8_fast", 0)}
    for mode, (env, fp8, compute) in keysm_rows.MODES.items():
        for name in ("TORCH_MLA_KEYSM", "TORCH_MLA_KEYSM_RS", "TORCH_MLA_KEYSM_FAST",
                     "TORCH_MLA_FAST_DITHER"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("TORCH_MLA_KEYSM", "128")  # (as the tool sets it)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        key = "sm90" + ("_fp8" if fp8 else "") + ("_fast" if compute == "fp8" else "")
        assert dispatch.step_kind("sm90", key, 32, compute, 1, 1, fp8) == want[mode], mode
        # (and at a batch past both thresholds: the flags, not the batch, decide)
        assert dispatch.step_kind("sm90", key, 32, compute, 1, 128, fp8) == want[mode], mode
        # (run_split_kv then takes the dithered step where the flag says)
        assert dispatch.fast_dither() == (mode == "dither"), mode
    assert keysm_rows.parse_row("128,2,8192,16") == (128, 2, 8192, 16, True)
    with pytest.raises(SystemExit):
        keysm_rows.main(["slow", "1,1,64,16"])
