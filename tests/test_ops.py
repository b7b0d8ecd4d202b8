"""Op registration (schemas, fake impls, opcheck), the Python API, append, and bad-input errors."""

import math
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import expecttest
import pytest
import torch

import torch_mla
from torch_mla.testing import POISON_BLOCK_ID, make_decode_inputs

from oracle import kv_head_inputs, mla_decode_fp64


def schema(name):
    return str(getattr(torch.ops.torch_mla, name).default._schema)


class TestSchemas(expecttest.TestCase):
    def test_schemas(self):
        self.assertExpectedInline(schema("get_decode_schedule"), """torch_mla::get_decode_schedule(Tensor cache_seqlens, int num_parts) -> (Tensor, Tensor)""")
        self.assertExpectedInline(schema("mla_decode"), """torch_mla::mla_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, Tensor sched_metadata, Tensor num_splits, float softmax_scale, bool causal, int d_v, Tensor? kv_scale=None, Tensor? q_scale=None, str compute="exact") -> (Tensor, Tensor)""")
        self.assertExpectedInline(schema("append_kv"), """torch_mla::append_kv(Tensor(a!) kv_cache, Tensor kv_c, Tensor k_pe, Tensor slot_mapping, Tensor? kv_scale=None) -> ()""")
        self.assertExpectedInline(schema("_head_matmul"), """torch_mla::_head_matmul(Tensor x, Tensor w, Tensor? tail=None) -> Tensor""")
        self.assertExpectedInline(schema("_forward_only_grad"), """torch_mla::_forward_only_grad(Tensor grad, SymInt[] shape, ScalarType dtype, str op) -> Tensor""")


def decode_args(s_q=2, h_q=16, causal=True, lens=(3, 70, 0)):
    inp = make_decode_inputs(list(lens), s_q, h_q)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    return (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched.metadata,
            sched.num_splits, 576**-0.5, causal, 512)


def test_opcheck_decode():
    torch.library.opcheck(torch.ops.torch_mla.mla_decode.default, decode_args())


def test_opcheck_schedule():
    lens = torch.tensor([0, 5, 300, 64], dtype=torch.int32)
    torch.library.opcheck(torch.ops.torch_mla.get_decode_schedule.default, (lens, 7))


def test_opcheck_append():
    cache = torch.randn(4, 64, 1, 576, dtype=torch.bfloat16)
    args = (cache, torch.randn(5, 512), torch.randn(5, 64), torch.tensor([3, 70, 200, 64, 1]))
    torch.library.opcheck(torch.ops.torch_mla.append_kv.default, args)


def absorb_inputs(b, s, h, dtype, device="cpu"):
    """The modules' two per-head matmuls: (q_nope, w_uk, q_pe) as they slice them out of
    q_b_proj's output and a [h, 128 + 128, 512] kv_b_proj weight, token-major; and (out_lat,
    w_uv) for the output (mla_decode's [b, s, h, 512] against W_UV transposed)."""
    q = torch.randn(b, s, h * 192, dtype=dtype, device=device)
    q_nope, q_pe = q.view(b, s, h, 192).split([128, 64], dim=-1)
    w = torch.randn(h, 256, 512, dtype=dtype, device=device) / 16
    out_lat = torch.randn(b, s, h, 512, dtype=dtype, device=device)
    return (q_nope, w[:, :128], q_pe), (out_lat, w[:, 128:].transpose(1, 2))


def test_opcheck_head_matmul():
    query, output = absorb_inputs(2, 3, 4, torch.float32)
    torch.library.opcheck(torch.ops.torch_mla._head_matmul.default, query)
    torch.library.opcheck(torch.ops.torch_mla._head_matmul.default, output)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, s", [(1, 1), (3, 1), (2, 3), (0, 1)])
def test_head_matmul_is_the_einsum(b, s, dtype):
    """Per head x @ w, token-major, with the tail's columns behind it (cast to x's dtype, as
    .to() casts): for the strided inputs of the modules, for an x that reshape must copy
    ([b, h, s, k] storage seen as [b, s, h, k]) and for a float32 tail."""
    from torch_mla.ops.absorb import head_matmul

    query, output = absorb_inputs(b, s, 4, dtype)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    for x, w, *tail in (query, output, (*query[:2], query[2].float() * 3)):
        n = w.shape[2]
        ref = torch.einsum("bshk,hkn->bshn", x.double(), w.double())
        head_major = x.transpose(1, 2).contiguous().transpose(1, 2)
        for xx in (x, head_major):
            out = head_matmul(xx, w, *tail)
            width = n + (tail[0].shape[3] if tail else 0)
            assert out.shape == (b, s, 4, width) and out.dtype == dtype and out.is_contiguous()
            if tail:
                assert torch.equal(out[..., n:], tail[0].to(dtype))
            torch.testing.assert_close(out[..., :n].double(), ref, **tol)


@pytest.mark.cuda
@pytest.mark.parametrize("b, s", [(1, 1), (128, 1), (32, 2)])
def test_head_matmul_on_the_gpu(b, s):
    """cuBLAS writes the products through the strided view (no copy of them: besides cuBLAS's
    kernels a call launches only the tail's copy) and they match the einsum's."""
    from torch_mla.ops.absorb import head_matmul

    blas = ("gemm", "nvjet", "cutlass", "splitkreduce", "cublas")
    for x, w, *tail in absorb_inputs(b, s, 128, torch.bfloat16, "cuda"):
        ref = torch.einsum("bshk,hkn->bshn", x.float(), w.float())
        head_matmul(x, w, *tail)  # (cuBLAS's handle and workspace)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = head_matmul(x, w, *tail)
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        others = [k for k in kernels if not any(n in k.lower() for n in blas)]
        assert len(others) == len(tail) and len(kernels) > len(tail), kernels
        if tail:
            assert torch.equal(out[..., 512:], tail[0])
        torch.testing.assert_close(out[..., :w.shape[2]].float(), ref, atol=2e-2, rtol=1e-2)


def test_head_matmul_refuses_mismatched_shapes():
    from torch_mla.ops.absorb import head_matmul

    (q_nope, w_uk, q_pe), _ = absorb_inputs(2, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="_head_matmul: x"):
        head_matmul(q_nope, w_uk[:2], q_pe)
    with pytest.raises(ValueError, match="_head_matmul: x"):
        head_matmul(q_nope, w_uk, q_pe[:1])


def test_opcheck_with_inputs_requiring_grad():
    # Not test_aot_dispatch_dynamic: it runs the backward, which raises (forward-only ops).
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    args = list(decode_args())
    args[0] = args[0].clone().requires_grad_()
    torch.library.opcheck(torch.ops.torch_mla.mla_decode.default, tuple(args), test_utils=utils)
    cache = torch.randn(4, 64, 1, 576, dtype=torch.bfloat16)
    args = (cache, torch.randn(5, 512, requires_grad=True), torch.randn(5, 64),
            torch.tensor([3, 70, 200, 64, 1]))
    torch.library.opcheck(torch.ops.torch_mla.append_kv.default, args, test_utils=utils)
    (q_nope, w_uk, q_pe), _ = absorb_inputs(2, 1, 4, torch.float32)
    torch.library.opcheck(torch.ops.torch_mla._head_matmul.default,
                          (q_nope.detach().requires_grad_(), w_uk, q_pe), test_utils=utils)


def test_mla_decode_api_matches_fp64():
    inp = make_decode_inputs([1, 63, 64, 65, 300], 3, 16)
    out, lse = torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                    causal=True, softmax_scale=0.05)
    ref_out, ref_lse = mla_decode_fp64(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                       0.05, True, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_mla_decode_accepts_a_plain_tuple_schedule():
    inp = make_decode_inputs([5, 130, 64], 2, 16)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, 2, 16, num_sms=7)
    args = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens)
    out, lse = torch_mla.mla_decode(*args, tuple(sched), causal=True)
    ref_out, ref_lse = mla_decode_fp64(*args, 576**-0.5, True, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_unused_block_table_entries_may_hold_anything():
    inp = make_decode_inputs([3, 70, 0], 1, 16, extra_blocks=3)
    table = inp.block_table.clone()
    used = torch.tensor([[True] + [False] * 4, [True] * 2 + [False] * 3, [False] * 5])
    table[~used] = torch.randint(-(2**31), 2**31 - 1, (int((~used).sum()),), dtype=torch.int32)
    args = (inp.q, inp.kv_cache, table, inp.cache_seqlens)
    out, lse = torch_mla.mla_decode(*args, softmax_scale=0.1)
    ref_out, ref_lse = mla_decode_fp64(*args, 0.1, False, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), ~fin)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h_kv,h_q", [(2, 6), (8, 16)])
def test_mla_decode_kv_heads(h_kv, h_q):
    inp = kv_head_inputs([1, 63, 200], 2, h_q, h_kv)
    args = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens)
    out, lse = torch_mla.mla_decode(*args, causal=True)
    ref_out, ref_lse = mla_decode_fp64(*args, 576**-0.5, True, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("s_q,h_q,h_kv", [(1, 128, 1), (2, 128, 2), (1, 16, 8), (4, 64, 4)])
def test_schedule_is_sized_per_kv_head(s_q, h_q, h_kv):
    # One launch per KV head, each a full wave: m-blocks of the s_q * h_q // h_kv rows of one KV
    # head x parts <= SMs; FlashMLA's get_mla_metadata(lens, s_q * h_q // h_kv, h_kv) agrees.
    from torch_mla.compat.flash_mla import get_mla_metadata

    lens = torch.randint(1, 3000, (9,), dtype=torch.int32)
    meta, splits = torch_mla.get_decode_schedule(lens, s_q, h_q, h_kv=h_kv)
    rows = s_q * h_q // h_kv
    assert meta.shape[0] == 132 // math.ceil(rows / 64)
    meta2, splits2 = get_mla_metadata(lens, rows, h_kv)
    assert torch.equal(meta, meta2) and torch.equal(splits, splits2)


def test_compat_is_reachable_from_the_package():
    code = ("import torch_mla; print(torch_mla.compat.flash_mla.flash_mla_with_kvcache.__name__, "
            "'compat' in torch_mla.__all__)")
    root = pathlib.Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert res.stdout.split() == ["flash_mla_with_kvcache", "True"], res.stderr


def test_append_kv_writes_slots_and_skips_negative():
    cache = torch.full((3, 64, 1, 576), float("nan"), dtype=torch.bfloat16)
    kv_c, k_pe = torch.randn(4, 512), torch.randn(4, 64)
    slots = torch.tensor([130, -1, 5, 64])
    torch_mla.append_kv(cache, kv_c, k_pe, slots)
    flat = cache.view(-1, 576)
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        torch.testing.assert_close(flat[s, :512], kv_c[i].bfloat16(), atol=0, rtol=0)
        torch.testing.assert_close(flat[s, 512:], k_pe[i].bfloat16(), atol=0, rtol=0)
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[[130, 5, 64]] = True
    assert flat[~written].isnan().all()  # nothing else touched


def test_append_kv_padding_slots_may_repeat():
    cache = torch.randn(2, 64, 1, 576)
    before = cache.clone()
    kv_c, k_pe = torch.randn(5, 512), torch.randn(5, 64)
    torch_mla.append_kv(cache, kv_c, k_pe, torch.tensor([-1, 7, -1, -5, 70], dtype=torch.int32))
    expect = before.view(-1, 576).clone()
    expect[[7, 70]] = torch.cat([kv_c, k_pe], dim=1)[[1, 4]]
    assert torch.equal(cache.view(-1, 576), expect)


def test_append_kv_all_padding_changes_nothing():
    cache = torch.randn(2, 64, 1, 576)
    before = cache.clone()
    torch_mla.append_kv(cache, torch.randn(2, 512), torch.randn(2, 64), torch.tensor([-1, -1]))
    assert torch.equal(cache, before)


def test_schedule_covers_every_block_once():
    from torch_mla.scheduling import compute_schedule, walk_schedule

    cases = [(torch.tensor([1], dtype=torch.int32), 66)]  # parts inside the overhead units
    # Equal requests: whole requests per part (whole_request_cuts), with empty ones between.
    for b, parts in ((128, 66), (64, 66), (70, 132), (5, 2)):
        lens = torch.full((b,), 4097, dtype=torch.int32)
        cases += [(lens, parts), (lens * (torch.arange(b) % 3 != 1), parts)]
    for _ in range(50):
        b = int(torch.randint(1, 40, ()))
        lens = torch.randint(0, 5000, (b,), dtype=torch.int32)
        lens[torch.rand(b) < 0.2] = 0
        cases.append((lens, int(torch.randint(1, 140, ()))))
    for lens, parts in cases:
        b = lens.shape[0]
        meta, splits = compute_schedule(lens, parts)
        seen, slots = {}, set()
        for p, r, lo, hi, slot in walk_schedule(meta, splits, lens):
            for k in range(lo, hi):
                assert (r, k) not in seen
                seen[(r, k)] = p
            if slot >= 0:
                assert slot not in slots and splits[r] <= slot < splits[r + 1]
                slots.add(slot)
        for r in range(b):
            nb = math.ceil(int(lens[r]) / 64)
            assert all((r, k) in seen for k in range(nb))
            assert len({seen[(r, k)] for k in range(nb)}) == int(splits[r + 1] - splits[r])
        assert int(splits[-1]) <= b + parts  # fits the static partial-result workspace
        # The SM90 kernel loads a part's first Q before walking it, exactly when this says
        # that the part has a first segment with blocks (short requests and many parts leave
        # parts with none: a CTA must not exit with that load in flight).
        first = {p: hi > lo for p, r, lo, hi, _ in walk_schedule(meta, splits, lens)
                 if r == int(meta[p, 0])}
        for p, (br, bb, er, eb, *_rest) in enumerate(meta.tolist()):
            assert (br < er or (br == er and bb < eb)) == first.get(p, False), (p, br, bb, er, eb)


def test_schedule_balances_parts():
    from torch_mla.scheduling import OVERHEAD_BLOCKS, compute_schedule, walk_schedule

    g = torch.Generator().manual_seed(0)
    lens = (2048 + 600 * torch.randn(64, generator=g)).clamp(min=1).to(torch.int32)
    nb = (lens + 63) // 64
    total = int(nb.sum()) + OVERHEAD_BLOCKS * 64
    meta, splits = compute_schedule(lens, 132)
    load = [0] * 132
    for p, _r, lo, hi, _slot in walk_schedule(meta, splits, lens):
        load[p] += hi - lo
    # None gets more than its share of the stream, C = ceil(T / P) units, and as few parts as
    # that allows get work, each of them blocks: the first ceil(T / C).
    per_part = -(-total // 132)
    busy = -(-total // per_part)
    assert busy < 132 and max(load) <= per_part, (busy, max(load))
    assert min(load[:busy]) > 0 and max(load[busy:]) == 0, load


def test_schedule_cuts_requests_into_no_more_pieces_than_its_heaviest_part_needs():
    from torch_mla.scheduling import compute_schedule, walk_schedule

    # Sparse decode at b 2, topk 2048 (32 blocks a token), h_q 128 on 132 SMs: 66 parts for
    # 74 units. The heaviest part takes 2 blocks either way; 37 parts of 2 units cut the
    # tokens into 17 and 16 pieces where all 66 parts cut them into 28 (session 44 measured
    # 1.3 us a step on a branch; the rule as merged, session 45: 26.2 -> 24.7 us on an H100).
    lens = torch.full((2,), 2048, dtype=torch.int32)
    meta, splits = compute_schedule(lens, 66)
    load = [0] * 66
    for p, _r, lo, hi, _slot in walk_schedule(meta, splits, lens):
        load[p] += hi - lo
    assert max(load) == 2 and load[37:] == [0] * 29, load
    assert splits.tolist() == [0, 17, 33]


def test_schedule_takes_whole_requests_when_that_costs_little():
    from torch_mla.scheduling import WHOLE_MAX_BATCH, compute_schedule, walk_schedule

    def loads(lens, parts):
        meta, splits = compute_schedule(lens, parts)
        load = [0] * parts
        for p, _r, lo, hi, _slot in walk_schedule(meta, splits, lens):
            load[p] += hi - lo
        return splits, max(load)

    # 128 requests of 65 pages (70 units) on 66 parts: whole requests put 2 on a part (140
    # units) against the uniform cut's 136, so nothing is split.
    splits, top = loads(torch.full((128,), 4097, dtype=torch.int32), 66)
    assert torch.equal(splits, torch.arange(129, dtype=torch.int32)) and top == 2 * 65
    # 96 of them: whole requests would give 140 units against 102: the uniform cut, splits.
    splits, top = loads(torch.full((96,), 4097, dtype=torch.int32), 66)
    assert int(splits[-1]) > 96 and top <= -(-96 * 70 // 66)
    # Past the kernel's one chunk of requests: always the uniform cut.
    b = WHOLE_MAX_BATCH + 1
    splits, _ = loads(torch.full((b,), 64 * 130, dtype=torch.int32), b // 2)
    assert int(splits[-1]) > b


def test_compat_flash_mla_both_forms():
    from torch_mla.compat.flash_mla import flash_mla_with_kvcache, get_mla_metadata

    inp = make_decode_inputs([10, 200], 2, 16)
    meta, splits = get_mla_metadata(inp.cache_seqlens, 2 * 16, 1)
    assert meta.dtype == torch.int32 and meta.shape[1] == 8 and splits.shape == (3,)
    out1, lse1 = flash_mla_with_kvcache(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                        512, meta, splits, causal=True)
    sched_meta, none = get_mla_metadata()
    assert none is None
    out2, lse2 = flash_mla_with_kvcache(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                        512, sched_meta, None, causal=True)
    assert sched_meta.have_initialized
    ref_out, ref_lse = mla_decode_fp64(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                       576**-0.5, True, 512)
    for out, lse in ((out1, lse1), (out2, lse2)):
        torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    # Several KV heads (num_heads_k), both forms.
    inp = kv_head_inputs([10, 200, 0], 2, 8, 4)
    meta4, splits4 = get_mla_metadata(inp.cache_seqlens, 2 * 8 // 4, 4)
    args = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens)
    outs = [flash_mla_with_kvcache(*args, 512, meta4, splits4, causal=True),
            flash_mla_with_kvcache(*args, 512, get_mla_metadata()[0], None, causal=True)]
    ref_out, ref_lse = mla_decode_fp64(*args, 576**-0.5, True, 512)
    fin = torch.isfinite(ref_lse)
    for out, lse in outs:
        torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
        torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="dense decode only"):
        flash_mla_with_kvcache(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, 512,
                               meta, splits, is_fp8_kvcache=True)


class TestErrors(expecttest.TestCase):
    """Each bad input raises before any kernel runs, saying what is wrong and what is expected."""

    def err(self, **change):
        inp = make_decode_inputs([3, 70], 1, 16)
        args = dict(q=inp.q, kv_cache=inp.kv_cache, block_table=inp.block_table,
                    cache_seqlens=inp.cache_seqlens)
        args.update(change)
        with self.assertRaises((ValueError, TypeError)) as cm:
            torch_mla.mla_decode(**args)
        return str(cm.exception)

    def inp(self):
        return make_decode_inputs([3, 70], 1, 16)

    def test_q_dtype(self):
        i = self.inp()
        self.assertExpectedInline(self.err(q=i.q.to(torch.int8)), """q must be bfloat16, float16 or float32, got torch.int8""")

    def test_cache_dtype_mismatch(self):
        i = self.inp()
        self.assertExpectedInline(self.err(kv_cache=i.kv_cache.half()), """kv_cache dtype (torch.float16) must match q's dtype (torch.bfloat16)""")

    def test_q_rank(self):
        i = self.inp()
        self.assertExpectedInline(self.err(q=i.q[:, 0]), """q must have shape [batch, s_q, h_q, d_qk], got [2, 16, 576]""")

    def test_page_size(self):
        i = self.inp()
        bad = i.kv_cache.view(-1, 32, 1, 576)
        self.assertExpectedInline(self.err(kv_cache=bad), """kv_cache page size (dim 1) must be 64, got 32""")

    def test_kv_heads(self):
        i = self.inp()
        three = torch.randn(i.kv_cache.shape[0], 64, 3, 576).bfloat16()
        self.assertExpectedInline(self.err(kv_cache=three), """h_q (16) must be a multiple of kv_cache's KV heads h_kv (3, dim 2): query head h uses KV head h // (h_q // h_kv)""")
        self.assertExpectedInline(self.err(kv_cache=three[:, :, :0]), """kv_cache must have at least one KV head (dim 2), got 0""")

    def test_q_2d(self):
        i = self.inp()
        self.assertExpectedInline(self.err(q=i.q[:, 0, 0]), """q must have shape [batch, s_q, h_q, d_qk], got [2, 576]""")

    def test_seqlens_list(self):
        self.assertExpectedInline(self.err(cache_seqlens=[3, 70]), """cache_seqlens must be a torch.Tensor, got list""")

    def test_schedule_type(self):
        i = self.inp()
        sched = torch_mla.get_decode_schedule(i.cache_seqlens, 1, 16)
        self.assertExpectedInline(self.err(schedule=list(sched)), """schedule must be a torch_mla.DecodeSchedule (from get_decode_schedule) or a (metadata, num_splits) tuple of tensors, got list""")
        self.assertExpectedInline(self.err(schedule=(sched.metadata,)), """schedule must be a torch_mla.DecodeSchedule (from get_decode_schedule) or a (metadata, num_splits) tuple of tensors, got tuple""")

    def test_block_table_ids(self):
        # Request 1 has 70 tokens: its first 2 entries are used, the others never read.
        i = self.inp()

        def table(row, col, page_id):
            t = i.block_table.clone()
            t[row, col] = page_id
            return t

        self.assertExpectedInline(self.err(block_table=table(1, 1, -1)), """block_table[1, 1] = -1 is not a page of kv_cache (num_blocks = 5): request 1 has 70 tokens, so its first 2 entries must be page ids in [0, 5)""")
        self.assertExpectedInline(self.err(block_table=table(1, 0, i.kv_cache.shape[0])), """block_table[1, 0] = 5 is not a page of kv_cache (num_blocks = 5): request 1 has 70 tokens, so its first 2 entries must be page ids in [0, 5)""")
        self.assertExpectedInline(self.err(block_table=table(1, 1, 2**30)), """block_table[1, 1] = 1073741824 is not a page of kv_cache (num_blocks = 5): request 1 has 70 tokens, so its first 2 entries must be page ids in [0, 5)""")
        self.assertExpectedInline(self.err(block_table=table(0, 0, -7)), """block_table[0, 0] = -7 is not a page of kv_cache (num_blocks = 5): request 0 has 3 tokens, so its first entry must be a page id in [0, 5)""")

    def test_head_dims_do_not_add_up(self):
        i = self.inp()
        self.assertExpectedInline(self.err(kv_cache=i.kv_cache[..., :512].contiguous()), """kv_cache head dim (512) must equal q's head dim d_qk (576)""")
        with self.assertRaises(ValueError) as cm:
            torch_mla.mla_decode(i.q, i.kv_cache, i.block_table, i.cache_seqlens, d_v=600)
        self.assertExpectedInline(str(cm.exception), """d_v must be in (0, d_qk=576] (V is the first d_v columns of the cache), got 600""")

    def test_block_table_dtype(self):
        i = self.inp()
        self.assertExpectedInline(self.err(block_table=i.block_table.long()), """block_table must be int32, got torch.int64""")

    def test_seqlens_dtype(self):
        i = self.inp()
        self.assertExpectedInline(self.err(cache_seqlens=i.cache_seqlens.long()), """cache_seqlens must be int32, got torch.int64""")

    def test_batch_mismatch(self):
        i = self.inp()
        self.assertExpectedInline(self.err(cache_seqlens=i.cache_seqlens[:1]), """cache_seqlens has 1 entries, expected batch = 2""")

    def test_seqlen_past_block_table(self):
        i = self.inp()
        too_long = torch.tensor([3, 64 * i.block_table.shape[1] + 1], dtype=torch.int32)
        self.assertExpectedInline(self.err(cache_seqlens=too_long), """cache_seqlens[1] = 257, but block_table covers only 4 pages x 64 = 256 tokens""")

    def test_value_checks_stay_on_for_cpu_tensors(self):
        # set_value_checks(False) turns off the device asserts only: CPU values cost nothing.
        i = self.inp()
        table = i.block_table.clone()
        table[1, 1] = -1
        torch_mla.set_value_checks(False)
        try:
            msg = self.err(block_table=table)
        finally:
            torch_mla.set_value_checks(True)
        assert msg.startswith("block_table[1, 1] = -1 is not a page of kv_cache"), msg

    def test_schedule_args(self):
        lens = self.inp().cache_seqlens

        def err(*args, **kwargs):
            with self.assertRaises((ValueError, TypeError)) as cm:
                torch_mla.get_decode_schedule(*args, **kwargs)
            return str(cm.exception)

        self.assertExpectedInline(err(lens, 0, 16), """s_q must be >= 1, got 0""")
        self.assertExpectedInline(err(lens, 1, 0), """h_q must be >= 1, got 0""")
        self.assertExpectedInline(err(lens, 1, -16), """h_q must be >= 1, got -16""")
        self.assertExpectedInline(err(lens, 1.0, 16), """s_q must be an int, got float""")
        self.assertExpectedInline(err(lens, 1, 16, 0), """num_sms must be >= 1, got 0""")
        self.assertExpectedInline(err(lens, 1, 16, h_kv=3), """h_q (16) must be a multiple of h_kv (3)""")
        self.assertExpectedInline(err(lens, 1, 16, h_kv=0), """h_kv must be >= 1, got 0""")
        self.assertExpectedInline(err(lens.tolist(), 1, 16), """cache_seqlens must be a torch.Tensor, got list""")
        bad = torch.tensor([3, -2], dtype=torch.int32)
        self.assertExpectedInline(err(bad, 1, 16), """cache_seqlens[1] = -2, but lengths must be >= 0""")
        torch_mla.set_value_checks(False)  # CPU values are always checked
        try:
            self.assertExpectedInline(err(bad, 1, 16), """cache_seqlens[1] = -2, but lengths must be >= 0""")
        finally:
            torch_mla.set_value_checks(True)
        with self.assertRaises(ValueError) as cm:
            torch.ops.torch_mla.get_decode_schedule(bad, 4)
        self.assertExpectedInline(str(cm.exception), """cache_seqlens[1] = -2, but lengths must be >= 0""")

    def test_negative_seqlen(self):
        self.assertExpectedInline(self.err(cache_seqlens=torch.tensor([3, -2], dtype=torch.int32)), """cache_seqlens[1] = -2, but lengths must be >= 0""")

    def test_non_contiguous_last_dim(self):
        i = self.inp()
        q = i.q.transpose(-1, -2).contiguous().transpose(-1, -2)
        self.assertExpectedInline(self.err(q=q), """q's last dimension must be contiguous (stride 1), got stride 16""")

    def test_device_mismatch(self):
        i = self.inp()
        self.assertExpectedInline(self.err(cache_seqlens=i.cache_seqlens.to("meta")), """q, kv_cache, block_table and cache_seqlens must be on one device, got q=cpu, kv_cache=cpu, block_table=cpu, cache_seqlens=meta""")

    def test_not_a_tensor(self):
        i = self.inp()
        self.assertExpectedInline(self.err(block_table=i.block_table.tolist()), """block_table must be a torch.Tensor, got list""")

    def test_append_errors(self):
        cache = torch.zeros(2, 64, 1, 576)
        with self.assertRaises(ValueError) as cm:
            torch_mla.append_kv(cache, torch.zeros(3, 512), torch.zeros(3, 32), torch.arange(3))
        self.assertExpectedInline(str(cm.exception), """kv_c width 512 + k_pe width 32 must equal the cache's head dim 576""")
        with self.assertRaises(ValueError) as cm:
            torch_mla.append_kv(cache, torch.zeros(1, 512), torch.zeros(1, 64), torch.tensor([128]))
        self.assertExpectedInline(str(cm.exception), """slot_mapping[0] = 128, but the cache has only 128 slots (2 pages x 64)""")
        with self.assertRaises(ValueError) as cm:
            torch_mla.append_kv(cache, torch.zeros(5, 512), torch.zeros(5, 64),
                                torch.tensor([7, -1, 70, -1, 70]))
        self.assertExpectedInline(str(cm.exception), """slot_mapping[2] and slot_mapping[4] both write slot 70; slots must be distinct (negative slots are skipped and may repeat)""")
        with self.assertRaises(ValueError) as cm:
            torch_mla.append_kv(cache.view(2, 64, 2, 288), torch.zeros(1, 512),
                                torch.zeros(1, 64), torch.tensor([1]))
        self.assertExpectedInline(str(cm.exception), """append_kv writes one latent head per token: kv_cache must have shape [num_blocks, 64, 1, d_qk], got [2, 64, 2, 288]""")
        with self.assertRaises(TypeError) as cm:
            torch_mla.append_kv(cache, torch.zeros(1, 512).tolist(), torch.zeros(1, 64),
                                torch.tensor([1]))
        self.assertExpectedInline(str(cm.exception), """kv_c must be a torch.Tensor, got list""")

    def test_device_messages_fit_a_device_assert(self):
        # CUDA's _assert_async keeps messages shorter than 255 characters (it raises otherwise).
        from torch_mla.ops.checks import DEVICE_MESSAGES

        assert max(len(m) for m in DEVICE_MESSAGES.values()) < 255
        self.assertExpectedInline("\n".join(DEVICE_MESSAGES.values()), """\
torch_mla.mla_decode: cache_seqlens holds a length < 0 or > block_table's width x 64; run with CPU tensors to see which entry
torch_mla.mla_decode: block_table holds a page id outside [0, num_blocks) in a column that the request's cache_seqlens uses; run with CPU tensors to see which entry
torch_mla.get_decode_schedule: cache_seqlens holds a length < 0; run with CPU tensors to see which entry
torch_mla.append_kv: slot_mapping holds a slot >= num_blocks x 64 (past the cache); run with CPU tensors to see which entry
torch_mla.append_kv: slot_mapping writes one slot twice (slots >= 0 must be distinct); run with CPU tensors to see which entry""")


def test_poisoned_inputs_are_poisoned():
    # The poison the tests rely on is really there: NaN past each length, huge unused ids.
    inp = make_decode_inputs([3, 64], 1, 1, extra_blocks=1)
    flat = inp.kv_cache.view(-1, 64, 576)
    assert flat[inp.block_table[0, 0], 3:].isnan().all()
    assert int(inp.block_table[0, 1]) == POISON_BLOCK_ID
    assert not flat[inp.block_table[1, 0]].isnan().any()


class TestForwardOnly(expecttest.TestCase):
    """Inputs may require grad: the forward runs unchanged, a backward raises (no silent zeros)."""

    def test_mla_decode(self):
        inp = make_decode_inputs([3, 70, 0], 2, 16)
        q = inp.q.clone().requires_grad_()
        args = (inp.kv_cache, inp.block_table, inp.cache_seqlens)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # PyTorch's "no autograd kernel" warning included
            out, lse = torch_mla.mla_decode(q, *args, causal=True)
            with torch.no_grad():
                ref_out, ref_lse = torch_mla.mla_decode(inp.q, *args, causal=True)
            assert out.requires_grad and lse.requires_grad
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
            with self.assertRaises(RuntimeError) as cm:
                out.float().sum().backward()
            self.assertExpectedInline(str(cm.exception), """torch_mla.mla_decode is forward-only (inference): it has no backward, so no gradient can flow through it. Run it under torch.no_grad() or torch.inference_mode(), or detach its inputs; to train, use an attention with a backward (the model's own).""")
            with self.assertRaises(RuntimeError) as cm:
                lse[torch.isfinite(lse)].sum().backward()
            assert "torch_mla.mla_decode is forward-only" in str(cm.exception)

    def test_append_kv(self):
        cache = torch.full((2, 64, 1, 576), float("nan"), dtype=torch.bfloat16)
        kv_c = torch.randn(2, 512, requires_grad=True)
        k_pe = torch.randn(2, 64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch_mla.append_kv(cache, kv_c, k_pe, torch.tensor([5, 70]))
        new = torch.cat([kv_c, k_pe], dim=1).bfloat16()
        assert torch.equal(cache.detach().view(-1, 576)[[5, 70]], new)
        with self.assertRaises(RuntimeError) as cm:
            cache.float().nan_to_num().sum().backward()
        self.assertExpectedInline(str(cm.exception), """torch_mla.append_kv is forward-only (inference): it has no backward, so no gradient can flow through it. Run it under torch.no_grad() or torch.inference_mode(), or detach its inputs; to train, use an attention with a backward (the model's own).""")

    def test_head_matmul(self):
        from torch_mla.ops.absorb import head_matmul

        (q_nope, w_uk, q_pe), _ = absorb_inputs(2, 1, 4, torch.float32)
        w_uk.requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            q = head_matmul(q_nope, w_uk, q_pe)
        assert q.requires_grad
        assert torch.equal(q.detach(), head_matmul(q_nope, w_uk.detach(), q_pe))
        with self.assertRaises(RuntimeError) as cm:
            q.sum().backward()
        assert "torch_mla._head_matmul is forward-only" in str(cm.exception)

    def test_decode_over_a_cache_written_with_grad(self):
        # The gradient path through the cache must not vanish silently either.
        inp = make_decode_inputs([3, 70], 1, 16)
        cache = inp.kv_cache.clone()
        kv_c = torch.randn(2, 512, requires_grad=True)
        slots = torch.stack([inp.block_table[0, 0] * 64 + 2, inp.block_table[1, 1] * 64 + 5])
        torch_mla.append_kv(cache, kv_c, torch.randn(2, 64), slots)
        out, _ = torch_mla.mla_decode(inp.q, cache, inp.block_table, inp.cache_seqlens)
        assert out.requires_grad
        with self.assertRaises(RuntimeError) as cm:
            out.float().sum().backward()
        assert "torch_mla.mla_decode is forward-only" in str(cm.exception)


_BAD_INPUTS = {
    "cache_seqlens": "lens[1] = 64 * table.shape[1] + 1",
    "block_table": "table[1, 1] = -1",
    "slot_range": "slots[0] = cache.shape[0] * 64",
    "slot_repeat": "slots[1] = slots[0]",
}


def _run_bad_input(bad: str, graph: bool, env: dict | None = None) -> str:
    """Runs an append_kv + decode step with one bad input in a fresh process (a device-side
    error ends the CUDA context); with graph, the step is captured with good inputs and the bad
    one is written in place before a replay. Returns the process's output."""
    code = f"""
import torch, torch_mla
from torch_mla.testing import make_decode_inputs
inp = make_decode_inputs([3, 70], 1, 16, device="cuda")
cache, table, lens = inp.kv_cache.clone(), inp.block_table.clone(), inp.cache_seqlens.clone()
slots = torch.tensor([1, 2, 3], device="cuda")
kv_c, k_pe = torch.randn(3, 512, device="cuda"), torch.randn(3, 64, device="cuda")
def step():
    torch_mla.append_kv(cache, kv_c, k_pe, slots)
    return torch_mla.mla_decode(inp.q, cache, table, lens)
if {graph}:
    step(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
{textwrap.indent(bad, "    " if graph else "")}
if {graph}:
    g.replay()
else:
    step()
torch.cuda.synchronize()
print("no error")
"""
    root = pathlib.Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         env=dict(os.environ, **(env or {})))
    log = res.stdout + res.stderr
    assert res.returncode != 0 and "no error" not in log, log
    return log


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["cache_seqlens", "block_table", "slot_range", "slot_repeat"])
def test_device_checks_assert_on_the_gpu(case):
    """The torch-op checks (append_kv; decode on the GPU reference path): device asserts."""
    from torch_mla.ops.checks import DEVICE_MESSAGES

    log = _run_bad_input(_BAD_INPUTS[case], graph=False, env={"TORCH_MLA_FORCE_REFERENCE": "1"})
    # The assert's own line; the error the host then sees depends on which call meets the dead
    # context first ("device-side assert triggered", or e.g. a cuBLAS handle that fails).
    assert f"Assertion `{DEVICE_MESSAGES[case]}` failed" in log, log


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("case", ["cache_seqlens", "block_table"])
def test_decode_kernel_stops_on_bad_values(case, graph):
    """The decode kernel checks the lengths and page ids it uses, inside CUDA graphs too, and
    names the entry."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the SM90 kernel")
    log = _run_bad_input(_BAD_INPUTS[case], graph=graph)
    want = {
        "cache_seqlens": "torch_mla.mla_decode: cache_seqlens[1] = 257, but lengths must be in "
                         "[0, 256] (block_table's width 4 x 64 tokens)",
        "block_table": "torch_mla.mla_decode: block_table[1, 1] = -1 is not a page of kv_cache",
    }[case]
    assert want in log, log
