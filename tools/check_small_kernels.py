"""GPU check of the one-launch schedule and append_kv kernels: their tests, then their time.

    python -m tools.check_small_kernels [--log PATH] [--quick] [--no-tests]

1. values and errors: tests/test_small_kernels.py (pytest, in a child process): the schedule
   kernel bit-identical to compute_schedule and append_kv to append_kv_reference on the regime
   boundaries, CUDA-graph replays with new values, one kernel per call, and each in-kernel check
   failing with its message.
2. time, per call: host us of an eager call (time.perf_counter over many calls, no sync in the
   loop: the kernels are shorter than the host work, so the host is what is measured), GPU us
   of the kernel (profiler: device time of the kernel itself) and per call in a replayed CUDA
   graph of many calls (CUDA events: kernel + the graph's launch gap), beside the torch-op path
   they replace and FlashMLA's get_mla_metadata when flash_mla is installed. Targets (issue 14):
   schedule <= 10 us host and <= 3 us GPU, append_kv <= 10 us host.

Everything printed also goes to the log (default $OUT/check_small_kernels.log, else ./).
Exit status 1 when a test fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from functools import partial

import torch

import torch_mla
from torch_mla.reference import append_kv_reference
from torch_mla.scheduling import compute_schedule
from torch_mla.testing import load_flash_mla

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POISON = -0x5A5A5A5A
_log = []


def say(*parts):
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    _log.append(line)


# time --------------------------------------------------------------------------------------

def host_us(fn, n):
    for _ in range(min(n, 200)):
        fn()
    torch.cuda.synchronize()
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        reps.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(reps)


def graph_us(fn, per_graph=50, replays=20):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (per_graph * replays)


def kernel_us(fn, calls=100):
    """Mean device time of the kernels one call runs (profiler), summed per call."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    return total / calls


def row(name, fn, n, graph=True):
    h = host_us(fn, n)
    k = kernel_us(fn)
    gu = graph_us(fn) if graph else float("nan")
    say(f"  {name:58} host {h:7.1f} us | kernels {k:6.2f} us | graph {gu:6.2f} us/call")
    return h, k, gu


def old_append(cache, kv_c, k_pe, slots, kv_scale=None):
    """The torch-op path append_kv took before the kernel: value checks, then the reference."""
    from torch_mla.ops.checks import check_slot_values

    check_slot_values(cache.shape[0], slots)
    append_kv_reference(cache, kv_c, k_pe, slots, kv_scale)


def timing(n):
    say("\nget_decode_schedule (s_q 1, h_q 128: 2 m-blocks; lengths ~U[1, 8192])")
    results = {}
    flash_mla = load_flash_mla()
    flash_metadata = None if flash_mla is None else flash_mla.get_mla_metadata
    for b in (1, 32, 128, 1024):
        lens = torch.randint(1, 8192, (b,), dtype=torch.int32, device="cuda")
        parts = torch_mla.get_decode_schedule(lens, 1, 128).metadata.shape[0]
        sched = partial(torch_mla.get_decode_schedule, lens, 1, 128)
        results[("schedule", b)] = row(f"b={b:<5} kernel (value checks on)", sched, n)
        torch_mla.set_value_checks(False)
        row(f"b={b:<5} kernel (value checks off)", sched, n)
        torch_mla.set_value_checks(True)
        row(f"b={b:<5} torch ops (compute_schedule, the old path)",
            partial(compute_schedule, lens, parts), max(n // 10, 50))
        if flash_metadata is not None:
            try:
                row(f"b={b:<5} FlashMLA get_mla_metadata", partial(flash_metadata, lens, 128, 1),
                    n)
            except Exception as e:  # FlashMLA's interface moves between versions
                say(f"  FlashMLA get_mla_metadata(lens, 128, 1) failed: {e}")
    if flash_metadata is None:
        say("  (flash_mla not installed: no FlashMLA row)")

    say("\nappend_kv (bf16 cache of 4096 pages; slots distinct, random)")
    for T, src in ((1, torch.bfloat16), (32, torch.bfloat16), (128, torch.bfloat16),
                   (128, torch.float32), (2048, torch.bfloat16), (8192, torch.bfloat16)):
        args = (torch.randn(4096, 64, 1, 576, dtype=torch.bfloat16, device="cuda"),
                torch.randn(T, 512, device="cuda").to(src),
                torch.randn(T, 64, device="cuda").to(src),
                torch.randperm(4096 * 64, device="cuda")[:T])
        name = f"T={T:<5} {str(src)[6:]:8}"
        append = partial(torch_mla.append_kv, *args)
        results[("append", T, src)] = row(f"{name} kernel (value checks on)", append, n)
        torch_mla.set_value_checks(False)
        row(f"{name} kernel (value checks off)", append, n)
        torch_mla.set_value_checks(True)
        row(f"{name} torch ops (checks + reference, the old path)", partial(old_append, *args),
            max(n // 10, 50), graph=False)

    say("\nappend_kv (float8_e4m3fn cache of 4096 pages, kv_scale; bf16 sources)")
    kv_scale = torch.full((1,), 0.01, device="cuda")
    for T in (1, 32, 128, 2048):
        args = (torch.randn(4096, 64, 1, 576, device="cuda").to(torch.float8_e4m3fn),
                torch.randn(T, 512, device="cuda").to(torch.bfloat16),
                torch.randn(T, 64, device="cuda").to(torch.bfloat16),
                torch.randperm(4096 * 64, device="cuda")[:T])
        append = partial(torch_mla.append_kv, *args, kv_scale=kv_scale)
        results[("append_fp8", T)] = row(f"T={T:<5} kernel (value checks on)", append, n)
        row(f"T={T:<5} torch ops (checks + reference, the old path)",
            partial(old_append, *args, kv_scale), max(n // 10, 50), graph=False)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="eager calls per host timing")
    ap.add_argument("--quick", action="store_true", help="300 calls per host timing")
    ap.add_argument("--no-tests", action="store_true", help="the timing only")
    ap.add_argument("--log", default=os.path.join(os.environ.get("OUT", "."),
                                                  "check_small_kernels.log"))
    args = ap.parse_args(argv)
    if args.quick:
        args.calls = 300
    import cutlass

    dev = torch.cuda.get_device_properties(0)
    say(f"{dev.name} sm_{dev.major}{dev.minor}, {dev.multi_processor_count} SMs | torch "
        f"{torch.__version__} | nvidia-cutlass-dsl {cutlass.__version__} | torch_mla "
        f"{torch_mla.__version__}")
    t0 = time.perf_counter()
    torch_mla.get_decode_schedule(torch.tensor([5], dtype=torch.int32, device="cuda"), 1, 16)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    torch_mla.append_kv(torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16, device="cuda"),
                        torch.randn(1, 512, device="cuda", dtype=torch.bfloat16),
                        torch.randn(1, 64, device="cuda", dtype=torch.bfloat16),
                        torch.tensor([3], device="cuda"))
    torch.cuda.synchronize()
    say(f"first call (compile or disk-cache load): schedule {t1 - t0:.2f} s, append_kv "
        f"{time.perf_counter() - t1:.2f} s")

    failures = 0
    if not args.no_tests:
        say("\nvalues and errors: tests/test_small_kernels.py")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/test_small_kernels.py"], cwd=ROOT, capture_output=True,
                              text=True, timeout=900)
        for line in proc.stdout.splitlines()[-15:]:
            say("  " + line)
        failures += proc.returncode != 0

    res = timing(args.calls)
    say("\ntargets (issue 14, point 4; value checks on)")
    for b in (1, 32, 128, 1024):
        h, k, g = res[("schedule", b)]
        say(f"  schedule b={b:<5} host {h:5.1f} us {'<=' if h <= 10 else '>'} 10 | kernel "
            f"{k:5.2f} us, graph {g:5.2f} us/call {'<=' if min(k, g) <= 3 else '>'} 3")
    for T in (1, 32, 128):
        h, _, _ = res[("append", T, torch.bfloat16)]
        h8, _, _ = res[("append_fp8", T)]
        say(f"  append_kv T={T:<5} host {h:5.1f} us {'<=' if h <= 10 else '>'} 10 (bf16 cache), "
            f"{h8:5.1f} us {'<=' if h8 <= 10 else '>'} 10 (e4m3 cache)")
    say(f"\n{'THE TESTS PASS' if not failures else 'TESTS FAILED'}" if not args.no_tests else "")
    os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    with open(args.log, "w") as f:
        f.write("\n".join(_log) + "\n")
    print(f"log: {args.log}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
