"""FlashMLA's decode interface on top of torch_mla, so callers switch by changing one import::

    from torch_mla.compat.flash_mla import get_mla_metadata, flash_mla_with_kvcache

Both of FlashMLA's forms are accepted:

* the tensor form used by vLLM and SGLang:
  ``tile_scheduler_metadata, num_splits = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)``
  returns int32 ``[num_sm_parts, 8]`` and int32 ``[batch + 1]``, passed on to every layer;
* the newer object form: ``sched_meta, _ = get_mla_metadata()`` returns an empty
  :class:`FlashMLASchedMeta` that the first ``flash_mla_with_kvcache`` call fills in and later
  calls reuse (valid while the shapes and ``cache_seqlens`` values stay the same).

Sparse decode (``indices=``, FlashMLA's ``is_fp8_kvcache=True`` 656-byte cache, ``topk_length``,
``attn_sink``) routes to :func:`torch_mla.mla_decode_sparse` (see :func:`flash_mla_with_kvcache`);
the ``extra_*`` arguments (DeepSeek's MODEL1 layout) raise NotImplementedError. The dense FP8
cache that vLLM's fork of FlashMLA decodes (float8_e4m3fn ``[num_blocks, 64, h_kv, 576]``, one
``descale_k`` and one ``descale_q`` per tensor) is served by :func:`get_mla_metadata_dense_fp8`
and :func:`flash_mla_with_kvcache_fp8`, vLLM's names.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ..ops.checks import check_count, check_decode_args
from ..ops.decode import mla_decode
from ..ops.schedule import DecodeSchedule, get_decode_schedule

__all__ = ["FlashMLASchedMeta", "get_mla_metadata", "flash_mla_with_kvcache",
           "get_mla_metadata_dense_fp8", "flash_mla_with_kvcache_fp8"]


@dataclasses.dataclass
class FlashMLASchedMeta:
    """Schedule holder of FlashMLA's newer interface; filled in by the first decode call."""

    have_initialized: bool = False
    config: Optional[tuple] = None  # (b, s_q, h_q, page_block_size, h_k, causal)
    tile_scheduler_metadata: Optional[torch.Tensor] = None  # int32 [num_sm_parts, 8]
    num_splits: Optional[torch.Tensor] = None  # int32 [batch + 1]


def get_mla_metadata(
    cache_seqlens: Optional[torch.Tensor] = None,
    num_q_tokens_per_head_k: Optional[int] = None,
    num_heads_k: int = 1,
    num_heads_q: Optional[int] = None,
    is_fp8_kvcache: bool = False,
    topk: Optional[int] = None,
):
    """FlashMLA's ``get_mla_metadata``.

    With ``cache_seqlens`` (int32 [batch]), ``num_q_tokens_per_head_k`` (= s_q * h_q // h_kv, the
    query rows of one KV head) and ``num_heads_k`` (h_kv): returns
    ``(tile_scheduler_metadata int32 [num_sm_parts, 8], num_splits int32 [batch + 1])``, computed
    on the device; the same schedule as ``torch_mla.get_decode_schedule(cache_seqlens, s_q, h_q,
    h_kv=h_kv)``. With no arguments: returns ``(FlashMLASchedMeta(), None)``.
    """
    if topk is not None:  # sparse: the object form, as FlashMLA's get_mla_metadata returns now
        return FlashMLASchedMeta(), None
    if is_fp8_kvcache:
        raise NotImplementedError("is_fp8_kvcache=True without topk: FlashMLA's sparse FP8 "
                                  "cache takes topk= here (then indices= in "
                                  "flash_mla_with_kvcache); a dense float8_e4m3fn cache: "
                                  "get_mla_metadata_dense_fp8")
    if cache_seqlens is None:
        return FlashMLASchedMeta(), None
    if num_q_tokens_per_head_k is None:
        raise TypeError("get_mla_metadata needs num_q_tokens_per_head_k (= s_q * h_q // h_kv)")
    check_count("num_q_tokens_per_head_k", num_q_tokens_per_head_k)
    check_count("num_heads_k", num_heads_k)
    # One query token of num_q_tokens_per_head_k * h_kv heads: the schedule is sized by the rows
    # per KV head, as with get_decode_schedule(s_q, h_q, h_kv=h_kv).
    sched = get_decode_schedule(cache_seqlens, 1, num_q_tokens_per_head_k * num_heads_k,
                                h_kv=num_heads_k)
    return sched.metadata, sched.num_splits


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata,
    num_splits: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    **unsupported,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's ``flash_mla_with_kvcache``: dense decode, or sparse decode with ``indices``.

    Forward-only (inference), as :func:`torch_mla.mla_decode`.

    Args:
        q: [batch, s_q, h_q, head_dim]; k_cache: [num_blocks, 64, h_kv, head_dim], h_q a
        multiple of h_kv (query head h reads KV head h // (h_q // h_kv));
        block_table: int32 [batch, max_blocks]; cache_seqlens: int32 [batch];
        head_dim_v: width of V (the first head_dim_v columns of the cache);
        tile_scheduler_metadata, num_splits: from :func:`get_mla_metadata` (either form).

    Sparse decode (``indices`` given; FlashMLA's argument names and meaning): ``indices`` int32
    [batch, s_q, topk] of cache slots (page * 64 + row, -1 for none); with
    ``is_fp8_kvcache=True`` k_cache is DeepSeek-V3.2's 656-byte FP8 layout, uint8 or
    float8_e4m3fn [num_blocks, 64, 1, 656] (else a bf16/fp16 cache in q's dtype, which FlashMLA
    does not take); ``topk_length`` int32 [batch]; ``attn_sink`` float32 [h_q] (scales the output
    by exp(lse) / (exp(lse) + exp(sink)), not the lse); block_table and cache_seqlens are not
    read; causal must be False. tile_scheduler_metadata: a :class:`FlashMLASchedMeta` (filled in
    by the first call; reuse it while the shapes and topk_length's values stay the same) or
    tensors from :func:`torch_mla.get_sparse_decode_schedule`. See
    :func:`torch_mla.mla_decode_sparse`.

    Returns:
        out [batch, s_q, h_q, head_dim_v] in q's dtype; softmax_lse float32 [batch, h_q, s_q].
    """
    if indices is not None:
        return _sparse_decode(q, k_cache, head_dim_v, tile_scheduler_metadata, num_splits,
                              softmax_scale, causal, is_fp8_kvcache, indices, attn_sink,
                              topk_length, dict(unsupported, extra_k_cache=extra_k_cache,
                                                extra_indices_in_kvcache=extra_indices_in_kvcache,
                                                extra_topk_length=extra_topk_length))
    if is_fp8_kvcache:
        raise NotImplementedError("is_fp8_kvcache=True without indices: FlashMLA's FP8 cache is "
                                  "its sparse one (pass indices=); torch_mla's dense decode only "
                                  "takes a float8_e4m3fn cache through flash_mla_with_kvcache_fp8")
    extra = [k for k, v in dict(unsupported, attn_sink=attn_sink, extra_k_cache=extra_k_cache,
                                extra_indices_in_kvcache=extra_indices_in_kvcache,
                                topk_length=topk_length,
                                extra_topk_length=extra_topk_length).items() if v is not None]
    if extra:
        raise NotImplementedError(f"unsupported FlashMLA arguments: {', '.join(sorted(extra))}")
    if isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        meta = tile_scheduler_metadata
        if not meta.have_initialized:  # (mla_decode checks the values)
            check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, causal)
        config = (q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], causal)
        if not meta.have_initialized:
            sched = get_decode_schedule(cache_seqlens, q.shape[1], q.shape[2],
                                        h_kv=k_cache.shape[2])
            meta.tile_scheduler_metadata, meta.num_splits = sched
            meta.config, meta.have_initialized = config, True
        elif meta.config != config:
            raise ValueError(
                f"sched_meta was made for (b, s_q, h_q, page, h_k, causal) = {meta.config}, "
                f"but this call has {config}; use one FlashMLASchedMeta per configuration"
            )
        schedule = DecodeSchedule(meta.tile_scheduler_metadata, meta.num_splits)
    else:
        if num_splits is None:
            raise TypeError("num_splits is required with a tensor tile_scheduler_metadata")
        schedule = DecodeSchedule(tile_scheduler_metadata, num_splits)
    return mla_decode(q, k_cache, block_table, cache_seqlens, schedule,
                      softmax_scale=softmax_scale, causal=causal, d_v=head_dim_v)


def get_mla_metadata_dense_fp8(
    cache_seqlens: torch.Tensor, num_q_tokens_per_head_k: int, num_heads_k: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``get_mla_metadata_dense_fp8``: ``(tile_scheduler_metadata int32 [num_sm_parts, 8],
    num_splits int32 [batch + 1])`` for ``cache_seqlens`` int32 [batch]; the schedule does not
    depend on the cache dtype, so this is :func:`get_mla_metadata`'s tensor form."""
    return get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k)


def flash_mla_with_kvcache_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: torch.Tensor,
    num_splits: torch.Tensor,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    descale_q: Optional[torch.Tensor] = None,
    descale_k: Optional[torch.Tensor] = None,
    compute: str = "exact",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``flash_mla_with_kvcache_fp8``: dense decode over an FP8 latent cache.

    Args:
        q: [batch, s_q, h_q, head_dim], float8_e4m3fn with ``descale_q`` (or bf16/fp16 without);
        k_cache: [num_blocks, 64, h_kv, head_dim] float8_e4m3fn; value = ``k_cache.float() *
        descale_k``; block_table int32 [batch, max_blocks]; cache_seqlens int32 [batch];
        head_dim_v: width of V; tile_scheduler_metadata, num_splits: from
        :func:`get_mla_metadata_dense_fp8`; descale_k, descale_q: float32 [1] (one per tensor):
        :func:`torch_mla.mla_decode`'s ``kv_scale`` and ``q_scale``; compute (not vLLM's):
        :func:`torch_mla.mla_decode`'s, "fp8" for vLLM's e4m3 Q and P arithmetic.

    Returns:
        out [batch, s_q, h_q, head_dim_v] bf16 (q's dtype for a bf16/fp16 q); softmax_lse
        float32 [batch, h_q, s_q].
    """
    return mla_decode(q, k_cache, block_table, cache_seqlens,
                      DecodeSchedule(tile_scheduler_metadata, num_splits),
                      softmax_scale=softmax_scale, causal=causal, d_v=head_dim_v,
                      kv_scale=descale_k, q_scale=descale_q, compute=compute)


def _sparse_decode(q, k_cache, head_dim_v, sched, num_splits, softmax_scale, causal,
                   is_fp8_kvcache, indices, attn_sink, topk_length, extra):
    """flash_mla_with_kvcache with indices: FlashMLA's sparse decode, on mla_decode_sparse."""
    from ..ops.sparse import get_sparse_decode_schedule, mla_decode_sparse

    extra = sorted(k for k, v in extra.items() if v is not None)
    if extra:
        raise NotImplementedError(f"unsupported FlashMLA sparse arguments: {', '.join(extra)}")
    if causal:
        raise ValueError("causal must be False with indices (sparse attention): the indices say "
                         "which tokens each query token sees")
    if is_fp8_kvcache:
        if k_cache.dtype not in (torch.uint8, torch.float8_e4m3fn) or k_cache.shape[-1] != 656:
            raise ValueError("is_fp8_kvcache=True with indices means DeepSeek-V3.2's 656-byte FP8 "
                             "cache: uint8 or float8_e4m3fn [num_blocks, 64, 1, 656], got "
                             f"{k_cache.dtype} {list(k_cache.shape)}")
        k_cache = k_cache.view(torch.uint8)
    if isinstance(sched, FlashMLASchedMeta):
        config = ("sparse", q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1],
                  k_cache.shape[2], bool(is_fp8_kvcache), indices.shape[-1])
        if not sched.have_initialized:
            sched.tile_scheduler_metadata, sched.num_splits = get_sparse_decode_schedule(
                indices, q.shape[2], topk_length)
            sched.config, sched.have_initialized = config, True
        elif sched.config != config:
            raise ValueError(
                f"sched_meta was made for (mode, b, s_q, h_q, page, h_k, is_fp8_kvcache, topk) = "
                f"{sched.config}, but this call has {config}; use one FlashMLASchedMeta per "
                "configuration")
        schedule = DecodeSchedule(sched.tile_scheduler_metadata, sched.num_splits)
    else:
        if num_splits is None:
            raise TypeError("num_splits is required with a tensor tile_scheduler_metadata")
        schedule = DecodeSchedule(sched, num_splits)
    return mla_decode_sparse(q, k_cache, indices, topk_length=topk_length, attn_sink=attn_sink,
                             softmax_scale=softmax_scale, d_v=head_dim_v, schedule=schedule)
