"""Plain-PyTorch lightning indexer (DeepSeek-V3.2's DSA): the CPU path and the oracle.

At every step each query token scores every cached token with the indexer's own small query
(``H`` heads of ``D``) against one index key per token (``D`` wide, cached beside the latents, on
the same pages):

    logits[b, t, j] = sum_h w[b, t, h] * relu(q[b, t, h] . k_j)          (* k_scale_j for FP8)

for the positions j a query token sees (``j < L_b - s_q + t + 1``: causal among this step's
``s_q`` tokens, L_b the request's length including them), -inf beyond. ``w`` already carries the
indexer's ``softmax_scale`` and ``n_heads ** -0.5`` (and, for an FP8 q, its scale). The query
token then attends (``torch_mla.mla_decode_sparse``) to the ``topk`` positions of largest logit,
named by their cache slots.

The index-key cache, per layer, on the latent cache's pages (block table and slots shared):

    index_cache  [num_blocks, 64, D]  bf16 / fp16 / fp32, or float8_e4m3fn with
    index_scale  [num_blocks, 64]     float32, one scale per token: key = e4m3 * scale

FP8 keys are quantized per token as DeepSeek-V3.2's inference code does (``act_quant`` with
``scale_fmt="ue8m0"``, one block of 128 = index_head_dim values): ``amax`` floored at 1e-4, the
scale ``amax / 448`` rounded *up* to a power of two (only an exponent: ``e4m3 * scale`` is exact
in any float format, and rounding up keeps every ``k / scale`` within +-448), values saturated
to +-448 and rounded to nearest even. Queries are quantized the same way per (token, head), their
scale folded into ``w`` (DeepSeek's ``weights * q_scale``). DeepSeek rotates q and k by a
Hadamard transform before quantizing (orthogonal: the products are unchanged, the outliers
spread over the whole vector); torch_mla.modules does the same.

Everything is computed in float32 from the stored values. Written to be obviously right: keys are
gathered through the block table a chunk of pages at a time, keys past a request's length are
zeroed before any product (garbage, even NaN, there cannot leak) and their logits set to -inf,
block-table entries past a request's pages are never read.
"""

from __future__ import annotations

import math

import torch

from .reference import FP8, FP8_MAX, PAGE_SIZE, visible_lengths

# DeepSeek's act_quant floors a block's amax here before dividing by 448: an all-zero key gets a
# finite scale (and zeros), not 0 / 0.
INDEX_MIN_AMAX = 1e-4


def index_scales(x: torch.Tensor) -> torch.Tensor:
    """float32 [...]: the power-of-two scale of each row of x [..., D] (DeepSeek's ue8m0
    act_quant): ``2 ** ceil(log2(max(amax, 1e-4) / 448))``.

    Through frexp, not log2: ``ceil(log2(x))`` in float32 rounds values just above a power of two
    down onto it, and then ``k / scale`` would pass 448 (DeepSeek's kernel reads the exponent
    bits, as frexp does)."""
    amax = x.float().abs().amax(dim=-1).clamp_min(INDEX_MIN_AMAX) / FP8_MAX
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2 ** exponent, mantissa in [.5, 1)
    # ceil(log2(amax)) is exponent, or exponent - 1 when amax is a power of two (mantissa 0.5).
    return torch.where(mantissa == 0.5, amax, torch.ldexp(torch.ones_like(amax), exponent))


def quantize_index_keys(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 quantization of index keys or queries x [..., D] (any float dtype):
    ``(float8_e4m3fn [..., D], float32 scale [...])`` with ``x ~ e4m3 * scale``, scale from
    :func:`index_scales`, values saturated to +-448 and rounded to nearest even. NaN stays NaN."""
    scale = index_scales(x)
    return (x.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_index_keys(keys: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 [..., D]: ``keys.float() * scale[..., None]`` (scale None: keys.float())."""
    return keys.float() if scale is None else keys.float() * scale[..., None]


def indexer_logits_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    index_scale: torch.Tensor | None = None,
    pages_per_chunk: int | None = None,
) -> torch.Tensor:
    """Reference indexer logits; arguments as in :func:`torch_mla.indexer_logits` (validated).

    q [b, s_q, H, D] (float8_e4m3fn for an FP8 cache: its scale is in ``weights``); weights
    float32 [b, s_q, H]; index_cache [num_blocks, page, D] (with index_scale float32
    [num_blocks, page] when float8_e4m3fn); block_table int32 [b, max_blocks]; cache_seqlens
    int32 [b] (including this step's s_q tokens).

    Returns float32 [b, s_q, max_blocks * page]: ``sum_h w[h] * relu(q[h] . k_j)`` for
    ``j < cache_seqlens[b] - s_q + t + 1``, -inf elsewhere. Walks every column of the block
    table (no host sync: CUDA-graph capturable), ``pages_per_chunk`` pages at a time (default:
    as many as keep a chunk's float32 keys and [b, s_q, H, keys] products within 2^25 values
    each, 128 MiB: at DeepSeek-V3.2's 64 heads x 128 a whole 131072-token context at batch 1,
    128 pages at batch 32; a GPU without the logits kernel then runs a few dozen kernels a
    layer, not thousands).
    """
    b, s_q, H, D = q.shape
    page = index_cache.shape[1]
    width = block_table.shape[1] if index_cache.shape[0] > 0 else 0
    if pages_per_chunk is None:
        pages_per_chunk = max(1, (1 << 25) // (max(b, 1) * page * max(s_q * H, D)))
    out = torch.full((b, s_q, block_table.shape[1] * page), -math.inf, dtype=torch.float32,
                     device=q.device)
    lens = cache_seqlens.to(torch.int64)
    horizon = visible_lengths(cache_seqlens, s_q, causal=True)  # [b, s_q]
    qf, w = q.float(), weights.float()
    for c0 in range(0, width, pages_per_chunk):
        c1 = min(width, c0 + pages_per_chunk)
        pos = torch.arange(c0 * page, c1 * page, device=q.device)  # (keys,)
        # Unused table entries may hold any id: read page 0 instead and zero its keys.
        used = torch.arange(c0, c1, device=q.device)[None, :] * page < lens[:, None]
        ids = torch.where(used, block_table[:, c0:c1].to(torch.int64), 0)
        keys = dequantize_index_keys(index_cache[ids], None if index_scale is None
                                     else index_scale[ids]).view(b, -1, D)  # (b, keys, D)
        keys = torch.where(pos[None, :, None] < lens[:, None, None], keys, 0.0)
        dots = torch.einsum("bthd,bkd->bthk", qf, keys).relu()
        logits = torch.einsum("bth,bthk->btk", w, dots)
        out[:, :, c0 * page:c1 * page] = logits.masked_fill(pos >= horizon[..., None], -math.inf)
    return out


def slots_of_positions(block_table: torch.Tensor, positions: torch.Tensor,
                       page: int = PAGE_SIZE) -> torch.Tensor:
    """int64 cache slots ``block_table[b, j // page] * page + j % page`` of positions j (int64
    [b, ...], each in [0, max_blocks * page)): mla_decode_sparse's slot convention."""
    b = block_table.shape[0]
    flat = positions.reshape(b, -1)
    pages = torch.gather(block_table.to(torch.int64), 1, flat // page)
    return (pages * page + flat % page).view(positions.shape)


def topk_slots_reference(logits: torch.Tensor, block_table: torch.Tensor,
                         cache_seqlens: torch.Tensor, topk: int) -> torch.Tensor:
    """The ``topk`` positions of largest logit of each query token, as cache slots.

    logits float32 [b, s_q, max_blocks * page] as :func:`indexer_logits_reference` returns
    them. Returns int32 [b, s_q, topk]: the slots in descending logit order, -1 for the entries
    past the positions the token sees (fewer than topk of them), by a full sort: the oracle of
    :func:`torch_mla.indexer_topk`'s selection."""
    b, s_q, n = logits.shape
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :topk]
    horizon = visible_lengths(cache_seqlens, s_q, causal=True)  # [b, s_q]
    slots = torch.where(order < horizon[..., None], slots_of_positions(block_table, order), -1)
    if slots.shape[-1] < topk:
        slots = torch.nn.functional.pad(slots, (0, topk - slots.shape[-1]), value=-1)
    return slots.to(torch.int32)
