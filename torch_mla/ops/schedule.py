"""``torch_mla::get_decode_schedule``: the split-KV work schedule, computed on the device."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..scheduling import DecodeSplitConfig, compute_schedule, default_num_sms
from .checks import check_count, check_seqlens_tensor
from .library import lib


class DecodeSchedule(NamedTuple):
    """Work split for one decode step; compute once per step and share it across layers.

    metadata: int32 [num_parts, 8] on the seqlens' device (layout in torch_mla.scheduling).
    num_splits: int32 [batch + 1], prefix sum of the number of pieces each request is cut into.
    """

    metadata: torch.Tensor
    num_splits: torch.Tensor


def _schedule_impl(cache_seqlens: torch.Tensor, num_parts: int):
    check_seqlens_tensor(cache_seqlens)
    check_count("num_parts", num_parts)
    return compute_schedule(cache_seqlens, num_parts)


lib.impl("get_decode_schedule", _schedule_impl, "CompositeExplicitAutograd")


def get_decode_schedule(
    cache_seqlens: torch.Tensor, s_q: int, h_q: int, num_sms: int | None = None, *, h_kv: int = 1
) -> DecodeSchedule:
    """Computes the split-KV schedule for a decode step, on the device, with no host sync.

    Args:
        cache_seqlens: int32 [batch], keys cached per request (including this step's tokens).
        s_q: query tokens per request (1, or more with speculative decoding), >= 1.
        h_q: query heads, >= 1, a multiple of h_kv.
        num_sms: multiprocessors to spread the work over (default: the device's count; 132 on CPU).
        h_kv: KV (latent) heads of the cache. The kernel runs each KV head's group of
            s_q * h_q // h_kv query rows over this one schedule (one launch per head), so it is
            sized for that many rows.

    Returns:
        DecodeSchedule(metadata int32 [num_parts, 8], num_splits int32 [batch + 1]). It depends on
        the values of ``cache_seqlens``: recompute it whenever they change (once per step).
    """
    check_seqlens_tensor(cache_seqlens)
    check_count("s_q", s_q)
    check_count("h_q", h_q)
    check_count("h_kv", h_kv)
    if h_q % h_kv:
        raise ValueError(f"h_q ({h_q}) must be a multiple of h_kv ({h_kv})")
    if num_sms is None:
        num_sms = default_num_sms(cache_seqlens.device)
    check_count("num_sms", num_sms)
    cfg = DecodeSplitConfig.from_heuristic(s_q, h_q, num_sms, h_kv)
    if torch.compiler.is_compiling():
        meta, splits = torch.ops.torch_mla.get_decode_schedule(cache_seqlens, cfg.num_parts)
    else:
        meta, splits = _schedule_impl(cache_seqlens, cfg.num_parts)
    return DecodeSchedule(meta, splits)
