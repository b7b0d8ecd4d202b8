"""MLA decode benchmark on the workload of shared/anchors/README.md (FlashMLA's decode test).

    python benchmarks/bench_decode.py              # all anchor configurations
    python benchmarks/bench_decode.py --quick      # a few of them
    python benchmarks/bench_decode.py 8,1,4096,128 # chosen ones (b,s_q,s_k,h_q; causal if s_q > 1)
    python benchmarks/bench_decode.py --fp8        # torch_mla over a float8_e4m3fn cache
    python benchmarks/bench_decode.py --keysm ...  # heads-on-M (TORCH_MLA_KEYSM=0), then keys-on-M

Per configuration: the schedule is computed once (as in serving, shared by all layers), one decode
call (split-KV kernel + combine) is captured in a CUDA graph, and the replay is timed with
triton.testing.do_bench(warmup=50, rep=300, return_mode="median"). With mean length Lm:
    FLOP  = b * h_q * s_q * (2 * 576 * Lm + 2 * 512 * Lm)
    bytes = b * (s_q * h_q * 576 * 2 + Lm * 576 * 2 + s_q * h_q * 512 * 2)
Ceilings ("% copy", "% matmul"): this GPU's, measured at the start of the run as
shared/anchors/README.md measured the H200's (a device-to-device copy, bytes read + written; a
bf16 8192^3 matmul: torch_mla.testing.measure_ceilings), printed first; --anchor-ceilings takes
the H200's 4246 GB/s and 679 TFLOP/s instead (tables before session 47). FlashMLA's figures
(deepseek-ai/FlashMLA 9241ae3, measured the same way on the same machine) are built in; FlashMLA
is also timed side by side when `flash_mla` is importable (on the GPU machine: the build of
shared/anchors/flashmla-sm90 on PYTHONPATH; torch_mla.testing.load_flash_mla).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import torch_mla
from torch_mla.constants import KEYSM_FAST_COLUMNS, KEYSM_RS_COLUMNS, PAGE_SIZE
from torch_mla.devtools import breakdown_us
from torch_mla.ops import dispatch
from torch_mla.ops.sparse import sparse_backend
from torch_mla.reference import mla_decode_reference
from torch_mla.testing import (
    ANCHORS,
    QUICK_ANCHORS,
    flash_mla_decode,
    graph_time_us,
    load_flash_mla,
    make_anchor_inputs,
    measure_ceilings,
    parse_config,
    quantize_per_tensor,
)

# The H200's ceilings (shared/anchors/README.md); main() replaces them by this GPU's, measured
# in the same run, unless --anchor-ceilings.
COPY_GBPS = 4246.0
MATMUL_TFLOPS = 679.0

def run_config(b, s_q, s_k, h_q, causal, check: bool, flash_mla=None, fp8: bool = False,
               compute: str = "exact"):
    """fp8: torch_mla runs over the cache quantized to float8_e4m3fn (one scale, amax / 448;
    exact mode, or fast mode with compute="fp8", whose lse is not checked here: its bound is
    tests/test_fp8.py's check_fast_mode), FlashMLA over the bf16 one; bytes count 1 per cache
    element."""
    inp = make_anchor_inputs(b, s_q, h_q, s_k)
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    cache, kw = inp.kv_cache, {}
    if fp8:
        cache, kw["kv_scale"] = quantize_per_tensor(cache)
        kw["compute"] = compute
    args = (inp.q, cache, inp.block_table, inp.cache_seqlens, sched)
    err = float("nan")
    if check:
        out, lse = torch_mla.mla_decode(*args, causal=causal, **kw)
        ref, ref_lse = mla_decode_reference(inp.q, cache, inp.block_table, inp.cache_seqlens,
                                            576**-0.5, causal, 512, kv_scale=kw.get("kv_scale"))
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        if compute == "exact":
            assert torch.allclose(lse, ref_lse, atol=1e-3, rtol=1e-4), "lse mismatch"
    us = graph_time_us(lambda: torch_mla.mla_decode(*args, causal=causal, **kw))
    fm_us = float("nan")
    if flash_mla is not None:
        fm_us = graph_time_us(flash_mla_decode(flash_mla, inp, causal))
    lm = inp.cache_seqlens.float().mean().item()
    flop = b * h_q * s_q * (2 * 576 * lm + 2 * 512 * lm)
    nbytes = b * (s_q * h_q * 576 * 2 + lm * 576 * (1 if fp8 else 2) + s_q * h_q * 512 * 2)
    return us, flop / us / 1e6, nbytes / us / 1e3, err, fm_us


# Sparse decode (DeepSeek-V3.2 shapes: topk 2048 of s_k 32768): (b, s_q, h_q).
SPARSE_CONFIGS = [(b, s_q, h) for h in (128, 64, 32, 16) for s_q in (1, 2) for b in (2, 32, 128)]


def _sparse_problem(b, s_q, h_q, topk, s_k):
    """A sparse decode problem on the GPU: the latents of b requests of s_k tokens ((kv_c,
    k_pe), random), indices naming topk distinct random slots of each request per query token,
    q (b, s_q, h_q, 576) and the schedule."""
    tokens = (torch.randn(b * s_k, 512, device="cuda").bfloat16(),
              torch.randn(b * s_k, 64, device="cuda").bfloat16())
    pick = torch.rand(b, s_q, s_k, device="cuda").argsort(-1)[..., :topk].int()
    idx = (pick + torch.arange(b, device="cuda").int()[:, None, None] * s_k).contiguous()
    q = torch.randn(b, s_q, h_q, 576, device="cuda").bfloat16()
    return tokens, idx, q, torch_mla.get_sparse_decode_schedule(idx, h_q)


def _sparse_cache(n: int, dtype, width: int, tokens, kv_scale=None):
    """A paged cache of rows `width` wide in dtype holding the n tokens (kv_c, k_pe) at slots
    0..n-1, written by torch_mla.append_kv (kv_scale: a float8_e4m3fn cache's)."""
    cache = torch.empty(n // PAGE_SIZE, PAGE_SIZE, 1, width, dtype=dtype, device="cuda")
    torch_mla.append_kv(cache, *tokens, torch.arange(n, dtype=torch.int32, device="cuda"),
                        kv_scale=kv_scale)
    return cache


def run_sparse(b, s_q, h_q, topk=2048, s_k=32768, flash_mla=None):
    """(us, TFLOP/s, GB/s, FlashMLA us or nan, ours over the 656-byte cache: us, GB/s, or nan,
    the kernel that ran over the bf16 cache) of mla_decode_sparse over a bf16 cache, b
    requests of s_k tokens, topk distinct random slots of each request per query token; over
    the same tokens in the 656-byte FP8 layout on the kernel the dispatch picks (keys-on-M at
    h_q <= 32, SM90 where it pays, else portable; never the reference, far too slow here).
    FlashMLA runs its sparse decode over the 656-byte cache (its only sparse format), at h_q 64
    or 128 (it takes no other)."""
    tokens, idx, q, sched = _sparse_problem(b, s_q, h_q, topk, s_k)
    cache = _sparse_cache(b * s_k, torch.bfloat16, 576, tokens)
    us = graph_time_us(lambda: torch_mla.mla_decode_sparse(q, cache, idx, schedule=sched))
    cache8 = _sparse_cache(b * s_k, torch.uint8, 656, tokens)
    us8 = float("nan")
    if sparse_backend(q, cache8, 512)[0] != "reference":
        us8 = graph_time_us(lambda: torch_mla.mla_decode_sparse(q, cache8, idx, schedule=sched))
    fm_us = float("nan")
    if flash_mla is not None and h_q in (64, 128) and hasattr(flash_mla, "flash_mla_with_kvcache"):
        try:
            fm_us = _flash_mla_sparse_us(flash_mla, q, cache8, idx)
        except RuntimeError as e:  # (reported, not fatal: the row keeps ours)
            print(f"# FlashMLA sparse failed: {e}")
    flop = b * s_q * h_q * topk * 2 * (576 + 512)
    # per query token: topk rows (1152 bytes in bf16, 656 in the FP8 layout) and their 4-byte
    # entries, q and out
    rest = b * s_q * (topk * 4 + h_q * (576 + 512) * 2)
    nbytes, nbytes8 = b * s_q * topk * 576 * 2 + rest, b * s_q * topk * 656 + rest
    return (us, flop / us / 1e6, nbytes / us / 1e3, fm_us, us8, nbytes8 / us8 / 1e3,
            sparse_backend(q, cache, 512)[0])


def main_sparse(flash_mla) -> None:
    # The kernel mla_decode_sparse picks over the bf16 cache depends on the shape (the column
    # "kernel"; on an H200 TORCH_MLA_SPARSE_SM90=1 / =0: the SM90 / portable one for every
    # shape the keys-on-M kernel does not take, TORCH_MLA_SPARSE_KEYSM=0: it takes none).
    q = torch.empty(1, 1, 64, 576, dtype=torch.bfloat16, device="cuda")
    kernel8, why8 = sparse_backend(q, torch.empty(1, PAGE_SIZE, 1, 656, dtype=torch.uint8,
                                                  device="cuda"), 512)
    print(f"# over the 656-byte cache: {kernel8}{' (' + why8 + '; not timed)' if why8 else ''}")
    print("| b | s_q | h_q | topk | kernel | us | TFLOP/s | GB/s | % matmul | % copy | FlashMLA "
          "fp8 us (same run) | FlashMLA / ours | ours 656 B us | 656 B GB/s | FlashMLA / ours "
          "656 B |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b, s_q, h_q in SPARSE_CONFIGS:
        us, tflops, gbps, fm_us, us8, gbps8, kernel = run_sparse(b, s_q, h_q,
                                                                 flash_mla=flash_mla)
        print(f"| {b} | {s_q} | {h_q} | 2048 | {kernel} | {us:.1f} | {tflops:.0f} | {gbps:.0f} | "
              f"{100 * tflops / MATMUL_TFLOPS:.0f} | {100 * gbps / COPY_GBPS:.0f} | "
              f"{fm_us:.1f} | {fm_us / us:.3f} | {us8:.1f} | {gbps8:.0f} | {fm_us / us8:.3f} |")
        sys.stdout.flush()


def sparse_floors_pct(b, s_q, h_q, us, row_bytes, topk=2048) -> tuple[float, float]:
    """(% of the copy ceiling, % of the matmul ceiling) that a sparse decode of us microseconds
    reaches: bytes = the topk rows of row_bytes (1152 bf16, 656 the FP8 layout) a query token,
    their 4-byte entries, q and out; FLOP = 2 (576 + 512) a head, key and token."""
    nbytes = b * s_q * (topk * (row_bytes + 4) + h_q * (576 + 512) * 2)
    flop = b * s_q * h_q * topk * 2 * (576 + 512)
    return 100 * nbytes / us / 1e3 / COPY_GBPS, 100 * flop / us / 1e6 / MATMUL_TFLOPS


def _sparse_us(q, cache, idx, sched, kv_scale) -> float:
    """mla_decode_sparse's time (us, CUDA-graph replay) on the kernel the dispatch picks now."""
    return graph_time_us(lambda: torch_mla.mla_decode_sparse(q, cache, idx, schedule=sched,
                                                             kv_scale=kv_scale))


def flash_mla_sparse_call(flash_mla, q, rows, idx):
    """A call of FlashMLA's sparse decode over the 656-byte rows `rows` (its metadata made
    once, here)."""
    meta = flash_mla.get_mla_metadata()[0]
    return lambda: flash_mla.flash_mla_with_kvcache(
        q, rows.view(torch.float8_e4m3fn), None, None, 512, meta, None, 576 ** -0.5, False,
        True, idx)


def _flash_mla_sparse_us(flash_mla, q, rows, idx) -> float:
    """FlashMLA's sparse decode over the 656-byte rows `rows` (us, CUDA-graph replay)."""
    return graph_time_us(flash_mla_sparse_call(flash_mla, q, rows, idx))


# The sparse kernels, by the environment that makes mla_decode_sparse run each for every shape
# it takes (ops.sparse.sparse_backend).
SPARSE_KERNEL_ENV = {"sm90": {"TORCH_MLA_SPARSE_SM90": "1", "TORCH_MLA_SPARSE_KEYSM": "0"},
                     "sm80": {"TORCH_MLA_SPARSE_SM90": "0", "TORCH_MLA_SPARSE_KEYSM": "0"},
                     "sm90_keysm": {"TORCH_MLA_SPARSE_KEYSM": None}}


def _set_env(values: dict) -> None:
    """os.environ[k] = v for each item (None: k unset)."""
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _column(kernel: str) -> str:
    """The SPARSE_KERNEL_ENV column a kernel the dispatch took is timed in: a variant that a
    developer flag puts in its kernel's place (sm90_keysm_rs, sm90_producer, sm90_split) in that
    kernel's."""
    return {"sm90_keysm_rs": "sm90_keysm", "sm90_producer": "sm90",
            "sm90_split": "sm90"}.get(kernel, kernel)


def main_sparse_kernels(flash_mla, heads=None, batches=None) -> None:
    """The sparse kernels over the three cache formats in one process (each made to run by
    SPARSE_KERNEL_ENV around its calls; the keys-on-M one where it takes the shape: h_q <= 32),
    beside FlashMLA's sparse decode: the table of docs/kernels/sparse.md "Kernel choice".
    heads, batches: only these h_q, b. With TORCH_MLA_SPARSE_KEYSM_RS=1 (or 32) the keys-on-M
    column runs its ping-pong variant where that takes the shape (the FP8 caches, every h_q);
    with TORCH_MLA_SPARSE_PRODUCER=1 the SM90 column runs its producer-warpgroup variant, with
    =split its split variant; at 64-128 heads over the 16-bit cache and the 656-byte rows the
    split by default (the dispatch's choice there; =0: the SM90 kernel itself)."""
    print("| b | s_q | h_q | default kernel (bf16, fp8) | bf16 SM90 us | bf16 portable us | "
          "bf16 keys-on-M us | e4m3 SM90 us | e4m3 portable us | e4m3 keys-on-M us | "
          "656 B SM90 us | 656 B portable us | 656 B keys-on-M us | default bf16: % copy, "
          "% matmul | default 656 B: % copy, % matmul | FlashMLA 656 B us (same run; at h_q "
          "64 where h_q < 64) | FlashMLA / ours 656 B (default) | "
          "FlashMLA / ours bf16 (default) |")
    print("|" + "---|" * 18)
    saved = {k: os.environ.get(k) for k in ("TORCH_MLA_SPARSE_SM90", "TORCH_MLA_SPARSE_KEYSM")}
    for b, s_q, h_q in SPARSE_CONFIGS:
        if (heads and h_q not in heads) or (batches and b not in batches):
            continue
        s_k, topk = 32768, 2048
        tokens, idx, q, sched = _sparse_problem(b, s_q, h_q, topk, s_k)
        kv_scale = (torch.cat(tokens, 1).float().abs().amax() / 448).reshape(1)
        caches = {name: _sparse_cache(b * s_k, dt, width, tokens,
                                      kv_scale if name == "e4m3" else None)
                  for name, dt, width in (("bf16", torch.bfloat16, 576),
                                          ("e4m3", torch.float8_e4m3fn, 576),
                                          ("656", torch.uint8, 656))}
        # (the kernel columns: the ping-pong variant, under its flag, in the keys-on-M one)
        default = _column(sparse_backend(q, caches["bf16"], 512)[0])
        default8 = _column(sparse_backend(q, caches["656"], 512)[0])
        us = {}
        for name, cache in caches.items():
            scale = kv_scale if name == "e4m3" else None
            for kernel, env in SPARSE_KERNEL_ENV.items():
                _set_env(env)
                us[name, kernel] = float("nan")
                taken = sparse_backend(q, cache, 512)[0]
                if _column(taken) == kernel:
                    us[name, kernel] = _sparse_us(q, cache, idx, sched, scale)
                _set_env(saved)
        fm_us = float("nan")
        if flash_mla is not None:
            # FlashMLA takes 64 or 128 heads: below 64, its time at 64 (what a shard of fewer
            # heads would pay, padded), over the same rows and indices.
            fm_q = q if h_q in (64, 128) else torch.randn(b, s_q, 64, 576, device="cuda").to(
                q.dtype)
            try:
                fm_us = _flash_mla_sparse_us(flash_mla, fm_q, caches["656"], idx)
            except RuntimeError as e:  # (reported, not fatal: the row keeps ours)
                print(f"# FlashMLA sparse failed: {e}")
        floors = [sparse_floors_pct(b, s_q, h_q, us[n, k], w)
                  for n, k, w in (("bf16", default, 1152), ("656", default8, 656))]
        print(f"| {b} | {s_q} | {h_q} | {default}, {default8} | "
              + " | ".join(f"{us[n, k]:.1f}" for n in caches for k in SPARSE_KERNEL_ENV)
              + "".join(f" | {c:.0f}, {m:.0f}" for c, m in floors) + f" | {fm_us:.1f} | "
              f"{fm_us / us['656', default8]:.3f} | {fm_us / us['bf16', default]:.3f} |")
        sys.stdout.flush()


def fast_lines(cfg, check, us, k_us, rs_rows):
    """--fast: fast mode on the heads-on-M kernel, then (where it takes the shape) the keys-on-M
    fast variant, each against the exact rows' times (us: heads-on-M, k_us: keys-on-M)."""
    os.environ["TORCH_MLA_KEYSM"] = "0"
    f_us = float("nan")
    try:
        f_us, _, f_gbps, f_err, _ = run_config(*cfg, check=check, fp8=True, compute="fp8")
        print(f"|   | fast heads-on-M {f_us:.1f} us, {f_gbps:.0f} GB/s "
              f"({100 * f_gbps / COPY_GBPS:.0f} % copy), {f_us / us:.3f} x the row above, "
              f"rel err {f_err:.1e} |")
    except AssertionError as e:
        print(f"|   | fast heads-on-M: {e} |")
    os.environ["TORCH_MLA_KEYSM"] = "128"
    if rs_rows:
        os.environ["TORCH_MLA_KEYSM_FAST"] = "1"
        try:
            r_us, _, r_gbps, r_err, _ = run_config(*cfg, check=check, fp8=True, compute="fp8")
            print(f"|   | fast keys-on-M {r_us:.1f} us, {r_gbps:.0f} GB/s "
                  f"({100 * r_gbps / COPY_GBPS:.0f} % copy), {r_us / us:.3f} x the row above, "
                  f"{r_us / k_us:.3f} x keys-on-M, {r_us / f_us:.3f} x fast heads-on-M, "
                  f"rel err {r_err:.1e} |")
        except AssertionError as e:
            print(f"|   | fast keys-on-M: {e} |")
        finally:
            os.environ.pop("TORCH_MLA_KEYSM_FAST")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only a few configurations")
    ap.add_argument("--no-check", action="store_true", help="skip the reference comparison")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the split-KV kernel and the combine kernel on their own")
    ap.add_argument("--fp8", action="store_true",
                    help="torch_mla over a float8_e4m3fn cache (exact mode; FlashMLA stays bf16)")
    ap.add_argument("configs", nargs="*", metavar="B,S_Q,S_K,H_Q",
                    help="configurations to time instead of the anchor table")
    ap.add_argument("--sparse", action="store_true",
                    help="sparse decode (V3.2 shapes) beside FlashMLA's sparse decode")
    ap.add_argument("--sparse-kernels", action="store_true",
                    help="sparse decode on each kernel over the three cache formats")
    ap.add_argument("--heads", default=None,
                    help="with --sparse-kernels: only these h_q (comma-separated)")
    ap.add_argument("--batches", default=None,
                    help="with --sparse-kernels: only these b (comma-separated)")
    ap.add_argument("--keysm", action="store_true",
                    help="time the heads-on-M SM90 kernel (TORCH_MLA_KEYSM=0), then the "
                         "keys-on-M one (TORCH_MLA_KEYSM=128: rows <= 128, a CTA for each 64 "
                         "above 64; over an fp8 cache "
                         "TORCH_MLA_KEYSM_RS=0, not its ping-pong variant) in the same run, with "
                         "its error against the reference")
    ap.add_argument("--rs", action="store_true",
                    help="with --keysm --fp8: also the ping-pong keys-on-M kernel "
                         "(TORCH_MLA_KEYSM_RS=1) where it takes the shape")
    ap.add_argument("--fast", action="store_true",
                    help="with --keysm --fp8: also fast mode (compute='fp8') on the heads-on-M "
                         "kernel and, where it takes the shape, the keys-on-M fast variant "
                         "(the dispatch's choice there)")
    ap.add_argument("--anchor-ceilings", action="store_true",
                    help="the %% columns against the H200's ceilings (4246 GB/s, 679 TFLOP/s) "
                         "instead of this GPU's, measured at the start of the run")
    args = ap.parse_args(argv)
    flash_mla = load_flash_mla()
    global COPY_GBPS, MATMUL_TFLOPS
    if not args.anchor_ceilings:
        COPY_GBPS, MATMUL_TFLOPS = measure_ceilings()
    print(f"# ceilings ({'the H200 anchor' if args.anchor_ceilings else 'measured in this run'}"
          f"): copy {COPY_GBPS:.0f} GB/s (read + written), bf16 matmul {MATMUL_TFLOPS:.0f} "
          "TFLOP/s")
    if args.sparse:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, sparse decode")
        return main_sparse(flash_mla)
    if args.sparse_kernels:
        print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, sparse kernels")
        heads = [int(h) for h in args.heads.split(",")] if args.heads else None
        batches = [int(b) for b in args.batches.split(",")] if args.batches else None
        return main_sparse_kernels(flash_mla, heads, batches)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}"
          + (", torch_mla over a float8_e4m3fn cache (exact mode)" if args.fp8 else ""))
    print("| b | s_q | s_k | h_q | causal | us | TFLOP/s | GB/s | % matmul | % copy "
          "| FlashMLA us (anchor) | FlashMLA / ours (same run; else the anchor's) | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    if args.keysm:  # the row: the heads-on-M kernel, whatever the dispatch's default
        os.environ["TORCH_MLA_KEYSM"] = "0"
    configs = QUICK_ANCHORS if args.quick else list(ANCHORS)
    if args.configs:
        configs = [(*dims, dims[1] > 1) for dims in map(parse_config, args.configs)]
    for cfg in configs:
        b, s_q, s_k, h_q, causal = cfg
        check = not args.no_check and b * s_k <= 128 * 8192
        us, tflops, gbps, err, fm_us = run_config(*cfg, check=check, flash_mla=flash_mla,
                                                  fp8=args.fp8)
        anchor = ANCHORS.get(cfg, float("nan"))
        fm = f"{anchor:.1f}" + (f" ({fm_us:.1f} here)" if fm_us == fm_us else "")
        ratio = (fm_us if fm_us == fm_us else anchor) / us  # (only a same-run ratio compares)
        print(f"| {b} | {s_q} | {s_k} | {h_q} | {'yes' if causal else 'no'} | {us:.1f} | "
              f"{tflops:.0f} | {gbps:.0f} | {100 * tflops / MATMUL_TFLOPS:.0f} | "
              f"{100 * gbps / COPY_GBPS:.0f} | {fm} | {ratio:.3f} | {err:.1e} |")
        if args.keysm:  # (=128: up to 128 rows, a CTA for each 64 above 64)
            os.environ["TORCH_MLA_KEYSM"] = "128"
            os.environ["TORCH_MLA_KEYSM_RS"] = "0"  # (the keys-on-M kernel at every batch)
            k_us = float("nan")
            try:
                k_us, _, k_gbps, k_err, _ = run_config(*cfg, check=check, fp8=args.fp8)
                print(f"|   | keys-on-M {k_us:.1f} us, {k_gbps:.0f} GB/s "
                      f"({100 * k_gbps / COPY_GBPS:.0f} % copy), {k_us / us:.3f} x the row above"
                      + (f", {k_us / fm_us:.3f} x FlashMLA" if fm_us == fm_us else "")
                      + f", rel err {k_err:.1e} |")
            except AssertionError as e:  # (the next rows still run)
                print(f"|   | keys-on-M: {e} |")
            # (only where the dispatch then takes the ping-pong kernel: an fp8 cache, <= 128
            # rows, 64 columns a CTA above 64)
            rs_rows = dispatch.keysm_columns("sm90", s_q * h_q) in KEYSM_RS_COLUMNS
            if args.rs and args.fp8 and rs_rows:
                os.environ["TORCH_MLA_KEYSM_RS"] = "1"
                try:
                    r_us, _, r_gbps, r_err, _ = run_config(*cfg, check=check, fp8=args.fp8)
                    print(f"|   | ping-pong keys-on-M {r_us:.1f} us, {r_gbps:.0f} GB/s "
                          f"({100 * r_gbps / COPY_GBPS:.0f} % copy), {r_us / us:.3f} x the row "
                          f"above, {r_us / k_us:.3f} x keys-on-M, rel err {r_err:.1e} |")
                except AssertionError as e:
                    print(f"|   | ping-pong keys-on-M: {e} |")
                finally:
                    os.environ["TORCH_MLA_KEYSM_RS"] = "0"
            if args.fast and args.fp8:
                fast_lines(cfg, check, us, k_us,
                           dispatch.keysm_columns("sm90", s_q * h_q, "fp8", batch=b)
                           in KEYSM_FAST_COLUMNS)
            os.environ["TORCH_MLA_KEYSM"] = "0"
            os.environ.pop("TORCH_MLA_KEYSM_RS")
        if args.breakdown:
            inp = make_anchor_inputs(b, s_q, h_q, s_k)
            sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
            t_dec, t_comb = breakdown_us(inp, sched, causal)
            pieces = int(sched.num_splits[-1])
            print(f"|   | decode kernel {t_dec:.1f} us, combine kernel {t_comb:.1f} us, "
                  f"{pieces} pieces for {b} requests, {sched.metadata.shape[0]} parts |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
