"""Seeded fuzzer: torch_mla.mla_decode against an independent computation on random configurations.

On a GPU, mla_decode (the SM90 kernel on an H100/H200) is checked against the plain-PyTorch
reference (torch_mla.reference.mla_decode_reference, fp32 accumulate). On the CPU, mla_decode *is*
the reference, so it is checked against a float64 computation (torch_mla.testing.mla_decode_fp64).

Each case draws, from the seed and its index alone: dtype (bf16, fp16), batch, query tokens (1-8,
causal or not), query and KV heads (h_q a multiple of h_kv; query head h reads KV head
h // (h_q // h_kv)), lengths (often on page edges, varlen within a batch, zeros), block-table
width and spare pages, the size of the scores (peaky or flat softmax) and the softmax scale.
Inputs are poisoned: NaN in every cache slot past each length and in spare pages, a huge page id
in every unused block-table entry. A case passes when out and lse are within the per-dtype
tolerances of the kernel tests (tests/test_kernel_sm90.py), query rows that see no key give
out == 0 and lse == +inf exactly, and nothing is NaN.

    python -m tools.fuzz_decode --cases 2000 --seed 0 --log fuzz.log                    # H200
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python -m tools.fuzz_decode --small --cases 200 --seed 0 --log memcheck.log  # memcheck
    python -m tools.fuzz_decode --device cpu --cases 20                                   # CPU

Without the caching allocator every tensor is its own allocation, so memcheck also sees a read
that lands in a neighbouring tensor. ``--max-h-kv 8`` adds h_kv > 1 (default 1). ``--fp8``: every
case's cache quantized to float8_e4m3fn at the per-tensor scale amax / 448 (the NaN poison stays
NaN), mla_decode given kv_scale (exact mode), the reference over the same dequantized values; with
TORCH_MLA_KEYSM_RS=1 every case of up to 32 query rows and one KV head runs the ping-pong
keys-on-M kernel (without it, those of a batch of 8 or more, 32 or more above 16 rows).
``--fast``: the same over an e4m3 cache in fast mode (compute="fp8"; its cases of <= 16 rows
a KV head, and of <= 32 from a batch of 4, run the keys-on-M fast kernel), q at its drawn
size without the large multipliers
(fast mode's bound is for ordinary scores: Q's e4m3 rounding moves a score by up to
2^-4 |q| |k| scale), checked as tests/test_fp8.py's check_fast_mode does: the output's relative
error within 2.5 x e_store (the reference over the dequantized cache against the reference over
the original latents), each lse within 1e-3 + that score bound; out_tol and lse_tol are those
ratios.

A failing case prints a one-line repro (``--only K`` reruns case K). Exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import shlex
import sys
import time

import torch

import torch_mla
from torch_mla.constants import D_QK, D_V, PAGE_SIZE
from torch_mla.devtools import runs_kernel
from torch_mla.reference import dequantize_fp8, mla_decode_reference, quantize_fp8
from torch_mla.testing import (
    DECODE_TOL,
    LSE_TOL,
    make_decode_inputs,
    mla_decode_fp64,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Rows the reference handles per call: its scores are [chunk, s_q * h_q, keys] fp32, 2 GiB at
# s_q * h_q = 1024 and 64k keys; each call gets a block table cut to its chunk's longest request.
REF_CHUNK = 8
HEAD_CHOICES = [1, 2, 3, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 96, 127, 128]

# (max_b, max_len, max_tokens) when not given: the tokens cap keeps a bf16 cache under ~2 GB.
LIMITS = {"cuda": (300, 65536, 1_800_000), "small": (8, 640, 4096), "cpu": (4, 320, 1024)}


@dataclasses.dataclass(frozen=True)
class Case:
    index: int
    dtype: str
    lens: tuple[int, ...]
    s_q: int
    h_q: int
    h_kv: int
    causal: bool
    extra_width: int  # block-table columns past the longest request
    spare_pages: int  # cache pages no request owns (NaN)
    q_mult: float  # q = q_mult * randn / 10: 1 gives a flat softmax, 300 a peaky one
    softmax_scale: float | None  # None: d_qk ** -0.5
    schedule: str  # "explicit" (get_decode_schedule passed in) or "inside" (None passed)
    num_sms: int | None  # for an explicit schedule; None: the device's count

    def describe(self) -> str:
        lens = self.lens
        if len(lens) <= 8:
            shown = "[" + ",".join(map(str, lens)) + "]"
        else:
            shown = (f"[{','.join(map(str, lens[:4]))},...] (min {min(lens)} max {max(lens)} "
                     f"sum {sum(lens)} zeros {lens.count(0)})")
        scale = "default" if self.softmax_scale is None else f"{self.softmax_scale:.4g}"
        sched = self.schedule + ("" if self.num_sms is None else f"/{self.num_sms}sm")
        return (f"{self.dtype} b={len(lens)} s_q={self.s_q} h_q={self.h_q} h_kv={self.h_kv} "
                f"causal={int(self.causal)} lens={shown} width+={self.extra_width} "
                f"spare={self.spare_pages} q_mult={self.q_mult:g} scale={scale} sched={sched}")


def _page_edge(rng: random.Random, hi: int) -> int:
    top = max(1, hi // PAGE_SIZE)
    k = top if rng.random() < 0.3 else rng.randint(1, top)
    return rng.choice([0, 1, 63, 64, 65, k * PAGE_SIZE - 1, k * PAGE_SIZE, k * PAGE_SIZE + 1])


def draw_case(seed: int, index: int, max_b: int, max_len: int, max_tokens: int, max_h_kv: int,
              schedule: str) -> Case:
    """Case ``index`` of ``seed``: a function of these arguments only."""
    rng = random.Random(f"torch_mla-fuzz:{seed}:{index}")
    dtype = rng.choice(list(DTYPES))
    s_q = 1 if rng.random() < 0.3 else rng.randint(1, 8)
    causal = rng.random() < 0.5
    h_kv = 1 if rng.random() < 0.5 else rng.randint(1, max_h_kv)
    want = rng.choice(HEAD_CHOICES) if rng.random() < 0.6 else rng.randint(1, 128)
    h_q = max(1, want // h_kv) * h_kv
    regime = rng.random()
    b = rng.randint(1, min(4, max_b)) if regime < 0.4 else (
        rng.randint(1, min(32, max_b)) if regime < 0.7 else rng.randint(1, max_b))
    # Log-uniform: short and long cases alike; now and then the longest allowed.
    hi = max_len if rng.random() < 0.1 else int(2 ** rng.uniform(0, math.log2(max_len)))
    if rng.random() < 0.15:  # one length for the whole batch
        lens = [_page_edge(rng, hi) if rng.random() < 0.5 else rng.randint(0, hi)] * b
    else:
        lens = [_page_edge(rng, hi) if rng.random() < 0.4 else rng.randint(0, hi)
                for _ in range(b)]
    lens = [min(L, max_len) for L in lens]
    # The cache must fit max_tokens rows ([tokens, h_kv] latents): drop requests or shrink them.
    budget = max_tokens // (PAGE_SIZE * h_kv)  # pages

    def pages(ls):
        return sum(-(-L // PAGE_SIZE) for L in ls)

    if pages(lens) > budget:
        if rng.random() < 0.5:
            while len(lens) > 1 and pages(lens) > budget:
                lens.pop()
        if pages(lens) > budget:
            f = budget / pages(lens)
            lens = [int(L * f) for L in lens]
            while pages(lens) > budget:  # rounding up to pages left at most b pages over
                i = lens.index(max(lens))
                lens[i] = max(0, lens[i] - PAGE_SIZE)
    # Wide tables cost the reference (it reads the table's whole width): at most 40 extra pages.
    extra_width = rng.choice([0, 0, 1, 2, rng.randint(3, max(3, min(40, max_len // PAGE_SIZE)))])
    spare_pages = rng.choice([0, 1, rng.randint(2, 16)])
    q_mult = rng.choice([1.0, 30.0, 300.0])
    softmax_scale = None if rng.random() < 0.8 else rng.uniform(0.01, 0.1)
    if schedule == "random":
        schedule = rng.choice(["explicit", "inside"])
    num_sms = None
    if schedule != "inside" and rng.random() < 0.2:
        num_sms = rng.choice([1, 2, 3, 17, 66, 131, 264])
    return Case(index, dtype, tuple(lens), s_q, h_q, h_kv, causal, extra_width, spare_pages,
                q_mult, softmax_scale, schedule, num_sms)


def build_inputs(case: Case, seed: int, device: torch.device, fp8: bool = False):
    pages = [-(-L // PAGE_SIZE) for L in case.lens]
    g = torch.Generator(device=device)
    g.manual_seed(random.Random(f"torch_mla-fuzz-data:{seed}:{case.index}").getrandbits(62))
    inp = make_decode_inputs(list(case.lens), case.s_q, case.h_q, D_QK, DTYPES[case.dtype],
                             device, generator=g, h_kv=case.h_kv,
                             max_blocks=max(1, max(pages)) + case.extra_width,
                             num_blocks=max(1, sum(pages) + case.spare_pages))
    if case.q_mult != 1.0:
        inp.q = (inp.q.float() * case.q_mult).to(inp.q.dtype)
    kv_scale = None
    inp.original = inp.kv_cache
    if fp8:
        cache = inp.kv_cache.float()
        kv_scale = (cache.nan_to_num(0).abs().amax().clamp(min=1e-30) / 448).reshape(1)
        inp.kv_cache = quantize_fp8(cache, kv_scale)
    return inp, kv_scale


def reference_chunked(inp, scale: float, causal: bool, lens: tuple[int, ...], kv_scale=None):
    """mla_decode_reference, REF_CHUNK requests per call, each call's table cut to its longest
    request (the reference gathers the table's whole width)."""
    outs, lses = [], []
    for start in range(0, len(lens), REF_CHUNK):
        stop = min(len(lens), start + REF_CHUNK)
        width = max(1, -(-max(lens[start:stop]) // PAGE_SIZE))
        o, lse = mla_decode_reference(inp.q[start:stop], inp.kv_cache,
                                      inp.block_table[start:stop, :width].contiguous(),
                                      inp.cache_seqlens[start:stop], scale, causal, D_V,
                                      kv_scale=kv_scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def compare(out, lse, ref_out, ref_lse, dtype) -> dict:
    """Errors of (out, lse) against the reference; one host read."""
    atol, rtol = DECODE_TOL[dtype]
    o, r = out.float(), ref_out.float()
    err = (o - r).abs()
    empty = torch.isposinf(ref_lse).transpose(1, 2)[..., None]  # [b, s_q, h_q, 1]
    fin = torch.isfinite(ref_lse)
    lse_err = torch.where(fin, (lse.double() - ref_lse.double()).abs(), 0.0)
    lse_tol = LSE_TOL[0] + LSE_TOL[1] * torch.where(fin, ref_lse.double().abs(), 0.0)
    stats = torch.stack([
        err.max().double(),
        err.max().double() / r.abs().max().double().clamp(min=1e-30),
        (err / (atol + rtol * r.abs())).max().double(),
        lse_err.max(),
        (lse_err / lse_tol).max(),
        (out.isnan().any() | lse.isnan().any()).double(),
        ((o != 0) & empty).any().double(),
        (torch.isposinf(lse) != torch.isposinf(ref_lse)).any().double(),
    ]).tolist()
    keys = ("out_abs", "out_rel", "out_tol", "lse_abs", "lse_tol", "nan", "empty_nonzero",
            "inf_mismatch")
    return dict(zip(keys, stats))


def compare_fast(out, lse, ref_out, ref_lse, orig_out, q, cache, kv_scale, scale) -> dict:
    """Fast mode's errors (module docstring): out_tol = |out - ref| / |ref| over 2.5 e_store,
    lse_tol = the largest |lse - ref_lse| over 1e-3 + 2^-4 |q_row| max|k| scale."""
    def rel(a, b):
        return (a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)

    e_store = rel(ref_out, orig_out)
    if ref_out.double().norm() == 0:
        out_tol = torch.where(out.double().norm() == 0, 0.0, math.inf)
    else:
        out_tol = rel(out, ref_out) / (2.5 * e_store).clamp(min=1e-30)
    k_max = dequantize_fp8(cache, kv_scale).double().nan_to_num(0).norm(dim=-1).amax()
    bound = 2.0**-4 * q.double().norm(dim=-1).transpose(1, 2) * k_max * scale
    fin = torch.isfinite(ref_lse)
    lse_err = torch.where(fin, (lse.double() - ref_lse.double()).abs(), 0.0)
    empty = torch.isposinf(ref_lse).transpose(1, 2)[..., None]
    stats = torch.stack([
        (out.double() - ref_out.double()).abs().max(), rel(out, ref_out), out_tol.double(),
        lse_err.max(), (lse_err / (1e-3 + bound)).max(),
        (out.isnan().any() | lse.isnan().any()).double(),
        ((out != 0) & empty).any().double(),
        (torch.isposinf(lse) != torch.isposinf(ref_lse)).any().double(),
    ]).tolist()
    keys = ("out_abs", "out_rel", "out_tol", "lse_abs", "lse_tol", "nan", "empty_nonzero",
            "inf_mismatch")
    return dict(zip(keys, stats))


def passed(m: dict) -> bool:
    # Written so that a NaN error fails.
    return (m["out_tol"] <= 1 and m["lse_tol"] <= 1 and not m["nan"] and not m["empty_nonzero"]
            and not m["inf_mismatch"])


def run_case(case: Case, seed: int, device: torch.device,
             fp8: bool = False, fast: bool = False) -> tuple[bool, str, dict]:
    """Runs one case: (passed, its errors as text, the largest of each error); fp8: over an e4m3
    cache (build_inputs); fast: in fast mode (module docstring), q without its multiplier."""
    if fast:
        fp8 = True
        case = dataclasses.replace(case, q_mult=1.0)
    inp, kv_scale = build_inputs(case, seed, device, fp8)
    scale = case.softmax_scale if case.softmax_scale is not None else D_QK**-0.5
    args = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens)
    scheds = {}
    if case.schedule in ("explicit", "both"):
        scheds["explicit"] = torch_mla.get_decode_schedule(inp.cache_seqlens, case.s_q, case.h_q,
                                                           num_sms=case.num_sms)
    if case.schedule in ("inside", "both"):
        scheds["inside"] = None
    results = {name: torch_mla.mla_decode(*args, sched, softmax_scale=scale, causal=case.causal,
                                          d_v=D_V, kv_scale=kv_scale,
                                          compute="fp8" if fast else "exact")
               for name, sched in scheds.items()}
    if device.type == "cpu":
        cache = inp.kv_cache if kv_scale is None else dequantize_fp8(inp.kv_cache, kv_scale)
        ref_out, ref_lse = mla_decode_fp64(inp.q, cache, inp.block_table, inp.cache_seqlens,
                                           scale, case.causal, D_V)
    else:
        ref_out, ref_lse = reference_chunked(inp, scale, case.causal, case.lens, kv_scale)
    dtype = DTYPES[case.dtype]
    ok, parts, worst = True, [], {}
    if device.type == "cuda" and not runs_kernel(inp.q, inp.kv_cache, D_V):
        parts.append("path=reference")  # on the GPU: the reference checked against itself
    if fast:
        orig = dataclasses.replace(inp, kv_cache=inp.original)  # (the latents before e4m3)
        if device.type == "cpu":
            orig_out, _ = mla_decode_fp64(inp.q, inp.original, inp.block_table,
                                          inp.cache_seqlens, scale, case.causal, D_V)
        else:
            orig_out, _ = reference_chunked(orig, scale, case.causal, case.lens)
    for name, (out, lse) in results.items():
        if fast:
            m = compare_fast(out, lse, ref_out, ref_lse, orig_out, inp.q, inp.kv_cache,
                             kv_scale, scale)
        else:
            m = compare(out, lse, ref_out, ref_lse, dtype)
        ok &= passed(m)
        for key in ("out_tol", "lse_tol"):
            worst[key] = max(worst.get(key, 0.0), m[key], key=lambda v: (v != v, v))
        tag = f"{name}:" if len(results) > 1 else ""
        parts.append(f"{tag}out_abs={m['out_abs']:.2e} out_rel={m['out_rel']:.2e} "
                     f"out_tol={m['out_tol']:.3f} lse_abs={m['lse_abs']:.2e} "
                     f"lse_tol={m['lse_tol']:.3f}"
                     + "".join(f" {k}" for k in ("nan", "empty_nonzero", "inf_mismatch") if m[k]))
    if len(results) == 2 and case.num_sms is None:
        (o1, l1), (o2, l2) = results.values()
        if not (torch.equal(o1, o2) and torch.equal(l1, l2)):
            ok = False
            parts.append("explicit/inside differ")
    return ok, " ".join(parts), worst


def kernel_path(device: torch.device) -> bool:
    q = torch.empty(1, 1, 1, D_QK, dtype=torch.bfloat16, device=device)
    kv = torch.empty(1, PAGE_SIZE, 1, D_QK, dtype=torch.bfloat16, device=device)
    return runs_kernel(q, kv, D_V)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", type=int, nargs="+", metavar="K", help="run only these cases")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--small", action="store_true",
                   help="short lengths and small batches (for compute-sanitizer)")
    p.add_argument("--max-b", type=int)
    p.add_argument("--max-len", type=int)
    p.add_argument("--max-tokens", type=int,
                   help="cap on cached latent rows per case (sum of padded lengths x h_kv)")
    p.add_argument("--max-h-kv", type=int, default=1)
    p.add_argument("--schedule", choices=["random", "explicit", "inside", "both"],
                   default="random",
                   help="pass the schedule in, let mla_decode compute it, or a random one of "
                        "these per case; 'both' runs each case both ways (and compares them)")
    p.add_argument("--fp8", action="store_true",
                   help="over a float8_e4m3fn cache with kv_scale (exact mode)")
    p.add_argument("--fast", action="store_true",
                   help="over a float8_e4m3fn cache in fast mode (compute='fp8'), fast mode's "
                        "bounds")
    p.add_argument("--log", help="write one line per case and the summary here")
    args = p.parse_args(argv)
    defaults = LIMITS["small" if args.small else args.device]
    for name, d in zip(("max_b", "max_len", "max_tokens"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, d)
    if args.max_len < 1 or args.max_b < 1 or args.max_tokens < PAGE_SIZE * args.max_h_kv:
        p.error("--max-b and --max-len must be >= 1, --max-tokens >= 64 x --max-h-kv")
    if not 1 <= args.max_h_kv <= 8:
        p.error("--max-h-kv must be in 1..8")
    return args


def repro(args, index: int) -> str:
    return shlex.join([
        "python", "-m", "tools.fuzz_decode", "--device", args.device, "--seed", str(args.seed),
        "--max-b", str(args.max_b), "--max-len", str(args.max_len),
        "--max-tokens", str(args.max_tokens), "--max-h-kv", str(args.max_h_kv),
        "--schedule", args.schedule, *(["--fp8"] if args.fp8 else []),
        *(["--fast"] if args.fast else []), "--only", str(index)])


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not kernel_path(device):
        print("fuzz_decode: no decode kernel for this GPU (or TORCH_MLA_FORCE_REFERENCE=1): "
              "mla_decode would be checked against itself", file=sys.stderr)
        return 2
    indices = args.only if args.only is not None else range(args.cases)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"fuzz_decode: {len(indices)} cases on {where}, seed {args.seed}, max_b {args.max_b}, "
          f"max_len {args.max_len}, max_tokens {args.max_tokens}, max_h_kv {args.max_h_kv}"
          + (", e4m3 cache" if args.fp8 else "") + (", fast mode" if args.fast else ""),
          file=sys.stderr, flush=True)
    log = open(args.log, "w") if args.log else None
    t0 = time.time()
    n_pass = n_fail = on_reference = 0
    worst = {"out_tol": (0.0, -1), "lse_tol": (0.0, -1)}  # (value, case)
    try:
        for done, k in enumerate(indices, 1):
            case = draw_case(args.seed, k, args.max_b, args.max_len, args.max_tokens,
                             args.max_h_kv, args.schedule)
            t = time.time()
            lost = False
            try:
                ok, detail, errs = run_case(case, args.seed, device, args.fp8, args.fast)
            except Exception as e:  # a failed case, reported like any other
                ok, detail, errs = False, f"error={type(e).__name__}: {str(e).splitlines()[0]}", {}
                # After an illegal access the CUDA context is unusable: later cases would fail too.
                lost = device.type == "cuda" and "CUDA error" in str(e)
            for key, v in errs.items():
                if not v <= worst[key][0]:  # NaN counts as the worst
                    worst[key] = (v, k)
            line = (f"case {k} {'PASS' if ok else 'FAIL'} {case.describe()} {detail} "
                    f"ms={1000 * (time.time() - t):.0f}")
            n_pass += ok
            n_fail += not ok
            on_reference += "path=reference" in detail
            if log:
                print(line, file=log, flush=True)
            if not ok:
                print(line, flush=True)
                print(f"  repro: {repro(args, k)}", flush=True)
            if done % 100 == 0:
                print(f"fuzz_decode: {done} cases, {n_fail} failed, {time.time() - t0:.0f} s",
                      file=sys.stderr, flush=True)
            if lost:
                print("fuzz_decode: stopping, the CUDA context is lost", flush=True)
                break
        summary = (f"summary: cases={n_pass + n_fail} passed={n_pass} failed={n_fail} "
                   f"worst out_tol={worst['out_tol'][0]:.3f} (case {worst['out_tol'][1]}) "
                   f"lse_tol={worst['lse_tol'][0]:.3f} (case {worst['lse_tol'][1]}) "
                   f"seed={args.seed} seconds={time.time() - t0:.1f}"
                   + (f" on_reference_path={on_reference}" if on_reference else ""))
        print(summary, flush=True)
        if log:
            print(summary, file=log, flush=True)
    finally:
        if log:
            log.close()
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
