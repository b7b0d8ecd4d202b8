"""Fake (meta) implementation of sparse decode: shapes and dtypes only, no data access."""

import torch

from ..ops import library  # noqa: F401  (defines the ops first)
from ..ops.checks import decode_out_dtype


@torch.library.register_fake("torch_mla::mla_decode_sparse")
def _mla_decode_sparse_fake(q, kv_cache, indices, topk_length, attn_sink, sched_metadata,
                            num_splits, softmax_scale, d_v, kv_scale=None):
    b, s_q, h_q, _ = q.shape
    out = q.new_empty((b, s_q, h_q, d_v), dtype=decode_out_dtype(q.dtype))
    lse = q.new_empty((b, h_q, s_q), dtype=torch.float32)
    return out, lse
