"""Fake (meta) implementations of every torch_mla op: shapes and dtypes only, no data access."""

import torch

from ..contract import decode_lse_shape, decode_out_shape, schedule_shapes
from ..ops import library  # noqa: F401  (defines the ops first)
from ..ops.checks import decode_out_dtype


@torch.library.register_fake("torch_mla::get_decode_schedule")
def _get_decode_schedule_fake(cache_seqlens, num_parts):
    meta_shape, splits_shape = schedule_shapes(cache_seqlens.shape[0], num_parts)
    return (cache_seqlens.new_empty(meta_shape, dtype=torch.int32),
            cache_seqlens.new_empty(splits_shape, dtype=torch.int32))


@torch.library.register_fake("torch_mla::mla_decode")
def _mla_decode_fake(q, kv_cache, block_table, cache_seqlens, sched_metadata, num_splits,
                     softmax_scale, causal, d_v, kv_scale=None, q_scale=None,
                     compute="exact"):
    b, s_q, h_q, _ = q.shape
    out = q.new_empty(decode_out_shape(b, s_q, h_q, d_v), dtype=decode_out_dtype(q.dtype))
    lse = q.new_empty(decode_lse_shape(b, s_q, h_q), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("torch_mla::_head_matmul")
def _head_matmul_fake(x, w, tail=None):
    b, s, h, _ = x.shape
    return x.new_empty((b, s, h, w.shape[2] + (0 if tail is None else tail.shape[3])))


@torch.library.register_fake("torch_mla::append_kv")
def _append_kv_fake(kv_cache, kv_c, k_pe, slot_mapping, kv_scale=None):
    return None


@torch.library.register_fake("torch_mla::_forward_only_grad")
def _forward_only_grad_fake(grad, shape, dtype, op):
    return grad.new_empty(shape, dtype=dtype)

from . import indexer, sparse  # noqa: E402, F401  (the lightning indexer, sparse decode)
