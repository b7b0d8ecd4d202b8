"""Plain-PyTorch sparse MLA decode (DeepSeek Sparse Attention): the CPU path and the oracle.

Each query token attends to the cache slots its row of ``indices`` names (DeepSeek-V3.2's
indexer picks them), not to a contiguous prefix. Everything is computed in float32 from the
stored values, dequantized first for an FP8 cache. Written to be obviously right: one softmax over
a query token's gathered keys, invalid entries masked to -inf and their keys zeroed before any
product, so garbage (even NaN) in slots no valid entry names cannot leak.

The FP8 cache of DeepSeek-V3.2 ("fp8_ds_mla"), one row of 656 bytes a token, uint8
[num_blocks, page_size, 1, 656] (page_size 64 in torch_mla's caches):

    bytes   0 .. 511   512 float8_e4m3fn values: the latent (the "NoPE" part), quantized
    bytes 512 .. 527   4 float32 scales, little-endian: scale t covers values 128 t .. 128 t + 127
    bytes 528 .. 655   64 bfloat16 values: the RoPE key, not quantized

A row stands for ``[e4m3[0:512] * scale[tile] | rope]``, 576 values (d_qk).
"""

from __future__ import annotations

import math

import torch

from .constants import (
    FP8_DS_MLA_ROPE_AT,
    FP8_DS_MLA_SCALES_AT,
    FP8_NUM_TILES,
    FP8_TILE,
)
from .reference import FP8, FP8_MAX, dequantize_fp8

# DeepSeek's quantizer floors a tile's scale here (FlashMLA tests/quant.py), so an all-zero tile
# gets a finite scale and zeros, not 0 / 0.
FP8_DS_MLA_MIN_SCALE = 1e-4


def fp8_ds_mla_scales(kv_c: torch.Tensor) -> torch.Tensor:
    """The 4 tile scales DeepSeek's quantizer gives a latent: float32 [..., 4] for kv_c [..., 512].

    Per tile of 128 values, ``amax / 448`` (448: e4m3fn's largest finite value), floored at 1e-4,
    then rounded *up* to a power of two (a "UE8M0" scale: only the exponent is kept). As
    FlashMLA's tests/quant.py (DeepSeek's reference for this layout). Rounding up keeps every
    ``value / scale`` within +-448; a power of two makes ``e4m3 * scale`` exact in bf16.
    """
    amax = kv_c.float().unflatten(-1, (FP8_NUM_TILES, FP8_TILE)).abs().amax(dim=-1)
    return torch.exp2(torch.ceil(torch.log2((amax / FP8_MAX).clamp_min(FP8_DS_MLA_MIN_SCALE))))


def quantize_fp8_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """Packs latents into DeepSeek-V3.2's 656-byte FP8 rows (layout in the module docstring).

    Args:
        kv_c: [..., 512] (any float dtype), the compressed latents.
        k_pe: [..., 64] (any float dtype), the RoPE keys; stored as bf16.

    Returns:
        uint8 [..., 656]: value v of tile t is stored as ``(v / scale_t)`` rounded to the nearest
        float8_e4m3fn (ties to even), scale_t from :func:`fp8_ds_mla_scales`.
    """
    scale = fp8_ds_mla_scales(kv_c)  # (..., 4)
    tiles = kv_c.float().unflatten(-1, (FP8_NUM_TILES, FP8_TILE))
    nope = (tiles / scale[..., None]).to(FP8).flatten(-2).view(torch.uint8)
    scales = scale.contiguous().view(torch.uint8)  # (..., 16)
    rope = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8)  # (..., 128)
    return torch.cat([nope, scales, rope], dim=-1)


def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """float32 [..., 576], the values 656-byte rows (uint8 [..., 656]) stand for.

    ``e4m3 * scale`` of its tile for the first 512, the bf16 RoPE values for the last 64. Any
    float32 scale is read as stored (vLLM's cache writer keeps ``amax / 448`` unrounded)."""
    rows = rows.contiguous()  # (whole rows: the float32 and bf16 views need aligned bytes)
    nope = rows[..., :FP8_DS_MLA_SCALES_AT].view(FP8).float()
    scales = rows[..., FP8_DS_MLA_SCALES_AT:FP8_DS_MLA_ROPE_AT].view(torch.float32)
    rope = rows[..., FP8_DS_MLA_ROPE_AT:].view(torch.bfloat16).float()
    nope = nope.unflatten(-1, (FP8_NUM_TILES, FP8_TILE)) * scales[..., None]
    return torch.cat([nope.flatten(-2), rope], dim=-1)


def gather_slots(kv_cache: torch.Tensor, slots: torch.Tensor,
                 kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [..., d_qk]: the latents of cache slots ``slots`` (int64 [...], each in
    [0, num_blocks * page_size); slot s is page ``s // page_size``, row ``s % page_size``),
    dequantized.

    kv_cache: [num_blocks, page_size, 1, d_qk] bf16/fp16/fp32, or float8_e4m3fn with its float32
    [1] ``kv_scale``, or uint8 [num_blocks, page_size, 1, 656] (the 656-byte layout). Any
    strides."""
    page_size = kv_cache.shape[1]
    rows = kv_cache[slots // page_size, slots % page_size, 0]
    if kv_cache.dtype == torch.uint8:
        return dequantize_fp8_ds_mla(rows)
    if kv_scale is not None:
        return dequantize_fp8(rows, kv_scale)
    return rows.float()


def mla_decode_sparse_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    softmax_scale: float,
    d_v: int,
    kv_scale: torch.Tensor | None = None,
    max_keys: int = 1 << 15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference sparse MLA decode; arguments as in :func:`torch_mla.mla_decode_sparse` (already
    validated).

    q [b, s_q, h_q, d_qk]; kv_cache one of :func:`gather_slots`'s formats (h_kv = 1); indices
    int32 [b, s_q, topk]. Entry k of query token (r, i) counts when ``k < topk_length[r]`` and
    its slot is in [0, num_blocks * page_size) (-1: no token; anything else out of range is skipped
    too, so nothing is read outside the cache even with the value checks off), once per
    occurrence (a slot named twice weighs twice, as in FlashMLA's reference). attn_sink float32
    [h_q] adds ``exp(sink_h)`` to head h's softmax denominator: the output is scaled by
    ``1 / (1 + exp(sink_h - lse))``, the returned lse leaves the sink out (FlashMLA's meaning).

    Returns out [b, s_q, h_q, d_v] in q's dtype and lse float32 [b, h_q, s_q] (natural log); a
    query token with no valid entry gets out = 0 and lse = +inf, sink or not.

    Query tokens go ``max_keys // topk`` at a time (memory is one chunk's gathered keys), with
    no host synchronisation (CUDA-graph capturable).
    """
    b, s_q, h_q, d_qk = q.shape
    topk = indices.shape[2]
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    n = b * s_q
    out = torch.empty(n, h_q, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, h_q, dtype=torch.float32, device=q.device)
    idx = indices.reshape(n, topk).to(torch.int64)
    valid = (idx >= 0) & (idx < num_slots)
    if topk_length is not None:
        pos = torch.arange(topk, device=q.device)
        valid &= pos[None, :] < topk_length.repeat_interleave(s_q)[:, None]
    qf = q.reshape(n, h_q, d_qk)
    step = max(1, max_keys // max(topk, 1))
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        ok = valid[rows]  # (rows, topk)
        kv = gather_slots(kv_cache, torch.where(ok, idx[rows], 0), kv_scale)
        kv = torch.where(ok[..., None], kv, 0.0)  # (rows, topk, d_qk)
        scores = torch.einsum("nhd,nkd->nhk", qf[rows].float(), kv) * softmax_scale
        scores = scores.masked_fill(~ok[:, None, :], -math.inf)
        m = torch.logsumexp(scores, dim=-1)  # (rows, h_q); -inf: no valid entry
        empty = torch.isneginf(m)
        p = torch.exp(scores - torch.where(empty, 0.0, m)[..., None])
        o = torch.einsum("nhk,nkd->nhd", p, kv[..., :d_v])
        if attn_sink is not None:
            # exp(lse) / (exp(lse) + exp(sink)); sink = +inf gives 0, -inf leaves o as it is.
            o = o * torch.sigmoid(m - attn_sink)[..., None]
        out[rows] = torch.where(empty[..., None], 0.0, o).to(q.dtype)
        lse[rows] = torch.where(empty, math.inf, m)
    return out.view(b, s_q, h_q, d_v), lse.view(b, s_q, h_q).transpose(1, 2).contiguous()

