"""The SM100 CuTe DSL decode kernel against the fp32 reference, on fresh poisoned inputs.

Written before any Blackwell GPU was available: these tests have not run yet. On a B200 they are
the first thing to run (with TORCH_MLA_SM100=1 set by the tests themselves), then
compute-sanitizer; docs/sm100-design.md says what else."""


import pytest
import torch

import torch_mla
from torch_mla.ops import dispatch
from torch_mla.reference import mla_decode_reference
from torch_mla.testing import make_decode_inputs, varlen_seqlens

pytestmark = pytest.mark.cuda


def is_sm100():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (10, 0)


requires_sm100 = pytest.mark.skipif(not is_sm100(), reason="needs an SM100 GPU (B200)")

# As tests/test_kernel_sm90.py: P is rounded to bf16/fp16 before P @ V (FlashMLA's tolerance).
TOL = {torch.bfloat16: dict(atol=8e-4, rtol=2.01 / 128), torch.float16: dict(atol=4e-4, rtol=3e-3)}


@pytest.fixture(autouse=True)
def _opt_in(monkeypatch):
    monkeypatch.setenv("TORCH_MLA_SM100", "1")


def run_and_check(lens, s_q, h_q, causal, dtype=torch.bfloat16, scale=None, h_kv=1):
    inp = make_decode_inputs(lens, s_q, h_q, dtype=dtype, device="cuda", h_kv=h_kv)
    # The first-use check passed, or this is the reference path and the test says why.
    assert dispatch.find_decode_kernel(inp.q, inp.kv_cache, 512) is dispatch.run_sm100
    scale = scale or 576**-0.5
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q, h_kv=h_kv)
    out, lse = torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched,
                                    softmax_scale=scale, causal=causal)
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table,
                                            inp.cache_seqlens, scale, causal, 512)
    assert not out.isnan().any(), "NaN in output"
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)  # +inf must match +inf


@requires_sm100
@pytest.mark.parametrize("h_q", [1, 3, 16, 63, 64, 128])
@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True), (4, True), (2, False)])
def test_heads_and_query_tokens(h_q, s_q, causal):
    run_and_check([20, 140, 4096, 0, 1, 65], s_q, h_q, causal)


@requires_sm100
@pytest.mark.parametrize("b", [1, 2, 6, 64, 128])
def test_batches_varlen(b):
    lens = varlen_seqlens(b)
    run_and_check(lens, 2, 128, True)
    run_and_check(lens, 1, 16, False)


@requires_sm100
@pytest.mark.parametrize("L", [1, 63, 64, 65, 127, 128, 129, 191, 192, 193])
def test_page_boundaries(L):
    run_and_check([L, L + 1, max(L - 1, 0)], 1, 64, False)
    run_and_check([L, L + 1, max(L - 1, 0)], 3, 32, True)


@requires_sm100
def test_fp16_and_kv_heads():
    run_and_check([20, 140, 4096, 0], 2, 64, True, dtype=torch.float16)
    run_and_check([20, 140, 700], 1, 32, False, h_kv=2)


@requires_sm100
def test_small_softmax_scale_and_long_context():
    run_and_check([32768, 5], 1, 128, False, scale=0.01)


@requires_sm100
def test_cuda_graph_replay():
    inp = make_decode_inputs([3000, 77, 4096, 512], 2, 128, device="cuda")
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, 2, 128)
    args = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched)
    o1, l1 = torch_mla.mla_decode(*args, causal=True)  # compiles and runs the first-use check
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o2, l2 = torch_mla.mla_decode(*args, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
