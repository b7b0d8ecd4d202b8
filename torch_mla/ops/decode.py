"""``torch_mla::mla_decode``: validation, then the CuTe DSL kernel where one exists, else the
reference."""

from __future__ import annotations

import torch

from ..reference import mla_decode_reference
from .checks import check_decode_args, check_schedule_args
from .dispatch import find_decode_kernel
from .library import lib
from .schedule import DecodeSchedule, get_decode_schedule


def _decode_impl(q, kv_cache, block_table, cache_seqlens, sched_metadata, num_splits,
                 softmax_scale: float, causal: bool, d_v: int):
    check_decode_args(q, kv_cache, block_table, cache_seqlens, d_v, causal)
    check_schedule_args(sched_metadata, num_splits, q.shape[0], q.device)
    kernel = find_decode_kernel(q, kv_cache, d_v)
    if kernel is not None:
        return kernel(q, kv_cache, block_table, cache_seqlens, sched_metadata, num_splits,
                      softmax_scale, causal)
    return mla_decode_reference(q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, d_v)


lib.impl("mla_decode", _decode_impl, "CompositeExplicitAutograd")


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    schedule: DecodeSchedule | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    d_v: int = 512,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-head latent attention decode over a paged latent cache (FlashMLA's dense decode).

    Every query head attends to the one cached latent per token: K is the whole cached row
    (d_qk = d_v + d_rope wide), V its first d_v columns.

    Args:
        q: [batch, s_q, h_q, d_qk], bf16/fp16 (fp32 runs on the reference path); last dim
            contiguous. With absorbed weights, d_qk = kv_lora_rank + qk_rope_head_dim.
        kv_cache: [num_blocks, 64, 1, d_qk], q's dtype, contiguous; page size 64, one latent head.
        block_table: int32 [batch, max_blocks]; page j of request r is ``block_table[r, j]``.
            Entries past a request's length are never read.
        cache_seqlens: int32 [batch], keys per request, 0 <= L <= max_blocks * 64.
        schedule: from :func:`get_decode_schedule` for these ``cache_seqlens`` (computed here if
            None; pass it in to share it across layers and keep CUDA graphs free of it).
        softmax_scale: scale of QK^T before the softmax (default d_qk ** -0.5).
        causal: for s_q > 1, query token i sees keys ``< L - s_q + i + 1`` (speculative decoding).
        d_v: width of V and of the output (512 for DeepSeek-V2/V3).

    Returns:
        out: [batch, s_q, h_q, d_v] in q's dtype.
        lse: float32 [batch, h_q, s_q], natural-log log-sum-exp of the scaled scores.
        A query token that sees no key gets out = 0 and lse = +inf.
    """
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    if schedule is None:
        schedule = get_decode_schedule(cache_seqlens, q.shape[1], q.shape[2])
    args = (q, kv_cache, block_table, cache_seqlens, schedule.metadata, schedule.num_splits,
            float(softmax_scale), bool(causal), int(d_v))
    if torch.compiler.is_compiling():
        return torch.ops.torch_mla.mla_decode(*args)
    return _decode_impl(*args)
