"""Op registration (schemas, fake impls, opcheck), the Python API, append, and bad-input errors."""

import math

import expecttest
import pytest
import torch

import torch_mla
from torch_mla.testing import POISON_BLOCK_ID, make_decode_inputs

from oracle import mla_decode_fp64


def schema(name):
    return str(getattr(torch.ops.torch_mla, name).default._schema)


class TestSchemas(expecttest.TestCase):
    def test_schemas(self):
        self.assertExpectedInline(schema("get_decode_schedule"), """torch_mla::get_decode_schedule(Tensor cache_seqlens, int num_parts) -> (Tensor, Tensor)""")
        self.assertExpectedInline(schema("mla_decode"), """torch_mla::mla_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, Tensor sched_metadata, Tensor num_splits, float softmax_scale, bool causal, int d_v) -> (Tensor, Tensor)""")
        self.assertExpectedInline(schema("append_kv"), """torch_mla::append_kv(Tensor(a!) kv_cache, Tensor kv_c, Tensor k_pe, Tensor slot_mapping) -> ()""")


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


def test_mla_decode_api_matches_fp64():
    inp = make_decode_inputs([1, 63, 64, 65, 300], 3, 16)
    out, lse = torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                    causal=True, softmax_scale=0.05)
    ref_out, ref_lse = mla_decode_fp64(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                       0.05, True, 512)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-3, rtol=1e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


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


def test_append_kv_all_padding_changes_nothing():
    cache = torch.randn(2, 64, 1, 576)
    before = cache.clone()
    torch_mla.append_kv(cache, torch.randn(2, 512), torch.randn(2, 64), torch.tensor([-1, -1]))
    assert torch.equal(cache, before)


def test_schedule_covers_every_block_once():
    from torch_mla.scheduling import compute_schedule, walk_schedule

    cases = [(torch.tensor([1], dtype=torch.int32), 66)]  # parts inside the overhead units
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
    # Every part gets blocks, and none more than its share of the stream, ceil(T / P) units.
    assert min(load) > 0 and max(load) <= -(-total // 132), (min(load), max(load))


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

    def test_latent_heads(self):
        i = self.inp()
        bad = i.kv_cache.view(-1, 64, 2, 288)
        self.assertExpectedInline(self.err(kv_cache=bad), """kv_cache must hold one latent head (dim 2 == 1), got 2""")

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
        self.assertExpectedInline(self.err(cache_seqlens=too_long), """cache_seqlens has a length of 257 but block_table covers only 4 pages x 64 = 256 tokens""")

    def test_negative_seqlen(self):
        self.assertExpectedInline(self.err(cache_seqlens=torch.tensor([3, -2], dtype=torch.int32)), """cache_seqlens must be >= 0, got a minimum of -2""")

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
        self.assertExpectedInline(str(cm.exception), """slot_mapping holds slot 128 but the cache has only 128 slots (2 pages x 64)""")


def test_poisoned_inputs_are_poisoned():
    # The poison the tests rely on is really there: NaN past each length, huge unused ids.
    inp = make_decode_inputs([3, 64], 1, 1, extra_blocks=1)
    flat = inp.kv_cache.view(-1, 64, 576)
    assert flat[inp.block_table[0, 0], 3:].isnan().all()
    assert int(inp.block_table[0, 1]) == POISON_BLOCK_ID
    assert not flat[inp.block_table[1, 0]].isnan().any()
