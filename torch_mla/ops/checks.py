"""Input validation for the torch_mla ops: every message says what is wrong and what is expected.

Shape, dtype and device checks read metadata only. Checks of *values* (sequence lengths) need the
data on the host: they run for CPU tensors always, and for CUDA tensors in eager mode unless
disabled with :func:`torch_mla.set_value_checks` (they are skipped while a CUDA graph is being
captured, where a host read is not allowed).
"""

from __future__ import annotations

import torch

PAGE_SIZE = 64
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_value_checks = True


def set_value_checks(enabled: bool) -> None:
    """Turns the host-side checks of ``cache_seqlens`` values on CUDA tensors on or off.

    They cost one device-to-host read per call; turn them off once the caller is trusted.
    """
    global _value_checks
    _value_checks = bool(enabled)


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_seqlens_tensor(cache_seqlens: torch.Tensor, name: str = "cache_seqlens") -> None:
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dim() != 1:
        _fail(f"{name} must have shape [batch], got {_shape(cache_seqlens)}")
    if cache_seqlens.dtype != torch.int32:
        _fail(f"{name} must be int32, got {cache_seqlens.dtype}")


def _values_checkable(t: torch.Tensor) -> bool:
    if t.device.type == "cpu":
        return True
    if t.device.type == "meta" or not _value_checks:
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_decode_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    d_v: int,
    causal: bool,
) -> None:
    """Validates :func:`torch_mla.mla_decode`'s arguments; raises ValueError/TypeError."""
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_seqlens_tensor(cache_seqlens)
    if q.dim() != 4:
        _fail(f"q must have shape [batch, s_q, h_q, d_qk], got {_shape(q)}")
    if kv_cache.dim() != 4:
        _fail(f"kv_cache must have shape [num_blocks, page_size, 1, d_qk], got {_shape(kv_cache)}")
    if block_table.dim() != 2:
        _fail(f"block_table must have shape [batch, max_blocks], got {_shape(block_table)}")
    b, s_q, h_q, d_qk = q.shape
    num_blocks, page, h_kv, d_kv = kv_cache.shape
    if q.dtype not in DTYPES:
        _fail(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    if kv_cache.dtype != q.dtype:
        _fail(f"kv_cache dtype ({kv_cache.dtype}) must match q's dtype ({q.dtype})")
    if block_table.dtype != torch.int32:
        _fail(f"block_table must be int32, got {block_table.dtype}")
    devs = {t.device for t in (q, kv_cache, block_table, cache_seqlens)}
    if len(devs) != 1:
        _fail(
            "q, kv_cache, block_table and cache_seqlens must be on one device, got "
            + ", ".join(f"{n}={t.device}" for n, t in
                        (("q", q), ("kv_cache", kv_cache), ("block_table", block_table),
                         ("cache_seqlens", cache_seqlens)))
        )
    if page != PAGE_SIZE:
        _fail(f"kv_cache page size (dim 1) must be {PAGE_SIZE}, got {page}")
    if h_kv != 1:
        _fail(f"kv_cache must hold one latent head (dim 2 == 1), got {h_kv}")
    if d_kv != d_qk:
        _fail(f"kv_cache head dim ({d_kv}) must equal q's head dim d_qk ({d_qk})")
    if not (0 < d_v <= d_qk):
        _fail(f"d_v must be in (0, d_qk={d_qk}] (V is the first d_v columns of the cache), "
              f"got {d_v}")
    if s_q < 1 or h_q < 1:
        _fail(f"q must have s_q >= 1 and h_q >= 1, got s_q={s_q}, h_q={h_q}")
    if block_table.shape[0] != b:
        _fail(f"block_table has {block_table.shape[0]} rows, expected batch = {b}")
    if cache_seqlens.shape[0] != b:
        _fail(f"cache_seqlens has {cache_seqlens.shape[0]} entries, expected batch = {b}")
    if q.stride(-1) != 1:
        _fail(f"q's last dimension must be contiguous (stride 1), got stride {q.stride(-1)}")
    if not kv_cache.is_contiguous():
        _fail("kv_cache must be contiguous (a persistent [num_blocks, 64, 1, d_qk] buffer)")
    if block_table.stride(-1) != 1:
        _fail("block_table's last dimension must be contiguous (stride 1)")
    if _values_checkable(cache_seqlens):
        cap = block_table.shape[1] * PAGE_SIZE
        lo, hi = torch.aminmax(cache_seqlens) if b > 0 else (torch.tensor(0), torch.tensor(0))
        lo, hi = int(lo), int(hi)
        if lo < 0:
            _fail(f"cache_seqlens must be >= 0, got a minimum of {lo}")
        if hi > cap:
            _fail(
                f"cache_seqlens has a length of {hi} but block_table covers only "
                f"{block_table.shape[1]} pages x {PAGE_SIZE} = {cap} tokens"
            )


def check_schedule_args(metadata: torch.Tensor, num_splits: torch.Tensor, batch: int,
                        device: torch.device) -> None:
    if metadata.dim() != 2 or metadata.shape[1] != 8 or metadata.dtype != torch.int32:
        _fail(f"schedule metadata must be int32 [num_parts, 8], got {metadata.dtype} "
              f"{_shape(metadata)}; compute it with torch_mla.get_decode_schedule")
    if num_splits.dim() != 1 or num_splits.shape[0] != batch + 1 or num_splits.dtype != torch.int32:
        _fail(f"num_splits must be int32 [batch + 1] = [{batch + 1}], got {num_splits.dtype} "
              f"{_shape(num_splits)}; compute it with torch_mla.get_decode_schedule")
    if metadata.device != device or num_splits.device != device:
        _fail(f"schedule tensors must be on {device}, got {metadata.device} and "
              f"{num_splits.device}")


def check_append_args(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Validates :func:`torch_mla.append_kv`'s arguments."""
    for name, t in (("kv_cache", kv_cache), ("kv_c", kv_c), ("k_pe", k_pe),
                    ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if kv_cache.dim() != 4 or kv_cache.shape[1] != PAGE_SIZE or kv_cache.shape[2] != 1:
        _fail(f"kv_cache must have shape [num_blocks, {PAGE_SIZE}, 1, d_qk], "
              f"got {_shape(kv_cache)}")
    if not kv_cache.is_contiguous():
        _fail("kv_cache must be contiguous")
    if kv_c.dim() != 2 or k_pe.dim() != 2:
        _fail(f"kv_c and k_pe must be [tokens, d_v] and [tokens, d_rope], got {_shape(kv_c)} "
              f"and {_shape(k_pe)}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        _fail(f"slot_mapping must be int32 or int64 [tokens], got {slot_mapping.dtype} "
              f"{_shape(slot_mapping)}")
    T = slot_mapping.shape[0]
    if kv_c.shape[0] != T or k_pe.shape[0] != T:
        _fail(f"kv_c ({kv_c.shape[0]}), k_pe ({k_pe.shape[0]}) and slot_mapping ({T}) must have "
              "the same number of tokens")
    if kv_c.shape[1] + k_pe.shape[1] != kv_cache.shape[3]:
        _fail(f"kv_c width {kv_c.shape[1]} + k_pe width {k_pe.shape[1]} must equal the cache's "
              f"head dim {kv_cache.shape[3]}")
    if kv_cache.dtype not in DTYPES:
        _fail(f"kv_cache must be bfloat16, float16 or float32, got {kv_cache.dtype}")
    devs = {t.device for t in (kv_cache, kv_c, k_pe, slot_mapping)}
    if len(devs) != 1:
        _fail("kv_cache, kv_c, k_pe and slot_mapping must be on one device, "
              f"got {sorted(map(str, devs))}")
    if _values_checkable(slot_mapping) and T > 0:
        hi = int(slot_mapping.max())
        cap = kv_cache.shape[0] * PAGE_SIZE
        if hi >= cap:
            _fail(f"slot_mapping holds slot {hi} but the cache has only {cap} slots "
                  f"({kv_cache.shape[0]} pages x {PAGE_SIZE})")
