"""``torch_mla::_head_matmul``: one matrix product per head, written token-major, the absorbed
MLA layer's two batched matmuls (the query's ``q_nope W_UK``, the output's ``o W_UV``).

A batched matmul over the heads puts its result head-major, [h, tokens, n], and the layer needs
it token-major, [tokens, h, n] (the query as mla_decode reads it, the output as o_proj reads it).
Written as an einsum, that costs a copy under torch.compile: the matmul is an extern kernel that
inductor neither lets write into a concatenation nor in a permuted layout, so a kernel rewrites
the result (the query at batch 128 on the H200: 13 us a layer, the whole [b, 1, 128, 576]
buffer). Here the matmul writes token-major through a strided view of the output (cuBLAS with
leading dimension h * width and batch stride width; ATen's bmm takes such an ``out`` as it is),
and the query's q_pe columns are copied behind the product (``tail``).
"""

from __future__ import annotations

import torch

from .library import forward_only_grads, grad_like, lib


def _head_matmul_impl(x: torch.Tensor, w: torch.Tensor,
                      tail: torch.Tensor | None = None) -> torch.Tensor:
    b, s, h, k = x.shape
    n = w.shape[2]
    width = n + (0 if tail is None else tail.shape[3])
    if tuple(w.shape[:2]) != (h, k) or (tail is not None and (
            tail.dim() != 4 or tuple(tail.shape[:3]) != (b, s, h))):
        raise ValueError(f"_head_matmul: x [b, s, h, k], w [h, k, n] and tail None or "
                         f"[b, s, h, t], got {list(x.shape)}, {list(w.shape)} and "
                         f"{None if tail is None else list(tail.shape)}")
    out = x.new_empty(b, s, h, width)
    # [h, b * s, k] @ [h, k, n] into out's [h, b * s, n] columns: a view of x where its strides
    # allow (q_b_proj's output, mla_decode's), else a copy.
    torch.bmm(x.reshape(b * s, h, k).transpose(0, 1), w,
              out=out.view(b * s, h, width)[..., :n].transpose(0, 1))
    if tail is not None:
        out[..., n:].copy_(tail)
    return out


lib.impl("_head_matmul", _head_matmul_impl, "CompositeExplicitAutograd")


def _setup_context(ctx, inputs, output):
    ctx.like = grad_like(inputs)


def _backward(ctx, grad_out):
    return forward_only_grads(grad_out, ctx.like, "_head_matmul")


torch.library.register_autograd("torch_mla::_head_matmul", _backward,
                                setup_context=_setup_context, lib=lib)


def head_matmul(x: torch.Tensor, w: torch.Tensor,
                tail: torch.Tensor | None = None) -> torch.Tensor:
    """``[x[:, :, i] @ w[i] | tail[:, :, i]]`` for each head i, laid out token-major.

    Args:
        x: [b, s, h, k] (any strides).
        w: [h, k, n] (any strides), in x's dtype.
        tail: None, or [b, s, h, t]: columns appended after each head's product (cast to x's
            dtype), bit for bit.

    Returns:
        [b, s, h, n + t] in x's dtype, contiguous.

    Forward-only (inference), as mla_decode: a backward through it raises.
    """
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
            x.requires_grad or w.requires_grad or (tail is not None and tail.requires_grad))):
        return torch.ops.torch_mla._head_matmul(x, w, tail)
    return _head_matmul_impl(x, w, tail)  # (eager: no dispatcher overhead)
