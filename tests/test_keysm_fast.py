"""Fast mode of the ping-pong keys-on-M kernel (cute_kernels/sm90_keysm_fast_decode.py): its
e4m3 Q layout checked against the DSL's, the registry entry and the dispatch's choice (fast mode
where s_q * h_q <= 16, <= 32 from a batch of 4, unless TORCH_MLA_KEYSM_FAST=0); on an SM90
GPU the kernel (TORCH_MLA_KEYSM_FAST=1) against the fp32
reference within fast mode's bounds (test_fp8.check_fast_mode: 2.5 x the error of storing the
cache in e4m3; lse within Q's rounding)."""

import pytest
import torch
from expecttest import assert_expected_inline
from test_keysm import keysm, sm90, wrong_lines  # noqa: F401 (keysm: a fixture)

import torch_mla
from torch_mla.constants import KEYSM_FAST_COLUMNS, KEYSM_FAST_MIN_BATCH
from torch_mla.cute_kernels.sm90_keysm_fast_decode import flat_latent_of, q8_word, sw64_offset
from torch_mla.ops import dispatch, registry
from torch_mla.testing import capture_graph, varlen_seqlens


def test_q8_offsets_are_a_bijection():
    for n in KEYSM_FAST_COLUMNS:
        got = sorted(sw64_offset(r, b, n) for r in range(n) for b in range(576))
        assert got == list(range(n * 576))


def test_latent_order():
    """flat_latent_of is a bijection of each 64-byte group; Q8's word w holds four consecutive
    latent bytes, those of the run's word q8_word(w)."""
    assert sorted(flat_latent_of(k) for k in range(576)) == list(range(576))
    assert all(flat_latent_of(k) // 64 == k // 64 for k in range(576))
    for w in range(16):
        for c in range(9):
            at = [flat_latent_of(64 * c + 4 * w + i) for i in range(4)]
            assert at == [64 * c + 4 * q8_word(w) + i for i in range(4)]


def test_s_operand_reads_its_fragment():
    """S^T's A, register r of k-step j = 2 c + h for thread (warp wq, lane; g = lane / 4,
    q = lane % 4): the DSL's fragment (checked by LAYOUT_SCRIPT) holds row 16 wq + g + 8 (r % 2)
    and k 4 q + 16 (r // 2) + i; the kernel puts there byte i of word 2 h + r // 2 of its
    16-byte load of that row at 64 c + 16 q: the cache's flat_latent_of of that k."""
    for lane in range(32):
        q = lane % 4
        for j in range(18):
            c, h = j // 2, j % 2
            for r in range(4):
                for i in range(4):
                    k = 32 * j + 4 * q + 16 * (r // 2) + i
                    assert 64 * c + 16 * q + 4 * (2 * h + r // 2) + i == flat_latent_of(k)


LAYOUT_SCRIPT = r"""
import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup, OperandMajorMode
from torch_mla.cute_kernels.sm90_keysm_fast_decode import sw64_offset

def byte(layout, coord):
    # 8-bit elements: the swizzle (on byte addresses) of the outer offset
    sw, o = layout.inner, cute.crd2idx(coord, layout.outer)
    mask = ((1 << sw.num_bits) - 1) << (sw.num_base + sw.num_shift)
    return o ^ ((o & mask) >> sw.num_shift)

@cute.jit
def check(n: cutlass.Constexpr):
    f8 = cutlass.Float8E4M3FN
    atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW64, f8)
    q8 = cute.tile_to_shape(atom, (n, 576), order=(0, 1))
    bad_q = sum(byte(q8, (r, k)) != sw64_offset(r, k, n) for r in range(n) for k in range(576))
    # S^T's register A fragment (e4m3 m64nNk32): value v is byte v % 4 of register v // 4,
    # row g + 8 (r % 2), k 4 q + 16 (r // 2) + byte
    mma = sm90_utils.make_trivial_tiled_mma(f8, f8, OperandMajorMode.K, OperandMajorMode.K,
                                            cutlass.Float32, (1, 1, 1), (64, n),
                                            warpgroup.OperandSource.RMEM)
    tv = mma.tv_layout_A_tiled
    bad_a = 0
    for t in cutlass.range_constexpr(128):
        for v in cutlass.range_constexpr(16):
            r, i = v // 4, v % 4
            m = 16 * (t // 32) + (t % 32) // 4 + 8 * (r % 2)
            k = 4 * (t % 4) + 16 * (r // 2) + i
            bad_a += cute.crd2idx((t, v), tv) != m + 64 * k
    print(f"n {n}: Q8 {bad_q}, A {bad_a} wrong")

for n in (8, 16, 32):
    check(n)
"""


def test_layouts_match_the_models(tmp_path):
    """The wgmma's K-major SW64 e4m3 layout of Q8 is the one the kernel writes
    (sw64_offset); the register A fragment of S^T is the one it fills."""
    assert_expected_inline(wrong_lines(tmp_path, LAYOUT_SCRIPT), """\
n 8: Q8 0, A 0 wrong
n 16: Q8 0, A 0 wrong
n 32: Q8 0, A 0 wrong""")


def test_registry_and_dispatch(monkeypatch):
    c = registry.DecodeStepConfig("sm90_keysm_fast", "bf16", True, kv_fp8=True, compute="fp8",
                                  columns=16)
    assert (c.name, c.key()) == ("step_sm90_keysm_fast", {
        "dtype": "bf16", "causal": True, "kv": "e4m3", "compute": "fp8", "columns": 16})
    for bad in (dict(columns=16, kv_fp8=True), dict(columns=64, kv_fp8=True, compute="fp8"),
                dict(columns=16, kv_fp8=True, compute="fp8", q_fp8=True)):
        with pytest.raises(ValueError):
            registry.DecodeStepConfig("sm90_keysm_fast", "bf16", False, **bad)
    with pytest.raises(ValueError):
        registry.DecodeStepConfig("sm90_keysm_rs", "bf16", False, kv_fp8=True, compute="fp8",
                                  columns=16)
    got = registry.variants(("bf16",), (False,), ("keysm_fast",))
    assert sorted(v.config.columns for v in got) == [8, 16, 32]
    for name in ("TORCH_MLA_KEYSM_FAST", "TORCH_MLA_KEYSM"):
        monkeypatch.delenv(name, raising=False)
    rows = (1, 8, 9, 16, 17, 32, 33)
    assert KEYSM_FAST_MIN_BATCH == {8: 1, 16: 1, 32: 4}
    assert [dispatch.keysm_columns("sm90", r, "fp8", batch=4) for r in rows] == [8, 8, 16, 16,
                                                                               32, 32, 0]
    # 32 columns from a batch of 4 (batch defaults to 1)
    assert [dispatch.keysm_columns("sm90", r, "fp8") for r in rows] == [8, 8, 16, 16, 0, 0, 0]
    assert dispatch.keysm_columns("sm90", 32, "fp8", batch=3) == 0
    monkeypatch.setenv("TORCH_MLA_KEYSM_FAST", "0")
    assert [dispatch.keysm_columns("sm90", r, "fp8", batch=4) for r in rows] == [0] * 7
    monkeypatch.setenv("TORCH_MLA_KEYSM_FAST", "1")
    assert dispatch.keysm_columns("sm90", 32, "fp8") == 32
    monkeypatch.setenv("TORCH_MLA_KEYSM_FAST", "1")
    assert dispatch.keysm_columns("sm90", 8, "fp8", q_fp8=True) == 0
    # (its pages are whole 36 KB blocks: one KV head only)
    assert dispatch.keysm_columns("sm90", 8, "fp8", h_kv=4) == 0
    assert dispatch.keysm_columns("sm90", 8, "exact", h_kv=4) == 8
    assert dispatch.keysm_columns("sm80", 8, "fp8") == 0
    assert dispatch.keysm_kind(16, True, "fp8") == "sm90_keysm_fast"
    monkeypatch.setenv("TORCH_MLA_KEYSM", "0")
    assert dispatch.keysm_columns("sm90", 8, "fp8") == 0


# ---- on an SM90 GPU ---------------------------------------------------------------------------


@pytest.fixture
def fast(keysm, monkeypatch):  # noqa: F811 (the fixture imported above)
    """test_keysm.py's launch count, with TORCH_MLA_KEYSM_FAST=1 (this kernel at any batch: the
    default takes 32 columns from a batch of 4)."""
    monkeypatch.setenv("TORCH_MLA_KEYSM_FAST", "1")
    return keysm


def run_and_check(launched, lens, s_q, h_q, causal, dtype=torch.bfloat16, mult=1.0,
                  outliers=False, zero_head=None):
    """Fast mode over an e4m3 cache (test_fp8.fp8_inputs, times mult; outliers: four latent
    channels 30 x the rest) against the fp32 reference within test_fp8.check_fast_mode's
    bounds; this kernel must have run."""
    from test_fp8 import SCALE, check_fast_mode, fp8_inputs, quantize_fp8

    inp, cache, kv_scale = fp8_inputs(lens, s_q, h_q, mult, device="cuda")
    latents = inp.kv_cache.float() * mult
    if outliers:
        latents[..., [3, 100, 257, 511]] *= 30
        kv_scale = (latents.nan_to_num(0).abs().amax() / 448).reshape(1)
        cache = quantize_fp8(latents, kv_scale)
    q = (inp.q.float() * mult).to(dtype)
    if zero_head is not None:
        q[:, :, zero_head] = 0  # its scores all 0: out is the mean of V, lse log(keys)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    before = dict(launched)
    out, lse = torch_mla.mla_decode(q, cache, inp.block_table, inp.cache_seqlens, sched,
                                    softmax_scale=SCALE, causal=causal, kv_scale=kv_scale,
                                    compute="fp8")
    ran = {k for k in launched if launched[k] != before.get(k)}
    assert {kind for kind, _ in ran} == {"sm90_keysm_fast"}, launched
    return check_fast_mode(out, lse, q, None, cache, kv_scale, latents.to(dtype),
                           inp.block_table, inp.cache_seqlens, SCALE, causal), sched


LENS = [20, 140, 4096, 0, 1, 65, 1000]


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("h_q,s_q,causal", [(8, 1, False), (16, 1, False), (8, 2, True),
                                            (4, 3, True), (3, 1, False), (1, 1, False),
                                            (32, 1, False), (16, 2, True), (17, 1, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_grid(fast, h_q, s_q, causal, dtype):
    _, sched = run_and_check(fast, LENS, s_q, h_q, causal, dtype)
    assert sched.num_splits[-1].item() > len(LENS)  # split requests: partials and the combine


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("b", [1, 6, 128, 300])
def test_varlen_batches(fast, b):
    run_and_check(fast, varlen_seqlens(b), 1, 16, False)
    run_and_check(fast, varlen_seqlens(b), 2, 8, True)
    run_and_check(fast, varlen_seqlens(b), 1, 32, False)


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("L", [1, 63, 64, 65, 127, 128, 129, 191, 193])
def test_page_boundaries(fast, L):
    run_and_check(fast, [L, L + 1, max(L - 1, 0)], 1, 16, False)
    run_and_check(fast, [L, L + 1, max(L - 1, 0)], 1, 32, False)


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("mult,outliers", [(0.1, False), (10.0, False), (20.0, False),
                                           (1.0, True)])
def test_data(fast, mult, outliers, capsys):
    """Near-uniform (randn / 100 scores), peaky (2 randn: scores in the hundreds) and
    outlier-channel data: within 2.5 x e_store each."""
    for h_q in (16, 32):
        e_store, _ = run_and_check(fast, LENS, 1, h_q, False, mult=mult, outliers=outliers)
        with capsys.disabled():
            print(f"\nh_q {h_q} mult {mult} outliers {outliers}: e_store {e_store:.2e}")


@pytest.mark.cuda
@sm90
def test_zero_query_row(fast):
    """A query row of zeros (its amax 0) gives the mean of V, not NaN: e4m3_row_factors keeps
    its scale finite (masked keys -inf, not -inf x 0). Lengths off the page size: masked keys
    on every last page."""
    run_and_check(fast, LENS, 1, 16, False, zero_head=5)
    run_and_check(fast, LENS, 2, 8, True, zero_head=0)
    run_and_check(fast, LENS, 1, 32, False, zero_head=21)


@pytest.mark.cuda
@sm90
@pytest.mark.parametrize("s_q,h_q", [(2, 8), (2, 16)])
def test_graph_replays_with_new_lengths(fast, s_q, h_q):
    """One step captured in a CUDA graph, replayed on new lengths, pages and queries: each
    replay equals an eager call (the same kernel) and is within fast mode's bounds."""
    from test_fp8 import SCALE, check_fast_mode, fp8_inputs

    shapes = dict(device="cuda", max_blocks=6, num_blocks=14)
    steps = [fp8_inputs(x, s_q, h_q, **shapes) for x in ([70, 3, 300], [129, 64, 0],
                                                         [5, 250, 190])]
    static = [t.clone() for t in (steps[0][0].q, steps[0][1], steps[0][0].block_table,
                                  steps[0][0].cache_seqlens, steps[0][2])]

    def step(q, cache, table, lens, kv_scale):
        sched = torch_mla.get_decode_schedule(lens, s_q, h_q)
        return torch_mla.mla_decode(q, cache, table, lens, sched, causal=True,
                                    kv_scale=kv_scale, compute="fp8")

    torch_mla.set_value_checks(False)
    try:
        graph, (out, lse) = capture_graph(step, static)
        for inp, cache, kv_scale in steps * 2:
            for dst, src in zip(static, [inp.q, cache, inp.block_table, inp.cache_seqlens,
                                         kv_scale]):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            eager = step(*static)
            assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1])
            check_fast_mode(out, lse, static[0], None, static[1], static[4], inp.kv_cache,
                            *static[2:4], SCALE, True)
    finally:
        torch_mla.set_value_checks(True)
    assert set(fast) == {("sm90_keysm_fast", s_q * h_q)}


def test_load_only_tool_refuses_a_shared_cache(monkeypatch):
    """tools/keysm_load_only.py: an unknown mode, or a load-only mode without its own
    TORCH_MLA_CACHE_DIR (its build would be cached under the shipped kernel's key), stops
    before anything is built or swapped."""
    from tools import keysm_load_only
    from torch_mla.cute_kernels import sm90_keysm_fast_decode as fast

    shipped = fast.MLADecodeSm90KeysMFast
    monkeypatch.delenv("TORCH_MLA_CACHE_DIR", raising=False)
    for argv in (["bogus"], ["pages"], ["ring64"]):  # (ring64: a mode until session 22)
        with pytest.raises(SystemExit):
            keysm_load_only.main(argv)
    assert fast.MLADecodeSm90KeysMFast is shipped


def test_fast_mode_error_tool_on_cpu(capsys):
    """tools/fast_mode_error.py on a CPU: mla_decode is the reference there (its error 0); the
    emulations run, P in f16 far closer to the reference than P in e4m3."""
    from tools import fast_mode_error

    fast_mode_error.main(["--device", "cpu", "--lengths", "200", "--heads", "8"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| 8 |")]
    assert len(rows) == 2  # plain, outliers
    for r in rows:
        assert r[5].strip() == "0.00 / 0.00 / 0.00"
        e4m3, f16 = float(r[6]), float(r[9])
        assert 0 < f16 < e4m3 / 2, r
