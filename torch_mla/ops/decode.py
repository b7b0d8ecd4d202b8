"""``torch_mla::mla_decode``: validation, then the CuTe DSL kernel where one exists, else the
reference. Forward-only: its autograd formula raises (see library.forward_only_message)."""

from __future__ import annotations

import torch

from ..constants import D_V
from ..reference import mla_decode_reference
from .checks import (
    check_decode_args,
    check_decode_call,
    check_decode_values,
    checks_values,
    unpack_schedule,
)
from .dispatch import find_decode_kernel
from .library import forward_only_grads, grad_like, lib
from .schedule import DecodeSchedule, get_decode_schedule


def _decode_run(q, kv_cache, block_table, cache_seqlens, sched_metadata, num_splits,
                softmax_scale: float, causal: bool, d_v: int, kv_scale=None, q_scale=None,
                compute: str = "exact"):
    # compute="fp8" permits e4m3 Q and P: the SM90 kernel's fast mode; the fp32 reference
    # (CPU, other GPUs) is at least as accurate (decode_backend says which runs).
    kernel = find_decode_kernel(q, kv_cache, d_v)
    if kernel is not None:
        # The kernels check the lengths and the page ids they use themselves, at no cost and
        # inside CUDA graphs too: a bad value stops the launch with a message.
        args = (q, kv_cache, block_table, cache_seqlens, sched_metadata, num_splits,
                softmax_scale, causal)
        if kv_scale is None:
            return kernel(*args)
        return kernel(*args, kv_scale, q_scale, compute)
    if checks_values(cache_seqlens):
        check_decode_values(kv_cache.shape[0], block_table, cache_seqlens)
    args = (q, kv_cache, block_table, cache_seqlens, softmax_scale, causal, d_v)
    if kv_scale is None and q_scale is None:
        return mla_decode_reference(*args)  # (the bf16/fp16 call as it always was)
    return mla_decode_reference(*args, kv_scale=kv_scale, q_scale=q_scale)


def _decode_impl(q, kv_cache, block_table, cache_seqlens, sched_metadata, num_splits,
                 softmax_scale: float, causal: bool, d_v: int, kv_scale=None, q_scale=None,
                 compute: str = "exact"):
    check_decode_call(q, kv_cache, block_table, cache_seqlens, sched_metadata, num_splits, d_v,
                      causal, kv_scale, q_scale, compute)
    return _decode_run(q, kv_cache, block_table, cache_seqlens, sched_metadata, num_splits,
                       softmax_scale, causal, d_v, kv_scale, q_scale, compute)


lib.impl("mla_decode", _decode_impl, "CompositeExplicitAutograd")


def _setup_context(ctx, inputs, output):
    ctx.like = grad_like(inputs)


def _backward(ctx, grad_out, grad_lse):
    return forward_only_grads(grad_out, ctx.like, "mla_decode")


torch.library.register_autograd("torch_mla::mla_decode", _backward, setup_context=_setup_context,
                                lib=lib)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    schedule: DecodeSchedule | tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    softmax_scale: float | None = None,
    causal: bool = False,
    d_v: int = D_V,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    compute: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-head latent attention decode over a paged latent cache (FlashMLA's dense decode).

    Every query head attends to a cached latent per token: K is the whole cached row
    (d_qk = d_v + d_rope wide), V its first d_v columns. With h_kv > 1 latent heads (FlashMLA's
    interface), query head h reads KV head ``h // (h_q // h_kv)``.

    Forward-only (inference): inputs may require grad, but backward raises.

    Args:
        q: [batch, s_q, h_q, d_qk], bf16/fp16 (fp32 runs on the reference path), or
            float8_e4m3fn with ``q_scale`` (only with an fp8 cache); last dim contiguous. With
            absorbed weights, d_qk = kv_lora_rank + qk_rope_head_dim.
        kv_cache: [num_blocks, 64, h_kv, d_qk], contiguous; page size 64, h_kv latent heads (1
            for DeepSeek), h_q a multiple of h_kv. In q's dtype, or float8_e4m3fn (the FP8
            latent cache, d_qk bytes per token and KV head) with ``kv_scale``: the latent a row
            stands for is ``row.float() * kv_scale`` (see :func:`torch_mla.append_kv`).
        block_table: int32 [batch, max_blocks]; page j of request r is ``block_table[r, j]``.
            Entries request r uses (j < ceil(L_r / 64)) must be in [0, num_blocks); the others
            are never read and may hold anything.
        cache_seqlens: int32 [batch], keys per request, 0 <= L <= max_blocks * 64.
        schedule: from :func:`get_decode_schedule` for these ``cache_seqlens`` (or its
            ``(metadata, num_splits)`` tuple); computed here if None. Pass it in to share it
            across layers and keep CUDA graphs free of it.
        softmax_scale: scale of QK^T before the softmax (default d_qk ** -0.5).
        causal: for s_q > 1, query token i sees keys ``< L - s_q + i + 1`` (speculative decoding).
        d_v: width of V and of the output (512 for DeepSeek-V2/V3).
        kv_scale: float32 [1] on the cache's device, the dequantization scale of a
            float8_e4m3fn ``kv_cache``: required with one, refused without. One scale per
            cache tensor for now (the argument is a tensor so that finer scales, per token or
            per column block, can come later).
        q_scale: float32 [1], the dequantization scale of a float8_e4m3fn ``q`` (value =
            ``q.float() * q_scale``): required with one, refused otherwise.
        compute: with a float8_e4m3fn cache, "exact" (default: the scores and P V in 16-bit
            MMAs over the dequantized pages; the bf16 kernel's error on top of the cache's own)
            or "fp8" ("fast mode": Q, quantized per row, in float8_e4m3fn on the fp8 tensor
            cores, and P too except on the keys-on-M fast variant, which keeps P in f16 (up
            to 16 query rows a KV head, or 32 from a batch of 4); allowed up to 2.5x the
            error the fp8 cache itself costs): the SM90
            kernel (H100/H200); elsewhere the fp32 reference runs, which is at least as
            accurate (:func:`torch_mla.ops.dispatch.decode_backend` says which runs). Refused
            with a 16-bit cache.

    Returns:
        out: [batch, s_q, h_q, d_v] in q's dtype (bf16 for a float8_e4m3fn q).
        lse: float32 [batch, h_q, s_q], natural-log log-sum-exp of the scaled scores.
        A query token that sees no key gets out = 0 and lse = +inf.

    Lengths and used block-table entries are checked: on CPU tensors with a ValueError naming
    the entry; on a GPU by the kernel itself, which stops with a message naming the entry (a
    "CUDA error: unspecified launch failure" at the next synchronisation, after the message
    is printed), inside CUDA graphs too; on the GPU reference path by device-side asserts
    (see :func:`torch_mla.set_value_checks`).

    A float8_e4m3fn cache runs the SM90 kernel on H100/H200 ("exact" mode: the pages are
    expanded to bf16/fp16 on chip, the matmuls are the 16-bit kernel's, q_scale and kv_scale
    fold into the softmax scale and the output), with a bf16/fp16 or float8_e4m3fn q; elsewhere
    (and with a float32 q) the reference (dequantize to float32, then the fp32 math; on a GPU
    with a one-time warning).
    """
    compiling = torch.compiler.is_compiling()
    # Shapes and dtypes here; values where they are used (_decode_run): in the kernel, or before
    # the reference runs. (Traced by torch.compile, the tensors hold no values.)
    if schedule is None or compiling:  # (before the schedule reads cache_seqlens)
        check_decode_args(q, kv_cache, block_table, cache_seqlens, d_v, causal, kv_scale,
                          q_scale, compute)
        if schedule is None:
            schedule = get_decode_schedule(cache_seqlens, q.shape[1], q.shape[2],
                                           h_kv=kv_cache.shape[2])
    metadata, num_splits = unpack_schedule(schedule)
    if not compiling:  # (eager: skipped for a signature checked before)
        check_decode_call(q, kv_cache, block_table, cache_seqlens, metadata, num_splits, d_v,
                          causal, kv_scale, q_scale, compute)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    args = (q, kv_cache, block_table, cache_seqlens, metadata, num_splits,
            float(softmax_scale), bool(causal), int(d_v))
    # The op (with its autograd formula) where autograd or the compiler needs it; else the
    # implementation directly, which saves the dispatcher's overhead on every layer.
    if compiling or (torch.is_grad_enabled() and (q.requires_grad or kv_cache.requires_grad)):
        if kv_scale is None and q_scale is None:  # (the bf16/fp16 graph stays as it was)
            return torch.ops.torch_mla.mla_decode(*args)
        if compute == "exact":  # (and so does the exact-mode graph)
            return torch.ops.torch_mla.mla_decode(*args, kv_scale=kv_scale, q_scale=q_scale)
        return torch.ops.torch_mla.mla_decode(*args, kv_scale=kv_scale, q_scale=q_scale,
                                              compute=compute)
    return _decode_run(*args, kv_scale, q_scale, compute)
