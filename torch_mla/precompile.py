"""Compile every kernel variant the dispatch can pick into the disk cache, ahead of time.

    python -m torch_mla.precompile [--arch sm_90a] [--dtypes bf16,fp16] [--causal both]
                                   [--kernels step,fp8_step,fp8_fast,sparse,sparse_rs,
                                              sparse_producer,sparse_split,keysm,keysm64,
                                              keysm_rs,keysm_fast,decode,combine,portable,
                                              schedule,append_kv]
                                   [--jobs N]

By default it builds what the ops run on ``--arch`` (default: the first visible GPU's arch, else
sm_90a): the decode step (the decode kernel and the combine behind one call: the SM90 kernel on
sm_90a, the portable one elsewhere), on sm_90a the decode step over a float8_e4m3fn cache
(``fp8_step``: q and output in each dtype; ``fp8_fast``: its fast mode, compute="fp8", with q
in each dtype and in float8_e4m3fn; ``keysm``: the keys-on-M steps of 8, 16 and 32 columns,
both cache formats, which the dispatch runs where s_q * h_q <= 32; ``keysm_rs``: the keys-on-M
ping-pong variant over an e4m3 cache, 8, 16 and 32 columns, which it runs in exact mode from a
batch of 8 (32 at 32 columns); ``keysm_fast``: that variant's fast mode, which it runs in
fast mode where s_q * h_q <= 32 (from a batch of 4 above 16)), the schedule kernel and
append_kv in each cache dtype of ``--dtypes`` (and, from SM89 up, float8_e4m3fn) for
bf16/fp16/fp32 sources and int32/int64 slots. ``portable`` adds the portable decode step on
sm_90a (``TORCH_MLA_PORTABLE=1``), ``keysm64`` the keys-on-M steps of 64 columns
(``TORCH_MLA_KEYSM=1``), ``sparse_rs`` the sparse ping-pong steps over the FP8 caches
(``TORCH_MLA_SPARSE_KEYSM_RS=1``), ``sparse_producer`` the SM90 sparse steps with a producer
warpgroup (``TORCH_MLA_SPARSE_PRODUCER=1``; the 16-bit caches and the 656-byte rows),
``sparse_split`` those with FlashMLA's consumer split (``TORCH_MLA_SPARSE_PRODUCER=split``); decode
and combine alone
serve benchmarks. The variants are listed in
torch_mla/ops/registry.py.

Runs without a GPU (the kernels are compiled for ``--arch``, a compile option), so a container
image or a CI job can bake the cache; a process that later finds an entry loads it in
milliseconds instead of compiling (15-60 s per decode variant). ``--jobs`` processes (default:
the CPU count) compile at once, each storing its entries (the cache's writes are atomic); this
process imports no DSL. The cache directory is ``TORCH_MLA_CACHE_DIR`` or its default
(torch_mla/ops/kernel_cache.py); the processes that use the kernels must see the same
directory and the same torch_mla, nvidia-cutlass-dsl and apache-tvm-ffi versions. One line per
variant as it finishes: built or cached, seconds, the artefact's path; then the total.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time

import torch

from .ops import kernel_cache, registry

DTYPES = ("bf16", "fp16")
CAUSAL = {"true": (True,), "false": (False,), "both": (False, True)}
# Roughly what a variant costs to compile (a decode step ~55 s of a core, append_kv ~2 s):
# the longest start first, so that the last to finish are short.
_COST = {"step": 4, "decode": 3, "combine": 1, "schedule": 1, "append": 0}


def default_arch() -> str:
    """The first visible GPU's arch, else sm_90a."""
    if torch.cuda.is_available():
        return registry.gpu_arch(*torch.cuda.get_device_capability(0))
    return registry.SM90_ARCH


def build(variant: registry.Variant) -> tuple[registry.Variant, str, float, str]:
    """Loads or compiles one variant into the disk cache (in a worker process): (variant,
    "built" / "cached" / "NOT STORED", seconds, the artefact's path or "")."""
    t0 = time.perf_counter()
    config, arch = variant
    cached = kernel_cache.load(config.name, config.key(), arch) is not None
    registry.compiled(config, arch)
    path = kernel_cache.artefact(config.name, config.key(), arch)
    stored = path is not None and path.exists()
    what = "cached" if cached else "built" if stored else "NOT STORED"
    return variant, what, time.perf_counter() - t0, str(path) if stored else ""


def _worker_start() -> None:
    # The DSL's import (seconds) once per worker, not in its first variant's time. A failed
    # import is left to the worker's first build, which reports it: an initializer that raises
    # makes multiprocessing.Pool start new workers forever, and the run hangs.
    try:
        import cutlass.cute  # noqa: F401
    except Exception:
        pass


def _list(choices):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return items
    return parse


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 1")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m torch_mla.precompile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=registry.ARCHS, default=None,
                    help="default: the first visible GPU's arch, else sm_90a")
    ap.add_argument("--dtypes", type=_list(DTYPES), default=list(DTYPES),
                    help="comma-separated: bf16,fp16 (default both)")
    ap.add_argument("--causal", choices=CAUSAL, default="both",
                    help="decode variants: causal (s_q > 1) masking, plain, or both (default)")
    ap.add_argument("--kernels", type=_list(registry.KERNELS),
                    default=list(registry.DEFAULT_KERNELS),
                    help="comma-separated from " + ",".join(registry.KERNELS) + " (default: "
                         + ",".join(registry.DEFAULT_KERNELS) + ", what the ops run; step is "
                         "decode + combine behind one call, decode and combine alone serve "
                         "benchmarks)")
    ap.add_argument("--jobs", type=_positive, default=os.cpu_count() or 1,
                    help="processes compiling at once (default: the CPU count); 1 compiles in "
                         "this process")
    args = ap.parse_args(argv)
    if args.arch is None:
        args.arch = default_arch()
    directory = kernel_cache.cache_dir(args.arch)
    if directory is None:
        print("TORCH_MLA_CACHE_DIR=off: there is no disk cache to fill", file=sys.stderr)
        return 2
    todo = registry.variants(args.dtypes, CAUSAL[args.causal], args.kernels, args.arch)
    jobs = min(args.jobs, len(todo)) or 1
    t0 = time.perf_counter()
    if jobs == 1:
        results = map(build, todo)
        pool = None
    else:
        # spawn: the DSL is not fork-safe once imported, and this process never imports it.
        pool = multiprocessing.get_context("spawn").Pool(jobs, initializer=_worker_start)
        order = sorted(todo, key=lambda v: -_COST.get(v.config.name.split("_")[0], 0))
        results = pool.imap_unordered(build, order)
    counts = {"built": 0, "cached": 0, "NOT STORED": 0}
    try:
        for (config, _), what, seconds, path in results:
            counts[what] += 1
            cfg = " ".join(f"{k}={v}" for k, v in config.key().items())
            print(f"{what:10} {config.name:12} {cfg:28} {seconds:6.1f} s  {path}", flush=True)
    except BaseException:
        if pool is not None:  # (a compile failed, or ^C: the others stop too)
            pool.terminate()
        raise
    if pool is not None:
        pool.close()
        pool.join()
    print(f"{len(todo)} variants in {time.perf_counter() - t0:.1f} s, {jobs} process"
          f"{'es' if jobs > 1 else ''}: {counts['built']} built, {counts['cached']} cached, "
          f"{counts['NOT STORED']} not stored")
    print(f"cache: {directory}")
    return 1 if counts["NOT STORED"] else 0


if __name__ == "__main__":
    sys.exit(main())
