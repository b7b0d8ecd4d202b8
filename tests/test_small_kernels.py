"""The one-launch schedule and append_kv kernels (cute_kernels/schedule.py, append_kv.py) against
their torch implementations: bit-identical schedules, append_kv equal to the reference with
NaN-poisoned neighbours untouched, CUDA-graph replays with new values, one kernel per call, and
the in-kernel value checks surfacing as a device error with their message."""

import pathlib
import random
import subprocess
import sys

import pytest
import torch

import torch_mla
from torch_mla.ops import dispatch
from torch_mla.reference import append_kv_reference
from torch_mla.scheduling import compute_schedule

pytestmark = pytest.mark.cuda
ROOT = pathlib.Path(__file__).resolve().parents[1]
POISON = -0x5A5A5A5A  # what an output cell holds if the kernel never writes it

# Regime boundaries: page edges, the kernel's chunk (1024 requests) and threads (256).
BATCHES = [0, 1, 2, 3, 63, 64, 65, 255, 256, 257, 1023, 1024, 1025, 2049, 4096]
PARTS = [1, 2, 7, 66, 132, 133, 255, 256, 257, 1000]


def random_lengths(b: int, rng: random.Random) -> list[int]:
    kind = rng.random()
    if kind < 0.15:  # mostly empty: T < num_parts, empty parts
        return [rng.choice([0, 0, 0, 1, 64]) for _ in range(b)]
    if kind < 0.25:  # near int32's limit: the stream positions need int64
        return [rng.choice([2**31 - 1, 2**31 - 64, 0, 1]) for _ in range(b)]
    return [rng.choice([0, 1, 63, 64, 65, 127, 128, 129, rng.randrange(1, 5000),
                        rng.randrange(1, 200_000)]) for _ in range(b)]


def schedule_kernel(lens: torch.Tensor, num_parts: int, check: int = 1):
    """The kernel alone, into poisoned outputs: a cell it does not write keeps POISON."""
    kernel = dispatch.find_schedule_kernel(lens.device)
    assert kernel is not None, "no schedule kernel on this GPU"
    meta = torch.full((num_parts, 8), POISON, dtype=torch.int32, device=lens.device)
    splits = torch.full((lens.shape[0] + 1,), POISON, dtype=torch.int32, device=lens.device)
    kernel(lens, meta, splits, check)
    return meta, splits


def assert_schedule_equal(lens_cpu: torch.Tensor, num_parts: int, meta, splits):
    ref_meta, ref_splits = compute_schedule(lens_cpu, num_parts)
    assert torch.equal(meta.cpu(), ref_meta), (lens_cpu.tolist()[:16], num_parts)
    assert torch.equal(splits.cpu(), ref_splits), (lens_cpu.tolist()[:16], num_parts)


@pytest.mark.parametrize("b", BATCHES)
def test_schedule_kernel_matches_torch(b):
    rng = random.Random(b)
    for _ in range(8):
        lens = torch.tensor(random_lengths(b, rng), dtype=torch.int32)
        for parts in rng.sample(PARTS, 4):
            assert_schedule_equal(lens, parts, *schedule_kernel(lens.cuda(), parts))


@pytest.mark.parametrize("b, parts", [(1, 66), (5, 2), (64, 66), (96, 66), (128, 66),
                                      (128, 132), (300, 257), (1024, 66), (1025, 66)])
def test_schedule_kernel_whole_requests_match_torch(b, parts):
    # Equal lengths (with and without empty requests between) make whole-request schedules
    # (scheduling.whole_request_cuts) for most of these, the uniform cut for the others.
    for L in (1, 64, 4097, 8192):
        lens = torch.full((b,), L, dtype=torch.int32)
        for x in (lens, lens * (torch.arange(b) % 5 != 2)):
            assert_schedule_equal(x, parts, *schedule_kernel(x.cuda(), parts))


def test_schedule_kernel_with_checks_off_clamps_negative_lengths():
    # compute_schedule counts a negative length as 0; with the checks off the kernel agrees.
    lens = torch.tensor([5, -3, 700, -(2**31), 64], dtype=torch.int32)
    assert_schedule_equal(lens, 132, *schedule_kernel(lens.cuda(), 132, check=0))


def test_get_decode_schedule_is_one_kernel_and_matches_torch():
    lens = torch.randint(0, 9000, (37,), dtype=torch.int32)
    lens_gpu = lens.cuda()
    torch_mla.get_decode_schedule(lens_gpu, 2, 128)  # compiles or loads the kernel
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        meta, splits = torch_mla.get_decode_schedule(lens_gpu, 2, 128)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1, kernels
    parts = torch.cuda.get_device_properties(0).multi_processor_count // 4  # 256 rows: 4 m-blocks
    assert_schedule_equal(lens, parts, meta, splits)


def test_schedule_cuda_graph_replays_new_lengths():
    rng = random.Random(0)
    lens = torch.tensor(random_lengths(100, rng), dtype=torch.int32, device="cuda")
    torch_mla.get_decode_schedule(lens, 1, 16, num_sms=132)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        meta, splits = torch_mla.get_decode_schedule(lens, 1, 16, num_sms=132)
    for _ in range(5):
        new = torch.tensor(random_lengths(100, rng), dtype=torch.int32)
        lens.copy_(new)
        g.replay()
        torch.cuda.synchronize()
        assert_schedule_equal(new, 132, meta, splits)


def test_compiled_schedule_runs_the_kernel():
    torch._dynamo.reset()
    fn = torch.compile(lambda lens: torch_mla.get_decode_schedule(lens, 1, 64, num_sms=77),
                       fullgraph=True)
    for b in (3, 300):
        lens = torch.randint(0, 5000, (b,), dtype=torch.int32)
        meta, splits = fn(lens.cuda())
        assert_schedule_equal(lens, 77, meta, splits)
    lens = torch.randint(0, 5000, (40,), dtype=torch.int32, device="cuda")
    fn(lens)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(lens)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) == 1 and "DecodeSchedule" in names[0], names


# append_kv ---------------------------------------------------------------------------------

def append_case(T, num_blocks, cache_dtype, src_dtype, slot_dtype, rng, padding=0.2):
    cache = torch.full((num_blocks, 64, 1, 576), float("nan"), dtype=cache_dtype, device="cuda")
    cache.view(-1, 576)[::3] = torch.randn(num_blocks * 64, 576, device="cuda")[::3].to(cache_dtype)
    slots = torch.randperm(num_blocks * 64, device="cuda")[:T]
    pad = torch.rand(T, device="cuda") < padding
    slots = torch.where(pad, -torch.randint(1, 100, (T,), device="cuda"), slots).to(slot_dtype)
    # Sources as a model makes them: kv_c often a view of a wider projection output.
    if rng.random() < 0.5:
        kv_c = torch.randn(T, 512 + 64, device="cuda").to(src_dtype)[:, 64:]
    else:
        kv_c = torch.randn(T, 512, device="cuda").to(src_dtype)
    k_pe = torch.randn(T, 64, device="cuda").to(src_dtype) * 100
    return cache, kv_c, k_pe, slots


def assert_append_matches(cache, kv_c, k_pe, slots, kv_scale=None):
    ref = cache.clone()
    append_kv_reference(ref, kv_c, k_pe, slots, kv_scale)
    torch_mla.append_kv(cache, kv_c, k_pe, slots, kv_scale=kv_scale)
    torch.cuda.synchronize()
    assert_same_cache(cache, ref)


def assert_same_cache(cache, ref):
    """Bit-identical, NaN where the cache held NaN (rows no token writes); e4m3 bytes compared
    as bytes (a NaN's sign aside)."""
    if cache.dtype != torch.float8_e4m3fn:
        torch.testing.assert_close(cache, ref, atol=0, rtol=0, equal_nan=True)
        return
    nan, nan_ref = cache.float().isnan(), ref.float().isnan()
    assert torch.equal(nan, nan_ref)
    bad = (cache.view(torch.uint8) != ref.view(torch.uint8)) & ~nan
    assert not bad.any(), (cache.float()[bad][:8], ref.float()[bad][:8])


def fp8_append_case(T, num_blocks, src_dtype, slot_dtype, rng):
    """append_case over an e4m3 cache, with a scale that saturates k_pe's largest values and
    sources that hold e4m3 rounding ties, zeros of both signs, subnormals, NaN and +-inf."""
    cache, kv_c, k_pe, slots = append_case(T, num_blocks, torch.float8_e4m3fn, src_dtype,
                                           slot_dtype, rng)
    kv_scale = torch.tensor([rng.choice([0.25, 0.0137, 1.7e-3, 3.0])], device="cuda")
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    table = table[table.isfinite()].sort().values.cuda()
    ties = (table[1:] + table[:-1]) / 2  # midpoints: round to the even neighbour
    special = torch.cat([ties, -ties, torch.tensor(
        [0.0, -0.0, 2.0**-9, -(2.0**-10), 1e-12, 447.9, 448.0, 464.0, 465.0, 1e6, -1e6,
         float("nan"), float("inf"), -float("inf")], device="cuda")]) * kv_scale
    # At random places of kv_c (a 16-bit source keeps the ties it can represent).
    idx = torch.randperm(kv_c.numel(), device="cuda")[:min(special.numel(), kv_c.numel())]
    kv_c[idx // 512, idx % 512] = special[:idx.numel()].to(src_dtype)
    # k_pe / kv_scale ~ 300 randn: past +-448 (saturated) in about 13% of its values.
    k_pe = (k_pe.float() * (kv_scale * 3)).to(src_dtype)
    return cache, kv_c, k_pe, slots, kv_scale


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_append_kv_kernel_matches_reference(cache_dtype, src_dtype, slot_dtype):
    rng = random.Random(str((cache_dtype, src_dtype, slot_dtype)))
    for T in (1, 2, 3, 63, 64, 65, 257, 2048, 2049, 5000):
        case = append_case(T, T // 64 + 3, cache_dtype, src_dtype, slot_dtype, rng)
        assert dispatch.find_append_kernel(*case) is not None
        assert_append_matches(*case)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_append_kv_fp8_kernel_matches_reference(src_dtype, slot_dtype):
    """The e4m3 cache: the kernel's bytes equal the reference's quantization (x / kv_scale,
    saturated, rounded to nearest even) everywhere, ties and specials included."""
    rng = random.Random(str(("fp8", src_dtype, slot_dtype)))
    for T in (1, 2, 3, 63, 64, 65, 257, 2048, 2049, 5000):
        case = fp8_append_case(T, T // 64 + 3, src_dtype, slot_dtype, rng)
        assert dispatch.find_append_kernel(*case[:4]) is not None
        assert_append_matches(*case)


def test_append_kv_fp8_is_one_kernel_and_replays_in_a_cuda_graph():
    rng = random.Random(5)
    cache, kv_c, k_pe, slots, kv_scale = fp8_append_case(48, 4, torch.bfloat16, torch.int64, rng)
    scratch = cache.clone()
    torch_mla.append_kv(scratch, kv_c, k_pe, slots, kv_scale=kv_scale)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch_mla.append_kv(scratch, kv_c, k_pe, slots, kv_scale=kv_scale)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) == 1 and "AppendKV" in names[0], names
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch_mla.append_kv(cache, kv_c, k_pe, slots, kv_scale=kv_scale)
    for _ in range(4):
        new = fp8_append_case(48, 4, torch.bfloat16, torch.int64, rng)
        for dst, src in zip((cache, kv_c, k_pe, slots, kv_scale), new):
            dst.copy_(src)
        expect = cache.clone()
        append_kv_reference(expect, kv_c, k_pe, slots, kv_scale)
        g.replay()
        torch.cuda.synchronize()
        assert_same_cache(cache, expect)


def test_append_kv_all_padding_and_misaligned_sources():
    rng = random.Random(1)
    cache, kv_c, k_pe, slots = append_case(40, 3, torch.bfloat16, torch.bfloat16, torch.int64, rng)
    assert_append_matches(cache, kv_c, k_pe, torch.full_like(slots, -1))
    wide = torch.randn(40 * 577 + 1, device="cuda", dtype=torch.bfloat16)
    kv_c = wide[1:].view(40, 577)[:, :512]  # rows 2-byte aligned: the op copies them first
    assert_append_matches(cache, kv_c, k_pe, slots)


def test_append_kv_is_one_kernel():
    rng = random.Random(2)
    case = append_case(64, 4, torch.bfloat16, torch.bfloat16, torch.int64, rng)
    torch_mla.append_kv(*case)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch_mla.append_kv(*case)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) == 1 and "AppendKV" in names[0], names


def test_append_kv_with_checks_off_skips_slots_past_the_cache():
    rng = random.Random(3)
    cache, kv_c, k_pe, slots = append_case(5, 2, torch.bfloat16, torch.float32, torch.int64, rng,
                                           padding=0)
    slots[2] = 2 * 64 + 7  # past the cache
    expect = cache.clone()
    keep = slots.clone()
    keep[2] = -1
    append_kv_reference(expect, kv_c, k_pe, keep)
    torch_mla.set_value_checks(False)
    try:
        torch_mla.append_kv(cache, kv_c, k_pe, slots)
        torch.cuda.synchronize()
    finally:
        torch_mla.set_value_checks(True)
    torch.testing.assert_close(cache, expect, atol=0, rtol=0, equal_nan=True)


def test_append_kv_cuda_graph_replays_new_values():
    rng = random.Random(4)
    cache, kv_c, k_pe, slots = append_case(48, 4, torch.bfloat16, torch.float32, torch.int32, rng)
    torch_mla.append_kv(cache.clone(), kv_c, k_pe, slots)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        torch_mla.append_kv(cache, kv_c, k_pe, slots)
    for _ in range(4):
        new = append_case(48, 4, torch.bfloat16, torch.float32, torch.int32, rng)
        for dst, src in zip((cache, kv_c, k_pe, slots), new):
            dst.copy_(src)
        expect = cache.clone()
        append_kv_reference(expect, kv_c, k_pe, slots)
        g.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(cache, expect, atol=0, rtol=0, equal_nan=True)


# In-kernel checks: a trap ends the CUDA context, so each case runs in its own process.

ERROR_CASES = {
    "negative_length": (
        "lens = torch.tensor([5, -3, 9], dtype=torch.int32, device='cuda')\n"
        "torch_mla.get_decode_schedule(lens, 1, 16)",
        "torch_mla.get_decode_schedule: cache_seqlens[1] = -3, but lengths must be >= 0"),
    "slot_past_cache": (
        "torch_mla.append_kv(cache, kv_c, k_pe, torch.tensor([128, 1, 2], device='cuda'))",
        "torch_mla.append_kv: slot_mapping[0] = 128, but the cache has only 128 slots "
        "(num_blocks x 64)"),
    "repeated_slot": (
        "torch_mla.append_kv(cache, kv_c, k_pe, torch.tensor([5, -1, 5], device='cuda',"
        " dtype=torch.int32))",
        "torch_mla.append_kv: slot_mapping[0] and slot_mapping[2] both write slot 5; slots >= 0 "
        "must be distinct"),
    "repeated_slot_in_a_graph_replay": (
        "slots = torch.tensor([5, 6, 7], device='cuda')\n"
        "torch_mla.append_kv(cache, kv_c, k_pe, slots)\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n"
        "    torch_mla.append_kv(cache, kv_c, k_pe, slots)\n"
        "slots[2] = 6\n"
        "g.replay()",
        "torch_mla.append_kv: slot_mapping[1] and slot_mapping[2] both write slot 6; slots >= 0 "
        "must be distinct"),
}

ERROR_SCRIPT = """
import torch, torch_mla
cache = torch.randn(2, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
kv_c, k_pe = torch.randn(3, 512, device="cuda"), torch.randn(3, 64, device="cuda")
{code}
torch.cuda.synchronize()
print("no error")
"""


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_in_kernel_checks_fail_with_their_message(case):
    code, message = ERROR_CASES[case]
    res = subprocess.run([sys.executable, "-c", ERROR_SCRIPT.format(code=code)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    log = res.stdout + res.stderr
    assert res.returncode != 0 and "no error" not in log, log
    assert message in log, log
