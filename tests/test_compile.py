"""A decode step (schedule + append + decode) under torch.compile(fullgraph=True)."""

import pytest
import torch
import torch._dynamo.testing

import torch_mla
from torch_mla.testing import make_decode_inputs

from oracle import mla_decode_fp64

S_Q, H_Q = 2, 16


def decode_step(q, kv_c, k_pe, slots, kv_cache, block_table, cache_seqlens):
    sched = torch_mla.get_decode_schedule(cache_seqlens, S_Q, H_Q)
    torch_mla.append_kv(kv_cache, kv_c, k_pe, slots)
    return torch_mla.mla_decode(q, kv_cache, block_table, cache_seqlens, sched, causal=True)


def step_inputs(lens, device="cpu", dtype=torch.bfloat16):
    inp = make_decode_inputs(lens, S_Q, H_Q, device=device, dtype=dtype, max_blocks=8, num_blocks=12)
    b = len(lens)
    # The last S_Q tokens of each request are this step's: write them through append_kv.
    pos = inp.cache_seqlens[:, None].long() - S_Q + torch.arange(S_Q, device=device)[None, :]
    page = torch.gather(inp.block_table.long(), 1, (pos // 64).clamp(min=0))
    slots = torch.where(pos >= 0, page * 64 + pos % 64, -1).reshape(-1)
    kv_c = torch.randn(b * S_Q, 512, device=device) / 10
    k_pe = torch.randn(b * S_Q, 64, device=device) / 10
    return inp, kv_c, k_pe, slots


def run_steps(fn, steps):
    results = []
    for inp, kv_c, k_pe, slots in steps:
        cache = inp.kv_cache.clone()
        out, lse = fn(inp.q, kv_c, k_pe, slots, cache, inp.block_table, inp.cache_seqlens)
        results.append((out, lse, cache))
    return results


def test_compiled_step_matches_eager_without_recompiling():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(decode_step, backend=counter, fullgraph=True)
    # Same shapes, new seqlen values and block-table contents at every step.
    steps = [step_inputs([70, 3, 300]), step_inputs([129, 64, 2]), step_inputs([5, 250, 190])]
    for (inp, *_), (out_c, lse_c, cache_c), (out_e, lse_e, cache_e) in zip(
        steps, run_steps(compiled, steps), run_steps(decode_step, steps)
    ):
        torch.testing.assert_close(out_c, out_e, atol=0, rtol=0)
        torch.testing.assert_close(lse_c, lse_e, atol=0, rtol=0)
        torch.testing.assert_close(cache_c, cache_e, atol=0, rtol=0, equal_nan=True)
        ref_out, _ = mla_decode_fp64(inp.q, cache_c, inp.block_table, inp.cache_seqlens,
                                     576**-0.5, True, 512)
        torch.testing.assert_close(out_c.double(), ref_out, atol=1e-3, rtol=1e-2)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compiled_graph_has_no_breaks():
    torch._dynamo.reset()
    inp, kv_c, k_pe, slots = step_inputs([70, 3, 300])
    explain = torch._dynamo.explain(decode_step)(inp.q, kv_c, k_pe, slots, inp.kv_cache.clone(),
                                                 inp.block_table, inp.cache_seqlens)
    assert explain.graph_break_count == 0
    assert explain.graph_count == 1
    ops = [str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [o for o in ops if "torch_mla" in o] == [
        "torch_mla.get_decode_schedule",
        "torch_mla.append_kv",
        "torch_mla.mla_decode",
    ]


@pytest.mark.cuda
def test_reduce_overhead_cudagraphs_replay_new_seqlens():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    dev = "cuda"
    steps = [step_inputs(lens, dev) for lens in ([70, 3, 300], [129, 64, 2], [5, 250, 190])]
    # The cache, block table and seqlens are persistent buffers in serving: one set, updated.
    inp0, *_ = steps[0]
    cache = inp0.kv_cache.clone()
    table = inp0.block_table.clone()
    lens = inp0.cache_seqlens.clone()
    q = inp0.q.clone()
    torch._dynamo.mark_static_address(cache)
    compiled = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    for _ in range(2):  # warm-up and recording
        for inp, kv_c, k_pe, slots in steps:
            cache.copy_(inp.kv_cache)
            table.copy_(inp.block_table)
            lens.copy_(inp.cache_seqlens)
            q.copy_(inp.q)
            out, lse = compiled(q, kv_c, k_pe, slots, cache, table, lens)
            ref_out, ref_lse = mla_decode_fp64(q, cache, table, lens, 576**-0.5, True, 512)
            torch.testing.assert_close(out.double().cpu(), ref_out, atol=2e-3, rtol=2e-2)
            fin = torch.isfinite(ref_lse)
            torch.testing.assert_close(lse.double().cpu()[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.cuda
def test_manual_cuda_graph_replays_new_seqlens():
    dev = "cuda"
    steps = [step_inputs(lens, dev) for lens in ([70, 3, 300], [129, 64, 2], [5, 250, 190])]
    inp0, kv_c0, k_pe0, slots0 = steps[0]
    static = [inp0.q.clone(), kv_c0.clone(), k_pe0.clone(), slots0.clone(), inp0.kv_cache.clone(),
              inp0.block_table.clone(), inp0.cache_seqlens.clone()]
    torch_mla.set_value_checks(False)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            decode_step(*[t.clone() for t in static])  # warm-up: compiles kernels outside capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out, lse = decode_step(*static)
        for inp, kv_c, k_pe, slots in steps:
            for dst, src in zip(static, [inp.q, kv_c, k_pe, slots, inp.kv_cache, inp.block_table,
                                         inp.cache_seqlens]):
                dst.copy_(src)
            g.replay()
            torch.cuda.synchronize()
            ref_out, ref_lse = mla_decode_fp64(static[0], static[4], static[5], static[6],
                                               576**-0.5, True, 512)
            torch.testing.assert_close(out.double().cpu(), ref_out, atol=2e-3, rtol=2e-2)
            fin = torch.isfinite(ref_lse)
            torch.testing.assert_close(lse.double().cpu()[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)
    finally:
        torch_mla.set_value_checks(True)


def test_compiled_step_with_inputs_requiring_grad_is_forward_only():
    # torch.compile traces a backward when inputs require grad: the forward must still compile
    # and match, and the backward raise when it runs (not at compile time, not silently).
    torch._dynamo.reset()
    inp, kv_c, k_pe, slots = step_inputs([70, 3, 300])
    q = inp.q.clone().requires_grad_()
    kv_c = kv_c.clone().requires_grad_()
    compiled = torch.compile(decode_step, fullgraph=True)
    cache = inp.kv_cache.clone()
    out, lse = compiled(q, kv_c, k_pe, slots, cache, inp.block_table, inp.cache_seqlens)
    with torch.no_grad():
        ref_cache = inp.kv_cache.clone()
        ref_out, ref_lse = decode_step(inp.q, kv_c, k_pe, slots, ref_cache, inp.block_table,
                                       inp.cache_seqlens)
    assert out.requires_grad
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=0, rtol=0)
    torch.testing.assert_close(cache.detach(), ref_cache, atol=0, rtol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="torch_mla.mla_decode is forward-only"):
        out.float().sum().backward()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # kernel, reference path
def test_eager_step_with_value_checks_does_not_sync(dtype):
    inp, kv_c, k_pe, slots = step_inputs([70, 3, 300], "cuda", dtype)
    args = (inp.q, kv_c, k_pe, slots)
    decode_step(*args, inp.kv_cache.clone(), inp.block_table, inp.cache_seqlens)  # compiles
    cache = inp.kv_cache.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = decode_step(*args, cache, inp.block_table, inp.cache_seqlens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_out, ref_lse = mla_decode_fp64(inp.q, cache, inp.block_table, inp.cache_seqlens,
                                       576**-0.5, True, 512)
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=2e-3, rtol=2e-2)
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double().cpu()[fin], ref_lse[fin], atol=1e-4, rtol=1e-4)
