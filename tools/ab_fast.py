"""A/B timing of FP8 fast-mode schedule variants (MLADecodeSm90Fast constructor flags) in one
process (development tool, needs the H200):

    python tools/ab_fast.py "early_vt=1,prefetch=1" "early_vt=0,prefetch=0" ... -- 128,1,8192,16 ...

Each variant is compiled (in parallel processes, into the disk kernel cache), then every
configuration (b,s_q,s_k,h_q; causal when s_q > 1) runs the anchor workload over its fp8 cache
through torch_mla.mla_decode(compute="fp8") with the variant swapped in, interleaved for
--rounds rounds, timed as bench_decode.py times it; the bf16 kernel is timed beside them. A
variant whose output differs bitwise from the first variant's is marked (the flags change only
when work is done, not what is computed)."""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import torch_mla  # noqa: E402
from torch_mla.ops import dispatch, kernel_cache  # noqa: E402
from torch_mla.reference import quantize_fp8  # noqa: E402
from torch_mla.testing import make_anchor_inputs  # noqa: E402


def parse_flags(text: str) -> dict:
    return {k: bool(int(v)) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def compiled(flags: dict, causal: bool):
    def build():
        import cutlass
        import cutlass.cute as cute

        from torch_mla.cute_kernels.decode_step import MLADecodeStep
        from torch_mla.cute_kernels.sm90_decode import MLADecodeSm90Fast

        step = MLADecodeStep(MLADecodeSm90Fast(cutlass.BFloat16, causal, **flags),
                             cutlass.BFloat16)
        return dispatch.compile_decode_step(cute, cutlass, step, cutlass.BFloat16)

    config = {"causal": causal, **{k: int(v) for k, v in flags.items()}}
    return kernel_cache.load_or_build("ab_fast", config, dispatch.SM90_ARCH, build)


def main(argv=None):
    from bench_decode import graph_time_us

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("items", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    variants = [x for x in args.items if "=" in x or x == "default"]
    cfgs = [tuple(int(v) for v in x.split(",")) for x in args.items if x.count(",") == 3]
    if os.environ.get("AB_FAST_CHILD"):
        flags, causal = parse_flags(variants[0].replace("default", "")), bool(cfgs[0][0])
        compiled(flags, causal)
        return
    procs = [subprocess.Popen([sys.executable, __file__, v, f"{int(c)},0,0,0"],
                              env=dict(os.environ, AB_FAST_CHILD="1"))
             for v in variants for c in sorted({s_q > 1 for _, s_q, _, _ in cfgs})]
    for p in procs:
        p.wait()
    steps = {v: {c: compiled(parse_flags(v.replace("default", "")), c) for c in (False, True)
                 if any((s_q > 1) == c for _, s_q, _, _ in cfgs)} for v in variants}
    print("| b | s_q | s_k | h_q | bf16 us | " + " | ".join(variants) + " |")
    for b, s_q, s_k, h_q in cfgs:
        causal = s_q > 1
        inp = make_anchor_inputs(b, s_q, h_q, s_k)
        kv_scale = (inp.kv_cache.float().abs().amax() / 448).reshape(1)
        cache8 = quantize_fp8(inp.kv_cache, kv_scale)
        sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
        fn = functools.partial(torch_mla.mla_decode, inp.q, cache8, inp.block_table,
                               inp.cache_seqlens, sched, causal=causal, kv_scale=kv_scale,
                               compute="fp8")
        times = {v: [] for v in variants}
        first = None
        same = {}
        t16 = graph_time_us(functools.partial(torch_mla.mla_decode, inp.q, inp.kv_cache,
                                              inp.block_table, inp.cache_seqlens, sched,
                                              causal=causal))
        for _ in range(args.rounds):
            for v in variants:
                dispatch._STEPS["sm90_fp8_fast"] = (
                    lambda dtype, c, index, v=v: steps[v][c])
                out = fn()[0]
                if first is None:
                    first = out.clone()
                same[v] = torch.equal(out, first)
                times[v].append(graph_time_us(fn))
        cells = [f"{min(times[v]):.1f}{'' if same[v] else ' (differs)'}" for v in variants]
        print(f"| {b} | {s_q} | {s_k} | {h_q} | {t16:.1f} | " + " | ".join(cells) + " |",
              flush=True)
        del inp, cache8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
