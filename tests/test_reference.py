"""The reference decode against an independent float64 computation, with poisoned inputs."""

import pytest
import torch

from torch_mla.reference import mla_decode_reference
from torch_mla.testing import make_decode_inputs

from oracle import mla_decode_fp64

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
