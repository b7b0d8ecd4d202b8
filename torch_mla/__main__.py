"""``python -m torch_mla``: versions, GPUs, and which decode implementation each input kind gets.

For every device here (each kind of GPU, and the CPU) and each (q dtype, cache dtype) pair the
ops take (an FP8 cache in both modes, with bf16 q), it names what :func:`torch_mla.mla_decode`
would run and why, from :func:`torch_mla.ops.dispatch.decode_backend`: the answer to "why is
this slow here?".
"""

from __future__ import annotations

import importlib.metadata
import os
import re

import torch

import torch_mla
from torch_mla.ops.dispatch import D_QK, D_V, decode_backend, gpu_arch
from torch_mla.scheduling import PAGE_SIZE

# (q dtype, cache dtype, compute): the 16-bit and fp32 caches, and the float8_e4m3fn cache in
# exact and fast mode (mla_decode's compute="exact" / "fp8"; q may be fp16 or e4m3 there too).
FORMATS = [(torch.bfloat16, torch.bfloat16, "exact"), (torch.float16, torch.float16, "exact"),
           (torch.float32, torch.float32, "exact"),
           (torch.bfloat16, torch.float8_e4m3fn, "exact"),
           (torch.bfloat16, torch.float8_e4m3fn, "fp8")]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _pinned_dsl() -> str | None:
    """The nvidia-cutlass-dsl version torch-mla's installed metadata pins, if it is installed."""
    try:
        requires = importlib.metadata.requires("torch-mla") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for req in requires:
        m = re.fullmatch(r"nvidia-cutlass-dsl\s*==\s*([^;\s]+)", req.strip())
        if m:
            return m.group(1)
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _devices() -> list[tuple[str, str]]:
    """(device, GPU name) of one GPU per distinct (name, compute capability), then the CPU."""
    out, seen = [], set()
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            if (p.name, p.major, p.minor) in seen:
                continue
            seen.add((p.name, p.major, p.minor))
            out.append((f"cuda:{i}", p.name))
    out.append(("cpu", ""))
    return out


def report() -> str:
    """The text ``python -m torch_mla`` prints."""
    lines = [f"torch_mla {torch_mla.__version__} ({os.path.dirname(torch_mla.__file__)})"]
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    lines.append(f"torch {torch.__version__} ({build})")
    dsl, pinned = _version("nvidia-cutlass-dsl"), _pinned_dsl()
    note = f" (torch-mla pins {pinned}: the kernels may not build)" if (
        pinned and dsl != pinned) else ""
    lines.append(f"nvidia-cutlass-dsl {dsl}{note}")
    for dist in ("cuda-python", "apache-tvm-ffi", "transformers"):
        lines.append(f"{dist} {_version(dist)}")
    lines.append("")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"GPU {i}: {p.name}, compute capability {p.major}.{p.minor}, "
                         f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
                         f"kernels compiled for {gpu_arch(p.major, p.minor)}")
    else:
        why = "torch is a CPU-only build" if not torch.version.cuda else "none visible to torch"
        lines.append(f"no CUDA GPU ({why})")
    force = os.environ.get("TORCH_MLA_FORCE_REFERENCE")
    if force is not None:
        effect = ("every call runs the reference path" if force == "1" else
                  "no effect: only the value 1 forces the reference path")
        lines.append(f"TORCH_MLA_FORCE_REFERENCE={force} is set: {effect}")
    portable = os.environ.get("TORCH_MLA_PORTABLE")
    if portable is not None:
        effect = ("GPUs of compute capability 8.0 or newer run the portable kernel" if
                  portable == "1" else "no effect: only the value 1 forces the portable kernel")
        lines.append(f"TORCH_MLA_PORTABLE={portable} is set: {effect}")
    lines.append("")
    lines.append(f"torch_mla.mla_decode with d_qk {D_QK}, d_v {D_V}, page size {PAGE_SIZE}:")
    rows = [("device", "q dtype", "cache dtype", "runs", "why")]
    for dev, gpu in _devices():
        for q_dtype, cache_dtype, compute in FORMATS:
            name, why = decode_backend(dev, q_dtype, D_QK, D_V, PAGE_SIZE, cache_dtype, compute)
            label = f"{dev} ({gpu})" if gpu else dev
            cache = _name(cache_dtype) + (" (fast)" if compute == "fp8" else "")
            rows.append((label, _name(q_dtype), cache, name, why))
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    for r in rows:
        lines.append("  " + "  ".join(f"{r[c]:<{widths[c]}}" for c in range(4)) + "  " + r[4])
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
