"""Fake (meta) implementations of the indexer ops: shapes and dtypes only, no data access."""

import torch

from ..constants import PAGE_SIZE
from ..ops import library  # noqa: F401  (defines the ops first)


@torch.library.register_fake("torch_mla::indexer_logits")
def _indexer_logits_fake(q, weights, index_cache, index_scale, block_table, cache_seqlens):
    b, s_q = q.shape[:2]
    return q.new_empty((b, s_q, block_table.shape[1] * PAGE_SIZE), dtype=torch.float32)


@torch.library.register_fake("torch_mla::indexer_topk")
def _indexer_topk_fake(q, weights, index_cache, index_scale, block_table, cache_seqlens, topk):
    b, s_q = q.shape[:2]
    return q.new_empty((b, s_q, topk), dtype=torch.int32)


@torch.library.register_fake("torch_mla::append_index_keys")
def _append_index_keys_fake(index_cache, k, slot_mapping, index_scale=None):
    return None
