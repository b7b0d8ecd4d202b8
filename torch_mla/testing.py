"""What the tests, the benchmarks and the tools share: input builders, tolerances, an
independent float64 oracle, CUDA-graph timing and the FlashMLA peer.

Importable without a GPU, the DSL or triton (those are imported inside the functions that need
them). It imports nothing of torch_mla's ops at module level or in its functions (the ops'
first-use check uses its builders); the internal hooks the tools need live in
torch_mla/devtools.py.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from types import ModuleType

import torch

from .constants import D_V, PAGE_SIZE

POISON_BLOCK_ID = 2**30  # an id far past any cache: reading it faults or returns garbage


@dataclasses.dataclass
class DecodeInputs:
    q: torch.Tensor  # [b, s_q, h_q, d_qk]
    kv_cache: torch.Tensor  # [num_blocks, 64, h_kv, d_qk]
    block_table: torch.Tensor  # int32 [b, max_blocks]
    cache_seqlens: torch.Tensor  # int32 [b]


def make_decode_inputs(
    seqlens: list[int],
    s_q: int,
    h_q: int,
    d_qk: int = 576,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    poison: bool = True,
    extra_blocks: int = 2,
    generator: torch.Generator | None = None,
    max_blocks: int | None = None,
    num_blocks: int | None = None,
    h_kv: int = 1,
) -> DecodeInputs:
    """Fresh random decode inputs; each request gets its own pages in a shuffled order.

    ``max_blocks`` (block-table width) and ``num_blocks`` (cache pages) default to just enough
    plus ``extra_blocks``. The cache is ``[num_blocks, 64, h_kv, d_qk]``.

    With ``poison``, every cache slot past a request's length is NaN (spare pages too, every KV
    head) and every unused block-table entry is a huge id, so a kernel that reads what it must
    not fails loudly.

    The data is drawn on ``generator``'s device (``device`` when there is no generator) with no
    per-page host work, so a multi-gigabyte cache builds on the GPU in milliseconds.
    """
    b = len(seqlens)
    pages = [math.ceil(L / PAGE_SIZE) for L in seqlens]
    if max_blocks is None:
        max_blocks = max([1, *pages]) + extra_blocks
    if num_blocks is None:
        num_blocks = sum(pages) + extra_blocks
    assert max_blocks >= max([0, *pages]) and num_blocks >= sum(pages)
    g = generator
    gdev = g.device if g is not None else torch.device(device)
    q = torch.randn(b, s_q, h_q, d_qk, generator=g, device=gdev).div_(10)
    cache = torch.randn(num_blocks, PAGE_SIZE, h_kv, d_qk, generator=g, device=gdev).div_(10)
    perm = torch.randperm(num_blocks, generator=g, device=gdev)
    # Request r owns perm[start_r : start_r + pages_r], in that order.
    n = torch.tensor(pages, dtype=torch.int64, device=gdev)
    start = torch.cumsum(n, 0) - n
    col = torch.arange(max_blocks, device=gdev)
    table = torch.full((b, max_blocks), POISON_BLOCK_ID if poison else 0, dtype=torch.int32,
                       device=gdev)
    if num_blocks > 0:
        own = perm[(start[:, None] + col[None, :]).clamp(max=num_blocks - 1)].to(torch.int32)
        table = torch.where(col[None, :] < n[:, None], own, table)
    if poison:
        cache[perm[sum(pages):]] = float("nan")
        tails = [(r, L % PAGE_SIZE) for r, (L, p) in enumerate(zip(seqlens, pages))
                 if p > 0 and L % PAGE_SIZE]
        if tails:
            rows = torch.tensor([r for r, _ in tails], device=gdev)
            cut = torch.tensor([c for _, c in tails], device=gdev)
            last = perm[start[rows] + n[rows] - 1]
            past = torch.arange(PAGE_SIZE, device=gdev)[None, :] >= cut[:, None]  # (tails, 64)
            cache[last] = cache[last].masked_fill(past[:, :, None, None], float("nan"))
    return DecodeInputs(
        q=q.to(dtype).to(device),
        kv_cache=cache.to(dtype).to(device),
        block_table=table.to(device),
        cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
    )


# The anchor workload's configurations (b, s_q, s_k, h_q, causal): FlashMLA's us on the H200
# (shared/anchors/h200-flashmla.json, deepseek-ai/FlashMLA 9241ae3); QUICK_ANCHORS: a few.
ANCHORS = {
    (128, 1, 4096, 128, False): 271.4,
    (128, 1, 8192, 128, False): 521.7,
    (128, 1, 16384, 128, False): 1034.3,
    (128, 1, 32768, 128, False): 2068.9,
    (128, 2, 4096, 128, True): 498.8,
    (128, 2, 8192, 128, True): 1017.6,
    (128, 2, 16384, 128, True): 2002.1,
    (128, 2, 32768, 128, True): 4121.3,
    (128, 1, 8192, 16, False): 326.1,
    (128, 1, 8192, 32, False): 330.9,
    (128, 1, 8192, 64, False): 343.0,
    (1, 1, 4096, 128, False): 31.3,
    (8, 1, 4096, 128, False): 39.0,
    (32, 1, 4096, 128, False): 77.7,
    (64, 1, 2048, 16, False): 58.9,
}
QUICK_ANCHORS = [(128, 1, 8192, 128, False), (128, 2, 8192, 128, True),
                 (128, 1, 8192, 16, False), (1, 1, 4096, 128, False), (64, 1, 2048, 16, False)]


def varlen_seqlens(b: int) -> list[int]:
    """b lengths drawn around 1500 (normal, sd 750, at least 0; seeded by b, so the same b
    gives the same batch) and, for b > 2, one of them 0: the kernel tests' varlen batches."""
    rng = random.Random(b)
    lens = [max(0, int(rng.normalvariate(1500, 750))) for _ in range(b)]
    if b > 2:
        lens[rng.randrange(b)] = 0
    return lens


def anchor_seqlens(b: int, s_k: int, s_q: int) -> list[int]:
    """FlashMLA's dense-decoding test lengths: ``max(int(normalvariate(s_k, s_k / 2)), s_q)``."""
    random.seed(0)
    return [max(int(random.normalvariate(s_k, s_k / 2)), s_q) for _ in range(b)]


def make_anchor_inputs(b: int, s_q: int, h_q: int, s_k: int, dtype=torch.bfloat16,
                       device="cuda") -> DecodeInputs:
    """The workload of shared/anchors/README.md (FlashMLA's test): each request padded to a
    multiple of 256 tokens, block table a random permutation of all blocks, values clamped."""
    seqlens = anchor_seqlens(b, s_k, s_q)
    max_len = max(seqlens)
    max_len_pad = -(-max_len // 256) * 256
    blocks_per_req = max_len_pad // PAGE_SIZE
    q = (torch.randn(b, s_q, h_q, 576, device=device) / 10).clamp(-1, 1).to(dtype)
    table = torch.randperm(b * blocks_per_req, device=device, dtype=torch.int32).view(b, -1)
    cache = (torch.randn(b * blocks_per_req, PAGE_SIZE, 1, 576, device=device) / 10)
    cache = cache.clamp(-1, 1).to(dtype)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    return DecodeInputs(q, cache, table, lens)


@dataclasses.dataclass
class Fp8CodeCase:
    """Inputs whose exact output is known: see :func:`make_fp8_code_case`."""

    q: torch.Tensor  # [1, 2, 128, 576], bf16/fp16, or float8_e4m3fn with q_scale
    kv_cache: torch.Tensor  # float8_e4m3fn [5, 64, 1, 576]
    block_table: torch.Tensor  # int32 [1, 6]
    cache_seqlens: torch.Tensor  # int32 [1], 256
    kv_scale: torch.Tensor  # float32 [1]
    q_scale: torch.Tensor | None  # float32 [1] for an e4m3 q
    out: torch.Tensor  # [1, 2, 128, 512] float32: the exact output (softmax_scale=1)
    lse: float  # every row's lse


def make_fp8_code_case(q_dtype: torch.dtype, device: str | torch.device = "cpu",
                       seed: int = 0) -> Fp8CodeCase:
    """An FP8-cache decode whose exact output is each query row's own key's V: a bit-exact
    check of a kernel's e4m3 -> 16-bit conversion of every value (every code at every row and
    column position of the pages) through the whole kernel.

    One request of 256 keys (4 pages, shuffled; a spare NaN page and huge ids after them),
    s_q 2 x h_q 128 = 256 query rows, causal off, softmax_scale 1. Query row j (= s * 128 + h)
    and key j share a RoPE signature: key j holds +-448 (sign: bit 5 of j) at RoPE column
    j % 32 and 448 at RoPE column 32 + j // 64, zeros elsewhere; q row j holds the same pattern
    with 16 in place of 448 (8 with q_scale 2 for an e4m3 q). Row j's score is 2 * 448 * 16 on
    key j and at most half of that on any other key, so the softmax is exactly one-hot (the
    others underflow to 0) and out[j] = V[key j] * kv_scale exactly (kv_scale = 1/8: exact in
    bf16 and fp16). V columns hold random finite e4m3 codes (NaN codes 0x7f/0xff excluded:
    q's zero columns times NaN would poison the scores)."""
    g = torch.Generator().manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    keys = torch.arange(256)
    codes = torch.randint(0, 256, (4, PAGE_SIZE, 1, 576), generator=g, dtype=torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    codes[..., 512:] = 0
    pos, neg = 0x7E, 0xFE  # +448, -448
    flat = codes.view(256, 576)
    flat[keys, 512 + keys % 32] = torch.where((keys >> 5) % 2 == 0, pos, neg).to(torch.uint8)
    flat[keys, 544 + keys // 64] = pos
    order = torch.tensor([3, 0, 2, 1])  # page j // 64 of the request lives in block order[j]
    cache = torch.full((5, PAGE_SIZE, 1, 576), 0x7F, dtype=torch.uint8)  # block 4: NaN
    cache[order] = codes
    table = torch.tensor([[*order.tolist(), POISON_BLOCK_ID, POISON_BLOCK_ID]], dtype=torch.int32)
    kv_scale = torch.tensor([0.125])
    q = torch.zeros(256, 576)
    q[keys, 512 + keys % 32] = torch.where((keys >> 5) % 2 == 0, 16.0, -16.0)
    q[keys, 544 + keys // 64] = 16.0
    q = q.view(1, 2, 128, 576)
    q_scale = None
    if q_dtype == fp8:
        q_scale = torch.tensor([2.0])
        q = (q / 2).to(fp8)
    else:
        q = q.to(q_dtype)
    out = (flat.view(fp8).float()[:, :512] * kv_scale).view(1, 2, 128, 512)
    dev = torch.device(device)
    return Fp8CodeCase(q.to(dev), cache.view(fp8).to(dev), table.to(dev),
                       torch.tensor([256], dtype=torch.int32, device=dev), kv_scale.to(dev),
                       None if q_scale is None else q_scale.to(dev), out.to(dev),
                       2 * 448 * 16 * 0.125)


def capture_graph(fn, static: list[torch.Tensor]):
    """Captures ``fn(*static)`` in a CUDA graph after one warm-up call on a side stream (which
    compiles and allocates outside the capture). Returns ``(graph, outputs)``: copy new values
    into ``static`` in place, then ``graph.replay()`` rewrites ``outputs``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*[t.clone() for t in static])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*static)
    return graph, outputs


# Tolerances of a 16-bit decode against the fp32 reference (tests/test_kernel_sm90.py): the
# kernels round P to the input dtype before P @ V (as FlashMLA does); FlashMLA's own test allows
# |err| <= 8e-4 + 2/128 |ref| in bf16. LSE is fp32. Pairs (atol, rtol).
DECODE_TOL = {torch.bfloat16: (8e-4, 2.01 / 128), torch.float16: (4e-4, 3e-3)}
LSE_TOL = (1e-4, 1e-4)


def decode_errors(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor,
                  ref_lse: torch.Tensor, dtype: torch.dtype) -> tuple[float, float, bool]:
    """How far a decode is from the reference, as fractions of :data:`DECODE_TOL` and
    :data:`LSE_TOL` (<= 1 passes): (worst |out - ref| / tol, worst lse error / tol (inf where
    the non-finite entries differ), any NaN in out). out/ref_out [b, s_q, h_q, d_v], lse/ref_lse
    float32 [b, h_q, s_q]."""
    atol, rtol = DECODE_TOL[dtype]
    o, r = out.float(), ref_out.float()
    ratio = ((o - r).abs() / (atol + rtol * r.abs())).max().item() if o.numel() else 0.0
    fin = torch.isfinite(ref_lse)
    lse_ok = torch.equal(torch.isfinite(lse), fin) and torch.equal(lse[~fin], ref_lse[~fin])
    lse_ratio = 0.0
    if fin.any():
        lse_err = (lse[fin] - ref_lse[fin]).abs().max().item()
        lse_ratio = lse_err / (LSE_TOL[0] + LSE_TOL[1] * ref_lse[fin].abs().max().item())
    return ratio, (lse_ratio if lse_ok else float("inf")), bool(out.isnan().any())


def mla_decode_fp64(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    cache_seqlens: torch.Tensor, softmax_scale: float, causal: bool,
                    d_v: int = D_V) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent float64 MLA decode, one request at a time (no code shared with
    torch_mla.reference). q [b, s_q, h_q, d_qk], kv_cache [num_blocks, 64, h_kv, d_qk] (any
    float dtype; only the pages a request uses are read), block_table int32 [b, max_blocks],
    cache_seqlens int32 [b]. Query heads ``k * h_q // h_kv .. (k + 1) * h_q // h_kv - 1`` read
    KV head k (FlashMLA's grouping). Returns float64 out [b, s_q, h_q, d_v] and lse
    [b, h_q, s_q] (+inf and a zero row where a query token sees no key)."""
    b, s_q, h_q, d_qk = q.shape
    h_kv = kv_cache.shape[2]
    heads = torch.arange(h_q) // (h_q // h_kv)
    out = torch.zeros(b, s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    q = q.detach().cpu().double()
    for r in range(b):
        L = int(cache_seqlens[r])
        ids = block_table[r, : -(-L // PAGE_SIZE)].long().cpu()
        pages = kv_cache[ids.to(kv_cache.device)].detach().cpu().double()
        keys = pages.reshape(-1, h_kv, d_qk)[:L, heads]  # (L, h_q, d_qk)
        for i in range(s_q):
            n = max(L - s_q + i + 1, 0) if causal else L
            if n == 0:
                continue
            s = torch.einsum("hd,nhd->hn", q[r, i], keys[:n]) * softmax_scale
            lse[r, :, i] = torch.logsumexp(s, dim=-1)
            out[r, i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), keys[:n, :, :d_v])
    return out, lse


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, 16/32-bit; NaN poison kept as NaN codes) in float8_e4m3fn with one scale,
    amax / 448 over its finite values, as the benchmarks quantize a cache: (codes, float32 [1]
    kv_scale on x's device)."""
    from .reference import quantize_fp8

    scale = (x.float().nan_to_num(0).abs().amax() / 448).reshape(1)
    return quantize_fp8(x, scale), scale


def parse_config(text: str) -> tuple[int, int, int, int]:
    """"B,S_Q,S_K,H_Q" (the tools' and benchmarks' configuration argument) as four ints."""
    dims = tuple(int(x) for x in text.split(","))
    if len(dims) != 4:
        raise ValueError(f"{text!r}: expected B,S_Q,S_K,H_Q")
    return dims


# Timing ------------------------------------------------------------------------------------


def graph_time_us(fn: Callable[[], object]) -> float:
    """Microseconds per call of ``fn`` (no arguments; it launches GPU work), the anchors'
    method: one call to compile and warm up, one on a side stream, then a CUDA graph of one
    call replayed under triton.testing.do_bench(warmup=50, rep=300), median."""
    import triton.testing

    fn()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median") * 1e3


def measure_ceilings(copy_mib: int = 1024, n: int = 8192) -> tuple[float, float]:
    """(GB/s, TFLOP/s): this GPU's practical ceilings, measured as shared/anchors/README.md
    measured the H200's (4246 GB/s, 679 TFLOP/s): a device-to-device copy of copy_mib MiB
    (bytes read + written) and a bf16 n x n x n torch matmul, each under
    triton.testing.do_bench, median. A benchmark's "% of the ceiling" then means this GPU's."""
    import triton.testing

    src = torch.empty(copy_mib << 20, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200,
                                 return_mode="median")
    copy_gbps = 2 * src.numel() / ms / 1e6
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return copy_gbps, 2 * n**3 / ms / 1e9


# The FlashMLA peer -------------------------------------------------------------------------


def load_flash_mla() -> ModuleType | None:
    """FlashMLA's ``flash_mla`` package when it imports, else None. It is never a dependency:
    on the GPU machine a build of it is put on PYTHONPATH (shared/anchors/flashmla-sm90)."""
    try:
        import flash_mla
    except (ImportError, OSError):  # (OSError: an extension built for another torch)
        return None
    return flash_mla


def flash_mla_decode(flash_mla: ModuleType, inp: DecodeInputs,
                     causal: bool) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """FlashMLA's decode of ``inp`` (bf16/fp16, d_v 512) as a call without arguments, for
    timing beside mla_decode. Its metadata object is filled by the first call and reused by the
    later ones (same lengths), so make the first call before a CUDA-graph capture
    (:func:`graph_time_us` does)."""
    meta, splits = flash_mla.get_mla_metadata(inp.cache_seqlens, inp.q.shape[1] * inp.q.shape[2],
                                              1)
    return lambda: flash_mla.flash_mla_with_kvcache(
        inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, D_V, meta, splits,
        causal=causal)
