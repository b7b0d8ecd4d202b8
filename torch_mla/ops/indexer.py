"""``torch_mla::indexer_logits`` and ``torch_mla::indexer_topk``: DeepSeek-V3.2's lightning
indexer over a paged index-key cache, and :func:`append_index_keys`, which fills that cache.

Validation, then the logits kernel where one exists (:func:`find_indexer_kernel`, the one
dispatch point), else the reference (torch_mla.reference_indexer); then the top-k on the device
(``torch.topk``: a radix selection, then a sort of the ``topk`` selected only) and the positions
turned into cache slots. No call reads a tensor's values on the host, so a decode step with the
indexer compiles with ``fullgraph=True`` and replays in a CUDA graph. Forward-only.
"""

from __future__ import annotations

import warnings

import torch

from ..constants import PAGE_SIZE
from ..contract import indexer_unsupported
from ..reference import append_kv_reference, visible_lengths
from ..reference_indexer import (
    indexer_logits_reference,
    quantize_index_keys,
    slots_of_positions,
)
from . import dispatch
from .cache import ForwardOnlyWrite
from .checks import FP8, check_decode_values, check_slot_values, checks_values
from .checks_indexer import check_append_index_args, check_indexer_args
from .indexer_kernel import indexer_logits_sm90
from .library import forward_only_grads, grad_like, lib


def find_indexer_kernel(q: torch.Tensor, index_cache: torch.Tensor):
    """A callable computing the indexer logits on the GPU for these (validated) inputs, or None
    (the reference).

    The one place an indexer logits kernel plugs in. It is called as ``kernel(q, weights,
    index_cache, index_scale, block_table, cache_seqlens, out)`` and fills ``out`` float32
    [b, s_q, max_blocks * 64] (allocated by the caller, so the launch allocates nothing) with
    the logits :func:`torch_mla.indexer_logits` documents: the same values as the reference up to
    the order of the float32 sums. On SM90 GPUs that is cute_kernels/sm90_indexer.py (bf16 q and
    keys, or e4m3 q and keys with their scales; D 64 or 128, H a multiple of 8, s_q * H <= 128:
    ops/indexer_kernel.py); elsewhere, or for other shapes, the reference, with a warning once
    per reason on a GPU."""
    if not q.is_cuda or dispatch._force_reference():
        return None
    why = _kernel_unsupported(q, index_cache)
    if why is None:
        return indexer_logits_sm90
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"torch_mla.indexer_logits runs the plain-PyTorch reference on this GPU: "
                      f"{why}", stacklevel=3)
    return None


_warned: set[str] = set()


def _kernel_unsupported(q: torch.Tensor, index_cache: torch.Tensor) -> str | None:
    # What validation leaves open: the device, the dtypes, the sizes (weights, table, lengths
    # and the caller's out are as the kernel takes them once check_indexer_args passed).
    cap = dispatch.cuda_capability(q.device)
    if tuple(cap) != (9, 0):
        return f"the indexer kernel is built for SM90 (sm_90a), not compute capability {cap}"
    fp8 = index_cache.dtype == torch.float8_e4m3fn
    if (q.dtype, index_cache.dtype) not in ((torch.bfloat16, torch.bfloat16),
                                            (torch.float8_e4m3fn, torch.float8_e4m3fn)):
        return (f"the indexer kernel takes bf16 q and keys, or float8_e4m3fn q and keys, got "
                f"{q.dtype} q over {index_cache.dtype} keys" + (" (quantize q as the keys)"
                                                                   if fp8 else ""))
    return indexer_unsupported(q.shape[3], q.shape[2], q.shape[1])


def _logits_run(q, weights, index_cache, index_scale, block_table, cache_seqlens):
    kernel = find_indexer_kernel(q, index_cache)
    if kernel is not None:
        b, s_q = q.shape[:2]
        out = weights.new_empty(b, s_q, block_table.shape[1] * PAGE_SIZE)
        kernel(q, weights, index_cache, index_scale, block_table, cache_seqlens, out)
        return out
    if checks_values(cache_seqlens):
        check_decode_values(index_cache.shape[0], block_table, cache_seqlens,
                            "torch_mla.indexer_logits", "index_cache")
    return indexer_logits_reference(q, weights, index_cache, block_table, cache_seqlens,
                                    index_scale)


def select_slots(logits: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                 topk: int) -> torch.Tensor:
    """The top-k of validated logits [b, s_q, max_blocks * 64] as cache slots: int32
    [b, s_q, topk] in descending logit order, -1 past the positions a query token sees.

    ``torch.topk`` selects (a radix select over each row; on CUDA one row is spread over several
    blocks when it is long) and sorts only the topk it keeps. A position a token sees has a finite
    logit and the others -inf, so the selection holds every seen position before any other: the
    entries past ``min(topk, seen)`` are the unseen ones, set to -1 by their position."""
    b, s_q, n = logits.shape
    k = min(topk, n)
    pos = torch.topk(logits, k, dim=-1, sorted=True).indices  # int64 [b, s_q, k]
    seen = pos < visible_lengths(cache_seqlens, s_q, causal=True)[..., None]
    slots = torch.where(seen, slots_of_positions(block_table, pos), -1).to(torch.int32)
    if k < topk:  # (a table narrower than topk: pad; a static shape, no host read)
        slots = torch.nn.functional.pad(slots, (0, topk - k), value=-1)
    return slots


def _logits_impl(q, weights, index_cache, index_scale, block_table, cache_seqlens):
    check_indexer_args(q, weights, index_cache, index_scale, block_table, cache_seqlens)
    return _logits_run(q, weights, index_cache, index_scale, block_table, cache_seqlens)


def _topk_impl(q, weights, index_cache, index_scale, block_table, cache_seqlens, topk: int):
    check_indexer_args(q, weights, index_cache, index_scale, block_table, cache_seqlens, topk)
    logits = _logits_run(q, weights, index_cache, index_scale, block_table, cache_seqlens)
    return select_slots(logits, block_table, cache_seqlens, topk)


lib.impl("indexer_logits", _logits_impl, "CompositeExplicitAutograd")
lib.impl("indexer_topk", _topk_impl, "CompositeExplicitAutograd")


def _setup_context(ctx, inputs, output):
    ctx.like = grad_like(inputs)


def _logits_backward(ctx, grad):
    return forward_only_grads(grad, ctx.like, "indexer_logits")


def _topk_backward(ctx, grad):  # (int32 output: autograd never calls it; registered for opcheck)
    return forward_only_grads(grad, ctx.like, "indexer_topk")


torch.library.register_autograd("torch_mla::indexer_logits", _logits_backward,
                                setup_context=_setup_context, lib=lib)
torch.library.register_autograd("torch_mla::indexer_topk", _topk_backward,
                                setup_context=_setup_context, lib=lib)


def _through_op(*tensors) -> bool:
    grads = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)
    return torch.compiler.is_compiling() or (torch.is_grad_enabled() and grads)


def indexer_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSeek-V3.2's lightning-indexer logits of each query token over its request's cached
    index keys (the scores :func:`indexer_topk` selects from).

    ``logits[b, t, j] = sum_h weights[b, t, h] * relu(q[b, t, h] . k_j)`` (times k_j's scale for
    an FP8 cache) for the positions ``j < cache_seqlens[b] - s_q + t + 1`` (causal among this
    step's s_q tokens), -inf for the others. Forward-only.

    Args:
        q: [batch, s_q, index_n_heads, index_head_dim] in index_cache's dtype (bf16, fp16 or fp32;
            the reference computes in float32 on CPUs), or float8_e4m3fn over an FP8 cache with
            its per-(token, head) scale folded into ``weights``. Last dim contiguous.
        weights: float32 [batch, s_q, index_n_heads], each head's weight with everything that
            multiplies it folded in: the indexer's softmax_scale (index_head_dim ** -0.5), its
            n_heads ** -0.5, an FP8 q's scale.
        index_cache: [num_blocks, 64, index_head_dim], one index key a token on the latent
            cache's pages (same block table, same slots); bf16/fp16/fp32, or float8_e4m3fn with
            ``index_scale``. :func:`append_index_keys` writes it.
        block_table: int32 [batch, max_blocks], page j of request r is ``block_table[r, j]``.
        cache_seqlens: int32 [batch], tokens cached per request including this step's s_q.
        index_scale: float32 [num_blocks, 64], a float8_e4m3fn cache's per-token scales (key =
            ``index_cache.float() * index_scale``); None otherwise.

    Returns:
        float32 [batch, s_q, max_blocks * 64]: position j of request r is its token j.

    Lengths must lie in [0, max_blocks * 64] and the block-table entries a request uses (its
    first ceil(L / 64)) must be pages of the cache: checked on the reference path as the
    dense decode's reference checks them. The SM90 kernel does not check them: its TMA reads
    zeros for a page outside the cache (nothing outside it is read); such a page's slots are
    outside [-1, num_blocks * 64) but for one, and :func:`torch_mla.mla_decode_sparse` stops
    on those the top-k selects. Unused entries are never read.
    """
    args = (q, weights, index_cache, index_scale, block_table, cache_seqlens)
    if _through_op(q, weights):
        return torch.ops.torch_mla.indexer_logits(*args)
    return _logits_impl(*args)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    topk: int,
    *,
    index_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``topk`` cached tokens each query token attends to under DeepSeek Sparse Attention,
    as cache slots for :func:`torch_mla.mla_decode_sparse`.

    The logits of :func:`indexer_logits` (same arguments), then, per query token, the positions
    of its ``topk`` largest logits among those it sees, on the device.

    Returns:
        int32 [batch, s_q, topk]: cache slots ``block_table[r, j // 64] * 64 + j % 64`` of the
        selected positions j, in descending logit order (ties in any order); -1 for the
        entries past the positions the token sees when it sees fewer than topk.
        ``mla_decode_sparse(q, kv_cache, indices)`` takes them as they are (``topk_length``
        None: the -1 entries name no token).
    """
    args = (q, weights, index_cache, index_scale, block_table, cache_seqlens, int(topk))
    if _through_op(q, weights):
        return torch.ops.torch_mla.indexer_topk(*args)
    return _topk_impl(*args)


def append_index_keys(index_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor,
                      index_scale: torch.Tensor | None = None) -> None:
    """Writes index keys into the index-key cache in place (the indexer's :func:`append_kv`).

    Args:
        index_cache: [num_blocks, 64, index_head_dim], contiguous; bf16/fp16/fp32 (k is cast), or
            float8_e4m3fn with ``index_scale``: each key is quantized per token as DeepSeek-V3.2
            does (``torch_mla.reference_indexer.quantize_index_keys``: a power-of-two scale,
            ``2 ** ceil(log2(max(amax, 1e-4) / 448))``, e4m3 values saturated to +-448).
        k: [tokens, index_head_dim], bf16/fp16/fp32, the new tokens' index keys (after the
            indexer's LayerNorm and RoPE).
        slot_mapping: int32/int64 [tokens], as for append_kv (``page * 64 + row``; slots < 0
            are skipped: padding; slots >= 0 distinct).
        index_scale: float32 [num_blocks, 64], written at the same slots; None for a float cache.

    Torch ops on every device, no host sync (CUDA-graph capturable, compiles with fullgraph:
    under torch.compile the op ``torch_mla::append_index_keys``, which writes the rows in place).
    Forward-only, as append_kv: the keys may require grad, a backward through the cache raises.
    """
    check_append_index_args(index_cache, k, slot_mapping, index_scale)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and k.requires_grad):
        torch.ops.torch_mla.append_index_keys(index_cache, k, slot_mapping, index_scale)
    else:
        _append_index_impl(index_cache, k, slot_mapping, index_scale)


def _append_index_impl(index_cache, k, slot_mapping, index_scale=None) -> None:
    # (is_compiling first: dynamo cannot trace checks_values' stream-capture query)
    if not torch.compiler.is_compiling() and slot_mapping.shape[0] > 0 \
            and checks_values(slot_mapping):
        check_slot_values(index_cache.shape[0], slot_mapping, "torch_mla.append_index_keys")
    nb, page, d = index_cache.shape
    if index_cache.dtype != FP8:
        # The latent append's no-sync handling of skipped slots, on a one-head view.
        append_kv_reference(index_cache.view(nb, page, 1, d), k, k[:, :0], slot_mapping)
        return
    keys, scale = quantize_index_keys(k)
    # As bytes: torch has no concatenation (nor where) of float8 tensors on every device.
    keys = keys.view(torch.uint8)
    append_kv_reference(index_cache.view(torch.uint8).view(nb, page, 1, d), keys, keys[:, :0],
                        slot_mapping)
    scale = scale[:, None]
    append_kv_reference(index_scale.view(nb, page, 1, 1), scale, scale[:, :0], slot_mapping)


def _append_index_autograd(index_cache, k, slot_mapping, index_scale=None) -> None:
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.torch_mla.append_index_keys(index_cache, k, slot_mapping, index_scale)
    if torch.is_grad_enabled() and (index_cache.requires_grad or k.requires_grad):
        ForwardOnlyWrite.apply("append_index_keys", index_cache, k)


lib.impl("append_index_keys", _append_index_impl, "CompositeExplicitAutograd")
lib.impl("append_index_keys", _append_index_autograd, "Autograd")


def index_cache_bytes_per_token(index_head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's index key takes in one layer: index_head_dim values, plus its float32
    scale in an FP8 cache."""
    el = torch.empty((), dtype=dtype).element_size()
    return index_head_dim * el + (4 if dtype == FP8 else 0)


__all__ = ["append_index_keys", "find_indexer_kernel", "index_cache_bytes_per_token",
           "indexer_logits", "indexer_topk", "select_slots"]
