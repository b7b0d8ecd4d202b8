"""The CuTe DSL decode kernels against the fp32 reference, on fresh poisoned inputs: every test
runs on the SM90 kernel (H100/H200) and on the portable SM80-class kernel (any GPU of compute
capability 8.0 or newer; TORCH_MLA_PORTABLE=1 forces it where the SM90 kernel is the default)."""

import os

import pytest
import torch

import torch_mla
from torch_mla.constants import COMBINE_VARIANTS
from torch_mla.devtools import combine_warps
from torch_mla.ops.dispatch import decode_backend, find_decode_kernel
from torch_mla.reference import mla_decode_reference
from torch_mla.testing import capture_graph, make_decode_inputs, varlen_seqlens

# Each test runs on each kernel this GPU has (conftest.py's dense_backend).
pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("dense_backend")]


# bf16 output: the kernel rounds P to bf16 before P @ V (as FlashMLA does); FlashMLA's own test
# allows |err| <= 8e-4 + 2/128 |ref|. LSE is fp32 throughout.
TOL = {torch.bfloat16: dict(atol=8e-4, rtol=2.01 / 128), torch.float16: dict(atol=4e-4, rtol=3e-3)}


def expected_backend():
    return "sm80" if os.environ.get("TORCH_MLA_PORTABLE") == "1" else "sm90"


def check(out, lse, ref_out, ref_lse, dtype):
    assert not out.isnan().any(), "NaN in output"
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)  # +inf must match +inf
    # The norm of the error as well: the elementwise bound above allows 1.6% of each value, so
    # on near-uniform scores (outputs close to V's mean) it alone would pass a kernel that
    # weighs the keys wrongly; P's bf16 rounding moves the whole output by ~2^-9.
    ref = ref_out.float()
    if ref.norm() > 0:
        assert (out.float() - ref).norm() / ref.norm() < 5e-3


def run_and_check(lens, s_q, h_q, causal, dtype=torch.bfloat16, scale=None, contrast=1.0):
    """The kernel against the fp32 reference on fresh poisoned inputs; contrast multiplies q
    (make_decode_inputs' q and cache are randn / 10, so at the default scale the scores spread
    by ~0.01 and the softmax is near uniform; contrast 300 spreads them by ~3, as real
    attention's peaked rows)."""
    inp = make_decode_inputs(lens, s_q, h_q, dtype=dtype, device="cuda")
    if contrast != 1.0:
        inp.q.mul_(contrast)
    assert find_decode_kernel(inp.q, inp.kv_cache, 512) is not None
    assert decode_backend(inp.q.device, dtype)[0] == expected_backend()
    scale = scale or 576**-0.5
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    out, lse = torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched,
                                    softmax_scale=scale, causal=causal)
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table,
                                            inp.cache_seqlens, scale, causal, 512)
    check(out, lse, ref_out, ref_lse, dtype)
    return out, lse


@pytest.mark.parametrize("h_q", [1, 3, 9, 16, 63, 64, 126, 128])
@pytest.mark.parametrize("s_q,causal", [(1, False), (2, True), (4, True), (2, False)])
def test_heads_and_query_tokens(h_q, s_q, causal):
    run_and_check([20, 140, 4096, 0, 1, 65], s_q, h_q, causal)


@pytest.mark.parametrize("b", [1, 2, 6, 64, 128])
def test_batches_varlen(b):
    lens = varlen_seqlens(b)
    run_and_check(lens, 2, 128, True)
    run_and_check(lens, 1, 16, False)


@pytest.mark.parametrize("L", [1, 63, 64, 65, 127, 128, 129, 191, 192, 193])
def test_page_boundaries(L):
    run_and_check([L, L + 1, max(L - 1, 0)], 1, 64, False)
    run_and_check([L, L + 1, max(L - 1, 0)], 3, 32, True)


@pytest.mark.parametrize("variant", COMBINE_VARIANTS)
def test_every_combine_variant(variant):
    """Each combine variant, forced (devtools.combine_warps), merges long requests' pieces: the
    heuristic's choice depends on the device's size and may leave one untried."""
    with combine_warps(*variant):
        run_and_check([4096, 3000, 17], 2, 64, True)


def test_fp16():
    run_and_check([20, 140, 4096, 0], 2, 64, True, dtype=torch.float16)


def test_small_softmax_scale_and_long_context():
    run_and_check([32768, 5], 1, 128, False, scale=0.01)


@pytest.mark.parametrize("s_q,h_q,causal", [(1, 16, False), (1, 64, False), (2, 128, True),
                                            (4, 16, True)])
def test_peaked_scores(s_q, h_q, causal):
    """Scores spread by ~3 (q x 300): a few keys carry most of each row's weight, so a kernel
    that weighs, masks or rescales them wrongly across pages and pieces fails."""
    run_and_check([20, 140, 4096, 0, 1, 65, 3000], s_q, h_q, causal, contrast=300.0)


def test_deterministic():
    inp = make_decode_inputs([3000, 77, 4096, 512], 2, 128, device="cuda")
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, 2, 128)
    args = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched)
    o1, l1 = torch_mla.mla_decode(*args, causal=True)
    # (right as well as repeatable: a deterministic kernel may still be wrong)
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table,
                                            inp.cache_seqlens, 576**-0.5, True, 512)
    check(o1, l1, ref_out, ref_lse, torch.bfloat16)
    for _ in range(5):
        o2, l2 = torch_mla.mla_decode(*args, causal=True)
        assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_h_kv_heads():
    # FlashMLA's interface: several latent heads, one launch per head over a strided view.
    inp = make_decode_inputs([20, 140, 0, 65], 2, 16, dtype=torch.bfloat16, device="cuda", h_kv=4)
    out, lse = torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                    causal=True)
    ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table,
                                            inp.cache_seqlens, 576**-0.5, True, 512)
    check(out, lse, ref_out, ref_lse, torch.bfloat16)


@pytest.mark.parametrize("mode", ["graph", "reduce-overhead"])
def test_graph_replays_with_new_lengths(mode):
    """One call captured (a CUDA graph, or torch.compile's reduce-overhead), replayed on new
    lengths, pages and queries of the same shapes: each replay matches the reference."""
    steps = [make_decode_inputs(lens, 2, 64, device="cuda", max_blocks=6, num_blocks=14)
             for lens in ([70, 3, 300], [129, 64, 0], [5, 250, 190])]
    static = [steps[0].q.clone(), steps[0].kv_cache.clone(), steps[0].block_table.clone(),
              steps[0].cache_seqlens.clone()]

    def step(q, kv_cache, block_table, cache_seqlens):
        sched = torch_mla.get_decode_schedule(cache_seqlens, 2, 64)
        return torch_mla.mla_decode(q, kv_cache, block_table, cache_seqlens, sched, causal=True)

    torch_mla.set_value_checks(False)
    try:
        if mode == "graph":
            g, (out, lse) = capture_graph(step, static)
            run = g.replay
        else:
            torch._dynamo.reset()
            torch._dynamo.mark_static_address(static[1])
            compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
            res = {}

            def run():
                res["out"] = compiled(*static)
        for _ in range(2):
            for inp in steps:
                for dst, src in zip(static, [inp.q, inp.kv_cache, inp.block_table,
                                             inp.cache_seqlens]):
                    dst.copy_(src)
                run()
                if mode != "graph":
                    out, lse = (t.clone() for t in res["out"])
                torch.cuda.synchronize()
                ref_out, ref_lse = mla_decode_reference(*static, 576**-0.5, True, 512)
                check(out, lse, ref_out, ref_lse, torch.bfloat16)
    finally:
        torch_mla.set_value_checks(True)
