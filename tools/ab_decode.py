"""A/B timing of two versions of the SM90 decode kernel, or of the combine kernel, in one process
(development tool, needs the H200):

    git show HEAD~1:torch_mla/cute_kernels/sm90_decode.py > /tmp/old_decode.py
    python tools/ab_decode.py /tmp/old_decode.py 8,1,4096,128 32,1,4096,128 ...
    git show BRANCH:torch_mla/cute_kernels/combine.py > /tmp/old_combine.py
    python tools/ab_decode.py --kernel combine /tmp/old_combine.py 8,1,4096,128 ...

"new" is the kernel of the working tree (the dispatcher's), "old" the module file given first
(compiled for bf16 with the same fake tensors; --old-arg epilogue=direct passes constructor
arguments to the decode kernel class, e.g. to an experiment's variant). Per configuration
(b,s_q,s_k,h_q; causal when s_q > 1) both run the anchor workload through
torch_mla.mla_decode, interleaved for --rounds rounds (run-to-run drift then hits both alike),
each timed as bench_decode.py times it. Prints one line per configuration and marks a version
whose output or lse differs bitwise from new's first run. Lines are also appended to
$OUT/ab.txt when OUT is set: keep the device's output unfiltered, or write it there."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

import torch_mla
from torch_mla.ops import dispatch
from torch_mla.testing import make_anchor_inputs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_decode import graph_time_us  # noqa: E402  (the anchors' timing method)


def load_old(path: str, name: str = "MLADecodeSm90"):
    spec = importlib.util.spec_from_file_location("old_kernel_module", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="path of the other sm90_decode.py (or combine.py)")
    ap.add_argument("--kernel", choices=("decode", "combine"), default="decode")
    ap.add_argument("configs", nargs="+", metavar="B,S_Q,S_K,H_Q")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--old-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra constructor argument of the old kernel class (a string)")
    args = ap.parse_args(argv)

    import cutlass
    import cutlass.cute as cute

    old_kwargs = dict(kv.split("=", 1) for kv in args.old_arg)
    attr = "_compiled_decode_sm90" if args.kernel == "decode" else "_compiled_combine"
    new_fn = getattr(dispatch, attr)
    old_cache = {}
    if args.kernel == "decode":
        old_cls = load_old(args.old)

        def old_fn(dtype, causal):
            if causal not in old_cache:
                assert dtype == torch.bfloat16, dtype
                old_cache[causal] = dispatch.compile_decode_sm90(
                    cute, cutlass, old_cls(cutlass.BFloat16, causal, **old_kwargs),
                    cutlass.BFloat16)
            return old_cache[causal]
    else:
        old_cls = load_old(args.old, "MLACombine")

        def old_fn(dtype, warps_per_row):
            if warps_per_row not in old_cache:
                assert dtype == torch.bfloat16, dtype
                old_cache[warps_per_row] = dispatch.compile_combine(
                    cute, cutlass, old_cls(cutlass.BFloat16, dispatch.D_V, warps_per_row),
                    cutlass.BFloat16)
            return old_cache[warps_per_row]

    versions = {"new": new_fn, "old": old_fn}
    torch_mla.set_value_checks(False)
    out_file = os.path.join(os.environ["OUT"], "ab.txt") if os.environ.get("OUT") else None
    try:
        for cfg in args.configs:
            b, s_q, s_k, h_q = (int(x) for x in cfg.split(","))
            causal = s_q > 1
            inp = make_anchor_inputs(b, s_q, h_q, s_k)
            sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
            call_args = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched)
            times = {name: [] for name in versions}
            differs = set()
            first = None
            for _ in range(args.rounds):
                for name, fn in versions.items():
                    setattr(dispatch, attr, fn)
                    out, lse = torch_mla.mla_decode(*call_args, causal=causal)
                    if first is None:
                        first = (out.clone(), lse.clone())
                    elif not (torch.equal(out, first[0]) and torch.equal(lse, first[1])):
                        differs.add(name)
                    times[name].append(graph_time_us(
                        lambda a=call_args, c=causal: torch_mla.mla_decode(*a, causal=c)))
            line = f"{cfg:16s} " + " | ".join(
                f"{name} " + " ".join(f"{t:.1f}" for t in ts)
                + (" OUTPUT DIFFERS" if name in differs else "") for name, ts in times.items())
            print(line, flush=True)
            if out_file:
                with open(out_file, "a") as f:
                    f.write(line + "\n")
    finally:
        setattr(dispatch, attr, new_fn)


if __name__ == "__main__":
    main()
