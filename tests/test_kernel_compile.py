"""Every CuTe DSL kernel compiles for its GPU on a machine without one (CUTE_DSL_ARCH), and the
PTX uses the instructions the design relies on (SM90: wgmma, TMA, stmatrix/ldmatrix; SM100:
tcgen05 MMAs and TMEM, TMA)."""

import json
import os
import re
import subprocess
import sys

import pytest

SCRIPT = r"""
import glob, json, os, re, sys
import cutlass, cutlass.cute as cute
from torch_mla.ops.dispatch import compile_combine, compile_decode_sm90
from torch_mla.cute_kernels.combine import MLACombine
from torch_mla.cute_kernels.sm90_decode import MLADecodeSm90
dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[sys.argv[1]]
causal = sys.argv[2] == "causal"
compile_decode_sm90(cute, cutlass, MLADecodeSm90(dt, causal), dt)
for wpr in (1, 4, 16):
    compile_combine(cute, cutlass, MLACombine(dt, 512, wpr), dt)
counts = {"decode": {}, "combine": {}}
for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")):
    ptx = open(f).read()
    kind = "decode" if "MLADecodeSm90" in f else "combine"
    for k in ["wgmma.mma_async", "cp.async.bulk.tensor", "cp.async.bulk.global", "stmatrix",
              "ldmatrix", "ld.local", "st.local", "griddepcontrol.launch_dependents",
              "griddepcontrol.wait", "ld.global.v4", "ld.global.nc"]:
        counts[kind][k] = counts[kind].get(k, 0) + len(re.findall(k, ptx))
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
    # output staged in smem and written by bulk copies; the combine may launch early (PDL)
    assert dec["cp.async.bulk.global"] > 0 and dec["griddepcontrol.launch_dependents"] == 1, dec
    comb = counts["combine"]
    assert comb["wgmma.mma_async"] == 0 and comb["ld.local"] == 0 and comb["st.local"] == 0, comb
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


SM100_SCRIPT = r"""
import glob, json, os, re, sys
import cutlass, cutlass.cute as cute
from torch_mla.ops.dispatch import compile_combine, compile_decode
from torch_mla.cute_kernels import sm100_decode
from torch_mla.cute_kernels.combine import MLACombine
dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[sys.argv[1]]
causal = sys.argv[2] == "causal"
if len(sys.argv) > 3:  # a configuration past the shared-memory budget must not compile
    sm100_decode.KV_STAGES = int(sys.argv[3])
kernel = sm100_decode.MLADecodeSm100(dt, causal)
try:
    compile_decode(cute, cutlass, kernel, dt, "sm_100a")
except AssertionError as e:
    print(json.dumps({"assert": str(e)}))
    sys.exit(0)
compile_combine(cute, cutlass, MLACombine(dt, 512, 4), dt, "sm_100a")
counts = {"decode": {}, "combine": {}, "smem_bytes": kernel.smem_bytes}
for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")):
    ptx = open(f).read()
    kind = "decode" if "MLADecodeSm100" in f else "combine"
    for k in ["tcgen05.mma.cta_group::1.kind::f16", "tcgen05.alloc", "tcgen05.dealloc",
              "tcgen05.relinquish_alloc_permit", "tcgen05.commit", "tcgen05.ld.sync.aligned",
              "tcgen05.st.sync.aligned", "tcgen05.wait::ld", "tcgen05.wait::st",
              "tcgen05.fence::before_thread_sync", "tcgen05.fence::after_thread_sync",
              "cp.async.bulk.tensor", "wgmma", "ld.local", "st.local", "st.shared.v4",
              "st.global.v4", "griddepcontrol.launch_dependents", ".target sm_100a"]:
        counts[kind][k] = counts[kind].get(k, 0) + len(re.findall(re.escape(k), ptx))
print(json.dumps(counts))
"""


def _sm100_compile(tmp_path, *argv):
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    env.pop("CUTE_DSL_ARCH", None)  # the arch is a compile option: none is needed here
    res = subprocess.run([sys.executable, "-c", SM100_SCRIPT, *argv], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype,causal", [("bf16", "causal"), ("fp16", "plain")])
def test_sm100_kernel_compiles(tmp_path, dtype, causal):
    """The SM100 kernel (never run on hardware) compiles for sm_100a on the CPU, and its PTX
    has the instructions of the design (docs/sm100-design.md)."""
    counts = _sm100_compile(tmp_path, dtype, causal)
    dec = counts["decode"]
    assert dec[".target sm_100a"] == 1, dec
    # One segment's code: 36 k-steps of QK^T (576 / 16), and P V at its two call sites (the
    # loop and the segment's last page), 4 k-steps x 2 halves of d_v each. No Hopper wgmma.
    assert dec["tcgen05.mma.cta_group::1.kind::f16"] == 36 + 2 * 4 * 2, dec
    assert dec["wgmma"] == 0, dec
    # TMEM: allocated once, freed once, and the permit given up.
    assert dec["tcgen05.alloc"] == dec["tcgen05.dealloc"] == 1, dec
    assert dec["tcgen05.relinquish_alloc_permit"] == 1, dec
    # Commits: S full, Q empty, O full, and page + P empty at each of the two P V sites.
    assert dec["tcgen05.commit"] == 3 + 2 * 2, dec
    # S loads, O rescale (8 chunks: load and store) and the epilogue (8 chunks x 2 outputs).
    assert dec["tcgen05.ld.sync.aligned"] == 1 + 8 + 2 * 8, dec
    assert dec["tcgen05.st.sync.aligned"] == 8 and dec["tcgen05.wait::st"] >= 1, dec
    assert dec["tcgen05.wait::ld"] >= dec["tcgen05.ld.sync.aligned"], dec
    assert dec["tcgen05.fence::before_thread_sync"] > 0, dec
    assert dec["tcgen05.fence::after_thread_sync"] > 0, dec
    # TMA: Q (9 boxes of 64 x 64) and a page (9 boxes), each issued at one place.
    assert dec["cp.async.bulk.tensor"] == 18, dec
    assert dec["ld.local"] == 0 and dec["st.local"] == 0, dec
    # P goes to shared memory in 16-byte stores; O to global memory in 16-byte stores.
    assert dec["st.shared.v4"] == 4 and dec["st.global.v4"] == 8 * (4 + 8), dec
    assert dec["griddepcontrol.launch_dependents"] == 1, dec
    # Q 72 KB + 2 pages 144 KB + P 8 KB + barriers, within sm_100's 227 KB per block.
    assert 224 * 1024 < counts["smem_bytes"] <= 227 * 1024, counts["smem_bytes"]
    comb = counts["combine"]
    assert comb[".target sm_100a"] == 1 and comb["tcgen05.mma.cta_group::1.kind::f16"] == 0, comb
    assert comb["ld.local"] == 0 and comb["st.local"] == 0, comb


def test_sm100_shared_memory_budget_is_checked_at_compile_time(tmp_path):
    """A third page buffer (72 KB more) does not fit: the compile stops with the numbers."""
    counts = _sm100_compile(tmp_path, "bf16", "plain", "3")
    assert re.fullmatch(r"\((\d+), 232448\)", counts["assert"]), counts
    assert int(counts["assert"][1:].split(",")[0]) > 232448


def test_sm100_tmem_budget_is_checked(monkeypatch):
    from torch_mla.cute_kernels import sm100_decode

    monkeypatch.setattr(sm100_decode, "TMEM_USED", 513)  # e.g. O for 128 rows (512) + S
    with pytest.raises(AssertionError) as e:
        sm100_decode.MLADecodeSm100(None, False)
    assert str(e.value) == "(513, 512)"


ALIAS_SCRIPT = r"""
import cutlass, cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import OperandMajorMode as OM, tcgen05
import cutlass.utils.blackwell_helpers as sm100_utils
from torch_mla.cute_kernels.sm100_decode import MLADecodeSm100
dt = cutlass.BFloat16
@cute.jit
def check():
    one = tcgen05.CtaGroup.ONE
    qk = sm100_utils.make_trivial_tiled_mma(dt, dt, OM.K, OM.K, Float32, one, (64, 64))
    sK = sm100_utils.make_smem_layout_b(qk, (64, 64, 576), dt, 2)
    for v_major in (OM.MN, OM.K):  # the kernel's V operand, then a K-major one (wrong)
        pv = sm100_utils.make_trivial_tiled_mma(dt, dt, OM.K, v_major, Float32, one, (64, 256))
        sV = cute.select(sm100_utils.make_smem_layout_b(pv, (64, 512, 64), dt, 1), mode=[0, 1, 2])
        try:
            MLADecodeSm100._check_v_aliases_k(sK, sV)
            print(v_major, "aliases K")
        except AssertionError as e:
            print(v_major, "differs at (key, d, K offset, V offset) =", e)
check()
"""


def test_sm100_v_operand_aliases_the_k_page(tmp_path):
    """P V reads V from the page buffer QK^T reads K from; the compile-time check accepts the
    kernel's MN-major V layout and rejects a layout that puts (d, key) elsewhere."""
    script = tmp_path / "alias.py"  # a file: the DSL reads a jit function's source
    script.write_text(ALIAS_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.splitlines()[-2:] == [
        "OperandMajorMode.MN aliases K",
        "OperandMajorMode.K differs at (key, d, K offset, V offset) = (0, 1, 1, 64)",
    ], res.stdout
