"""Kernel selection and the compile cache.

Each kernel is compiled once per static configuration (dtype, causal, arch) from fake tensors
whose batch, query rows (s_q * h_q), page count and block-table width are symbolic, with
``--enable-tvm-ffi`` so that a launch takes torch tensors directly on the current stream (~7 us of
host time). Launches allocate nothing whose size depends on data: safe in CUDA-graph capture.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from ..scheduling import PAGE_SIZE

D_QK, D_V = 576, 512


def _cuda_arch(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def find_decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int):
    """A callable running the decode kernel for these inputs, or None (use the reference)."""
    if not q.is_cuda or os.environ.get("TORCH_MLA_FORCE_REFERENCE") == "1":
        return None
    if q.dtype not in (torch.bfloat16, torch.float16):
        return None
    if q.shape[-1] != D_QK or d_v != D_V or kv_cache.shape[1] != PAGE_SIZE:
        return None
    if _cuda_arch(q.device) != (9, 0):
        return None
    return _run_sm90


def _run_sm90(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale, causal):
    b, s_q, h_q, _ = q.shape
    decode = _compiled_decode_sm90(q.dtype, bool(causal) and s_q > 1)
    rows = s_q * h_q
    combine = _compiled_combine(q.dtype, combine_warps_per_row(b, meta.shape[0], rows))
    q3 = q.reshape(b, rows, D_QK)
    if not q3.is_contiguous() or q3.data_ptr() % 16:  # TMA needs 16-byte aligned rows
        q3 = q3.contiguous() if not q3.is_contiguous() else q3.clone()
    if kv_cache.data_ptr() % 16:
        raise ValueError("kv_cache must be 16-byte aligned for the CUDA kernel (TMA)")
    kv3 = kv_cache.view(kv_cache.shape[0], PAGE_SIZE, D_QK)
    out = torch.empty(b, s_q, h_q, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device)
    # One slot per piece a request can be cut into: at most batch + num_parts (scheduling.py).
    slots = b + meta.shape[0]
    oacc = torch.empty(slots, rows, D_V, dtype=torch.float32, device=q.device)
    lseacc = torch.empty(slots, rows, dtype=torch.float32, device=q.device)
    out3 = out.view(b, rows, D_V)
    if b > 0:
        decode(q3, kv3, block_table, cache_seqlens, meta, num_splits, out3, lse, oacc, lseacc,
               softmax_scale * math.log2(math.e))
        combine(num_splits, oacc, lseacc, out3, lse)
    return out, lse


@functools.lru_cache(maxsize=None)
def combine_warps_per_row(batch: int, num_parts: int, rows: int) -> int:
    """CombineConfig's choice, cached: it runs on every eager decode call."""
    from ..cute_kernels.combine import CombineConfig

    return CombineConfig.from_heuristic(batch, num_parts, rows).warps_per_row


def _dsl(dtype: torch.dtype):
    """(cute, cutlass, the DSL's element type for dtype); imports the DSL for SM90 by default."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute

    return cute, cutlass, {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


@functools.lru_cache(maxsize=None)
def _compiled_decode_sm90(dtype: torch.dtype, causal: bool):
    cute, cutlass, cdt = _dsl(dtype)
    from ..cute_kernels.sm90_decode import MLADecodeSm90

    return compile_decode_sm90(cute, cutlass, MLADecodeSm90(cdt, causal), cdt)


@functools.lru_cache(maxsize=None)
def _compiled_combine(dtype: torch.dtype, warps_per_row: int):
    cute, cutlass, cdt = _dsl(dtype)
    from ..cute_kernels.combine import MLACombine

    return compile_combine(cute, cutlass, MLACombine(cdt, D_V, warps_per_row), cdt)


def _fake(cute, dtype, shape, stride, align=16):
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def compile_decode_sm90(cute, cutlass, kernel, cdt):
    """Compiles the SM90 decode kernel from fake tensors (also used by the CPU compile tests)."""
    i32, f32 = cutlass.Int32, cutlass.Float32
    b, rows, n_blocks, max_blocks, parts, slots = (cute.sym_int() for _ in range(6))
    h_q, s_q = cute.sym_int(), cute.sym_int()
    args = [
        _fake(cute, cdt, (b, rows, D_QK), (cute.sym_int64(divisibility=8), D_QK, 1)),
        _fake(cute, cdt, (n_blocks, PAGE_SIZE, D_QK), (PAGE_SIZE * D_QK, D_QK, 1)),
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
    return cute.compile(kernel, *args, options="--enable-tvm-ffi")


def compile_combine(cute, cutlass, kernel, cdt):
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
    return cute.compile(kernel, *args, options="--enable-tvm-ffi")
