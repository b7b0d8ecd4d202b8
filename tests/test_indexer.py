"""The lightning indexer ops (torch_mla.indexer_logits / indexer_topk) on their reference path,
the index-key cache (append_index_keys, bf16 and FP8), the ops' registration and compile
behaviour. The oracle is independent of torch_mla: a float64 loop over requests and query tokens
reading each position's key through the block table, and FP8 keys decoded from their bits."""

import math

import expecttest
import pytest
import torch
import torch._dynamo.testing

import torch_mla
from torch_mla.reference_indexer import (
    dequantize_index_keys,
    index_scales,
    quantize_index_keys,
    topk_slots_reference,
)

PAGE = 64
HUGE = 2**30  # block-table poison: a page id far past any cache


# ---- inputs and the fp64 oracle -----------------------------------------------------------------

def make_inputs(lens, s_q, heads, dim, fmt="bf16", width=None, spare_pages=2):
    """q, weights, index cache (+ scale), a shuffled block table and the lengths. Slots no
    request holds are NaN (FP8: NaN bytes and NaN scales); block-table entries past each
    request's pages hold a huge id."""
    b = len(lens)
    width = width or max(1, max(-(-n // PAGE) for n in lens))
    num_blocks = b * width + spare_pages
    table = torch.randperm(num_blocks)[: b * width].view(b, width).int()
    lengths = torch.tensor(lens, dtype=torch.int32)
    for r, n in enumerate(lens):
        table[r, -(-n // PAGE):] = HUGE
    keys = torch.randn(num_blocks, PAGE, dim)
    keys *= torch.rand(num_blocks, PAGE, 1) * 3  # tokens of differing ranges (FP8 scales)
    held = torch.zeros(num_blocks, PAGE, dtype=torch.bool)
    for r, n in enumerate(lens):
        for j in range(n):
            held[table[r, j // PAGE], j % PAGE] = True
    scale = None
    if fmt == "fp8":
        cache, scale = quantize_index_keys(keys)
        cache.view(torch.uint8)[~held] = 0xFF  # e4m3fn NaN
        scale[~held] = math.nan
        q, q_scale = quantize_index_keys(torch.randn(b, s_q, heads, dim))
        weights = torch.randn(b, s_q, heads) * q_scale
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[fmt]
        cache = keys.to(dtype)
        cache[~held] = math.nan
        q = torch.randn(b, s_q, heads, dim).to(dtype)
        weights = torch.randn(b, s_q, heads)
    return q, weights, cache, scale, table, lengths


def e4m3_to_f64(x: torch.Tensor) -> torch.Tensor:
    """float64 values of float8_e4m3fn bits (sign, 4-bit exponent bias 7, 3-bit mantissa)."""
    bits = x.view(torch.uint8).long()
    sign = torch.where(bits >> 7 == 1, -1.0, 1.0).double()
    e, m = (bits >> 3) & 15, (bits & 7).double()
    val = torch.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * torch.pow(2.0, (e - 7).double()))
    return torch.where((e == 15) & (m == 7), math.nan, sign * val)


def logits_fp64(q, weights, cache, scale, table, lens):
    """float64 [b, s_q, width * 64]: one query token and one position at a time."""
    b, s_q, _, _ = q.shape
    qd = e4m3_to_f64(q) if q.dtype == torch.float8_e4m3fn else q.double()
    kd = e4m3_to_f64(cache) * scale.double()[..., None] if scale is not None else cache.double()
    out = torch.full((b, s_q, table.shape[1] * PAGE), -math.inf, dtype=torch.float64)
    for r in range(b):
        L = int(lens[r])
        for t in range(s_q):
            seen = L - s_q + t + 1
            for j in range(max(seen, 0)):
                k = kd[table[r, j // PAGE], j % PAGE]
                out[r, t, j] = (weights[r, t].double() * (qd[r, t] @ k).clamp_min(0)).sum()
    return out


def check_selection(indices, ref_logits, table, lens, topk):
    """indices [b, s_q, topk] against the fp64 logits: each token's entries name distinct
    positions it sees, min(topk, seen) of them, in descending logit order, then -1; and they are
    a top-k (each selected logit at least the k-th largest, up to float32 rounding)."""
    b, s_q, _ = indices.shape
    assert indices.dtype == torch.int32 and indices.shape[2] == topk
    for r in range(b):
        slot_of = {int(table[r, j // PAGE]) * PAGE + j % PAGE: j
                   for j in range(int(lens[r]))}
        for t in range(s_q):
            row = ref_logits[r, t]
            seen = max(int(lens[r]) - s_q + t + 1, 0)
            n = min(topk, seen)
            got = indices[r, t].tolist()
            assert got[n:] == [-1] * (topk - n), (r, t)
            pos = [slot_of[s] for s in got[:n]]
            assert len(set(pos)) == n and all(p < seen for p in pos), (r, t)
            vals = row[pos]
            tol = 1e-5 * float(row[:seen].abs().max()) if seen else 0.0
            assert (vals[1:] <= vals[:-1] + tol).all(), (r, t)  # descending
            if n:
                kth = row[:seen].sort(descending=True).values[n - 1]
                assert (vals >= kth - tol).all(), (r, t)


def logit_at_slots(logits, slots, table):
    """logits [b, s_q, n] at the positions that the cache slots ``slots`` [b, s_q, k] hold (-inf
    for -1)."""
    vals = torch.full(slots.shape, -math.inf)
    for r in range(table.shape[0]):
        pos_of = {int(table[r, j]) * PAGE + i: j * PAGE + i
                  for j in range(table.shape[1]) if table[r, j] < HUGE for i in range(PAGE)}
        for t in range(slots.shape[1]):
            for k, slot in enumerate(slots[r, t].tolist()):
                if slot >= 0:
                    vals[r, t, k] = logits[r, t, pos_of[slot]]
    return vals


# ---- the reference against the fp64 loop --------------------------------------------------------

# Lengths around the page boundaries (1, 63, 64, 65) and a longer one, s_q 1..4 (lengths include
# the step's s_q tokens, so a length below s_q leaves the first tokens seeing nothing), heads
# 1 / 3 / 64 (DeepSeek-V3.2's), index_head_dim 32 and 128 (its).
GRID = [(lens, s_q, h, d) for lens in ([1, 65], [63, 64, 200]) for s_q in (1, 2, 4)
        for h, d in ((1, 32), (3, 128), (64, 128))]


@pytest.mark.parametrize("lens,s_q,heads,dim", GRID)
def test_logits_match_fp64(lens, s_q, heads, dim):
    q, w, cache, scale, table, L = make_inputs(lens, s_q, heads, dim)
    got = torch_mla.indexer_logits(q, w, cache, table, L)
    want = logits_fp64(q, w, cache, scale, table, L)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))  # -inf exactly past the horizon
    fin = torch.isfinite(want)
    assert torch.isfinite(got[fin]).all()
    torch.testing.assert_close(got[fin].double(), want[fin], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "fp8"])
@pytest.mark.parametrize("topk", [1, 16, 100, 500])
def test_topk_selects_the_largest_logits(fmt, topk):
    # topk below, near and above the lengths (then -1 entries), and 500 past the table's width
    # (256 positions: the output is padded with -1).
    lens, s_q = [3, 130, 256, 77], 3
    q, w, cache, scale, table, L = make_inputs(lens, s_q, 8, 64, fmt=fmt)
    idx = torch_mla.indexer_topk(q, w, cache, table, L, topk, index_scale=scale)
    check_selection(idx, logits_fp64(q, w, cache, scale, table, L), table, L, topk)
    # The op's selection is the reference's full sort of its own logits: the same logits in the
    # same order (tied positions, such as keys every head's relu zeroes, in any order).
    logits = torch_mla.indexer_logits(q, w, cache, table, L, index_scale=scale)
    ref = topk_slots_reference(logits, table, L, topk)
    assert torch.equal(idx == -1, ref == -1)
    assert torch.equal(logit_at_slots(logits, idx, table), logit_at_slots(logits, ref, table))


def test_empty_requests_and_tokens_that_see_nothing():
    # Length 0, and a length below s_q: its first tokens see no key (all -1, logits all -inf).
    q, w, cache, scale, table, L = make_inputs([0, 2, 70], 3, 4, 32)
    logits = torch_mla.indexer_logits(q, w, cache, table, L)
    assert torch.isneginf(logits[0]).all() and torch.isneginf(logits[1, 0]).all()
    idx = torch_mla.indexer_topk(q, w, cache, table, L, 8)
    assert (idx[0] == -1).all() and (idx[1, 0] == -1).all()
    assert (idx[1, 1, 1:] == -1).all() and idx[1, 1, 0] == table[1, 0] * PAGE
    check_selection(idx, logits_fp64(q, w, cache, scale, table, L), table, L, 8)


def test_reference_chunks_agree():
    from torch_mla.reference_indexer import indexer_logits_reference

    q, w, cache, _, table, L = make_inputs([300, 129], 2, 4, 32)
    whole = indexer_logits_reference(q, w, cache, table, L, pages_per_chunk=64)
    for chunk in (1, 2, 3):
        torch.testing.assert_close(indexer_logits_reference(q, w, cache, table, L,
                                                            pages_per_chunk=chunk), whole)


def test_relu_is_per_head_and_weights_sign_matters():
    # Two heads whose products cancel before the relu but not after, and a negative weight.
    cache = torch.zeros(1, PAGE, 2)
    cache[0, :3] = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
    q = torch.tensor([[[[1.0, 0.0], [-1.0, 0.0]]]])  # heads: +x, -x
    w = torch.tensor([[[1.0, -0.5]]])
    table, L = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    got = torch_mla.indexer_logits(q, w, cache, table, L)[0, 0, :3]
    # key 0: relu(1) - 0.5 relu(-1) = 1; key 1: 0; key 2: relu(-1) - 0.5 relu(1) = -0.5
    assert got.tolist() == [1.0, 0.0, -0.5]


# ---- FP8 index keys -----------------------------------------------------------------------------

def test_fp8_scales_are_deepseeks_ue8m0():
    x = torch.randn(500, 128) * torch.logspace(-6, 3, 500)[:, None]
    x[0] = 0  # all zero: the 1e-4 floor
    x[1, :] = 448 * 2.0**-3  # amax / 448 a power of two exactly: not rounded up past it
    x[2, 0] = 448 * 2.0**-3 * (1 + 2**-20)  # just above one: the next power
    s = index_scales(x)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))  # powers of two
    amax = x.abs().amax(-1).clamp_min(1e-4)
    assert (amax / s <= 448).all() and (amax / s > 224).all()  # rounded up, by less than 2x
    assert s[1] == 2.0**-3 and s[2] == 2.0**-2 and s[0] == 2.0**-22  # 1e-4 / 448 -> 2^-22
    k8, s8 = quantize_index_keys(x)
    assert torch.equal(s8, s) and k8.dtype == torch.float8_e4m3fn
    back = dequantize_index_keys(k8, s8)
    # e4m3 keeps 3 mantissa bits: a normal value within 2^-4 relative (subnormals absolutely).
    err = (back - x).abs()
    assert (err <= x.abs() * 2.0**-4 + s[:, None] * 2.0**-10).all()


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "fp8"])
def test_append_index_keys(fmt):
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}[fmt]
    cache = torch.full((3, PAGE, 32), math.nan).to(dtype)
    scale = torch.full((3, PAGE), math.nan) if fmt == "fp8" else None
    k = torch.randn(70, 32) * 5
    slots = torch.randperm(3 * PAGE)[:70]
    slots[::9] = -1  # padding: skipped
    torch_mla.append_index_keys(cache, k, slots, index_scale=scale)
    flat = cache.view(-1, 32).float() if fmt != "fp8" else dequantize_index_keys(
        cache.view(-1, 32), scale.view(-1))
    written = slots >= 0
    if fmt == "fp8":
        want = dequantize_index_keys(*quantize_index_keys(k))
    else:
        want = k.to(dtype).float()
    assert torch.equal(flat[slots[written]], want[written])
    untouched = torch.ones(3 * PAGE, dtype=torch.bool)
    untouched[slots[written]] = False
    assert flat[untouched].isnan().all()
    torch_mla.append_index_keys(cache, k[:2], torch.tensor([-1, -1]), index_scale=scale)
    flat2 = cache.view(-1, 32).float() if fmt != "fp8" else dequantize_index_keys(
        cache.view(-1, 32), scale.view(-1))
    assert flat2[untouched].isnan().all()  # all padding: nothing written


def test_fp8_cache_logits_are_the_dequantized_keys():
    # Written by append_index_keys, read by the op: the fp64 oracle on the stored bits.
    lens, dim = [90, 40], 64
    b = len(lens)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    cache = torch.zeros(4, PAGE, dim, dtype=torch.float8_e4m3fn)
    scale = torch.zeros(4, PAGE)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        slots = table[r, pos // PAGE].long() * PAGE + pos % PAGE
        torch_mla.append_index_keys(cache, torch.randn(n, dim) * (r + 1), slots, scale)
    q, q_scale = quantize_index_keys(torch.randn(b, 1, 4, dim))
    w = torch.rand(b, 1, 4) * q_scale
    L = torch.tensor(lens, dtype=torch.int32)
    got = torch_mla.indexer_logits(q, w, cache, table, L, index_scale=scale)
    want = logits_fp64(q, w, cache, scale, table, L)
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin].double(), want[fin], atol=1e-4, rtol=1e-5)


# ---- the ops: schema, opcheck, torch.compile -----------------------------------------------------

class TestIndexerSchema(expecttest.TestCase):
    def test_schemas(self):
        schemas = "\n".join(str(getattr(torch.ops.torch_mla, op).default._schema)
                            for op in ("indexer_logits", "indexer_topk", "append_index_keys"))
        self.assertExpectedInline(schemas, """\
torch_mla::indexer_logits(Tensor q, Tensor weights, Tensor index_cache, Tensor? index_scale, Tensor block_table, Tensor cache_seqlens) -> Tensor
torch_mla::indexer_topk(Tensor q, Tensor weights, Tensor index_cache, Tensor? index_scale, Tensor block_table, Tensor cache_seqlens, int topk) -> Tensor
torch_mla::append_index_keys(Tensor(a!) index_cache, Tensor k, Tensor slot_mapping, Tensor(b!)? index_scale=None) -> ()""")


def op_args(fmt="bf16", lens=(70, 5), s_q=2, heads=4, dim=32):
    q, w, cache, scale, table, L = make_inputs(list(lens), s_q, heads, dim, fmt=fmt)
    return q, w, cache, scale, table, L


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_opcheck(fmt):
    # (FP8 inputs: not test_schema, whose SchemaCheckMode compares them with a multiply torch has
    # no float8 CPU kernel for, as tests/test_fp8.py notes)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    kwargs = {"test_utils": utils} if fmt == "fp8" else {}
    args = op_args(fmt)
    torch.library.opcheck(torch.ops.torch_mla.indexer_logits.default, args, **kwargs)
    torch.library.opcheck(torch.ops.torch_mla.indexer_topk.default, (*args, 16), **kwargs)
    _, _, cache, scale, _, _ = args
    slots = torch.tensor([3, -1, 70], dtype=torch.int64)
    torch.library.opcheck(torch.ops.torch_mla.append_index_keys.default,
                          (cache, torch.randn(3, cache.shape[-1]), slots, scale), **kwargs)


def test_inputs_requiring_grad_run_and_backward_raises():
    q, w, cache, scale, table, L = op_args("fp32")
    w = w.clone().requires_grad_()
    logits = torch_mla.indexer_logits(q, w, cache, table, L)
    assert logits.requires_grad
    with pytest.raises(RuntimeError, match="torch_mla.indexer_logits is forward-only"):
        logits[torch.isfinite(logits)].sum().backward()
    idx = torch_mla.indexer_topk(q, w, cache, table, L, 8)
    assert torch.equal(idx, torch_mla.indexer_topk(q, w.detach(), cache, table, L, 8))
    k = torch.randn(2, cache.shape[-1], requires_grad=True)
    torch_mla.append_index_keys(cache, k, torch.tensor([3, 70]))
    assert torch.equal(cache.view(-1, cache.shape[-1])[[3, 70]], k.detach())
    with pytest.raises(RuntimeError, match="torch_mla.append_index_keys is forward-only"):
        cache.view(-1, cache.shape[-1])[3].sum().backward()


def indexer_step(q, w, cache, scale, table, L, k_new, slots):
    """One decode step's indexer work: write the new keys, then select."""
    torch_mla.append_index_keys(cache, k_new, slots, index_scale=scale)
    return torch_mla.indexer_topk(q, w, cache, table, L, 16, index_scale=scale)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_compiled_step_matches_eager_without_recompiles(fmt):
    torch._dynamo.reset()
    # (aot_eager: dynamo's guards and functionalization of the cache writes, without inductor's
    # compile time on a shared CPU; the ops are opaque to both)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(indexer_step, backend=counter, fullgraph=True)
    q, w, cache, scale, table, L = op_args(fmt, lens=(70, 5), s_q=2)
    for step in range(3):
        q, _ = (quantize_index_keys(torch.randn(q.shape)) if fmt == "fp8"
                else (torch.randn(q.shape).to(q.dtype), None))
        w = torch.randn(w.shape)
        k_new = torch.randn(2 * 2, 32)
        pos = L.long()[:, None] + torch.arange(2) - 2  # this step's positions, inside the pages
        slots = (table.long().gather(1, pos // PAGE) * PAGE + pos % PAGE).flatten()
        eager_cache, eager_scale = cache.clone(), None if scale is None else scale.clone()
        got = compiled(q, w, cache, scale, table, L, k_new, slots)
        want = indexer_step(q, w, eager_cache, eager_scale, table, L, k_new, slots)
        assert torch.equal(got, want), step
        assert torch.equal(cache.view(torch.uint8), eager_cache.view(torch.uint8))
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compiled_graph_has_the_op():
    torch._dynamo.reset()
    q, w, cache, scale, table, L = op_args()
    explain = torch._dynamo.explain(torch_mla.indexer_topk)(q, w, cache, table, L, 16)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    ops = [str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [o for o in ops if "torch_mla" in o] == ["torch_mla.indexer_topk"]
    # The step's cache write is one op too (the torch ops it runs, lowered by inductor on CUDA,
    # copied the whole index cache: 2 x 0.5 ms a layer at b 32 and a 128k context on the H200).
    torch._dynamo.reset()
    k_new, slots = torch.randn(2, q.shape[-1]).to(cache.dtype), torch.tensor([3, 70])
    explain = torch._dynamo.explain(indexer_step)(q, w, cache, scale, table, L, k_new, slots)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    ops = [str(n.target) for g in explain.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [o for o in ops if "torch_mla" in o] == ["torch_mla.append_index_keys",
                                                     "torch_mla.indexer_topk"]


# ---- errors ----------------------------------------------------------------------------------------

class TestIndexerErrors(expecttest.TestCase):
    """Each bad input raises before anything runs, saying what is wrong and what is expected."""

    def err(self, fn=torch_mla.indexer_topk, **change):
        q, w, cache, scale, table, L = op_args("bf16", lens=(70, 5), s_q=1)
        args = dict(q=q, weights=w, index_cache=cache, block_table=table, cache_seqlens=L,
                    topk=16)
        if fn is torch_mla.indexer_logits:
            del args["topk"]
        args.update(change)
        with self.assertRaises((ValueError, TypeError)) as cm:
            fn(**args)
        return str(cm.exception)

    def test_shapes_and_dtypes(self):
        q, w, cache, _, table, L = op_args("bf16", lens=(70, 5), s_q=1)
        fp8 = cache.float().nan_to_num().to(torch.float8_e4m3fn)
        e = self.err
        self.assertExpectedInline(e(q=q[:, 0]), """q must have shape [batch, s_q, index_n_heads, index_head_dim], got [2, 4, 32]""")
        self.assertExpectedInline(e(q=q.float()), """q must be index_cache's dtype (torch.bfloat16), got torch.float32""")
        self.assertExpectedInline(e(q=q[..., :16]), """q's head dim (16) must equal index_cache's index_head_dim (32)""")
        self.assertExpectedInline(e(index_cache=cache[:, :32]), """index_cache must have shape [num_blocks, 64, index_head_dim] (one index key a token, on the latent cache's pages), got [6, 32, 32]""")
        self.assertExpectedInline(e(index_cache=cache.to(torch.int8)), """index_cache must be bfloat16, float16, float32 or float8_e4m3fn, got torch.int8""")
        self.assertExpectedInline(e(index_cache=fp8), """index_cache is float8_e4m3fn: pass index_scale=, float32 [num_blocks, 64] = [6, 64] (key = index_cache.float() * index_scale)""")
        self.assertExpectedInline(e(index_cache=fp8, index_scale=torch.ones(4, 32)), """index_scale must be float32 [num_blocks, 64] = [6, 64], got torch.float32 [4, 32]""")
        self.assertExpectedInline(e(index_cache=fp8, index_scale=torch.ones(6, 64)), """over a float8_e4m3fn index_cache q must be float8_e4m3fn too (quantize it per (token, head) and fold its scale into weights), got torch.bfloat16""")
        self.assertExpectedInline(e(index_scale=torch.ones(4, 64)), """index_scale is the scale of a float8_e4m3fn index_cache; this one is torch.bfloat16: pass index_scale=None""")
        self.assertExpectedInline(e(weights=w.bfloat16()), """weights must be float32 [batch, s_q, index_n_heads] = [2, 1, 4], got torch.bfloat16 [2, 1, 4]""")
        self.assertExpectedInline(e(block_table=table.long()), """block_table must be int32 [batch, max_blocks] with batch = 2, got torch.int64 [2, 2]""")
        self.assertExpectedInline(e(cache_seqlens=L[:1]), """cache_seqlens must have shape [batch] = [2], got [1]""")
        self.assertExpectedInline(e(topk=0), """topk must be >= 1, got 0""")
        self.assertExpectedInline(e(weights=[1.0]), """weights must be a torch.Tensor, got list""")

    def test_values(self):
        q, w, cache, _, table, L = op_args("bf16", lens=(70, 5), s_q=1)
        bad = table.clone()
        bad[1, 0] = 9
        e = self.err
        self.assertExpectedInline(e(cache_seqlens=torch.tensor([70, 129], dtype=torch.int32)), """cache_seqlens[1] = 129, but block_table covers only 2 pages x 64 = 128 tokens""")
        self.assertExpectedInline(e(fn=torch_mla.indexer_logits, block_table=bad), """block_table[1, 0] = 9 is not a page of index_cache (num_blocks = 6): request 1 has 5 tokens, so its first entry must be a page id in [0, 6)""")

    def test_append_errors(self):
        cache = torch.zeros(2, PAGE, 32)

        def err(**kw):
            args = dict(index_cache=cache, k=torch.zeros(3, 32), slot_mapping=torch.tensor([0, 1, 2]))
            args.update(kw)
            with self.assertRaises((ValueError, TypeError)) as cm:
                torch_mla.append_index_keys(**args)
            return str(cm.exception)

        self.assertExpectedInline(err(k=torch.zeros(3, 16)), """k must be [tokens, index_head_dim] = [3, 32] (as many tokens as slot_mapping), got [3, 16]""")
        self.assertExpectedInline(err(index_cache=cache.to(torch.float8_e4m3fn)), """index_cache is float8_e4m3fn: pass index_scale=, float32 [num_blocks, 64] = [2, 64] (key = index_cache.float() * index_scale)""")
        self.assertExpectedInline(err(slot_mapping=torch.tensor([0, 128, 1])), """slot_mapping[1] = 128, but the cache has only 128 slots (2 pages x 64)""")
        self.assertExpectedInline(err(slot_mapping=torch.tensor([5, 1, 5])), """slot_mapping[0] and slot_mapping[2] both write slot 5; slots must be distinct (negative slots are skipped and may repeat)""")


# ---- on a GPU (the coordinator runs these) --------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_equals_cpu(fmt):
    args = op_args(fmt, lens=(700, 3000, 64), s_q=2, heads=64, dim=128)
    q, w, cache, scale, table, L = args
    want_logits = torch_mla.indexer_logits(q, w, cache, table, L, index_scale=scale)
    cuda = [None if t is None else t.cuda() for t in args]
    got_logits = torch_mla.indexer_logits(cuda[0], cuda[1], cuda[2], cuda[4], cuda[5],
                                          index_scale=cuda[3])
    fin = torch.isfinite(want_logits)
    assert torch.equal(torch.isfinite(got_logits.cpu()), fin)
    if fmt == "fp8":
        # The e4m3 wgmma accumulates with fewer bits than fp32 (~2^-13 a k32 step, 4 steps for
        # D 128): within 2e-3 of each logit's magnitude, the same sum over |w|, |q| and |k|.
        absolute = [q.float().abs().to(q.dtype), w.abs(), cache.float().abs().to(cache.dtype)]
        mag = torch_mla.indexer_logits(*absolute, table, L, index_scale=scale)[fin]
        err = (got_logits.cpu()[fin] - want_logits[fin]).abs()
        assert (err <= 2e-3 * mag + 1e-5).all(), float((err / (2e-3 * mag + 1e-5)).max())
    else:
        # (bf16 products summed in float32 in another order, by the kernel or the GPU's matmuls)
        torch.testing.assert_close(got_logits.cpu()[fin], want_logits[fin], atol=1e-3,
                                   rtol=1e-3)
    idx = torch_mla.indexer_topk(cuda[0], cuda[1], cuda[2], cuda[4], cuda[5], 2048,
                                 index_scale=cuda[3])
    # The selection is a top-k of the logits it was made from: fp64's for bf16 keys; for e4m3
    # keys the kernel's own (checked above), whose rounding reorders logits closer than 2e-3 of
    # their magnitude (seen on the H200: neighbours 0.3% apart swapped).
    order = (logits_fp64(q, w, cache, scale, table, L) if fmt == "bf16"
             else got_logits.cpu().double())
    check_selection(idx.cpu(), order, table, L, 2048)


@pytest.mark.cuda
def test_gpu_cuda_graph_replays_new_queries_and_lengths():
    q, w, cache, scale, table, L = [None if t is None else t.cuda()
                                    for t in op_args("bf16", lens=(200, 128), s_q=1, heads=8)]
    from torch_mla.testing import capture_graph

    static = [q.clone(), w.clone(), L.clone()]
    g, out = capture_graph(lambda q, w, L: torch_mla.indexer_topk(q, w, cache, table, L, 32),
                           static)
    for lens in ((150, 128), (1, 64), (128, 2)):  # (within the lengths the cache holds keys for)
        static[0].copy_(torch.randn(q.shape, device="cuda").bfloat16())
        static[1].copy_(torch.randn(w.shape, device="cuda"))
        static[2].copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        args = [t.cpu() for t in (static[0], static[1], cache)] + [None] + \
            [t.cpu() for t in (table, static[2])]
        check_selection(out.cpu(), logits_fp64(*args), table.cpu(), static[2].cpu(), 32)
