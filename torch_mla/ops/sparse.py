"""``torch_mla::mla_decode_sparse``: sparse MLA decode (DeepSeek Sparse Attention) over the latent
cache, and appending to DeepSeek-V3.2's 656-byte FP8 cache. Validation, then the kernel where one
takes the inputs (:func:`find_sparse_decode_kernel`), else the reference. Forward-only."""

from __future__ import annotations

import functools
import os
import warnings
from functools import partial

import torch

from ..constants import BLOCK_M, D_QK, D_V, LOG2_E, PAGE_SIZE
from ..contract import keysm_columns_for
from ..reference import append_kv_reference
from ..reference_sparse import mla_decode_sparse_reference, quantize_fp8_ds_mla
from . import dispatch, registry
from .checks import check_schedule_args, checks_values, unpack_schedule
from .checks_sparse import (
    cache_format,
    check_fp8_ds_mla_append_args,
    check_sparse_decode_args,
    check_sparse_decode_values,
    check_topk_length_values,
)
from .library import forward_only_grads, grad_like, lib
from .schedule import DecodeSchedule, get_decode_schedule

_warned: set[str] = set()


def _sparse_schedule_args(sched_metadata, num_splits, q):
    b, s_q = q.shape[0], q.shape[1]
    check_schedule_args(sched_metadata, num_splits, b * s_q, q.device, "batch x s_q",
                        "torch_mla.get_sparse_decode_schedule")


# cache_format's names -> the registry's (SparseStepConfig.cache)
_STEP_CACHE = {"plain": "plain", "fp8": "e4m3", "fp8_ds_mla": "fp8_ds_mla"}


# Where the SM90 sparse kernel beats the portable one (H200, docs/kernels/sparse.md "Kernel
# choice"): each of its CTAs takes 64 query rows of one token, so it wants 64 heads to fill
# them and enough (token, 64-head block) CTAs to fill the GPU: from 64 CTAs over a 16-bit
# cache, from 32 over an FP8 one (whose conversion the portable kernel does in its gathering
# threads). Below 64 heads (where the keys-on-M kernel is off) only from 128 CTAs, FP8 only.
SM90_MIN_HEADS = 64
SM90_MIN_CTAS = 64
SM90_MIN_CTAS_FP8 = 32
SM90_MIN_CTAS_FEW_HEADS = 128


def sm90_sparse_pays(b: int, s_q: int, h_q: int, fp8: bool = False) -> bool:
    """Whether the SM90 sparse kernel runs by default for b requests of s_q tokens and h_q
    heads, with ctas = b * s_q * ceil(h_q / 64): h_q >= SM90_MIN_HEADS and ctas >=
    SM90_MIN_CTAS over a 16-bit cache, SM90_MIN_CTAS_FP8 over an FP8 one (fp8); with fewer
    heads, an FP8 cache and ctas >= SM90_MIN_CTAS_FEW_HEADS."""
    ctas = b * s_q * -(-h_q // BLOCK_M)
    if h_q < SM90_MIN_HEADS:
        return fp8 and ctas >= SM90_MIN_CTAS_FEW_HEADS
    return ctas >= (SM90_MIN_CTAS_FP8 if fp8 else SM90_MIN_CTAS)


# Over the 656-byte rows the split kernel takes the SM90 one's place at the head counts it was
# measured at (H100, session 30: 64 and 128; 65-127 run the same code with fewer rows), and
# beats the portable one from fewer CTAs too: b 2 in one process, split / portable at h_q 64
# s_q 1 (2 CTAs) 23.1 / 22.7 us, s_q 2 (4) 31.8 / 35.1, h_q 128 s_q 1 (4) 31.3 / 34.2, s_q 2
# (8) 38.7 / 44.7. Session 35 (H100, one start): the split at b 2 s_q 1 h_q 64 22.5 / 22.4 us
# (tools/sparse_rows.py), the portable kernel there 23.1 (bench_decode.py --sparse, the same
# problem and CUDA-graph timing), FlashMLA 23.8 (the split in the session's other starts
# 21.5-22.5). So it runs from 2 one-token requests (b s_q) since, where it ran from 4 CTAs
# (b s_q ceil(h_q / 64)): the same at 65-128 heads, 2 and 3 tokens of 64 heads added; a single
# token stays on the portable kernel (not measured). Over the 16-bit cache it ran only when asked
# for until session 39, whose A/B (H100, one start, tools/gpu_sparse.sh plain: the SM90 kernel,
# the split and the portable kernel over the bf16 rows, alternated twice; docs/benchmarks-h100.md)
# had the split fastest on all 16 rows at 64, 100 and 128 heads, b 2-128, s_q 1-2: 128,1,128
# 158.6 us against 214.0 (SM90) and 306.5 (portable); 32,1,64 58.3 against 71.8 (portable);
# 2,1,64 20.5 against 21.0 (portable). So the same rule holds over both formats it takes.
SPLIT_MAX_HEADS = 128
SPLIT_MIN_TOKENS = 2


def split_sparse_pays(b: int, s_q: int, h_q: int, sm90_pays: bool = False) -> bool:
    """Whether the split kernel runs by default (over the 16-bit cache and the 656-byte rows;
    not over e4m3, which it does not take): SM90_MIN_HEADS <= h_q
    <= SPLIT_MAX_HEADS, and where the SM90 kernel pays (sm90_pays) or from SPLIT_MIN_TOKENS
    one-token requests (b * s_q)."""
    return SM90_MIN_HEADS <= h_q <= SPLIT_MAX_HEADS and (sm90_pays or b * s_q >= SPLIT_MIN_TOKENS)


def keysm_sparse_columns(h_q: int) -> int:
    """The query columns (8, 16, 32) of the keys-on-M sparse kernel for h_q heads (any cache
    format), or 0 where it cannot run (h_q > 32)."""
    return next((n for n in registry.SPARSE_KEYSM_COLUMNS if n >= h_q), 0)


def keysm_rs_sparse_columns(h_q: int) -> int:
    """The query columns of the sparse ping-pong kernel for h_q heads: the fewest keys-on-M
    columns that hold them (8, 16, 32, 64); above 64 heads 64, a CTA for each 64 heads of a
    token (their grid's m-blocks), every one gathering the token's rows. At most 32 with
    TORCH_MLA_SPARSE_KEYSM_RS=32 (dispatch.sparse_keysm_rs_32)."""
    most = 32 if dispatch.sparse_keysm_rs_32() else registry.SPARSE_KEYSM_RS_COLUMNS[-1]
    n = keysm_columns_for(min(h_q, most))
    return n if n in registry.SPARSE_KEYSM_RS_COLUMNS else 0


# The pair from this many one-token requests (b s_q). Session 35 (H100, same start as
# FlashMLA, 656-byte rows, h_q 128): one CTA an m-block was 0.2-1.0 us faster up to 8 tokens
# (b 2 s_q 1 27.6 against 28.5 us) and 1.6-4.9 us slower from 16 (16,1,128 54.7 against 52.8;
# docs/benchmarks-h100.md). Session 46 (H100, same start, two rounds): the pair faster at every
# count from 2 to 16 (2,1,128 24.4 against 25.2 us, 8,1,128 35.1 against 36.55, 16,1,128 47.9
# against 47.9), so 1 (every shape); TORCH_MLA_DEV_SPLIT_PAIR_MIN_TOKENS (a developer knob,
# read at import) sets it.
SPLIT_PAIR_MIN_TOKENS = int(os.environ.get("TORCH_MLA_DEV_SPLIT_PAIR_MIN_TOKENS") or 1)
if SPLIT_PAIR_MIN_TOKENS < 1:
    raise ValueError("TORCH_MLA_DEV_SPLIT_PAIR_MIN_TOKENS takes a count from 1, not "
                     f"{SPLIT_PAIR_MIN_TOKENS}")


def split_pair_rows(h_q: int, cache: str, tokens: int | None = None) -> int:
    """The split kernel's cluster pair (registry.SPARSE_SPLIT_PAIR query rows: the two 64-row
    m-blocks of a token as one cluster whose producers share each block's conversion) where it
    applies, h_q 65-128 over the 656-byte rows from SPLIT_PAIR_MIN_TOKENS one-token requests
    (tokens: b * s_q; None or 0, an empty batch: any count; unless
    TORCH_MLA_SPARSE_SPLIT_PAIR=0), else 0."""
    pair = registry.SPARSE_SPLIT_PAIR
    return pair if (cache == "fp8_ds_mla" and pair // 2 < h_q <= pair
                    and (not tokens or tokens >= SPLIT_PAIR_MIN_TOKENS)
                    and not dispatch.sparse_split_pair_off()) else 0


# The split's short build (SparseStepConfig short=True) for parts of at most this many blocks
# of 64 entries (split_short_parts): SPLIT_SHORT_BLOCKS_PAIR with the cluster pair,
# SPLIT_SHORT_BLOCKS without. Session 46 (H100, same start as FlashMLA, 656-byte rows, topk
# 2048, two rounds, us, default / short build; docs/kernels/sparse.md "Session 46"): with the
# pair (h_q 128, 66 parts) 2,1,128 (1 block a part) 24.5, 24.6 / 22.9, 22.8; 4,1,128 (2)
# 27.7, 27.8 / 26.8, 26.9; 8,1,128 (4) 34.9, 35.0 / 34.5, 34.3; 16,1,128 (8) 47.7, 48.0 /
# 48.6, 48.5; without it (h_q 64, 132 parts) 2,1,64 (0.5) and 2,2,64 (1) 0.9-1.3 us faster
# (the knobs' A/B), 8,1,64 (2) 30.3, 30.3 / 30.6, 30.6; 16,1,64 (4) 40.0, 40.2 / 40.1, 40.2;
# 32,1,64 (8) 58.7, 58.8 / 60.0, 60.1. TORCH_MLA_DEV_SPLIT_SHORT_BLOCKS (a developer knob, read
# at import) sets both; 0: never.
_SHORT_KNOB = os.environ.get("TORCH_MLA_DEV_SPLIT_SHORT_BLOCKS") or ""
SPLIT_SHORT_BLOCKS = int(_SHORT_KNOB or 1)
SPLIT_SHORT_BLOCKS_PAIR = int(_SHORT_KNOB or 4)
if SPLIT_SHORT_BLOCKS < 0:
    raise ValueError("TORCH_MLA_DEV_SPLIT_SHORT_BLOCKS takes a count from 0, not "
                     f"{SPLIT_SHORT_BLOCKS}")


def split_short_parts(tokens: int, topk: int, parts: int, pair: bool = False) -> bool:
    """Whether the split kernel runs its short build (over the 656-byte rows): tokens
    one-token requests (b * s_q) of topk entries each, cut over the schedule's parts (its
    metadata rows), leave at most SPLIT_SHORT_BLOCKS blocks of 64 entries a part
    (SPLIT_SHORT_BLOCKS_PAIR with the cluster pair, pair). topk_length may leave fewer; the
    shape decides, so a captured graph keeps its build."""
    most = SPLIT_SHORT_BLOCKS_PAIR if pair else SPLIT_SHORT_BLOCKS
    return parts > 0 and tokens * -(-topk // PAGE_SIZE) <= most * parts


# The keys-on-M backends' column counts for h_q heads (run_sparse_step, on every eager call).
_COLUMNS = {"sm90_keysm": keysm_sparse_columns, "sm90_keysm_rs": keysm_rs_sparse_columns}


def sparse_backend(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int) -> tuple[str, str]:
    """(name, reason) of the kernel for validated inputs on a CUDA device, or ("reference",
    why). On sm_90a, in this order:
      - "sm90_keysm_rs" with TORCH_MLA_SPARSE_KEYSM_RS=1 (or 32) over an FP8 cache (e4m3 or
        the 656-byte rows) at every h_q it takes, even with TORCH_MLA_SPARSE_KEYSM=0;
      - "sm90_keysm", the keys-on-M kernel, where keysm_sparse_columns (h_q <= 32), over any
        cache format (TORCH_MLA_SPARSE_KEYSM=0: never);
      - the SM90 kernel where sm90_sparse_pays (TORCH_MLA_SPARSE_SM90=1: every shape the
        keys-on-M kernel does not take, =0: never): "sm90_producer" with
        TORCH_MLA_SPARSE_PRODUCER=1 and "sm90_split" with =split (the 16-bit cache and the
        656-byte rows); over those two formats at 64-128 heads "sm90_split" by default, also
        from fewer CTAs (split_sparse_pays; faster than the SM90 kernel on every row measured:
        the 656-byte rows in session 30, the bf16 cache in session 39), unless
        TORCH_MLA_SPARSE_PRODUCER=0 or 1; else "sm90";
      - else "sm80", the portable kernel (also on other GPUs from SM80).
    Every kernel takes every cache format (the FP8 ones dequantized in the kernel) but the
    producer variants, which do not take e4m3; the 656-byte rows with bf16 q only (their RoPE
    values are bf16)."""
    if dispatch._force_reference():
        return "reference", "TORCH_MLA_FORCE_REFERENCE=1"
    arch = dispatch._small_kernel_arch(q.device)
    if arch is None:
        return "reference", f"no kernel arch for compute capability " \
                            f"{dispatch.cuda_capability(q.device)}"
    fmt = cache_format(kv_cache)
    if q.dtype not in (torch.bfloat16, torch.float16):
        return "reference", f"the sparse kernel takes bf16/fp16 q, got {q.dtype}"
    if q.shape[-1] != D_QK or d_v != D_V or kv_cache.shape[1] != PAGE_SIZE:
        return "reference", (f"the sparse kernel takes d_qk {D_QK}, d_v {D_V} and pages of "
                             f"{PAGE_SIZE} tokens, got {q.shape[-1]}, {d_v}, "
                             f"{kv_cache.shape[1]}")
    if fmt != "plain":
        if fmt == "fp8_ds_mla" and q.dtype != torch.bfloat16:
            return "reference", ("the sparse kernel over the 656-byte cache takes bf16 q (the "
                                 f"rows' RoPE values are bf16), got {q.dtype}")
    # (the FP8 caches; opt-in: run on an H100, slower than the default choice where it matters)
    if (arch == registry.SM90_ARCH and dispatch.sparse_keysm_rs()
            and fmt in ("fp8", "fp8_ds_mla") and keysm_rs_sparse_columns(q.shape[2])):
        return "sm90_keysm_rs", ""
    if arch == registry.SM90_ARCH and not dispatch.sparse_keysm_off() and keysm_sparse_columns(
            q.shape[2]):
        return "sm90_keysm", ""
    if arch == registry.SM90_ARCH and not dispatch.sparse_sm90_off():
        pays = dispatch.sparse_sm90_always() or sm90_sparse_pays(*q.shape[:3], fmt != "plain")
        if pays and fmt != "fp8":  # (the producer variants: the 16-bit cache, the 656-byte rows)
            if dispatch.sparse_producer():
                return "sm90_producer", ""
            if dispatch.sparse_split():
                return "sm90_split", ""
        if (fmt != "fp8" and not dispatch.sparse_heads_on_m()
                and not dispatch.sparse_producer() and split_sparse_pays(*q.shape[:3], pays)):
            return "sm90_split", ""
        if pays:
            return "sm90", ""
    return "sm80", ""


def find_sparse_decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int):
    """A callable running the sparse decode kernel for these inputs, or None (the reference).

    On a GPU the kernel sparse_backend names: on sm_90a the keys-on-M kernel
    (cute_kernels/sm90_keysm_sparse_decode.py) for h_q <= 32, else the SM90 kernel
    (cute_kernels/sm90_sparse_decode.py) where sm90_sparse_pays (over the 16-bit cache and the
    656-byte rows at 64-128 heads its split variant, sm90_split_sparse_decode.py, there and from
    fewer CTAs: split_sparse_pays), else the portable kernel
    (cute_kernels/sm80_sparse_decode.py), each over every cache format (the FP8 ones
    dequantized in the kernel); inputs no kernel takes run the
    reference, which warns once per reason (it gathers every key in float32 and is far slower
    than a kernel). A kernel is called as
    ``kernel(q, kv_cache, indices, topk_length, attn_sink, sched_metadata, num_splits,
    softmax_scale, d_v, kv_scale)`` on validated arguments and returns ``(out, lse)`` as
    :func:`torch_mla.mla_decode_sparse` documents; it checks the index values itself (its
    combine, on the device)."""
    if not q.is_cuda:
        return None
    name, reason = sparse_backend(q, kv_cache, d_v)
    if name in registry.SPARSE_BACKENDS:
        return partial(run_sparse_step, name)
    if reason not in _warned and not dispatch._force_reference():
        _warned.add(reason)
        warnings.warn("torch_mla.mla_decode_sparse runs the slow plain-PyTorch reference on this "
                      f"GPU: {reason}", stacklevel=3)
    return None


@functools.lru_cache(maxsize=None)
def _sparse_step(backend: str, dtype: torch.dtype, cache: str, arch: str, columns: int = 0,
                 short: bool = False):
    return registry.compiled(
        registry.SparseStepConfig(backend, registry.dtype_name(dtype), cache, columns, short),
        arch)


def _rows16(t: torch.Tensor) -> torch.Tensor:
    """t itself where its data and every stride but the last are 16-byte multiples (the
    kernel's cp.async rows), else a contiguous copy."""
    size = t.element_size()
    if t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
        return t.contiguous() if not t.is_contiguous() else t.clone()
    return t


def fp8_cache_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """The bytes (uint8 [num_blocks, 64, width]) of an FP8 sparse cache (float8_e4m3fn or the
    656-byte rows, [num_blocks, 64, 1, width]) as the kernel reads them: 16 bytes a load, so
    its data pointer and page and row strides must be multiples of 16 bytes (a contiguous
    cache's are: 576 and 656 bytes a row); ValueError otherwise (no silent copy of a cache)."""
    rows = kv_cache[:, :, 0].view(torch.uint8)
    if rows.data_ptr() % 16 or rows.stride(0) % 16 or rows.stride(1) % 16:
        raise ValueError(
            f"torch_mla.mla_decode_sparse: the sparse kernel reads the {cache_format(kv_cache)} "
            "cache in 16-byte loads: kv_cache's data pointer and its page and row strides must "
            f"be multiples of 16 bytes, got data pointer % 16 = {rows.data_ptr() % 16}, "
            f"strides {list(rows.stride()[:2])} bytes (a contiguous cache qualifies)")
    return rows


def run_sparse_step(backend: str, q, kv_cache, indices, topk_length, attn_sink,
                    sched_metadata, num_splits, softmax_scale: float, d_v: int, kv_scale=None):
    """The sparse decode step of `backend` ("sm80": the portable kernel, "sm90": the SM90 one,
    "sm90_keysm": the keys-on-M one, "sm90_keysm_rs": its ping-pong variant, "sm90_producer":
    the SM90 one with a producer warpgroup, "sm90_split": with FlashMLA's warpgroup split, its
    cluster pair where split_pair_rows; decode, then
    combine) on validated arguments; the sink, if
    any, scales the output afterwards. Allocates nothing whose size depends on data (CUDA-graph
    safe)."""
    if q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):
            return run_sparse_step(backend, q, kv_cache, indices, topk_length, attn_sink,
                                   sched_metadata, num_splits, softmax_scale, d_v, kv_scale)
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[2]
    cache = _STEP_CACHE[cache_format(kv_cache)]
    kv = _rows16(kv_cache[:, :, 0]) if cache == "plain" else fp8_cache_bytes(kv_cache)
    columns = _COLUMNS[backend](h_q) if backend in _COLUMNS else 0
    parts = sched_metadata.shape[0]
    short = False
    if backend == "sm90_split":
        columns = split_pair_rows(h_q, cache, b * s_q)
        # (over the 656-byte rows, where it was measured)
        short = cache == "fp8_ds_mla" and split_short_parts(b * s_q, topk, parts, columns > 0)
    if topk_length is None:
        topk_length = full_topk_length(b, topk, q.device)
    slots = b * s_q + parts
    oacc = q.new_empty(slots, h_q, D_V, dtype=torch.float32)
    lseacc = q.new_empty(slots, h_q, dtype=torch.float32)
    out = q.new_empty(b, s_q, h_q, D_V)
    lse = q.new_empty(b, h_q, s_q, dtype=torch.float32)
    if b > 0 and s_q > 0:  # (an empty batch loads no kernel)
        step = _sparse_step(backend, q.dtype, cache, dispatch.device_arch(q.device.index),
                            columns, short)
        variant = dispatch.combine_variant(b * s_q, parts, h_q,
                                           dispatch.device_num_sms(q.device))
        # kv_scale: the float8_e4m3fn cache's, else None (the 656-byte rows carry their
        # scales), passed either way: a step loaded from the disk cache takes its defaulted
        # trailing arguments explicitly (dispatch.run_split_kv's fp8 arguments likewise)
        step(_rows16(q), kv, indices, topk_length, sched_metadata, num_splits, out, lse, oacc,
             lseacc, softmax_scale * LOG2_E, variant, kv_scale)
    if attn_sink is not None:
        out = apply_attn_sink(out, lse, attn_sink)
    return out, lse


run_sparse_sm80 = partial(run_sparse_step, "sm80")

# (device index, topk) -> int32 [n >= b] of topk: full_topk_length's constants. A constant is
# never freed, also when a longer one replaces it (_RETIRED): a CUDA graph captured with it
# keeps its address, and a graph does not keep tensors alive.
_FULL_LENGTHS: dict[tuple[int, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def full_topk_length(b: int, topk: int, device: torch.device) -> torch.Tensor:
    """int32 [b] of topk, the kernels' topk_length when the call gives none.

    A view of a constant kept per (device, topk) and never freed, made on first use outside a
    CUDA-graph capture, on a stream of its own (so no graph pool of the caller's stream, e.g.
    torch.compile's CUDA-graph trees, holds it): one fill, then that stream's synchronisation,
    so that no call on any stream reads it before the fill. Later calls, and the graphs
    captured after it, launch nothing for it; a fill a call cost ~1 us more at b 2
    (docs/kernel-notes.md, session 44). A capture that finds no constant long enough captures
    its own fill (correct, as before)."""
    if device.type != "cuda":  # (the host path's tests run it on CPU tensors)
        return torch.full((b,), topk, dtype=torch.int32, device=device)
    key = (device.index, topk)
    full = _FULL_LENGTHS.get(key)
    if full is None or full.shape[0] < b:
        if torch.cuda.is_current_stream_capturing():
            return torch.full((b,), topk, dtype=torch.int32, device=device)
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            longer = torch.full((max(b, 1024, 2 * (0 if full is None else full.shape[0])),),
                                topk, dtype=torch.int32, device=device)
        side.synchronize()
        if full is not None:
            _RETIRED.append(full)
        _FULL_LENGTHS[key] = full = longer
    return full[:b]


def apply_attn_sink(out: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor) -> torch.Tensor:
    """out * exp(lse) / (exp(lse) + exp(sink)) per head (FlashMLA's sink), as
    sigmoid(lse - sink); rows without keys (lse +inf, out 0) stay 0."""
    factor = torch.sigmoid(lse - attn_sink[None, :, None])  # [b, h_q, s_q]
    factor = torch.nan_to_num(factor, nan=0.0)  # (lse = sink = +inf)
    return (out.float() * factor.transpose(1, 2)[..., None]).to(out.dtype)


def _sparse_run(q, kv_cache, indices, topk_length, attn_sink, sched_metadata, num_splits,
                softmax_scale: float, d_v: int, kv_scale=None):
    kernel = find_sparse_decode_kernel(q, kv_cache, d_v)
    if kernel is not None:
        return kernel(q, kv_cache, indices, topk_length, attn_sink, sched_metadata, num_splits,
                      softmax_scale, d_v, kv_scale)
    if checks_values(indices):
        check_sparse_decode_values(kv_cache.shape[0] * kv_cache.shape[1], indices, topk_length)
    return mla_decode_sparse_reference(q, kv_cache, indices, topk_length, attn_sink,
                                       softmax_scale, d_v, kv_scale)


def _sparse_impl(q, kv_cache, indices, topk_length, attn_sink, sched_metadata, num_splits,
                 softmax_scale: float, d_v: int, kv_scale=None):
    check_sparse_decode_args(q, kv_cache, indices, topk_length, attn_sink, d_v, kv_scale)
    _sparse_schedule_args(sched_metadata, num_splits, q)
    return _sparse_run(q, kv_cache, indices, topk_length, attn_sink, sched_metadata, num_splits,
                       softmax_scale, d_v, kv_scale)


lib.impl("mla_decode_sparse", _sparse_impl, "CompositeExplicitAutograd")


def _setup_context(ctx, inputs, output):
    ctx.like = grad_like(inputs)


def _backward(ctx, grad_out, grad_lse):
    return forward_only_grads(grad_out, ctx.like, "mla_decode_sparse")


torch.library.register_autograd("torch_mla::mla_decode_sparse", _backward,
                                setup_context=_setup_context, lib=lib)


def get_sparse_decode_schedule(indices: torch.Tensor, h_q: int,
                               topk_length: torch.Tensor | None = None,
                               num_sms: int | None = None) -> DecodeSchedule:
    """The split schedule of a sparse decode step, on the device, with no host sync: the dense
    schedule (:func:`torch_mla.get_decode_schedule`) over each query token's entry count, each
    (request, token) pair one single-token request of h_q rows (the tokens of a request have
    their own entries), as FlashMLA's sparse decode schedules topk like a length.

    Args:
        indices: int32 [batch, s_q, topk] (only its shape and device are read).
        h_q: query heads.
        topk_length: int32 [batch] or None (every request then counts topk entries); its
            values are checked (0 <= topk_length[r] <= topk) as mla_decode_sparse checks them.
        num_sms: as in get_decode_schedule.

    Returns:
        DecodeSchedule(metadata int32 [num_parts, 8], num_splits int32 [batch * s_q + 1]);
        share it across the layers of a step; recompute it when topk_length's values change.
    """
    b, s_q, topk = indices.shape
    lengths = topk_length
    if lengths is None:
        lengths = torch.full((b * s_q,), topk, dtype=torch.int32, device=indices.device)
    else:
        if not torch.compiler.is_compiling() and checks_values(lengths):
            # (before the schedule reads them, whose message would call them cache_seqlens)
            check_topk_length_values(lengths, topk)
        if s_q > 1:
            lengths = lengths.repeat_interleave(s_q)
    heads = _schedule_heads(h_q)
    return get_decode_schedule(lengths, 1, heads, num_sms)


def _schedule_heads(h_q: int) -> int:
    """The head count the schedule's size is taken for: h_q, except under
    TORCH_MLA_SPARSE_KEYSM_RS=32 (a developer flag: the sparse ping-pong at most 32 columns a
    CTA), where a token of more than 32 heads takes a CTA for each 32, not each 64: sized as
    that many 64-row blocks, so the grid is one wave (whatever kernel then runs)."""
    if dispatch.sparse_keysm_rs_32() and h_q > 32:
        return 64 * -(-h_q // 32)
    return h_q


def mla_decode_sparse(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    *,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    d_v: int = 512,
    kv_scale: torch.Tensor | None = None,
    schedule: DecodeSchedule | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse multi-head latent attention decode (DeepSeek Sparse Attention, FlashMLA's sparse
    decode): each query token attends to the cached tokens its row of ``indices`` names.

    K is a token's whole cached latent (d_qk = d_v + d_rope values), V its first d_v values;
    every query head reads the one latent head. Forward-only (inference): inputs may require
    grad, but backward raises.

    Args:
        q: [batch, s_q, h_q, d_qk], bf16/fp16/fp32, last dim contiguous.
        kv_cache: [num_blocks, page_size, 1, width], last dim contiguous, any strides
            otherwise (page_size 64 in torch_mla's caches; FlashMLA's sparse decode takes any);
            one of
            * q's dtype, width d_qk;
            * float8_e4m3fn, width d_qk, with ``kv_scale`` (row stands for
              ``row.float() * kv_scale``, as mla_decode's FP8 cache);
            * uint8, width 656: DeepSeek-V3.2's FP8 layout (FlashMLA's and vLLM's "fp8_ds_mla"),
              d_qk = 576. Per token: bytes 0-511 the 512 latent values in float8_e4m3fn,
              bytes 512-527 four float32 scales (scale t for values 128 t .. 128 t + 127),
              bytes 528-655 the 64 RoPE values in bf16 (not quantized); the token's key is
              ``[e4m3 * scale | rope]``. :func:`torch_mla.append_kv` writes it.
        indices: int32 [batch, s_q, topk], last dim contiguous: entry k of query token i of
            request r is a cache slot, ``page * page_size + row`` (the convention of FlashMLA
            and vLLM), or -1 for no token. A slot named twice counts twice (its key enters the
            softmax once per occurrence, as in FlashMLA's reference).
        topk_length: int32 [batch] or None: request r uses only its entries at positions
            ``< topk_length[r]``, 0 <= topk_length[r] <= topk; the later entries are never read
            and may hold anything.
        attn_sink: float32 [h_q] or None: a sink per head, FlashMLA's meaning: ``exp(sink_h)``
            joins head h's softmax denominator, i.e. the output is scaled by
            ``exp(lse) / (exp(lse) + exp(sink_h))``; lse is returned without it. +inf zeroes
            the head's output, -inf changes nothing.
        softmax_scale: scale of QK^T before the softmax (default d_qk ** -0.5).
        d_v: width of V and of the output, 0 < d_v <= d_qk (512 for DeepSeek).
        kv_scale: float32 [1], the scale of a float8_e4m3fn cache; None otherwise.
        schedule: from :func:`get_sparse_decode_schedule` for these indices and topk_length (or
            its ``(metadata, num_splits)``); computed here if None. Share it across layers.

    Returns:
        out: [batch, s_q, h_q, d_v] in q's dtype.
        lse: float32 [batch, h_q, s_q], natural-log log-sum-exp of the scaled scores of the
        used entries (without the sink). A query token with no used entry (all -1, or
        topk_length 0) gets out = 0 and lse = +inf.

    Used entries must be -1 or slots in [0, num_blocks * page_size): checked on CPU tensors with a
    ValueError naming the entry; on a GPU by the kernel step's combine, which prints the entry
    and stops (always, in CUDA graphs too), and on the GPU reference path by device-side asserts
    (see :func:`torch_mla.set_value_checks`). Out-of-range entries are never read, checks or
    not.

    On a GPU a sparse kernel runs, over every cache format (docs/kernels/sparse.md): on
    H100/H200 the keys-on-M kernel for h_q <= 32, the SM90 kernel where it pays (64+ heads and
    enough CTAs, or 33-63 heads over an FP8 cache from 128 CTAs; over the 16-bit cache and the
    656-byte rows at 64-128 heads its split variant, from 2 query tokens), else the portable
    kernel, which also runs on other GPUs from SM80; elsewhere, and where no kernel takes the
    inputs, the fp32 reference (torch_mla.reference_sparse), on a GPU with a warning once per
    reason.
    """
    check_sparse_decode_args(q, kv_cache, indices, topk_length, attn_sink, d_v, kv_scale)
    if schedule is None:
        schedule = get_sparse_decode_schedule(indices, q.shape[2], topk_length)
    metadata, num_splits = unpack_schedule(schedule)
    _sparse_schedule_args(metadata, num_splits, q)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    args = (q, kv_cache, indices, topk_length, attn_sink, metadata, num_splits,
            float(softmax_scale), int(d_v), kv_scale)
    grads = any(t is not None and t.requires_grad for t in (q, kv_cache, attn_sink))
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and grads):
        return torch.ops.torch_mla.mla_decode_sparse(*args)
    return _sparse_run(*args)


def append_kv_fp8_ds_mla(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                         slot_mapping: torch.Tensor, kv_scale: torch.Tensor | None = None) -> None:
    """:func:`torch_mla.append_kv` into a uint8 [num_blocks, 64, 1, 656] cache: each token's row
    becomes ``quantize_fp8_ds_mla(kv_c, k_pe)`` (DeepSeek's quantization, see
    torch_mla.reference_sparse); slots < 0 are skipped. Torch ops on every device (no kernel
    yet), no host sync."""
    check_fp8_ds_mla_append_args(kv_cache, kv_c, k_pe, slot_mapping, kv_scale)
    rows = quantize_fp8_ds_mla(kv_c, k_pe)  # uint8 [T, 656]
    # The rows are the cache's bytes already: the plain append writes them with a zero-width
    # tail (and its no-sync handling of skipped slots).
    append_kv_reference(kv_cache, rows, rows[:, :0], slot_mapping)
