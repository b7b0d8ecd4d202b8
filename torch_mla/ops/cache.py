"""``torch_mla::append_kv``: writes new tokens' latents into the paged cache, in place.
Forward-only: a cache written from inputs that require grad raises on backward."""

from __future__ import annotations

import torch

from ..reference import append_kv_reference
from . import checks
from .checks import check_append_args
from .dispatch import find_append_kernel
from .library import forward_only_grads, grad_like, lib
from .sparse import append_kv_fp8_ds_mla

# The kernel's repeat check reads T^2 / 2 slots from L1/L2 (cute_kernels/append_kv.py): up to
# this many tokens it costs about as much as the copy itself.
REPEAT_CHECK_MAX_TOKENS = 2048


def _append_impl(kv_cache, kv_c, k_pe, slot_mapping, kv_scale=None) -> None:
    if kv_cache.dtype == torch.uint8:  # DeepSeek-V3.2's 656-byte FP8 rows (ops/sparse.py)
        return append_kv_fp8_ds_mla(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)
    check_append_args(kv_cache, kv_c, k_pe, slot_mapping, values=False, kv_scale=kv_scale)
    T = slot_mapping.shape[0]
    kernel = find_append_kernel(kv_cache, kv_c, k_pe, slot_mapping) if T else None
    if kernel is None:
        if T and checks.checks_values(slot_mapping):
            checks.check_slot_values(kv_cache.shape[0], slot_mapping)
        append_kv_reference(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)
        return
    # The kernel checks the slots itself (printf + trap, in CUDA graphs too): the range always,
    # repeats up to REPEAT_CHECK_MAX_TOKENS tokens; longer slot arrays (prefill) have their
    # repeats checked by torch ops, outside graphs.
    on = checks._value_checks
    in_kernel = on and T <= REPEAT_CHECK_MAX_TOKENS
    if on and not in_kernel and checks.checks_values(slot_mapping):
        checks.check_slot_repeats(slot_mapping)
    if slot_mapping.stride(0) != 1:
        slot_mapping = slot_mapping.contiguous()
    cache, srcs = _plain(kv_cache), (_rows_16b(_plain(kv_c)), _rows_16b(_plain(k_pe)))
    if kv_scale is None:
        kernel(cache, *srcs, slot_mapping, int(on), int(in_kernel))
    else:  # the e4m3 bytes (DLPack has no fp8 type)
        kernel(cache.view(torch.uint8), *srcs, slot_mapping, int(on), int(in_kernel),
               kv_scale if kv_scale.dim() == 1 else kv_scale.reshape(1))


def _plain(x: torch.Tensor) -> torch.Tensor:
    """x without autograd (the forward-only op reaches here below autograd, but DLPack still
    refuses tensors that require grad); the same storage, so writes land in x."""
    return x.detach() if x.requires_grad else x


def _rows_16b(x: torch.Tensor) -> torch.Tensor:
    """x itself when each row starts 16-byte aligned and is contiguous (a view of a wider
    projection output usually is), else an aligned copy."""
    if x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0:
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


lib.impl("append_kv", _append_impl, "CompositeExplicitAutograd")


class ForwardOnlyWrite(torch.autograd.Function):
    """Marks a cache as written from the sources by the op named ``op``: a backward through it
    raises."""

    @staticmethod
    def forward(ctx, op, cache, *sources):
        ctx.mark_dirty(cache)
        ctx.like, ctx.op = grad_like(sources), op
        return cache

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *forward_only_grads(grad, ctx.like, ctx.op))


def _append_autograd(kv_cache, kv_c, k_pe, slot_mapping, kv_scale=None) -> None:
    # register_autograd does not take ops that mutate an input: an Autograd kernel instead.
    with torch._C._AutoDispatchBelowAutograd():
        torch.ops.torch_mla.append_kv(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)
    if torch.is_grad_enabled() and (kv_cache.requires_grad or kv_c.requires_grad
                                    or k_pe.requires_grad):
        ForwardOnlyWrite.apply("append_kv", kv_cache, kv_c, k_pe)


lib.impl("append_kv", _append_autograd, "Autograd")


def append_kv(
    kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Writes new tokens' latents into the paged cache in place. Forward-only (inference): the
    inputs may require grad, but a backward through the written cache raises.

    Args:
        kv_cache: [num_blocks, 64, 1, d_v + d_rope] (bf16/fp16/fp32, or float8_e4m3fn with
            ``kv_scale``), the persistent cache (one latent head); token slot s is page
            ``s // 64``, row ``s % 64``.
        kv_c: [T, d_v] compressed latents (after kv_a_layernorm); cast to the cache dtype.
        k_pe: [T, d_rope] rotary keys (RoPE already applied); cast to the cache dtype.
        slot_mapping: int32/int64 [T], the slot of each token, < num_blocks * 64; negative
            entries are skipped (padding) and may repeat, the others must be distinct. Checked
            on CPU tensors with a ValueError; on CUDA tensors by the kernel itself (a message
            naming the entries on stdout, then the launch fails: the next synchronising call
            raises, and the CUDA context is lost), in CUDA graphs too; where append_kv has no
            kernel, by device-side asserts (see :func:`torch_mla.set_value_checks`). Slots past
            the cache are never written, also with the checks off.
        kv_scale: float32 [1] on the cache's device, required with a float8_e4m3fn cache (and
            refused with any other): row = ``[kv_c | k_pe] / kv_scale``, saturated to +-448
            (e4m3fn's largest finite value; values past ``448 * kv_scale`` are clipped, not
            NaN) and rounded to nearest even; decode reads ``row.float() * kv_scale``. Choose
            it so the largest latent magnitude maps near 448, e.g. ``amax / 448`` measured over
            a prefill's latents. One scale per cache tensor for now.

    A uint8 [num_blocks, 64, 1, 656] cache is DeepSeek-V3.2's FP8 layout (see
    :func:`torch_mla.mla_decode_sparse`): kv_c [T, 512] is quantized per 128 values with a
    power-of-two scale, k_pe [T, 64] stored as bf16, as DeepSeek's reference does
    (torch_mla.reference_sparse.quantize_fp8_ds_mla; torch ops on every device for now);
    kv_scale must be None.

    One kernel launch on a GPU from SM80 up with a bf16/fp16 cache of 576-wide rows (512 + 64),
    and from SM89 up with a float8_e4m3fn one (bit-identical to the reference's quantization);
    otherwise (a CPU, an older GPU, other widths) the reference's torch ops.
    """
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (kv_cache, kv_c, k_pe))):
        if kv_scale is None:  # (the bf16/fp16 graph stays as it was)
            torch.ops.torch_mla.append_kv(kv_cache, kv_c, k_pe, slot_mapping)
        else:
            torch.ops.torch_mla.append_kv(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)
    else:
        _append_impl(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)


def slot_mapping(block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                 num_tokens: int) -> torch.Tensor:
    """The cache slots of each request's next ``num_tokens`` tokens: ``append_kv``'s slot_mapping.

    ``cache_seqlens`` are the lengths *before* this step's tokens are written: request r's new
    tokens take positions ``cache_seqlens[r] .. cache_seqlens[r] + num_tokens - 1``, and position
    p lives in slot ``block_table[r, p // 64] * 64 + p % 64``. A decode step therefore calls this,
    then :func:`append_kv`, then advances ``cache_seqlens`` by ``num_tokens`` before scheduling
    and decoding (whose lengths include the new tokens).

    Pure tensor ops on the block table's device: no host synchronisation, so it can run inside
    ``torch.compile(fullgraph=True)`` and CUDA-graph capture.

    Args:
        block_table: int32 [batch, max_blocks]; page j of request r is ``block_table[r, j]``.
        cache_seqlens: int32 [batch], tokens already cached per request.
        num_tokens: new tokens per request (1 for plain decode, more with speculative decoding).

    Returns:
        int64 [batch * num_tokens], request-major (token i of request r at ``r * num_tokens + i``,
        the order of ``kv_c.reshape(batch * num_tokens, -1)`` for kv_c [batch, num_tokens, d]).

    Raises:
        ValueError (CPU tensors): a new token's position lies past the pages the block table
        holds (``max_blocks * 64``) or a length is negative. On CUDA the same check runs on the
        device (``torch._assert_async``: the next synchronising call fails) unless turned off with
        :func:`torch_mla.set_value_checks`, and under ``torch.compile`` too (a RuntimeError on a
        CPU). Either way such tokens get slot -1, which :func:`append_kv` skips, so nothing is
        ever written out of bounds.
    """
    from . import checks  # (local: this helper is appended below the op's own imports)

    if not isinstance(block_table, torch.Tensor) or not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError("block_table and cache_seqlens must be torch.Tensors")
    if block_table.dim() != 2 or block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32 [batch, max_blocks], got {block_table.dtype} "
                         f"{list(block_table.shape)}")
    checks.check_seqlens_tensor(cache_seqlens)
    b, max_blocks = block_table.shape
    if cache_seqlens.shape[0] != b or cache_seqlens.device != block_table.device:
        raise ValueError(f"cache_seqlens ({cache_seqlens.shape[0]} entries on "
                         f"{cache_seqlens.device}) must match block_table ({b} rows on "
                         f"{block_table.device})")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    page_size, device = checks.PAGE_SIZE, block_table.device
    cap = max_blocks * page_size
    pos = cache_seqlens.to(torch.int64)[:, None] + torch.arange(num_tokens, device=device)
    inside = (pos >= 0) & (pos < cap)  # (b, num_tokens)
    if torch.compiler.is_compiling() or device.type != "cpu":
        if checks._value_checks and device.type != "meta":
            torch._assert_async(inside.all(), "torch_mla.slot_mapping: a request's new tokens lie "
                                "past its block_table row, or its length is negative")
    else:
        bad = (~inside).any(dim=1).nonzero().flatten().tolist()
        if bad:
            r, n = bad[0], int(cache_seqlens[bad[0]])
            if n < 0:
                raise ValueError(f"slot_mapping: cache_seqlens[{r}] is {n}; lengths must be >= 0")
            raise ValueError(f"slot_mapping: request {r} has length {n}, so its next {num_tokens} "
                             f"token(s) take positions {n}..{n + num_tokens - 1}, but its "
                             f"block_table row holds only {max_blocks} pages x {page_size} = "
                             f"{cap} positions; give it more pages")
    if max_blocks == 0:
        return torch.full((b * num_tokens,), -1, dtype=torch.int64, device=device)
    # Out-of-range positions gather a clamped (real) page and are then dropped: nothing is read
    # or written out of bounds even with the checks off.
    page = torch.gather(block_table.to(torch.int64), 1, (pos // page_size).clamp(0, max_blocks - 1))
    return torch.where(inside, page * page_size + pos % page_size, -1).reshape(-1)
