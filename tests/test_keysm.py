"""The keys-on-M SM90 decode kernel (cute_kernels/sm90_keysm_decode.py; opt-in,
TORCH_MLA_KEYSM=1): its index arithmetic modelled in Python and checked against the DSL's
layouts on the CPU, the registry and dispatch wiring, and on an SM90 GPU the kernel against the
fp32 reference over a grid (bf16 and float8_e4m3fn caches, NaN past each length, huge unused
block ids). The compile and PTX checks are in test_kernel_compile.py."""

import os
import subprocess
import sys

import pytest
import torch
from expecttest import assert_expected_inline

import torch_mla
from torch_mla.constants import KEYSM_COLUMNS
from torch_mla.contract import keysm_columns_for
from torch_mla.cute_kernels.sm90_keysm_decode import (
    BF16_INF,
    acc_coord,
    fp8_unit,
    plan,
    pt_offset,
    q_f16_factors,
    ring_slot,
    stages,
)
from torch_mla.ops import dispatch, registry
from torch_mla.reference import mla_decode_reference
from torch_mla.testing import capture_graph, make_decode_inputs, varlen_seqlens

N_WG = (8, 16, 32)  # a consumer warpgroup's columns


def sw128(o: int) -> int:
    """The 128-byte swizzle of a 16-bit tile (Swizzle<3, 4, 3> on byte addresses: 16-byte chunk
    ^= 128-byte row % 8), on element offsets."""
    return o ^ ((o >> 3) & (7 << 3))


# ---- models ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", N_WG)
def test_accumulator_values_cover_the_tile_once(n):
    # 128 threads x n / 2 values: every (key or d row, column) of a 64 x n tile once.
    seen = [acc_coord(t % 32, t // 32, i) for t in range(128) for i in range(n // 2)]
    assert sorted(seen) == [(m, c) for m in range(64) for c in range(n)]


@pytest.mark.parametrize("n", N_WG)
def test_column_max_and_sum_reach_every_key_of_the_column(n):
    # A thread's value jc (column 8 (jc // 2) + 2 (lane % 4) + jc % 2) is combined over its two
    # row halves, the lanes lane ^ 4, ^ 8, ^ 16 (butterflies), then the 4 warps' smem slots: the
    # keys that reach each column are all 64, and only that column's.
    for _warp in range(4):
        for lane in range(32):
            for jc in range(n // 4):
                group = {lane ^ x for x in (0, 4, 8, 12, 16, 20, 24, 28)}
                keys, cols = set(), set()
                for w in range(4):
                    for ln in group:
                        for h in range(2):
                            m, c = acc_coord(ln, w, jc % 2 + 2 * h + 4 * (jc // 2))
                            keys.add(m)
                            cols.add(c)
                assert keys == set(range(64)) and cols == {8 * (jc // 2) + 2 * (lane % 4) + jc % 2}


@pytest.mark.parametrize("n", N_WG)
def test_p_transpose_layout(n):
    offs = [pt_offset(k, c, n) for k in range(64) for c in range(n)]
    assert sorted(offs) == list(range(64 * n))  # a bijection onto the tile
    # a thread's columns 2q, 2q + 1 are adjacent: one 32-bit store
    assert all(pt_offset(k, c + 1, n) == pt_offset(k, c, n) + 1
               for k in range(64) for c in range(0, n, 2))


def store_ways(n: int) -> int:
    """The most lanes of a warp whose P^T word stores (one per (h, j)) share a bank."""
    worst = 0
    for warp in range(4):
        for h in range(2):
            for j in range(n // 8):
                banks = {}
                for lane in range(32):
                    key = 16 * warp + lane // 4 + 8 * h
                    word = pt_offset(key, 8 * j + 2 * (lane % 4), n) // 2
                    banks.setdefault(word % 32, set()).add(word)
                worst = max(worst, max(len(w) for w in banks.values()))
    return worst


def test_p_transpose_store_bank_conflicts():
    # Conflict-free at every width: the MN atoms' swizzle spreads a warp's 8 keys over the banks
    # (with the swizzle applied to element offsets instead, 16 and 32 would be 2-way).
    assert_expected_inline(str({n: store_ways(n) for n in N_WG}), """{8: 1, 16: 1, 32: 1}""")


def test_fp8_expansion_units():
    units = [fp8_unit(u) for u in range(2304)]
    # every source byte read once, every destination chunk written once
    assert sorted(a for a, _, _, _ in units) == list(range(0, 9 * 4096, 16))
    assert sorted(d for _, d0, d1, _ in units for d in (d0, d1)) == list(range(0, 9 * 8192, 16))
    for a, d0, d1, key in units:
        tile, col = a // 4096, a % 64  # the fp8 tile is unswizzled: (key, column) rows
        assert key == (a % 4096) // 64
        for v in range(16):
            o = sw128(tile * 64 * 64 + key * 64 + col + v)  # element (key, 64 tile + col + v)
            assert 2 * o == (d0 if v < 8 else d1) + 2 * (v % 8)
    # a store phase (8 lanes of 16 bytes) covers 32 distinct banks
    for u0 in range(0, 2304, 8):
        banks = [(d // 4 + i) % 32 for _, d, _, _ in units[u0:u0 + 8] for i in range(4)]
        assert len(set(banks)) == 32


class MBarrier:
    """An mbarrier: `count` arrivals complete a phase; a wait for parity p passes once the
    phase of that parity has completed (a fresh barrier: parity 1, the phase before 0)."""

    def __init__(self, count):
        self.count, self.left, self.completed = count, count, 0

    def arrive(self):
        self.left -= 1
        if self.left == 0:
            self.completed, self.left = self.completed + 1, self.count

    def passed(self, parity):
        return self.completed % 2 != parity


def run_protocol(segments, n_stages, consumers, seed, slot=ring_slot, pingpong=False,
                 producers=1):
    """The kernel's ring and Q protocol under a random interleaving: a producer (per non-empty
    segment its first page, Q, its other pages), TMA completing the loads in any order, 4 x consumers warps that
    wait, read, release. Checks that every warp reads the page (and Q) it expects, that no
    load lands in a stage or Q buffer a warp still reads, and that nothing deadlocks. Actors
    yield True while blocked on a barrier, False when they made progress. pingpong
    (sm90_keysm_rs_decode.py): two warpgroups (8 warps) of one column set, warpgroup
    count % 2 taking page count; a stage's empty barrier then counts its owner's 4 warps, Q's
    all 8. producers: producer warps, warp p loading the pages of count % producers == p
    (producer_warps; the stages s % producers == p) and warp 0 Q."""
    import random

    rng = random.Random(seed)
    full = [MBarrier(1) for _ in range(n_stages)]
    wgs = 2 if pingpong else consumers
    empty = [MBarrier(4 * (1 if pingpong else consumers)) for _ in range(n_stages)]
    q_full, q_empty = MBarrier(1), MBarrier(4 * wgs)
    data, q_data = [None] * n_stages, [None]
    in_flight = []  # loads issued, not landed: (buffer, value)
    readers = {}  # buffer -> the warps reading it
    pages = [(seg, j) for seg, n in enumerate(segments) for j in range(n)]
    segs = [seg for seg, n in enumerate(segments) if n]

    def producer(p):  # a segment's first page, its Q, its other pages
        cnt = 0
        for qcnt, seg in enumerate(segs):
            for j in range(segments[seg]):
                if cnt % producers == p:
                    stage, parity = slot(cnt, n_stages)
                    while not empty[stage].passed(parity ^ 1):
                        yield True
                    in_flight.append((stage, (seg, j)))
                    yield False
                cnt += 1
                if j == 0 and p == 0:
                    while not q_empty.passed(slot(qcnt, 1)[1] ^ 1):
                        yield True
                    in_flight.append(("q", seg))

    def warp(w):
        cnt = 0
        for qcnt, seg in enumerate(segs):
            while not q_full.passed(slot(qcnt, 1)[1]):
                yield True
            readers.setdefault("q", set()).add(w)
            assert q_data[0] == seg
            for _ in range(segments[seg]):
                if pingpong and cnt % 2 != w // 4:
                    cnt += 1
                    continue
                stage, parity = slot(cnt, n_stages)
                while not full[stage].passed(parity):
                    yield True
                readers.setdefault(stage, set()).add(w)
                assert data[stage] == pages[cnt]
                yield False  # (the MMAs)
                readers[stage].discard(w)
                empty[stage].arrive()
                cnt += 1
            readers["q"].discard(w)
            q_empty.arrive()
        assert cnt == len(pages)

    def land(item):
        buf, value = item
        assert not readers.get(buf), f"a load landed in {buf} while it is read"
        if buf == "q":
            q_data[0] = value
            q_full.arrive()
        else:
            data[buf] = value
            full[buf].arrive()

    actors = [producer(p) for p in range(producers)] + [warp(w) for w in range(4 * wgs)]
    interleave(actors, in_flight, land, rng)


def interleave(actors, in_flight, land, rng, limit=1000):
    """Runs the generator `actors` (each yields True while blocked on a barrier, False when it
    made progress) and lands the items of the list `in_flight` (land(item)) in a random order
    until every actor has finished and nothing is in flight; asserts that no `limit` actor steps
    in a row, with nothing in flight, all wait (a deadlock)."""
    blocked = 0  # actor steps in a row that made no progress, with nothing in flight
    while actors or in_flight:
        if in_flight and rng.random() < 0.3 or not actors:
            land(in_flight.pop(rng.randrange(len(in_flight))))
            blocked = 0
            continue
        a = rng.choice(actors)
        try:
            waiting = next(a)
        except StopIteration:
            actors.remove(a)
            waiting = False
        blocked = blocked + 1 if waiting and not in_flight else 0
        assert blocked < limit, "deadlock"


@pytest.mark.parametrize("n_stages,consumers", [(2, 1), (3, 1), (2, 2)])
def test_ring_protocol(n_stages, consumers):
    for seed in range(40):
        segments = [[5, 0, 1, 3, 0, 0, 7], [1], [0, 2, 2], [9, 9]][seed % 4]
        run_protocol(segments, n_stages, consumers, seed)
    # the model catches parities one phase off (a consumer passes a fresh full barrier and
    # reads a stage before its page lands) and a fixed parity (the second lap passes at once)
    with pytest.raises(AssertionError):
        run_protocol([3, 4], n_stages, consumers, 0, lambda c, s: (c % s, (c // s) % 2 ^ 1))
    with pytest.raises(AssertionError):
        run_protocol([3, 4], n_stages, consumers, 0, lambda c, s: (c % s, 0))


def test_ring_protocol_pingpong():
    """Two warpgroups on alternate pages need an even ring: then each stage always serves the
    same warpgroup. With an odd one a warpgroup can wait for a stage's next phase while the
    other's use of it has not landed, and the parity wait passes on the phase before (seen on
    the H200 as a launch failure of the 5-stage variant)."""
    for seed in range(40):
        segments = [[5, 0, 1, 3, 0, 0, 7], [1], [0, 2, 2], [9, 9]][seed % 4]
        for n_stages in (2, 4):
            run_protocol(segments, n_stages, 1, seed, pingpong=True)
    failed = 0
    for seed in range(300):  # (the model hits it in ~2% of its interleavings)
        try:
            run_protocol([60], 5, 1, seed, pingpong=True)
        except AssertionError:
            failed += 1
    assert failed > 0


def test_ring_protocol_producer_warps():
    """The sparse ping-pong's four producer warps (producer_warps), each filling its own ring
    stage, warp 0 also Q: every warp reads the page it expects, nothing lands in a stage or Q
    while it is read, no deadlock; two warps sharing four stages likewise."""
    for seed in range(40):
        segments = [[5, 0, 1, 3, 0, 0, 7], [1], [0, 2, 2], [9, 9]][seed % 4]
        for producers in (2, 4):
            run_protocol(segments, 4, 1, seed, pingpong=True, producers=producers)


def test_plan_and_stages():
    assert [keysm_columns_for(r) for r in (1, 8, 9, 16, 17, 33, 64, 65)] == [8, 8, 16, 16, 32, 64,
                                                                             64, 0]
    assert [plan(n) for n in KEYSM_COLUMNS] == [(1, 8), (1, 16), (1, 32), (2, 32)]
    assert [stages(n, f) for n in (16, 64) for f in (False, True)] == [2, 3, 2, 2]


# ---- the layouts the kernel builds, against the models (host-side CuTe DSL) -------------------

BYTE_OF = r"""
def byte(layout, coord):
    # The byte offset of coord (16-bit elements): the atom's swizzle (printed as DSL and CuTe
    # C++ define it, on byte addresses, as TMA and wgmma apply it) of the outer offset.
    sw, o = layout.inner, 2 * cute.crd2idx(coord, layout.outer)
    mask = ((1 << sw.num_bits) - 1) << (sw.num_base + sw.num_shift)
    return o ^ ((o & mask) >> sw.num_shift)
"""

LAYOUT_SCRIPT = r"""
import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from torch_mla.cute_kernels.sm90_keysm_decode import acc_coord, fp8_unit, pt_offset, smem_layouts
""" + BYTE_OF + r"""

@cute.jit
def check(n: cutlass.Constexpr, buffers: cutlass.Constexpr):
    dt = cutlass.BFloat16
    _, _, sK, sVt, sPt, _ = smem_layouts(dt, n, 2, buffers)
    bad_p = sum(byte(sPt, (c, k, w)) != 2 * (w * 64 * n + pt_offset(k, c, n))
                for w in range(2) for k in range(64) for c in range(n))
    # V^T (d, key) is the page's (key, d): the same outer offset under the same swizzle
    bad_v = sum(cute.crd2idx((d, k, b), sVt) != cute.crd2idx((k, d, b), sK.outer)
                for b in range(buffers) for k in range(64) for d in range(0, 512, 3))
    bad_8 = 0
    for u in cutlass.range_constexpr(0, 2304, 7):  # (a plain range is a loop on the device)
        a, d0, d1, key = fp8_unit(u)
        col = (a // 4096) * 64 + a % 64
        bad_8 += byte(sK, (key, col, 0)) != d0
        bad_8 += byte(sK, (key, col + 8, 0)) != d1
    bad_c = 0
    for mma in (sm90_utils.make_trivial_tiled_mma(dt, dt, warpgroup.OperandMajorMode.K,
                                                  warpgroup.OperandMajorMode.K,
                                                  cutlass.Float32, (1, 1, 1), (64, n)),
                sm90_utils.make_trivial_tiled_mma(dt, dt, warpgroup.OperandMajorMode.MN,
                                                  warpgroup.OperandMajorMode.MN,
                                                  cutlass.Float32, (1, 1, 1), (64, n))):
        tv = mma.tv_layout_C
        for t in cutlass.range_constexpr(128):
            for i in cutlass.range_constexpr(n // 2):
                m, c = acc_coord(t % 32, t // 32, i)
                bad_c += cute.crd2idx((t, i), tv) != m + 64 * c
    # O^T's registers as the epilogue stores them: value i of thread t is d 64 (i // (n / 2)) +
    # m, column c for (m, c) = acc_coord(value i % (n / 2))
    tiled_o = sm90_utils.make_trivial_tiled_mma(dt, dt, warpgroup.OperandMajorMode.MN,
                                                warpgroup.OperandMajorMode.MN, cutlass.Float32,
                                                (1, 1, 1), (64, n))
    cO = cute.make_identity_tensor((512, n))
    bad_o = 0
    for t in cutlass.range_constexpr(0, 128, 5):
        part = tiled_o.get_slice(t).partition_C(cO)
        for i in cutlass.range_constexpr(cute.size(part)):
            m, c = acc_coord(t % 32, t // 32, i % (n // 2))
            bad_o += tuple(part[i]) != (64 * (i // (n // 2)) + m, c)
    print(f"n {n} buffers {buffers}: P^T {bad_p}, V^T {bad_v}, fp8 {bad_8}, C {bad_c}, "
          f"O^T {bad_o} wrong")

for n in (8, 16, 32):
    for buffers in (1, 2):
        check(n, buffers)
"""


def test_layouts_match_the_models(tmp_path):
    """P^T's offsets (pt_offset), V^T over the page buffers, the fp8 expansion's destinations
    (fp8_unit), the accumulator order of both MMAs (acc_coord) and O^T's m-tiles (the
    epilogue's d of each register) are the DSL's own."""
    assert_expected_inline(wrong_lines(tmp_path, LAYOUT_SCRIPT), """\
n 8 buffers 1: P^T 0, V^T 0, fp8 0, C 0, O^T 0 wrong
n 8 buffers 2: P^T 0, V^T 0, fp8 0, C 0, O^T 0 wrong
n 16 buffers 1: P^T 0, V^T 0, fp8 0, C 0, O^T 0 wrong
n 16 buffers 2: P^T 0, V^T 0, fp8 0, C 0, O^T 0 wrong
n 32 buffers 1: P^T 0, V^T 0, fp8 0, C 0, O^T 0 wrong
n 32 buffers 2: P^T 0, V^T 0, fp8 0, C 0, O^T 0 wrong""")


def wrong_lines(tmp_path, source: str) -> str:
    """Runs a host-side CuTe DSL script (sm_90a; the DSL compiles from source files only) and
    returns its lines that count what is "wrong"."""
    script = tmp_path / "layouts.py"
    script.write_text(source)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return "\n".join(x for x in res.stdout.splitlines() if "wrong" in x)


# ---- registry and dispatch --------------------------------------------------------------------

def test_registry_config():
    c = registry.DecodeStepConfig("sm90_keysm", "bf16", True, kv_fp8=True, columns=16)
    assert (c.name, c.key(), c.entry) == (
        "step_sm90_keysm", {"dtype": "bf16", "causal": True, "kv": "e4m3", "columns": 16},
        "decode_step:compile_step")
    for bad in (dict(columns=0), dict(columns=48), dict(columns=16, kv_fp8=True, compute="fp8")):
        with pytest.raises(ValueError):
            registry.DecodeStepConfig("sm90_keysm", "bf16", False, **bad)
    with pytest.raises(ValueError):
        registry.DecodeStepConfig("sm90", "bf16", False, columns=16)
    # precompile's default builds the columns the dispatch picks by default (8, 16, 32), both
    # caches; --kernels keysm64 the 64-column ones (TORCH_MLA_KEYSM=1)
    got = registry.variants(("bf16",), (False,), ("keysm", "keysm64"))
    assert sorted((v.config.columns, v.config.kv_fp8) for v in got) == sorted(
        (n, f) for n in KEYSM_COLUMNS for f in (False, True))
    default = [v.config for v in registry.variants(("bf16",), (False,))
               if v.config.name == "step_sm90_keysm"]
    assert sorted((c.columns, c.kv_fp8) for c in default) == sorted(
        (n, f) for n in (8, 16, 32) for f in (False, True))
    assert not [v for v in registry.variants(arch="sm_86") if v.config.name == "step_sm90_keysm"]


def test_dispatch_choice(monkeypatch):
    """By default up to 32 rows (docs/kernels/keysm.md "Kernel choice"), TORCH_MLA_KEYSM=1 up
    to 64, =128 up to 128 (64 columns a CTA above 64 rows), TORCH_MLA_KEYSM=0 never."""
    rows = (1, 8, 9, 16, 17, 32, 33, 64, 65, 128)
    monkeypatch.delenv("TORCH_MLA_KEYSM", raising=False)
    assert [dispatch.keysm_columns("sm90", r) for r in rows] == [8, 8, 16, 16, 32, 32, 0, 0, 0,
                                                                 0]
    monkeypatch.setenv("TORCH_MLA_KEYSM", "1")
    assert [dispatch.keysm_columns("sm90", r) for r in rows] == [8, 8, 16, 16, 32, 32, 64, 64, 0,
                                                                 0]
    monkeypatch.setenv("TORCH_MLA_KEYSM", "128")  # (above 64 rows: CTAs of 64 columns)
    assert [dispatch.keysm_columns("sm90", r) for r in rows + (129,)] == [
        8, 8, 16, 16, 32, 32, 64, 64, 64, 64, 0]
    assert dispatch.keysm_columns("sm90", 100, "fp8") == 0  # (fast mode: <= 32 rows)
    monkeypatch.setenv("TORCH_MLA_KEYSM", "0")
    assert [dispatch.keysm_columns("sm90", r) for r in rows] == [0] * len(rows)
    monkeypatch.delenv("TORCH_MLA_KEYSM")
    # not the portable or SM100 kernels, not fast mode
    assert dispatch.keysm_columns("sm80", 16) == dispatch.keysm_columns("sm100", 16) == 0
    # fast mode: its ping-pong variant's fast mode up to 32 rows (tests/test_keysm_fast.py)
    monkeypatch.delenv("TORCH_MLA_KEYSM_FAST", raising=False)
    assert dispatch.keysm_columns("sm90", 32, "fp8", batch=4) == 32
    assert dispatch.keysm_columns("sm90", 33, "fp8", batch=4) == 0


# ---- on an SM90 GPU -----------------------------------------------------------------------------

sm90 = pytest.mark.skipif(not torch.cuda.is_available()
                          or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an SM90 GPU")


@pytest.fixture
def keysm(monkeypatch):
    """TORCH_MLA_KEYSM=1 (TORCH_MLA_KEYSM_RS=0: over an e4m3 cache the keys-on-M kernel
    itself at every batch), and a count of the keys-on-M steps launched by (kind, columns)."""
    monkeypatch.setenv("TORCH_MLA_KEYSM", "1")
    monkeypatch.setenv("TORCH_MLA_KEYSM_RS", "0")
    for name in ("TORCH_MLA_FORCE_REFERENCE", "TORCH_MLA_PORTABLE"):
        monkeypatch.delenv(name, raising=False)
    launched = {}
    for kind in ("sm90_keysm", "sm90_keysm_fp8", "sm90_keysm_rs", "sm90_keysm_fast"):
        def count(dtype, causal, index, columns, kind=kind, orig=dispatch.STEPS[kind]):
            launched[kind, columns] = launched.get((kind, columns), 0) + 1
            return orig(dtype, causal, index, columns)
        monkeypatch.setitem(dispatch.STEPS, kind, count)
    return launched


def run_and_check(keysm, lens, s_q, h_q, causal, fp8=False, dtype=torch.bfloat16, q_scale=1.0,
                  scale=576**-0.5):
    """The kernel against the fp32 reference (the SM90 kernel's tolerances: bf16 P, as
    FlashMLA's test); fp8: over the same dequantized cache; q times q_scale."""
    from test_fp8 import fp8_inputs
    from test_kernel_sm90 import check

    if fp8:
        inp, cache, kv_scale = fp8_inputs(lens, s_q, h_q, device="cuda")
    else:
        inp = make_decode_inputs(lens, s_q, h_q, dtype=dtype, device="cuda")
        cache, kv_scale = inp.kv_cache, None
    q = (inp.q * q_scale).to(dtype)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    before = sum(keysm.values())
    out, lse = torch_mla.mla_decode(q, cache, inp.block_table, inp.cache_seqlens, sched,
                                    softmax_scale=scale, causal=causal, kv_scale=kv_scale)
    assert sum(keysm.values()) == before + 1, "the keys-on-M kernel did not run"
    ref_out, ref_lse = mla_decode_reference(q, cache, inp.block_table, inp.cache_seqlens, scale,
                                            causal, 512, kv_scale=kv_scale)
    check(out, lse, ref_out, ref_lse, dtype)
    return sched


# h_q * s_q <= 64 (what the dispatch gives this kernel): 8, 16, 32 and 64 columns; lengths off
# the page size, 0 and 1; split requests (few, long) and whole ones (many, short).
GRID = [(h, s, c) for h in (8, 16, 32, 64) for s, c in ((1, False), (2, True)) if h * s <= 64]
LENS = [20, 140, 4096, 0, 1, 65, 1000]


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("h_q,s_q,causal", [(16, 1, False), (8, 4, True), (32, 1, False),
                                            (64, 1, False)])
def test_peaked_scores(keysm, h_q, s_q, causal, fp8):
    """Scores spread by ~3 (q x 300, test_kernel_sm90.test_peaked_scores): a few keys carry
    most of each row's weight."""
    run_and_check(keysm, [20, 140, 4096, 0, 1, 65, 3000], s_q, h_q, causal, fp8, q_scale=300.0)


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("h_q,s_q,causal", GRID)
def test_grid(keysm, h_q, s_q, causal, fp8):
    sched = run_and_check(keysm, LENS, s_q, h_q, causal, fp8=fp8)
    # few long requests over 132 SMs: they are split (partials and the combine)
    assert sched.num_splits[-1].item() > len(LENS)


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("h_q,s_q,causal", [(16, 1, False), (16, 2, True), (32, 2, True)])
def test_varlen_batches_whole_and_split(keysm, h_q, s_q, causal, fp8):
    for b in (1, 6, 128, 300):
        run_and_check(keysm, varlen_seqlens(b), s_q, h_q, causal, fp8=fp8)


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_whole_requests(keysm, fp8):
    # Two equal requests per SM: the schedule cuts only at request boundaries, so every request
    # is written by the decode kernel itself (no partials, the combine skips them all).
    parts = torch.cuda.get_device_properties(0).multi_processor_count
    lens = [640 - 7] * (2 * parts)
    sched = run_and_check(keysm, lens, 1, 16, False, fp8=fp8)
    assert sched.num_splits[-1].item() == len(lens), "premise: no request split"


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("L", [1, 63, 64, 65, 127, 128, 129, 191, 193])
def test_page_boundaries(keysm, L):
    for fp8 in (False, True):
        run_and_check(keysm, [L, L + 1, max(L - 1, 0)], 1, 16, False, fp8=fp8)
        run_and_check(keysm, [L, L + 1, max(L - 1, 0)], 2, 32, True, fp8=fp8)


@pytest.mark.cuda
@sm90
def test_fp16_and_odd_head_counts(keysm):
    run_and_check(keysm, LENS, 2, 16, True, dtype=torch.float16)  # 32 rows
    run_and_check(keysm, LENS, 1, 3, False)  # 3 rows in 8 columns
    run_and_check(keysm, LENS, 3, 7, True, fp8=True)  # 21 rows in 32 columns
    run_and_check(keysm, LENS, 1, 40, False, fp8=True)  # 40 rows in 64 columns
    assert {c for _, c in keysm} == {8, 32, 64}


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("kind", ["bf16", "fp8", "rs"])
@pytest.mark.parametrize("h_q,s_q,causal", [(128, 1, False), (64, 2, True), (100, 1, False)])
def test_more_rows_than_columns(keysm, monkeypatch, kind, h_q, s_q, causal):
    # TORCH_MLA_KEYSM=128 (not yet run on a GPU): above 64 rows a CTA for each 64 (the grid's
    # m-blocks; at 100 rows the second CTA's second 32 columns hold 4 real rows); "rs": the
    # ping-pong's 64-column split (TORCH_MLA_KEYSM_RS=1), else the keys-on-M fp8 kernel.
    monkeypatch.setenv("TORCH_MLA_KEYSM", "128")
    monkeypatch.setenv("TORCH_MLA_KEYSM_RS", "1" if kind == "rs" else "0")
    run_and_check(keysm, LENS, s_q, h_q, causal, fp8=kind != "bf16")
    run_and_check(keysm, varlen_seqlens(128), s_q, h_q, causal, fp8=kind != "bf16")
    want = {"bf16": "sm90_keysm", "fp8": "sm90_keysm_fp8", "rs": "sm90_keysm_rs"}[kind]
    assert set(keysm) == {(want, 64)}


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_graph_replays_with_new_lengths(keysm, fp8):
    graph_replays(2, 16, fp8)
    assert keysm


def graph_replays(s_q, h_q, fp8):
    """One step (schedule and decode) captured in a CUDA graph, replayed on new lengths, pages
    and queries of the same shapes: each replay matches the reference (tests/test_keysm_rs.py
    runs it too)."""
    from test_fp8 import fp8_inputs

    shapes = dict(device="cuda", max_blocks=6, num_blocks=14)
    lens = ([70, 3, 300], [129, 64, 0], [5, 250, 190])
    if fp8:
        steps = [fp8_inputs(x, s_q, h_q, **shapes) for x in lens]
        steps = [(i.q, c, i.block_table, i.cache_seqlens, s) for i, c, s in steps]
    else:
        steps = [make_decode_inputs(x, s_q, h_q, **shapes) for x in lens]
        steps = [(i.q, i.kv_cache, i.block_table, i.cache_seqlens, None) for i in steps]
    static = [t.clone() for t in steps[0][:4]]
    kv_scale = steps[0][4]

    def step(q, kv_cache, block_table, cache_seqlens):
        sched = torch_mla.get_decode_schedule(cache_seqlens, s_q, h_q)
        return torch_mla.mla_decode(q, kv_cache, block_table, cache_seqlens, sched, causal=True,
                                    kv_scale=kv_scale)

    torch_mla.set_value_checks(False)
    try:
        graph, (out, lse) = capture_graph(step, static)
        for inp in steps:
            for dst, src in zip(static, inp[:4]):
                dst.copy_(src)
            if fp8:
                kv_scale.copy_(inp[4])
            graph.replay()
            torch.cuda.synchronize()
            ref_out, ref_lse = mla_decode_reference(*static, 576**-0.5, True, 512,
                                                    kv_scale=kv_scale)
            assert not out.isnan().any()
            torch.testing.assert_close(out.float(), ref_out.float(), atol=8e-4, rtol=2.01 / 128)
            torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    finally:
        torch_mla.set_value_checks(True)


def test_q_f16_factors():
    """The keys-on-M kernel's f16 MMAs for bf16 q over an e4m3 cache (q_f16_factors): q times
    mul fits f16 (no overflow, |q| mul < 2^15), inv is 1 / mul exactly, and every bf16 value
    within 2^-29 of the tile's largest |q| comes back exactly from f16; for tiles from 1e-30 to
    3e38 and all zero; with an inf and a NaN beside finite values, the finite ones exact and the
    others passed through."""
    import struct

    def f32(bits):
        return struct.unpack("<f", struct.pack("<I", bits))[0]

    gen = torch.Generator().manual_seed(0)
    for amax in (0.0, 1e-30, 1e-8, 0.1, 1.0, 1.99, 300.0, 7e4, 1e20, 3e38):
        q = (torch.randn(16, 576, generator=gen) * amax / 4).clamp(-amax, amax).bfloat16()
        q[0, 0] = amax
        bits = (q.view(torch.int16).int() & 0x7FFF).max().item()
        mul_bits, inv_bits = q_f16_factors(bits)
        mul, inv = f32(mul_bits), f32(inv_bits)
        assert mul * inv == 1.0 and mul > 0 and inv > 0, (amax, mul, inv)
        scaled = q.double() * mul
        assert scaled.abs().max().item() < 2.0**15, amax
        back = scaled.half().double() * inv
        big = q.double().abs() >= amax * 2.0**-29
        assert torch.equal(back[big], q.double()[big]), amax
    # inf and NaN are left out of the largest (the kernel's _q_to_f16 skips magnitudes at or
    # above BF16_INF), so one bad row leaves the tile's other rows their factor
    q = torch.tensor([float("inf"), float("nan"), -1.5, 0.25]).bfloat16()
    mags = q.view(torch.int16).int() & 0x7FFF
    mul_bits, inv_bits = q_f16_factors(mags[mags < BF16_INF].max().item())
    scaled = q.double() * f32(mul_bits)
    assert torch.equal(scaled[2:].half().double() * f32(inv_bits), q.double()[2:])
    assert scaled[0].half().item() == float("inf") and scaled[1].half().isnan()
