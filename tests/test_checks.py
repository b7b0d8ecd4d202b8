"""mla_decode's metadata checks are skipped for a call signature that passed them before: a call
that differs in anything they read (type, shape, strides, dtype, device, d_v, scales, compute)
is checked again and raises as it would on its first call."""

from unittest import mock

import expecttest
import torch

import torch_mla
from torch_mla.ops import checks
from torch_mla.reference import mla_decode_reference
from torch_mla.testing import make_decode_inputs


def good_call():
    inp = make_decode_inputs([3, 70], 2, 16)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, 2, 16)
    return dict(q=inp.q, kv_cache=inp.kv_cache, block_table=inp.block_table,
                cache_seqlens=inp.cache_seqlens, schedule=sched)


def strided_like(t, dim):
    """t's values and shape with dimension `dim`'s stride doubled (every other element of a
    buffer twice as long): same signature but for one stride."""
    shape = list(t.shape)
    shape[dim] *= 2
    wide = torch.empty(shape, dtype=t.dtype)
    return wide[(slice(None),) * (dim % t.dim()) + (slice(None, None, 2),)].copy_(t)


class TestCheckedSignatures(expecttest.TestCase):
    def setUp(self):
        patch = mock.patch.object(checks, "_checked_calls", set())
        patch.start()
        self.addCleanup(patch.stop)

    def test_a_repeated_signature_is_checked_once(self):
        good = good_call()
        calls = []
        check = checks.check_decode_args
        with mock.patch.object(checks, "check_decode_args",
                               lambda *args: calls.append(1) or check(*args)):
            out, lse = torch_mla.mla_decode(**good)
            fresh = torch.randn_like(good["q"])  # other values, the same signature
            out2, lse2 = torch_mla.mla_decode(**{**good, "q": fresh})
            self.assertEqual(len(calls), 1)
            torch_mla.mla_decode(**{**good, "q": fresh[:, :1]})  # s_q 1: a new signature
            self.assertEqual(len(calls), 2)
        for o, lse_, q in ((out, lse, good["q"]), (out2, lse2, fresh)):
            ref_out, ref_lse = mla_decode_reference(q, good["kv_cache"], good["block_table"],
                                                    good["cache_seqlens"], 576**-0.5, False, 512)
            torch.testing.assert_close(o, ref_out, rtol=0, atol=0)
            torch.testing.assert_close(lse_, ref_lse, rtol=0, atol=0)

    def test_a_changed_call_is_checked_again(self):
        good = good_call()
        q, kv, bt, sl = good["q"], good["kv_cache"], good["block_table"], good["cache_seqlens"]
        meta, splits = good["schedule"]
        out, lse = torch_mla.mla_decode(**good)  # its signature is known from here on
        changes = {
            "q's last stride": dict(q=strided_like(q, -1)),
            "q's dtype": dict(q=q.half()),
            "q's type": dict(q=None),
            "kv_cache's page stride": dict(kv_cache=strided_like(kv, 1)),
            "kv_cache's dtype": dict(kv_cache=kv.half()),
            "kv_cache's device": dict(kv_cache=kv.to("meta")),
            "kv_cache's shape": dict(kv_cache=kv.view(-1, 32, 1, 576)),
            "block_table's last stride": dict(block_table=strided_like(bt, -1)),
            "block_table's dtype": dict(block_table=bt.long()),
            "cache_seqlens' shape": dict(cache_seqlens=sl[:1]),
            "cache_seqlens' dtype": dict(cache_seqlens=sl.long()),
            "metadata's dtype": dict(schedule=(meta.long(), splits)),
            "num_splits' shape": dict(schedule=(meta, splits[:-1])),
            "num_splits' device": dict(schedule=(meta, splits.to("meta"))),
            "d_v": dict(d_v=600),
            "kv_scale": dict(kv_scale=torch.ones(1)),
            "compute": dict(compute="fp8"),
        }
        msgs = []
        for name, change in changes.items():
            with self.assertRaises((ValueError, TypeError), msg=name) as cm:
                torch_mla.mla_decode(**{**good, **change})
            msgs.append(f"{name}: {cm.exception}")
        self.assertExpectedInline("\n".join(msgs), """\
q's last stride: q's last dimension must be contiguous (stride 1), got stride 2
q's dtype: kv_cache dtype (torch.bfloat16) must match q's dtype (torch.float16)
q's type: q must be a torch.Tensor, got NoneType
kv_cache's page stride: kv_cache must be contiguous (a persistent [num_blocks, 64, h_kv, d_qk] buffer)
kv_cache's dtype: kv_cache dtype (torch.float16) must match q's dtype (torch.bfloat16)
kv_cache's device: q, kv_cache, block_table and cache_seqlens must be on one device, got q=cpu, kv_cache=meta, block_table=cpu, cache_seqlens=cpu
kv_cache's shape: kv_cache page size (dim 1) must be 64, got 32
block_table's last stride: block_table's last dimension must be contiguous (stride 1)
block_table's dtype: block_table must be int32, got torch.int64
cache_seqlens' shape: cache_seqlens has 1 entries, expected batch = 2
cache_seqlens' dtype: cache_seqlens must be int32, got torch.int64
metadata's dtype: schedule metadata must be int32 [num_parts, 8], got torch.int64 [132, 8]; compute it with torch_mla.get_decode_schedule
num_splits' shape: num_splits must be int32 [batch + 1] = [3], got torch.int32 [2]; compute it with torch_mla.get_decode_schedule
num_splits' device: schedule tensors must be on cpu, got cpu and meta
d_v: d_v must be in (0, d_qk=576] (V is the first d_v columns of the cache), got 600
kv_scale: kv_scale is the scale of a float8_e4m3fn kv_cache; this kv_cache is torch.bfloat16: pass kv_scale=None
compute: compute='fp8' (e4m3 Q and P on fp8 tensor cores) needs a float8_e4m3fn kv_cache; this kv_cache is torch.bfloat16: pass compute='exact'""")
        out2, lse2 = torch_mla.mla_decode(**good)
        torch.testing.assert_close(out2, out, rtol=0, atol=0)
        torch.testing.assert_close(lse2, lse, rtol=0, atol=0)
