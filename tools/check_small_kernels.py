"""GPU check of the one-launch schedule and append_kv kernels: values, errors, and time.

    python -m tools.check_small_kernels [--cases 400] [--log PATH] [--quick]

1. values: the schedule kernel against compute_schedule (torch ops on the CPU: bit-identical
   metadata and num_splits, outputs poisoned first so an unwritten cell shows), append_kv
   against append_kv_reference (bit-identical cache, NaN-poisoned rows untouched), on random
   inputs; CUDA-graph replays with new values; one kernel per call (profiler).
2. errors: each in-kernel check in a fresh process (a trap ends the CUDA context): the message
   must be in the child's output and the child must fail.
3. time, per call: host us of an eager call (time.perf_counter over many calls, no sync in the
   loop: the kernels are shorter than the host work, so the host is what is measured), GPU us
   of the kernel (profiler: device time of the kernel itself) and per call in a replayed CUDA
   graph of many calls (CUDA events: kernel + the graph's launch gap), beside the torch-op path
   they replace and FlashMLA's get_mla_metadata when flash_mla is installed. Targets (issue 14):
   schedule <= 10 us host and <= 3 us GPU, append_kv <= 10 us host.

Everything printed also goes to the log (default $OUT/check_small_kernels.log, else ./).
Exit status 1 when a value or error check fails.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from functools import partial

import torch

import torch_mla
from torch_mla.reference import append_kv_reference
from torch_mla.scheduling import compute_schedule
from torch_mla.testing import append_kernel, load_flash_mla, schedule_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POISON = -0x5A5A5A5A
_log = []


def say(*parts):
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    _log.append(line)


# values ------------------------------------------------------------------------------------

def random_lengths(b, rng):
    kind = rng.random()
    if kind < 0.15:
        return [rng.choice([0, 0, 0, 1, 64]) for _ in range(b)]
    if kind < 0.25:
        return [rng.choice([2**31 - 1, 2**31 - 64, 0, 1]) for _ in range(b)]
    return [rng.choice([0, 1, 63, 64, 65, 127, 128, 129, rng.randrange(1, 5000),
                        rng.randrange(1, 200_000)]) for _ in range(b)]


def check_schedule(cases, rng):
    kernel = schedule_kernel(torch.device("cuda"))
    if kernel is None:
        say("schedule: NO KERNEL on this GPU")
        return 0, 1
    ok = bad = 0
    batches = [0, 1, 2, 3, 63, 64, 65, 127, 128, 255, 256, 257, 1023, 1024, 1025, 2048,
               2049, 4096]
    parts_list = [1, 2, 7, 33, 66, 132, 133, 255, 256, 257, 264, 1000]
    for i in range(cases):
        b = rng.choice(batches) if i % 2 else rng.randrange(0, 4100)
        parts = rng.choice(parts_list)
        check = 1
        lens = random_lengths(b, rng)
        if i % 17 == 0 and b:  # checks off: negative lengths count as 0
            check = 0
            lens[rng.randrange(b)] = -rng.randrange(1, 2**31)
        cpu = torch.tensor(lens, dtype=torch.int32)
        meta = torch.full((parts, 8), POISON, dtype=torch.int32, device="cuda")
        splits = torch.full((b + 1,), POISON, dtype=torch.int32, device="cuda")
        kernel(cpu.cuda(), meta, splits, check)
        ref_meta, ref_splits = compute_schedule(cpu, parts)
        if torch.equal(meta.cpu(), ref_meta) and torch.equal(splits.cpu(), ref_splits):
            ok += 1
            continue
        bad += 1
        if bad <= 5:
            rows = (meta.cpu() != ref_meta).any(1).nonzero().flatten().tolist()
            say(f"  schedule MISMATCH b={b} parts={parts} check={check} lens[:8]={lens[:8]} "
                f"meta rows {rows[:5]}: {meta.cpu()[rows[:2]].tolist()} vs "
                f"{ref_meta[rows[:2]].tolist()}; splits equal: "
                f"{torch.equal(splits.cpu(), ref_splits)}")
    # graph replay with new lengths
    lens = torch.tensor(random_lengths(100, rng), dtype=torch.int32, device="cuda")
    torch_mla.get_decode_schedule(lens, 1, 16, num_sms=132)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        meta, splits = torch_mla.get_decode_schedule(lens, 1, 16, num_sms=132)
    for _ in range(10):
        new = torch.tensor(random_lengths(100, rng), dtype=torch.int32)
        lens.copy_(new)
        g.replay()
        ref_meta, ref_splits = compute_schedule(new, 132)
        good = torch.equal(meta.cpu(), ref_meta) and torch.equal(splits.cpu(), ref_splits)
        ok, bad = ok + good, bad + (not good)
        if not good:
            say("  schedule MISMATCH after a graph replay")
    return ok, bad


def append_case(T, num_blocks, cache_dtype, src_dtype, slot_dtype, rng, padding=0.2):
    cache = torch.full((num_blocks, 64, 1, 576), float("nan"), dtype=cache_dtype, device="cuda")
    cache.view(-1, 576)[::3] = torch.randn(num_blocks * 64, 576, device="cuda")[::3].to(cache_dtype)
    slots = torch.randperm(num_blocks * 64, device="cuda")[:T]
    pad = torch.rand(T, device="cuda") < padding
    slots = torch.where(pad, -torch.randint(1, 100, (T,), device="cuda"), slots).to(slot_dtype)
    if rng.random() < 0.5:
        kv_c = torch.randn(T, 576, device="cuda").to(src_dtype)[:, 64:]
    else:
        kv_c = torch.randn(T, 512, device="cuda").to(src_dtype)
    k_pe = torch.randn(T, 64, device="cuda").to(src_dtype) * 100
    return cache, kv_c, k_pe, slots


def check_append(cases, rng):
    ok = bad = 0
    caches = [torch.bfloat16, torch.float16]
    sources = [torch.bfloat16, torch.float16, torch.float32]
    for _ in range(cases):
        T = rng.choice([1, 2, 3, 31, 64, 65, 128, 257, 1000, 2048, 2049, rng.randrange(1, 6000)])
        args = (rng.choice(caches), rng.choice(sources), rng.choice([torch.int32, torch.int64]))
        case = append_case(T, T // 64 + rng.randrange(1, 5), *args, rng)
        if append_kernel(*case) is None:
            bad += 1
            say(f"  append_kv: NO KERNEL for {args}")
            continue
        ref = case[0].clone()
        append_kv_reference(ref, *case[1:])
        torch_mla.append_kv(*case)
        same = torch.equal(case[0].isnan(), ref.isnan()) and torch.equal(
            case[0].nan_to_num(), ref.nan_to_num())
        ok, bad = ok + same, bad + (not same)
        if not same and bad <= 5:
            rows = (case[0].view(-1, 576).nan_to_num() != ref.view(-1, 576).nan_to_num())
            say(f"  append_kv MISMATCH T={T} {args}: rows {rows.any(1).nonzero().flatten()[:8]}")
    # graph replay with new values and slots
    cache, kv_c, k_pe, slots = append_case(48, 4, torch.bfloat16, torch.float32, torch.int32, rng)
    torch_mla.append_kv(cache.clone(), kv_c, k_pe, slots)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch_mla.append_kv(cache, kv_c, k_pe, slots)
    for _ in range(10):
        new = append_case(48, 4, torch.bfloat16, torch.float32, torch.int32, rng)
        for dst, src in zip((cache, kv_c, k_pe, slots), new):
            dst.copy_(src)
        ref = cache.clone()
        append_kv_reference(ref, kv_c, k_pe, slots)
        g.replay()
        same = torch.equal(cache.isnan(), ref.isnan()) and torch.equal(cache.nan_to_num(),
                                                                       ref.nan_to_num())
        ok, bad = ok + same, bad + (not same)
        if not same:
            say("  append_kv MISMATCH after a graph replay")
    return ok, bad


def kernels_per_call(fn):
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# errors ------------------------------------------------------------------------------------

ERROR_SCRIPT = """
import torch, torch_mla
cache = torch.randn(2, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
kv_c, k_pe = torch.randn(3, 512, device="cuda"), torch.randn(3, 64, device="cuda")
{code}
torch.cuda.synchronize()
print("no error")
"""
ERROR_CASES = {
    "negative length": (
        "lens = torch.tensor([5, -3, 9], dtype=torch.int32, device='cuda')\n"
        "torch_mla.get_decode_schedule(lens, 1, 16)",
        "torch_mla.get_decode_schedule: cache_seqlens[1] = -3, but lengths must be >= 0"),
    "slot past the cache": (
        "torch_mla.append_kv(cache, kv_c, k_pe, torch.tensor([128, 1, 2], device='cuda'))",
        "torch_mla.append_kv: slot_mapping[0] = 128, but the cache has only 128 slots "
        "(num_blocks x 64)"),
    "repeated slot": (
        "torch_mla.append_kv(cache, kv_c, k_pe, torch.tensor([5, -1, 5], device='cuda',"
        " dtype=torch.int32))",
        "torch_mla.append_kv: slot_mapping[0] and slot_mapping[2] both write slot 5; slots >= 0 "
        "must be distinct"),
    "repeated slot, graph replay": (
        "slots = torch.tensor([5, 6, 7], device='cuda')\n"
        "torch_mla.append_kv(cache, kv_c, k_pe, slots)\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n"
        "    torch_mla.append_kv(cache, kv_c, k_pe, slots)\n"
        "slots[2] = 6\n"
        "g.replay()",
        "torch_mla.append_kv: slot_mapping[1] and slot_mapping[2] both write slot 6; slots >= 0 "
        "must be distinct"),
    "negative length, checks off (no error expected)": (
        "torch_mla.set_value_checks(False)\n"
        "lens = torch.tensor([5, -3, 9], dtype=torch.int32, device='cuda')\n"
        "torch_mla.get_decode_schedule(lens, 1, 16)",
        None),
}


def check_errors():
    ok = bad = 0
    for name, (code, message) in ERROR_CASES.items():
        res = subprocess.run([sys.executable, "-c", ERROR_SCRIPT.format(code=code)], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        log = res.stdout + res.stderr
        if message is None:
            good = res.returncode == 0 and "no error" in log
        else:
            good = res.returncode != 0 and "no error" not in log and message in log
        ok, bad = ok + good, bad + (not good)
        errs = [ln for ln in log.splitlines() if "Error" in ln or "error" in ln][-1:]
        say(f"  {'pass' if good else 'FAIL'} {name}: rc={res.returncode} "
            f"message {'seen' if message and message in log else 'absent'}; {errs}")
        if not good:
            say("    child output tail: " + log[-1500:].replace("\n", "\n    "))
    return ok, bad


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
    ap.add_argument("--cases", type=int, default=400, help="random cases per kernel")
    ap.add_argument("--calls", type=int, default=2000, help="eager calls per host timing")
    ap.add_argument("--quick", action="store_true", help="40 cases, 300 calls")
    ap.add_argument("--log", default=os.path.join(os.environ.get("OUT", "."),
                                                  "check_small_kernels.log"))
    args = ap.parse_args(argv)
    if args.quick:
        args.cases, args.calls = 40, 300
    import cutlass

    dev = torch.cuda.get_device_properties(0)
    say(f"{dev.name} sm_{dev.major}{dev.minor}, {dev.multi_processor_count} SMs | torch "
        f"{torch.__version__} | nvidia-cutlass-dsl {cutlass.__version__} | torch_mla "
        f"{torch_mla.__version__}")
    rng = random.Random(0)
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
    say("\nvalues")
    ok, bad = check_schedule(args.cases, rng)
    failures += bad
    say(f"  schedule kernel == compute_schedule: {ok} pass, {bad} fail")
    ok, bad = check_append(args.cases, rng)
    failures += bad
    say(f"  append_kv kernel == append_kv_reference: {ok} pass, {bad} fail")
    lens = torch.randint(0, 9000, (64,), dtype=torch.int32, device="cuda")
    names = kernels_per_call(lambda: torch_mla.get_decode_schedule(lens, 1, 128))
    say(f"  kernels per get_decode_schedule call: {len(names)} {names}")
    case = append_case(64, 4, torch.bfloat16, torch.bfloat16, torch.int64, rng)
    names2 = kernels_per_call(lambda: torch_mla.append_kv(*case))
    say(f"  kernels per append_kv call (T=64): {len(names2)} {names2}")
    failures += (len(names) != 1) + (len(names2) != 1)

    say("\nerrors (each in a fresh process)")
    ok, bad = check_errors()
    failures += bad
    say(f"  {ok} pass, {bad} fail")

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
    say(f"\n{'ALL VALUE AND ERROR CHECKS PASS' if not failures else f'{failures} FAILURES'}")
    os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    with open(args.log, "w") as f:
        f.write("\n".join(_log) + "\n")
    print(f"log: {args.log}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
