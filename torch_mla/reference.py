"""Plain-PyTorch MLA decode: the CPU path and the oracle every kernel is tested against.

Everything is computed in float32 from the stored (bf16/fp16/fp32) values. It is written to be
obviously right, not fast: pages are gathered through the block table, keys past each request's
length (and, with ``causal``, past each query token's horizon) are masked out, and masked values
are zeroed before the P @ V product so that garbage (even NaN) in unused cache slots cannot leak.
"""

from __future__ import annotations

import math

import torch

PAGE_SIZE = 64


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference MLA decode; arguments as in :func:`torch_mla.mla_decode` (already validated).

    Returns ``out`` [b, s_q, h_q, d_v] in q's dtype and ``lse`` [b, h_q, s_q] float32 (natural
    log; +inf and a zero output for a query token that sees no key).
    """
    b, s_q, h_q, d_qk = q.shape
    page = kv_cache.shape[1]
    out = torch.empty(b, s_q, h_q, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    cache = kv_cache.view(kv_cache.shape[0], page, d_qk)
    vis = visible_lengths(cache_seqlens, s_q, causal)  # [b, s_q]
    # Only the pages that hold keys below the longest length are gathered; unused block-table
    # entries (which may hold garbage ids) are replaced by page 0 and masked out below.
    n_pages = block_table.shape[1]
    for start in range(0, b, batch_chunk):
        stop = min(b, start + batch_chunk)
        lens = cache_seqlens[start:stop].to(torch.int64)
        used = torch.arange(n_pages, device=q.device)[None, :] * page < lens[:, None]
        ids = torch.where(used, block_table[start:stop].to(torch.int64), 0)
        kv = cache[ids].reshape(stop - start, n_pages * page, d_qk).float()  # (bc, keys, d_qk)
        key_idx = torch.arange(n_pages * page, device=q.device)
        in_len = key_idx[None, :] < lens[:, None]  # (bc, keys)
        kv = torch.where(in_len[:, :, None], kv, 0.0)
        qf = q[start:stop].float().reshape(stop - start, s_q * h_q, d_qk)
        scores = torch.einsum("brd,bkd->brk", qf, kv) * softmax_scale  # (bc, s_q*h_q, keys)
        horizon = vis[start:stop].repeat_interleave(h_q, dim=1)  # (bc, s_q*h_q)
        visible = key_idx[None, None, :] < horizon[:, :, None]
        scores = scores.masked_fill(~visible, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is visible
        empty = torch.isneginf(row_lse)
        probs = torch.exp(scores - torch.where(empty, 0.0, row_lse)[:, :, None])
        o = torch.einsum("brk,bkd->brd", probs, kv[:, :, :d_v])
        o = torch.where(empty[:, :, None], 0.0, o)
        out[start:stop] = o.reshape(stop - start, s_q, h_q, d_v).to(q.dtype)
        row_lse = torch.where(empty, math.inf, row_lse)
        lse[start:stop] = row_lse.reshape(stop - start, s_q, h_q).transpose(1, 2)
    return out, lse


def append_kv_reference(
    kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes ``[kv_c | k_pe]`` into ``kv_cache`` at ``slot_mapping`` in place; slots < 0 skipped.

    Implemented without data-dependent shapes or host synchronisation, so it can be captured in a
    CUDA graph: skipped rows are redirected to the slot of a row that is written anyway, carrying
    the same value, so no two writes to one slot disagree.
    """
    T = slot_mapping.shape[0]
    if T == 0:
        return
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    new = torch.cat([kv_c, k_pe], dim=-1).to(kv_cache.dtype)
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
