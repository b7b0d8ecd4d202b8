"""The ``torch_mla`` operator namespace and the schemas of its ops (pinned by tests/test_ops.py)."""

import torch

lib = torch.library.Library("torch_mla", "DEF")

lib.define(
    "get_decode_schedule(Tensor cache_seqlens, int num_parts) -> (Tensor, Tensor)"
)
lib.define(
    "mla_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, "
    "Tensor sched_metadata, Tensor num_splits, float softmax_scale, bool causal, int d_v) "
    "-> (Tensor, Tensor)"
)
lib.define(
    "append_kv(Tensor(a!) kv_cache, Tensor kv_c, Tensor k_pe, Tensor slot_mapping) -> ()"
)
