"""``torch_mla::_absorb_query``: the query of absorbed MLA, ``[q_nope W_UK | q_pe]`` per head,
in the layout mla_decode reads, with the matmul writing its columns in place.

Written as an einsum and a concatenation, the query costs a copy of the whole [b, s, h, 576]
buffer after the matmul: under torch.compile the batched matmul is an extern kernel whose
output inductor cannot place inside the concatenation, so a kernel copies it (13 us a layer at
batch 128 on the H200, 38 MB moved). Here the batched matmul (one matrix per head) writes into
the query's first kv_lora_rank columns through a strided view, which cuBLAS takes as is (its
leading dimension h * 576, the batch stride 576), and only q_pe is copied behind them.
"""

from __future__ import annotations

import torch

from .library import forward_only_grads, grad_like, lib


def _absorb_query_impl(q_nope: torch.Tensor, q_pe: torch.Tensor,
                       w_uk: torch.Tensor) -> torch.Tensor:
    b, h, s, d_nope = q_nope.shape
    rank = w_uk.shape[2]
    if (q_pe.dim() != 4 or tuple(q_pe.shape[:3]) != (b, h, s)
            or tuple(w_uk.shape[:2]) != (h, d_nope)):
        raise ValueError(f"_absorb_query: q_nope [b, h, s, d_nope], q_pe [b, h, s, d_rope] and "
                         f"w_uk [h, d_nope, rank], got {list(q_nope.shape)}, "
                         f"{list(q_pe.shape)} and {list(w_uk.shape)}")
    q = q_nope.new_empty(b, s, h, rank + q_pe.shape[3])
    # [h, b * s, d_nope] @ [h, d_nope, rank] into q's [h, b * s, rank] columns: a view of
    # q_nope where its strides allow (the q_b_proj output's), else a copy.
    lat = q.view(b * s, h, q.shape[3])[..., :rank].transpose(0, 1)
    torch.bmm(q_nope.transpose(0, 1).reshape(h, b * s, d_nope), w_uk, out=lat)
    q[..., rank:].copy_(q_pe.transpose(1, 2))
    return q


lib.impl("_absorb_query", _absorb_query_impl, "CompositeExplicitAutograd")


def _setup_context(ctx, inputs, output):
    ctx.like = grad_like(inputs)


def _backward(ctx, grad_q):
    return forward_only_grads(grad_q, ctx.like, "_absorb_query")


torch.library.register_autograd("torch_mla::_absorb_query", _backward,
                                setup_context=_setup_context, lib=lib)


def absorb_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The absorbed MLA query: ``[q_nope[:, i] @ w_uk[i] | q_pe[:, i]]`` for each head i.

    Args:
        q_nope: [b, h, s, d_nope] (any strides), the query's no-RoPE part.
        q_pe: [b, h, s, d_rope], its rotated RoPE part (cast to q_nope's dtype).
        w_uk: [h, d_nope, rank], the key up-projection absorbed into the query (the first
            d_nope rows of each head's block of kv_b_proj's weight), in q_nope's dtype.

    Returns:
        [b, s, h, rank + d_rope] in q_nope's dtype, contiguous: what mla_decode takes as q.

    Forward-only (inference), as mla_decode: a backward through it raises.
    """
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            q_nope.requires_grad or q_pe.requires_grad or w_uk.requires_grad)):
        return torch.ops.torch_mla._absorb_query(q_nope, q_pe, w_uk)
    return _absorb_query_impl(q_nope, q_pe, w_uk)  # (eager: no dispatcher overhead)
