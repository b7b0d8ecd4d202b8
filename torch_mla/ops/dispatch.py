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

from ..scheduling import COMBINE_WARPS_PER_ROW, PAGE_SIZE
from . import kernel_cache

D_QK, D_V = 576, 512


_capability: dict[int, tuple[int, int]] = {}


def _cuda_arch(device: torch.device) -> tuple[int, int]:
    # Cached: torch.cuda.get_device_capability costs ~10 us, on every eager decode call.
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = _capability.get(index)
    if cap is None:
        cap = _capability[index] = torch.cuda.get_device_capability(index)
    return cap


def gpu_arch(major: int, minor: int) -> str:
    """The ``--gpu-arch`` a GPU of this compute capability gets kernels compiled for: its own
    arch, with the arch-specific suffix from 9.0 on (sm_80, sm_86, sm_89, sm_90a, sm_100a,
    sm_120a, ...)."""
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def _env_flag(name: str):
    """A function telling whether the environment variable `name` is "1", read live at each
    call. os.environ.get of an unset name costs ~1 us (a KeyError raised and caught inside the
    mapping), and eager decode calls read two of them; the dict beneath os.environ answers in
    ~0.05 us and is the live environment (os.environ[...] =, monkeypatch.setenv and
    mock.patch.dict all write through to it)."""
    data = getattr(os.environ, "_data", None)
    if not isinstance(data, dict):
        return lambda: os.environ.get(name) == "1"
    key, one = os.environ.encodekey(name), os.environ.encodevalue("1")
    return lambda: data.get(key) == one


_force_reference = _env_flag("TORCH_MLA_FORCE_REFERENCE")
_sm100_enabled = _env_flag("TORCH_MLA_SM100")
# TORCH_MLA_PORTABLE=1: the portable kernel even where a native one exists (testing).
portable_forced = _env_flag("TORCH_MLA_PORTABLE")


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
        float8_e4m3fn cache its "exact" variant: pages expanded to 16 bits on chip), ``"sm100"``
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
    major, minor = _cuda_arch(device)
    if major < 8:
        return "reference", (f"compute capability {major}.{minor}: the kernels need 8.0 "
                             "(Ampere) or newer")
    if (major, minor) == (9, 0) and not portable_forced():
        return "sm90", "compute capability 9.0: the SM90 CuTe DSL kernel"
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
    major, minor = _cuda_arch(device)
    if (major, minor) != (9, 0) or portable_forced():
        why = "TORCH_MLA_PORTABLE=1" if portable_forced() else (
            f"compute capability {major}.{minor}")
        return "reference", (f"float8_e4m3fn cache on {why}: the only FP8 kernel is the SM90 "
                             f"one ({deq})")
    why = "exact mode (pages expanded to 16 bits on chip, 16-bit MMAs)"
    if compute == "fp8":
        why = ("fast mode (compute='fp8': Q, quantized per row, and P in e4m3 on the fp8 "
               "tensor cores)")
    return "sm90", f"compute capability 9.0, float8_e4m3fn cache: the SM90 CuTe DSL kernel, {why}"


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
        return _run_sm90_fp8 if kv_cache.dtype == torch.float8_e4m3fn else _run_sm90
    if name == "sm80" and _cuda_arch(q.device) == (9, 0):
        return _run_sm80  # (the GPU it was verified on: no first-use check)
    if name in ("sm80", "sm100"):
        run = _run_sm80 if name == "sm80" else _run_sm100
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
        from . import selfcheck  # (it runs the ops, which import this module)

        why = selfcheck.check_kernel(run, device, dtype)
        _first_use_checked[key] = None if why is None else (
            f"{what} did not match the reference in its first-use check ({why})")
    return _first_use_checked[key]


def _run_sm90(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale, causal):
    return _run_split_kv("sm90", q, kv_cache, block_table, cache_seqlens, meta, num_splits,
                         softmax_scale, causal)


def _run_sm90_fp8(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale,
                  causal, kv_scale, q_scale=None, compute="exact"):
    """The SM90 kernel over a float8_e4m3fn cache, exact mode or (compute="fp8") fast mode. In
    exact mode an e4m3 q becomes bf16 here (exact; its scale folds into the kernel's softmax
    scale); fast mode reads its bytes. out is bf16 for an e4m3 q."""
    return _run_split_kv("sm90", q, kv_cache, block_table, cache_seqlens, meta, num_splits,
                         softmax_scale, causal, (kv_scale, q_scale), compute)


def _run_sm80(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale, causal):
    return _run_split_kv("sm80", q, kv_cache, block_table, cache_seqlens, meta, num_splits,
                         softmax_scale, causal)


def _run_sm100(q, kv_cache, block_table, cache_seqlens, meta, num_splits, softmax_scale, causal):
    return _run_split_kv("sm100", q, kv_cache, block_table, cache_seqlens, meta, num_splits,
                         softmax_scale, causal)


def _run_split_kv(backend, q, kv_cache, block_table, cache_seqlens, meta, num_splits,
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
            return _run_split_kv(backend, q, kv_cache, block_table, cache_seqlens, meta,
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
            out_dtype = torch.bfloat16
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
    step = _STEPS[key](out_dtype, bool(causal) and s_q > 1, index)
    parts = meta.shape[0]
    variant = combine_variant(b, parts, rows)
    # One slot per piece a request can be cut into: at most batch + num_parts (scheduling.py).
    # (new_empty with the sizes as separate arguments: of the ways to allocate, the one that
    # costs least to parse, ~0.5 us below torch.empty(..., device=) per tensor.)
    oacc = q.new_empty(b + parts, rows, D_V, dtype=torch.float32)
    lseacc = q.new_empty(b + parts, rows, dtype=torch.float32)
    scale_log2 = softmax_scale * _LOG2E
    if h_kv == 1:
        out = q.new_empty(b, rows, D_V, dtype=out_dtype)
        lse = q.new_empty(b, h_q, s_q, dtype=torch.float32)
        if b > 0:
            # The cache is contiguous (checked): its one head's rows are a plain view. The
            # combine also checks the lengths and the used page ids (combine.check_request).
            step(_q_rows(q, b, rows), kv_cache.view(num_blocks, PAGE_SIZE, D_QK), block_table,
                 cache_seqlens, meta, num_splits, out, lse, oacc, lseacc, scale_log2, variant,
                 *extra)
        return out.view(b, s_q, h_q, D_V), lse
    out = q.new_empty(b, s_q, h_kv, g, D_V, dtype=out_dtype)
    lse = q.new_empty(b, h_kv, g, s_q, dtype=torch.float32)
    qg = q.view(b, s_q, h_kv, g, D_QK)
    for k in range(h_kv):
        if b == 0:
            break
        out_k = q.new_empty(b, rows, D_V, dtype=out_dtype)
        lse_k = q.new_empty(b, g, s_q, dtype=torch.float32)
        step(_q_rows(qg[:, :, k], b, rows), kv_cache[:, :, k], block_table, cache_seqlens, meta,
             num_splits, out_k, lse_k, oacc, lseacc, scale_log2, variant, *extra)
        out[:, :, k] = out_k.view(b, s_q, g, D_V)
        lse[:, k] = lse_k
    return out.view(b, s_q, h_q, D_V), lse.view(b, h_q, s_q)


_LOG2E = math.log2(math.e)


def _q_rows(q, b, rows):
    """q [b, s_q, g, 576] (any strides) as the kernels' [b, rows = s_q * g, 576] with 16-byte
    aligned rows (TMA): a view where q allows one, else a copy."""
    if q.is_contiguous() and not q.data_ptr() % 16:
        return q.view(b, rows, D_QK)  # (the usual q: nothing more to look at)
    q3 = q.reshape(b, rows, D_QK)
    if q3.stride(-1) != 1 or q3.stride(1) != D_QK or q3.data_ptr() % 16:
        q3 = q3.contiguous() if not q3.is_contiguous() else q3.clone()
    return q3


@functools.lru_cache(maxsize=None)
def combine_warps_per_row(batch: int, num_parts: int, rows: int) -> int:
    """CombineConfig's choice, cached: it runs on every eager decode call."""
    from ..scheduling import CombineConfig

    return CombineConfig.from_heuristic(batch, num_parts, rows).warps_per_row


@functools.lru_cache(maxsize=None)
def combine_variant(batch: int, num_parts: int, rows: int) -> int:
    """The index of that choice among the decode step's combine variants."""
    return COMBINE_WARPS_PER_ROW.index(combine_warps_per_row(batch, num_parts, rows))


def _dsl(dtype: torch.dtype):
    """(cute, cutlass, the DSL's element type for dtype)."""
    import cutlass
    import cutlass.cute as cute

    return cute, cutlass, {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


# The disk cache (kernel_cache.py) keys an entry on these names; a load imports no kernel class.
SM90_ARCH = "sm_90a"
SM100_ARCH = "sm_100a"
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
def _compiled_step(backend: str, dtype: torch.dtype, causal: bool, arch: str,
                   kv_fp8: bool = False, tiles: tuple[int, int, int] | None = None,
                   compute: str = "exact", q_fp8: bool = False):
    """A decode kernel and the combine behind one host call (what mla_decode runs), for arch:
    backend "sm90" (MLADecodeSm90, sm_90a), "sm100" (MLADecodeSm100, sm_100a) or "sm80" (the
    portable MLADecodeSm80, any arch from sm_80). kv_fp8 (sm90 only): over a float8_e4m3fn
    cache, with q (and out) in dtype. tiles: the portable kernel's (block_m, block_n, stages)
    instead of Sm80DecodeConfig.from_heuristic(arch), for tools that compare tile shapes
    (tools/check_portable.py). compute="fp8" (with kv_fp8): fast mode (MLADecodeSm90Fast),
    q_fp8: its q is float8_e4m3fn (passed as bytes; out is dtype)."""
    if kv_fp8 and backend != "sm90":
        raise ValueError(f"no float8_e4m3fn-cache kernel for backend {backend!r}")
    if (compute == "fp8" and not kv_fp8) or (q_fp8 and compute != "fp8"):
        raise ValueError(f"compute={compute!r}, q_fp8={q_fp8} needs kv_fp8 and fast mode")

    def build():
        cute, cutlass, cdt = _dsl(dtype)
        from ..cute_kernels.decode_step import MLADecodeStep

        if backend == "sm90" and compute == "fp8":
            from ..cute_kernels.sm90_decode import MLADecodeSm90Fast

            decode = MLADecodeSm90Fast(cdt, causal, q_fp8=q_fp8)
        elif backend == "sm90":
            from ..cute_kernels.sm90_decode import MLADecodeSm90

            decode = MLADecodeSm90(cdt, causal, kv_fp8=kv_fp8)
        elif backend == "sm100":
            from ..cute_kernels.sm100_decode import MLADecodeSm100

            decode = MLADecodeSm100(cdt, causal)
        else:
            from ..cute_kernels.sm80_decode import MLADecodeSm80, Sm80DecodeConfig

            cfg = Sm80DecodeConfig(*tiles) if tiles else Sm80DecodeConfig.from_heuristic(arch)
            decode = MLADecodeSm80(cdt, causal, cfg, use_pdl=_has_pdl(arch))
        step = MLADecodeStep(decode, cdt, use_pdl=_has_pdl(arch))
        return compile_decode_step(cute, cutlass, step, cdt, arch)

    config = {"dtype": _DTYPE_NAMES[dtype], "causal": causal}
    if kv_fp8:
        config["kv"] = "e4m3"  # (bf16/fp16-cache entries keep their names)
    if compute == "fp8":
        config["compute"] = "fp8"
    if q_fp8:
        config["q"] = "e4m3"
    if tiles:
        config["tiles"] = "x".join(map(str, tiles))
    return kernel_cache.load_or_build(f"step_{backend}", config, arch, build)


def _compiled_step_sm90(dtype: torch.dtype, causal: bool):
    return _compiled_step("sm90", dtype, causal, SM90_ARCH)


# backend name -> its compiled step for (dtype, causal, device index). The lambdas look the
# functions up when called, so tools and tests can swap them.
_STEPS = {
    "sm90": lambda dtype, causal, index: _compiled_step("sm90", dtype, causal, SM90_ARCH),
    "sm90_fp8": lambda dtype, causal, index: _compiled_step("sm90", dtype, causal, SM90_ARCH,
                                                            kv_fp8=True),
    "sm90_fp8_fast": lambda dtype, causal, index: _compiled_step(
        "sm90", dtype, causal, SM90_ARCH, kv_fp8=True, compute="fp8"),
    "sm90_fp8_fast_q8": lambda dtype, causal, index: _compiled_step(
        "sm90", dtype, causal, SM90_ARCH, kv_fp8=True, compute="fp8", q_fp8=True),
    "sm100": lambda dtype, causal, index: _compiled_step("sm100", dtype, causal, SM100_ARCH),
    "sm80": lambda dtype, causal, index: _compiled_step("sm80", dtype, causal,
                                                        device_arch(index)),
}


@functools.lru_cache(maxsize=None)
def _compiled_decode_sm100(dtype: torch.dtype, causal: bool):
    def build():
        cute, cutlass, cdt = _dsl(dtype)
        from ..cute_kernels.sm100_decode import MLADecodeSm100

        return compile_decode(cute, cutlass, MLADecodeSm100(cdt, causal), cdt, SM100_ARCH)

    return kernel_cache.load_or_build(
        "decode_sm100", {"dtype": _DTYPE_NAMES[dtype], "causal": causal}, SM100_ARCH, build)


@functools.lru_cache(maxsize=None)
def device_arch(index: int) -> str:
    """gpu_arch of CUDA device `index` (cached: read on every eager decode call)."""
    return gpu_arch(*_cuda_arch(torch.device("cuda", index)))


def compiled_decode(name: str, dtype: torch.dtype, causal: bool, arch: str):
    """The compiled decode kernel `name` ("sm90" or "sm80") for arch, and whether it takes the
    trailing trace-table argument (the SM90 kernel's development builds)."""
    if name == "sm90":
        return _compiled_decode_sm90(dtype, causal), True
    return _compiled_decode_sm80(dtype, causal, arch), False


@functools.lru_cache(maxsize=None)
def _compiled_decode_sm80(dtype: torch.dtype, causal: bool, arch: str):
    """The portable decode kernel alone (its tiles from Sm80DecodeConfig.from_heuristic(arch)),
    for precompile and the tools; mla_decode runs it inside the decode step (_compiled_step,
    which also takes other tiles)."""
    def build():
        cute, cutlass, cdt = _dsl(dtype)
        from ..cute_kernels.sm80_decode import MLADecodeSm80, Sm80DecodeConfig

        kernel = MLADecodeSm80(cdt, causal, Sm80DecodeConfig.from_heuristic(arch),
                               use_pdl=_has_pdl(arch))
        return compile_decode_sm80(cute, cutlass, kernel, cdt, arch)

    config = {"dtype": _DTYPE_NAMES[dtype], "causal": causal}
    return kernel_cache.load_or_build("decode_sm80", config, arch, build)


def _has_pdl(arch: str) -> bool:
    """Programmatic dependent launch (griddepcontrol) exists from sm_90 on."""
    return int(arch[3:].rstrip("af")) >= 90


@functools.lru_cache(maxsize=None)
def _compiled_combine(dtype: torch.dtype, warps_per_row: int, arch: str = SM90_ARCH):
    def build():
        cute, cutlass, cdt = _dsl(dtype)
        from ..cute_kernels.combine import MLACombine

        kernel = MLACombine(cdt, D_V, warps_per_row, use_pdl=_has_pdl(arch))
        return compile_combine(cute, cutlass, kernel, cdt, arch)

    return kernel_cache.load_or_build(
        "combine", {"dtype": _DTYPE_NAMES[dtype], "warps_per_row": warps_per_row}, arch, build)


# The small kernels (schedule, append_kv) use no arch-specific instruction: they run on every
# arch from SM80 up, compiled for the device's own (sm_90a on H100/H200, the decode kernel's arch,
# so that precompiling sm_90a covers all of them). The arches nvidia-cutlass-dsl compiles for.
PORTABLE_ARCHS = {cap: gpu_arch(*cap) for cap in [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0),
                                                   (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)]}


# Arches with the e4m3 cvt (cvt.rn.satfinite.e4m3x2.f32, SM89 and later): append_kv's fp8 kernel.
FP8_APPEND_ARCHS = frozenset(a for cap, a in PORTABLE_ARCHS.items() if cap >= (8, 9))


@functools.lru_cache(maxsize=None)
def _device_arch(device: torch.device) -> str | None:
    """The arch the small kernels are compiled for on this CUDA device, or None (older than
    SM80, or unknown to the DSL): looked up once per device (this runs on every eager call)."""
    return PORTABLE_ARCHS.get(tuple(_cuda_arch(device)))


def find_schedule_kernel(device: torch.device):
    """The compiled schedule kernel for a CUDA device, else None (compute_schedule's torch ops:
    CPU tensors, TORCH_MLA_FORCE_REFERENCE=1, a GPU without a kernel arch)."""
    if device.type != "cuda" or _force_reference():
        return None
    arch = _device_arch(device)
    return None if arch is None else _compiled_schedule(arch)


_APPEND_SOURCES = (torch.bfloat16, torch.float16, torch.float32)
_SLOT_NAMES = {torch.int32: "int32", torch.int64: "int64"}


def find_append_kernel(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                       slot_mapping: torch.Tensor):
    """The compiled append_kv kernel for these (validated) arguments, else None (the reference):
    a bf16/fp16 cache (any SM80+ GPU) or a float8_e4m3fn one (SM89+: the e4m3 conversion) of
    576-wide rows, 16-byte aligned, sources of one dtype. The fp8 kernel takes the cache as its
    bytes (``kv_cache.view(torch.uint8)``) and kv_scale after the two check flags."""
    if not kv_cache.is_cuda or _force_reference():
        return None
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if ((not fp8 and kv_cache.dtype not in _DTYPE_NAMES) or kv_c.dtype not in _APPEND_SOURCES
            or k_pe.dtype != kv_c.dtype or kv_c.shape[1] != D_V or k_pe.shape[1] != D_QK - D_V
            or kv_cache.data_ptr() % 16):
        return None
    arch = _device_arch(kv_cache.device)
    if arch is None or (fp8 and arch not in FP8_APPEND_ARCHS):
        return None
    return _compiled_append_kv(arch, kv_cache.dtype, kv_c.dtype, slot_mapping.dtype)


def _dsl_type(dtype: torch.dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16,
            torch.float32: cutlass.Float32, torch.int32: cutlass.Int32,
            torch.int64: cutlass.Int64}[dtype]


@functools.lru_cache(maxsize=None)
def _compiled_schedule(arch: str):
    def build():
        import cutlass
        import cutlass.cute as cute

        from ..cute_kernels.schedule import DecodeSchedule

        return compile_schedule(cute, cutlass, DecodeSchedule(), arch)

    return kernel_cache.load_or_build("schedule", {}, arch, build)


@functools.lru_cache(maxsize=None)
def _compiled_append_kv(arch: str, cache_dtype: torch.dtype, source_dtype: torch.dtype,
                        slot_dtype: torch.dtype):
    def build():
        import cutlass
        import cutlass.cute as cute

        from ..cute_kernels.append_kv import AppendKV, AppendKVFp8

        src = _dsl_type(source_dtype)
        kernel = (AppendKVFp8(src) if cache_dtype == torch.float8_e4m3fn
                  else AppendKV(_dsl_type(cache_dtype), src))
        return compile_append_kv(cute, cutlass, kernel, _dsl_type(slot_dtype), arch)

    names = {torch.float32: "fp32", torch.float8_e4m3fn: "e4m3", **_DTYPE_NAMES}
    config = {"cache": names[cache_dtype], "source": names[source_dtype],
              "slot": _SLOT_NAMES[slot_dtype]}
    return kernel_cache.load_or_build("append_kv", config, arch, build)


def _fake(cute, dtype, shape, stride, align=16):
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def _decode_fake_args(cute, cutlass, cdt, kv_fp8: bool = False, q_fp8: bool = False) -> list:
    """A decode kernel's arguments up to scale_log2, as fake tensors with symbolic sizes. With
    kv_fp8 the cache is float8_e4m3fn, passed as its bytes (uint8: the kernels only move and
    convert them; DLPack needs no fp8 type); likewise q with q_fp8 (fast mode)."""
    i32, f32 = cutlass.Int32, cutlass.Float32
    b, rows, n_blocks, max_blocks, parts, slots = (cute.sym_int() for _ in range(6))
    h_q, s_q = cute.sym_int(), cute.sym_int()
    kdt, kdiv = (cutlass.Uint8, 16) if kv_fp8 else (cdt, 8)  # 16-byte aligned rows (TMA)
    qdt, qdiv = (cutlass.Uint8, 16) if q_fp8 else (cdt, 8)
    return [
        _fake(cute, qdt, (b, rows, D_QK), (cute.sym_int64(divisibility=qdiv), D_QK, 1)),
        # Strides are runtime values: one KV head of a [num_blocks, 64, h_kv, 576] cache.
        _fake(cute, kdt, (n_blocks, PAGE_SIZE, D_QK),
              (cute.sym_int64(divisibility=kdiv), cute.sym_int64(divisibility=kdiv), 1)),
        _fake(cute, i32, (b, max_blocks), (cute.sym_int64(), 1), 4),
        _fake(cute, i32, (b,), (1,), 4),
        _fake(cute, i32, (parts, 8), (8, 1), 4),
        _fake(cute, i32, (cute.sym_int(),), (1,), 4),
        _fake(cute, cdt, (b, rows, D_V), (cute.sym_int64(divisibility=8), D_V, 1)),
        _fake(cute, f32, (b, h_q, s_q), (cute.sym_int64(), cute.sym_int64(), 1), 4),
        _fake(cute, f32, (slots, rows, D_V), (cute.sym_int64(divisibility=4), D_V, 1)),
        _fake(cute, f32, (slots, rows), (cute.sym_int64(), 1), 4),
        f32(1.0),
    ]


def compile_decode(cute, cutlass, kernel, cdt, arch: str = SM90_ARCH):
    """Compiles a decode kernel (MLADecodeSm90 or MLADecodeSm100: one signature) from fake
    tensors (also used by the CPU compile tests) for arch, on any machine (a compile option: no
    CUTE_DSL_ARCH needed)."""
    args = _decode_fake_args(cute, cutlass, cdt)
    args.append(cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    if getattr(kernel, "trace", False):  # development builds: a (ctas, 128) int64 stamp table
        args.append(_fake(cute, cutlass.Int64, (cute.sym_int(), 128), (128, 1), 8))
    return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


compile_decode_sm90 = compile_decode  # the name the tools and older tests use


compile_decode_sm80 = compile_decode  # the portable kernel: the same signature, any arch


def compile_decode_step(cute, cutlass, step, cdt, arch: str = SM90_ARCH):
    """Compiles a decode step (cute_kernels/decode_step.py: decode kernel + combine variants).
    A float8_e4m3fn-cache step (step.kv_fp8) takes three more arguments: kv_scale and q_scale
    (float32 [1] device tensors) and q_scaled (int: 1 when q_scale applies)."""
    kv_fp8 = getattr(step, "kv_fp8", False)
    args = _decode_fake_args(cute, cutlass, cdt, kv_fp8, getattr(step.decode, "q_fp8", False))
    args += [cutlass.Int32(0), cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)]
    if kv_fp8:
        args += [_fake(cute, cutlass.Float32, (1,), (1,), 4),
                 _fake(cute, cutlass.Float32, (1,), (1,), 4), cutlass.Int32(0)]
    return cute.compile(step, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def compile_combine(cute, cutlass, kernel, cdt, arch: str = SM90_ARCH):
    i32, f32 = cutlass.Int32, cutlass.Float32
    b, rows, slots, h_q, s_q = (cute.sym_int() for _ in range(5))
    args = [
        _fake(cute, i32, (cute.sym_int(),), (1,), 4),
        _fake(cute, f32, (slots, rows, D_V), (cute.sym_int64(divisibility=4), D_V, 1)),
        _fake(cute, f32, (slots, rows), (cute.sym_int64(), 1), 4),
        _fake(cute, cdt, (b, rows, D_V), (cute.sym_int64(divisibility=8), D_V, 1)),
        _fake(cute, f32, (b, h_q, s_q), (cute.sym_int64(), cute.sym_int64(), 1), 4),
        _fake(cute, i32, (b, cute.sym_int()), (cute.sym_int64(), 1), 4),  # block_table
        _fake(cute, i32, (b,), (1,), 4),  # cache_seqlens
        i32(1),  # the cache's page count
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    ]
    return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def compile_schedule(cute, cutlass, kernel, arch: str = SM90_ARCH):
    """The schedule kernel: (cache_seqlens int32 [b], metadata int32 [num_parts, 8], num_splits
    int32 [b + 1], check int, stream)."""
    i32 = cutlass.Int32
    args = [
        _fake(cute, i32, (cute.sym_int(),), (1,), 4),
        _fake(cute, i32, (cute.sym_int(), 8), (8, 1), 4),
        _fake(cute, i32, (cute.sym_int(),), (1,), 4),
        i32(1),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
    ]
    return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")


def compile_append_kv(cute, cutlass, kernel, slot_dtype, arch: str = SM90_ARCH):
    """The append kernel: (kv_cache [num_blocks, 64, 1, 576], kv_c [T, 512], k_pe [T, 64] (row
    strides multiples of 8 elements, 16-byte aligned), slot_mapping [T], check_range int,
    check_repeats int, [AppendKVFp8: kv_scale float32 [1],] stream). An fp8 cache comes as its
    bytes (uint8)."""
    T = cute.sym_int()
    src = kernel.source_dtype
    cache_div = 16 if kernel.fp8 else 8  # 16-byte aligned rows either way
    args = [
        # Page stride int64: a cache past 2^31 elements (4 GB in bf16) is addressed right.
        _fake(cute, kernel.cache_dtype, (cute.sym_int(), PAGE_SIZE, 1, D_QK),
              (cute.sym_int64(divisibility=cache_div), D_QK, D_QK, 1)),
        _fake(cute, src, (T, D_V), (cute.sym_int64(divisibility=8), 1)),
        _fake(cute, src, (T, D_QK - D_V), (cute.sym_int64(divisibility=8), 1)),
        _fake(cute, slot_dtype, (T,), (1,), slot_dtype.width // 8),
        cutlass.Int32(1),
        cutlass.Int32(1),
    ]
    if kernel.fp8:
        args.append(_fake(cute, cutlass.Float32, (1,), (1,), 4))
    args.append(cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True))
    return cute.compile(kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")
