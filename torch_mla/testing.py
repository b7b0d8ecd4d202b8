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
    kv_cache: torch.Tensor  # [num_blocks, 64, 1, d_qk]
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
) -> DecodeInputs:
    """Fresh random decode inputs; each request gets its own pages in a shuffled order.

    ``max_blocks`` (block-table width) and ``num_blocks`` (cache pages) default to just enough.

    With ``poison``, every cache slot past a request's length is NaN (spare pages too) and every
    unused block-table entry is a huge id, so a kernel that reads what it must not fails loudly.
    """
    b = len(seqlens)
    pages = [math.ceil(L / PAGE_SIZE) for L in seqlens]
    max_blocks = max_blocks or max([1, *pages]) + extra_blocks
    num_blocks = num_blocks or sum(pages) + extra_blocks
    assert max_blocks >= max([0, *pages]) and num_blocks >= sum(pages)
    g = generator
    q = torch.randn(b, s_q, h_q, d_qk, generator=g) / 10
    cache = torch.randn(num_blocks, PAGE_SIZE, 1, d_qk, generator=g) / 10
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((b, max_blocks), POISON_BLOCK_ID if poison else 0, dtype=torch.int32)
    used = torch.zeros(num_blocks, dtype=torch.bool)
    k = 0
    for r, (L, n) in enumerate(zip(seqlens, pages)):
        ids = perm[k : k + n]
        k += n
        table[r, :n] = ids.to(torch.int32)
        used[ids] = True
        if poison and n > 0 and L % PAGE_SIZE:
            cache[ids[-1], L % PAGE_SIZE :] = float("nan")
    if poison:
        cache[~used] = float("nan")
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
