"""Input validation for sparse decode (:func:`torch_mla.mla_decode_sparse`) and for appending to the
656-byte FP8 cache. Shapes, dtypes and devices here read metadata only; the values (indices,
topk_length, slots) go through checks._require as the dense checks do: a ValueError naming the
entry on CPU tensors, an asynchronous device-side assert elsewhere (off inside CUDA-graph
captures and with set_value_checks(False))."""

from __future__ import annotations

import torch

from ..constants import D_QK, D_ROPE, D_V, FP8_DS_MLA_BYTES, PAGE_SIZE
from .checks import (
    _CPU_HINT,
    DTYPES,
    FP8,
    _fail,
    _require,
    _shape,
    check_append_devices_and_slots,
    check_scale,
)

SPARSE_DEVICE_MESSAGES = {
    "indices": "torch_mla.mla_decode_sparse: indices holds a slot >= num_blocks x page_size "
               f"or < -1 at a position below topk_length; {_CPU_HINT}",
    "topk_length": "torch_mla.mla_decode_sparse: topk_length holds a length < 0 or > topk; "
                   + _CPU_HINT,
}


def _tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def cache_format(kv_cache: torch.Tensor) -> str:
    """"fp8_ds_mla" (uint8 656-byte rows), "fp8" (float8_e4m3fn with one kv_scale) or "plain"."""
    if kv_cache.dtype == torch.uint8:
        return "fp8_ds_mla"
    return "fp8" if kv_cache.dtype == FP8 else "plain"


def check_sparse_decode_args(q, kv_cache, indices, topk_length, attn_sink, d_v: int,
                             kv_scale=None) -> None:
    """Validates the shapes, dtypes and devices of :func:`torch_mla.mla_decode_sparse`'s
    arguments; raises ValueError/TypeError. Values: :func:`check_sparse_decode_values`."""
    for name, t in (("q", q), ("kv_cache", kv_cache), ("indices", indices)):
        _tensor(name, t)
    if q.dim() != 4:
        _fail(f"q must have shape [batch, s_q, h_q, d_qk], got {_shape(q)}")
    if q.dtype not in DTYPES:
        _fail(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    b, s_q, h_q, d_qk = q.shape
    if s_q < 1 or h_q < 1:
        _fail(f"q must have s_q >= 1 and h_q >= 1, got s_q={s_q}, h_q={h_q}")
    if kv_cache.dim() != 4 or kv_cache.shape[1] < 1 or kv_cache.shape[2] != 1:
        _fail(f"kv_cache must have shape [num_blocks, page_size, 1, width] (one latent head; "
              f"page_size {PAGE_SIZE} in torch_mla's caches), got {_shape(kv_cache)}")
    width = kv_cache.shape[3]
    fmt = cache_format(kv_cache)
    if fmt == "fp8_ds_mla":
        if width != FP8_DS_MLA_BYTES:
            _fail(f"a uint8 kv_cache is DeepSeek-V3.2's FP8 layout, {FP8_DS_MLA_BYTES} bytes a "
                  f"token: shape [num_blocks, page_size, 1, {FP8_DS_MLA_BYTES}], got "
                  f"{_shape(kv_cache)}")
        if d_qk != D_QK:
            _fail(f"the {FP8_DS_MLA_BYTES}-byte FP8 cache holds {D_V} + {D_ROPE} = {D_QK} values "
                  f"a token; q's head dim must be {D_QK}, got {d_qk}")
        if kv_scale is not None:
            _fail(f"the {FP8_DS_MLA_BYTES}-byte FP8 cache carries its own scales (one per 128 "
                  "values in every row): pass kv_scale=None")
    else:
        if fmt == "fp8":
            check_scale("kv_scale", kv_scale, kv_cache, "kv_cache")
        elif kv_cache.dtype != q.dtype:
            _fail(f"kv_cache must be q's dtype ({q.dtype}), float8_e4m3fn (with kv_scale) or "
                  f"uint8 [num_blocks, page_size, 1, {FP8_DS_MLA_BYTES}] (DeepSeek-V3.2's FP8 "
                  f"layout), got {kv_cache.dtype}")
        elif kv_scale is not None:
            _fail(f"kv_scale is the scale of a float8_e4m3fn kv_cache; this kv_cache is "
                  f"{kv_cache.dtype}: pass kv_scale=None")
        if width != d_qk:
            _fail(f"kv_cache head dim ({width}) must equal q's head dim d_qk ({d_qk})")
    if not (0 < d_v <= d_qk):
        _fail(f"d_v must be in (0, d_qk={d_qk}] (V is the first d_v values of a cached row), "
              f"got {d_v}")
    if indices.dim() != 3 or indices.dtype != torch.int32:
        _fail(f"indices must be int32 [batch, s_q, topk], got {indices.dtype} {_shape(indices)}")
    if indices.shape[0] != b or indices.shape[1] != s_q:
        _fail(f"indices has shape {_shape(indices)}, expected [batch, s_q, topk] = "
              f"[{b}, {s_q}, topk] (q is {_shape(q)})")
    if topk_length is not None:
        _tensor("topk_length", topk_length)
        if topk_length.dim() != 1 or topk_length.dtype != torch.int32 or topk_length.shape[0] != b:
            _fail(f"topk_length must be int32 [batch] = [{b}], got {topk_length.dtype} "
                  f"{_shape(topk_length)}")
    if attn_sink is not None:
        _tensor("attn_sink", attn_sink)
        if attn_sink.dim() != 1 or attn_sink.dtype != torch.float32 or attn_sink.shape[0] != h_q:
            _fail(f"attn_sink must be float32 [h_q] = [{h_q}], got {attn_sink.dtype} "
                  f"{_shape(attn_sink)}")
    named = [("q", q), ("kv_cache", kv_cache), ("indices", indices), ("topk_length", topk_length),
             ("attn_sink", attn_sink)]
    named = [(n, t) for n, t in named if t is not None]
    if any(t.device != q.device for _, t in named):
        _fail("q, kv_cache, indices, topk_length and attn_sink must be on one device, got "
              + ", ".join(f"{n}={t.device}" for n, t in named))
    for name, t in (("q", q), ("kv_cache", kv_cache), ("indices", indices)):
        if t.stride(-1) != 1:
            _fail(f"{name}'s last dimension must be contiguous (stride 1), got stride "
                  f"{t.stride(-1)}")


def check_topk_length_values(topk_length: torch.Tensor, topk: int) -> None:
    """0 <= topk_length[r] <= topk for every request r."""
    L = topk_length
    _require((L < 0) | (L > topk), SPARSE_DEVICE_MESSAGES["topk_length"],
             lambda r: f"topk_length[{r}] = {int(L[r])}, but it must be in [0, topk = {topk}] "
                       "(topk: the last dim of indices)")


def check_sparse_decode_values(num_slots: int, indices: torch.Tensor,
                               topk_length: torch.Tensor | None) -> None:
    """0 <= topk_length[r] <= topk, and every entry of indices at a position below its request's
    topk_length (all of them without one) is -1 or a slot in [0, num_slots = num_blocks *
    page_size); entries past topk_length are never read and may hold anything."""
    b, s_q, topk = indices.shape
    cap = num_slots
    used = torch.ones(b, 1, topk, dtype=torch.bool, device=indices.device)
    if topk_length is not None:
        check_topk_length_values(topk_length, topk)
        used = torch.arange(topk, device=indices.device)[None, None, :] < topk_length[:, None, None]

    def bad_slot(r, i, k):
        where = "" if topk_length is None else f" (below topk_length[{r}] = {int(topk_length[r])})"
        return (f"indices[{r}, {i}, {k}] = {int(indices[r, i, k])}{where} is not a cache slot: "
                f"slots are page * page_size + row, in [0, num_blocks x page_size = {cap}), or "
                "-1 for no token")

    _require(used & ((indices < -1) | (indices >= cap)), SPARSE_DEVICE_MESSAGES["indices"],
             bad_slot)


def check_fp8_ds_mla_append_args(kv_cache, kv_c, k_pe, slot_mapping, kv_scale=None,
                                 values: bool = True) -> None:
    """Validates :func:`torch_mla.append_kv`'s arguments for a 656-byte FP8 cache (uint8)."""
    for name, t in (("kv_cache", kv_cache), ("kv_c", kv_c), ("k_pe", k_pe),
                    ("slot_mapping", slot_mapping)):
        _tensor(name, t)
    if kv_cache.dim() != 4 or tuple(kv_cache.shape[1:]) != (PAGE_SIZE, 1, FP8_DS_MLA_BYTES):
        _fail(f"a uint8 kv_cache is DeepSeek-V3.2's FP8 layout: shape [num_blocks, {PAGE_SIZE}, 1, "
              f"{FP8_DS_MLA_BYTES}], got {_shape(kv_cache)}")
    if not kv_cache.is_contiguous():
        _fail("kv_cache must be contiguous")
    if kv_scale is not None:
        _fail(f"the {FP8_DS_MLA_BYTES}-byte FP8 cache carries its own scales (one per 128 values "
              "in every row): pass kv_scale=None")
    T = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    if kv_c.shape != (T, D_V) or k_pe.shape != (T, D_ROPE):
        _fail(f"the {FP8_DS_MLA_BYTES}-byte FP8 cache takes kv_c [tokens, {D_V}] and k_pe "
              f"[tokens, {D_ROPE}], as many tokens as slot_mapping [tokens]; got kv_c "
              f"{_shape(kv_c)}, k_pe {_shape(k_pe)}, slot_mapping {_shape(slot_mapping)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if not (kv_c.is_floating_point() and k_pe.is_floating_point()):
        _fail(f"kv_c and k_pe must be floating point, got {kv_c.dtype} and {k_pe.dtype}")
    check_append_devices_and_slots(kv_cache, kv_c, k_pe, slot_mapping, T, values)
