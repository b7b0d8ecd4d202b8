"""``torch_mla::get_decode_schedule``: the split-KV work schedule, computed on the device."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..scheduling import DecodeSplitConfig, compute_schedule, default_num_sms
from .checks import check_seqlens_tensor
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
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    return compute_schedule(cache_seqlens, num_parts)


lib.impl("get_decode_schedule", _schedule_impl, "CompositeExplicitAutograd")


def get_decode_schedule(
    cache_seqlens: torch.Tensor, s_q: int, h_q: int, num_sms: int | None = None
) -> DecodeSchedule:
    """Computes the split-KV schedule for a decode step, on the device, with no host sync.

    Args:
        cache_seqlens: int32 [batch], keys cached per request (including this step's tokens).
        s_q: query tokens per request (1, or more with speculative decoding).
        h_q: query heads.
        num_sms: multiprocessors to spread the work over (default: the device's count; 132 on CPU).

    Returns:
        DecodeSchedule(metadata int32 [num_parts, 8], num_splits int32 [batch + 1]). It depends on
        the values of ``cache_seqlens``: recompute it whenever they change (once per step).
    """
    if num_sms is None:
        num_sms = default_num_sms(cache_seqlens.device)
    cfg = DecodeSplitConfig.from_heuristic(s_q, h_q, num_sms)
    if torch.compiler.is_compiling():
        meta, splits = torch.ops.torch_mla.get_decode_schedule(cache_seqlens, cfg.num_parts)
    else:
        meta, splits = _schedule_impl(cache_seqlens, cfg.num_parts)
    return DecodeSchedule(meta, splits)
