"""An independent float64 MLA decode, one request and one query token at a time."""

import math

import torch

from torch_mla.testing import DecodeInputs, make_decode_inputs


def mla_decode_fp64(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, d_v):
    """q [b, s_q, h_q, d_qk], kv_cache [num_blocks, page, h_kv, d_qk]: query heads
    ``k * h_q // h_kv .. (k + 1) * h_q // h_kv - 1`` read KV head k (FlashMLA's grouping)."""
    b, s_q, h_q, d_qk = q.shape
    page, h_kv = kv_cache.shape[1], kv_cache.shape[2]
    group = h_q // h_kv
    out = torch.zeros(b, s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    cache = kv_cache.detach().cpu().double()
    for r in range(b):
        L = int(cache_seqlens[r])
        rows = []
        for t in range(L):
            rows.append(cache[int(block_table[r, t // page]), t % page])  # (h_kv, d_qk)
        keys = torch.stack(rows) if rows else torch.zeros(0, h_kv, d_qk, dtype=torch.float64)
        for i in range(s_q):
            n = L - s_q + i + 1 if causal else L
            n = max(n, 0)
            if n == 0:
                continue
            for kv_head in range(h_kv):
                heads = slice(kv_head * group, (kv_head + 1) * group)
                k = keys[:n, kv_head]  # (n, d_qk)
                qi = q[r, i, heads].detach().cpu().double()  # (group, d_qk)
                s = qi @ k.T * softmax_scale  # (group, n)
                lse[r, heads, i] = torch.logsumexp(s, dim=-1)
                out[r, i, heads] = torch.softmax(s, dim=-1) @ k[:, :d_v]
    return out, lse


def kv_head_inputs(lens, s_q, h_q, h_kv, d_qk=576, dtype=torch.bfloat16):
    """Decode inputs with h_kv KV heads: make_decode_inputs' pages (poisoned as usual), each
    row split into h_kv heads of d_qk, and a fresh q of d_qk per head."""
    inp = make_decode_inputs(lens, s_q, h_q, d_qk=h_kv * d_qk, dtype=dtype)
    cache = inp.kv_cache.view(inp.kv_cache.shape[0], 64, h_kv, d_qk)
    q = (torch.randn(len(lens), s_q, h_q, d_qk) / 10).to(dtype)
    return DecodeInputs(q, cache, inp.block_table, inp.cache_seqlens)
