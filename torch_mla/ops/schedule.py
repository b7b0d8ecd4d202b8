"""``torch_mla::get_decode_schedule``: the split-KV work schedule, computed on the device."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..scheduling import METADATA_WIDTH, DecodeSplitConfig, compute_schedule, default_num_sms
from . import checks
from .checks import DEVICE_MESSAGES, _require, check_count, check_seqlens_tensor, checks_values
from .dispatch import find_schedule_kernel
from .library import lib


class DecodeSchedule(NamedTuple):
    """Work split for one decode step; compute once per step and share it across layers.

    metadata: int32 [num_parts, 8] on the seqlens' device (layout in torch_mla.scheduling).
    num_splits: int32 [batch + 1], prefix sum of the number of pieces each request is cut into.
    """

    metadata: torch.Tensor
    num_splits: torch.Tensor


def _schedule_run(cache_seqlens: torch.Tensor, num_parts: int):
    """On a GPU with a kernel arch: one launch of the schedule kernel, which checks the lengths
    itself (a negative one prints its index and value and traps). Elsewhere the torch ops of
    compute_schedule, after the lengths' check (a ValueError on CPU tensors)."""
    kernel = find_schedule_kernel(cache_seqlens.device)
    if kernel is None:
        if checks_values(cache_seqlens):
            _require(cache_seqlens < 0, DEVICE_MESSAGES["schedule_seqlens"],
                     lambda r: f"cache_seqlens[{r}] = {int(cache_seqlens[r])}, but lengths must "
                               "be >= 0")
        return compute_schedule(cache_seqlens, num_parts)
    dev = cache_seqlens.device
    meta = torch.empty(num_parts, METADATA_WIDTH, dtype=torch.int32, device=dev)
    splits = torch.empty(cache_seqlens.shape[0] + 1, dtype=torch.int32, device=dev)
    if cache_seqlens.stride(0) != 1:
        cache_seqlens = cache_seqlens.contiguous()
    # The in-kernel check stays in CUDA graphs too: it costs a compare per length.
    kernel(cache_seqlens, meta, splits, int(checks._value_checks))
    return meta, splits


def _schedule_impl(cache_seqlens: torch.Tensor, num_parts: int):
    check_seqlens_tensor(cache_seqlens)
    check_count("num_parts", num_parts)
    return _schedule_run(cache_seqlens, num_parts)


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

    What a schedule depends on: it cuts the stream of every request's 64-key blocks into at
    most num_parts runs of equal length (as few as keep the heaviest part as light as
    num_parts runs would: torch_mla.scheduling; the other parts are empty), so it is a
    function of the batch size, each request's block count
    ``ceil(L / 64)`` (the lengths' cut points; lengths with the same block counts share a
    schedule, the kernels mask the last block by the length they are given) and num_parts.
    s_q, h_q, h_kv and num_sms only choose num_parts, the schedule's size: the kernels read
    it from ``metadata.shape[0]`` (their grid, the workspace), so a schedule made for another
    h_q or s_q still covers every block once (the output is the same; only the balance of the
    work across SMs differs). On a GPU, a schedule made for other lengths is either still
    right or stops the launch with a message, at no host sync (inside CUDA graphs too): the
    kernels walk no block past a request's length, a request's last piece runs to the
    request's end now (a request that has grown keeps its new blocks), and a piece that starts
    past the length or a request with keys but no piece (the schedule saw it empty) makes the
    combine print which request and stop (tests/test_schedule_mismatch.py). On CPU tensors the
    reference path does not read the schedule.

    On a GPU from SM80 up it is one kernel launch (cute_kernels/schedule.py), elsewhere a few
    dozen torch ops (torch_mla.scheduling.compute_schedule); the results are identical. A
    negative length fails: a ValueError on CPU tensors; on a GPU the kernel prints the entry and
    traps (the next synchronising call raises; also inside CUDA graphs), unless
    :func:`torch_mla.set_value_checks` turned the checks off (then it counts as 0).
    """
    check_seqlens_tensor(cache_seqlens)
    if torch.compiler.is_compiling():
        num_parts = _num_parts(cache_seqlens.device, s_q, h_q, num_sms, h_kv)
        meta, splits = torch.ops.torch_mla.get_decode_schedule(cache_seqlens, num_parts)
    else:
        num_parts = _num_parts_cached(cache_seqlens.device, s_q, h_q, num_sms, h_kv)
        meta, splits = _schedule_run(cache_seqlens, num_parts)
    return DecodeSchedule(meta, splits)


def _num_parts(device: torch.device, s_q: int, h_q: int, num_sms: int | None, h_kv: int) -> int:
    check_count("s_q", s_q)
    check_count("h_q", h_q)
    check_count("h_kv", h_kv)
    if h_q % h_kv:
        raise ValueError(f"h_q ({h_q}) must be a multiple of h_kv ({h_kv})")
    if num_sms is None:
        num_sms = default_num_sms(device)
    check_count("num_sms", num_sms)
    return DecodeSplitConfig.from_heuristic(s_q, h_q, num_sms, h_kv).num_parts


# Eager calls repeat the same few shapes every step: the checks and the device query run once
# per shape (typed: 1.0 and True are not 1, and still raise).
_num_parts_cached = functools.lru_cache(maxsize=256, typed=True)(_num_parts)
