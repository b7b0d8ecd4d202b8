"""The SM90 kernel over a float8_e4m3fn cache (issue 13), exact mode and fast mode
(compute="fp8"), on this GPU: exact conversion, correctness grid with e_store, then speed
against bf16 and FlashMLA.

    python -m tools.check_fp8 --quick     # trimmed grid + benchmarks' QUICK rows (~3 min)
    python -m tools.check_fp8             # full grid + every anchor row
    python -m tools.check_fp8 --no-bench / --no-grid / --compute exact|fp8 (default both)

(0) Conversion: testing.make_fp8_code_case (every e4m3 code but NaN, at every row and column
position, one-hot softmax) with q bf16, fp16 and e4m3 + q_scale: the output must equal V *
kv_scale bit for bit (fast mode too: its one-hot P is exact in e4m3 and so is Q's per-row
quantization of these rows).
(1) Grid: tools/check_portable.py's cases (heads x tokens, s_q 8, varlen, page edges, fp16,
long context, h_kv 4) on randn / 10, randn and 2 randn data (q and latents), poisoned as in the
tests, the cache quantized per tensor (kv_scale = amax / 448); the kernel against the fp32
reference over the same dequantized cache, within the bf16 kernel's tolerances (atol scaled
with the data). Per group: passed / run, worst error / tolerance, worst lse error / tolerance,
and e_store (exact attention over the dequantized cache vs over the original 16-bit latents,
relative norm error; worst per group and data scale). Plus an e4m3 q and a CUDA-graph replay.
Fast mode's bar instead: out error (relative norm, vs the same reference) <= 2.5 x the case's
e_store; lse within 1e-3 + 2^-4 |q| max|k| softmax_scale of the reference (what e4m3 rounding
of Q can move a score by); its table adds what that rounding of Q alone costs the output (the
reference with Q rounded as the kernel rounds it) beside the kernel's total.
(2) Speed: anchor rows, one call captured in a CUDA graph and replayed (bench_decode's
timing): torch_mla fp8, torch_mla bf16, FlashMLA bf16 (when ``flash_mla`` imports), same
process; ratio = fp8 / bf16 against the issue's bars (<= 0.55 for b128 s_k 8192 h_q 16/32/64,
both modes; h_q 128 rows <= 1.1 exact, <= 0.65 fast).
Exit 1 when a grid case fails or a bar is missed (the last lines say which).
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import time

import torch

import torch_mla
from tools.check_portable import grid
from torch_mla.reference import dequantize_fp8, mla_decode_reference, quantize_fp8
from torch_mla.testing import (
    ANCHORS,
    QUICK_ANCHORS,
    capture_graph,
    decode_errors,
    flash_mla_decode,
    graph_time_us,
    load_flash_mla,
    make_anchor_inputs,
    make_decode_inputs,
    make_fp8_code_case,
    quantize_per_tensor,
)

FP8 = torch.float8_e4m3fn
MULTS = {"randn/10": 1.0, "randn": 10.0, "2 randn": 20.0}  # make_decode_inputs draws randn/10
BARS = {(128, 1, 8192, 16): 0.55, (128, 1, 8192, 32): 0.55, (128, 1, 8192, 64): 0.55}
H128_BAR = {"exact": 1.1, "fp8": 0.65}
MODES = ("exact", "fp8")


def quantize_q_rows(q: torch.Tensor) -> torch.Tensor:
    """q rounded as fast mode's kernel rounds it: each row (576 values) scaled by 448 / amax,
    to e4m3 (nearest, saturating), and back (float32)."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    s = amax / 448
    return (qf / torch.where(amax > 0, s, 1)).clamp(-448, 448).to(FP8).float() * s


def precompile_in_parallel() -> None:
    """Compiles the decode steps this script runs into the disk cache, one process per
    (kernel, dtype, causal) of ``python -m torch_mla.precompile`` (a variant compiles for ~20-30
    s; this process then loads them)."""
    procs = [subprocess.Popen([sys.executable, "-m", "torch_mla.precompile", "--arch", "sm_90a",
                               "--kernels", kernel, "--dtypes", dtype, "--causal", causal])
             for kernel in ("step", "fp8_step", "fp8_fast") for dtype in ("bf16", "fp16")
             for causal in ("false", "true")]
    for p in procs:
        p.wait()


def check_codes(modes) -> int:
    print("\n## (0) e4m3 -> 16-bit conversion, every finite code (bit-exact output)")
    failed = 0
    for mode in modes:
        for q_dtype in (torch.bfloat16, torch.float16, FP8):
            c = make_fp8_code_case(q_dtype, "cuda")
            out, lse = torch_mla.mla_decode(c.q, c.kv_cache, c.block_table, c.cache_seqlens,
                                            softmax_scale=1.0, kv_scale=c.kv_scale,
                                            q_scale=c.q_scale, compute=mode)
            wrong = int((out.float() != c.out).sum())
            lse_err = (lse - c.lse).abs().max().item()
            ok = wrong == 0 and lse_err < (1e-3 if mode == "exact" else 1e-6 * abs(c.lse))
            failed += not ok
            print(f"{mode} q {str(q_dtype)[6:]}: {'ok' if ok else 'FAIL'} ({wrong} of "
                  f"{out.numel()} values differ, lse err {lse_err:.2g})", flush=True)
    return failed


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_case(lens, s_q, h_q, causal, dtype, scale, h_kv, mult, q_fp8=False, mode="exact"):
    """(out err / tol, lse err / tol, NaN?, e_store, (fast mode) Q-rounding error, out rel
    error) of one fp8 case."""
    inp = make_decode_inputs(lens, s_q, h_q, dtype=torch.float32, device="cuda", h_kv=h_kv)
    q = (inp.q * mult).to(dtype)
    latents = (inp.kv_cache * mult).to(dtype)  # the "original" 16-bit latents
    kv_scale = (latents.float().nan_to_num(0).abs().amax() / 448).reshape(1)
    cache = quantize_fp8(latents, kv_scale)
    q_scale = None
    if q_fp8:
        q_scale = (q.float().abs().amax() / 448).reshape(1)
        q = quantize_fp8(q, q_scale)
    scale = scale or 576**-0.5
    args = (inp.block_table, inp.cache_seqlens)
    out, lse = torch_mla.mla_decode(q, cache, *args, softmax_scale=scale, causal=causal,
                                    kv_scale=kv_scale, q_scale=q_scale, compute=mode)
    ref_out, ref_lse = mla_decode_reference(q, cache, *args, scale, causal, 512,
                                            kv_scale=kv_scale, q_scale=q_scale)
    q16 = q.float() * q_scale if q_fp8 else q
    orig_out, _ = mla_decode_reference(q16.to(torch.bfloat16) if q_fp8 else q16, latents, *args,
                                       scale, causal, 512)
    e_store = rel(ref_out, orig_out)
    if mode == "exact":
        ratio, lse_ratio, nan = decode_errors(out.float() / mult, lse, ref_out.float() / mult,
                                              ref_lse, torch.bfloat16 if q_fp8 else dtype)
        return ratio, lse_ratio, nan, e_store, float("nan"), rel(out, ref_out)
    # Fast mode: relative to what storing in e4m3 already costs (rows that see no key: 0).
    e_out = rel(out, ref_out)
    q_rows = q if q_fp8 else quantize_q_rows(q)
    qref, _ = mla_decode_reference(q_rows.to(torch.float32) if not q_fp8 else q, cache, *args,
                                   scale, causal, 512, kv_scale=kv_scale, q_scale=q_scale)
    e_q = rel(qref, ref_out)
    # lse: e4m3 rounding of Q moves every score by at most 2^-4 |q| |k| softmax_scale
    # (Cauchy-Schwarz, relative rounding error <= 2^-4), and so lse; the fp8 MMAs' truncated
    # accumulation (~14 bits) stays well inside that. Per row, against the largest |k| cached.
    k_norm = dequantize_fp8(cache, kv_scale).float().nan_to_num(0).norm(dim=-1).amax()
    bound = 2.0**-4 * q.float().norm(dim=-1).transpose(1, 2) * k_norm * scale  # [b, h_q, s_q]
    if q_fp8:
        bound = bound * q_scale
    fin = torch.isfinite(ref_lse)
    lse_err = (lse[fin] - ref_lse[fin]).abs() / (1e-3 + bound[fin])
    lse_ratio = lse_err.max().item() if lse_err.numel() else 0.0
    lse_ratio = max(lse_ratio, float((lse[~fin] != ref_lse[~fin]).any()) * 2)
    nan = bool(out.isnan().any())
    ratio = e_out / (2.5 * e_store) if e_store > 0 else (0.0 if e_out == 0 else float("inf"))
    return ratio, lse_ratio, nan, e_store, e_q, e_out


def graph_case(mode="exact"):
    """schedule + decode over an fp8 cache captured once, replayed on three new inputs (new
    lengths, pages, queries and kv_scale): (worst err / tol, worst lse err / tol, NaN?). Fast
    mode: its out must also equal the eager call's bit for bit, and stay within 2.5 e_store
    of the reference (here randn / 10 data: e_store >= 1e-2, so err / tol uses 2.5e-2)."""
    steps = []
    for lens in ([70, 3, 300], [129, 64, 0], [5, 250, 190]):
        inp = make_decode_inputs(lens, 2, 64, device="cuda", max_blocks=6, num_blocks=14)
        kv_scale = (inp.kv_cache.float().nan_to_num(0).abs().amax() / 448).reshape(1)
        steps.append([inp.q, quantize_fp8(inp.kv_cache, kv_scale), inp.block_table,
                      inp.cache_seqlens, kv_scale])
    static = [t.clone() for t in steps[0]]

    def step(q, cache, table, lens, kv_scale):
        sched = torch_mla.get_decode_schedule(lens, 2, 64)
        return torch_mla.mla_decode(q, cache, table, lens, sched, causal=True, kv_scale=kv_scale,
                                    compute=mode)

    torch_mla.set_value_checks(False)
    try:
        g, (out, lse) = capture_graph(step, static)
        worst = (0.0, 0.0, False)
        for inputs in steps:
            for dst, src in zip(static, inputs):
                dst.copy_(src)
            g.replay()
            torch.cuda.synchronize()
            ref = mla_decode_reference(*static[:4], 576**-0.5, True, 512, kv_scale=static[4])
            if mode == "exact":
                e = decode_errors(out, lse, *ref, torch.bfloat16)
            else:
                eager, _ = step(*static)
                fin = torch.isfinite(ref[1])
                e = (rel(out, ref[0]) / 2.5e-2 + float(not torch.equal(out, eager)) * 10,
                     ((lse - ref[1])[fin].abs().max().item() / 0.05), bool(out.isnan().any()))
            worst = (max(worst[0], e[0]), max(worst[1], e[1]), worst[2] or e[2])
        return worst
    finally:
        torch_mla.set_value_checks(True)


def check_grid(quick: bool, modes) -> int:
    return sum(check_grid_mode(quick, mode) for mode in modes)


def check_grid_mode(quick: bool, mode: str) -> int:
    print(f"\n## (1) correctness grid, {mode} mode: fp8 cache vs the fp32 reference over the "
          "dequantized cache" + ("" if mode == "exact" else
                                 " (err / tol: out rel err / (2.5 e_store))"))
    cases = [(g, label, lens, s_q, h_q, causal, dtype, scale, h_kv, m, False)
             for g, label, lens, s_q, h_q, causal, dtype, scale, h_kv in grid(quick)
             for m in MULTS]
    cases += [("e4m3 q", f"s_q=2 h_q=128 causal {m}", [20, 140, 4096, 0], 2, 128, True,
               torch.bfloat16, None, 1, m, True) for m in MULTS]
    cases.append(("graph replay", "s_q=2 h_q=64 causal, 3 replays", None, 2, 64, True,
                  torch.bfloat16, None, 1, "randn/10", False))
    groups: dict[str, list] = {}
    e_store: dict[tuple[str, str], float] = {}
    e_parts: dict[tuple[str, str], tuple] = {}  # fast mode: worst (out err, Q part) / e_store
    failed = 0
    for group, label, lens, s_q, h_q, causal, dtype, scale, h_kv, m, q_fp8 in cases:
        try:
            if lens is None:
                ratio, lse_ratio, nan = graph_case(mode)
                es = e_q = e_out = float("nan")
            else:
                ratio, lse_ratio, nan, es, e_q, e_out = run_case(
                    lens, s_q, h_q, causal, dtype, scale, h_kv, MULTS[m], q_fp8, mode)
            ok = ratio <= 1 and lse_ratio <= 1 and not nan
            why = f"out err/tol {ratio:.3g}, lse err/tol {lse_ratio:.3g}, NaN {nan}"
        except Exception as e:  # a launch or compile error is a failed case, not a crash
            ok, ratio, lse_ratio, es, why = False, float("inf"), float("inf"), float("nan"), \
                repr(e)[:300]
            e_q = e_out = float("nan")
        g = groups.setdefault(group, [0, 0, 0.0, 0.0])
        g[0] += ok
        g[1] += 1
        g[2], g[3] = max(g[2], ratio), max(g[3], lse_ratio)
        if es == es:
            e_store[group, m] = max(e_store.get((group, m), 0.0), es)
            if mode == "fp8" and es > 0:
                old = e_parts.get((group, m), (0.0, 0.0))
                e_parts[group, m] = (max(old[0], e_out / es), max(old[1], e_q / es))
        if not ok:
            failed += 1
            print(f"FAIL {group}: {label} ({m}): {why}", flush=True)
    print("| group | passed | worst out err / tol | worst lse err / tol | "
          + " | ".join(f"e_store {m}" for m in MULTS) + " |"
          + ("" if mode == "exact" else
             " | ".join([""] + [f"err / e_store, Q part {m}" for m in MULTS]) + " |"))
    print("|---|---|---|---|" + "---|" * len(MULTS) * (1 if mode == "exact" else 2))
    for group, (ok, n, r, lr) in groups.items():
        es = " | ".join(f"{e_store.get((group, m), float('nan')):.2e}" for m in MULTS)
        parts = ""
        if mode == "fp8":
            parts = " | ".join([""] + ["{:.2f}, {:.2f}".format(*e_parts.get((group, m), (
                float("nan"), float("nan")))) for m in MULTS]) + " |"
        print(f"| {group} | {ok}/{n} | {r:.3f} | {lr:.3f} | {es} |{parts}")
    total = sum(g[1] for g in groups.values())
    print(f"{total - failed}/{total} passed, {failed} failed", flush=True)
    return failed


def bench_row(cfg, flash_mla, modes):
    """({mode: (fp8 us, relative error vs the reference)}, bf16 us, FlashMLA bf16 us or NaN) of
    an anchor row; the fp8 cache is the bf16 one quantized per tensor."""
    b, s_q, s_k, h_q, causal = cfg
    inp = make_anchor_inputs(b, s_q, h_q, s_k)
    cache8, kv_scale = quantize_per_tensor(inp.kv_cache)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    rest = (inp.block_table, inp.cache_seqlens, sched)
    ref = None
    if b * s_k <= 128 * 8192:
        ref, _ = mla_decode_reference(inp.q, cache8, inp.block_table, inp.cache_seqlens,
                                      576**-0.5, causal, 512, kv_scale=kv_scale)
    res = {}
    for mode in modes:
        fp8 = functools.partial(torch_mla.mla_decode, inp.q, cache8, *rest, causal=causal,
                                kv_scale=kv_scale, compute=mode)
        err = float("nan") if ref is None else rel(fp8()[0], ref)
        res[mode] = (graph_time_us(fp8), err)
    t16 = graph_time_us(functools.partial(torch_mla.mla_decode, inp.q, inp.kv_cache, *rest,
                                          causal=causal))
    tfm = float("nan")
    if flash_mla is not None:
        tfm = graph_time_us(flash_mla_decode(flash_mla, inp, causal))
    return res, t16, tfm


def bench(quick: bool, modes) -> int:
    flash_mla = load_flash_mla()
    print(f"\n## (2) speed, {torch.cuda.get_device_name()}: us per call (decode + combine, CUDA "
          "graph replay); ratio = fp8 / bf16")
    cols = " | ".join(f"fp8 {m} us | {m} / bf16 | bar | {m} rel err" for m in modes)
    print(f"| b | s_q | s_k | h_q | causal | bf16 us | FlashMLA bf16 us | {cols} |")
    print("|---|---|---|---|---|---|---|" + "---|---|---|---|" * len(modes))
    missed = 0
    for cfg in (QUICK_ANCHORS if quick else list(ANCHORS)):
        b, s_q, s_k, h_q, causal = cfg
        res, t16, tfm = bench_row(cfg, flash_mla, modes)
        torch.cuda.empty_cache()  # the next row's cache may be several GB
        cells = []
        for mode in modes:
            t8, err = res[mode]
            bar = BARS.get((b, s_q, s_k, h_q), H128_BAR[mode] if h_q == 128 else None)
            ok = bar is None or t8 / t16 <= bar
            missed += not ok
            cells.append(f"{t8:.1f} | {t8 / t16:.3f} | "
                         f"{'-' if bar is None else f'<= {bar}'}{'' if ok else ' MISSED'} | "
                         f"{err:.1e}")
        print(f"| {b} | {s_q} | {s_k} | {h_q} | {'yes' if causal else 'no'} | {t16:.1f} | "
              f"{tfm:.1f} | {' | '.join(cells)} |", flush=True)
    return missed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="trimmed grid, benchmarks' QUICK rows")
    ap.add_argument("--no-grid", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--compute", choices=("exact", "fp8", "both"), default="both")
    args = ap.parse_args(argv)
    modes = MODES if args.compute == "both" else (args.compute,)
    os.environ.pop("TORCH_MLA_FORCE_REFERENCE", None)
    os.environ.pop("TORCH_MLA_PORTABLE", None)
    print(f"# {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}, "
          f"torch {torch.__version__}")
    t0 = time.time()
    precompile_in_parallel()
    print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    failed = check_codes(modes)
    if not args.no_grid:
        failed += check_grid(args.quick, modes)
    missed = 0 if args.no_bench else bench(args.quick, modes)
    print(f"\n{time.time() - t0:.0f} s; correctness failures: {failed}; speed bars missed: "
          f"{missed}")
    return 1 if failed or missed else 0


if __name__ == "__main__":
    sys.exit(main())
