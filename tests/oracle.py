"""An independent float64 MLA decode, one request and one query token at a time."""

import math

import torch


def mla_decode_fp64(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, d_v):
    b, s_q, h_q, d_qk = q.shape
    page = kv_cache.shape[1]
    out = torch.zeros(b, s_q, h_q, d_v, dtype=torch.float64)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float64)
    cache = kv_cache.detach().cpu().double().reshape(-1, page, d_qk)
    for r in range(b):
        L = int(cache_seqlens[r])
        rows = []
        for t in range(L):
            rows.append(cache[int(block_table[r, t // page]), t % page])
        keys = torch.stack(rows) if rows else torch.zeros(0, d_qk, dtype=torch.float64)
        for i in range(s_q):
            n = L - s_q + i + 1 if causal else L
            n = max(n, 0)
            if n == 0:
                continue
            k = keys[:n]
            qi = q[r, i].detach().cpu().double()  # (h_q, d_qk)
            s = qi @ k.T * softmax_scale  # (h_q, n)
            lse[r, :, i] = torch.logsumexp(s, dim=-1)
            out[r, i] = torch.softmax(s, dim=-1) @ k[:, :d_v]
    return out, lse
