"""The DSA indexer's logits kernel (cute_kernels/sm90_indexer.py, launched by
torch_mla.ops.indexer_kernel) on an SM90 GPU against a plain-torch fp32 loop: V3.2's shapes (H 64,
D 128, s_q 1-2) and small models' (H 8-32, D 64), bf16 and e4m3 caches, lengths at page edges
(0, 1, 63, 64, 65, long), fewer keys than query tokens, CTAs of 1..many pages (the pipeline's
stages wrapping), pages past the keys (-inf), scattered block tables. What must not be read is
poisoned: NaN in every cache row past a request's length (and in unused pages, with NaN scales),
huge ids in block-table entries past it. Plus CUDA-graph replays with new data, and (CPU) the
kernel's limits and its split heuristic."""

import math

import pytest
import torch
from expecttest import assert_expected_inline

from torch_mla.contract import indexer_unsupported
from torch_mla.scheduling import IndexerSplit

PAGE = 64
HUGE_ID = 2**30  # a block id far past any cache: reading it would fault or return garbage
E4M3_MAX = 448.0


def logits_fp32(q, weights, cache, scale, block_table, seqlens, max_len):
    """The oracle, on CPU in float32: logits[r, t, j] = sum_h w[r, t, h] relu(q[r, t, h] . k_j)
    for j < L_r - s_q + t + 1, else -inf; k_j = cache row (times its scale for e4m3). Also
    the magnitude sum_h |w| sum_d |q k| of each logit, which bounds its rounding error."""
    b, s_q, H, D = q.shape
    out = torch.full((b, s_q, max_len), -math.inf)
    mag = torch.zeros(b, s_q, max_len)
    for r in range(b):
        L = int(seqlens[r])
        pages = block_table[r, :-(-L // PAGE)].long()
        keys = cache[pages].reshape(-1, D)[:L].float()
        if scale is not None:
            keys = keys * scale[pages].reshape(-1)[:L, None]
        qr, wr = q[r].float(), weights[r].float()
        logits = torch.einsum("th,thj->tj", wr, torch.einsum("thd,jd->thj", qr, keys).relu())
        m = torch.einsum("th,thj->tj", wr.abs(), torch.einsum("thd,jd->thj", qr.abs(),
                                                               keys.abs()))
        for t in range(s_q):
            n = max(L - s_q + t + 1, 0)
            out[r, t, :n] = logits[t, :n]
            mag[r, t, :n] = m[t, :n]
    return out, mag


def make_case(b, s_q, H, D, lengths, fp8=False, extra_pages=1, device="cuda", exact=True):
    """Random inputs for lengths (one per request); a scattered block table of the pages each
    request needs, HUGE_ID past them; NaN in every cache row no length covers (and their
    scales); out of width max_len = (pages of the longest + extra_pages) * 64.

    e4m3 with exact: q and keys small integers, scales powers of two, so that every dot product
    is exact in the e4m3 wgmma's accumulator (fewer bits than fp32: DeepSeek-V3's report says
    ~14; here sums stay below 2^11) and the tolerance can be fp32's; else randn data,
    quantized per token (scale amax / 448)."""
    need = [-(-L // PAGE) for L in lengths]
    max_pages = max(need) + extra_pages
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks)
    table = torch.full((b, max_pages), HUGE_ID, dtype=torch.int32)
    used = torch.zeros(num_blocks, PAGE, dtype=torch.bool)
    k = 0
    for r, n in enumerate(need):
        table[r, :n] = perm[k:k + n].int()
        for p in range(n):
            used[perm[k + p], :max(0, min(PAGE, lengths[r] - p * PAGE))] = True
        k += n
    keys = torch.randn(num_blocks, PAGE, D)
    q = torch.randn(b, s_q, H, D)
    scale = None
    if fp8 and exact:
        scale = 2.0 ** torch.randint(-8, -3, (num_blocks, PAGE)).float()
        keys = torch.randint(-4, 5, keys.shape).float().to(torch.float8_e4m3fn)
        q = torch.randint(-4, 5, q.shape).float().to(torch.float8_e4m3fn)
    elif fp8:
        scale = keys.abs().amax(-1) / E4M3_MAX  # one per token, >= 0
        keys = (keys / scale[..., None]).to(torch.float8_e4m3fn)
        q = (q * 8).to(torch.float8_e4m3fn)
    if fp8:
        keys.view(torch.uint8)[~used] = 0x7F  # e4m3fn NaN
        scale[~used] = math.nan
    else:
        keys, q = keys.bfloat16(), q.bfloat16()
        keys[~used] = math.nan
    weights = torch.randn(b, s_q, H) / math.sqrt(H)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    args = [q, weights, keys, scale, table, seqlens]
    return [None if t is None else t.to(device) for t in args], max_pages * PAGE


def assert_logits(got, args, max_len, rel=1e-4):
    """got (the kernel's out) against the oracle on args: masked logits exactly -inf, the
    others finite (no NaN leaks from poisoned rows) and within rel of their magnitude: fp32
    sums of exact products differ by order only (at most ~(D + H) * 2^-24 of it; rel leaves
    room for the tensor cores' own accumulation, while a wrong key, head, weight or scale is
    off by a good fraction of the magnitude)."""
    ref, mag = logits_fp32(*[None if t is None else t.cpu() for t in args], max_len)
    got = got.cpu()
    masked = ref == -math.inf
    assert torch.equal(got == -math.inf, masked), (got == -math.inf).ne(masked).nonzero()[:8]
    assert torch.isfinite(got[~masked]).all()
    err = (got - ref).abs()[~masked]
    bound = rel * mag[~masked] + 1e-5
    assert (err <= bound).all(), f"worst error / bound {float((err / bound).max()):.3g}"


def check(args, max_len, pages_per_cta=None, rel=1e-4):
    from torch_mla.ops.indexer_kernel import indexer_kernel_unsupported, indexer_logits_sm90

    q = args[0]
    # (a value no logit takes: an element the kernel leaves unwritten fails)
    out = torch.full((q.shape[0], q.shape[1], max_len), 12345.0, device=q.device)
    assert indexer_kernel_unsupported(*args, out) is None
    assert indexer_logits_sm90(*args, out, pages_per_cta=pages_per_cta) is out
    assert_logits(out, args, max_len, rel)


cuda = pytest.mark.cuda


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the indexer kernel needs an SM90 GPU")


@cuda
@needs_sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("s_q", [1, 2])
def test_v32_shapes(fp8, s_q):
    # H 64, D 128; lengths at the page edges, one long; extra pages of -inf past the longest
    args, max_len = make_case(7, s_q, 64, 128, [0, 1, 63, 64, 65, 2, 3000], fp8, extra_pages=3)
    check(args, max_len)


@cuda
@needs_sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("H,D,s_q", [(8, 64, 1), (16, 64, 2), (32, 128, 4), (8, 128, 16),
                                     (64, 64, 2)])
def test_small_models(fp8, H, D, s_q):
    args, max_len = make_case(3, s_q, H, D, [s_q + 200, 5, 129], fp8)
    check(args, max_len)


@cuda
@needs_sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("pages_per_cta", [1, 2, 3, 5, 17, 64])
def test_pages_per_cta(fp8, pages_per_cta):
    # 40 pages: CTAs of an odd and an even number of pages, each warpgroup's stages wrapping
    # (4 stages in bf16 D 128, 8 in e4m3), a CTA's last pages past the keys.
    args, max_len = make_case(2, 2, 64, 128, [40 * PAGE - 7, 19 * PAGE], fp8, extra_pages=2)
    check(args, max_len, pages_per_cta)


@cuda
@needs_sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_long_context_and_batch(fp8):
    # the heuristic's split for a 32k row, and a batch of 64 random lengths
    args, max_len = make_case(1, 2, 64, 128, [32768], fp8)
    check(args, max_len)
    lengths = torch.randint(0, 5000, (64,)).tolist()
    args, max_len = make_case(64, 1, 64, 128, lengths, fp8)
    check(args, max_len)


@cuda
@needs_sm90
@pytest.mark.parametrize("s_q", [1, 2])
def test_e4m3_quantized_randn(s_q):
    # real-valued keys quantized per token: the e4m3 wgmma rounds (~14 accumulator bits), so
    # 2e-3 of the magnitude (4 k32 steps of 2^-13 each, with room)
    args, max_len = make_case(3, s_q, 64, 128, [5000, 64, 333], True, exact=False)
    check(args, max_len, rel=2e-3)


@cuda
@needs_sm90
def test_fewer_keys_than_tokens_and_empty():
    # L < s_q: token t sees keys < L - s_q + t + 1, none for the first ones
    args, max_len = make_case(3, 4, 16, 64, [1, 3, 0])
    check(args, max_len)


@cuda
@needs_sm90
def test_strided_inputs():
    args, max_len = make_case(2, 2, 64, 128, [300, 77])
    q, w = args[0], args[1]
    big = torch.zeros(2, 2, 64, 256, dtype=q.dtype, device=q.device)
    big[..., 64:192] = q
    args[0] = big[..., 64:192]  # rows 512 bytes apart (TMA takes them as they are)
    args[1] = torch.zeros(2, 2, 128, device=w.device)[..., ::2].copy_(w)  # copied
    check(args, max_len)


@cuda
@needs_sm90
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
def test_cuda_graph_replays_new_data(fp8):
    from torch_mla.ops.indexer_kernel import indexer_logits_sm90

    # The captured launch is replayed over new values of the same tensors: q, weights, the
    # cache and its scales, a new block table and new lengths.
    args, max_len = make_case(4, 2, 64, 128, [2000] * 4, fp8)
    out = torch.empty(4, 2, max_len, device="cuda")
    indexer_logits_sm90(*args, out)  # compiled and loaded outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        indexer_logits_sm90(*args, out)
    for _ in range(3):
        new, _ = make_case(4, 2, 64, 128, [2000] * 4, fp8)  # the same shapes
        new[5] = torch.randint(0, 2001, (4,), dtype=torch.int32, device="cuda")
        for dst, src in zip(args, new):
            if dst is not None:
                dst.copy_(src)
        out.fill_(12345.0)
        g.replay()
        torch.cuda.synchronize()
        assert_logits(out, args, max_len)


# --- CPU: the limits and the split ----------------------------------------------------------


def test_limits_messages():
    assert indexer_unsupported(128, 64, 2) is None
    assert indexer_unsupported(64, 8, 16) is None
    assert_expected_inline(str(indexer_unsupported(96, 64, 1)),
                           """the indexer kernel takes head_dim 64 or 128, got 96""")
    assert_expected_inline(str(indexer_unsupported(128, 12, 1)),
                           """the indexer kernel takes a multiple of 8 heads, got 12""")
    assert_expected_inline(str(indexer_unsupported(128, 64, 3)),
                           """the indexer kernel takes s_q * heads <= 128, got s_q 3 x 64 heads""")


@pytest.mark.parametrize("batch", [1, 2, 8, 64, 128])
@pytest.mark.parametrize("n_pages", [1, 64, 512, 2048])
def test_split_fills_the_gpu_in_full_rounds(batch, n_pages):
    c = IndexerSplit.from_heuristic(batch, n_pages, 132).pages_per_cta
    ctas = batch * -(-n_pages // c)
    slots = IndexerSplit.CTAS_PER_SM * 132
    if batch * n_pages <= slots:
        assert c == 1  # a CTA a page: all the parallelism there is
    else:  # the last round of CTAs nearly full
        assert ctas / (-(-ctas // slots) * slots) >= 0.9, (c, ctas)
