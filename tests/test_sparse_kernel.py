"""The sparse decode kernels on a GPU, each test for each: the portable kernel's gather path
(cute_kernels/sm80_sparse_decode.py), the SM90 one (cute_kernels/sm90_sparse_decode.py) and
the keys-on-M one (cute_kernels/sm90_keysm_sparse_decode.py, h_q <= 32), the last two on
H100/H200 only (the cases set TORCH_MLA_SPARSE_SM90 and TORCH_MLA_SPARSE_KEYSM to take one
whatever the shape), against the float64 loop of test_sparse.py: the issue's grid of h_q, s_q and
topk, repeated and -1 entries, topk_length 0 and partial (garbage past it), NaN in every slot
no entry names, splits over the entries, the sink, CUDA-graph replays with new indices, and the
device-side message for a bad entry."""

import os
import subprocess
import sys
import warnings

import pytest
import torch
from test_sparse import (
    PAGE,
    cache_to_f64,
    make_cache,
    poisoned_indices,
    sparse_decode_fp64,
    used_slots,
)

import torch_mla
from torch_mla.constants import COMBINE_VARIANTS
from torch_mla.devtools import combine_warps
from torch_mla.ops import sparse as sparse_ops
from torch_mla.testing import DECODE_TOL, LSE_TOL

pytestmark = pytest.mark.cuda

# the kernel _take asked for (check_against_fp64 checks it ran); short: the split's short build
_TAKEN = {"kernel": None, "short": False}


def _skip_short_elsewhere(fmt: str):
    """Skips a case of the split's short build (_take's "sm90_split_short") over a cache other
    than the 656-byte rows, the only one it takes (the default build would run)."""
    if _TAKEN["short"] and fmt != "fp8_ds_mla":
        pytest.skip("the split's short build takes the 656-byte rows only")


def _take(kernel: str, monkeypatch) -> str:
    """Has mla_decode_sparse run `kernel` whatever the shape: TORCH_MLA_SPARSE_SM90=1 for
    "sm90" (sm_90a only: skipped elsewhere), =0 for "sm80"; TORCH_MLA_SPARSE_KEYSM=0 for both
    of those, not 0 for "sm90_keysm" (sm_90a only), which takes h_q <= 32, and
    TORCH_MLA_SPARSE_KEYSM_RS=1 for "sm90_keysm_rs" (its ping-pong variant: the FP8 caches,
    every h_q): the other shapes' cases skip (check_against_fp64); "sm90_producer" as "sm90"
    with TORCH_MLA_SPARSE_PRODUCER=1 (its producer-warpgroup variant), "sm90_split" with
    =split (FlashMLA's warpgroup split) and its default build at every shape, and
    "sm90_split_short" the same with its short build at every shape over the 656-byte rows
    (ops.sparse.SPLIT_SHORT_BLOCKS and SPLIT_SHORT_BLOCKS_PAIR; it takes no other format: its
    cases over the others skip, _skip_short_elsewhere). Returns the backend's name
    ("sm90_split" for both)."""
    _TAKEN["short"] = short = kernel == "sm90_split_short"
    if kernel.startswith("sm90_split"):
        for name in ("SPLIT_SHORT_BLOCKS", "SPLIT_SHORT_BLOCKS_PAIR"):
            monkeypatch.setattr(sparse_ops, name, 1 << 30 if short else 0)
        kernel = "sm90_split"
    keysm = kernel in ("sm90_keysm", "sm90_keysm_rs")
    sm90 = kernel in ("sm90", "sm90_producer", "sm90_split")
    if sm90 or keysm:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the SM90 sparse kernels need compute capability 9.0")
    monkeypatch.setenv("TORCH_MLA_SPARSE_SM90", "1" if sm90 else "0")
    monkeypatch.setenv("TORCH_MLA_SPARSE_PRODUCER", {"sm90_producer": "1",
                                                     "sm90_split": "split"}.get(kernel, "0"))
    monkeypatch.setenv("TORCH_MLA_SPARSE_KEYSM", "1" if keysm else "0")
    monkeypatch.setenv("TORCH_MLA_SPARSE_KEYSM_RS", "1" if kernel == "sm90_keysm_rs" else "0")
    _TAKEN["kernel"] = kernel
    return kernel


@pytest.fixture(params=["sm80", "sm90", "sm90_keysm", "sm90_producer", "sm90_split"])
def backend(request, monkeypatch):
    """The kernel the 16-bit cases run (_take)."""
    yield _take(request.param, monkeypatch)
    _TAKEN.update(kernel=None, short=False)


GRID = [(h, s, k) for h in (1, 3, 16, 64, 128) for s in (1, 2, 3, 4) for k in (64, 128, 2048)]


def _case(h_q, s_q, topk, fmt="bf16", b=2, lengths=True, sink=False, num_blocks=None,
          dtype=None, scale=False):
    """CUDA (q, cache, indices, topk_length, attn_sink), and the cache's kv_scale if `scale`;
    fmt: make_cache's ("fp8": float8_e4m3fn, "fp8_ds_mla": the 656-byte rows, NaN bytes in
    the slots no entry names); dtype: q's (default bf16, fp16 for an fp16 cache)."""
    num_blocks = num_blocks or 3 + topk // PAGE
    lens = None
    if lengths:
        lens = torch.tensor([topk, int(torch.randint(0, topk, ()))] + [topk] * (b - 2),
                            dtype=torch.int32)[:b]
    idx = poisoned_indices(b, s_q, topk, num_blocks * PAGE, lens)
    cache, kv_scale = make_cache(num_blocks, fmt, used_slots(idx, lens, num_blocks * PAGE))
    dtype = dtype or (torch.float16 if fmt == "fp16" else torch.bfloat16)
    q = torch.randn(b, s_q, h_q, 576).to(dtype)
    attn_sink = torch.randn(h_q) if sink else None
    out = (q, cache, idx, lens, attn_sink) + ((kv_scale,) if scale else ())
    return [None if t is None else t.cuda() for t in out]


def p_atol(dtype, kv_cache, kv_scale=None) -> float:
    """The kernel rounds each probability to dtype (relative 2^-9 in bf16, 2^-12 in fp16) before
    P V, so an output value may be off by up to max|v| times that (the probabilities sum to 1);
    make_cache's latents reach |v| ~ 4 (tiles of differing ranges), the dense tests' ~1. Never
    below the dense kernels' DECODE_TOL. (v: the values the cache stands for, dequantized.)"""
    v = cache_to_f64(kv_cache, kv_scale)[:, :512]
    vmax = float(v[v.isfinite()].abs().max())
    return max(DECODE_TOL[dtype][0], vmax * (2 ** -9 if dtype == torch.bfloat16 else 2 ** -12))


def check_against_fp64(q, kv_cache, indices, topk_length=None, attn_sink=None, kv_scale=None):
    """The kernel's (out, lse) on these CUDA tensors against the float64 loop on their CPU
    copies (an FP8 cache decoded from its bytes): bf16/fp16 output rounding, fp32 lse; +inf
    exactly where a token uses no entry."""
    _skip_short_elsewhere(sparse_ops.cache_format(kv_cache))
    taken = sparse_ops.sparse_backend(q, kv_cache, 512)[0]
    if (_TAKEN["kernel"] in ("sm90_keysm", "sm90_keysm_rs", "sm90_producer", "sm90_split")
            and taken != _TAKEN["kernel"]):
        pytest.skip(f"the {_TAKEN['kernel']} sparse kernel does not take this shape ({taken} "
                    "would run)")
    assert _TAKEN["kernel"] in (None, taken), (_TAKEN, taken)
    out, lse = torch_mla.mla_decode_sparse(q, kv_cache, indices, topk_length=topk_length,
                                           attn_sink=attn_sink, kv_scale=kv_scale)
    cpu = [None if t is None else t.cpu()
           for t in (q, kv_cache, indices, topk_length, attn_sink, kv_scale)]
    ref_out, ref_lse = sparse_decode_fp64(*cpu[:5], kv_scale=cpu[5])
    assert out.dtype == q.dtype and out.shape == ref_out.shape and lse.shape == ref_lse.shape
    out, lse = out.cpu(), lse.cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, atol=p_atol(q.dtype, cpu[1], cpu[5]),
                               rtol=DECODE_TOL[q.dtype][1])
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])
    return out, lse


def _no_reference_warning(**kw):
    """mla_decode_sparse(**kw), asserting that it warned of no reference fallback. Warnings are
    recorded, not raised: a variant compiled on first use may warn from the DSL (session 28's
    run failed five cases so where the kernel cache lacked the variant)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch_mla.mla_decode_sparse(**kw)
    assert not [w for w in seen if "reference" in str(w.message)], [str(w.message) for w in seen]


def test_the_kernel_runs_not_the_reference(backend):
    q, cache, idx, lens, _ = _case(16, 1, 64)
    assert sparse_ops.sparse_backend(q, cache, 512) == (backend, "")
    _no_reference_warning(q=q, kv_cache=cache, indices=idx, topk_length=lens)


@pytest.mark.parametrize("h_q,s_q,topk", GRID)
def test_grid_matches_fp64(backend, h_q, s_q, topk):
    q, cache, idx, lens, _ = _case(h_q, s_q, topk)
    check_against_fp64(q, cache, idx, lens)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("sink", [False, True])
def test_formats_and_sink(backend, fmt, sink):
    q, cache, idx, lens, attn_sink = _case(32, 2, 256, fmt, b=3, sink=sink)
    check_against_fp64(q, cache, idx, lens, attn_sink)


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
@pytest.mark.parametrize("h_q,s_q", [(64, 1), (100, 2), (128, 1)])
def test_default_kernel_over_the_16bit_cache(monkeypatch, fmt, h_q, s_q):
    # With no flag set, the dispatch's own choice over a 16-bit cache: on H100/H200 the split
    # kernel at 64-128 heads from 2 query tokens (since session 39), else the portable kernel.
    for name in ("TORCH_MLA_SPARSE_SM90", "TORCH_MLA_SPARSE_KEYSM", "TORCH_MLA_SPARSE_KEYSM_RS",
                 "TORCH_MLA_SPARSE_PRODUCER", "TORCH_MLA_SPARSE_SPLIT_PAIR",
                 "TORCH_MLA_FORCE_REFERENCE"):
        monkeypatch.delenv(name, raising=False)
    q, cache, idx, lens, attn_sink = _case(h_q, s_q, 512, fmt, b=2, sink=True)
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert sparse_ops.sparse_backend(q, cache, 512)[0] == ("sm90_split" if sm90 else "sm80")
    check_against_fp64(q, cache, idx, lens, attn_sink)


def test_strided_cache(backend):
    # Rows 640 wide (576 used, NaN after) and one spare page between pages: the kernels
    # address each row through the cache's strides, and read no byte past its 576 values.
    q, cache, idx, lens, _ = _case(16, 2, 256, b=3)
    nb = cache.shape[0]
    wide = torch.full((nb, 2, PAGE, 1, 640), float("nan"), dtype=cache.dtype,
                      device=cache.device)
    strided = wide[:, 0, :, :, :576]
    strided.copy_(cache)
    check_against_fp64(q, strided, idx, lens)


@pytest.mark.parametrize("b,topk", [(1, 16384), (2, 4096), (64, 2048), (128, 512)])
def test_splits_and_long_rows(backend, b, topk):
    # Few requests: each token's entries are cut across parts and merged by the combine.
    q, cache, idx, lens, _ = _case(64, 1, topk, b=b, num_blocks=64)
    check_against_fp64(q, cache, idx, lens)


@pytest.mark.parametrize("h_q", [16, 64])
@pytest.mark.parametrize("variant", COMBINE_VARIANTS)
def test_every_combine_variant(backend, variant, h_q):
    # Each combine variant, forced (devtools.combine_warps), merges the pieces of a few long
    # rows: the heuristic's choice depends on the device's size and may leave one untried
    # (h_q 16: the keys-on-M step's combine).
    q, cache, idx, lens, _ = _case(h_q, 2, 4096, b=2, num_blocks=64)
    with combine_warps(*variant):
        check_against_fp64(q, cache, idx, lens)


def test_parts_of_many_blocks(backend):
    # 128 tokens of 16 blocks, ~16 blocks a part: every page buffer or ring stage is refilled
    # many times within a CTA with other entries (-1 among them), so a bias or tile read after
    # its stage was handed back would show.
    q, cache, idx, lens, _ = _case(16, 2, 1024, b=64)
    check_against_fp64(q, cache, idx, lens)


def test_no_topk_length_and_odd_topk(backend):
    q, cache, idx, _, _ = _case(8, 2, 100, lengths=False)
    check_against_fp64(q, cache, idx, None)


def test_zero_lengths_and_all_minus_one(backend):
    q, cache, idx, lens, _ = _case(16, 2, 128, b=3)
    lens[1] = 0
    idx[2, 1] = -1
    out, lse = check_against_fp64(q, cache, idx, lens)
    assert (out[1] == 0).all() and (lse[1] == float("inf")).all()
    assert (out[2, 1] == 0).all() and (lse[2, :, 1] == float("inf")).all()


def test_cuda_graph_replays_new_indices(backend):
    graph_replays_new_indices("bf16")


def graph_replays_new_indices(fmt: str):
    cache, kv_scale = make_cache(8, fmt, torch.ones(8 * PAGE, dtype=torch.bool))
    cache = cache.cuda()
    scale = None if kv_scale is None else kv_scale.cuda()
    static = [torch.randn(4, 2, 16, 576, device="cuda").bfloat16(),
              torch.zeros(4, 2, 256, dtype=torch.int32, device="cuda"),
              torch.full((4,), 256, dtype=torch.int32, device="cuda")]

    def step(q, idx, lens):
        sched = torch_mla.get_sparse_decode_schedule(idx, 16, lens)
        return torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens, schedule=sched,
                                           kv_scale=scale)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(*static)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, lse = step(*static)
    for _ in range(3):
        new = [torch.randn(4, 2, 16, 576).bfloat16(), poisoned_indices(4, 2, 256, 8 * PAGE),
               torch.randint(0, 257, (4,), dtype=torch.int32)]
        for dst, src in zip(static, new):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = sparse_decode_fp64(new[0], cache.cpu(), new[1], new[2],
                                              kv_scale=kv_scale)
        torch.testing.assert_close(out.double().cpu(), ref_out,
                                   atol=p_atol(torch.bfloat16, cache.cpu(), kv_scale),
                                   rtol=DECODE_TOL[torch.bfloat16][1])
        torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])


def test_cuda_graph_without_topk_length(backend):
    # topk_length None: the kernels' lengths are a cached constant (ops.sparse.full_topk_length)
    # made outside a capture; a capture that finds none captures its own fill instead. Both
    # graphs replay new q and indices right.
    cache, _ = make_cache(8, "bf16", torch.ones(8 * PAGE, dtype=torch.bool))
    cache = cache.cuda()
    q = torch.randn(4, 1, 16, 576, device="cuda").bfloat16()
    idx = torch.zeros(4, 1, 128, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch_mla.mla_decode_sparse(q, cache, idx)
    torch.cuda.current_stream().wait_stream(s)
    for cached in (False, True):
        key = (torch.cuda.current_device(), 128)
        if cached:
            torch_mla.mla_decode_sparse(q, cache, idx)  # (eager: makes the constant)
        elif key in sparse_ops._FULL_LENGTHS:  # (kept alive, as full_topk_length keeps it)
            sparse_ops._RETIRED.append(sparse_ops._FULL_LENGTHS.pop(key))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = torch_mla.mla_decode_sparse(q, cache, idx)
        assert (key in sparse_ops._FULL_LENGTHS) == cached
        for _ in range(2):
            q.copy_(torch.randn(4, 1, 16, 576).bfloat16())
            idx.copy_(poisoned_indices(4, 1, 128, 8 * PAGE))
            g.replay()
            torch.cuda.synchronize()
            ref_out, ref_lse = sparse_decode_fp64(q.cpu(), cache.cpu(), idx.cpu())
            torch.testing.assert_close(out.double().cpu(), ref_out,
                                       atol=p_atol(torch.bfloat16, cache.cpu()),
                                       rtol=DECODE_TOL[torch.bfloat16][1])
            torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=LSE_TOL[0],
                                       rtol=LSE_TOL[1])


BAD = """
import sys, torch, torch_mla
topk, length, bad = int(sys.argv[1]), int(sys.argv[2]), [int(c) for c in sys.argv[3].split(",")]
torch_mla.set_value_checks(False)  # (the torch-side checks off: the combine's must fire)
cache = torch.zeros(2, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
q = torch.randn(1, 2, 16, 576, device="cuda").bfloat16()
idx = torch.zeros(1, 2, topk, dtype=torch.int32, device="cuda")
idx[0, 1, bad] = 128
lengths = torch.tensor([length], dtype=torch.int32, device="cuda") if length >= 0 else None
torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lengths)
torch.cuda.synchronize()
print("ran")
"""


# (topk, topk_length (-1: none), the bad entries, the one named, or None: past the length,
# so never read and nothing to report). The combine's check loads 512 entries a warp before
# comparing (combine.first_outside): the first bad one still comes first, and alone, across
# batches and at the length's last entry, and nothing past the length counts.
@pytest.mark.parametrize("topk,length,bad,named", [(64, -1, "5", 5), (2048, 1000, "999,1500", 999),
                                                   (2048, 1000, "600,999", 600),
                                                   (2048, 1000, "1000,2047", None),
                                                   (2048, -1, "100,1900", 100)])
def test_bad_entry_stops_with_a_message(backend, topk, length, bad, named):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", BAD, str(topk), str(length), bad], cwd=root,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    if named is None:
        assert res.returncode == 0 and "ran" in res.stdout, res
        return
    assert res.returncode != 0
    assert f"indices[0, 1, {named}] = 128 is not a cache slot" in res.stdout + res.stderr, res
    # (one message, the first bad entry's: not the later ones)
    for other in {int(c) for c in bad.split(",")} - {named}:
        assert f"indices[0, 1, {other}]" not in res.stdout + res.stderr, res


@pytest.mark.parametrize("h_q", [63, 65, 100])
def test_m_block_edges_and_every_entry_kind(backend, h_q):
    # Rows across two 64-row m-blocks (the second partial), entries -1, repeated, in the
    # request's last partial block, and topk_length cutting a block.
    q, cache, idx, lens, _ = _case(h_q, 3, 200, b=3)
    idx[0, :, 7] = idx[0, :, 3]
    idx[2, 2, 150:] = -1
    lens[2] = 131
    check_against_fp64(q, cache, idx, lens)


# ---- the FP8 caches (the portable kernel's gather dequantizes) -----------------------------

FP8_KINDS = [("fp8", torch.bfloat16), ("fp8", torch.float16), ("fp8_ds_mla", torch.bfloat16)]


@pytest.fixture(params=["sm80", "sm90", "sm90_keysm", "sm90_keysm_rs", "sm90_producer",
                        "sm90_split", "sm90_split_short"])
def fp8_kernel(request, monkeypatch):
    """The kernel the FP8 cases run (_take)."""
    yield _take(request.param, monkeypatch)
    _TAKEN.update(kernel=None, short=False)


@pytest.mark.parametrize("fmt,dtype", FP8_KINDS)
def test_fp8_runs_the_kernel_not_the_reference(fp8_kernel, fmt, dtype):
    if fp8_kernel in ("sm90_producer", "sm90_split") and fmt == "fp8":
        pytest.skip("the producer variants take the 656-byte rows, not the e4m3 cache")
    q, cache, idx, lens, _, kv_scale = _case(16, 1, 64, fmt, dtype=dtype, scale=True)
    assert sparse_ops.sparse_backend(q, cache, 512) == (fp8_kernel, "")
    _no_reference_warning(q=q, kv_cache=cache, indices=idx, topk_length=lens, kv_scale=kv_scale)


# The grid on both formats in bf16 (h_q 1, 16, 32, 64, 128 x s_q 1, 2 x topk 64, 2048),
# fp16 q over the e4m3 cache on its corners (the conversion differs, not the walk).
FP8_GRID = ([(f, torch.bfloat16, h, s, k) for f in ("fp8", "fp8_ds_mla")
             for h in (1, 16, 32, 64, 128)
             for s in (1, 2) for k in (64, 2048)]
            + [("fp8", torch.float16, h, s, k) for h, s, k in ((1, 1, 64), (128, 2, 2048),
                                                              (64, 1, 512))])


@pytest.mark.parametrize("fmt,dtype,h_q,s_q,topk", FP8_GRID)
def test_fp8_grid_matches_fp64(fp8_kernel, fmt, dtype, h_q, s_q, topk):
    q, cache, idx, lens, _, kv_scale = _case(h_q, s_q, topk, fmt, dtype=dtype, scale=True)
    check_against_fp64(q, cache, idx, lens, kv_scale=kv_scale)


def test_fp8_repeats_are_bit_identical(fp8_kernel):
    """The same call 30 times over the 656-byte rows at h_q 128, b 64 (for sm90_split its
    cluster pair, whose CTAs hand buffer halves to each other at CTA scope), from a cache of
    2048 pages (86 MB, more than the L2): every output and lse bit-identical to the first
    call's. A result that moves between identical runs is a race (an ordering a test against
    fp64 may not catch)."""
    q, cache, idx, lens, _, kv_scale = _case(128, 1, 2048, "fp8_ds_mla", b=64, scale=True,
                                             num_blocks=2048)
    taken = sparse_ops.sparse_backend(q, cache, 512)[0]
    if taken != fp8_kernel:
        pytest.skip(f"the {fp8_kernel} sparse kernel does not take this shape ({taken} would "
                    "run)")
    if fp8_kernel == "sm90_split":
        assert sparse_ops.split_pair_rows(128, "fp8_ds_mla", 64) == 128
    runs = [torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens, kv_scale=kv_scale)
            for _ in range(30)]
    first_out, first_lse = runs[0]
    assert torch.isfinite(first_out).all() and not first_lse.isnan().any()
    moved = [i for i, (out, lse) in enumerate(runs)
             if not (torch.equal(out, first_out) and torch.equal(lse, first_lse))]
    assert not moved, f"calls {moved} differ from the first"


@pytest.mark.parametrize("h_q", [16, 24, 100])
@pytest.mark.parametrize("fmt,dtype", FP8_KINDS)
def test_fp8_entry_kinds_lengths_and_sink(fp8_kernel, fmt, dtype, h_q):
    # -1 and repeated entries (poisoned_indices), a repeat across positions, a token with all
    # -1, a request with topk_length 0, one cut inside a block, splits; at h_q 100 rows over two
    # m-blocks (the ping-pong's 64 columns: its second CTA's second warpgroup has 4 real
    # columns of 32), at 16 and 24 the keys-on-M kernels' shapes (24: 32 columns, 8 padding).
    entry_kinds_case(fmt, dtype, h_q)


@pytest.mark.parametrize("h_q", [64, 100])
@pytest.mark.parametrize("fmt,dtype", FP8_KINDS)
def test_fp8_entry_kinds_sm90_keysm_rs32(monkeypatch, fmt, dtype, h_q):
    # TORCH_MLA_SPARSE_KEYSM_RS=32: the sparse ping-pong at 32 columns a CTA, so a token of 64
    # heads is two CTAs and of 100 four (the last with 4 real columns of 32).
    _take("sm90_keysm_rs", monkeypatch)
    monkeypatch.setenv("TORCH_MLA_SPARSE_KEYSM_RS", "32")
    assert sparse_ops.keysm_rs_sparse_columns(h_q) == 32
    try:
        entry_kinds_case(fmt, dtype, h_q)
    finally:
        _TAKEN.update(kernel=None, short=False)


@pytest.mark.parametrize("build", ["sm90_split", "sm90_split_short"])
@pytest.mark.parametrize("h_q,s_q,topk", [(100, 3, 200), (128, 1, 2048), (128, 2, 64)])
def test_fp8_entry_kinds_sm90_split_no_pair(monkeypatch, h_q, s_q, topk, build):
    # The split over the 656-byte rows at 65-128 heads without its cluster pair
    # (TORCH_MLA_SPARSE_SPLIT_PAIR=0, and what ops.sparse.SPLIT_PAIR_MIN_TOKENS gives few
    # tokens): one CTA an m-block, the second with h_q - 64 real rows; each build (_take).
    _take(build, monkeypatch)
    monkeypatch.setenv("TORCH_MLA_SPARSE_SPLIT_PAIR", "0")
    try:
        assert sparse_ops.split_pair_rows(h_q, "fp8_ds_mla") == 0
        if s_q == 3:
            entry_kinds_case("fp8_ds_mla", torch.bfloat16, h_q)
        else:
            q, cache, idx, lens, _ = _case(h_q, s_q, topk, "fp8_ds_mla")
            # (this path or a failure, not a skip: check_against_fp64 skips other kernels)
            assert sparse_ops.sparse_backend(q, cache, 512) == ("sm90_split", "")
            check_against_fp64(q, cache, idx, lens)
    finally:
        _TAKEN.update(kernel=None, short=False)


def entry_kinds_case(fmt, dtype, h_q):
    """test_fp8_entry_kinds_lengths_and_sink's case on the kernel _take chose."""
    q, cache, idx, lens, sink, kv_scale = _case(h_q, 3, 200, fmt, b=4, sink=True, dtype=dtype,
                                                scale=True)
    idx[0, :, 7] = idx[0, :, 3]
    idx[2, 1] = -1
    lens[1] = 0
    lens[3] = 131
    out, lse = check_against_fp64(q, cache, idx, lens, sink, kv_scale)
    assert (out[1] == 0).all() and (lse[1] == float("inf")).all()
    assert (out[2, 1] == 0).all() and (lse[2, :, 1] == float("inf")).all()


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla"])
def test_fp8_parts_of_many_blocks(fp8_kernel, fmt):
    # As test_parts_of_many_blocks: over an fp8 cache the keys-on-M kernel hands a ring stage
    # back as soon as it is expanded, before the scores are masked.
    q, cache, idx, lens, _, kv_scale = _case(16, 2, 1024, fmt, b=64, scale=True)
    check_against_fp64(q, cache, idx, lens, kv_scale=kv_scale)


@pytest.mark.parametrize("b,topk", [(1, 16384), (64, 2048)])
def test_fp8_ds_mla_splits_and_long_rows(fp8_kernel, b, topk):
    q, cache, idx, lens, _ = _case(64, 1, topk, "fp8_ds_mla", b=b, num_blocks=64)
    check_against_fp64(q, cache, idx, lens)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_ds_mla"])
def test_fp8_cuda_graph_replays_new_indices(fp8_kernel, fmt):
    _skip_short_elsewhere(fmt)
    graph_replays_new_indices(fmt)
