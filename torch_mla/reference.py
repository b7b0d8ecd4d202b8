"""Plain-PyTorch MLA decode: the CPU path and the oracle every kernel is tested against.

Everything is computed in float32 from the stored (bf16/fp16/fp32) values, or from the
dequantized ones (``fp8.float() * scale``) of a float8_e4m3fn cache or q. It is written to be
obviously right, not fast: pages are gathered through the block table, keys past each request's
length (and, with ``causal``, past each query token's horizon) are masked out, and masked values
are zeroed before the P @ V product so that garbage (even NaN) in unused cache slots cannot leak.
"""

from __future__ import annotations

import math

import torch

PAGE_SIZE = 64
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float8_e4m3fn: saturated to +-448 (e4m3fn has no infinity: an unclamped
    overflow would become NaN), then rounded to nearest even. x: any float dtype and shape;
    scale: float32 [1]. NaN stays NaN."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``x.float() * scale``: the values a float8_e4m3fn tensor x stands for."""
    return x.float() * scale


def visible_lengths(cache_seqlens: torch.Tensor, s_q: int, causal: bool) -> torch.Tensor:
    """Number of keys each query token sees: int64 [b, s_q].

    Query token i of a request of length L sees keys ``< L - s_q + i + 1`` if causal, else ``< L``.
    """
    L = cache_seqlens.to(torch.int64)[:, None]
    if not causal:
        return L.expand(-1, s_q)
    i = torch.arange(s_q, device=cache_seqlens.device)[None, :]
    return (L - s_q + i + 1).clamp(min=0)


def mla_decode_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    d_v: int,
    batch_chunk: int = 8,
    pages_per_chunk: int = 32,
    host_lengths: bool | None = None,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference MLA decode; arguments as in :func:`torch_mla.mla_decode` (already validated).

    q: [b, s_q, h_q, d_qk]; kv_cache: [num_blocks, 64, h_kv, d_qk], q's dtype, or float8_e4m3fn
    with its float32 [1] ``kv_scale`` (dequantized page by page as it is gathered); a
    float8_e4m3fn q comes with its float32 [1] ``q_scale``. Query head h reads KV head
    ``h // (h_q // h_kv)``; block_table int32 [b, max_blocks]; cache_seqlens int32 [b]. Returns
    ``out`` [b, s_q, h_q, d_v] in q's dtype (bf16 for a float8_e4m3fn q) and ``lse``
    [b, h_q, s_q] float32 (natural log; +inf and a zero output for a query token that sees no
    key).

    Requests are taken ``batch_chunk`` at a time, their pages ``pages_per_chunk`` at a time,
    merged with an online softmax, so memory does not grow with the lengths or the table width.
    Which pages are walked: with ``host_lengths`` (the default on CPU tensors) the lengths are
    read on the host and only the columns below the longest length of the batch chunk are
    gathered, so time follows the lengths. Without (the default on other devices: no host sync,
    CUDA-graph capturable) every column of block_table is walked: time grows with the table's
    width, memory stays one chunk.
    """
    b, s_q, h_q, d_qk = q.shape
    num_blocks, page, h_kv, _ = kv_cache.shape
    g = h_q // h_kv  # query heads per KV head, contiguous as in FlashMLA
    rows = s_q * g  # query rows per KV head, ordered (token, head)
    out_dtype = torch.bfloat16 if q.dtype == FP8 else q.dtype
    out = torch.empty(b, s_q, h_q, d_v, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    vis = visible_lengths(cache_seqlens, s_q, causal)  # [b, s_q]
    width = block_table.shape[1] if num_blocks > 0 else 0  # no pages: every length is 0
    if host_lengths is None:
        host_lengths = cache_seqlens.device.type == "cpu"
    for start in range(0, b, batch_chunk):
        stop = min(b, start + batch_chunk)
        bc = stop - start
        lens = cache_seqlens[start:stop].to(torch.int64)
        cols = width
        if host_lengths:
            cols = min(width, -(-int(lens.max()) // page))
        qf = q[start:stop].float()
        if q_scale is not None:
            qf = qf * q_scale
        qf = qf.reshape(bc, s_q, h_kv, g, d_qk).transpose(1, 2)
        qf = qf.reshape(bc, h_kv, rows, d_qk)
        horizon = vis[start:stop, :, None].expand(bc, s_q, g).reshape(bc, 1, rows, 1)
        o = torch.zeros(bc, h_kv, rows, d_v, dtype=torch.float32, device=q.device)
        m = torch.full((bc, h_kv, rows), -math.inf, dtype=torch.float32, device=q.device)
        for c0 in range(0, cols, pages_per_chunk):
            c1 = min(cols, c0 + pages_per_chunk)
            key = torch.arange(c0 * page, c1 * page, device=q.device)  # (keys,)
            # Unused entries may hold any id: read page 0 instead and mask its keys out.
            used = torch.arange(c0, c1, device=q.device)[None, :] * page < lens[:, None]
            ids = torch.where(used, block_table[start:stop, c0:c1].to(torch.int64), 0)
            kv = kv_cache[ids].float()
            if kv_scale is not None:
                kv = dequantize_fp8(kv, kv_scale)
            kv = kv.view(bc, -1, h_kv, d_qk).transpose(1, 2)  # (bc, h_kv, keys, d_qk)
            in_len = key[None, None, :, None] < lens[:, None, None, None]
            kv = torch.where(in_len, kv, 0.0)
            scores = torch.einsum("bhrd,bhkd->bhrk", qf, kv) * softmax_scale
            scores = scores.masked_fill(key >= horizon, -math.inf)
            m_new = torch.logaddexp(m, torch.logsumexp(scores, dim=-1))
            # o holds sum exp(score - m) V over the keys so far (m: their log-sum-exp); rows
            # that saw no key yet keep m = -inf and o = 0 (exp(-inf - 0) = 0, no NaN).
            shift = torch.where(torch.isneginf(m_new), 0.0, m_new)
            p = torch.exp(scores - shift[..., None])
            o = o * torch.exp(m - shift)[..., None] + torch.einsum("bhrk,bhkd->bhrd", p,
                                                                   kv[..., :d_v])
            m = m_new
        o = o.view(bc, h_kv, s_q, g, d_v).transpose(1, 2).reshape(bc, s_q, h_q, d_v)
        out[start:stop] = o.to(out_dtype)
        m = torch.where(torch.isneginf(m), math.inf, m)
        lse[start:stop] = m.view(bc, h_kv, s_q, g).permute(0, 1, 3, 2).reshape(bc, h_q, s_q)
    return out, lse


def append_kv_reference(
    kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Writes ``[kv_c | k_pe]`` into ``kv_cache`` at ``slot_mapping`` in place; slots < 0 skipped.
    A float8_e4m3fn cache gets ``quantize_fp8([kv_c | k_pe], kv_scale)``.

    Implemented without data-dependent shapes or host synchronisation, so it can be captured in a
    CUDA graph: skipped rows are redirected to the slot of a row that is written anyway, carrying
    the same value, so no two writes to one slot disagree.
    """
    T = slot_mapping.shape[0]
    if T == 0:
        return
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    new = torch.cat([kv_c, k_pe], dim=-1)
    new = quantize_fp8(new, kv_scale) if kv_scale is not None else new.to(kv_cache.dtype)
    slot = slot_mapping.to(torch.int64)
    valid = slot >= 0
    any_valid = valid.any()
    # First valid row (0 if none); index_select keeps it on the device (no sync under capture).
    first = torch.argmax(valid.to(torch.int8)).view(1)
    dummy_slot = torch.where(any_valid, slot.index_select(0, first), 0)
    idx = torch.where(valid, slot, dummy_slot)
    # With no valid row at all, every write goes to slot 0 and rewrites what is there.
    dummy_val = torch.where(any_valid, new.index_select(0, first), flat[:1])
    vals = torch.where(valid[:, None], new, dummy_val)
    flat.index_put_((idx,), vals)
