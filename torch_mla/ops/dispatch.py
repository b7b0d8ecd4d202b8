"""Kernel choice and launch: which implementation each op runs for its inputs, and the host
side of a decode kernel's launch.

The kernels themselves come from the registry (ops/registry.py: every compiled variant, keyed by
a frozen config, built from fake tensors whose batch, query rows, page count and block-table
width are symbolic, with ``--enable-tvm-ffi`` so that a launch takes torch tensors directly on
the current stream, ~7 us of host time; kept on disk by kernel_cache.py). Launches allocate
nothing whose size depends on data: safe in CUDA-graph capture.

API (stable, for the ops, tests and tools):
    decode_backend(...)          which decode implementation runs for such inputs, and why
    find_decode_kernel / find_schedule_kernel / find_append_kernel   the ops' kernel choice
    run_sm90, run_sm90_fp8, run_sm80, run_sm100   the launchers find_decode_kernel returns
    run_split_kv(backend, ...)   their common host side
    keysm_columns(backend, rows, compute, q_fp8, h_kv, batch)   the keys-on-M step's columns
                                 (0: another kernel)
    step_kind(backend, key, rows, compute, h_kv, batch, fp8)   run_split_kv's STEPS key
    STEPS                        key -> (dtype, causal, device index) -> compiled decode step;
                                 tests and tools swap entries to stand in for a kernel
    cuda_capability(device)      cached compute capability (tests patch it to pretend a GPU)
    device_arch(index)           the arch a CUDA device's kernels are compiled for
    combine_config, combine_variant   the combine's choice for a step
    device_num_sms(device)       a device's multiprocessor count (the combine's choice reads it)
    clear_caches()               forget cached devices, kernels, warnings and first-use checks
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from ..constants import (
    COMBINE_VARIANTS,
    D_QK,
    D_V,
    KEYSM_COLUMNS,
    KEYSM_DEFAULT_ROWS,
    KEYSM_FAST_COLUMNS,
    KEYSM_FAST_MIN_BATCH,
    KEYSM_RS_COLUMNS,
    KEYSM_RS_MIN_BATCH,
    LOG2_E,
    PAGE_SIZE,
)
from ..contract import keysm_columns_for
from . import registry, selfcheck
from .checks import decode_out_dtype
from .registry import SM90_ARCH, SM100_ARCH, gpu_arch  # noqa: F401  (gpu_arch: __main__'s)

_capability: dict[int, tuple[int, int]] = {}


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device (cached: torch.cuda.get_device_capability costs ~10 us,
    on every eager decode call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capability.get(index)
    if cap is None:
        cap = _capability[index] = torch.cuda.get_device_capability(index)
    return cap


def _env_flag(name: str, value: str = "1"):
    """A function telling whether the environment variable `name` is `value`, read live at each
    call. os.environ.get of an unset name costs ~1 us (a KeyError raised and caught inside the
    mapping), and eager decode calls read two of them; the dict beneath os.environ answers in
    ~0.05 us and is the live environment (os.environ[...] =, monkeypatch.setenv and
    mock.patch.dict all write through to it)."""
    data = getattr(os.environ, "_data", None)
    if not isinstance(data, dict):
        return lambda: os.environ.get(name) == value
    key, one = os.environ.encodekey(name), os.environ.encodevalue(value)
    return lambda: data.get(key) == one


_force_reference = _env_flag("TORCH_MLA_FORCE_REFERENCE")
_sm100_enabled = _env_flag("TORCH_MLA_SM100")
# The sparse kernels on sm_90a (ops.sparse.sparse_backend): the keys-on-M one for h_q <= 32
# (TORCH_MLA_SPARSE_KEYSM=0: never), else the SM90 one where ops.sparse.sm90_sparse_pays
# (TORCH_MLA_SPARSE_SM90=1: every such shape, =0: never), over the 16-bit cache and the
# 656-byte rows at 64-128 heads its split variant (ops.sparse.split_sparse_pays;
# TORCH_MLA_SPARSE_PRODUCER below).
sparse_sm90_always = _env_flag("TORCH_MLA_SPARSE_SM90")
sparse_sm90_off = _env_flag("TORCH_MLA_SPARSE_SM90", "0")
sparse_keysm_off = _env_flag("TORCH_MLA_SPARSE_KEYSM", "0")
# TORCH_MLA_SPARSE_PRODUCER=1: where the dispatch takes the SM90 sparse kernel, its variant with
# a producer warpgroup that gathers and dequantizes (cute_kernels/sm90_producer_sparse_decode.py;
# the 16-bit cache and the 656-byte rows).
sparse_producer = _env_flag("TORCH_MLA_SPARSE_PRODUCER")
# =split: its variant with FlashMLA's split of the consumer warpgroups
# (cute_kernels/sm90_split_sparse_decode.py) wherever the SM90 kernel would run; at 64-128
# heads over the 16-bit cache and the 656-byte rows the split is the default anyway (faster
# than the SM90 kernel on every row measured on an H100: docs/kernels/sparse.md, sessions 30
# and 39); =0: the SM90 kernel where it pays, else the portable one (the choice before the
# split).
sparse_split = _env_flag("TORCH_MLA_SPARSE_PRODUCER", "split")
sparse_heads_on_m = _env_flag("TORCH_MLA_SPARSE_PRODUCER", "0")
# Where the split kernel runs over the 656-byte rows at h_q 65-128, its cluster pair
# (ops.sparse.split_pair_rows; faster than one CTA an m-block at every token count from 2 to 16
# measured in session 46); TORCH_MLA_SPARSE_SPLIT_PAIR=0: without it.
sparse_split_pair_off = _env_flag("TORCH_MLA_SPARSE_SPLIT_PAIR", "0")
# TORCH_MLA_SPARSE_KEYSM_RS=1: the keys-on-M sparse kernel's ping-pong variant over the FP8 caches
# at every h_q (cute_kernels/sm90_keysm_rs_sparse_decode.py; run on an H100 in session 26: correct,
# slower than the default choice at h_q 64-128 and small batches); =32: the same with at most 32
# columns a CTA (above 32 heads a CTA for each 32, where 1 would take 64 columns: the A/B of the two
# ways to take 64 heads).
_sparse_keysm_rs_1 = _env_flag("TORCH_MLA_SPARSE_KEYSM_RS")
sparse_keysm_rs_32 = _env_flag("TORCH_MLA_SPARSE_KEYSM_RS", "32")


def sparse_keysm_rs() -> bool:
    """Whether TORCH_MLA_SPARSE_KEYSM_RS asks for the sparse ping-pong kernel (1 or 32)."""
    return _sparse_keysm_rs_1() or sparse_keysm_rs_32()


# TORCH_MLA_PORTABLE=1: the portable kernel even where a native one exists (testing).
portable_forced = _env_flag("TORCH_MLA_PORTABLE")
# The keys-on-M SM90 kernel (docs/kernels/keysm.md): by default where s_q * h_q <= 32;
# TORCH_MLA_KEYSM=1 up to 64 rows, =128 up to 128 (above 64 a CTA for each 64 rows: the grid's
# m-blocks; run on an H100: slower than heads-on-M there), TORCH_MLA_KEYSM=0 never.
keysm_wide = _env_flag("TORCH_MLA_KEYSM")
_keysm_128 = _env_flag("TORCH_MLA_KEYSM", "128")
_keysm_off = _env_flag("TORCH_MLA_KEYSM", "0")
# Its ping-pong variant over an e4m3 cache (cute_kernels/sm90_keysm_rs_decode.py), where the
# columns are in KEYSM_RS_COLUMNS: from a batch of KEYSM_RS_MIN_BATCH[columns] by default;
# TORCH_MLA_KEYSM_RS=1 at every batch, TORCH_MLA_KEYSM_RS=0 never.
keysm_rs_always = _env_flag("TORCH_MLA_KEYSM_RS")
keysm_rs_off = _env_flag("TORCH_MLA_KEYSM_RS", "0")
# Its fast mode (compute="fp8", cute_kernels/sm90_keysm_fast_decode.py) for bf16/fp16 q where
# s_q * h_q <= 32, by default from a batch of KEYSM_FAST_MIN_BATCH[columns] (faster than the
# heads-on-M fast mode there on every row measured: docs/kernels/keysm.md "Fast mode" and
# "Session 23"); TORCH_MLA_KEYSM_FAST=1 at every batch, =0 (or TORCH_MLA_KEYSM=0): never.
keysm_fast_always = _env_flag("TORCH_MLA_KEYSM_FAST")
keysm_fast_off = _env_flag("TORCH_MLA_KEYSM_FAST", "0")
# TORCH_MLA_FAST_DITHER=1: the heads-on-M fast mode with P dithered before its e4m3 rounding
# (MLADecodeSm90Fast.p_dither; its tests pass on an H100, 1.2-1.3x slower: docs/benchmarks-h100.md).
fast_dither = _env_flag("TORCH_MLA_FAST_DITHER")


def keysm_max_rows() -> int:
    """The most query rows (s_q * h_q of one KV head) the dispatch gives the keys-on-M kernel
    now: KEYSM_DEFAULT_ROWS (32), 64 with TORCH_MLA_KEYSM=1, 128 with =128, 0 with =0."""
    if keysm_wide():
        return KEYSM_COLUMNS[-1]
    if _keysm_128():
        return 2 * KEYSM_COLUMNS[-1]
    return 0 if _keysm_off() else KEYSM_DEFAULT_ROWS


def keysm_kind(columns: int, fp8: bool, compute: str = "exact", h_kv: int = 1,
               batch: int = 1) -> str:
    """The STEPS key of the keys-on-M step of ``columns`` (keysm_columns): over a float8_e4m3fn
    cache its ping-pong variant where it takes the columns (KEYSM_RS_COLUMNS: 8, 16, 32, 64),
    the cache has one KV head
    (its pages are loaded as whole 36 KB blocks, which h_kv > 1 interleaves) and ``batch``
    (requests) is at least KEYSM_RS_MIN_BATCH[columns] (8 at 8 and 16 columns, 32 at 32; 64
    columns only with TORCH_MLA_KEYSM_RS=1, which takes it at any batch; =0: never);
    in fast mode (compute="fp8") that variant's fast mode."""
    if not fp8:
        return "sm90_keysm"
    if compute == "fp8":
        return "sm90_keysm_fast"
    if columns in KEYSM_RS_COLUMNS and h_kv == 1:
        least = KEYSM_RS_MIN_BATCH.get(columns)  # (None: opt-in only)
        if keysm_rs_always() or (least is not None and batch >= least and not keysm_rs_off()):
            return "sm90_keysm_rs"
    return "sm90_keysm_fp8"


def keysm_columns(backend: str, rows: int, compute: str = "exact", q_fp8: bool = False,
                  h_kv: int = 1, batch: int = 1) -> int:
    """The query columns of the keys-on-M step (cute_kernels/sm90_keysm_decode.py) that runs
    ``rows`` (s_q * h_q of one KV head) query rows, or 0 for the other kernels: on the SM90
    backend (compute capability 9.0, sm_90a), a bf16/fp16 or float8_e4m3fn cache in exact
    mode, and 1 <= rows <= keysm_max_rows() (the smallest of 8, 16, 32, 64 that holds them;
    64 above 64 rows, TORCH_MLA_KEYSM=128's, a CTA for each 64);
    in fast mode (compute="fp8", q not float8_e4m3fn, one KV head: its pages are loaded as
    whole 36 KB blocks, which h_kv > 1 interleaves) where rows <= 32 (its fast variant's
    columns, KEYSM_FAST_COLUMNS) and ``batch`` (requests) is at least
    KEYSM_FAST_MIN_BATCH[columns] (1 at 8 and 16 columns, 4 at 32; TORCH_MLA_KEYSM_FAST=1: at
    every batch, =0: never)."""
    if backend != "sm90":
        return 0
    if compute != "exact":
        if q_fp8 or h_kv != 1 or keysm_fast_off():
            return 0
        columns = keysm_columns_for(rows, min(KEYSM_FAST_COLUMNS[-1], keysm_max_rows()))
        if columns and (keysm_fast_always() or batch >= KEYSM_FAST_MIN_BATCH[columns]):
            return columns
        return 0
    if rows > keysm_max_rows():
        return 0
    return keysm_columns_for(min(rows, KEYSM_COLUMNS[-1]))  # (above 64 rows: CTAs of 64)


def step_kind(backend: str, key: str, rows: int, compute: str, h_kv: int, batch: int,
              fp8: bool) -> tuple[str, int]:
    """run_split_kv's choice: (the STEPS key, the keys-on-M columns or 0) for ``rows`` query
    rows a KV head of a batch of ``batch`` requests; key is the backend's own step
    (backend, + "_fp8" or "_fp8_fast" over a float8_e4m3fn cache, + "_q8" for e4m3 q)."""
    columns = keysm_columns(backend, rows, compute, key.endswith("_q8"), h_kv, batch)
    if columns:
        return keysm_kind(columns, fp8, compute, h_kv, batch), columns
    return key, 0


def decode_backend(device: torch.device | str, dtype: torch.dtype, d_qk: int = D_QK,
                   d_v: int = D_V, page_size: int = PAGE_SIZE,
                   cache_dtype: torch.dtype | None = None,
                   compute: str = "exact") -> tuple[str, str]:
    """Which implementation :func:`torch_mla.mla_decode` runs for inputs like these, and why.

    Args:
        device: where q and the cache live; dtype: q's (and the cache's) dtype;
        d_qk, d_v, page_size: the problem's widths and the cache's page size;
        cache_dtype: the cache's dtype where it differs from q's (float8_e4m3fn);
        compute: mla_decode's (an fp8 cache's mode, "exact" or "fp8").

    Returns:
        ``(name, reason)``: name is ``"sm90"`` (the CuTe DSL kernel for H100/H200; with a
        float8_e4m3fn cache its exact mode, pages converted to 16 bits on chip, or with
        compute="fp8" its fast mode), ``"sm100"``
        (the CuTe DSL kernel for B200, only with ``TORCH_MLA_SM100=1``: it has not run on a
        Blackwell GPU yet), ``"sm80"`` (the portable CuTe DSL kernel on SM80-class
        instructions, for every other GPU of compute capability 8.0 or newer, and on any of them
        with ``TORCH_MLA_PORTABLE=1``) or ``"reference"`` (plain PyTorch, fp32 accumulate);
        reason is one sentence for a user.
    """
    if not isinstance(device, torch.device):  # (a conversion costs ~0.3 us, every eager call)
        device = torch.device(device)
    if device.type != "cuda":
        return "reference", f"{device.type} tensors: the kernels run on NVIDIA GPUs"
    if _force_reference():
        return "reference", "TORCH_MLA_FORCE_REFERENCE=1 is set"
    if torch.float8_e4m3fn in (dtype, cache_dtype):
        return _fp8_backend(device, dtype, d_qk, d_v, page_size, compute)
    if dtype not in (torch.bfloat16, torch.float16):
        return "reference", f"{dtype} inputs: the kernels take bfloat16 or float16"
    if (d_qk, d_v, page_size) != (D_QK, D_V, PAGE_SIZE):
        return "reference", (f"d_qk={d_qk}, d_v={d_v}, page size {page_size}: the kernels are "
                             f"built for d_qk={D_QK}, d_v={D_V}, page size {PAGE_SIZE}")
    major, minor = cuda_capability(device)
    if major < 8:
        return "reference", (f"compute capability {major}.{minor}: the kernels need 8.0 "
                             "(Ampere) or newer")
    if (major, minor) == (9, 0) and not portable_forced():
        keysm = _keysm_clause()
        return "sm90", ("compute capability 9.0: the SM90 CuTe DSL kernel"
                        + (f" ({keysm})" if keysm else ""))
    if (major, minor) == (10, 0) and _sm100_enabled() and not portable_forced():
        return "sm100", ("compute capability 10.0 and TORCH_MLA_SM100=1: the SM100 CuTe DSL "
                         "kernel (not yet run on a Blackwell GPU; checked against the "
                         "reference on first use)")
    if portable_forced():
        why = "TORCH_MLA_PORTABLE=1"
    elif (major, minor) == (10, 0):
        why = (f"compute capability {major}.{minor} (the native SM100 kernel has not run on a "
               "Blackwell GPU yet: TORCH_MLA_SM100=1 opts in to it)")
    else:
        why = f"compute capability {major}.{minor}"
    return "sm80", (f"{why}: the portable CuTe DSL kernel (SM80 instructions; verified on an "
                    "H200" + ("" if (major, minor) == (9, 0) else
                              ", checked against the reference on first use on this GPU") + ")")


def _fp8_backend(device: torch.device, dtype: torch.dtype, d_qk: int, d_v: int,
                 page_size: int, compute: str = "exact") -> tuple[str, str]:
    """decode_backend for a float8_e4m3fn cache (q bf16/fp16/float8_e4m3fn): the SM90 kernel
    (exact or fast mode, as compute says) on compute capability 9.0, else the reference."""
    deq = "the reference dequantizes the pages it reads to float32"
    if dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        return "reference", (f"{dtype} q with a float8_e4m3fn cache: the FP8 kernel takes a "
                             f"bfloat16, float16 or float8_e4m3fn q ({deq})")
    if (d_qk, d_v, page_size) != (D_QK, D_V, PAGE_SIZE):
        return "reference", (f"d_qk={d_qk}, d_v={d_v}, page size {page_size}: the FP8 kernel "
                             f"is built for d_qk={D_QK}, d_v={D_V}, page size {PAGE_SIZE}")
    major, minor = cuda_capability(device)
    if (major, minor) != (9, 0) or portable_forced():
        why = "with TORCH_MLA_PORTABLE=1" if portable_forced() else (
            f"on compute capability {major}.{minor}")
        return "reference", (f"float8_e4m3fn cache {why}: the only FP8 kernel is the SM90 "
                             f"one ({deq})")
    if compute == "fp8":
        why = ("fast mode (compute='fp8': Q, quantized per row, on the fp8 tensor cores; P in "
               "e4m3 too, except on its keys-on-M variant, which keeps P in f16: bf16/fp16 q, "
               "one KV head, up to 16 query rows, or 32 from a batch of 4)")
    else:
        keysm = _keysm_clause()
        why = ("exact mode (pages converted exactly to 16 bits on chip, 16-bit MMAs"
               + (f"; {keysm})" if keysm else ")"))
    return "sm90", f"compute capability 9.0, float8_e4m3fn cache: the SM90 CuTe DSL kernel, {why}"


def _keysm_clause() -> str:
    """The decode_backend reason's clause on the keys-on-M variant ("" where it never runs)."""
    n = keysm_max_rows()
    return f"its keys-on-M variant where s_q * h_q <= {n}" if n else ""


_warned: set[str] = set()


def find_decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int):
    """A callable running the decode kernel for these inputs, or None (use the reference).

    Falling back to the reference on a GPU warns once per reason (it is orders of magnitude
    slower than a kernel); CPU inputs and TORCH_MLA_FORCE_REFERENCE=1 fall back silently."""
    if not q.is_cuda:
        return None
    name, reason = decode_backend(q.device, q.dtype, q.shape[-1], d_v, kv_cache.shape[1],
                                  kv_cache.dtype)
    if name == "sm90":
        return run_sm90_fp8 if kv_cache.dtype == torch.float8_e4m3fn else run_sm90
    if name == "sm80" and cuda_capability(q.device) == (9, 0):
        return run_sm80  # (the GPU it was verified on: no first-use check)
    if name in ("sm80", "sm100"):
        run = run_sm80 if name == "sm80" else run_sm100
        failed = _first_use_failed(name, run, q.device, q.dtype)
        if failed is None:
            return run
        reason = failed
    if reason not in _warned and not _force_reference():
        _warned.add(reason)
        warnings.warn(f"torch_mla.mla_decode runs the slow plain-PyTorch reference on this GPU: "
                      f"{reason}", stacklevel=3)
    return None


# (backend, device index, dtype) -> None once that kernel passed its first-use check there, else
# why it failed (the reference then runs for the rest of the process).
_first_use_checked: dict[tuple, str | None] = {}
_KERNEL_NAMES = {"sm80": "the portable kernel", "sm100": "the SM100 kernel"}


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _first_use_failed(backend: str, run, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when kernel ``run`` of ``backend`` matched the reference on small poisoned problems
    on this device (checked on the first call of the process, then remembered), else the
    reason. For kernels that have not run on this kind of GPU before (selfcheck.py)."""
    key = (backend, torch.device(device).index, dtype)
    if key not in _first_use_checked:
        what = _KERNEL_NAMES[backend]
        if _capturing():
            # The check synchronizes; it cannot run while a CUDA graph is being captured.
            return (f"{what}'s first-use check cannot run during a CUDA-graph capture; make one "
                    "call before capturing")
        why = selfcheck.check_kernel(run, device, dtype)
        _first_use_checked[key] = None if why is None else (
            f"{what} did not match the reference in its first-use check ({why})")
    return _first_use_checked[key]


def run_sm90(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale, causal):
    return run_split_kv("sm90", q, kv_cache, block_table, cache_seqlens, meta, num_splits,
                        softmax_scale, causal)


def run_sm90_fp8(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale,
                 causal, kv_scale, q_scale=None, compute="exact"):
    """The SM90 kernel over a float8_e4m3fn cache, exact mode or (compute="fp8") fast mode. In
    exact mode an e4m3 q becomes bf16 here (exact; its scale folds into the kernel's softmax
    scale); fast mode reads its bytes. out is bf16 for an e4m3 q."""
    return run_split_kv("sm90", q, kv_cache, block_table, cache_seqlens, meta, num_splits,
                        softmax_scale, causal, (kv_scale, q_scale), compute)


def run_sm80(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale, causal):
    return run_split_kv("sm80", q, kv_cache, block_table, cache_seqlens, meta, num_splits,
                        softmax_scale, causal)


def run_sm100(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale, causal):
    return run_split_kv("sm100", q, kv_cache, block_table, cache_seqlens, meta, num_splits,
                        softmax_scale, causal)


def run_split_kv(backend, q, kv_cache, block_table, cache_seqlens, meta, num_splits,
                 softmax_scale, causal, scales=None, compute="exact"):
    """The split-KV decode kernel of ``backend`` ("sm90", "sm100" or "sm80") and the combine,
    behind one host call; the host side (workspace, one launch per KV head, argument packing) is
    the same for all. scales: (kv_scale, q_scale or None) with a float8_e4m3fn cache; compute:
    its mode ("exact" or "fp8").

    Runs on every eager decode call of every layer: each Python-level tensor op here costs
    ~1 us of host time (benchmarks/bench_host.py), so there are as few as the launch needs."""
    index = q.device.index
    if index != torch.cuda.current_device():
        # Kernels launch on the current device's stream, and a model split over GPUs
        # (device_map) calls its layers on cuda:1 while cuda:0 is current.
        with torch.cuda.device(q.device):
            return run_split_kv(backend, q, kv_cache, block_table, cache_seqlens, meta,
                                num_splits, softmax_scale, causal, scales, compute)
    b, s_q, h_q, _ = q.shape
    num_blocks, _, h_kv, _ = kv_cache.shape
    if kv_cache.data_ptr() % 16:
        raise ValueError("kv_cache must be 16-byte aligned for the CUDA kernels (TMA, cp.async)")
    # (A loaded step takes its defaulted trailing arguments explicitly: None without fp8.)
    extra = (None, None, None)
    key = backend
    out_dtype = q.dtype
    if scales is not None:
        kv_scale, q_scale = scales
        key += "_fp8" if compute == "exact" else "_fp8_fast"
        if q.dtype == torch.float8_e4m3fn:
            out_dtype = decode_out_dtype(q.dtype)
            if compute == "exact":
                q = q.to(torch.bfloat16)  # exact; q_scale is applied in the kernel
            else:
                q = q.view(torch.uint8)  # fast mode reads e4m3 q's bytes as they are
                key += "_q8"
        # The kernel takes the cache's bytes (no fp8 type crosses DLPack).
        kv_cache = kv_cache.view(torch.uint8)
        extra = (kv_scale, kv_scale if q_scale is None else q_scale, int(q_scale is not None))
    # One launch per KV head, over query heads h_kv_idx * g .. (h_kv_idx + 1) * g - 1 and a
    # strided view of that head's latents (MLA models have one KV head: a single launch).
    g = h_q // h_kv
    rows = s_q * g
    if b == 0:  # (launches nothing, so loads no step either)
        return (q.new_empty(0, s_q, h_q, D_V, dtype=out_dtype),
                q.new_empty(0, h_q, s_q, dtype=torch.float32))
    kind, columns = step_kind(backend, key, rows, compute, h_kv, b, scales is not None)
    if kind.startswith("sm90_fp8_fast") and fast_dither():
        kind += "_dither"
    if columns:
        step = STEPS[kind](out_dtype, bool(causal) and s_q > 1, index, columns)
    else:
        step = STEPS[kind](out_dtype, bool(causal) and s_q > 1, index)
    parts = meta.shape[0]
    variant = combine_variant(b, parts, rows, device_num_sms(q.device))
    # One slot per piece a request can be cut into: at most batch + num_parts (scheduling.py).
    # (new_empty with the sizes as separate arguments: of the ways to allocate, the one that
    # costs least to parse, ~0.5 us below torch.empty(..., device=) per tensor.)
    oacc = q.new_empty(b + parts, rows, D_V, dtype=torch.float32)
    lseacc = q.new_empty(b + parts, rows, dtype=torch.float32)
    scale_log2 = softmax_scale * LOG2_E
    if h_kv == 1:
        out = q.new_empty(b, rows, D_V, dtype=out_dtype)
        lse = q.new_empty(b, h_q, s_q, dtype=torch.float32)
        # The cache is contiguous (checked): its one head's rows are a plain view. The combine
        # also checks the lengths and the used page ids (combine.check_request).
        step(_q_rows(q, b, rows), kv_cache.view(num_blocks, PAGE_SIZE, D_QK), block_table,
             cache_seqlens, meta, num_splits, out, lse, oacc, lseacc, scale_log2, variant,
             *extra)
        return out.view(b, s_q, h_q, D_V), lse
    out = q.new_empty(b, s_q, h_kv, g, D_V, dtype=out_dtype)
    lse = q.new_empty(b, h_kv, g, s_q, dtype=torch.float32)
    qg = q.view(b, s_q, h_kv, g, D_QK)
    for k in range(h_kv):
        out_k = q.new_empty(b, rows, D_V, dtype=out_dtype)
        lse_k = q.new_empty(b, g, s_q, dtype=torch.float32)
        step(_q_rows(qg[:, :, k], b, rows), kv_cache[:, :, k], block_table, cache_seqlens, meta,
             num_splits, out_k, lse_k, oacc, lseacc, scale_log2, variant, *extra)
        out[:, :, k] = out_k.view(b, s_q, g, D_V)
        lse[:, k] = lse_k
    return out.view(b, s_q, h_q, D_V), lse.view(b, h_q, s_q)



def _q_rows(q, b, rows):
    """q [b, s_q, g, 576] (any strides) as the kernels' [b, rows = s_q * g, 576] with 16-byte
    aligned rows (TMA): a view where q allows one, else a copy."""
    if q.is_contiguous() and not q.data_ptr() % 16:
        return q.view(b, rows, D_QK)  # (the usual q: nothing more to look at)
    q3 = q.reshape(b, rows, D_QK)
    if q3.stride(-1) != 1 or q3.stride(1) != D_QK or q3.data_ptr() % 16:
        q3 = q3.contiguous() if not q3.is_contiguous() else q3.clone()
    return q3


# TORCH_MLA_DEV_COMBINE_WPR (a developer knob for an A/B, read at import: 1, 4 or 16): every
# combine merges with that many warps a row (at unroll 4), whatever CombineConfig would choose
# (session 36's A/B of CombineConfig's wave rule: docs/benchmarks-h100.md).
_COMBINE_WPR = int(os.environ.get("TORCH_MLA_DEV_COMBINE_WPR") or 0)
if _COMBINE_WPR not in (0, *{w for w, _ in COMBINE_VARIANTS}):
    raise ValueError(f"TORCH_MLA_DEV_COMBINE_WPR takes 1, 4 or 16, not {_COMBINE_WPR}")


@functools.lru_cache(maxsize=None)
def combine_config(batch: int, num_parts: int, rows: int, num_sms: int = 132):
    """CombineConfig's choice (or TORCH_MLA_DEV_COMBINE_WPR's), cached: it runs on every eager
    decode call."""
    from ..scheduling import CombineConfig

    if _COMBINE_WPR:
        return CombineConfig(_COMBINE_WPR)
    return CombineConfig.from_heuristic(batch, num_parts, rows, num_sms)


@functools.lru_cache(maxsize=None)
def combine_variant(batch: int, num_parts: int, rows: int, num_sms: int = 132) -> int:
    """The index of that choice among the decode step's combine variants
    (constants.COMBINE_VARIANTS)."""
    return combine_config(batch, num_parts, rows, num_sms).variant


@functools.lru_cache(maxsize=None)
def device_num_sms(device: torch.device) -> int:
    """scheduling.default_num_sms, cached: read on every eager decode call."""
    from ..scheduling import default_num_sms

    return default_num_sms(device)




# --- the compiled kernels each choice runs (ops/registry.py builds and caches them) ----------

# STEPS key -> the DecodeStepConfig fields besides dtype and causal.
_STEP_KINDS = {
    "sm90": {"backend": "sm90"},
    "sm90_fp8": {"backend": "sm90", "kv_fp8": True},
    "sm90_fp8_fast": {"backend": "sm90", "kv_fp8": True, "compute": "fp8"},
    "sm90_fp8_fast_q8": {"backend": "sm90", "kv_fp8": True, "compute": "fp8", "q_fp8": True},
    "sm90_fp8_fast_dither": {"backend": "sm90", "kv_fp8": True, "compute": "fp8",
                             "p_dither": True},
    "sm90_fp8_fast_q8_dither": {"backend": "sm90", "kv_fp8": True, "compute": "fp8",
                                "q_fp8": True, "p_dither": True},
    "sm100": {"backend": "sm100"},
    "sm80": {"backend": "sm80"},
    "sm90_keysm": {"backend": "sm90_keysm"},
    "sm90_keysm_fp8": {"backend": "sm90_keysm", "kv_fp8": True},
    "sm90_keysm_rs": {"backend": "sm90_keysm_rs", "kv_fp8": True},
    "sm90_keysm_fast": {"backend": "sm90_keysm_fast", "kv_fp8": True, "compute": "fp8"},
}


@functools.lru_cache(maxsize=None)
def _step(kind: str, dtype: torch.dtype, causal: bool, arch: str, columns: int = 0):
    # Keyed by plain values: a config object built and hashed on every eager call would cost
    # ~1 us more. (columns: the keys-on-M kernel's, keysm_columns.)
    config = registry.DecodeStepConfig(dtype=registry.dtype_name(dtype), causal=causal,
                                       columns=columns, **_STEP_KINDS[kind])
    return registry.compiled(config, arch)


# key -> the compiled decode step for (dtype, causal, device index). The lambdas look the
# functions up when called, so tools and tests can swap them.
STEPS = {
    "sm90": lambda dtype, causal, index: _step("sm90", dtype, causal, SM90_ARCH),
    "sm90_fp8": lambda dtype, causal, index: _step("sm90_fp8", dtype, causal, SM90_ARCH),
    "sm90_fp8_fast": lambda dtype, causal, index: _step("sm90_fp8_fast", dtype, causal,
                                                        SM90_ARCH),
    "sm90_fp8_fast_q8": lambda dtype, causal, index: _step("sm90_fp8_fast_q8", dtype, causal,
                                                           SM90_ARCH),
    "sm90_fp8_fast_dither": lambda dtype, causal, index: _step("sm90_fp8_fast_dither", dtype,
                                                               causal, SM90_ARCH),
    "sm90_fp8_fast_q8_dither": lambda dtype, causal, index: _step(
        "sm90_fp8_fast_q8_dither", dtype, causal, SM90_ARCH),
    "sm100": lambda dtype, causal, index: _step("sm100", dtype, causal, SM100_ARCH),
    "sm80": lambda dtype, causal, index: _step("sm80", dtype, causal, device_arch(index)),
    # (the keys-on-M steps take their column count too: keysm_columns)
    "sm90_keysm": lambda dtype, causal, index, columns: _step("sm90_keysm", dtype, causal,
                                                              SM90_ARCH, columns),
    "sm90_keysm_fp8": lambda dtype, causal, index, columns: _step("sm90_keysm_fp8", dtype,
                                                                  causal, SM90_ARCH, columns),
    "sm90_keysm_rs": lambda dtype, causal, index, columns: _step("sm90_keysm_rs", dtype,
                                                                 causal, SM90_ARCH, columns),
    "sm90_keysm_fast": lambda dtype, causal, index, columns: _step("sm90_keysm_fast", dtype,
                                                                   causal, SM90_ARCH, columns),
}


@functools.lru_cache(maxsize=None)
def device_arch(index: int) -> str:
    """gpu_arch of CUDA device `index` (cached: read on every eager decode call)."""
    return gpu_arch(*cuda_capability(torch.device("cuda", index)))


@functools.lru_cache(maxsize=None)
def _small_kernel_arch(device: torch.device) -> str | None:
    """The arch the small kernels are compiled for on this CUDA device, or None (older than
    SM80, or unknown to the DSL): looked up once per device (this runs on every eager call)."""
    return registry.PORTABLE_ARCHS.get(tuple(cuda_capability(device)))


@functools.lru_cache(maxsize=None)
def _schedule(arch: str):
    return registry.compiled(registry.ScheduleConfig(), arch)


def find_schedule_kernel(device: torch.device):
    """The compiled schedule kernel for a CUDA device, else None (compute_schedule's torch ops:
    CPU tensors, TORCH_MLA_FORCE_REFERENCE=1, a GPU without a kernel arch)."""
    if device.type != "cuda" or _force_reference():
        return None
    arch = _small_kernel_arch(device)
    return None if arch is None else _schedule(arch)


_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_APPEND_SOURCES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=None)
def _append(arch: str, cache_dtype: torch.dtype, source_dtype: torch.dtype,
            slot_dtype: torch.dtype):
    name = registry.dtype_name
    config = registry.AppendKVConfig(name(cache_dtype), name(source_dtype), name(slot_dtype))
    return registry.compiled(config, arch)


def find_append_kernel(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                       slot_mapping: torch.Tensor):
    """The compiled append_kv kernel for these (validated) arguments, else None (the reference):
    a bf16/fp16 cache (any SM80+ GPU) or a float8_e4m3fn one (SM89+: the e4m3 conversion) of
    576-wide rows, 16-byte aligned, sources of one dtype. The fp8 kernel takes the cache as its
    bytes (``kv_cache.view(torch.uint8)``) and kv_scale after the two check flags."""
    if not kv_cache.is_cuda or _force_reference():
        return None
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if ((not fp8 and kv_cache.dtype not in _KERNEL_DTYPES) or kv_c.dtype not in _APPEND_SOURCES
            or k_pe.dtype != kv_c.dtype or kv_c.shape[1] != D_V or k_pe.shape[1] != D_QK - D_V
            or kv_cache.data_ptr() % 16):
        return None
    arch = _small_kernel_arch(kv_cache.device)
    if arch is None or (fp8 and arch not in registry.FP8_APPEND_ARCHS):
        return None
    return _append(arch, kv_cache.dtype, kv_c.dtype, slot_mapping.dtype)


def clear_caches() -> None:
    """Forgets what this module cached: device capabilities and arches, the compiled kernels
    looked up, the warnings given and the first-use checks' results (for tests that pretend
    other GPUs or stand in for kernels; kernel_cache keeps the compiled kernels themselves)."""
    _capability.clear()
    _warned.clear()
    _first_use_checked.clear()
    for f in (device_arch, _small_kernel_arch, _schedule, _append, _step,
              combine_config, combine_variant, device_num_sms):
        f.cache_clear()
