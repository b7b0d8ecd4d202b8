"""Input builders shared by the tests and the benchmarks."""

from __future__ import annotations

import dataclasses
import math
import random

import torch

PAGE_SIZE = 64
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
