"""Kernel selection and the compile cache.

Each kernel is compiled once per static configuration (dtype, causal, arch) from fake tensors
whose batch, query rows (s_q * h_q), page count and block-table width are symbolic, with
``--enable-tvm-ffi`` so that a launch takes torch tensors directly on the current stream (~7 us of
host time). Launches allocate nothing whose size depends on data: safe in CUDA-graph capture.
Compiled kernels persist on disk (kernel_cache.py; ``python -m torch_mla.precompile``).
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch

from ..scheduling import PAGE_SIZE
from . import kernel_cache

D_QK, D_V = 576, 512


def _cuda_arch(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def decode_backend(device: torch.device | str, dtype: torch.dtype, d_qk: int = D_QK,
                   d_v: int = D_V, page_size: int = PAGE_SIZE) -> tuple[str, str]:
    """Which implementation :func:`torch_mla.mla_decode` runs for inputs like these, and why.

    Args:
        device: where q and the cache live; dtype: q's (and the cache's) dtype;
        d_qk, d_v, page_size: the problem's widths and the cache's page size.

    Returns:
        ``(name, reason)``: name is ``"sm90"`` (the CuTe DSL kernel for H100/H200) or
        ``"reference"`` (plain PyTorch, fp32 accumulate); reason is one sentence for a user.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "reference", f"{device.type} tensors: the kernels run on NVIDIA GPUs"
    if os.environ.get("TORCH_MLA_FORCE_REFERENCE") == "1":
        return "reference", "TORCH_MLA_FORCE_REFERENCE=1 is set"
    if dtype not in (torch.bfloat16, torch.float16):
        return "reference", f"{dtype} inputs: the kernels take bfloat16 or float16"
    if (d_qk, d_v, page_size) != (D_QK, D_V, PAGE_SIZE):
        return "reference", (f"d_qk={d_qk}, d_v={d_v}, page size {page_size}: the kernels are "
                             f"built for d_qk={D_QK}, d_v={D_V}, page size {PAGE_SIZE}")
    major, minor = _cuda_arch(device)
    if (major, minor) != (9, 0):
        return "reference", (f"compute capability {major}.{minor}: torch_mla has a kernel for "
                             "9.0 (H100/H200) only so far")
    return "sm90", "compute capability 9.0: the SM90 CuTe DSL kernel"


_warned: set[str] = set()


def find_decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int):
    """A callable running the decode kernel for these inputs, or None (use the reference).

    Falling back to the reference on a GPU warns once per reason (it is orders of magnitude
    slower than a kernel); CPU inputs and TORCH_MLA_FORCE_REFERENCE=1 fall back silently."""
    if not q.is_cuda:
        return None
    name, reason = decode_backend(q.device, q.dtype, q.shape[-1], d_v, kv_cache.shape[1])
    if name == "sm90":
        return _run_sm90
    if reason not in _warned and os.environ.get("TORCH_MLA_FORCE_REFERENCE") != "1":
        _warned.add(reason)
        warnings.warn(f"torch_mla.mla_decode runs the slow plain-PyTorch reference on this GPU: "
                      f"{reason}", stacklevel=3)
    return None


def _run_sm90(q, *args):
    # Kernels launch on the current device, and a model split over GPUs (device_map) calls its
    # layers on cuda:1 while cuda:0 is current.
    with torch.cuda.device(q.device):
        return _run_sm90_here(q, *args)


def _run_sm90_here(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale,
                   causal):
    b, s_q, h_q, _ = q.shape
    h_kv = kv_cache.shape[2]
    if kv_cache.data_ptr() % 16:
        raise ValueError("kv_cache must be 16-byte aligned for the CUDA kernel (TMA)")
    # One launch per KV head, over query heads h_kv_idx * g .. (h_kv_idx + 1) * g - 1 and a
    # strided view of that head's latents (MLA models have one KV head: a single launch).
    g = h_q // h_kv
    rows = s_q * g
    decode = _compiled_decode_sm90(q.dtype, bool(causal) and s_q > 1)
    combine = _compiled_combine(q.dtype, combine_warps_per_row(b, meta.shape[0], rows))
    # One slot per piece a request can be cut into: at most batch + num_parts (scheduling.py).
    slots = b + meta.shape[0]
    oacc = torch.empty(slots, rows, D_V, dtype=torch.float32, device=q.device)
    lseacc = torch.empty(slots, rows, dtype=torch.float32, device=q.device)
    scale_log2 = softmax_scale * math.log2(math.e)
    if h_kv == 1:
        out = torch.empty(b, s_q, h_q, D_V, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
        if b > 0:
            _launch(decode, combine, q, kv_cache[:, :, 0], block_table, cache_seqlens, meta,
                    num_splits, out, lse, oacc, lseacc, scale_log2)
        return out, lse
    out = torch.empty(b, s_q, h_kv, g, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h_kv, g, s_q, dtype=torch.float32, device=q.device)
    qg = q.view(b, s_q, h_kv, g, D_QK)
    for k in range(h_kv):
        if b == 0:
            break
        out_k = torch.empty(b, s_q, g, D_V, dtype=q.dtype, device=q.device)
        lse_k = torch.empty(b, g, s_q, dtype=torch.float32, device=q.device)
        _launch(decode, combine, qg[:, :, k], kv_cache[:, :, k], block_table, cache_seqlens,
                meta, num_splits, out_k, lse_k, oacc, lseacc, scale_log2)
        out[:, :, k] = out_k
        lse[:, k] = lse_k
    return out.view(b, s_q, h_q, D_V), lse.view(b, h_q, s_q)


def _launch(decode, combine, q, kv, block_table, cache_seqlens, meta, num_splits, out, lse,
            oacc, lseacc, scale_log2):
    """q [b, s_q, g, 576] (any strides), kv [num_blocks, 64, 576] (rows contiguous), out
    [b, s_q, g, 512] and lse [b, g, s_q] contiguous: decode, then combine."""
    b, s_q, g, _ = q.shape
    q3 = q.reshape(b, s_q * g, D_QK)
    if q3.stride(-1) != 1 or q3.stride(1) != D_QK or q3.data_ptr() % 16:
        q3 = q3.contiguous() if not q3.is_contiguous() else q3.clone()  # TMA: 16-byte rows
    out3 = out.view(b, s_q * g, D_V)
    # The trailing None is the trace table of development builds: a kernel loaded from the disk
    # cache takes every parameter, defaults included.
    decode(q3, kv, block_table, cache_seqlens, meta, num_splits, out3, lse, oacc, lseacc,
           scale_log2, None)
    combine(num_splits, oacc, lseacc, out3, lse)


@functools.lru_cache(maxsize=None)
def combine_warps_per_row(batch: int, num_parts: int, rows: int) -> int:
    """CombineConfig's choice, cached: it runs on every eager decode call."""
    from ..cute_kernels.combine import CombineConfig

    return CombineConfig.from_heuristic(batch, num_parts, rows).warps_per_row


def _dsl(dtype: torch.dtype):
    """(cute, cutlass, the DSL's element type for dtype)."""
    import cutlass
    import cutlass.cute as cute

    return cute, cutlass, {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


# The disk cache (kernel_cache.py) keys an entry on these names; a load imports no kernel class.
SM90_ARCH = "sm_90a"
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.lru_cache(maxsize=None)
def _compiled_decode_sm90(dtype: torch.dtype, causal: bool):
    def build():
        cute, cutlass, cdt = _dsl(dtype)
        from ..cute_kernels.sm90_decode import MLADecodeSm90

        return compile_decode_sm90(cute, cutlass, MLADecodeSm90(cdt, causal), cdt)

    return kernel_cache.load_or_build(
        "decode_sm90", {"dtype": _DTYPE_NAMES[dtype], "causal": causal}, SM90_ARCH, build)


@functools.lru_cache(maxsize=None)
def _compiled_combine(dtype: torch.dtype, warps_per_row: int):
    def build():
        cute, cutlass, cdt = _dsl(dtype)
        from ..cute_kernels.combine import MLACombine

        return compile_combine(cute, cutlass, MLACombine(cdt, D_V, warps_per_row), cdt)

    return kernel_cache.load_or_build(
        "combine", {"dtype": _DTYPE_NAMES[dtype], "warps_per_row": warps_per_row}, SM90_ARCH,
        build)


def _fake(cute, dtype, shape, stride, align=16):
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def compile_decode_sm90(cute, cutlass, kernel, cdt, arch: str = SM90_ARCH):
    """Compiles the SM90 decode kernel from fake tensors (also used by the CPU compile tests)
    for arch, on any machine (a compile option: no CUTE_DSL_ARCH needed)."""
    i32, f32 = cutlass.Int32, cutlass.Float32
    b, rows, n_blocks, max_blocks, parts, slots = (cute.sym_int() for _ in range(6))
    h_q, s_q = cute.sym_int(), cute.sym_int()
    args = [
        _fake(cute, cdt, (b, rows, D_QK), (cute.sym_int64(divisibility=8), D_QK, 1)),
        # Strides are runtime values: one KV head of a [num_blocks, 64, h_kv, 576] cache.
        _fake(cute, cdt, (n_blocks, PAGE_SIZE, D_QK),
              (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)),
        _fake(cute, i32, (b, max_blocks), (cute.sym_int64(), 1), 4),
        _fake(cute, i32, (b,), (1,), 4),
        _fake(cute, i32, (parts, 8), (8, 1), 4),
        _fake(cute, i32, (cute.sym_int(),), (1,), 4),
        _fake(cute, cdt, (b, rows, D_V), (cute.sym_int64(divisibility=8), D_V, 1)),
        _fake(cute, f32, (b, h_q, s_q), (cute.sym_int64(), cute.sym_int64(), 1), 4),
        _fake(cute, f32, (slots, rows, D_V), (cute.sym_int64(divisibility=4), D_V, 1)),
        _fake(cute, f32, (slots, rows), (cute.sym_int64(), 1), 4),
        f32(1.0),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    ]
    if getattr(kernel, "trace", False):  # development builds: a (ctas, 128) int64 stamp table
        args.append(_fake(cute, cutlass.Int64, (cute.sym_int(), 128), (128, 1), 8))
    return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def compile_combine(cute, cutlass, kernel, cdt, arch: str = SM90_ARCH):
    i32, f32 = cutlass.Int32, cutlass.Float32
    b, rows, slots, h_q, s_q = (cute.sym_int() for _ in range(5))
    args = [
        _fake(cute, i32, (cute.sym_int(),), (1,), 4),
        _fake(cute, f32, (slots, rows, D_V), (cute.sym_int64(divisibility=4), D_V, 1)),
        _fake(cute, f32, (slots, rows), (cute.sym_int64(), 1), 4),
        _fake(cute, cdt, (b, rows, D_V), (cute.sym_int64(divisibility=8), D_V, 1)),
        _fake(cute, f32, (b, h_q, s_q), (cute.sym_int64(), cute.sym_int64(), 1), 4),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    ]
    return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")
