"""Input validation for the torch_mla ops: every message says what is wrong and what is expected.

Shape, dtype and device checks read metadata only. Checks of *values* (lengths, page ids, slots)
go through :func:`_require`: on CPU tensors the values are read on the host and a ValueError names
the offending entry; on other devices the check runs on the device, as an asynchronous assert
(``torch._assert_async``: no host sync) with a fixed message; they are left out of CUDA-graph
captures (see :func:`checks_values`), and :func:`torch_mla.set_value_checks` turns them off.
The decode kernels' steps check the lengths and the page ids they use themselves (always, graphs
included: the combine kernel compares each request's entries, combine.check_request), so these
torch-op checks guard the reference path, append_kv and slot_mapping.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..constants import PAGE_SIZE

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The FP8 latent cache: e4m3 values times one float32 scale per cache tensor (kv_scale, [1]).
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value; append_kv saturates there

# What a device-side assert says (CUDA keeps at most 254 characters); the CPU path names the
# offending entry instead.
_CPU_HINT = "run with CPU tensors to see which entry"
DEVICE_MESSAGES = {
    "cache_seqlens": "torch_mla.mla_decode: cache_seqlens holds a length < 0 or > block_table's "
                     f"width x {PAGE_SIZE}; {_CPU_HINT}",
    "block_table": "torch_mla.mla_decode: block_table holds a page id outside [0, num_blocks) in "
                   "a column that the request's cache_seqlens uses; " + _CPU_HINT,
    "schedule_seqlens": "torch_mla.get_decode_schedule: cache_seqlens holds a length < 0; "
                        + _CPU_HINT,
    "slot_range": "torch_mla.append_kv: slot_mapping holds a slot >= num_blocks x "
                  f"{PAGE_SIZE} (past the cache); {_CPU_HINT}",
    "slot_repeat": "torch_mla.append_kv: slot_mapping writes one slot twice (slots >= 0 must be "
                   "distinct); " + _CPU_HINT,
}

_value_checks = True


def set_value_checks(enabled: bool) -> None:
    """Turns the device-side checks of input *values* on CUDA tensors on or off.

    Off: the schedule and append_kv kernels skip their checks of ``cache_seqlens`` and
    ``slot_mapping``, and the GPU reference path its asserts (``torch._assert_async``, a few
    small kernels per call). The decode kernels' check of the lengths and used ``block_table``
    entries (in the combine) always runs: it costs nothing measurable. CPU tensors are always
    checked (their values cost nothing to read). Either way no kernel reads or writes outside
    the cache or the block table.
    """
    global _value_checks
    _value_checks = bool(enabled)


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def checks_values(t: torch.Tensor) -> bool:
    """Whether the values of t are checked: always on CPU; on a GPU unless turned off or while a
    CUDA graph is being captured. A graph replays every kernel it captured, and these checks are
    about 16 small kernels per decode call: on the H200 they took a graph-replayed batch-1 decode
    from 23.8 to 52.5 us (benchmarks/bench_decode.py --quick). Inside graphs the kernels still read
    nothing outside the cache or the block table; checks that cost nothing there belong in the
    kernels themselves (docs/kernel-notes.md, next steps)."""
    if t.device.type == "cpu":
        return True
    if not _value_checks or t.device.type == "meta":
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _require(bad: torch.Tensor, device_msg: str, detail: Callable[..., str]) -> None:
    """Fails if any element of the boolean tensor ``bad`` is True.

    CPU: ValueError(detail(*index of the first bad element)). Other devices: an asynchronous
    device-side assert carrying ``device_msg``, with no host synchronisation.
    """
    if bad.device.type == "cpu":
        if bad.any():
            raise ValueError(detail(*bad.nonzero()[0].tolist()))
    else:
        torch._assert_async(~bad.any(), device_msg)


def check_count(name: str, value, minimum: int = 1) -> None:
    """A Python int (or a SymInt under torch.compile) >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        _fail(f"{name} must be >= {minimum}, got {value}")


def check_seqlens_tensor(cache_seqlens: torch.Tensor, name: str = "cache_seqlens") -> None:
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache_seqlens).__name__}")
    if cache_seqlens.dim() != 1:
        _fail(f"{name} must have shape [batch], got {_shape(cache_seqlens)}")
    if cache_seqlens.dtype != torch.int32:
        _fail(f"{name} must be int32, got {cache_seqlens.dtype}")


def check_decode_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    d_v: int,
    causal: bool,
    kv_scale: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    compute: str = "exact",
) -> None:
    """Validates the shapes, dtypes and devices of :func:`torch_mla.mla_decode`'s arguments;
    raises ValueError/TypeError. The values (lengths, used block-table entries) are checked
    where they are used: by the kernel, or by :func:`check_decode_values` before the reference.
    """
    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_seqlens_tensor(cache_seqlens)
    if q.dim() != 4:
        _fail(f"q must have shape [batch, s_q, h_q, d_qk], got {_shape(q)}")
    if kv_cache.dim() != 4:
        _fail(f"kv_cache must have shape [num_blocks, page_size, h_kv, d_qk], "
              f"got {_shape(kv_cache)}")
    if block_table.dim() != 2:
        _fail(f"block_table must have shape [batch, max_blocks], got {_shape(block_table)}")
    b, s_q, h_q, d_qk = q.shape
    num_blocks, page, h_kv, d_kv = kv_cache.shape
    check_compute(compute, kv_cache)
    if kv_cache.dtype == FP8 or q.dtype == FP8:
        _check_fp8_decode(q, kv_cache, kv_scale, q_scale)
    else:
        if q.dtype not in DTYPES:
            _fail(f"q must be bfloat16, float16 or float32, got {q.dtype}")
        if kv_cache.dtype != q.dtype:
            _fail(f"kv_cache dtype ({kv_cache.dtype}) must match q's dtype ({q.dtype})")
        if kv_scale is not None:
            _fail(f"kv_scale is the scale of a float8_e4m3fn kv_cache; this kv_cache is "
                  f"{kv_cache.dtype}: pass kv_scale=None")
        if q_scale is not None:
            _fail(f"q_scale is the scale of a float8_e4m3fn q; this q is {q.dtype}: pass "
                  "q_scale=None")
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
    if d_kv != d_qk:
        _fail(f"kv_cache head dim ({d_kv}) must equal q's head dim d_qk ({d_qk})")
    if not (0 < d_v <= d_qk):
        _fail(f"d_v must be in (0, d_qk={d_qk}] (V is the first d_v columns of the cache), "
              f"got {d_v}")
    if s_q < 1 or h_q < 1:
        _fail(f"q must have s_q >= 1 and h_q >= 1, got s_q={s_q}, h_q={h_q}")
    if h_kv < 1:
        _fail(f"kv_cache must have at least one KV head (dim 2), got {h_kv}")
    if h_q % h_kv:
        _fail(f"h_q ({h_q}) must be a multiple of kv_cache's KV heads h_kv ({h_kv}, dim 2): "
              "query head h uses KV head h // (h_q // h_kv)")
    if block_table.shape[0] != b:
        _fail(f"block_table has {block_table.shape[0]} rows, expected batch = {b}")
    if cache_seqlens.shape[0] != b:
        _fail(f"cache_seqlens has {cache_seqlens.shape[0]} entries, expected batch = {b}")
    if q.stride(-1) != 1:
        _fail(f"q's last dimension must be contiguous (stride 1), got stride {q.stride(-1)}")
    if not kv_cache.is_contiguous():
        _fail("kv_cache must be contiguous (a persistent [num_blocks, 64, h_kv, d_qk] buffer)")
    if block_table.stride(-1) != 1:
        _fail("block_table's last dimension must be contiguous (stride 1)")


# Signatures of mla_decode calls that passed check_decode_call. An eager decode repeats a few of
# them every step, and building one costs half of what the checks cost (bench_host.py
# --cpu-model); a call that differs in anything the checks read is checked again.
_checked_calls: set = set()
_MAX_CHECKED_CALLS = 1024  # (batch sizes come and go while serving: forget them all then)


def check_decode_call(q, kv_cache, block_table, cache_seqlens, metadata, num_splits, d_v: int,
                      causal: bool, kv_scale=None, q_scale=None, compute: str = "exact") -> None:
    """:func:`check_decode_args` and :func:`check_schedule_args` of one mla_decode call, skipped
    when a call with the same signature passed them before: the type, shape, strides, dtype and
    device of every tensor, d_v, causal, compute and the scales' (type, shape, dtype, device) or
    None, which is everything those checks read."""
    try:
        key = (type(q), q.shape, q.stride(), q.dtype, q.device,
               type(kv_cache), kv_cache.shape, kv_cache.stride(), kv_cache.dtype, kv_cache.device,
               type(block_table), block_table.shape, block_table.stride(), block_table.dtype,
               block_table.device,
               type(cache_seqlens), cache_seqlens.shape, cache_seqlens.dtype,
               cache_seqlens.device,
               metadata.shape, metadata.dtype, metadata.device,
               num_splits.shape, num_splits.dtype, num_splits.device, d_v, causal, compute,
               None if kv_scale is None else (type(kv_scale), kv_scale.shape, kv_scale.dtype,
                                              kv_scale.device),
               None if q_scale is None else (type(q_scale), q_scale.shape, q_scale.dtype,
                                             q_scale.device))
        if key in _checked_calls:
            return
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
        key = None
    check_decode_args(q, kv_cache, block_table, cache_seqlens, d_v, causal, kv_scale, q_scale,
                      compute)
    check_schedule_args(metadata, num_splits, q.shape[0], q.device)
    if key is not None:
        if len(_checked_calls) >= _MAX_CHECKED_CALLS:
            _checked_calls.clear()
        _checked_calls.add(key)


COMPUTE_MODES = ("exact", "fp8")


def check_compute(compute: str, kv_cache: torch.Tensor) -> None:
    """compute: how an fp8 cache is computed with ("exact": 16-bit MMAs over the dequantized
    pages; "fp8": e4m3 Q and P on fp8 MMAs); only "exact" means anything for a 16-bit cache."""
    if compute not in COMPUTE_MODES:
        _fail(f"compute must be 'exact' or 'fp8', got {compute!r}")
    if compute == "fp8" and kv_cache.dtype != FP8:
        _fail(f"compute='fp8' (e4m3 Q and P on fp8 tensor cores) needs a float8_e4m3fn "
              f"kv_cache; this kv_cache is {kv_cache.dtype}: pass compute='exact'")


def _check_fp8_decode(q, kv_cache, kv_scale, q_scale) -> None:
    if kv_cache.dtype != FP8:
        _fail(f"a float8_e4m3fn q needs a float8_e4m3fn kv_cache, got {kv_cache.dtype}")
    if q.dtype not in (*DTYPES, FP8):
        _fail(f"with a float8_e4m3fn kv_cache, q must be bfloat16, float16, float32 or "
              f"float8_e4m3fn, got {q.dtype}")
    check_scale("kv_scale", kv_scale, kv_cache, "kv_cache")
    if q.dtype == FP8:
        check_scale("q_scale", q_scale, q, "q")
    elif q_scale is not None:
        _fail(f"q_scale is the scale of a float8_e4m3fn q; this q is {q.dtype}: pass "
              "q_scale=None")


def check_scale(name: str, scale, x: torch.Tensor, x_name: str) -> None:
    """The dequantization scale of the float8_e4m3fn tensor x: a float32 tensor of one element
    on x's device (value = x.float() * scale)."""
    if scale is None:
        _fail(f"{x_name} is float8_e4m3fn: pass {name}=, a float32 tensor of shape [1] "
              f"(value = {x_name}.float() * {name})")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (float32, shape [1]), got "
                        f"{type(scale).__name__}")
    if scale.numel() != 1:
        _fail(f"{name} must hold one scale (shape [1]): one scale per tensor only for now, "
              f"got shape {_shape(scale)}")
    if scale.dtype != torch.float32:
        _fail(f"{name} must be float32, got {scale.dtype}")
    if scale.device != x.device:
        _fail(f"{name} must be on {x_name}'s device ({x.device}), got {scale.device}")


def decode_out_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """mla_decode's output dtype: q's, bf16 for a float8_e4m3fn q."""
    return torch.bfloat16 if q_dtype == FP8 else q_dtype


def _for_op(key: str, op: str) -> str:
    """DEVICE_MESSAGES[key] with its op name (the text before the first colon) replaced by op."""
    return op + DEVICE_MESSAGES[key][DEVICE_MESSAGES[key].index(":"):]


def check_decode_values(num_blocks: int, block_table: torch.Tensor,
                        cache_seqlens: torch.Tensor, op: str = "torch_mla.mla_decode",
                        cache: str = "kv_cache") -> None:
    """0 <= L <= max_blocks * 64 for every length L, and every block-table entry a request uses
    (its first ceil(L / 64)) is a page of the cache; unused entries may hold anything. op and
    cache name the calling op and its cache argument in the messages."""
    L = cache_seqlens
    width = block_table.shape[1]
    cap = width * PAGE_SIZE

    def bad_length(r):
        n = int(L[r])
        if n < 0:
            return f"cache_seqlens[{r}] = {n}, but lengths must be >= 0"
        return (f"cache_seqlens[{r}] = {n}, but block_table covers only {width} pages x "
                f"{PAGE_SIZE} = {cap} tokens")

    _require((L < 0) | (L > cap), _for_op("cache_seqlens", op), bad_length)
    used = torch.arange(width, device=L.device)[None, :] * PAGE_SIZE < L[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_blocks))

    def bad_page(r, j):
        n = -(-int(L[r]) // PAGE_SIZE)
        entries = "entry must be a page id" if n == 1 else f"{n} entries must be page ids"
        return (f"block_table[{r}, {j}] = {int(block_table[r, j])} is not a page of {cache} "
                f"(num_blocks = {num_blocks}): request {r} has {int(L[r])} tokens, so its first "
                f"{entries} in [0, {num_blocks})")

    _require(bad, _for_op("block_table", op), bad_page)


def check_schedule_args(metadata: torch.Tensor, num_splits: torch.Tensor, batch: int,
                        device: torch.device, batch_name: str = "batch",
                        maker: str = "torch_mla.get_decode_schedule") -> None:
    """The schedule's shapes, dtypes and device (batch: its requests, called batch_name in
    the message; maker: the function that computes it)."""
    if metadata.dim() != 2 or metadata.shape[1] != 8 or metadata.dtype != torch.int32:
        _fail(f"schedule metadata must be int32 [num_parts, 8], got {metadata.dtype} "
              f"{_shape(metadata)}; compute it with {maker}")
    if num_splits.dim() != 1 or num_splits.shape[0] != batch + 1 or num_splits.dtype != torch.int32:
        _fail(f"num_splits must be int32 [{batch_name} + 1] = [{batch + 1}], got "
              f"{num_splits.dtype} {_shape(num_splits)}; compute it with {maker}")
    if metadata.device != device or num_splits.device != device:
        _fail(f"schedule tensors must be on {device}, got {metadata.device} and "
              f"{num_splits.device}")


def unpack_schedule(schedule) -> tuple[torch.Tensor, torch.Tensor]:
    """(metadata, num_splits) from a DecodeSchedule or a plain 2-tuple of tensors."""
    if isinstance(schedule, tuple) and len(schedule) == 2:
        metadata, num_splits = schedule
        if isinstance(metadata, torch.Tensor) and isinstance(num_splits, torch.Tensor):
            return metadata, num_splits
    raise TypeError("schedule must be a torch_mla.DecodeSchedule (from get_decode_schedule) or a "
                    f"(metadata, num_splits) tuple of tensors, got {type(schedule).__name__}")


def check_append_args(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                      slot_mapping: torch.Tensor, values: bool = True,
                      kv_scale: torch.Tensor | None = None) -> None:
    """Validates :func:`torch_mla.append_kv`'s arguments (values as in check_decode_args)."""
    for name, t in (("kv_cache", kv_cache), ("kv_c", kv_c), ("k_pe", k_pe),
                    ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if kv_cache.dim() == 4 and kv_cache.shape[1] == PAGE_SIZE and kv_cache.shape[2] != 1:
        _fail(f"append_kv writes one latent head per token: kv_cache must have shape "
              f"[num_blocks, {PAGE_SIZE}, 1, d_qk], got {_shape(kv_cache)}")
    if kv_cache.dim() != 4 or kv_cache.shape[1] != PAGE_SIZE:
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
    if kv_cache.dtype == FP8:
        check_scale("kv_scale", kv_scale, kv_cache, "kv_cache")
    elif kv_cache.dtype not in DTYPES:
        _fail(f"kv_cache must be bfloat16, float16, float32 or float8_e4m3fn, got "
              f"{kv_cache.dtype}")
    elif kv_scale is not None:
        _fail(f"kv_scale is the scale of a float8_e4m3fn kv_cache; this kv_cache is "
              f"{kv_cache.dtype}: pass kv_scale=None")
    check_append_devices_and_slots(kv_cache, kv_c, k_pe, slot_mapping, T, values)


def check_append_devices_and_slots(kv_cache, kv_c, k_pe, slot_mapping, T: int,
                                   values: bool) -> None:
    """append_kv's last checks, for every cache format: one device, and (with values) the
    slots' values (T: the token count)."""
    dev = kv_cache.device  # (compared one by one: half the host time of a set, every call)
    if kv_c.device != dev or k_pe.device != dev or slot_mapping.device != dev:
        devs = {t.device for t in (kv_cache, kv_c, k_pe, slot_mapping)}
        _fail("kv_cache, kv_c, k_pe and slot_mapping must be on one device, "
              f"got {sorted(map(str, devs))}")
    if values and T > 0 and checks_values(slot_mapping):
        check_slot_values(kv_cache.shape[0], slot_mapping)


def check_slot_values(num_blocks: int, slot_mapping: torch.Tensor,
                      op: str = "torch_mla.append_kv") -> None:
    """Every slot < num_blocks * 64, and no slot >= 0 twice (negative slots are padding); op
    names the calling op in the device messages."""
    cap = num_blocks * PAGE_SIZE
    _require(slot_mapping >= cap, _for_op("slot_range", op),
             lambda t: f"slot_mapping[{t}] = {int(slot_mapping[t])}, but the cache has only "
                       f"{cap} slots ({num_blocks} pages x {PAGE_SIZE})")
    check_slot_repeats(slot_mapping, op)


def check_slot_repeats(slot_mapping: torch.Tensor, op: str = "torch_mla.append_kv") -> None:
    """No slot >= 0 twice."""
    # A repeated slot would be written by two tokens in an unspecified order; sorted, the
    # repeats are neighbours (stable: the earlier token comes first).
    s, order = torch.sort(slot_mapping, stable=True)
    _require((s[1:] == s[:-1]) & (s[1:] >= 0), _for_op("slot_repeat", op),
             lambda i: f"slot_mapping[{int(order[i])}] and slot_mapping[{int(order[i + 1])}] "
                       f"both write slot {int(s[i])}; slots must be distinct (negative slots are "
                       "skipped and may repeat)")
