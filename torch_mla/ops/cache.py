"""``torch_mla::append_kv``: writes new tokens' latents into the paged cache, in place."""

from __future__ import annotations

import torch

from ..reference import append_kv_reference
from .checks import check_append_args
from .library import lib


def _append_impl(kv_cache, kv_c, k_pe, slot_mapping) -> None:
    check_append_args(kv_cache, kv_c, k_pe, slot_mapping)
    append_kv_reference(kv_cache, kv_c, k_pe, slot_mapping)


lib.impl("append_kv", _append_impl, "CompositeExplicitAutograd")


def append_kv(
    kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes new tokens' latents into the paged cache in place.

    Args:
        kv_cache: [num_blocks, 64, 1, d_v + d_rope] (bf16/fp16/fp32), the persistent cache; token
            slot s is page ``s // 64``, row ``s % 64``.
        kv_c: [T, d_v] compressed latents (after kv_a_layernorm); cast to the cache dtype.
        k_pe: [T, d_rope] rotary keys (RoPE already applied); cast to the cache dtype.
        slot_mapping: int32/int64 [T], the slot of each token; negative entries are skipped
            (padding). Slots must be distinct.
    """
    if torch.compiler.is_compiling():
        torch.ops.torch_mla.append_kv(kv_cache, kv_c, k_pe, slot_mapping)
    else:
        _append_impl(kv_cache, kv_c, k_pe, slot_mapping)
