"""Compile every kernel variant the dispatch can pick into the disk cache, ahead of time.

    python -m torch_mla.precompile [--arch sm_90a] [--dtypes bf16,fp16] [--causal both]
                                   [--kernels step,fp8_step,fp8_fast,decode,combine,portable,
                                              schedule,append_kv]

By default it builds what the ops run on ``--arch`` (default: the first visible GPU's arch, else
sm_90a): the decode step (the decode kernel and the combine behind one call: the SM90 kernel on
sm_90a, the portable one elsewhere), on sm_90a the decode step over a float8_e4m3fn cache
(``fp8_step``: q and output in each dtype; ``fp8_fast``: its fast mode, compute="fp8", with q
in each dtype and in float8_e4m3fn), the schedule kernel and append_kv in each cache dtype of
``--dtypes`` (and, from SM89 up, float8_e4m3fn) for bf16/fp16/fp32 sources and int32/int64
slots. ``portable`` adds the portable decode step on sm_90a (``TORCH_MLA_PORTABLE=1``);
decode and combine alone serve benchmarks.

Runs without a GPU (the kernels are compiled for ``--arch``, a compile option), so a container
image or a CI job can bake the cache; a process that later finds an entry loads it in
milliseconds instead of compiling (15-30 s per decode variant). ``--arch`` defaults to the arch
of the first visible GPU (sm_90a without one): sm_90a gets the SM90 decode kernel, every other
arch the portable one (``portable`` adds the portable kernel for sm_90a, which
TORCH_MLA_PORTABLE=1 runs there). The cache directory is ``TORCH_MLA_CACHE_DIR`` or its default
(torch_mla/ops/kernel_cache.py); the processes that use the kernels must see the same
directory and the same torch_mla, nvidia-cutlass-dsl and apache-tvm-ffi versions. One line per
variant: built or cached, seconds, the artefact's path.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import scheduling
from .ops import dispatch, kernel_cache

# The arches torch_mla has kernels for: SM90's own, and the portable kernels'.
ARCHS = tuple(dict.fromkeys((dispatch.SM90_ARCH, *dispatch.PORTABLE_ARCHS.values())))
KERNELS = ("step", "fp8_step", "fp8_fast", "decode", "combine", "portable", "schedule",
           "append_kv")
DEFAULT_KERNELS = ("step", "fp8_step", "fp8_fast", "schedule", "append_kv")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
CAUSAL = {"true": (True,), "false": (False,), "both": (False, True)}
COMBINE_WARPS_PER_ROW = scheduling.COMBINE_WARPS_PER_ROW
APPEND_SOURCES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
APPEND_SLOTS = {"int32": torch.int32, "int64": torch.int64}


def variants(dtypes: list[str], causal: tuple[bool, ...], kernels: list[str],
             arch: str = dispatch.SM90_ARCH) -> list[tuple]:
    """(kernel name, config, a function compiling or loading it through dispatch's cache)."""
    out = []
    native = "sm90" if arch == dispatch.SM90_ARCH else "sm80"
    steps = [native] if "step" in kernels else []
    if "portable" in kernels and "sm80" not in steps:
        steps.append("sm80")
    decode = [native] if "decode" in kernels else []
    if "schedule" in kernels:
        out.append(("schedule", {}, lambda: dispatch._compiled_schedule(arch)))
    for name in dtypes:
        dt = DTYPES[name]
        for kind in steps:
            out += [(f"step_{kind}", {"dtype": name, "causal": c},
                     lambda dt=dt, c=c, kind=kind: dispatch._compiled_step(kind, dt, c, arch))
                    for c in causal]
        if "fp8_step" in kernels and native == "sm90":  # the only float8_e4m3fn-cache kernel
            out += [("step_sm90", {"dtype": name, "causal": c, "kv": "e4m3"},
                     lambda dt=dt, c=c: dispatch._compiled_step("sm90", dt, c, arch, kv_fp8=True))
                    for c in causal]
        if "fp8_fast" in kernels and native == "sm90":
            # q in dtype (quantized in the kernel) and, for bf16 output, q in float8_e4m3fn.
            for q8 in (False, True) if name == "bf16" else (False,):
                extra = {"q": "e4m3"} if q8 else {}
                out += [("step_sm90", {"dtype": name, "causal": c, "kv": "e4m3",
                                       "compute": "fp8", **extra},
                         lambda dt=dt, c=c, q8=q8: dispatch._compiled_step(
                             "sm90", dt, c, arch, kv_fp8=True, compute="fp8", q_fp8=q8))
                        for c in causal]
        for kind in decode:
            out += [(f"decode_{kind}", {"dtype": name, "causal": c},
                     lambda dt=dt, c=c, kind=kind: dispatch.compiled_decode(kind, dt, c, arch))
                    for c in causal]
        if "combine" in kernels:
            out += [("combine", {"dtype": name, "warps_per_row": w},
                     lambda dt=dt, w=w: dispatch._compiled_combine(dt, w, arch))
                    for w in COMBINE_WARPS_PER_ROW]
        if "append_kv" in kernels:
            out += _append_variants(name, dt, arch)
    if "append_kv" in kernels and arch in dispatch.FP8_APPEND_ARCHS:
        out += _append_variants("e4m3", torch.float8_e4m3fn, arch)
    return out


def _append_variants(name: str, dt: torch.dtype, arch: str) -> list[tuple]:
    return [("append_kv", {"cache": name, "source": src, "slot": slot},
             lambda s=sdt, i=idt: dispatch._compiled_append_kv(arch, dt, s, i))
            for src, sdt in APPEND_SOURCES.items() for slot, idt in APPEND_SLOTS.items()]


def default_arch() -> str:
    """The first visible GPU's arch, else sm_90a."""
    if torch.cuda.is_available():
        return dispatch.gpu_arch(*torch.cuda.get_device_capability(0))
    return dispatch.SM90_ARCH


def _list(choices):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return items
    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch_mla.precompile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=ARCHS, default=None,
                    help="default: the first visible GPU's arch, else sm_90a")
    ap.add_argument("--dtypes", type=_list(DTYPES), default=list(DTYPES),
                    help="comma-separated: bf16,fp16 (default both)")
    ap.add_argument("--causal", choices=CAUSAL, default="both",
                    help="decode variants: causal (s_q > 1) masking, plain, or both (default)")
    ap.add_argument("--kernels", type=_list(KERNELS), default=list(DEFAULT_KERNELS),
                    help="comma-separated from " + ",".join(KERNELS) + " (default: "
                         + ",".join(DEFAULT_KERNELS) + ", what the ops run; step is decode + "
                         "combine behind one call, decode and combine alone serve benchmarks)")
    args = ap.parse_args(argv)
    if args.arch is None:
        args.arch = default_arch()
    directory = kernel_cache.cache_dir(args.arch)
    if directory is None:
        print("TORCH_MLA_CACHE_DIR=off: there is no disk cache to fill", file=sys.stderr)
        return 2
    missing = 0
    for kernel, config, get in variants(args.dtypes, CAUSAL[args.causal], args.kernels,
                                        args.arch):
        t0 = time.perf_counter()
        cached = kernel_cache.load(kernel, config, args.arch) is not None
        get()
        path = kernel_cache.artefact(kernel, config, args.arch)
        stored = path is not None and path.exists()
        missing += not stored
        what = "cached" if cached else "built" if stored else "NOT STORED"
        cfg = " ".join(f"{k}={v}" for k, v in config.items())
        print(f"{what:10} {kernel:12} {cfg:28} {time.perf_counter() - t0:6.1f} s  "
              f"{path if stored else ''}", flush=True)
    print(f"cache: {directory}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
