"""``torch_mla::append_kv``: writes new tokens' latents into the paged cache, in place.
Forward-only: a cache written from inputs that require grad raises on backward."""

from __future__ import annotations

import torch

from ..reference import append_kv_reference
from .checks import check_append_args
from .library import forward_only_grads, grad_like, lib


def _append_impl(kv_cache, kv_c, k_pe, slot_mapping) -> None:
    check_append_args(kv_cache, kv_c, k_pe, slot_mapping)
    append_kv_reference(kv_cache, kv_c, k_pe, slot_mapping)


lib.impl("append_kv", _append_impl, "CompositeExplicitAutograd")


class _ForwardOnlyWrite(torch.autograd.Function):
    """Marks kv_cache as written from the sources: a backward through it raises."""

    @staticmethod
    def forward(ctx, kv_cache, *sources):
        ctx.mark_dirty(kv_cache)
        ctx.like = grad_like(sources)
        return kv_cache

    @staticmethod
    def backward(ctx, grad):
        return (None, *forward_only_grads(grad, ctx.like, "append_kv"))


def _append_autograd(kv_cache, kv_c, k_pe, slot_mapping) -> None:
    # register_autograd does not take ops that mutate an input: an Autograd kernel instead.
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.torch_mla.append_kv(kv_cache, kv_c, k_pe, slot_mapping)
    if torch.is_grad_enabled() and (kv_cache.requires_grad or kv_c.requires_grad
                                    or k_pe.requires_grad):
        _ForwardOnlyWrite.apply(kv_cache, kv_c, k_pe)


lib.impl("append_kv", _append_autograd, "Autograd")


def append_kv(
    kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes new tokens' latents into the paged cache in place. Forward-only (inference): the
    inputs may require grad, but a backward through the written cache raises.

    Args:
        kv_cache: [num_blocks, 64, 1, d_v + d_rope] (bf16/fp16/fp32), the persistent cache (one
            latent head); token slot s is page ``s // 64``, row ``s % 64``.
        kv_c: [T, d_v] compressed latents (after kv_a_layernorm); cast to the cache dtype.
        k_pe: [T, d_rope] rotary keys (RoPE already applied); cast to the cache dtype.
        slot_mapping: int32/int64 [T], the slot of each token, < num_blocks * 64; negative
            entries are skipped (padding) and may repeat, the others must be distinct. Checked
            on CPU tensors with a ValueError, on CUDA tensors by device-side asserts (see
            :func:`torch_mla.set_value_checks`).
    """
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (kv_cache, kv_c, k_pe))):
        torch.ops.torch_mla.append_kv(kv_cache, kv_c, k_pe, slot_mapping)
    else:
        _append_impl(kv_cache, kv_c, k_pe, slot_mapping)
