"""A/B timing of two versions of the SM90 decode kernel, or of the combine kernel, in one process
(development tool, needs the H200):

    git show HEAD~1:torch_mla/cute_kernels/sm90_decode.py > /tmp/old_decode.py
    python tools/ab_decode.py /tmp/old_decode.py 8,1,4096,128 32,1,4096,128 ...
    git show BRANCH:torch_mla/cute_kernels/combine.py > /tmp/old_combine.py
    python tools/ab_decode.py --kernel combine /tmp/old_combine.py 8,1,4096,128 ...
    git show HEAD~1:torch_mla/scheduling.py > /tmp/old_sched.py
    python tools/ab_decode.py /tmp/old_sched.py 64,1,2048,16 ...

"new" is the kernel of the working tree (the dispatcher's); every other version is a module file
given among the arguments (any argument ending in .py; several may be given, each named by its
file's stem), compiled for bf16 with the same fake tensors (--old-arg epilogue=direct passes
constructor arguments to their kernel classes, e.g. to an experiment's variant). A module that
defines compute_schedule and no kernel class is a version of torch_mla/scheduling.py: the working
tree's kernels run with the schedule it computes. Per configuration
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
from torch_mla.ops import schedule as op_schedule
from torch_mla.testing import make_anchor_inputs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_decode import graph_time_us  # noqa: E402  (the anchors' timing method)


def load_module(path: str):
    spec = importlib.util.spec_from_file_location(f"ab_module_{len(sys.modules)}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("decode", "combine"), default="decode")
    ap.add_argument("items", nargs="+", metavar="OTHER.py | B,S_Q,S_K,H_Q",
                    help="other versions' module files (sm90_decode.py or combine.py copies) "
                         "and configurations")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--old-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra constructor argument of the other versions' kernel classes "
                         "(a string)")
    args = ap.parse_args(argv)
    others = [x for x in args.items if x.endswith(".py")]
    args.configs = [x for x in args.items if not x.endswith(".py")]
    if not others or not args.configs:
        ap.error("give at least one module file and one configuration")

    import cutlass
    import cutlass.cute as cute

    old_kwargs = dict(kv.split("=", 1) for kv in args.old_arg)
    attr = "_compiled_decode_sm90" if args.kernel == "decode" else "_compiled_combine"
    new_fn = getattr(dispatch, attr)
    def make_fn(path):
        cache = {}
        mod = load_module(path)
        if hasattr(mod, "compute_schedule") and not hasattr(mod, "MLADecodeSm90"):
            # A scheduling.py version: the working tree's kernels with that split schedule.
            def fn(*key):
                return new_fn(*key)
            fn.compute_schedule = mod.compute_schedule
        elif args.kernel == "decode":
            cls = mod.MLADecodeSm90

            def fn(dtype, causal):
                if causal not in cache:
                    assert dtype == torch.bfloat16, dtype
                    cache[causal] = dispatch.compile_decode_sm90(
                        cute, cutlass, cls(cutlass.BFloat16, causal, **old_kwargs),
                        cutlass.BFloat16)
                return cache[causal]
        else:
            cls = mod.MLACombine

            def fn(dtype, warps_per_row):
                if warps_per_row not in cache:
                    assert dtype == torch.bfloat16, dtype
                    cache[warps_per_row] = dispatch.compile_combine(
                        cute, cutlass, cls(cutlass.BFloat16, dispatch.D_V, warps_per_row),
                        cutlass.BFloat16)
                return cache[warps_per_row]
        return fn

    new_schedule = op_schedule.compute_schedule
    versions = {"new": new_fn}
    for path in others:
        name = os.path.splitext(os.path.basename(path))[0]
        versions[name if name not in versions else path] = make_fn(path)
    torch_mla.set_value_checks(False)
    out_file = os.path.join(os.environ["OUT"], "ab.txt") if os.environ.get("OUT") else None
    try:
        for cfg in args.configs:
            b, s_q, s_k, h_q = (int(x) for x in cfg.split(","))
            causal = s_q > 1
            inp = make_anchor_inputs(b, s_q, h_q, s_k)
            scheds = {}
            for name, fn in versions.items():
                op_schedule.compute_schedule = getattr(fn, "compute_schedule", new_schedule)
                scheds[name] = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
            op_schedule.compute_schedule = new_schedule
            times = {name: [] for name in versions}
            differs = set()
            first = None
            for _ in range(args.rounds):
                for name, fn in versions.items():
                    setattr(dispatch, attr, fn)
                    call_args = (inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens,
                                 scheds[name])
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
