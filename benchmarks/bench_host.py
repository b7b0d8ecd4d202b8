"""Host time of one eager call of each op (CPU microseconds to issue it), beside FlashMLA's.

    python benchmarks/bench_host.py            # on a GPU; FlashMLA too when `flash_mla` imports
    python benchmarks/bench_host.py --cpu-model [--profile]   # no GPU: the Python path alone

A decode step at small batch is bounded by how fast the host issues kernels, not by the GPU. Here
the GPU is first held busy (``torch.cuda._sleep``) so that nothing waits for it, then N calls are
issued and the CPU time per call is taken (median of several rounds); the GPU work queued behind
the sleep is then drained. Value checks stay on (the defaults). Shapes: batch 4, 1 query token,
128 heads, lengths ~1000 (the host path does not depend on them).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

import torch_mla
from torch_mla.testing import make_decode_inputs

# At most ~1000 launches may wait in a stream's queue before a launch blocks the host: a round
# issues few enough calls (the torch-op schedule alone is ~40 kernels) to stay below that.
ROUNDS, CALLS = 31, 10


def host_us(fn) -> float:
    for _ in range(10):  # compile, load, warm up
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(ROUNDS):
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU spin: the queue never drains meanwhile
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - t0) / CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


_CUDA0 = torch.device("cuda", 0)


@contextlib.contextmanager
def cuda_model():
    """CPU tensors take mla_decode's SM90 kernel path, up to the launch of its compiled step,
    which is a no-op here: what remains is the Python host path (checks, dispatch, allocation,
    argument packing). Not modelled: the TVM-FFI call itself (~7 us on the H200 host) and the
    CUDA caching allocator (CPU allocations of the same sizes stand in)."""
    from torch_mla.ops import dispatch

    saved = (torch.Tensor.is_cuda, torch.cuda.current_device, dispatch.decode_backend,
             dict(dispatch.STEPS), dict(dispatch._capability))
    torch.Tensor.is_cuda = property(lambda self: True)
    backend = dispatch.decode_backend
    dispatch.decode_backend = lambda device, *args: backend(_CUDA0, *args)
    # CPU tensors have device index None: "the current device" is None too, an H100/H200.
    torch.cuda.current_device = lambda: None
    dispatch._capability[None] = dispatch._capability[0] = (9, 0)
    dispatch.STEPS["sm90"] = lambda dtype, causal, index: lambda *args: None
    try:
        yield
    finally:
        torch.Tensor.is_cuda, torch.cuda.current_device, dispatch.decode_backend = saved[:3]
        dispatch.STEPS.clear()
        dispatch.STEPS.update(saved[3])
        dispatch._capability.clear()
        dispatch._capability.update(saved[4])


def cpu_model(profile: bool):
    """Host us per eager mla_decode (schedule given), CPU tensors through the modelled SM90 path:
    median over rounds of perf_counter_ns around CALLS calls."""
    s_q, h_q = 1, 128
    inp = make_decode_inputs([900, 1000, 1100, 1200], s_q, h_q, poison=False)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)

    def fn():
        return torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                    sched)

    with cuda_model():
        for _ in range(200):
            fn()
        times = []
        for _ in range(31):
            t0 = time.perf_counter_ns()
            for _ in range(100):
                fn()
            times.append((time.perf_counter_ns() - t0) / 100 / 1e3)
        print(f"# CPU model, torch {torch.__version__}: mla_decode (schedule given), host us per "
              f"call without the step's launch: median {statistics.median(times):.2f}, "
              f"min {min(times):.2f} (31 rounds x 100 calls)")
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(3000):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def floor_rows(inp, sched, x):
    """What the calls above are made of: one launch of a compiled CuTe DSL kernel through
    TVM-FFI (an empty kernel), mla_decode's compiled step alone (its two launches, arguments
    prepared once), a CUDA allocation and a view, and a torch elementwise op for scale."""
    import cutlass
    import cutlass.cute as cute

    from torch_mla.ops import dispatch

    class Empty:  # (no annotations: this module's are strings, which the DSL cannot resolve)
        @cute.kernel
        def kernel(self, t):
            pass

        @cute.jit
        def __call__(self, t, stream):
            self.kernel(t).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    fake = cute.runtime.make_fake_tensor(cutlass.Float32, (cute.sym_int(),), stride=(1,),
                                         assumed_align=4)
    empty = cute.compile(Empty(), fake, cute.runtime.make_fake_stream(
        use_tvm_ffi_env_stream=True), options=f"--enable-tvm-ffi --gpu-arch "
                                              f"{dispatch.device_arch(x.device.index)}")
    y = torch.zeros(32, device=x.device)
    step_args = {}
    saved = dict(dispatch.STEPS)

    def capture(run):
        def get(dtype, causal, index):
            step = run(dtype, causal, index)

            def call(*args):
                step_args["step"] = (step, args)
                return step(*args)
            return call
        return get

    # Whichever step this GPU runs (the SM90 one on an H100/H200, the portable one elsewhere).
    dispatch.STEPS.update({key: capture(run) for key, run in saved.items()})
    try:
        torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched)
    finally:
        dispatch.STEPS.update(saved)
    step, args = step_args["step"]
    return [("one CuTe DSL kernel launch (an empty kernel, TVM-FFI)", lambda: empty(y)),
            ("mla_decode's compiled step alone (2 launches, arguments prepared)",
             lambda: step(*args)),
            ("torch.empty on the GPU (caching allocator)",
             lambda: torch.empty(4, 8, device=x.device)),
            ("a view (x.view(-1))", lambda: x.view(-1)),
            ("a torch elementwise op (x.add_(0))", lambda: x.add_(0))]


def main():
    b, s_q, h_q = 4, 1, 128
    inp = make_decode_inputs([900, 1000, 1100, 1200], s_q, h_q, device="cuda")
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    kv_c = torch.randn(b, 512, dtype=torch.bfloat16, device="cuda")
    k_pe = torch.randn(b, 64, dtype=torch.bfloat16, device="cuda")
    slots = torch_mla.slot_mapping(inp.block_table, inp.cache_seqlens - 1, 1)
    cache = inp.kv_cache.clone()
    cache8 = torch.zeros(cache.shape, dtype=torch.float8_e4m3fn, device="cuda")
    kv_scale = torch.full((1,), 0.01, device="cuda")
    rows = [
        ("get_decode_schedule", lambda: torch_mla.get_decode_schedule(inp.cache_seqlens, s_q,
                                                                      h_q)),
        ("mla_decode (schedule given)", lambda: torch_mla.mla_decode(
            inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched)),
        ("mla_decode (schedule inside)", lambda: torch_mla.mla_decode(
            inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens)),
        ("append_kv", lambda: torch_mla.append_kv(cache, kv_c, k_pe, slots)),
        ("append_kv (float8_e4m3fn cache)", lambda: torch_mla.append_kv(
            cache8, kv_c, k_pe, slots, kv_scale=kv_scale)),
        ("slot_mapping", lambda: torch_mla.slot_mapping(inp.block_table, inp.cache_seqlens, 1)),
    ]
    rows += floor_rows(inp, sched, kv_c)
    try:
        import flash_mla

        meta, _ = flash_mla.get_mla_metadata()

        def fm():
            return flash_mla.flash_mla_with_kvcache(inp.q, inp.kv_cache, inp.block_table,
                                                    inp.cache_seqlens, 512, meta, None)

        rows.append(("FlashMLA flash_mla_with_kvcache (metadata reused)", fm))
    except ImportError:
        pass
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: host us per eager call "
          f"(median of {ROUNDS} rounds x {CALLS} calls)")
    print("| call | host us |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {host_us(fn):.1f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-model", action="store_true",
                    help="no GPU: time mla_decode's Python host path with the launch a no-op")
    ap.add_argument("--profile", action="store_true", help="with --cpu-model: cProfile it")
    a = ap.parse_args()
    if a.cpu_model and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc maps and unmaps each allocation over 32 MB (the partials' workspace): ~15 us a
        # call that the CUDA caching allocator does not pay. Keep them on the heap instead.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="4294967296",
                   MALLOC_TRIM_THRESHOLD_="4294967296")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    cpu_model(a.profile) if a.cpu_model else main()
