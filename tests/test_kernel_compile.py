"""Every CuTe DSL kernel compiles for its GPU on a machine without one (CUTE_DSL_ARCH), and the
PTX uses the instructions the design relies on (wgmma, TMA, stmatrix/ldmatrix)."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import glob, json, os, re, sys
import cutlass, cutlass.cute as cute
from torch_mla.ops.dispatch import compile_decode_step
from torch_mla.cute_kernels.decode_step import MLADecodeStep
from torch_mla.cute_kernels.sm90_decode import MLADecodeSm90
dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[sys.argv[1]]
causal = sys.argv[2] == "causal"
# What mla_decode runs: the decode kernel and the three combine variants behind one host call.
compile_decode_step(cute, cutlass, MLADecodeStep(MLADecodeSm90(dt, causal), dt), dt)
counts = {"decode": {}, "combine": {}}
entries = {"decode": 0, "combine": 0}
for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")):
    for ptx in open(f).read().split(".entry ")[1:]:  # one kernel each
        name = ptx.split("(", 1)[0]
        kind = "decode" if "MLADecodeSm90" in name else "combine"
        assert kind == "decode" or "MLACombine" in name, name
        entries[kind] += 1
        for k in ["wgmma.mma_async", "cp.async.bulk.tensor", "cp.async.bulk.global", "stmatrix",
                  "ldmatrix", "ld.local", "st.local", "griddepcontrol.launch_dependents",
                  "griddepcontrol.wait", "ld.global.v4", "ld.global.nc", "trap;",
                  r"call.uni \(retval0\), vprintf"]:
            counts[kind][k] = counts[kind].get(k, 0) + len(re.findall(k, ptx))
assert entries == {"decode": 1, "combine": 3}, entries
print(json.dumps(counts))
"""


@pytest.mark.parametrize("dtype,causal", [("bf16", "causal"), ("fp16", "plain")])
def test_sm90_kernels_compile(tmp_path, dtype, causal):
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx",
               CUTE_DSL_DUMP_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", SCRIPT, dtype, causal], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    dec = counts["decode"]
    # 9 tiles x 4 k-steps of QK^T per warpgroup and page, 4 per P @ V: hundreds of wgmma.
    assert dec["wgmma.mma_async"] >= 100, dec
    assert dec["cp.async.bulk.tensor"] > 0 and dec["stmatrix"] > 0 and dec["ldmatrix"] > 0, dec
    assert dec["ld.local"] == 0 and dec["st.local"] == 0, dec
    # no function call: ptxas serialises every wgmma of a kernel that makes one (a printf in the
    # input checks made the decode 2.5x slower; they live in the combine instead)
    assert dec[r"call.uni \(retval0\), vprintf"] == 0 and dec["trap;"] == 0, dec
    # output staged in smem and written by bulk copies; the combine may launch early (PDL)
    assert dec["cp.async.bulk.global"] > 0 and dec["griddepcontrol.launch_dependents"] == 1, dec
    comb = counts["combine"]
    assert comb["wgmma.mma_async"] == 0 and comb["ld.local"] == 0, comb
    # the input checks: a message (its 5 and 8 arguments are the only local stores: 3 + 4
    # vector stores) and a trap, for the length and for a page id, in each of the 3 variants
    printfs = comb[r"call.uni \(retval0\), vprintf"]
    assert printfs == 2 * 3 and comb["trap;"] == printfs and comb["st.local"] == 7 * 3, comb
    assert comb["griddepcontrol.wait"] >= 2 and comb["ld.global.v4"] > 0, comb
    # partials are written by the decode kernel while this grid may already run (PDL): never
    # through the non-coherent read-only path
    assert comb["ld.global.nc"] == 0, comb


TRACE_SCRIPT = r"""
import glob, os
import cutlass, cutlass.cute as cute
from torch_mla.ops.dispatch import compile_decode_sm90
from torch_mla.cute_kernels.sm90_decode import MLADecodeSm90
compile_decode_sm90(cute, cutlass, MLADecodeSm90(cutlass.BFloat16, False, trace=True),
                    cutlass.BFloat16)
ptx = "".join(open(f).read() for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"],
                                                               "*.ptx")))
print(ptx.count("%globaltimer"))
"""


def test_sm90_trace_build_compiles(tmp_path):
    """The development build used by tools/trace_decode.py (one more argument, stamps)."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx",
               CUTE_DSL_DUMP_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-c", TRACE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert int(res.stdout.strip().splitlines()[-1]) >= 8  # start, 6 per segment, end


SMALL_SCRIPT = r"""
import glob, json, os, re
import cutlass, cutlass.cute as cute
from torch_mla.ops.dispatch import compile_append_kv, compile_schedule
from torch_mla.cute_kernels.append_kv import AppendKV
from torch_mla.cute_kernels.schedule import DecodeSchedule
compile_schedule(cute, cutlass, DecodeSchedule(), "sm_90a")
compile_schedule(cute, cutlass, DecodeSchedule(), "sm_80")
compile_append_kv(cute, cutlass, AppendKV(cutlass.BFloat16, cutlass.Float32), cutlass.Int64)
compile_append_kv(cute, cutlass, AppendKV(cutlass.Float16, cutlass.Float16), cutlass.Int32)
out = []
for f in sorted(glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx"))):
    lines = open(f).read().splitlines()
    calls = [i for i, l in enumerate(lines) if "call.uni" in l]
    # every local store fills the argument buffer of the printf call that follows it
    printf_args = all("vprintf" in lines[min([c for c in calls if c > i], default=0)]
                      for i, l in enumerate(lines) if "st.local" in l)
    text = "\n".join(lines)
    out.append({"kernel": "schedule" if "DecodeSchedule" in f else "append_kv",
                "target": re.search(r"\.target (\S+)", text)[1],
                "printf_args_only": printf_args,
                **{k: len(re.findall(re.escape(k), text)) for k in
                   ["ld.local", "st.local", "call.uni (retval0), vprintf", "trap;", "bar.sync",
                    "shfl.sync", "st.global.v4", "ld.global.v4", "cvt.rn.bf16x2.f32"]}})
print(json.dumps(out))
"""


def test_small_kernels_compile_for_sm80_and_sm90(tmp_path):
    """The one-launch schedule (sm_90a and sm_80) and append_kv: no local memory but printf's
    argument buffer, the value checks' printf + trap, 16-byte cache stores."""
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    env.pop("CUTE_DSL_ARCH", None)
    res = subprocess.run([sys.executable, "-c", SMALL_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    ptx = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted((p["kernel"], p["target"]) for p in ptx) == [
        ("append_kv", "sm_90a"), ("append_kv", "sm_90a"), ("schedule", "sm_80"),
        ("schedule", "sm_90a")], ptx
    for p in ptx:
        assert p["ld.local"] == 0 and p["printf_args_only"], p
        assert p["trap;"] == p["call.uni (retval0), vprintf"] > 0, p  # each message, then trap
        if p["kernel"] == "schedule":
            # block scans: warp shuffles and a few barriers, one CTA
            assert p["shfl.sync"] > 0 and p["bar.sync"] >= 3, p
        else:
            assert p["st.global.v4"] == 2, p  # kv_c and k_pe vectors: 16-byte stores
    fp32_src = [p for p in ptx if p["kernel"] == "append_kv" and p["cvt.rn.bf16x2.f32"]]
    assert len(fp32_src) == 1 and fp32_src[0]["ld.global.v4"] == 4, ptx  # 32-byte source vectors
