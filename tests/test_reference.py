"""The reference decode against an independent float64 computation, with poisoned inputs."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from torch_mla.reference import mla_decode_reference
from torch_mla.testing import make_decode_inputs

from oracle import kv_head_inputs, mla_decode_fp64

# Output tolerances per dtype: the reference accumulates in fp32 and rounds once to the dtype.
TOL = {
    torch.bfloat16: dict(atol=1e-3, rtol=1e-2),
    torch.float16: dict(atol=2e-4, rtol=2e-3),
    torch.float32: dict(atol=1e-5, rtol=1e-4),
}
SEQLENS = [0, 1, 63, 64, 65, 1000]  # empty, one token, page boundaries, long


def check(inp, s_q, causal, d_v, dtype):
    d_qk = inp.q.shape[-1]
    scale = d_qk**-0.5
    out, lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                    scale, causal, d_v)
    ref_out, ref_lse = mla_decode_fp64(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                       scale, causal, d_v)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, **TOL[dtype])
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), ~finite)  # +inf exactly where no key is visible
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-5, rtol=1e-5)
    assert (out.double()[(~finite).transpose(1, 2)] == 0).all()


@pytest.mark.parametrize("h_q", [1, 3, 16, 128])
@pytest.mark.parametrize("s_q,causal", [(1, False), (2, False), (2, True), (3, True), (4, False),
                                        (4, True)])
def test_reference_grid(h_q, s_q, causal):
    inp = make_decode_inputs(SEQLENS, s_q, h_q)
    check(inp, s_q, causal, 512, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_reference_dtypes(dtype):
    inp = make_decode_inputs([5, 130, 0, 64], 2, 16, dtype=dtype)
    check(inp, 2, True, 512, dtype)


@pytest.mark.parametrize("s_q,causal", [(1, False), (3, True)])
def test_reference_other_head_dims(s_q, causal):
    # MiniCPM3: kv_lora_rank 256 + rope 32.
    inp = make_decode_inputs([1, 77, 200], s_q, 40, d_qk=288)
    check(inp, s_q, causal, 256, torch.bfloat16)


def test_reference_random_varlen():
    lens = torch.randint(0, 700, (9,)).tolist()
    inp = make_decode_inputs(lens, 2, 9)
    check(inp, 2, True, 512, torch.bfloat16)


@pytest.mark.parametrize("h_kv,h_q", [(1, 4), (2, 6), (3, 3), (8, 16)])
@pytest.mark.parametrize("s_q,causal", [(1, False), (3, True)])
def test_reference_kv_heads(h_kv, h_q, s_q, causal):
    lens = [0, 1, 64, 65, *torch.randint(0, 300, (3,)).tolist()]
    inp = kv_head_inputs(lens, s_q, h_q, h_kv)
    check(inp, s_q, causal, 512, torch.bfloat16)
    # Each KV head matters: the result changes when another head's keys change.
    if h_kv > 1:
        out, _ = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                      576**-0.5, causal, 512)
        other = inp.kv_cache.clone()
        other[:, :, -1] = torch.randn_like(other[:, :, -1])
        out2, _ = mla_decode_reference(inp.q, other, inp.block_table, inp.cache_seqlens,
                                       576**-0.5, causal, 512)
        group = h_q // h_kv
        changed = (out2 != out).flatten(3).any(-1).any(1).any(0)  # per query head
        assert changed.tolist() == [False] * (h_q - group) + [True] * group


@pytest.mark.parametrize("pages_per_chunk", [1, 2, 3])
@pytest.mark.parametrize("host_lengths", [True, False])
def test_reference_page_chunks(pages_per_chunk, host_lengths):
    # The walk over page chunks (online softmax) against the fp64 oracle, with the device
    # default (every column of the table walked) as well as the CPU one (only what lengths use).
    lens = [0, 1, 63, 64, 65, 200, 130, *torch.randint(0, 400, (4,)).tolist()]
    inp = make_decode_inputs(lens, 2, 5, extra_blocks=3)
    scale = 576**-0.5
    out, lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                    scale, True, 512, batch_chunk=4,
                                    pages_per_chunk=pages_per_chunk, host_lengths=host_lengths)
    ref_out, ref_lse = mla_decode_fp64(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                       scale, True, 512)
    torch.testing.assert_close(out.double(), ref_out, **TOL[torch.bfloat16])
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isposinf(lse), ~fin)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)


class GatherCount(TorchFunctionMode):
    """Counts the pages gathered from kv_cache (indexing it or a view of it) and stops at the
    first gather past ``limit``, before it allocates; records the largest tensor made."""

    def __init__(self, kv_cache, limit):
        super().__init__()
        self.ptr, self.limit = kv_cache.untyped_storage().data_ptr(), limit
        self.pages, self.largest = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor)
                and args[0].untyped_storage().data_ptr() == self.ptr):
            self.pages += args[1].numel()
            assert self.pages <= self.limit, f"gathered {self.pages} pages, {self.limit} needed"
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_reference_cost_follows_lengths_not_table_width():
    # A 50_000-column block table with 3 columns used: the CPU reference gathers only the pages
    # the lengths need (3 requests x ceil(130 / 64) columns) and makes no tensor as large as
    # the table (a head dim of 64 keeps those pages smaller than the table).
    width, d_qk = 50_000, 64
    inp = make_decode_inputs([1, 130, 64], 2, 4, d_qk=d_qk, max_blocks=width)
    counter = GatherCount(inp.kv_cache, limit=3 * 3)
    with counter:
        out, lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                        0.05, True, 32)
    assert counter.pages == 9 and counter.largest <= 9 * 64 * d_qk < 3 * width, \
        (counter.pages, counter.largest)
    ref_out, ref_lse = mla_decode_fp64(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                       0.05, True, 32)
    torch.testing.assert_close(out.double(), ref_out, **TOL[torch.bfloat16])
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
