"""Input validation for the lightning indexer (:func:`torch_mla.indexer_logits`,
:func:`torch_mla.indexer_topk`) and for appending index keys. Shapes, dtypes and devices read
metadata only; the values (lengths, used block-table entries, slots) go through the dense
checks (checks.check_decode_values, checks.check_slot_values): a ValueError naming the entry
on CPU tensors, an asynchronous device-side assert elsewhere (off inside CUDA-graph captures and
with set_value_checks(False))."""

from __future__ import annotations

import torch

from ..constants import PAGE_SIZE
from .checks import DTYPES, FP8, _fail, _shape, check_count, check_seqlens_tensor


def _tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_index_cache(index_cache: torch.Tensor, index_scale) -> None:
    """index_cache [num_blocks, 64, D] of a float dtype, or float8_e4m3fn with index_scale
    float32 [num_blocks, 64] on its device; index_scale None otherwise."""
    _tensor("index_cache", index_cache)
    if index_cache.dim() != 3 or index_cache.shape[1] != PAGE_SIZE:
        _fail(f"index_cache must have shape [num_blocks, {PAGE_SIZE}, index_head_dim] (one "
              f"index key a token, on the latent cache's pages), got {_shape(index_cache)}")
    if index_cache.dtype == FP8:
        want = (index_cache.shape[0], PAGE_SIZE)
        if not isinstance(index_scale, torch.Tensor):
            _fail(f"index_cache is float8_e4m3fn: pass index_scale=, float32 [num_blocks, "
                  f"{PAGE_SIZE}] = {list(want)} (key = index_cache.float() * index_scale)")
        if index_scale.dtype != torch.float32 or tuple(index_scale.shape) != want:
            _fail(f"index_scale must be float32 [num_blocks, {PAGE_SIZE}] = {list(want)}, got "
                  f"{index_scale.dtype} {_shape(index_scale)}")
        if index_scale.device != index_cache.device:
            _fail(f"index_scale must be on index_cache's device ({index_cache.device}), got "
                  f"{index_scale.device}")
    elif index_cache.dtype not in DTYPES:
        _fail(f"index_cache must be bfloat16, float16, float32 or float8_e4m3fn, got "
              f"{index_cache.dtype}")
    elif index_scale is not None:
        _fail(f"index_scale is the scale of a float8_e4m3fn index_cache; this one is "
              f"{index_cache.dtype}: pass index_scale=None")


def check_indexer_args(q, weights, index_cache, index_scale, block_table, cache_seqlens,
                       topk: int | None = None) -> None:
    """Validates the indexer ops' arguments (shapes, dtypes, devices); raises ValueError or
    TypeError. Values: checks.check_decode_values."""
    for name, t in (("q", q), ("weights", weights), ("block_table", block_table)):
        _tensor(name, t)
    check_index_cache(index_cache, index_scale)
    if q.dim() != 4:
        _fail(f"q must have shape [batch, s_q, index_n_heads, index_head_dim], got {_shape(q)}")
    b, s_q, h, d = q.shape
    if s_q < 1 or h < 1:
        _fail(f"q must have s_q >= 1 and index_n_heads >= 1, got s_q={s_q}, heads={h}")
    if d != index_cache.shape[2]:
        _fail(f"q's head dim ({d}) must equal index_cache's index_head_dim "
              f"({index_cache.shape[2]})")
    if index_cache.dtype == FP8:
        if q.dtype != FP8:
            _fail(f"over a float8_e4m3fn index_cache q must be float8_e4m3fn too (quantize it "
                  f"per (token, head) and fold its scale into weights), got {q.dtype}")
    elif q.dtype != index_cache.dtype:
        _fail(f"q must be index_cache's dtype ({index_cache.dtype}), got {q.dtype}")
    if weights.dtype != torch.float32 or tuple(weights.shape) != (b, s_q, h):
        _fail(f"weights must be float32 [batch, s_q, index_n_heads] = [{b}, {s_q}, {h}], got "
              f"{weights.dtype} {_shape(weights)}")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != b:
        _fail(f"block_table must be int32 [batch, max_blocks] with batch = {b}, got "
              f"{block_table.dtype} {_shape(block_table)}")
    check_seqlens_tensor(cache_seqlens)
    if cache_seqlens.shape[0] != b:
        _fail(f"cache_seqlens must have shape [batch] = [{b}], got {_shape(cache_seqlens)}")
    if topk is not None:
        check_count("topk", topk)
    named = [("q", q), ("weights", weights), ("index_cache", index_cache),
             ("block_table", block_table), ("cache_seqlens", cache_seqlens)]
    if any(t.device != q.device for _, t in named):
        _fail("q, weights, index_cache, block_table and cache_seqlens must be on one device, "
              "got " + ", ".join(f"{n}={t.device}" for n, t in named))
    if q.stride(-1) != 1 or index_cache.stride(-1) != 1:
        _fail("q's and index_cache's last dimensions must be contiguous (stride 1)")


def check_append_index_args(index_cache, k, slot_mapping, index_scale) -> None:
    """Validates :func:`torch_mla.append_index_keys`' arguments (shapes, dtypes, devices)."""
    for name, t in (("k", k), ("slot_mapping", slot_mapping)):
        _tensor(name, t)
    check_index_cache(index_cache, index_scale)
    if not index_cache.is_contiguous():
        _fail("index_cache must be contiguous")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail(f"slot_mapping must be int32 or int64 [tokens], got {slot_mapping.dtype} "
              f"{_shape(slot_mapping)}")
    T = slot_mapping.shape[0]
    if k.dim() != 2 or k.shape[0] != T or k.shape[1] != index_cache.shape[2]:
        _fail(f"k must be [tokens, index_head_dim] = [{T}, {index_cache.shape[2]}] (as many "
              f"tokens as slot_mapping), got {_shape(k)}")
    if not k.is_floating_point() or k.dtype == FP8:
        _fail(f"k must be bfloat16, float16 or float32 (it is quantized here for an FP8 cache), "
              f"got {k.dtype}")
    if k.device != index_cache.device or slot_mapping.device != index_cache.device:
        _fail(f"index_cache, k and slot_mapping must be on one device, got {index_cache.device}, "
              f"{k.device} and {slot_mapping.device}")
