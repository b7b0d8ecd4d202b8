"""The ``torch_mla`` operator namespace and the schemas of its ops (pinned by tests/test_ops.py).

``kv_scale`` / ``q_scale`` are the float32 [1] scales of a float8_e4m3fn cache / q (None
otherwise); ``compute`` is "exact" or "fp8" (an fp8 cache's mode, see mla_decode); optional with
defaults at the end, so callers of the bf16/fp16 form are unchanged."""

import torch

lib = torch.library.Library("torch_mla", "DEF")

lib.define(
    "get_decode_schedule(Tensor cache_seqlens, int num_parts) -> (Tensor, Tensor)"
)
lib.define(
    "mla_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, "
    "Tensor sched_metadata, Tensor num_splits, float softmax_scale, bool causal, int d_v, "
    "Tensor? kv_scale=None, Tensor? q_scale=None, str compute=\"exact\") -> (Tensor, Tensor)"
)
lib.define(
    "append_kv(Tensor(a!) kv_cache, Tensor kv_c, Tensor k_pe, Tensor slot_mapping, "
    "Tensor? kv_scale=None) -> ()"
)
# One matmul per head, written token-major (ops/absorb.py; the modules' absorbed projections).
lib.define("_head_matmul(Tensor x, Tensor w, Tensor? tail=None) -> Tensor")
# The "gradient" of a forward-only op: raises when it runs. An op rather than a raise in the
# backward formula, so that torch.compile can trace the backward of a forward that saw inputs
# requiring grad (the forward must keep working) and the error comes when backward really runs.
lib.define("_forward_only_grad(Tensor grad, SymInt[] shape, ScalarType dtype, str op) -> Tensor")


def forward_only_message(op: str) -> str:
    return (f"torch_mla.{op} is forward-only (inference): it has no backward, so no gradient can "
            "flow through it. Run it under torch.no_grad() or torch.inference_mode(), or detach "
            "its inputs; to train, use an attention with a backward (the model's own).")


def _forward_only_grad(grad, shape, dtype, op):
    raise RuntimeError(forward_only_message(op))


lib.impl("_forward_only_grad", _forward_only_grad, "CompositeExplicitAutograd")


def forward_only_grads(grad: torch.Tensor, inputs, op: str) -> tuple:
    """What a forward-only op's backward returns: a raising "gradient" for each floating-point
    tensor input (by its (shape, dtype), saved in setup), None for the others."""
    return tuple(None if like is None else
                 torch.ops.torch_mla._forward_only_grad(grad, like[0], like[1], op)
                 for like in inputs)


def grad_like(inputs) -> list:
    """(shape, dtype) of each floating-point tensor in inputs, None for the others; saved instead
    of the tensors, which a forward-only op must not keep alive (nor see modified in place)."""
    return [(t.shape, t.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else None
            for t in inputs]

# Sparse decode (ops/sparse.py): indices int32 [b, s_q, topk] of cache slots, -1 for none;
# topk_length int32 [b], attn_sink float32 [h_q]; the schedule is the dense one over the
# requests' entry counts.
lib.define(
    "mla_decode_sparse(Tensor q, Tensor kv_cache, Tensor indices, Tensor? topk_length, "
    "Tensor? attn_sink, Tensor sched_metadata, Tensor num_splits, float softmax_scale, int d_v, "
    "Tensor? kv_scale=None) -> (Tensor, Tensor)"
)

# The lightning indexer (ops/indexer.py): q [b, s_q, H, D] (float8_e4m3fn over an FP8 index
# cache), weights float32 [b, s_q, H], the index-key cache [num_blocks, 64, D] with its float32
# [num_blocks, 64] scales when FP8; logits float32 [b, s_q, max_blocks * 64]; the top-k as cache
# slots, int32 [b, s_q, topk], -1 for none.
lib.define(
    "indexer_logits(Tensor q, Tensor weights, Tensor index_cache, Tensor? index_scale, "
    "Tensor block_table, Tensor cache_seqlens) -> Tensor"
)
lib.define(
    "indexer_topk(Tensor q, Tensor weights, Tensor index_cache, Tensor? index_scale, "
    "Tensor block_table, Tensor cache_seqlens, int topk) -> Tensor"
)
# Writes index keys in place (ops/indexer.py): an op of its own so that a compiled step writes
# the new rows into the cache, where inductor's lowering of the torch ops on CUDA copied the
# whole index cache twice a layer (seen on the H200: 2 x 0.5 ms a layer at b 32, context 128k).
lib.define(
    "append_index_keys(Tensor(a!) index_cache, Tensor k, Tensor slot_mapping, "
    "Tensor(b!)? index_scale=None) -> ()"
)
