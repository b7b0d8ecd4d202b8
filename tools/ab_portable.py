"""A/B timing of versions of the portable (SM80-class) decode kernel, with the SM90 kernel, in one
process (development tool, needs an H100/H200):

    git show HEAD~1:torch_mla/cute_kernels/sm80_decode.py > torch_mla/cute_kernels/sm80_old.py
    python tools/ab_portable.py --old sm80_old 128,1,8192,64 128,2,8192,128 ...

Versions: "sm90" (the dispatcher's SM90 kernel), "lag" and "nolag" (the working tree's portable
kernel with and without the lagging quad, sm80_decode.py), and each --old NAME: a copy of
sm80_decode.py placed beside it as torch_mla/cute_kernels/NAME.py (its relative imports need
the package; do not commit it). Per configuration (b,s_q,s_k,h_q; causal when s_q > 1) every
version runs the anchor workload through torch_mla.mla_decode, interleaved for --rounds rounds,
timed as benchmarks/bench_decode.py times it; prints us per round, the speed ratio SM90 / version
of the best round, and whether the portable versions' outputs equal the first one's bit for bit."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_decode import graph_time_us  # noqa: E402

import torch_mla  # noqa: E402
from torch_mla.ops import dispatch  # noqa: E402
from torch_mla.testing import make_anchor_inputs  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", metavar="B,S_Q,S_K,H_Q")
    ap.add_argument("--old", action="append", default=[], metavar="NAME")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)

    from torch_mla.cute_kernels.decode_step import MLADecodeStep

    arch = dispatch.device_arch(torch.cuda.current_device())
    cute, cutlass, cdt = dispatch._dsl(torch.bfloat16)
    pdl = dispatch._has_pdl(arch)

    def kernel_of(name):
        if name in ("lag", "nolag"):
            mod = importlib.import_module("torch_mla.cute_kernels.sm80_decode")
            kw = {"lag": name == "lag"}
        else:
            mod, kw = importlib.import_module(f"torch_mla.cute_kernels.{name}"), {}
        return lambda causal: mod.MLADecodeSm80(
            cdt, causal, mod.Sm80DecodeConfig.from_heuristic(arch), use_pdl=pdl, **kw)

    cache = {}

    def step(name, causal):
        if (name, causal) not in cache:
            step = MLADecodeStep(kernels[name](causal), cdt, use_pdl=pdl)
            cache[(name, causal)] = dispatch.compile_decode_step(cute, cutlass, step, cdt, arch)
        return cache[(name, causal)]

    kernels = {name: kernel_of(name) for name in ["lag", "nolag", *args.old]}
    default_sm80 = dispatch._STEPS["sm80"]
    torch_mla.set_value_checks(False)
    try:
        for cfg in args.configs:
            b, s_q, s_k, h_q = (int(x) for x in cfg.split(","))
            causal = s_q > 1
            inp = make_anchor_inputs(b, s_q, h_q, s_k)
            sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
            call = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched)
            times = {name: [] for name in ["sm90", *kernels]}
            first, differs = None, []
            for _ in range(args.rounds):
                for name in times:
                    if name == "sm90":
                        os.environ.pop("TORCH_MLA_PORTABLE", None)
                    else:
                        os.environ["TORCH_MLA_PORTABLE"] = "1"
                        dispatch._STEPS["sm80"] = lambda dt, c, index, n=name: step(n, c)
                    out, lse = torch_mla.mla_decode(*call, causal=causal)
                    if name != "sm90":
                        if first is None:
                            first = (out.clone(), lse.clone())
                        elif not (torch.equal(out, first[0]) and torch.equal(lse, first[1])):
                            differs.append(name)
                    times[name].append(graph_time_us(
                        lambda a=call, c=causal: torch_mla.mla_decode(*a, causal=c)))
            sm90 = min(times["sm90"])
            print(f"{cfg:16s} " + " | ".join(
                f"{name} " + " ".join(f"{t:.1f}" for t in ts)
                + ("" if name == "sm90" else f" ({sm90 / min(ts):.3f})")
                for name, ts in times.items())
                + (f"  OUTPUT DIFFERS: {sorted(set(differs))}" if differs else ""), flush=True)
    finally:
        dispatch._STEPS["sm80"] = default_sm80
        os.environ.pop("TORCH_MLA_PORTABLE", None)


if __name__ == "__main__":
    main()
