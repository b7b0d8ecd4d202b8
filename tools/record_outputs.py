"""Records every kernel variant's outputs on a fixed case set, and compares two recordings bit
for bit: the check that a refactor changed no output.

    python -m tools.record_outputs record FILE [--cpu | --device cpu|cuda [--small]] [--only TEXT]
    python -m tools.record_outputs compare A B

    # another tree's torch_mla (the file itself is the same): run it by path, so that the tree
    # on PYTHONPATH is imported and not this checkout (python -m puts the current directory
    # first); the recording's header says which torch_mla ran
    PYTHONPATH=/path/to/old/tree python tools/record_outputs.py record old.pt

Uses only the public API, which is the same before and after the issue-28 refactor:
torch_mla.mla_decode (its schedule, softmax_scale, causal, kv_scale, q_scale and compute
arguments), get_decode_schedule, append_kv, slot_mapping, and TORCH_MLA_PORTABLE=1 (read at
each call) for the portable kernel. Inputs are drawn on the CPU from a seed derived from each
case's key (a case does not depend on the others or on --only), poisoned as in the tests (NaN
past every length and in spare pages, huge ids in unused block-table entries), then moved to
the device. Cases, each a key in the file:
    decode   bf16 and fp16 (16-bit cache), causal and not; a float8_e4m3fn cache with kv_scale
             in exact and fast (compute="fp8") mode, q bf16, fp16 and e4m3 with q_scale; the
             portable kernel (bf16, fp16, causal and not): batches 1 to 32, lengths 0, 1, 63,
             64, 65 and a few thousand, s_q 1-4, h_q 1, 16, 64, 128, h_kv 4, the combine's
             warps-per-row choices (1, 4, 16 at unroll 4, and 16 at unroll 2 where the
             heuristic takes it), the schedule passed in, as a tuple, computed inside, for
             17 SMs, and another softmax scale. Recorded: out and lse.
    schedule get_decode_schedule's metadata and num_splits for batches of 0 to 2000 requests.
    append_kv the cache's bytes after writing into bf16, fp16 and float8_e4m3fn caches from
             bf16, fp16 and fp32 sources with int32 and int64 slots (padding slots, a strided
             source, slot_mapping's slots).
On an H200 the run takes about a minute once the kernels are compiled (python -m
torch_mla.precompile --kernels step,fp8_step,fp8_fast,portable,schedule,append_kv first: ~20
variants). ``--cpu`` (= ``--device cpu --small``) records a small case set on CPU tensors (the
reference path): the tool's own check.

compare prints one line per case, "same" or what differs (per tensor: how many elements have
other bits, NaN patterns included, and the largest absolute difference between finite values),
then a summary; exit status 1 when a case differs, failed, or is missing from either file.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import zlib

import torch

import torch_mla

FP8 = torch.float8_e4m3fn
PAGE, D_QK = 64, 576
POISON_ID = 2**30
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# Inputs ------------------------------------------------------------------------------------


def generator(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def paged(g: torch.Generator, lens: list[int], h_kv: int = 1, spare: int = 2):
    """(float32 cache [pages, 64, h_kv, 576] with NaN past every length and in the spare pages,
    int32 block table [b, max pages + 1] with huge ids in unused entries, int32 lengths)."""
    pages = [-(-L // PAGE) for L in lens]
    num_blocks = sum(pages) + spare
    cache = torch.randn(num_blocks, PAGE, h_kv, D_QK, generator=g) / 10
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(lens), max([0, *pages]) + 1), POISON_ID, dtype=torch.int32)
    cache[perm[sum(pages):]] = math.nan
    start = 0
    for r, (L, n) in enumerate(zip(lens, pages)):
        own = perm[start:start + n]
        table[r, :n] = own.to(torch.int32)
        if L % PAGE:
            cache[own[-1], L % PAGE:] = math.nan
        start += n
    return cache, table, torch.tensor(lens, dtype=torch.int32)


def to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in float8_e4m3fn with one scale (amax / 448 of its finite values; NaN stays NaN)."""
    scale = (x.nan_to_num(0).abs().amax() / 448).reshape(1)
    return (x / scale).clamp(-448, 448).to(FP8), scale


# (name, lengths, s_q, h_q, h_kv). Comments: the combine variant CombineConfig picks on 132 SMs.
SHAPES = {
    "b1": ([3000], 1, 128, 1),  # one request cut into many pieces: 16 warps a row
    "edges": ([0, 1, 63, 64, 65, 2500], 2, 16, 1),  # lengths 0 and around a page
    "b3": ([4097, 64, 1], 4, 64, 1),
    "b8": ([1000, 2000, 3000, 4000, 65, 1, 0, 2048], 1, 128, 1),  # 4 warps a row
    "h1": ([777, 2500, 65, 1, 1000, 0, 63, 4096], 3, 1, 1),
    "b32": ([150 * (i % 12) + 37 * i for i in range(32)], 1, 128, 1),  # 1 warp a row
    "hkv4": ([20, 140, 0, 65], 2, 16, 4),  # one launch per KV head
}
SMALL_SHAPES = {  # small enough for the reference on two CPU cores
    "edges": ([0, 1, 63, 64, 65, 130], 2, 16, 1),
    "hkv2": ([20, 70], 1, 4, 2),
}
# The set of shapes per decode variant: every shape for the 16-bit kernels, a few for the others.
FEW = ("b1", "edges", "b3", "b8", "hkv4")


def decode_variants() -> list[tuple[str, dict]]:
    """(name, how to call) of every decode variant."""
    out = []
    for causal in (False, True):
        for dt in ("bf16", "fp16"):
            out.append((f"kv={dt} q={dt} causal={int(causal)}",
                        dict(kv=dt, q=dt, causal=causal, compute=None, portable=False)))
        for compute in ("exact", "fp8"):
            for q in ("bf16", "fp16", "e4m3"):
                out.append((f"kv=e4m3 q={q} {compute} causal={int(causal)}",
                            dict(kv="e4m3", q=q, causal=causal, compute=compute,
                                 portable=False)))
        for dt in ("bf16", "fp16"):
            out.append((f"portable kv={dt} q={dt} causal={int(causal)}",
                        dict(kv=dt, q=dt, causal=causal, compute=None, portable=True)))
    return out


@contextlib.contextmanager
def portable(on: bool):
    old = os.environ.get("TORCH_MLA_PORTABLE")
    if on:
        os.environ["TORCH_MLA_PORTABLE"] = "1"
    else:
        os.environ.pop("TORCH_MLA_PORTABLE", None)
    try:
        yield
    finally:
        os.environ.pop("TORCH_MLA_PORTABLE", None)
        if old is not None:
            os.environ["TORCH_MLA_PORTABLE"] = old


def backend(device, q_dtype, kv_dtype, compute) -> str:
    """Which implementation runs (decode_backend, named in mla_decode's docstring), or '?'."""
    try:
        from torch_mla.ops.dispatch import decode_backend

        return decode_backend(device, q_dtype, D_QK, 512, PAGE, kv_dtype, compute)[0]
    except Exception:  # an informative extra: its absence must not stop a recording
        return "?"


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def decode_case(key: str, spec: dict, shape, call: str, device) -> dict:
    """Runs one decode case; returns its out and lse (on the CPU)."""
    lens, s_q, h_q, h_kv = shape
    g = generator(key)
    cache, table, seqlens = paged(g, lens, h_kv)
    q = torch.randn(len(lens), s_q, h_q, D_QK, generator=g) / 10
    kw = {"causal": spec["causal"]}
    if spec["kv"] == "e4m3":
        cache, kw["kv_scale"] = to_fp8(cache)
        kw["compute"] = spec["compute"]
        if spec["q"] == "e4m3":
            q, kw["q_scale"] = to_fp8(q)
    else:
        cache = cache.to(DTYPES[spec["kv"]])
    if spec["q"] != "e4m3":
        q = q.to(DTYPES[spec["q"]])
    q, cache, table, seqlens = (t.to(device) for t in (q, cache, table, seqlens))
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    sched = None
    if call != "inside":
        sched = torch_mla.get_decode_schedule(seqlens, s_q, h_q, 17 if call == "sms17" else None,
                                              h_kv=h_kv)
        if call == "tuple":
            sched = (sched.metadata, sched.num_splits)
    if call == "scale":
        kw["softmax_scale"] = 0.05
    with portable(spec["portable"]):
        out, lse = torch_mla.mla_decode(q, cache, table, seqlens, sched, **kw)
        name = backend(q.device, q.dtype, cache.dtype, spec["compute"] or "exact")
    return {"out": out.cpu(), "lse": lse.cpu(), "backend": name}


def decode_cases(small: bool):
    """(key, spec, shape, how the schedule is passed) of every decode case."""
    shapes = SMALL_SHAPES if small else SHAPES
    for name, spec in decode_variants():
        few = spec["compute"] is not None or spec["portable"]
        for sname, shape in shapes.items():
            if spec["causal"] and shape[1] == 1:
                continue  # (causal masking needs s_q > 1: the same kernel as causal=False)
            if few and not small and sname not in FEW:
                continue
            yield f"decode {name} {sname}", spec, shape, "given"
    if small:
        calls = [("tuple", "edges"), ("inside", "hkv2")]
    else:
        calls = [("tuple", "b8"), ("inside", "edges"), ("sms17", "b3"), ("scale", "b1")]
    for call, sname in calls:
        spec = dict(kv="bf16", q="bf16", causal=True, compute=None, portable=False)
        yield f"decode kv=bf16 q=bf16 causal=1 {sname} schedule={call}", spec, shapes[sname], call


SCHEDULES = {  # name: (lengths as a function of a generator, s_q, h_q, num_sms)
    "b0": (lambda g: [], 1, 128, None),
    "b1": (lambda g: [0], 1, 128, None),
    "varlen": (lambda g: [0, 1, 63, 64, 65, 3000, 100000, 7], 2, 64, None),
    "b128": (lambda g: torch.randint(0, 10000, (128,), generator=g).tolist(), 1, 16, None),
    "equal": (lambda g: [4097] * 64, 1, 128, None),  # whole requests per part
    "b1000": (lambda g: torch.randint(0, 70000, (1000,), generator=g).tolist(), 1, 128, 17),
    "b2000": (lambda g: torch.randint(0, 5000, (2000,), generator=g).tolist(), 4, 128, None),
}
SMALL_SCHEDULES = ("b0", "b1", "varlen", "b128", "equal")


def schedule_case(key: str, name: str, device) -> dict:
    make, s_q, h_q, num_sms = SCHEDULES[name]
    lens = torch.tensor(make(generator(key)), dtype=torch.int32).to(device)
    meta, splits = torch_mla.get_decode_schedule(lens, s_q, h_q, num_sms)
    return {"metadata": meta.cpu(), "num_splits": splits.cpu()}


def append_case(key: str, cache_dt: str, src_dt: str, slot_dt: torch.dtype, kind: str,
                device) -> dict:
    """Writes T tokens into a random cache (NaN rows between the written ones); returns the
    cache's bytes after the write."""
    g = generator(key)
    num_blocks, T = 6, 150
    cache = torch.randn(num_blocks, PAGE, 1, D_QK, generator=g)
    cache.view(-1, D_QK)[::5] = math.nan
    kw = {}
    if cache_dt == "e4m3":
        cache, kw["kv_scale"] = to_fp8(cache)
    else:
        cache = cache.to(DTYPES[cache_dt])
    src = (torch.randn(T, D_QK, generator=g) * 3).to(DTYPES[src_dt])
    slots = torch.randperm(num_blocks * PAGE, generator=g)[:T]
    slots = torch.where(torch.rand(T, generator=g) < 0.2, -1, slots)  # padding slots
    kv_c, k_pe = src[:, :512].contiguous(), src[:, 512:].contiguous()
    if kind == "strided":  # views into one buffer, as a model's projection output gives them
        kv_c, k_pe = src[:, :512], src[:, 512:]
    cache, kv_c, k_pe = cache.to(device), kv_c.to(device), k_pe.to(device)
    kw = {k: v.to(device) for k, v in kw.items()}
    if kind == "slot_mapping":
        table = torch.randperm(num_blocks, generator=g)[:4].view(2, 2).to(torch.int32)
        lens = torch.tensor([3, 70], dtype=torch.int32)
        slots = torch_mla.slot_mapping(table.to(device), lens.to(device), 40)
        kv_c, k_pe = kv_c[:80], k_pe[:80]
    else:
        slots = slots.to(slot_dt).to(device)
    torch_mla.append_kv(cache, kv_c, k_pe, slots, **kw)
    return {"cache": cache.cpu()}


def append_cases(small: bool):
    for cache_dt in ("bf16", "fp16", "e4m3"):
        for src_dt in ("bf16", "fp16", "fp32"):
            for slot_name, slot_dt in (("int32", torch.int32), ("int64", torch.int64)):
                if small and slot_name == "int32" and src_dt != "bf16":
                    continue
                yield (f"append_kv cache={cache_dt} src={src_dt} slots={slot_name}", cache_dt,
                       src_dt, slot_dt, "plain")
        yield f"append_kv cache={cache_dt} src=bf16 strided", cache_dt, "bf16", torch.int64, \
            "strided"
        yield f"append_kv cache={cache_dt} src=bf16 slot_mapping", cache_dt, "bf16", \
            torch.int64, "slot_mapping"


def all_cases(small: bool, device):
    """(key, a function recording that case) of the whole set, or of the small one."""
    for key, spec, shape, call in decode_cases(small):
        yield key, lambda k=key, s=spec, sh=shape, c=call: decode_case(k, s, sh, c, device)
    for name in (SMALL_SCHEDULES if small else SCHEDULES):
        key = f"schedule {name}"
        yield key, lambda k=key, n=name: schedule_case(k, n, device)
    for key, *args in append_cases(small):
        yield key, lambda k=key, a=args: append_case(k, *a, device)


def record(path: str, device: str, small: bool, only: str | None) -> int:
    device = torch.device(device)
    header = {"torch_mla": os.path.dirname(torch_mla.__file__), "torch": str(torch.__version__),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "environment": {k: v for k, v in os.environ.items() if k.startswith("TORCH_MLA")},
              "small": small}
    print(f"recording with torch_mla from {header['torch_mla']} on {header['device']}",
          flush=True)
    cases, failed, t0 = {}, 0, time.time()
    for key, run in all_cases(small, device):
        if only and only not in key:
            continue
        t = time.time()
        try:
            cases[key] = run()
        except Exception as e:  # recorded as a failed case; compare reports it
            first = (str(e).splitlines() or [""])[0]
            cases[key] = {"error": f"{type(e).__name__}: {first}"}
        failed += "error" in cases[key]
        note = cases[key].get("error") or cases[key].get("backend", "")
        print(f"{key}: {time.time() - t:.2f} s {note}", flush=True)
        if "CUDA error" in cases[key].get("error", ""):
            print("stopping: the CUDA context is lost", flush=True)
            break
    torch.save({"header": header, "cases": cases}, path)
    print(f"{len(cases)} cases ({failed} failed) in {time.time() - t0:.0f} s -> {path}")
    return 1 if failed else 0


# Comparison --------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns as integers of its element size (every NaN pattern distinct)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    return t.contiguous().view(BITS[t.element_size()])


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when a and b have the same dtype, shape and bits; else what differs."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    n = int((bits(a) != bits(b)).sum())
    if n == 0:
        return None
    text = f"{n} of {a.numel()} elements differ"
    if a.is_floating_point():
        x, y = a.double(), b.double()
        both = torch.isfinite(x) & torch.isfinite(y)
        if both.any():
            text += f", max |diff| {float((x - y)[both].abs().max()):.3g}"
        text += f", {int((torch.isnan(x) != torch.isnan(y)).sum())} NaN positions differ"
    return text


def case_difference(a: dict, b: dict) -> str | None:
    if "error" in a or "error" in b:
        return f"failed: A {a.get('error', 'ok')} | B {b.get('error', 'ok')}"
    parts = []
    for name in sorted(set(a) | set(b)):
        if name == "backend":
            continue
        if name not in a or name not in b:
            parts.append(f"{name} missing in {'A' if name not in a else 'B'}")
            continue
        diff = tensor_difference(a[name], b[name])
        if diff:
            parts.append(f"{name}: {diff}")
    known = "?" not in (a.get("backend", "?"), b.get("backend", "?"))
    if known and a["backend"] != b["backend"]:  # (unknown where decode_backend moved)
        parts.append(f"backend {a['backend']} vs {b['backend']}")
    return "; ".join(parts) or None


def compare(path_a: str, path_b: str) -> int:
    a, b = (torch.load(p, weights_only=True) for p in (path_a, path_b))
    for tag, rec, path in (("A", a, path_a), ("B", b, path_b)):
        h = rec["header"]
        print(f"{tag}: {path}: torch_mla from {h['torch_mla']}, torch {h['torch']}, "
              f"{h['device']}, environment {h['environment']}")
    keys = list(dict.fromkeys([*a["cases"], *b["cases"]]))
    same = differ = missing = 0
    for key in keys:
        if key not in a["cases"] or key not in b["cases"]:
            missing += 1
            print(f"{key}: MISSING in {'A' if key not in a['cases'] else 'B'}")
            continue
        diff = case_difference(a["cases"][key], b["cases"][key])
        same += diff is None
        differ += diff is not None
        print(f"{key}: {'same' if diff is None else 'DIFFERS: ' + diff}")
    ok = differ == 0 and missing == 0
    print(f"summary: {len(keys)} cases, {same} same, {differ} differ, {missing} missing: "
          f"{'IDENTICAL' if ok else 'NOT IDENTICAL'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run every case, save the results to FILE")
    rec.add_argument("file")
    rec.add_argument("--cpu", action="store_true",
                     help="a small case set on CPU tensors (the reference path)")
    rec.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    rec.add_argument("--small", action="store_true", help="the small case set")
    rec.add_argument("--only", metavar="TEXT", help="only the cases whose key contains TEXT")
    cmp = sub.add_parser("compare", help="compare two recordings bit for bit")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = ap.parse_args(argv)
    if args.command == "record":
        if args.cpu:
            args.device, args.small = "cpu", True
        return record(args.file, args.device, args.small, args.only)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
