"""Host side of the DSA indexer's logits kernel (cute_kernels/sm90_indexer.py): which inputs it
takes, and its launch on the current stream (TVM-FFI; no host synchronisation, nothing allocated
whose size depends on data: CUDA-graph safe).

API (for the indexer op, tests and tools):
    indexer_kernel_unsupported(...)   why the kernel cannot run these inputs (None: it can)
    indexer_logits_sm90(...)          the launch; writes ``out`` and returns it
"""

from __future__ import annotations

import functools
import math

import torch

from ..constants import PAGE_SIZE
from ..contract import indexer_unsupported
from ..scheduling import IndexerSplit, default_num_sms
from . import dispatch, registry
from .sparse import _rows16


@functools.lru_cache(maxsize=None)
def _kernel(dtype: str, head_dim: int, heads: int, s_q: int):
    return registry.compiled(registry.IndexerConfig(dtype, head_dim, heads, s_q),
                             registry.SM90_ARCH)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy where its last stride is not 1 (the kernel's views need it)."""
    return t if t.stride(-1) == 1 else t.contiguous()


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return default_num_sms(torch.device("cuda", index))


def indexer_kernel_unsupported(q: torch.Tensor, weights: torch.Tensor,
                               index_cache: torch.Tensor, index_scale: torch.Tensor | None,
                               block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                               out: torch.Tensor) -> str | None:
    """Why :func:`indexer_logits_sm90` cannot run these (already validated) inputs, or None.

    It runs on SM90 (H100/H200) GPUs: q [b, s_q, H, D] bfloat16 over a bfloat16 cache, or
    float8_e4m3fn over a float8_e4m3fn cache with float32 index_scale; D 64 or 128, H a
    multiple of 8 with s_q * H <= 128 (V3.2: H 64, D 128, s_q 1 or 2); pages of 64 tokens;
    weights and out float32; int32 block_table and cache_seqlens."""
    if not q.is_cuda:
        return "the indexer kernel runs on CUDA tensors"
    cap = dispatch.cuda_capability(q.device)
    if tuple(cap) != (9, 0):
        return f"the indexer kernel is built for SM90 (sm_90a), not compute capability {cap}"
    fp8 = index_cache.dtype == torch.float8_e4m3fn
    if fp8:
        if q.dtype != torch.float8_e4m3fn or index_scale is None \
                or index_scale.dtype != torch.float32:
            return ("over a float8_e4m3fn index cache the indexer kernel takes float8_e4m3fn q "
                    "and float32 index_scale")
    elif q.dtype != torch.bfloat16 or index_cache.dtype != torch.bfloat16:
        return (f"the indexer kernel takes bf16 or float8_e4m3fn q and cache, got "
                f"{q.dtype} and {index_cache.dtype}")
    if (weights.dtype != torch.float32 or out.dtype != torch.float32
            or block_table.dtype != torch.int32 or cache_seqlens.dtype != torch.int32):
        return "the indexer kernel takes float32 weights and out, int32 block_table and lengths"
    if index_cache.dim() != 3 or index_cache.shape[1] != PAGE_SIZE:
        return f"the indexer kernel takes an index cache [num_blocks, {PAGE_SIZE}, D]"
    if out.dim() != 3 or out.stride(-1) != 1:
        return "the indexer kernel writes an out [b, s_q, max_len] of last stride 1"
    b, s_q, heads, head_dim = q.shape
    return indexer_unsupported(head_dim, heads, s_q)


def indexer_logits_sm90(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor,
                        index_scale: torch.Tensor | None, block_table: torch.Tensor,
                        cache_seqlens: torch.Tensor, out: torch.Tensor,
                        pages_per_cta: int | None = None) -> torch.Tensor:
    """The indexer's logits by the SM90 kernel, into ``out`` (returned), for inputs that
    :func:`indexer_kernel_unsupported` accepts (shapes and values are not checked here):

        logits[r, t, j] = sum_h weights[r, t, h] * relu(q[r, t, h] . key_j) (* index_scale_j)
        for j < cache_seqlens[r] - s_q + t + 1, and -inf for the other j < max_len.

    Args:
        q: [b, s_q, H, D] bfloat16, or float8_e4m3fn over an e4m3 cache (its per-(token, head)
            scale folded into weights by the caller).
        weights: [b, s_q, H] float32.
        index_cache: [num_blocks, 64, D] bfloat16 or float8_e4m3fn, one key a token (rows
            16-byte aligned; other layouts are copied).
        index_scale: [num_blocks, 64] float32 (e4m3 cache: key_j = e4m3 value x scale_j, scales
            >= 0), else None.
        block_table: [b, max_blocks] int32; entries past a request's length are never read.
        cache_seqlens: [b] int32, this step's s_q tokens included.
        out: [b, s_q, max_len] float32, last stride 1 (max_len a multiple of 64 that covers
            every length; written in full). Other tensors of unsupported strides are copied.
        pages_per_cta: the pages of an output row a CTA takes (tests, tools); default
            IndexerSplit.from_heuristic's choice.
    """
    if q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):
            return indexer_logits_sm90(q, weights, index_cache, index_scale, block_table,
                                       cache_seqlens, out, pages_per_cta)
    b, s_q, heads, head_dim = q.shape
    max_len = out.shape[2]
    if b == 0 or max_len == 0:
        return out
    if index_cache.shape[0] == 0:  # no key anywhere (and no TMA descriptor of an empty cache)
        return out.fill_(-math.inf)
    fp8 = index_cache.dtype == torch.float8_e4m3fn
    kernel = _kernel("e4m3" if fp8 else "bf16", head_dim, heads, s_q)
    if pages_per_cta is None:
        n_pages = -(-max_len // PAGE_SIZE)
        pages_per_cta = IndexerSplit.from_heuristic(b, n_pages,
                                                    _num_sms(q.device.index)).pages_per_cta
    # The kernel's views: (token, head) rows of q and weights flattened (a view for the usual
    # contiguous tensors); TMA needs 16-byte aligned rows. e4m3 crosses as bytes.
    q_rows = _rows16(_unit_last(q.reshape(b, s_q * heads, head_dim)))
    cache = _rows16(_unit_last(index_cache))
    args = [q_rows, _unit_last(weights.reshape(b, s_q * heads)), cache,
            _unit_last(block_table), cache_seqlens.contiguous(), out,
            max(int(pages_per_cta), 1)]
    # (The bf16 build's signature keeps the scale's slot: None is passed for it.)
    scale = None
    if fp8:
        args[0], args[2] = q_rows.view(torch.uint8), cache.view(torch.uint8)
        scale = _rows16(_unit_last(index_scale))
    kernel(*args, scale)
    return out
