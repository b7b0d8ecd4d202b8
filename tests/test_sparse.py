"""Sparse MLA decode (torch_mla.mla_decode_sparse) on its reference path, the 656-byte FP8 cache
(quantization, append_kv), the op's registration and compile behaviour, and the FlashMLA compat
call. The oracle here is independent of torch_mla: a float64 loop over query tokens, and cache
bytes decoded from their bit fields (not through torch's fp8/bf16/fp32 views)."""

import dataclasses
import math
import struct
import warnings

import expecttest
import pytest
import torch
import torch._dynamo.testing
from expecttest import assert_expected_inline

import torch_mla
from torch_mla.ops import sparse as sparse_ops
from torch_mla.reference import quantize_fp8
from torch_mla.reference_sparse import (
    dequantize_fp8_ds_mla,
    fp8_ds_mla_scales,
    mla_decode_sparse_reference,
    quantize_fp8_ds_mla,
)

PAGE = 64
NAN_BYTE = 0xFF  # e4m3fn NaN, and the top byte of a NaN float32/bf16: poison for a uint8 cache


# ---- independent decoding of the cache formats -------------------------------------------------

def _bits_to_float(bits: torch.Tensor, exp_bits: int, man_bits: int, ieee_specials: bool):
    """float64 values of floating-point bit patterns (int64 tensor), from sign, exponent and
    mantissa fields; ieee_specials: an all-ones exponent is inf/NaN (float32, bf16), else only
    the all-ones pattern is NaN (float8_e4m3fn)."""
    bias = (1 << (exp_bits - 1)) - 1
    sign = torch.where((bits >> (exp_bits + man_bits)) & 1 == 1, -1.0, 1.0).double()
    e = (bits >> man_bits) & ((1 << exp_bits) - 1)
    m = (bits & ((1 << man_bits) - 1)).double()
    normal = (1 + m / (1 << man_bits)) * torch.pow(2.0, (e - bias).double())
    sub = m / (1 << man_bits) * 2.0 ** (1 - bias)
    val = sign * torch.where(e == 0, sub, normal)
    top = (1 << exp_bits) - 1
    if ieee_specials:
        val = torch.where((e == top) & (m == 0), sign * math.inf, val)
        return torch.where((e == top) & (m != 0), math.nan, val)
    return torch.where((e == top) & (m == (1 << man_bits) - 1), math.nan, val)


def e4m3_bytes_to_f64(b: torch.Tensor) -> torch.Tensor:
    return _bits_to_float(b.long(), 4, 3, ieee_specials=False)


def le_words(b: torch.Tensor, n: int) -> torch.Tensor:
    """Little-endian n-byte words of uint8 [..., k * n] as int64 [..., k]."""
    b = b.long().unflatten(-1, (-1, n))
    return sum(b[..., i] << (8 * i) for i in range(n))


def ds_mla_rows_to_f64(rows: torch.Tensor) -> torch.Tensor:
    """float64 [..., 576] from 656-byte rows, by the documented byte layout."""
    nope = e4m3_bytes_to_f64(rows[..., :512]).unflatten(-1, (4, 128))
    scales = _bits_to_float(le_words(rows[..., 512:528], 4), 8, 23, True)
    rope = _bits_to_float(le_words(rows[..., 528:656], 2), 8, 7, True)
    return torch.cat([(nope * scales[..., None]).flatten(-2), rope], dim=-1)


def cache_to_f64(kv_cache: torch.Tensor, kv_scale=None) -> torch.Tensor:
    """float64 [num_slots, d_qk], the values of every cache slot."""
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    if kv_cache.dtype == torch.uint8:
        return ds_mla_rows_to_f64(flat)
    if kv_cache.dtype == torch.float8_e4m3fn:
        return e4m3_bytes_to_f64(flat.view(torch.uint8)) * float(kv_scale)
    return flat.double()


def sparse_decode_fp64(q, kv_cache, indices, topk_length=None, attn_sink=None,
                       softmax_scale=None, d_v=512, kv_scale=None):
    """One query token at a time: the keys its used entries name (in order, repeats included),
    a float64 softmax, FlashMLA's sink factor 1 / (1 + exp(sink - lse))."""
    b, s_q, h_q, d_qk = q.shape
    scale = d_qk ** -0.5 if softmax_scale is None else softmax_scale
    cache = cache_to_f64(kv_cache, kv_scale)
    out = torch.zeros(b, s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    for r in range(b):
        n = indices.shape[2] if topk_length is None else int(topk_length[r])
        for i in range(s_q):
            slots = [s for s in indices[r, i, :n].tolist() if s != -1]
            if not slots:
                continue
            k = cache[slots]  # (used, d_qk)
            s = q[r, i].double() @ k.T * scale  # (h_q, used)
            m = torch.logsumexp(s, dim=-1)
            o = torch.softmax(s, dim=-1) @ k[:, :d_v]
            if attn_sink is not None:
                o = o / (1 + torch.exp(attn_sink.double() - m))[:, None]
            out[r, i], lse[r, :, i] = o, m
    return out, lse


# ---- inputs ------------------------------------------------------------------------------------

def poisoned_indices(b, s_q, topk, num_slots, topk_length=None, repeats=True, minus_ones=True):
    """Random slots in [1, num_slots) (slot 0, which the reference gathers in place of unused
    entries, stays unnamed and poisoned), some -1 and some repeated; entries past topk_length
    hold garbage (huge, negative) that must never be read."""
    idx = torch.randint(1, num_slots, (b, s_q, topk), dtype=torch.int32)
    if repeats and topk > 1:
        idx[..., 1::7] = idx[..., 0:1]  # the first slot of each row several more times
    if minus_ones:
        idx[torch.rand(b, s_q, topk) < 0.1] = -1
    if topk_length is not None:
        past = (torch.arange(topk)[None, None, :] >= topk_length[:, None, None]).expand(b, s_q, -1)
        garbage = torch.tensor([2**31 - 1, -(2**31), -7, num_slots, 0], dtype=torch.int32)
        idx[past] = garbage[torch.randint(0, 5, (int(past.sum()),))]
    return idx


def used_slots(indices, topk_length, num_slots):
    topk = indices.shape[2]
    used = torch.ones_like(indices, dtype=torch.bool)
    if topk_length is not None:
        used = torch.arange(topk)[None, None, :] < topk_length[:, None, None]
    named = torch.zeros(num_slots, dtype=torch.bool)
    named[indices[used & (indices >= 0)].long()] = True
    return named


def make_cache(num_blocks, fmt, named, page=PAGE):
    """(kv_cache, kv_scale) of format fmt ("bf16", "fp16", "fp32", "fp8", "fp8_ds_mla") with
    random latents in the slots `named` marks and NaN (poison bytes) in all the others."""
    lat = torch.randn(num_blocks * page, 576) / 4
    lat[:, :512] *= torch.rand(num_blocks * page, 1) * 4  # tiles of differing ranges
    kv_scale = None
    if fmt == "fp8_ds_mla":
        rows = quantize_fp8_ds_mla(lat[:, :512], lat[:, 512:])
        rows[~named] = NAN_BYTE
        return rows.view(num_blocks, page, 1, 656), None
    if fmt == "fp8":
        kv_scale = torch.tensor([lat.abs().max() / 448])
        flat = quantize_fp8(lat, kv_scale)  # (torch_mla's quantizer: testing.quantize_per_tensor)
        flat.view(torch.uint8)[~named] = NAN_BYTE
    else:
        flat = lat.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fmt])
        flat[~named] = math.nan
    return flat.view(num_blocks, page, 1, 576), kv_scale


def check_against_fp64(q, kv_cache, indices, topk_length=None, attn_sink=None, kv_scale=None,
                       softmax_scale=None, out_tol=(1e-3, 1e-2)):
    out, lse = torch_mla.mla_decode_sparse(q, kv_cache, indices, topk_length=topk_length,
                                           attn_sink=attn_sink, kv_scale=kv_scale,
                                           softmax_scale=softmax_scale)
    ref_out, ref_lse = sparse_decode_fp64(q, kv_cache, indices, topk_length, attn_sink,
                                          softmax_scale, kv_scale=kv_scale)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref_out, atol=out_tol[0], rtol=out_tol[1])
    # +inf exactly where a query token has no used entry; float32 accumulation elsewhere.
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    return out, lse


# ---- the reference against the fp64 loop --------------------------------------------------------

# The grid, h_q x s_q x topk with b = 2: every (h_q, s_q) at topk 64 and 128, and topk
# 2048 once per h_q (each s_q at least once): 45 of the 60 cases. Trimmed because a topk-2048
# case costs 0.4-0.7 s (the fp64 loop and the fp32 reference over ~2000 keys a token; 2 shared
# cores, 4x that under the other helpers' load) against < 0.1 s at 64 and 128, and the rows of
# the reference are independent: s_q and h_q change its shapes, not its arithmetic, at any topk.
GRID = [(h, s, k) for h in (1, 3, 16, 64, 128) for s in (1, 2, 3, 4) for k in (64, 128)]
GRID += [(1, 1, 2048), (3, 2, 2048), (16, 3, 2048), (64, 4, 2048), (128, 1, 2048)]


@pytest.mark.parametrize("h_q,s_q,topk", GRID)
def test_reference_grid_matches_fp64(h_q, s_q, topk):
    num_blocks = 3 + topk // PAGE
    topk_length = torch.tensor([topk, int(torch.randint(1, topk, ()))], dtype=torch.int32)
    idx = poisoned_indices(2, s_q, topk, num_blocks * PAGE, topk_length)
    cache, _ = make_cache(num_blocks, "bf16", used_slots(idx, topk_length, num_blocks * PAGE))
    q = torch.randn(2, s_q, h_q, 576).bfloat16()
    check_against_fp64(q, cache, idx, topk_length, softmax_scale=0.1)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "fp8", "fp8_ds_mla"])
def test_cache_formats_match_fp64(fmt):
    b, s_q, h_q, topk, num_blocks = 3, 2, 16, 192, 6
    topk_length = torch.tensor([192, 70, 0], dtype=torch.int32)
    idx = poisoned_indices(b, s_q, topk, num_blocks * PAGE, topk_length)
    cache, kv_scale = make_cache(num_blocks, fmt, used_slots(idx, topk_length, num_blocks * PAGE))
    q_dtype = {"fp16": torch.float16, "fp32": torch.float32}.get(fmt, torch.bfloat16)
    q = torch.randn(b, s_q, h_q, 576).to(q_dtype)
    out, lse = check_against_fp64(q, cache, idx, topk_length, kv_scale=kv_scale)
    assert torch.isposinf(lse[2]).all() and (out[2] == 0).all()  # topk_length 0


def test_attn_sink_matches_fp64():
    # FlashMLA's sink draws: normal, with +inf (head's output 0) and -inf (no effect) mixed in.
    h_q = 16
    sink = torch.randn(h_q)
    sink[:3], sink[3:6] = math.inf, -math.inf
    idx = poisoned_indices(2, 3, 128, 4 * PAGE)
    idx[1, 2] = -1  # a token with no entry: out 0 and lse +inf, whatever the sink
    cache, _ = make_cache(4, "fp8_ds_mla", used_slots(idx, None, 4 * PAGE))
    q = torch.randn(2, 3, h_q, 576).bfloat16()
    out, lse = check_against_fp64(q, cache, idx, attn_sink=sink)
    assert (out[:, :, :3] == 0).all()
    plain, plain_lse = torch_mla.mla_decode_sparse(q, cache, idx)
    assert torch.equal(lse, plain_lse)  # the sink leaves lse out
    assert torch.equal(out[:, :, 3:6], plain[:, :, 3:6])
    assert (out[1, 2] == 0).all() and torch.isposinf(lse[1, :, 2]).all()


def test_repeated_slot_counts_once_per_occurrence():
    # Entries [a, a, b] weigh a twice: the same as [a, c, b] with c a copy of a's row.
    cache, _ = make_cache(2, "bf16", torch.ones(2 * PAGE, dtype=torch.bool))
    a, b_, c = 5, 77, 100
    cache.view(-1, 576)[c] = cache.view(-1, 576)[a]
    q = torch.randn(1, 1, 8, 576).bfloat16()
    twice = torch.tensor([[[a, a, b_]]], dtype=torch.int32)
    copy = torch.tensor([[[a, c, b_]]], dtype=torch.int32)
    once = torch.tensor([[[a, b_]]], dtype=torch.int32)
    out2, lse2 = torch_mla.mla_decode_sparse(q, cache, twice)
    outc, lsec = torch_mla.mla_decode_sparse(q, cache, copy)
    out1, lse1 = torch_mla.mla_decode_sparse(q, cache, once)
    torch.testing.assert_close(out2, outc, atol=0, rtol=0)
    torch.testing.assert_close(lse2, lsec, atol=1e-6, rtol=0)
    assert not torch.allclose(out2.float(), out1.float(), atol=1e-3)


def test_minus_one_entries_and_empty_rows():
    cache, _ = make_cache(2, "bf16", torch.ones(2 * PAGE, dtype=torch.bool))
    q = torch.randn(2, 2, 4, 576).bfloat16()
    idx = torch.tensor([[[3, -1, 9, -1], [-1, -1, -1, -1]],
                        [[-1, 7, -1, -1], [1, 2, 3, 4]]], dtype=torch.int32)
    out, lse = check_against_fp64(q, cache, idx)
    assert (out[0, 1] == 0).all() and torch.isposinf(lse[0, :, 1]).all()
    # The -1 entries change nothing: the same as the row without them.
    alone, alone_lse = torch_mla.mla_decode_sparse(q[:1, :1], cache, idx[:1, :1, [0, 2]])
    torch.testing.assert_close(out[:1, :1], alone, atol=0, rtol=0)
    torch.testing.assert_close(lse[:1, :, :1], alone_lse, atol=1e-6, rtol=0)


def test_topk_length_zero_and_partial():
    cache, _ = make_cache(3, "bf16", torch.ones(3 * PAGE, dtype=torch.bool))
    q = torch.randn(3, 1, 16, 576).bfloat16()
    idx = torch.randint(0, 3 * PAGE, (3, 1, 64), dtype=torch.int32)
    lens = torch.tensor([0, 17, 64], dtype=torch.int32)
    out, lse = check_against_fp64(q, cache, idx, lens)
    assert (out[0] == 0).all() and torch.isposinf(lse[0]).all()
    head, head_lse = torch_mla.mla_decode_sparse(q[1:2], cache, idx[1:2, :, :17].contiguous())
    torch.testing.assert_close(out[1:2], head, atol=0, rtol=0)
    torch.testing.assert_close(lse[1:2], head_lse, atol=1e-6, rtol=0)


@pytest.mark.parametrize("page", [2, 61])
def test_any_page_size(page):
    # FlashMLA's sparse decode takes any page size (its tests use 2, 61, 69 and 576 as well as
    # 64): slot s is row s % page_size of page s // page_size.
    num_blocks = 300 // page + 1
    lens = torch.tensor([128, 50], dtype=torch.int32)
    idx = poisoned_indices(2, 2, 128, num_blocks * page, lens)
    for fmt in ("bf16", "fp8_ds_mla"):
        cache, _ = make_cache(num_blocks, fmt, used_slots(idx, lens, num_blocks * page), page)
        check_against_fp64(torch.randn(2, 2, 16, 576).bfloat16(), cache, idx, lens)


def test_page_padded_strided_inputs():
    # FlashMLA's tests pass a cache whose pages are padded (page stride > 64 rows) and indices
    # and q with padded rows: only the last dim must be contiguous.
    idx = poisoned_indices(2, 2, 64, 4 * PAGE)
    cache, _ = make_cache(4, "fp8_ds_mla", used_slots(idx, None, 4 * PAGE))
    padded = torch.full((4, PAGE + 1, 1, 656), NAN_BYTE, dtype=torch.uint8)[:, :PAGE]
    padded.copy_(cache)
    idx_p = torch.zeros(3, 3, 64 + 128, dtype=torch.int32)[:2, :2, :64]
    idx_p.copy_(idx)
    q = torch.randn(2, 2, 16, 576).bfloat16()
    q_p = torch.zeros(3, 3, 17, 576 + 128, dtype=torch.bfloat16)[:2, :2, :16, :576]
    q_p.copy_(q)
    assert not (padded.is_contiguous() or idx_p.is_contiguous() or q_p.is_contiguous())
    out, lse = check_against_fp64(q_p, padded, idx_p)
    want, want_lse = torch_mla.mla_decode_sparse(q, cache, idx)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_reference_chunks_agree():
    # The reference takes query tokens max_keys // topk at a time: chunking changes nothing
    # but float32 rounding (a batched matmul of another shape may block its sums otherwise:
    # one bf16 ulp in the output at most).
    idx = poisoned_indices(3, 4, 64, 4 * PAGE)
    cache, _ = make_cache(4, "bf16", used_slots(idx, None, 4 * PAGE))
    q = torch.randn(3, 4, 8, 576).bfloat16()
    args = (q, cache, idx, None, None, 0.05, 512)
    whole = mla_decode_sparse_reference(*args)
    for max_keys in (1, 64, 64 * 5):
        part = mla_decode_sparse_reference(*args, max_keys=max_keys)
        torch.testing.assert_close(part[0], whole[0], rtol=2 ** -7, atol=1e-6)
        torch.testing.assert_close(part[1], whole[1], rtol=1e-6, atol=1e-6)


def test_schedule_is_the_dense_one_over_each_tokens_entry_count():
    # Each (request, query token) pair is a one-token request (the tokens have their own
    # entries): request r's length repeated s_q times.
    idx = torch.zeros(5, 2, 2048, dtype=torch.int32)
    lens = torch.tensor([0, 64, 2048, 100, 1], dtype=torch.int32)
    per_token = torch.tensor([0, 0, 64, 64, 2048, 2048, 100, 100, 1, 1], dtype=torch.int32)
    for tl, L in ((None, torch.full((10,), 2048, dtype=torch.int32)), (lens, per_token)):
        got = torch_mla.get_sparse_decode_schedule(idx, 64, tl)
        want = torch_mla.get_decode_schedule(L, 1, 64)
        assert torch.equal(got.metadata, want.metadata)
        assert torch.equal(got.num_splits, want.num_splits)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_86", "sm_100a"])
def test_sm90_kernel_where_it_pays_on_sm90a(monkeypatch, arch):
    # The SM90 sparse kernel runs on sm_90a only, over a 16-bit cache where h_q >= 64 and the
    # launch has at least 64 CTAs of 64 heads (b * s_q * ceil(h_q / 64)); at 64-128 heads its
    # split variant in its place, also from 2 query tokens (split_sparse_pays);
    # TORCH_MLA_SPARSE_PRODUCER=0 keeps the SM90 kernel itself. TORCH_MLA_SPARSE_SM90=1 takes
    # it for every shape, =0 never (the arch lookup stubbed: no GPU needed).
    from torch_mla.ops import dispatch

    monkeypatch.setattr(dispatch, "_small_kernel_arch", lambda device: arch)
    monkeypatch.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
    monkeypatch.setenv("TORCH_MLA_SPARSE_KEYSM", "0")  # (h_q <= 32: test_keysm_sparse_kernel)
    cache = torch.empty(2, 64, 1, 576, dtype=torch.bfloat16)
    native = "sm90" if arch == "sm_90a" else "sm80"
    shapes = {(128, 1, 128): native, (32, 2, 128): native, (128, 1, 64): native,
              (64, 2, 96): native, (32, 1, 128): native, (64, 1, 64): native,
              (2, 2, 128): "sm80", (63, 1, 64): "sm80", (32, 1, 64): "sm80",
              (128, 2, 32): "sm80", (1024, 1, 16): "sm80"}
    split = "sm90_split" if arch == "sm_90a" else "sm80"
    for flag, want_default in ((None, None), ("1", native), ("0", "sm80")):
        if flag is None:
            monkeypatch.delenv("TORCH_MLA_SPARSE_SM90", raising=False)
        else:
            monkeypatch.setenv("TORCH_MLA_SPARSE_SM90", flag)
        for (b, s_q, h_q), want in shapes.items():
            q = torch.empty(b, s_q, h_q, 576, dtype=torch.bfloat16)
            monkeypatch.setenv("TORCH_MLA_SPARSE_PRODUCER", "0")
            assert sparse_ops.sparse_backend(q, cache, 512) == (want_default or want, ""), (
                flag, b, s_q, h_q)
            monkeypatch.delenv("TORCH_MLA_SPARSE_PRODUCER")
            # (by default the split at 64-128 heads where the SM90 kernel would run, and from
            # 2 query tokens where the portable kernel would)
            by_default = want_default or want
            if flag != "0" and 64 <= h_q <= 128 and b * s_q >= 2:
                by_default = split
            assert sparse_ops.sparse_backend(q, cache, 512) == (by_default, ""), (
                flag, b, s_q, h_q)
    q = torch.empty(1, 1, 128, 576, dtype=torch.bfloat16)  # (one token: the portable kernel)
    monkeypatch.delenv("TORCH_MLA_SPARSE_SM90", raising=False)
    assert sparse_ops.sparse_backend(q, cache, 512) == ("sm80", "")
    assert sparse_ops.sm90_sparse_pays(64, 1, 64) and not sparse_ops.sm90_sparse_pays(63, 1, 64)
    assert sparse_ops.sm90_sparse_pays(32, 1, 128) and not sparse_ops.sm90_sparse_pays(128, 2, 32)
    # over an FP8 cache: from 32 CTAs at h_q >= 64, from 128 below
    fp8 = {(128, 1, 16): True, (64, 2, 32): True, (32, 1, 128): True, (32, 2, 64): True,
           (32, 1, 64): True, (31, 1, 64): False, (32, 2, 32): False, (2, 2, 128): False}
    for (b, s_q, h_q), want in fp8.items():
        assert sparse_ops.sm90_sparse_pays(b, s_q, h_q, fp8=True) == want, (b, s_q, h_q)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_86"])
def test_keysm_sparse_kernel_by_default(monkeypatch, arch):
    # The keys-on-M sparse kernel on sm_90a for h_q <= 32 (8, 16 or 32 columns) over every cache
    # format unless TORCH_MLA_SPARSE_KEYSM=0; it goes before the SM90 kernel's flag; otherwise
    # the other kernels' rules.
    from torch_mla.ops import dispatch

    monkeypatch.setattr(dispatch, "_small_kernel_arch", lambda device: arch)
    monkeypatch.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
    monkeypatch.setenv("TORCH_MLA_SPARSE_SM90", "1")  # (the keys-on-M kernel goes first)
    caches = {"plain": torch.empty(2, 64, 1, 576, dtype=torch.bfloat16),
              "fp8": torch.empty(2, 64, 1, 576, dtype=torch.float8_e4m3fn),
              "fp8_ds_mla": torch.empty(2, 64, 1, 656, dtype=torch.uint8)}
    for flag in ("0", "1", None):
        if flag is None:
            monkeypatch.delenv("TORCH_MLA_SPARSE_KEYSM", raising=False)
        else:
            monkeypatch.setenv("TORCH_MLA_SPARSE_KEYSM", flag)
        for fmt, cache in caches.items():
            for h_q, cols in ((1, 8), (16, 16), (20, 32), (32, 32), (33, 0), (64, 0), (128, 0)):
                q = torch.empty(2, 1, h_q, 576, dtype=torch.bfloat16)
                keysm = arch == "sm_90a" and cols > 0 and flag != "0"
                want = "sm90_keysm" if keysm else "sm90" if arch == "sm_90a" else "sm80"
                # (over the 16-bit cache and the 656-byte rows at 64-128 heads the split kernel
                # in the SM90 kernel's place, unless TORCH_MLA_SPARSE_PRODUCER=0)
                default = ("sm90_split" if want == "sm90" and fmt != "fp8"
                           and 64 <= h_q <= 128 else want)
                assert sparse_ops.sparse_backend(q, cache, 512) == (default, ""), (
                    flag, fmt, h_q)
                monkeypatch.setenv("TORCH_MLA_SPARSE_PRODUCER", "0")
                assert sparse_ops.sparse_backend(q, cache, 512) == (want, ""), (flag, fmt, h_q)
                assert sparse_ops.keysm_sparse_columns(h_q) == cols
                # TORCH_MLA_SPARSE_PRODUCER=1: the SM90 kernel's producer variant in its place
                monkeypatch.setenv("TORCH_MLA_SPARSE_PRODUCER", "1")
                producer = want == "sm90" and fmt != "fp8"  # (not over e4m3)
                assert sparse_ops.sparse_backend(q, cache, 512) == (
                    "sm90_producer" if producer else want, ""), (flag, fmt, h_q)
                # =split: its variant with FlashMLA's warpgroup split, the same places
                monkeypatch.setenv("TORCH_MLA_SPARSE_PRODUCER", "split")
                assert sparse_ops.sparse_backend(q, cache, 512) == (
                    "sm90_split" if producer else want, ""), (flag, fmt, h_q)
                monkeypatch.delenv("TORCH_MLA_SPARSE_PRODUCER")
                # TORCH_MLA_SPARSE_KEYSM_RS=1: its ping-pong variant, the FP8 caches, every
                # h_q (64 columns from 33 heads, a CTA per 64 heads above 64), on sm_90a
                # whatever TORCH_MLA_SPARSE_KEYSM says
                monkeypatch.setenv("TORCH_MLA_SPARSE_KEYSM_RS", "1")
                rs = arch == "sm_90a" and fmt != "plain"
                assert sparse_ops.sparse_backend(q, cache, 512) == (
                    "sm90_keysm_rs" if rs else default, ""), (flag, fmt, h_q)
                assert sparse_ops.keysm_rs_sparse_columns(h_q) == (cols or 64)
                # =32: the same kernel, at most 32 columns a CTA
                monkeypatch.setenv("TORCH_MLA_SPARSE_KEYSM_RS", "32")
                assert sparse_ops.sparse_backend(q, cache, 512) == (
                    "sm90_keysm_rs" if rs else default, ""), (flag, fmt, h_q)
                assert sparse_ops.keysm_rs_sparse_columns(h_q) == (cols or 32)
                # (and the schedule is sized for its CTAs: one wave of ceil(h_q / 32) a part)
                sched = sparse_ops.get_sparse_decode_schedule(
                    torch.zeros(2, 1, 64, dtype=torch.int32), h_q, num_sms=132)
                assert sched.metadata.shape[0] == 132 // -(-h_q // (cols or 32))
                monkeypatch.delenv("TORCH_MLA_SPARSE_KEYSM_RS")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_86"])
def test_fp8_caches_run_a_kernel(monkeypatch, arch):
    # The FP8 caches run both kernels (each dequantizes, in its gather or in shared memory),
    # the SM90 one (over the 656-byte rows its split variant) from fewer heads than over a
    # 16-bit cache (sm90_sparse_pays); the 656-byte rows with bf16 q only (their RoPE values
    # are bf16).
    from torch_mla.ops import dispatch

    monkeypatch.setattr(dispatch, "_small_kernel_arch", lambda device: arch)
    monkeypatch.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
    monkeypatch.delenv("TORCH_MLA_SPARSE_SM90", raising=False)
    monkeypatch.setenv("TORCH_MLA_SPARSE_KEYSM", "0")  # (h_q <= 32: test_keysm_sparse_kernel)
    e4m3 = torch.empty(2, 64, 1, 576, dtype=torch.float8_e4m3fn)
    rows = torch.empty(2, 64, 1, 656, dtype=torch.uint8)
    big = "sm90" if arch == "sm_90a" else "sm80"
    for dtype in (torch.bfloat16, torch.float16):
        # (128 CTAs of 16 heads: the portable kernel over a 16-bit cache, the SM90 one here)
        for shape, want in (((1, 1, 16), "sm80"), ((128, 1, 128), big), ((128, 1, 16), big)):
            q = torch.empty(*shape, 576, dtype=dtype)
            assert sparse_ops.sparse_backend(q, e4m3, 512) == (want, "")
            if want == "sm90" and shape[2] >= 64:  # (over the 656-byte rows at 64-128 heads
                want = "sm90_split"  # the split kernel in its place)
            want = (want, "") if dtype == torch.bfloat16 else (
                "reference", "the sparse kernel over the 656-byte cache takes bf16 q (the rows' "
                             "RoPE values are bf16), got torch.float16")
            assert sparse_ops.sparse_backend(q, rows, 512) == want
    q = torch.empty(1, 1, 16, 576)  # fp32 q: the reference, whatever the cache
    assert sparse_ops.sparse_backend(q, rows, 512)[0] == "reference"
    # Over the 656-byte rows at 64-128 heads the split where the SM90 kernel pays and from 2
    # one-token requests below that (split_sparse_pays); at other head counts the SM90
    # kernel's own rules.
    # TORCH_MLA_SPARSE_PRODUCER=0 keeps the SM90 / portable kernel, =1 its producer variant
    # where the SM90 kernel pays, the portable one below.
    for shape, want in (((1, 1, 64), "sm80"), ((1, 1, 128), "sm80"), ((2, 1, 64), "sm90_split"),
                        ((1, 2, 64), "sm90_split"), ((2, 2, 64), "sm90_split"),
                        ((2, 1, 128), "sm90_split"), ((128, 1, 100), "sm90_split"),
                        ((1, 1, 48), "sm80"), ((4, 1, 48), "sm80"), ((128, 1, 48), "sm90"),
                        ((4, 1, 256), "sm80"), ((128, 1, 256), "sm90")):
        q = torch.empty(*shape, 576, dtype=torch.bfloat16)
        pays = sparse_ops.sm90_sparse_pays(*shape, True)
        if arch != "sm_90a":
            want = "sm80"
        assert sparse_ops.sparse_backend(q, rows, 512) == (want, ""), shape
        for flag, other in (("0", "sm90" if pays else "sm80"),
                            ("1", "sm90_producer" if pays else "sm80")):
            monkeypatch.setenv("TORCH_MLA_SPARSE_PRODUCER", flag)
            assert sparse_ops.sparse_backend(q, rows, 512) == (
                other if arch == "sm_90a" else "sm80", ""), (shape, flag)
        monkeypatch.delenv("TORCH_MLA_SPARSE_PRODUCER")
    assert not sparse_ops.split_sparse_pays(1, 1, 64) and sparse_ops.split_sparse_pays(2, 1, 64)
    assert not sparse_ops.split_sparse_pays(1, 1, 128) and sparse_ops.split_sparse_pays(1, 2, 128)
    assert not sparse_ops.split_sparse_pays(128, 1, 48, True)
    assert not sparse_ops.split_sparse_pays(128, 1, 256, True)


def test_fp8_cache_rows_must_be_16_byte_aligned_for_the_kernel():
    # The kernel's 16-byte loads: a contiguous cache passes as it is (its bytes, no copy); a
    # misaligned one is an error naming what to fix, never a silent copy of the cache.
    rows = torch.zeros(3, 64, 1, 656, dtype=torch.uint8)
    assert sparse_ops.fp8_cache_bytes(rows).data_ptr() == rows.data_ptr()
    assert sparse_ops.fp8_cache_bytes(rows).shape == (3, 64, 656)
    e4m3 = torch.zeros(3, 64, 1, 576, dtype=torch.float8_e4m3fn)
    assert sparse_ops.fp8_cache_bytes(e4m3).dtype == torch.uint8
    # rows 664 bytes apart (a padded buffer) and a cache starting 8 bytes into its storage
    padded = torch.zeros(3, 64, 1, 664, dtype=torch.uint8)[..., :656]
    shifted = torch.zeros(3 * 64 * 656 + 8, dtype=torch.uint8)[8:].view(3, 64, 1, 656)
    with pytest.raises(ValueError) as e:
        sparse_ops.fp8_cache_bytes(padded)
    assert_expected_inline(str(e.value), """torch_mla.mla_decode_sparse: the sparse kernel reads the fp8_ds_mla cache in 16-byte loads: kv_cache's data pointer and its page and row strides must be multiples of 16 bytes, got data pointer % 16 = 0, strides [42496, 664] bytes (a contiguous cache qualifies)""")
    with pytest.raises(ValueError, match="data pointer % 16 = 8"):
        sparse_ops.fp8_cache_bytes(shifted)


# ---- the 656-byte layout: quantization, dequantization, append ---------------------------------

def test_scale_rule_is_a_power_of_two_rounded_up():
    x = torch.randn(50, 512) * torch.logspace(-8, 4, 50)[:, None]
    x[0] = 0  # an all-zero row: the 1e-4 floor
    x[1, :128] = 448 * 2.0**-3  # amax / 448 exactly a power of two: kept
    x[1, 128:256] = 448 * 2.0**-3 * 1.01  # just above: the next power
    got = fp8_ds_mla_scales(x)
    for r in range(50):
        for t in range(4):
            amax = float(x[r, 128 * t:128 * (t + 1)].abs().max())
            # fp32 division as the quantizer does it, then the smallest power of two >= it
            s = max(struct.unpack("f", struct.pack("f", amax / 448))[0], 1e-4)
            mant, exp = math.frexp(s)  # s = mant * 2**exp, 0.5 <= mant < 1
            want = 2.0 ** (exp - 1) if mant == 0.5 else 2.0**exp
            assert float(got[r, t]) == want, (r, t, amax)
    assert float(got[0, 0]) == 2.0**-13 and float(got[1, 0]) == 2.0**-3
    assert float(got[1, 1]) == 2.0**-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantize_round_trip(dtype):
    kv_c = torch.randn(300, 512) * torch.logspace(-6, 2, 300)[:, None]
    kv_c[:, 7] *= 40  # an outlier per row: the other values of its tile go subnormal
    kv_c = kv_c.to(dtype)
    k_pe = (torch.randn(300, 64) * 3).to(dtype)
    rows = quantize_fp8_ds_mla(kv_c, k_pe)
    assert rows.dtype == torch.uint8 and rows.shape == (300, 656)
    dec = ds_mla_rows_to_f64(rows)  # the bytes read back independently
    torch.testing.assert_close(dequantize_fp8_ds_mla(rows).double(), dec, atol=0, rtol=0)
    scale = fp8_ds_mla_scales(kv_c).double().repeat_interleave(128, dim=1)  # (300, 512)
    x = kv_c.double()
    # Nearest e4m3: within half a step, 2^-4 relative for normals (3 mantissa bits), 2^-10 *
    # scale absolute in the subnormal range; the largest value of a tile stays within 448.
    err = (dec[:, :512] - x).abs()
    assert (err <= torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)).all()
    assert (x.abs() / scale <= 448).all()
    assert torch.equal(dec[:, 512:], k_pe.to(torch.bfloat16).double())


def test_byte_layout_by_hand():
    kv_c = torch.zeros(1, 512)
    kv_c[0, :128] = 1.5  # amax 1.5 -> scale 2^-8 (1.5 / 448 = 0.00335 -> 0.0039)
    kv_c[0, 128] = -448.0  # tile 1: scale 1, value -448 (e4m3fn 0xFE)
    k_pe = torch.arange(64, dtype=torch.float32)[None] - 32
    row = quantize_fp8_ds_mla(kv_c, k_pe)[0].tolist()
    assert struct.unpack("<4f", bytes(row[512:528])) == (2.0**-8, 1.0, 2.0**-13, 2.0**-13)
    assert row[128] == 0xFE and row[129:256] == [0] * 127
    assert row[0] == 0x7C  # 1.5 / 2^-8 = 384 = 1.5 * 2^8: exponent 8 + 7 = 15, mantissa 4
    rope = struct.unpack("<64H", bytes(row[528:656]))
    assert [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in rope] == list(range(-32, 32))


def test_append_kv_writes_656_byte_rows():
    cache = torch.full((3, 64, 1, 656), NAN_BYTE, dtype=torch.uint8)
    kv_c, k_pe = torch.randn(5, 512).bfloat16(), torch.randn(5, 64).bfloat16()
    slots = torch.tensor([130, -1, 5, 64, -3])
    torch_mla.append_kv(cache, kv_c, k_pe, slots)
    flat = cache.view(-1, 656)
    want = quantize_fp8_ds_mla(kv_c, k_pe)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s], want[i])
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[[130, 5, 64]] = True
    assert (flat[~written] == NAN_BYTE).all()
    torch_mla.append_kv(cache, kv_c[:2], k_pe[:2], torch.tensor([-1, -1]))  # all padding
    assert (flat[~written] == NAN_BYTE).all()
    # The written cache decodes to what was appended (as the round trip bounds allow).
    idx = torch.tensor([[[130, 5, 64]]], dtype=torch.int32)
    check_against_fp64(torch.randn(1, 1, 4, 576).bfloat16(), cache, idx)


def test_append_kv_656_under_compile():
    torch._dynamo.reset()
    cache = torch.zeros(2, 64, 1, 656, dtype=torch.uint8)
    kv_c, k_pe, slots = torch.randn(3, 512), torch.randn(3, 64), torch.tensor([7, -1, 70])
    # (aot_eager: the mutation goes through functionalization as under inductor, without its
    # compile time)
    torch.compile(torch_mla.append_kv, fullgraph=True, backend="aot_eager")(cache, kv_c, k_pe,
                                                                           slots)
    eager = torch.zeros_like(cache)
    torch_mla.append_kv(eager, kv_c, k_pe, slots)
    assert torch.equal(cache, eager) and cache.view(-1, 656)[7].any()


# ---- the op: schema, opcheck, autograd, torch.compile --------------------------------------------

def op_args(fmt="fp8_ds_mla", b=2, s_q=2, h_q=16, topk=128, sink=True, lengths=True):
    """The op's arguments; with lengths, a random topk_length and garbage past it."""
    lens = torch.randint(0, topk + 1, (b,), dtype=torch.int32) if lengths else None
    idx = poisoned_indices(b, s_q, topk, 4 * PAGE, lens)
    cache, kv_scale = make_cache(4, fmt, used_slots(idx, lens, 4 * PAGE))
    q = torch.randn(b, s_q, h_q, 576).bfloat16()
    sched = torch_mla.get_sparse_decode_schedule(idx, h_q, lens)
    attn_sink = torch.randn(h_q) if sink else None
    return (q, cache, idx, lens, attn_sink, sched.metadata, sched.num_splits, 0.05, 512,
            kv_scale)


class TestSparseSchema(expecttest.TestCase):
    def test_schema(self):
        schema = str(torch.ops.torch_mla.mla_decode_sparse.default._schema)
        self.assertExpectedInline(schema, """torch_mla::mla_decode_sparse(Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, Tensor? attn_sink, Tensor sched_metadata, Tensor num_splits, float softmax_scale, int d_v, Tensor? kv_scale=None) -> (Tensor, Tensor)""")


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla"])
def test_opcheck(fmt):
    # Not test_schema with the float8_e4m3fn cache: its SchemaCheckMode compares inputs with a
    # multiply torch has no float8 CPU kernel for (as tests/test_fp8.py notes).
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    kwargs = {"test_utils": utils} if fmt == "fp8" else {}
    args = op_args(fmt, s_q=2, h_q=4, topk=64)
    torch.library.opcheck(torch.ops.torch_mla.mla_decode_sparse.default, args, **kwargs)


def test_opcheck_and_backward_with_inputs_requiring_grad():
    args = list(op_args())
    args[0] = args[0].clone().requires_grad_()
    args[4] = args[4].clone().requires_grad_()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.torch_mla.mla_decode_sparse.default, tuple(args),
                          test_utils=utils)
    q, cache, idx, lens, sink = args[:5]
    out, lse = torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens, attn_sink=sink)
    assert out.requires_grad
    with torch.no_grad():
        want, _ = torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens, attn_sink=sink)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="torch_mla.mla_decode_sparse is forward-only"):
        out.float().sum().backward()


def sparse_step(q, kv_cache, indices, topk_length, attn_sink):
    sched = torch_mla.get_sparse_decode_schedule(indices, q.shape[2], topk_length)
    return torch_mla.mla_decode_sparse(q, kv_cache, indices, topk_length=topk_length,
                                       attn_sink=attn_sink, schedule=sched)


def test_compiled_sparse_step_no_recompiles_as_batch_and_topk_vary():
    torch._dynamo.reset()
    # (aot_eager: dynamo's guards, and so the recompiles, are inductor's; the op is opaque to
    # both, and this skips inductor's compile time on a shared CPU)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(sparse_step, backend=counter, fullgraph=True)
    for b, topk in ((3, 128), (5, 64), (2, 320)):
        q, cache, idx, lens, sink = op_args(b=b, topk=topk)[:5]
        # batch and topk are dynamic dims of a captured shape (the cache and heads are not).
        for t, dims in ((q, (0,)), (idx, (0, 2)), (lens, (0,))):
            torch._dynamo.mark_dynamic(t, dims)
        out, lse = compiled(q, cache, idx, lens, sink)
        want, want_lse = sparse_step(q, cache, idx, lens, sink)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compiled_graph_has_the_op():
    torch._dynamo.reset()
    explain = torch._dynamo.explain(sparse_step)(*op_args()[:5])
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    ops = [str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [o for o in ops if "torch_mla" in o] == ["torch_mla.get_decode_schedule",
                                                    "torch_mla.mla_decode_sparse"]


# ---- FlashMLA's interface -------------------------------------------------------------------------

def test_compat_flashmla_positional_call():
    # As FlashMLA's tests/lib.py calls it: positional, FlashMLASchedMeta, is_fp8_kvcache=True,
    # the 656-byte cache as float8_e4m3fn, block_table and cache_seqlens None.
    from torch_mla.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    q, cache, idx, lens, sink = op_args(b=3, s_q=3, h_q=16, topk=128)[:5]
    sched, none = get_mla_metadata()
    assert none is None
    for _ in range(2):  # the first call fills sched in, the second reuses it
        out, lse = flash_mla_with_kvcache(q, cache.view(torch.float8_e4m3fn), None, None, 512,
                                          sched, None, 0.07, False, True, idx, sink, None, None,
                                          lens, None)
        want, want_lse = torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens,
                                                     attn_sink=sink, softmax_scale=0.07)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert sched.have_initialized
    ref_out, ref_lse = sparse_decode_fp64(q, cache, idx, lens, sink, 0.07)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    with pytest.raises(ValueError, match="sched_meta was made for"):
        flash_mla_with_kvcache(q[:2], cache, None, None, 512, sched, None, 0.07, False, True,
                               idx[:2], sink, None, None, lens[:2], None)


def test_compat_vllm_flashmla_sparse_call():
    # vLLM's flashmla_sparse backend: keywords, a uint8 cache, a dummy block table and
    # max-length cache_seqlens (not read), a fresh get_mla_metadata() schedule.
    from torch_mla.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    q, cache, idx = op_args(b=4, s_q=1, h_q=16, topk=64, lengths=False)[:3]
    out, lse = flash_mla_with_kvcache(
        q=q, k_cache=cache, block_table=torch.empty(8, 1, dtype=torch.int32), head_dim_v=512,
        cache_seqlens=torch.full((8,), 163840, dtype=torch.int32),
        tile_scheduler_metadata=get_mla_metadata()[0], is_fp8_kvcache=True, indices=idx,
        softmax_scale=0.05)
    ref_out, ref_lse = sparse_decode_fp64(q, cache, idx, softmax_scale=0.05)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # The older tensor form of get_mla_metadata with topk gives the object form too.
    meta, none = get_mla_metadata(torch.full((4,), 100, dtype=torch.int32), 16, 1,
                                  num_heads_q=16, is_fp8_kvcache=True, topk=64)
    assert none is None and not meta.have_initialized


class TestCompatErrors(expecttest.TestCase):
    def call(self, **change):
        from torch_mla.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata

        q, cache, idx = op_args(b=2, s_q=1, h_q=16, topk=64, lengths=False)[:3]
        kwargs = dict(q=q, k_cache=cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                      tile_scheduler_metadata=get_mla_metadata()[0], is_fp8_kvcache=True,
                      indices=idx)
        kwargs.update(change)
        with self.assertRaises((ValueError, TypeError, NotImplementedError)) as cm:
            flash_mla_with_kvcache(**kwargs)
        return str(cm.exception)

    def test_errors(self):
        self.assertExpectedInline(self.call(causal=True), """causal must be False with indices (sparse attention): the indices say which tokens each query token sees""")
        self.assertExpectedInline(self.call(extra_k_cache=torch.zeros(1)), """unsupported FlashMLA sparse arguments: extra_k_cache""")
        bf16 = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)
        self.assertExpectedInline(self.call(k_cache=bf16), """is_fp8_kvcache=True with indices means DeepSeek-V3.2's 656-byte FP8 cache: uint8 or float8_e4m3fn [num_blocks, 64, 1, 656], got torch.bfloat16 [4, 64, 1, 576]""")


# ---- errors ----------------------------------------------------------------------------------------

class TestSparseErrors(expecttest.TestCase):
    """Each bad input raises before anything runs, saying what is wrong and what is expected."""

    def setUp(self):
        self.args = op_args(fmt="bf16", b=2, s_q=1, h_q=16, topk=64, lengths=False)

    def err(self, **change):
        q, cache, idx, _, sink = self.args[:5]
        lens = torch.tensor([64, 30], dtype=torch.int32)
        args = dict(q=q, kv_cache=cache, indices=idx, topk_length=lens, attn_sink=sink)
        args.update(change)
        with self.assertRaises((ValueError, TypeError)) as cm:
            torch_mla.mla_decode_sparse(**args)
        return str(cm.exception)

    def test_shapes_and_dtypes(self):
        q, cache, idx = self.args[:3]
        ds = torch.zeros(4, 64, 1, 656, dtype=torch.uint8)
        e = self.err
        self.assertExpectedInline(e(q=q.to(torch.int8)), """q must be bfloat16, float16 or float32, got torch.int8""")
        self.assertExpectedInline(e(q=q[:, 0]), """q must have shape [batch, s_q, h_q, d_qk], got [2, 16, 576]""")
        self.assertExpectedInline(e(kv_cache=cache.half()), """kv_cache must be q's dtype (torch.bfloat16), float8_e4m3fn (with kv_scale) or uint8 [num_blocks, page_size, 1, 656] (DeepSeek-V3.2's FP8 layout), got torch.float16""")
        self.assertExpectedInline(e(kv_cache=cache.view(4, 64, 2, 288)), """kv_cache must have shape [num_blocks, page_size, 1, width] (one latent head; page_size 64 in torch_mla's caches), got [4, 64, 2, 288]""")
        self.assertExpectedInline(e(kv_cache=ds[..., :576]), """a uint8 kv_cache is DeepSeek-V3.2's FP8 layout, 656 bytes a token: shape [num_blocks, page_size, 1, 656], got [4, 64, 1, 576]""")
        self.assertExpectedInline(e(q=q[..., :512], kv_cache=ds), """the 656-byte FP8 cache holds 512 + 64 = 576 values a token; q's head dim must be 576, got 512""")
        self.assertExpectedInline(e(kv_cache=ds, kv_scale=torch.ones(1)), """the 656-byte FP8 cache carries its own scales (one per 128 values in every row): pass kv_scale=None""")
        self.assertExpectedInline(e(kv_cache=cache.to(torch.float8_e4m3fn)), """kv_cache is float8_e4m3fn: pass kv_scale=, a float32 tensor of shape [1] (value = kv_cache.float() * kv_scale)""")
        self.assertExpectedInline(e(kv_scale=torch.ones(1)), """kv_scale is the scale of a float8_e4m3fn kv_cache; this kv_cache is torch.bfloat16: pass kv_scale=None""")
        self.assertExpectedInline(e(kv_cache=cache[..., :512]), """kv_cache head dim (512) must equal q's head dim d_qk (576)""")
        self.assertExpectedInline(e(d_v=600), """d_v must be in (0, d_qk=576] (V is the first d_v values of a cached row), got 600""")
        self.assertExpectedInline(e(indices=idx.long()), """indices must be int32 [batch, s_q, topk], got torch.int64 [2, 1, 64]""")
        self.assertExpectedInline(e(indices=idx[:1]), """indices has shape [1, 1, 64], expected [batch, s_q, topk] = [2, 1, topk] (q is [2, 1, 16, 576])""")
        self.assertExpectedInline(e(indices=idx.transpose(1, 2)), """indices has shape [2, 64, 1], expected [batch, s_q, topk] = [2, 1, topk] (q is [2, 1, 16, 576])""")
        self.assertExpectedInline(e(indices=torch.zeros(2, 1, 128, dtype=torch.int32)[..., ::2]), """indices's last dimension must be contiguous (stride 1), got stride 2""")
        self.assertExpectedInline(e(topk_length=torch.zeros(3, dtype=torch.int32)), """topk_length must be int32 [batch] = [2], got torch.int32 [3]""")
        self.assertExpectedInline(e(attn_sink=torch.zeros(16).double()), """attn_sink must be float32 [h_q] = [16], got torch.float64 [16]""")
        self.assertExpectedInline(e(indices=[[1]]), """indices must be a torch.Tensor, got list""")
        self.assertExpectedInline(e(schedule=[1, 2]), """schedule must be a torch_mla.DecodeSchedule (from get_decode_schedule) or a (metadata, num_splits) tuple of tensors, got list""")

    def test_values(self):
        q, cache, idx = self.args[:3]
        full = torch.tensor([64, 64], dtype=torch.int32)

        def at(r, k, v):
            bad = idx.clone()
            bad[r, 0, k] = v
            return bad

        e = self.err
        self.assertExpectedInline(e(indices=at(1, 3, 4 * 64), topk_length=full), """indices[1, 0, 3] = 256 (below topk_length[1] = 64) is not a cache slot: slots are page * page_size + row, in [0, num_blocks x page_size = 256), or -1 for no token""")
        self.assertExpectedInline(e(indices=at(0, 0, -2), topk_length=None), """indices[0, 0, 0] = -2 is not a cache slot: slots are page * page_size + row, in [0, num_blocks x page_size = 256), or -1 for no token""")
        self.assertExpectedInline(e(topk_length=torch.tensor([3, 65], dtype=torch.int32)), """topk_length[1] = 65, but it must be in [0, topk = 64] (topk: the last dim of indices)""")
        self.assertExpectedInline(e(topk_length=torch.tensor([-1, 5], dtype=torch.int32)), """topk_length[0] = -1, but it must be in [0, topk = 64] (topk: the last dim of indices)""")
        # Past topk_length an entry is never read: anything goes.
        out, _ = torch_mla.mla_decode_sparse(q, cache, at(1, 63, 2**31 - 1),
                                             topk_length=torch.tensor([64, 63], dtype=torch.int32))
        assert torch.isfinite(out).all()

    def test_append_errors(self):
        cache = torch.zeros(2, 64, 1, 656, dtype=torch.uint8)

        def err(**kw):
            args = dict(kv_cache=cache, kv_c=torch.zeros(3, 512), k_pe=torch.zeros(3, 64),
                        slot_mapping=torch.tensor([0, 1, 2]))
            args.update(kw)
            with self.assertRaises((ValueError, TypeError)) as cm:
                torch_mla.append_kv(**args)
            return str(cm.exception)

        self.assertExpectedInline(err(kv_c=torch.zeros(3, 448)), """the 656-byte FP8 cache takes kv_c [tokens, 512] and k_pe [tokens, 64], as many tokens as slot_mapping [tokens]; got kv_c [3, 448], k_pe [3, 64], slot_mapping [3]""")
        self.assertExpectedInline(err(kv_scale=torch.ones(1)), """the 656-byte FP8 cache carries its own scales (one per 128 values in every row): pass kv_scale=None""")
        self.assertExpectedInline(err(kv_cache=cache[..., :600]), """a uint8 kv_cache is DeepSeek-V3.2's FP8 layout: shape [num_blocks, 64, 1, 656], got [2, 64, 1, 600]""")
        self.assertExpectedInline(err(slot_mapping=torch.tensor([0, 128, 1])), """slot_mapping[1] = 128, but the cache has only 128 slots (2 pages x 64)""")
        self.assertExpectedInline(err(slot_mapping=torch.tensor([5, 1, 5])), """slot_mapping[0] and slot_mapping[2] both write slot 5; slots must be distinct (negative slots are skipped and may repeat)""")


# ---- on a GPU (the lead runs these) -------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla"])
def test_gpu_reference_equals_cpu_reference(fmt):
    args = op_args(fmt=fmt, b=3, s_q=2, h_q=64, topk=256)
    q, cache, idx, lens, sink, *_, kv_scale = args
    want = torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens, attn_sink=sink,
                                       kv_scale=kv_scale)
    cuda = [None if t is None else t.cuda() for t in (q, cache, idx, lens, sink, kv_scale)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the FP8 caches' reference warning; its own test)
        got = torch_mla.mla_decode_sparse(cuda[0], cuda[1], cuda[2], topk_length=cuda[3],
                                          attn_sink=cuda[4], kv_scale=cuda[5])
    # bf16: the kernel (bf16 P, fp32 sums); the FP8 caches: the same fp32 math, the GPU's
    # matmuls summing in another order.
    torch.testing.assert_close(got[0].cpu(), want[0], atol=2e-3, rtol=1e-2)
    torch.testing.assert_close(got[1].cpu(), want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.cuda
def test_gpu_warns_once_for_a_cache_the_kernel_does_not_read(monkeypatch):
    monkeypatch.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)  # (which silences it)
    # (topk_length given: op_args poisons the entries past it, which the checks would reject)
    q, cache, idx, lens = [t.cuda() for t in op_args(b=1, s_q=1, h_q=8, topk=64)[:4]]
    q = q.half()  # the 656-byte rows' RoPE values are bf16: the kernel takes bf16 q over them
    sparse_ops._warned.clear()
    with pytest.warns(UserWarning, match="the sparse kernel over the 656-byte cache takes bf16"):
        torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_mla.mla_decode_sparse(q, cache, idx, topk_length=lens)
    torch.cuda.synchronize()  # (an index check failing on the device would surface here)


@pytest.mark.cuda
def test_gpu_append_656_equals_cpu():
    kv_c, k_pe = torch.randn(70, 512).bfloat16(), torch.randn(70, 64).bfloat16()
    slots = torch.randperm(128)[:70]
    slots[::9] = -1
    cpu = torch.zeros(2, 64, 1, 656, dtype=torch.uint8)
    torch_mla.append_kv(cpu, kv_c, k_pe, slots)
    gpu = torch.zeros(2, 64, 1, 656, dtype=torch.uint8, device="cuda")
    torch_mla.append_kv(gpu, kv_c.cuda(), k_pe.cuda(), slots.cuda())
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.cuda
def test_gpu_cuda_graph_replays_new_indices():
    # The reference path is capturable (no host sync): replays see new q, indices and lengths.
    cache, _ = make_cache(4, "fp8_ds_mla", torch.ones(4 * PAGE, dtype=torch.bool))
    cache, sink = cache.cuda(), torch.randn(16, device="cuda")
    static = [torch.randn(4, 2, 16, 576, device="cuda").bfloat16(),
              torch.zeros(4, 2, 128, dtype=torch.int32, device="cuda"),
              torch.full((4,), 128, dtype=torch.int32, device="cuda")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the FP8 cache's reference warning)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            sparse_step(static[0], cache, static[1], static[2], sink)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = sparse_step(static[0], cache, static[1], static[2], sink)
    for _ in range(3):
        new = [torch.randn(4, 2, 16, 576).bfloat16(),
               poisoned_indices(4, 2, 128, 4 * PAGE),
               torch.randint(0, 129, (4,), dtype=torch.int32)]
        for dst, src in zip(static, new):
            dst.copy_(src)
        g.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = sparse_decode_fp64(new[0], cache.cpu(), new[1], new[2], sink.cpu())
        torch.testing.assert_close(out.double().cpu(), ref_out, atol=2e-3, rtol=2e-2)
        torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_ds_mla"])
def test_run_sparse_step_passes_the_cache_as_the_kernel_reads_it(monkeypatch, fmt):
    # The host side of the kernel path, on CPU tensors with the device lookups and the compiled
    # step stubbed: the step of the cache's format gets the cache as its kernel reads it (16-bit
    # rows, or bytes) and kv_scale as its 13th argument, None without an e4m3 cache (a step
    # loaded from the disk cache takes it explicitly: test_kernel_compile.py).
    from torch_mla.ops import dispatch

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(dispatch, "device_arch", lambda index: "sm_86")
    monkeypatch.setattr(sparse_ops, "_sparse_step",
                        lambda *key: lambda *args: calls.append((key, args)))
    named = torch.ones(2 * PAGE, dtype=torch.bool)
    cache, kv_scale = make_cache(2, fmt, named)
    q = torch.randn(1, 2, 16, 576).bfloat16()
    idx = poisoned_indices(1, 2, 64, 2 * PAGE)
    sched = torch_mla.get_sparse_decode_schedule(idx, 16)
    sparse_ops.run_sparse_step("sm80", q, cache, idx, None, None, sched.metadata,
                               sched.num_splits, 0.1, 512, kv_scale)
    if fmt != "fp8_ds_mla":  # the keys-on-M step's build takes its columns (16 heads: 16)
        sparse_ops.run_sparse_step("sm90_keysm", q, cache, idx, None, None, sched.metadata,
                                   sched.num_splits, 0.1, 512, kv_scale)
        assert calls.pop()[0] == ("sm90_keysm", torch.bfloat16,
                                  {"bf16": "plain", "fp8": "e4m3"}[fmt], "sm_86", 16, False)
    ((key, args),) = calls
    assert key == ("sm80", torch.bfloat16, {"bf16": "plain", "fp8": "e4m3"}.get(fmt, fmt), "sm_86",
                   0, False)
    assert len(args) == 13 and args[-1] is kv_scale
    width = 656 if fmt == "fp8_ds_mla" else 576
    assert args[1].shape == (2, PAGE, width)
    assert args[1].dtype == (torch.bfloat16 if fmt == "bf16" else torch.uint8)
    assert args[1].data_ptr() == cache.data_ptr()  # (no copy)


def test_run_sparse_step_picks_the_split_build(monkeypatch):
    # The split's build as run_sparse_step asks for it (the compiled step stubbed, CPU
    # tensors): the cluster pair at 65-128 heads and the short build where a part holds at most
    # SPLIT_SHORT_BLOCKS_PAIR (4) blocks of 64 entries with the pair, SPLIT_SHORT_BLOCKS (1)
    # without, over the 656-byte rows only; topk 2048 on 132 SMs (66 parts at 128 heads, 132 at
    # 64). The shipped limits are these unless the developer knob is set.
    import os

    from torch_mla.ops import dispatch

    if not os.environ.get("TORCH_MLA_DEV_SPLIT_SHORT_BLOCKS"):
        assert (sparse_ops.SPLIT_SHORT_BLOCKS, sparse_ops.SPLIT_SHORT_BLOCKS_PAIR) == (1, 4)
    monkeypatch.setattr(sparse_ops, "SPLIT_SHORT_BLOCKS", 1)
    monkeypatch.setattr(sparse_ops, "SPLIT_SHORT_BLOCKS_PAIR", 4)
    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(dispatch, "device_arch", lambda index: "sm_90a")
    monkeypatch.setattr(sparse_ops, "_sparse_step",
                        lambda *key: lambda *args: calls.append(key))
    got = {}
    for fmt in ("bf16", "fp8_ds_mla"):
        cache, _ = make_cache(1, fmt, torch.ones(PAGE, dtype=torch.bool))
        for h_q, batches in ((128, (2, 8, 9, 16)), (64, (2, 4, 5, 8))):
            for b in batches:
                q = torch.randn(b, 1, h_q, 576).bfloat16()
                idx = torch.zeros(b, 1, 2048, dtype=torch.int32)
                sched = torch_mla.get_sparse_decode_schedule(idx, h_q, num_sms=132)
                sparse_ops.run_sparse_step("sm90_split", q, cache, idx, None, None,
                                           sched.metadata, sched.num_splits, 0.1, 512)
                key = calls.pop()
                got[fmt, h_q, b] = (key[4], key[5])
                assert key[:4] == ("sm90_split", torch.bfloat16,
                                   "plain" if fmt == "bf16" else fmt, "sm_90a")
    assert got == {
        **{("bf16", h, b): (0, False) for h, bs in ((128, (2, 8, 9, 16)), (64, (2, 4, 5, 8)))
           for b in bs},
        ("fp8_ds_mla", 128, 2): (128, True), ("fp8_ds_mla", 128, 8): (128, True),
        ("fp8_ds_mla", 128, 9): (128, False), ("fp8_ds_mla", 128, 16): (128, False),
        ("fp8_ds_mla", 64, 2): (0, True), ("fp8_ds_mla", 64, 4): (0, True),
        ("fp8_ds_mla", 64, 5): (0, False), ("fp8_ds_mla", 64, 8): (0, False)}, got


def test_run_sparse_step_loads_no_kernel_for_an_empty_batch(monkeypatch):
    # b s_q = 0 launches nothing, so it loads (or compiles) no step either; the outputs keep
    # their shapes (the stubbed step's loader fails the test if called).
    from torch_mla.ops import dispatch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)
    monkeypatch.setattr(dispatch, "device_arch", lambda index: "sm_90a")

    def no_step(*key):
        raise AssertionError(f"a step was loaded for an empty batch: {key}")

    monkeypatch.setattr(sparse_ops, "_sparse_step", no_step)
    cache, _ = make_cache(1, "fp8_ds_mla", torch.ones(PAGE, dtype=torch.bool))
    for b, s_q in ((0, 1), (2, 0)):
        q = torch.randn(b, s_q, 128, 576).bfloat16()
        idx = torch.zeros(b, s_q, 2048, dtype=torch.int32)
        sched = torch_mla.get_sparse_decode_schedule(idx, 128, num_sms=132)
        out, lse = sparse_ops.run_sparse_step("sm90_split", q, cache, idx, None, None,
                                              sched.metadata, sched.num_splits, 0.1, 512)
        assert out.shape == (b, s_q, 128, 512) and lse.shape == (b, 128, s_q)


def test_sparse_rows_tool_modes(monkeypatch):
    """tools/sparse_rows.py: each mode's flags make the dispatch (on sm_90a) pick the kernel it
    names, at h_q 16 over each FP8 format ("rs", "rs32": its ping-pong variant; over bf16 the
    keys-on-M kernel would run, which the tool reports as not taken; "producer" and "split"
    over e4m3: the SM90 kernel, likewise); rows parse with their
    defaults; a
    bad mode or format stops."""
    from tools import sparse_rows
    from torch_mla.ops import dispatch

    monkeypatch.setattr(dispatch, "_small_kernel_arch", lambda device: "sm_90a")
    monkeypatch.delenv("TORCH_MLA_FORCE_REFERENCE", raising=False)
    q = torch.empty(2, 1, 16, 576, dtype=torch.bfloat16)
    caches = {"bf16": torch.empty(2, 64, 1, 576, dtype=torch.bfloat16),
              "e4m3": torch.empty(2, 64, 1, 576, dtype=torch.float8_e4m3fn),
              "656": torch.empty(2, 64, 1, 656, dtype=torch.uint8)}
    for mode, env in sparse_rows.MODES.items():
        if mode == "flashmla":  # (FlashMLA's call, not the dispatch's)
            continue
        for fmt, cache in caches.items():
            for name in ("TORCH_MLA_SPARSE_KEYSM", "TORCH_MLA_SPARSE_KEYSM_RS",
                         "TORCH_MLA_SPARSE_SM90", "TORCH_MLA_SPARSE_PRODUCER"):
                monkeypatch.delenv(name, raising=False)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            want = sparse_rows.KERNELS[mode]
            if mode in ("rs", "rs32") and fmt == "bf16":
                want = "sm90_keysm"
            if mode in ("producer", "split") and fmt == "e4m3":  # (the producer variants do
                want = "sm90"  # not take it)
            assert sparse_ops.sparse_backend(q, cache, 512) == (want, ""), (mode, fmt)
    assert sparse_rows.parse_row("128,1,16") == (128, 1, 16, 2048, 32768)
    assert sparse_rows.parse_row("2,2,64,512,4096") == (2, 2, 64, 512, 4096)
    for argv in (["slow", "656", "1,1,16"], ["rs", "fp4", "1,1,16"], ["rs", "656", "1,1"],
                 ["flashmla", "bf16", "1,1,64"]):
        with pytest.raises(SystemExit):
            sparse_rows.main(argv)


def test_split_pair_rows(monkeypatch):
    """The split kernel's cluster pair (ops.sparse.split_pair_rows): 128 rows (a token's two
    m-blocks as one cluster) at h_q 65-128 over the 656-byte rows, unless
    TORCH_MLA_SPARSE_SPLIT_PAIR=0; its build exists only over those rows."""
    from torch_mla.ops import registry

    for flag in (None, "0"):
        if flag is None:
            monkeypatch.delenv("TORCH_MLA_SPARSE_SPLIT_PAIR", raising=False)
        else:
            monkeypatch.setenv("TORCH_MLA_SPARSE_SPLIT_PAIR", flag)
        for cache in ("plain", "e4m3", "fp8_ds_mla"):
            for h_q in (1, 16, 64, 65, 100, 128, 129, 256):
                pair = flag is None and cache == "fp8_ds_mla" and 64 < h_q <= 128
                assert sparse_ops.split_pair_rows(h_q, cache) == (128 if pair else 0), (
                    flag, cache, h_q)
                # (from SPLIT_PAIR_MIN_TOKENS one-token requests)
                least = sparse_ops.SPLIT_PAIR_MIN_TOKENS
                assert sparse_ops.split_pair_rows(h_q, cache, least) == (128 if pair else 0)
                if least > 1:
                    assert sparse_ops.split_pair_rows(h_q, cache, least - 1) == 0
    monkeypatch.delenv("TORCH_MLA_SPARSE_SPLIT_PAIR", raising=False)
    monkeypatch.setattr(sparse_ops, "SPLIT_PAIR_MIN_TOKENS", 16)
    assert [sparse_ops.split_pair_rows(128, "fp8_ds_mla", n) for n in (1, 8, 15, 16, 256)] == [
        0, 0, 0, 128, 128]
    assert sparse_ops.split_pair_rows(128, "fp8_ds_mla") == 128  # (no count given)
    assert registry.SparseStepConfig("sm90_split", "bf16", "fp8_ds_mla", 128).key() == {
        "dtype": "bf16", "kv": "fp8_ds_mla", "columns": 128}
    for bad in [("sm90_split", "bf16", "plain", 128), ("sm90_split", "bf16", "fp8_ds_mla", 64),
                ("sm90_producer", "bf16", "fp8_ds_mla", 128),
                ("sm90", "bf16", "fp8_ds_mla", 0, True)]:
        with pytest.raises(ValueError, match="no sparse decode kernel"):
            registry.SparseStepConfig(*bad)


def test_split_short_parts(monkeypatch):
    """The split's short build (ops.sparse.split_short_parts) where the tokens' blocks of 64
    entries come to at most SPLIT_SHORT_BLOCKS a part (SPLIT_SHORT_BLOCKS_PAIR with the cluster
    pair); its own cache entry (key "short"), in the precompile list beside each default split
    build."""
    from torch_mla.ops import registry

    monkeypatch.setattr(sparse_ops, "SPLIT_SHORT_BLOCKS", 1)
    monkeypatch.setattr(sparse_ops, "SPLIT_SHORT_BLOCKS_PAIR", 4)
    # h_q 128 with the pair on 132 SMs: 66 parts; topk 2048 is 32 blocks a token
    assert [sparse_ops.split_short_parts(n, 2048, 66, True) for n in (1, 2, 4, 8, 9, 16)] == [
        True, True, True, True, False, False]
    # h_q 64: 132 parts, 1 block a part at most
    assert [sparse_ops.split_short_parts(n, 2048, 132) for n in (2, 4, 5, 8)] == [
        True, True, False, False]
    assert sparse_ops.split_short_parts(16, 500, 132)  # (8 blocks a token: 500 rounds up)
    assert not sparse_ops.split_short_parts(17, 500, 132)
    assert not sparse_ops.split_short_parts(2, 2048, 0, True)  # (no part)
    monkeypatch.setattr(sparse_ops, "SPLIT_SHORT_BLOCKS", 0)
    monkeypatch.setattr(sparse_ops, "SPLIT_SHORT_BLOCKS_PAIR", 0)
    assert not sparse_ops.split_short_parts(1, 64, 132)
    assert not sparse_ops.split_short_parts(1, 64, 132, True)
    short = registry.SparseStepConfig("sm90_split", "bf16", "fp8_ds_mla", 128, True)
    assert short.key() == {"dtype": "bf16", "kv": "fp8_ds_mla", "columns": 128, "short": True}
    with pytest.raises(ValueError, match="no sparse decode kernel"):
        registry.SparseStepConfig("sm90_split", "bf16", "plain", 0, True)
    listed = [v.config for v in registry.variants(("bf16", "fp16"), kernels=("sparse",))]
    split = [c for c in listed if isinstance(c, registry.SparseStepConfig)
             and c.backend == "sm90_split"]
    assert len(split) == 4 + 2 and {c for c in split if c.short} == {
        dataclasses.replace(c, short=True) for c in split
        if not c.short and c.cache == "fp8_ds_mla"}, split
