"""Every CuTe DSL kernel compiles for its GPUs on a machine without one (the arch is a compile
option), and the PTX uses the instructions the design relies on (SM90: wgmma, TMA,
stmatrix/ldmatrix; SM100: tcgen05 MMAs and TMEM, TMA; portable: cp.async, ldmatrix, mma.sync) and
no local memory but the input checks' printf arguments."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from compile_runs import ahead, python, result
from expecttest import assert_expected_inline

from tools.ptxas_figures import kernel_figures
from torch_mla.constants import D_QK

SCRIPT = r"""
import glob, json, os, re, sys
from torch_mla.ops import registry
fast = sys.argv[3].startswith("fast")  # fast mode (compute="fp8"); "fastq8": an e4m3 q
# What mla_decode runs: the decode kernel and the four combine variants behind one host call
# ("fp8": over a float8_e4m3fn cache, exact mode; "fastdither": fast mode with P dithered).
registry.build(registry.DecodeStepConfig(
    "sm90", sys.argv[1], sys.argv[2] == "causal", kv_fp8=sys.argv[3] != "same",
    compute="fp8" if fast else "exact", q_fp8=sys.argv[3] == "fastq8",
    p_dither=sys.argv[3] == "fastdither"), "sm_90a")
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
                  r"call.uni \(retval0\), vprintf", "cvt.rn.f16x2.e4m3x2",
                  r"cvt.rn.bf16x2.f32 h\d, fu\d, fl\d;", "wgmma.mma_async.*bf16",
                  "wgmma.mma_async.*f16.f16", "wgmma.mma_async.*e4m3.e4m3", "prmt.b32",
                  "cvt.rn.satfinite.e4m3x2.f32", "cp.async.bulk.prefetch", "%globaltimer",
                  "add.f32 d, d, 0fBFBFC000"]:
            counts[kind][k] = counts[kind].get(k, 0) + len(re.findall(k, ptx))
assert entries == {"decode": 1, "combine": 4}, entries
print(json.dumps(counts))
"""


def sm90_run(dtype, causal, cache):
    return python("-c", SCRIPT, dtype, causal, cache,
                  env={"CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx"})


@ahead(sm90_run)
@pytest.mark.parametrize("dtype,causal,cache", [("bf16", "causal", "same"),
                                                ("fp16", "plain", "same"),
                                                ("bf16", "causal", "fp8"),
                                                ("bf16", "causal", "fast"),
                                                ("fp16", "plain", "fastq8"),
                                                ("bf16", "plain", "fastdither")])
def test_sm90_kernels_compile(dtype, causal, cache):
    res = result(sm90_run(dtype, causal, cache))
    assert res.returncode == 0, res.stderr[-4000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    dec = counts["decode"]
    # 9 tiles x 4 k-steps of QK^T per warpgroup and page, 4 per P @ V: hundreds of wgmma
    # (fast mode: k32 steps, half as many).
    assert dec["wgmma.mma_async"] >= (80 if cache.startswith("fast") else 100), dec
    assert dec["cp.async.bulk.tensor"] > 0 and dec["ld.local"] == 0 and dec["st.local"] == 0, dec
    # The shipped classes' trace points are no-ops (the trace build is tools/trace_decode.py's).
    assert dec["%globaltimer"] == 0, dec
    if cache.startswith("fast"):
        # Fast mode: every MMA on e4m3 operands (Q K^T 18 k32 steps a page, P V 2 per half);
        # P to e4m3 by cvt (4 a word, 8 words per P); V^T by byte permutes (64 a transposed
        # half); no stmatrix/ldmatrix (bytes go through plain shared stores); no prefetches
        # (measured slower, off by default); Q by 16-byte global loads (none when q is e4m3:
        # 9 a thread either way, 18 for 16-bit q).
        assert dec["wgmma.mma_async.*e4m3.e4m3"] == dec["wgmma.mma_async"] >= 80, dec
        assert dec["stmatrix"] == 0 and dec["ldmatrix"] == 0, dec
        assert dec["prmt.b32"] > 0 and dec["prmt.b32"] % 64 == 0, dec
        assert dec["cvt.rn.satfinite.e4m3x2.f32"] > 0 and dec["cp.async.bulk.prefetch"] == 0, dec
        assert dec["ld.global.nc"] == (9 if cache == "fastq8" else 18), dec
        assert dec["cvt.rn.f16x2.e4m3x2"] == 0, dec
        assert dec[r"call.uni \(retval0\), vprintf"] == 0 and dec["trap;"] == 0, dec
        # P's dither (ptx.e4m3_dither: its offset's add, one a value) before every P value's
        # conversion (two a cvt) with p_dither only; Q's conversions (64 rows x 576 / 256
        # threads / 2 a thread, none for an e4m3 q) take none
        p_cvts = dec["cvt.rn.satfinite.e4m3x2.f32"] - (0 if cache == "fastq8" else 72)
        assert p_cvts > 0, dec
        want = 2 * p_cvts if cache == "fastdither" else 0
        assert dec["add.f32 d, d, 0fBFBFC000"] == want, dec
        return
    assert dec["stmatrix"] > 0 and dec["ldmatrix"] > 0, dec
    # no function call: ptxas serialises every wgmma of a kernel that makes one (a printf in the
    # input checks made the decode 2.5x slower; they live in the combine instead)
    assert dec[r"call.uni \(retval0\), vprintf"] == 0 and dec["trap;"] == 0, dec
    # output staged in smem and written by bulk copies; the combine may launch early (PDL)
    assert dec["cp.async.bulk.global"] > 0 and dec["griddepcontrol.launch_dependents"] == 1, dec
    # the MMAs are the 16-bit ones in both cache formats
    mma = dec["wgmma.mma_async.*bf16" if dtype == "bf16" else "wgmma.mma_async.*f16.f16"]
    assert mma == dec["wgmma.mma_async"], dec
    if cache == "fp8":
        # the page expansion: 8 cvt.rn.f16x2.e4m3x2 per 16 bytes, 8 or 10 waves a buffer half,
        # two halves, in each of the four inlined Q K^T issue sites (first S of each
        # warpgroup, the steady-state pair of each); bf16 goes through f32 (exact)
        assert dec["cvt.rn.f16x2.e4m3x2"] == 8 * 18 * 4, dec
        bf16_route = dec[r"cvt.rn.bf16x2.f32 h\d, fu\d, fl\d;"]
        assert bf16_route == (dec["cvt.rn.f16x2.e4m3x2"] if dtype == "bf16" else 0), dec
    else:
        assert dec["cvt.rn.f16x2.e4m3x2"] == 0, dec
    comb = counts["combine"]
    assert comb["wgmma.mma_async"] == 0 and comb["ld.local"] == 0, comb
    # the input checks: a message (its arguments are the only local stores) and a trap, for the
    # length, for a page id and for a piece past its request's end (a schedule made for other
    # lengths), in each of the 4 variants
    printfs = comb[r"call.uni \(retval0\), vprintf"]
    assert printfs == 3 * 4 and comb["trap;"] == printfs and comb["st.local"] == 9 * 4, comb
    assert comb["griddepcontrol.wait"] >= 2 and comb["ld.global.v4"] > 0, comb
    # partials are written by the decode kernel while this grid may already run (PDL): never
    # through the non-coherent read-only path
    assert comb["ld.global.nc"] == 0, comb


# ptxas's figures for one entry of a PTX file, in the scripts below (run with python -c): the
# installed ptxas's -v output read as the DSL's remarks are (tools.ptxas_figures.kernel_figures).
PTXAS_FIGURES = r"""
def ptxas_figures(f, entry, arch="sm_90a"):
    import torch_mla  # (the tree's root on the path, whatever the working directory)
    sys.path.insert(0, os.path.dirname(os.path.dirname(torch_mla.__file__)))
    from tools.ptxas_figures import kernel_figures
    res = subprocess.run(["ptxas", f"-arch={arch}", "-v", f, "-o", os.devnull],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return kernel_figures(res.stderr, entry)
"""


# The DSL assembles its PTX with its own ptxas, also here without a GPU, and under this option
# prints that ptxas's output among its remarks (tools/ptxas_figures.py), so registers and spills
# can be read even where no ptxas binary is installed. The figures are an installed ptxas's where
# there is one (CI has CUDA 13's): the DSL's libraries for CUDA 12 (the CPU wheel) carry an older
# ptxas than the CUDA 13 one the device's build uses, and its spills differ by a few bytes
# (session 38: 16 against 12 at keys-on-M ping-pong 64 columns, 136 against at most 132 in the
# producer's sparse kernel over the 656-byte rows). The bounds below are CUDA 13's, so without a
# ptxas binary those two tests fail.
REMARKS = {"CUTE_DSL_COMPILER_OPT": "remarks{ptx}"}


KEYSM_SCRIPT = r"""
import glob, json, os, re, shutil, subprocess, sys
from torch_mla.ops import registry
""" + PTXAS_FIGURES + r"""
dtype, causal, cache, columns = sys.argv[1], sys.argv[2] == "causal", sys.argv[3], int(sys.argv[4])
backend, compute = sys.argv[5], sys.argv[6]
registry.build(registry.DecodeStepConfig(backend, dtype, causal, kv_fp8=cache == "fp8",
                                         columns=columns, compute=compute), "sm_90a")
counts, ptxas = {}, {}
for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")):
    text = open(f).read()
    for ptx in text.split(".entry ")[1:]:
        if "MLADecodeSm90KeysM" not in ptx.split("(", 1)[0]:
            continue
        for k in ["wgmma.mma_async", r"wgmma.mma_async.sync.aligned.(m64n\d+k16.f32.\w+.\w+)",
                  r"wgmma.mma_async.sync.aligned.(m64n\d+k\d+.f32.\w+.\w+)",
                  "cp.async.bulk.tensor", "ld.local", "st.local", "cvt.rn.f16x2.e4m3x2", "prmt.b32",
                  "satfinite.e4m3x2", "setmaxnreg", "griddepcontrol.launch_dependents", "vprintf",
                  "trap;", "mbarrier.try_wait"]:
            found = re.findall(k, ptx)
            counts[k] = sorted(set(found)) if "(" in k else len(found)
        if shutil.which("ptxas"):
            ptxas = ptxas_figures(f, "MLADecodeSm90KeysM")
print(json.dumps({"counts": counts, "ptxas": ptxas}))
"""


def keysm_run(dtype, causal, cache, columns, backend="sm90_keysm", compute="exact"):
    return python("-c", KEYSM_SCRIPT, dtype, causal, cache, columns, backend, compute,
                  env={"CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx", **REMARKS})


def keysm_ptx(dtype, causal, cache, columns, backend="sm90_keysm", compute="exact"):
    """KEYSM_SCRIPT's counts of one keys-on-M step build's PTX, and ptxas's figures (empty
    where ptxas is not installed)."""
    res = result(keysm_run(dtype, causal, cache, columns, backend, compute))
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return got["counts"], got["ptxas"] or kernel_figures(res.stdout + res.stderr,
                                                     "MLADecodeSm90KeysM")


def have_figures(p) -> bool:
    """Whether ptxas's figures for a kernel were read; where a ptxas binary is installed (CI
    has one) they must have been, so that a renamed entry cannot skip the checks unseen."""
    assert p or not shutil.which("ptxas"), "ptxas is installed, but no figures were read"
    return bool(p)


def assert_ptxas_clean(p):
    """ptxas (where installed): no spill, no serialised wgmma."""
    if have_figures(p):
        assert not p["serialised"], p
        assert p["spill"] == 0, p


@ahead(keysm_run)
@pytest.mark.parametrize("dtype,causal,cache,columns", [("bf16", "causal", "same", 16),
                                                        ("fp16", "plain", "same", 8),
                                                        ("bf16", "causal", "fp8", 32),
                                                        ("bf16", "plain", "fp8", 64),
                                                        ("bf16", "causal", "same", 64)])
def test_sm90_keysm_kernel_compiles(dtype, causal, cache, columns):
    """The keys-on-M kernel (sm90_keysm_decode.py, opt-in): per page 36 wgmma m64nNk16 of S^T
    and 32 of O^T with N the warpgroup's columns (at most 32: 64 columns are two consumer
    warpgroups, which take the producer warpgroup's registers by setmaxnreg), 9 TMA tile loads
    a page and 9 for Q a consumer, the fp8 expansion (8 cvt per 16 bytes, 18 units a page per
    128 consumer threads), no local memory in the PTX, no call. ptxas (where installed):
    registers printed, no spill and no serialised wgmma (at 64 columns with the setmaxnreg split
    of REGS)."""
    c, p = keysm_ptx(dtype, causal, cache, columns)
    consumers, n_wg = (2, 32) if columns == 64 else (1, columns)
    assert c["wgmma.mma_async"] == 36 + 32, c
    mma = r"wgmma.mma_async.sync.aligned.(m64n\d+k16.f32.\w+.\w+)"
    # (over an e4m3 cache the MMAs take f16: bf16 q is converted once a segment)
    ptx_type = "f16" if cache == "fp8" else {"bf16": "bf16", "fp16": "f16"}[dtype]
    assert c[mma] == [f"m64n{n_wg}k16.f32.{ptx_type}.{ptx_type}"], c
    assert c["cp.async.bulk.tensor"] == 9 + 9 * consumers, c
    assert c["ld.local"] == c["st.local"] == c["vprintf"] == c["trap;"] == 0, c
    assert c["griddepcontrol.launch_dependents"] == 1, c
    assert c["setmaxnreg"] == (2 if consumers == 2 else 0), c
    assert c["cvt.rn.f16x2.e4m3x2"] == (8 * 18 // consumers if cache == "fp8" else 0), c
    print(f"keysm {dtype} {causal} {cache} {columns} columns (N = {n_wg}): ptxas {p}")
    assert_ptxas_clean(p)


@ahead(lambda dtype, causal, columns: keysm_run(dtype, causal, "fp8", columns, "sm90_keysm_rs"))
@pytest.mark.parametrize("dtype,causal,columns", [("bf16", "causal", 16), ("fp16", "plain", 8),
                                                  ("bf16", "plain", 32), ("bf16", "plain", 64)])
def test_sm90_keysm_rs_kernel_compiles(dtype, causal, columns):
    """The ping-pong keys-on-M kernel (sm90_keysm_rs_decode.py): per page 36 + 32
    wgmma m64nNk16 f16 with A from registers, S^T's 144 and O^T's 128 conversions a thread (the
    page converted once for each MMA) and O^T's 64 byte pairings (prmt), one TMA box a page and
    9 tiles for Q, setmaxnreg (two consumer warpgroups and a producer warpgroup), no local memory
    in the PTX; ptxas (where installed): no spill, no serialised wgmma (at 32 columns O^T's
    A in two m-tile groups and 240 registers a consumer thread). At 64 columns the two
    warpgroups take 32 columns each (N = 32; Q's 9 tiles for each), and ptxas spills 12 bytes
    (the epilogue's: none without it; tried in session 24: one epilogue copy a warpgroup took it
    from 104 to 12, the lse stores first and four O^T groups did not help)."""
    c, p = keysm_ptx(dtype, causal, "fp8", columns, "sm90_keysm_rs")
    mma = r"wgmma.mma_async.sync.aligned.(m64n\d+k16.f32.\w+.\w+)"
    n_wg, sets = min(columns, 32), max(columns // 32, 1)
    assert c["wgmma.mma_async"] == 36 + 32, c
    assert c[mma] == [f"m64n{n_wg}k16.f32.f16.f16"], c
    assert c["cvt.rn.f16x2.e4m3x2"] == 144 + 128 and c["prmt.b32"] == 64, c
    assert c["cp.async.bulk.tensor"] == 1 + 9 * sets, c  # a page in one box; Q
    assert c["setmaxnreg"] == 2, c
    assert c["ld.local"] == c["st.local"] == c["vprintf"] == c["trap;"] == 0, c
    assert c["griddepcontrol.launch_dependents"] == 1, c
    print(f"keysm_rs {dtype} {causal} {columns} columns: ptxas {p}")
    if columns == 64 and p:
        assert not p["serialised"] and p["spill"] <= 12, p
    else:
        assert_ptxas_clean(p)


@ahead(lambda dtype, causal, columns: keysm_run(dtype, causal, "fp8", columns, "sm90_keysm_fast",
                                               "fp8"))
@pytest.mark.parametrize("dtype,causal,columns", [("bf16", "causal", 16), ("fp16", "plain", 8),
                                                  ("bf16", "plain", 32)])
def test_sm90_keysm_fast_kernel_compiles(dtype, causal, columns):
    """Fast mode of the ping-pong variant (sm90_keysm_fast_decode.py): per page one TMA box,
    18 e4m3 wgmma m64nNk32 for S^T and O^T's 32 f16 ones, both with A from registers (O^T's:
    128 conversions, 64 prmt a thread), Q quantized by 32 cvt.rn.satfinite.e4m3x2 a thread a
    segment (twice at 32 columns), no local memory; ptxas (where installed): no spill, no serialised wgmma."""
    c, p = keysm_ptx(dtype, causal, "fp8", columns, "sm90_keysm_fast", "fp8")
    assert c["wgmma.mma_async"] == 18 + 32, c
    assert c[r"wgmma.mma_async.sync.aligned.(m64n\d+k\d+.f32.\w+.\w+)"] == [
        f"m64n{columns}k16.f32.f16.f16", f"m64n{columns}k32.f32.e4m3.e4m3"], c
    assert c["cvt.rn.f16x2.e4m3x2"] == 128 and c["prmt.b32"] == 64, c
    assert c["satfinite.e4m3x2"] == 32 * (2 if columns == 32 else 1), c  # (288 runs: 2 waves)
    assert c["cp.async.bulk.tensor"] == 1 + 9, c  # a page in one box; Q
    assert c["ld.local"] == c["st.local"] == c["vprintf"] == c["trap;"] == 0, c
    print(f"keysm_fast {dtype} {causal} {columns} columns: ptxas {p}")
    assert_ptxas_clean(p)


SPARSE_SCRIPT = r"""
import glob, json, os, re, sys
from torch_mla.ops import registry
registry.build(registry.SparseStepConfig("sm90", sys.argv[1], sys.argv[2]), "sm_90a")
counts = {"decode": {}, "combine": {}}
entries = {"decode": 0, "combine": 0}
for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")):
    for ptx in open(f).read().split(".entry ")[1:]:
        name = ptx.split("(", 1)[0]
        kind = "decode" if "MLASparseDecodeSm90" in name else "combine"
        assert kind == "decode" or "MLASparseCombine" in name, name
        entries[kind] += 1
        for k in ["wgmma.mma_async", "wgmma.mma_async.*bf16", "wgmma.mma_async.*f16.f16",
                  "cp.async.cg.shared.global", "cp.async.ca.shared.global",
                  "cvt.rn.f16x2.e4m3x2", "mul.rn.f32", "cp.async.mbarrier.arrive.noinc.shared",
                  "mbarrier.arrive.shared", "fence.proxy.async",
                  "cp.async.bulk.tensor", "mbarrier.arrive.expect_tx",
                  "stmatrix", "ldmatrix",
                  "cp.async.bulk.global", "griddepcontrol.launch_dependents", "ld.local",
                  "st.local", r"call.uni \(retval0\), vprintf", "trap;", "%globaltimer"]:
            counts[kind][k] = counts[kind].get(k, 0) + len(re.findall(k, ptx))
assert entries == {"decode": 1, "combine": 4}, entries
print(json.dumps(counts))
"""


def sparse_run(dtype, cache):
    return python("-c", SPARSE_SCRIPT, dtype, cache,
                  env={"CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx"})


@ahead(sparse_run)
@pytest.mark.parametrize("dtype,cache", [("bf16", "plain"), ("fp16", "plain"), ("bf16", "e4m3"),
                                         ("bf16", "fp8_ds_mla")])
def test_sm90_sparse_kernel_compiles(dtype, cache):
    """The SM90 sparse decode step (cute_kernels/sm90_sparse_decode.py): the dense SM90
    kernel's 16-bit MMAs, its cache tiles gathered by 16-byte cp.async copies completing on
    the tile's mbarrier through cp.async.mbarrier.arrive.noinc (with one plain arrival after
    the bias row), issued by the four warps of a warpgroup (a quarter of the rows each):
    16-bit tiles 4 copies a lane, fp8 tiles 2 (the FP8 caches, expanded in
    shared memory by the dense kernel's kv_fp8 path: cvt.rn.f16x2.e4m3x2, and for the
    656-byte rows the multiply by each group's scale, gathered 8 bytes a row by cp.async.ca);
    fenced for the MMAs' proxy; the sparse combine's checks; no local memory, no call in the
    decode kernel."""
    res = result(sparse_run(dtype, cache))
    assert res.returncode == 0, res.stderr[-4000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    dec, comb = counts["decode"], counts["combine"]
    mma = dec["wgmma.mma_async.*bf16" if dtype == "bf16" else "wgmma.mma_async.*f16.f16"]
    assert mma == dec["wgmma.mma_async"] >= 100, dec
    # Tile loads in the PTX: 56 (where the dense kernel has its TMA tile loads: 8 of them take
    # tile 8, the 656-byte rows' bf16 rope tile, and 10 load sites in all). Q's boxes (4-d:
    # tokens and requests are two modes of the folded view; 9 boxes at 3 load sites, one
    # expect_tx each) are the only TMA loads.
    tiles = dec["cp.async.mbarrier.arrive.noinc.shared"]
    copies = {"plain": 4 * tiles, "e4m3": 2 * tiles, "fp8_ds_mla": 2 * (tiles - 8) + 4 * 8}
    assert tiles == 56 and dec["cp.async.cg.shared.global"] == copies[cache], dec
    # (2 a lane and buffer half: 56 tiles in 12 halves)
    assert dec["cp.async.ca.shared.global"] == (2 * 12 if cache == "fp8_ds_mla" else 0), dec
    # the expansion: 8 cvt a 2 KB wave, 8 (4) waves a buffer half; 16 multiplies a wave
    waves = {"plain": 0, "e4m3": 4 * (8 + 10), "fp8_ds_mla": 4 * (8 + 8)}[cache]
    assert dec["cvt.rn.f16x2.e4m3x2"] == 8 * waves, dec
    assert dec["mul.rn.f32"] == (16 * waves if cache == "fp8_ds_mla" else 0), dec
    assert dec["mbarrier.arrive.shared"] == tiles, dec
    assert dec["cp.async.bulk.tensor"] == 27 and dec["mbarrier.arrive.expect_tx"] == 3, dec
    assert dec["fence.proxy.async"] > 0, dec
    assert dec["stmatrix"] > 0 and dec["ldmatrix"] > 0, dec
    assert dec["cp.async.bulk.global"] > 0 and dec["griddepcontrol.launch_dependents"] == 1, dec
    assert dec["ld.local"] == dec["st.local"] == dec["%globaltimer"] == 0, dec
    assert dec[r"call.uni \(retval0\), vprintf"] == dec["trap;"] == 0, dec
    # the sparse combine (sm80_sparse_decode.MLASparseCombine): topk_length, a bad entry, a
    # schedule for other lengths, in each of the 4 variants
    assert comb[r"call.uni \(retval0\), vprintf"] == comb["trap;"] == 3 * 4, comb
    assert comb["wgmma.mma_async"] == comb["ld.local"] == 0, comb


PRODUCER_SPARSE_SCRIPT = r"""
import glob, json, os, re, shutil, subprocess, sys
from torch_mla.ops import registry
""" + PTXAS_FIGURES + r"""
backend, cls = sys.argv[3], sys.argv[4]  # ("sm90_producer", its class name) or the split's
columns = int(sys.argv[5]) if len(sys.argv) > 5 else 0  # (the split's cluster pair: 128)
short = len(sys.argv) > 6 and sys.argv[6] == "True"  # (the split's short build)
registry.build(registry.SparseStepConfig(backend, sys.argv[1], sys.argv[2], columns, short),
               "sm_90a")
counts, ptxas = {}, {}
for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")):
    for ptx in open(f).read().split(".entry ")[1:]:
        if cls not in ptx.split("(", 1)[0]:
            continue
        for k in ["wgmma.mma_async", "cp.async.cg.shared.global", "cvt.rn.f16x2.e4m3x2",
                  "mul.rn.f32", "cp.async.mbarrier.arrive.shared", "prefetch.global.L2",
                  "ld.global.nc.L1::no_allocate.v4", "ld.global.nc.L1::no_allocate.v2",
                  "setmaxnreg", "cp.async.bulk.tensor",
                  "st.async", "barrier.cluster.arrive", "barrier.cluster.wait",
                  "mbarrier.arrive.release.cluster", "mbarrier.arrive.shared::cluster.b64",
                  "mbarrier.arrive.expect_tx",
                  "try_wait.parity.acquire.cluster",
                  "ld.local", "st.local", "vprintf", "trap;", "%globaltimer", "%clock64",
                  "st.global.v4", "ld.shared.v4", "cp.async.bulk.global.shared"]:
            counts[k] = counts.get(k, 0) + len(re.findall(re.escape(k), ptx))
        for v in ("v4", "v2"):  # (the read-only loads, whatever their cache hints)
            counts["ldnc." + v] = counts.get("ldnc." + v, 0) + len(
                re.findall(r"ld\.global\.nc[\w:.]*\." + v + r"\.b32", ptx))
        # (setmaxnreg's direction and count: .dec to a larger count is an illegal instruction)
        counts["setmaxnreg_to"] = sorted(re.findall(r"setmaxnreg\.(inc|dec)\S*\s+(\d+)", ptx))
        if shutil.which("ptxas"):
            ptxas = ptxas_figures(f, cls)
print(json.dumps({"counts": counts, "ptxas": ptxas}))
"""


def producer_run(dtype, cache, backend="sm90_producer", cls="MLASparseDecodeSm90Producer",
                 columns=0, short=False):
    return python("-c", PRODUCER_SPARSE_SCRIPT, dtype, cache, backend, cls, columns, short,
                  env={"CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx", **REMARKS})


def split_run(dtype, cache, columns, short):
    return producer_run(dtype, cache, "sm90_split", "MLASparseDecodeSm90Split", columns, short)


def _producer_counts(dtype, cache, backend, cls, columns=0, short=False):
    """PRODUCER_SPARSE_SCRIPT on one producer-kernel variant: (PTX counts, ptxas figures)."""
    res = result(producer_run(dtype, cache, backend, cls, columns, short))
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    return got["counts"], got["ptxas"] or kernel_figures(res.stdout + res.stderr, cls)


@ahead(producer_run)
@pytest.mark.parametrize("dtype,cache", [("bf16", "fp8_ds_mla"), ("fp16", "plain")])
def test_sm90_producer_sparse_kernel_compiles(dtype, cache):
    """The SM90 sparse kernel with a producer warpgroup (sm90_producer_sparse_decode.py; opt-in):
    the consumers' MMAs as the SM90 sparse kernel's (196 wgmma); four inlined fills a pair of
    blocks (two halves in each buffer). Over the 656-byte rows each fill loads a thread's 8
    chunks by ld.global.nc (AHEAD of them before the release, the others' lines prefetched
    into L2) and its two scale words, converts 8 cvt a chunk with 16 multiplies by the group's
    scale, and copies the rope tile by cp.async over half 1 (4 copies a thread); over the
    16-bit cache 4 copies a tile and thread by cp.async. The copies are tracked by
    cp.async.mbarrier.arrive (not .noinc); setmaxnreg on both sides; no local memory in the
    PTX, no call. ptxas (where installed): no serialised wgmma; the 16-bit cache no spill, the
    656-byte rows at most 132 bytes at AHEAD 2 (the producer's 56 registers: session 27, not
    placed: no disassembler here)."""
    from torch_mla.cute_kernels.sm90_producer_sparse_decode import AHEAD

    c, p = _producer_counts(dtype, cache, "sm90_producer", "MLASparseDecodeSm90Producer")
    assert c["wgmma.mma_async"] == 196, c
    ds = cache == "fp8_ds_mla"
    assert c["cp.async.cg.shared.global"] == (2 * 4 if ds else 2 * 4 * (4 + 5)), c
    assert c["cp.async.mbarrier.arrive.shared"] == (2 if ds else 4), c
    assert c["ld.global.nc.L1::no_allocate.v4"] == (4 * 8 if ds else 0), c
    assert c["prefetch.global.L2"] == (4 * (8 - AHEAD) if ds else 0), c
    assert c["cvt.rn.f16x2.e4m3x2"] == (4 * 8 * 8 if ds else 0), c
    assert c["mul.rn.f32"] == (4 * 8 * 16 if ds else 0), c
    assert c["setmaxnreg"] == 2 and c["cp.async.bulk.tensor"] == 27, c
    assert c["setmaxnreg_to"] == [["dec", "56"], ["inc", "224"]], c
    assert c["ld.local"] == c["st.local"] == c["vprintf"] == c["trap;"] == 0, c
    print(f"sm90_producer {dtype} {cache}: ptxas {p}")
    if have_figures(p):
        # (setmaxnreg's split, REGS, assumes 168 a thread at launch: 56 x 128 + 224 x 256)
        assert not p["serialised"] and p["registers"] == 168, p
        assert p["spill"] <= ((132 if AHEAD == 2 else 324) if ds else 0), p



@ahead(split_run)
@pytest.mark.parametrize("dtype,cache,columns,short", [
    ("bf16", "fp8_ds_mla", 0, False), ("fp16", "plain", 0, False),
    ("bf16", "fp8_ds_mla", 128, False), ("bf16", "fp8_ds_mla", 0, True),
    ("bf16", "fp8_ds_mla", 128, True)])
def test_sm90_split_sparse_kernel_compiles(dtype, cache, columns, short):
    """The SM90 sparse kernel with FlashMLA's warpgroup split (sm90_split_sparse_decode.py;
    the default at 64-128 heads over the 16-bit cache and the 656-byte rows). Its producer
    fills one block a loop step, the buffer a runtime index: two inlined fills (one a half).
    Over the 656-byte rows each loads its 8 chunks of 16 fp8 bytes (two keys, four chunks
    each; with the pair, SECTORS, each chunk as two 8-byte loads) and 2 x 2 scale words by
    ld.global.nc before the release, none prefetched into L2,
    converts 8 cvt a chunk with 16 multiplies, and copies the rope tile over half 1 (4 copies
    a thread); over the 16-bit cache 4 copies a tile and thread. WG0's
    Q K^T of 36 k-steps all from shared memory and its P V, WG1's P V, in the two inlined
    block sites (two blocks a loop step, the second where it exists): 2 x (36 + 4 + 4) wgmma;
    the body traced once a warpgroup (each copy only its warpgroup's code: one setmaxnreg
    each, the Q loads only in WG0's copy); REGS summing to 3 x 168 (the increases take what
    the decreases free), each warpgroup's setmaxnreg going the way its count lies from
    launch's. ptxas (where installed): 168 registers at launch, no serialised wgmma (C7512: a
    consumer's budget too small), spill at most 64 bytes over the 656-byte rows (0-48 seen in
    session 29's builds) and none over the 16-bit cache.

    columns 128, the cluster pair (the 656-byte rows at h_q 65-128): each producer converts one
    round of 32 keys a half (half the loads, cvt and multiplies) and stores every chunk here
    and by st.async into the peer (16 a fill); thread 0's arrival expects the peer's bytes
    (one expect_tx a fill beyond the Q loads' three); releases go to both CTAs (8 remote
    arrivals, mbarrier.arrive.shared::cluster: PTX's default .release.cta, as CUTLASS's
    cluster pipelines release; at SCOPE "cluster" release.cluster ones, and the waits they
    complete acquiring at cluster scope); each traced copy syncs the cluster after the
    barriers' set-up and at the end. Its producer loads the next block's chunks before
    converting this block's (LOOKAHEAD_PAIR 2): the chunk and scale loads at two sites, the
    segment's first block and the loop's next.

    short, the build for parts of few blocks (EPI_COPY, ENTRY_EARLY, META_EARLY and, with the
    pair, ENTRY_EARLY2 on): O copied out by the threads (ld.shared.v4 and st.global.v4, in a
    loop unrolled 4 times in each warpgroup's copy of the epilogue, for each output dtype), no
    bulk store from shared memory; the default build the reverse (over the 656-byte rows
    only)."""
    from torch_mla.cute_kernels.sm90_split_sparse_decode import (
        EPI_COPY,
        LOOKAHEAD_PAIR,
        REGS,
        SCOPE,
    )

    assert sum(REGS) == 3 * 168, REGS
    c, p = _producer_counts(dtype, cache, "sm90_split", "MLASparseDecodeSm90Split", columns,
                            short)
    copies = short or EPI_COPY == 1
    assert (c["st.global.v4"] > 0) == copies and (c["ld.shared.v4"] > 0) == copies, c
    assert c["st.global.v4"] == c["ld.shared.v4"], c
    assert (c["cp.async.bulk.global.shared"] == 0) == copies, c
    # (WG0's two block sites, 36 Q K^T and 4 P V wgmma each, WG1's 4 each)
    assert c["wgmma.mma_async"] == 2 * (36 + 4 + 4), c
    ds = cache == "fp8_ds_mla"
    rounds = 1 if columns else 2
    ahead = LOOKAHEAD_PAIR if columns else 0
    sites = {0: 1, 2: 2}.get(ahead)  # (the load sites: the docstring)
    assert sites, f"no load-site count written for a lookahead of {ahead}"
    assert c["cp.async.cg.shared.global"] == (4 if ds else 4 * (4 + 5)), c
    # (with the pair each chunk is two 8-byte loads, .v2: sector_load_offsets)
    halves = 2 * 4 * rounds * sites if ds else 0  # (chunk loads: 4 a half and round)
    split8 = bool(columns)
    assert c["ldnc.v4"] == (0 if split8 else halves), c
    assert c["ldnc.v2"] == (2 * rounds * sites if ds else 0) + (2 * halves if split8 else 0), c
    assert c["prefetch.global.L2"] == 0, c
    assert c["cvt.rn.f16x2.e4m3x2"] == (2 * 4 * rounds * 8 if ds else 0), c
    assert c["mul.rn.f32"] == (2 * 4 * rounds * 16 if ds else 0), c
    assert c["st.async"] == (2 * 4 * 2 if columns else 0), c
    assert c["barrier.cluster.arrive"] == c["barrier.cluster.wait"] == (6 if columns else 0), c
    # (the releases to the peer: WG0's four at a segment's start, both buffers' halves, and
    # the block sites')
    cluster = bool(columns) and SCOPE == "cluster"
    assert c["mbarrier.arrive.release.cluster"] == (8 if cluster else 0), c
    assert c["mbarrier.arrive.shared::cluster.b64"] == (8 if columns and not cluster else 0), c
    # (at SCOPE "cluster", the waits a peer's release completes: WG0's for each half at its
    # two block sites, the producer's for a free half at its two fills)
    assert c["try_wait.parity.acquire.cluster"] == (2 * 2 + 2 if cluster else 0), c
    assert c["mbarrier.arrive.expect_tx"] == 3 + (2 if columns else 0), c
    assert c["setmaxnreg"] == 3 and c["cp.async.bulk.tensor"] == 27, c
    # (.dec to a larger count is an illegal instruction: an H200 run of session 28's first
    # build, which decreased WG1 "to" 216, stopped on one)
    want = [["inc" if n > 168 else "dec", str(n)] for n in REGS]
    assert c["setmaxnreg_to"] == sorted(want), c
    assert c["ld.local"] == c["st.local"] == c["vprintf"] == c["trap;"] == 0, c
    # (the trace points, _stamp, are no-ops outside tools/trace_sparse.py's build)
    assert c["%globaltimer"] == c["%clock64"] == 0, c
    print(f"sm90_split {dtype} {cache}: ptxas {p}")
    if have_figures(p):
        assert not p["serialised"] and p["registers"] == 168, p
        assert p["spill"] <= (64 if ds else 0), p

KEYSM_SPARSE_SCRIPT = r"""
import glob, json, os, re, sys
from torch_mla.ops import registry
registry.build(registry.SparseStepConfig("sm90_keysm", sys.argv[1], sys.argv[2],
                                         int(sys.argv[3])), "sm_90a")
counts = {}
for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx")):
    for ptx in open(f).read().split(".entry ")[1:]:
        if "MLASparseDecodeKeysM" not in ptx.split("(", 1)[0]:
            continue
        for k in ["wgmma.mma_async", "cp.async.cg.shared.global", "cvt.rn.f16x2.e4m3x2",
                  "mul.rn.f32", "cp.async.mbarrier.arrive.noinc.shared", "fence.proxy.async",
                  "cp.async.bulk.tensor", "ld.local", "st.local", "vprintf", "trap;"]:
            counts[k] = counts.get(k, 0) + len(re.findall(re.escape(k), ptx))
print(json.dumps(counts))
"""


def keysm_sparse_run(dtype, cache, columns):
    return python("-c", KEYSM_SPARSE_SCRIPT, dtype, cache, columns,
                  env={"CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx"})


@ahead(keysm_sparse_run)
@pytest.mark.parametrize("dtype,cache,columns", [("bf16", "plain", 16), ("fp16", "e4m3", 32),
                                                 ("bf16", "fp8_ds_mla", 16)])
def test_keysm_sparse_kernel_compiles(dtype, cache, columns):
    """The keys-on-M sparse decode step (cute_kernels/sm90_keysm_sparse_decode.py): the
    keys-on-M kernel's MMAs (36 S^T + 32 O^T wgmma); its producer warp's gather, 16 16-byte
    cp.async copies a lane and 16-bit tile (8 a fp8 tile) over the page's 9 tiles, completing
    on the stage's full mbarrier through one cp.async.mbarrier.arrive.noinc; Q's 9 TMA boxes
    the only TMA loads; a proxy fence before the MMAs read a 16-bit stage; no local memory."""
    res = result(keysm_sparse_run(dtype, cache, columns))
    assert res.returncode == 0, res.stderr[-4000:]
    c = json.loads(res.stdout.strip().splitlines()[-1])
    assert c["wgmma.mma_async"] == 36 + 32, c
    # 16-bit tiles 16 copies a lane, fp8 tiles 8; the 656-byte rows: 8 fp8 tiles, the bf16
    # rope tile 2 a lane and row step (16), the scales one a lane and row (2)
    copies = {"plain": 9 * 16, "e4m3": 9 * 8, "fp8_ds_mla": 8 * 8 + 16 + 2}[cache]
    assert c["cp.async.cg.shared.global"] == copies, c
    assert c["cp.async.mbarrier.arrive.noinc.shared"] == 1 and c["cp.async.bulk.tensor"] == 9, c
    tiles8 = {"plain": 0, "e4m3": 9, "fp8_ds_mla": 8}[cache]
    assert c["cvt.rn.f16x2.e4m3x2"] == 8 * tiles8 * 256 // 128, c
    assert c["mul.rn.f32"] == (16 * 8 * 256 // 128 if cache == "fp8_ds_mla" else 0), c
    assert c["fence.proxy.async"] > 0, c
    assert c["ld.local"] == c["st.local"] == c["vprintf"] == c["trap;"] == 0, c


KEYSM_RS_SPARSE_SCRIPT = r"""
import glob, json, os, re, shutil, subprocess, sys
from torch_mla.ops import registry
""" + PTXAS_FIGURES + r"""
registry.build(registry.SparseStepConfig("sm90_keysm_rs", sys.argv[1], sys.argv[3],
                                        int(sys.argv[2])), "sm_90a")
counts = {}
(f,) = [g for g in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx"))]
for ptx in open(f).read().split(".entry ")[1:]:
    if "MLASparseDecodeKeysMRS" not in ptx.split("(", 1)[0]:
        continue
    for k in ["wgmma.mma_async", "cp.async.cg.shared.global", "cvt.rn.f16x2.e4m3x2",
              "cp.async.mbarrier.arrive.noinc.shared", "cp.async.bulk.tensor", "setmaxnreg",
              "mul.rn.f16x2", "cvt.rn.f16x2.f32", "cvt.rn.bf16x2.f32", "ld.shared.b32",
              ".bf16.bf16", "ld.local", "st.local", "vprintf", "trap;"]:
        counts[k] = counts.get(k, 0) + len(re.findall(re.escape(k), ptx))
if shutil.which("ptxas"):
    p = ptxas_figures(f, "MLASparseDecodeKeysMRS")
    counts["spill"], counts["serialised"] = p["spill"], p["serialised"]
print(json.dumps(counts))
"""


def keysm_rs_sparse_run(dtype, cache, columns):
    return python("-c", KEYSM_RS_SPARSE_SCRIPT, dtype, columns, cache,
                  env={"CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP": "ptx", **REMARKS})


@ahead(keysm_rs_sparse_run)
@pytest.mark.parametrize("dtype,cache,columns", [("bf16", "e4m3", 16), ("fp16", "e4m3", 8),
                                                  ("bf16", "fp8_ds_mla", 16),
                                                  ("bf16", "fp8_ds_mla", 8), ("bf16", "e4m3", 32),
                                                  ("bf16", "fp8_ds_mla", 32), ("bf16", "e4m3", 64),
                                                  ("bf16", "fp8_ds_mla", 64)])
def test_keysm_rs_sparse_kernel_compiles(dtype, cache, columns):
    """The sparse ping-pong step (cute_kernels/sm90_keysm_rs_sparse_decode.py; not yet checked
    on a GPU): the ping-pong's MMAs (36 + 32 wgmma a page) and e4m3 conversions (144 + 128 a
    thread over e4m3; 128 + 128 over the 656-byte rows, whose 4 rope k-steps are bf16 MMAs on
    the loaded words), setmaxnreg; its producer warp's gather, 8 row steps x 9 (e4m3) or 10
    (the 656-byte rows: 8 of values, 2 of rope; and 2 of scales a lane) 16-byte cp.async a
    lane, completing on the stage's full mbarrier through one cp.async.mbarrier.arrive.noinc;
    over the 656-byte rows O^T's A values times their scales (128 f16x2 multiplies a page, the
    scales read as 4-byte words, 16 a page) and Q's rope copied in bf16 (8 conversions a
    wave that can hold the rope run); Q's 9 TMA boxes the only TMA loads; no local memory;
    ptxas (where installed): no spill at 8 and 16 columns, no serialised wgmma. At 32 and 64
    columns (32 a warpgroup): over the 656-byte rows S^T's A values are multiplied by their
    scales too (128 more f16x2 multiplies, the scales read a scale group at a time). At 32 the
    gather's steps are a loop (its producer's 24 registers: no spill), and the merge over the
    656-byte rows takes 21 rounds of 7 floats (scalar loads: 144 a thread; ptxas spills 20
    bytes there). At 64 (two warpgroups of their own columns, one epilogue copy each, Q's
    boxes for both) ptxas spills up to 20 bytes outside the page loop."""
    res = result(keysm_rs_sparse_run(dtype, cache, columns))
    assert res.returncode == 0, res.stderr[-4000:]
    c = json.loads(res.stdout.strip().splitlines()[-1])
    if "spill" not in c:  # (no ptxas binary: the DSL's own ptxas's remarks)
        p = kernel_figures(res.stdout + res.stderr, "MLASparseDecodeKeysMRS")
        if p:
            c["spill"], c["serialised"] = p["spill"], p["serialised"]
    ds = cache == "fp8_ds_mla"
    sets = 2 if columns == 64 else 1  # (warpgroups of their own columns)
    assert c["wgmma.mma_async"] == 36 + 32, c
    assert c[".bf16.bf16"] == (4 if ds else 0), c  # the rope k-steps
    assert c["cvt.rn.f16x2.e4m3x2"] == (128 if ds else 144) + 128, c
    # (at 32 columns the gather's 8 row steps are two loops of 4, one a lane's entry)
    steps = 2 if columns == 32 else 8
    assert c["cp.async.cg.shared.global"] == steps * (10 if ds else 9) + (2 if ds else 0), c
    assert c["mul.rn.f16x2"] == (128 * (1 + (columns >= 32)) if ds else 0), c
    # (scale words: O^T's 16; S^T's folded ones 8, two a scale group; the merge's 144 at 32)
    folded = 8 if columns >= 32 else 0
    assert c["ld.shared.b32"] == 2 + (16 + folded + (144 if columns == 32 else 0) if ds
                                      else 0), c
    # (the output's conversions; over the 656-byte rows Q's rope in bf16, 32 a wave that can
    # hold it: the second of two at 32 columns, the last of three at 64 (LLVM drops the rest)
    out_cvt = 2 * min(columns, 32) * sets if dtype == "bf16" else 0
    assert c["cvt.rn.bf16x2.f32"] == out_cvt + (32 * (1 + (columns == 32)) if ds else 0), c
    assert c["cp.async.mbarrier.arrive.noinc.shared"] == 1, c
    assert c["cp.async.bulk.tensor"] == 9 * sets, c
    assert c["setmaxnreg"] == 2, c
    assert c["ld.local"] == c["st.local"] == c["vprintf"] == c["trap;"] == 0, c
    if "spill" in c:
        # (nvdisasm, session 25: at 32 columns the 656-byte rows' 20 bytes are the merge
        # rounds'; at 64 values held across the warpgroups' register split and the segment's
        # end; none in a page loop)
        bound = {32: 20 if ds else 0, 64: 20}.get(columns, 0)
        assert c["spill"] <= bound and not c["serialised"], c


PORTABLE_SPARSE_SCRIPT = r"""
import glob, json, os, re, shutil, subprocess, sys
from torch_mla.ops import registry
""" + PTXAS_FIGURES + r"""
from torch_mla.cute_kernels.sm80_decode import Sm80DecodeConfig
dtype, cache = sys.argv[1], sys.argv[2]
out = {}
for arch in sys.argv[3].split(","):
    cfg = Sm80DecodeConfig.from_heuristic(arch)
    registry.build(registry.SparseStepConfig("sm80", dtype, cache), arch)
    (f,) = glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], f"*.{arch}.ptx"))
    c = {"tiles": [cfg.block_m, cfg.block_n, cfg.stages], "threads": cfg.num_threads}
    for ptx in open(f).read().split(".entry ")[1:]:
        if "MLASparseDecodeSm80" not in ptx.split("(", 1)[0]:
            continue
        for k in ["cvt.rn.f16x2.e4m3x2", "prmt.b32", "mul.rn.f16x2", "mul.rn.f32",
                  "cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32", "ld.global.nc.v4.b32",
                  "cp.async.cg.shared.global", "st.shared.v4.b32",
                  "mma.sync.aligned.m16n8k16.row.col.f32", "ld.local", "st.local", "call.uni"]:
            c[k] = len(re.findall(re.escape(k), ptx))
    if shutil.which("ptxas"):
        p = ptxas_figures(f, "MLASparseDecodeSm80", arch)
        c["registers"], c["spill"] = p["registers"], p["spill"]
    for g in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*")):
        os.remove(g)
    out[arch] = c
print(json.dumps(out))
"""


# The portable sparse step over each cache format: sm_90a (64x64x2 tiles, the e4m3 cvt) and
# sm_86 (32x16x3, no e4m3 cvt before SM89: the integer path); ~5 s a compile.
def portable_sparse_run(dtype, cache, archs):
    return python("-c", PORTABLE_SPARSE_SCRIPT, dtype, cache, ",".join(archs),
                  env={"CUTE_DSL_ARCH": None, "CUTE_DSL_KEEP": "ptx"}, timeout=900)


@ahead(portable_sparse_run)
@pytest.mark.parametrize("dtype,cache,archs", [("bf16", "fp8_ds_mla", ["sm_90a", "sm_86"]),
                                               ("bf16", "e4m3", ["sm_90a"]),
                                               ("fp16", "e4m3", ["sm_86", "sm_90a"]),
                                               ("bf16", "plain", ["sm_90a"])])
def test_portable_sparse_kernel_compiles(dtype, cache, archs):
    """The portable sparse decode step (cute_kernels/sm80_sparse_decode.py) over its cache
    formats: the 16-bit MMAs of the portable kernel; over an FP8 cache the gather's 16-byte
    global loads (latent units: 4 a row and load site; a 656-byte row's scales, one load; an
    e4m3 row's rope, one load by threads 0-3), each unit's 8 conversions (cvt, or prmt and
    integer ops before SM89) and two 16-byte shared stores, the 656-byte rows' scale multiply
    (f32) and bf16 rope by cp.async; no local memory; ptxas (where installed): registers,
    spill (sm_90a's 255-register build spills 8 bytes, as the dense portable kernel does)."""
    res = result(portable_sparse_run(dtype, cache, archs))
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for arch, c in got.items():
        bm, bn, st = c["tiles"]
        rows = bn * 8 // c["threads"]  # key rows a thread gathers per stage
        # load sites: the prologue's st - 1 stages, a turn's rope tile, its latent tiles (by
        # the late quad, or all) and, with two quads (lag), the early quad's in _stage
        latent_sites = (st - 1) + 1 + (1 if bm == 64 else 0)
        rope_sites = (st - 1) + 1
        units = 4 * latent_sites * rows + (rope_sites * rows if cache == "e4m3" else 0)
        steps = bn // 16
        assert c["mma.sync.aligned.m16n8k16.row.col.f32"] == 36 * steps + 32 * steps, c
        assert c["ld.local"] == c["st.local"] == c["call.uni"] == 0, c
        q_copies = bm * D_QK // 8 // c["threads"]
        if cache == "plain":
            assert c["ld.global.nc.v4.b32"] == c["cvt.rn.f16x2.e4m3x2"] == c["prmt.b32"] == 0, c
            assert c["cp.async.cg.shared.global"] > q_copies, c
            continue
        scales = latent_sites * rows if cache == "fp8_ds_mla" else 0
        assert c["ld.global.nc.v4.b32"] == units + scales, c
        assert c["st.shared.v4.b32"] >= 2 * units, c
        hw = arch == "sm_90a"
        assert c["cvt.rn.f16x2.e4m3x2"] == (8 * units if hw else 0), c
        assert c["prmt.b32"] == c["mul.rn.f16x2"] == (0 if hw else 8 * units), c
        assert c["mul.rn.f32"] == (16 * units if cache == "fp8_ds_mla" else 0), c
        pack = "cvt.rn.bf16x2.f32" if dtype == "bf16" else "cvt.rn.f16x2.f32"
        assert c[pack] >= (8 * units if dtype == "bf16" or cache == "fp8_ds_mla" else 0), c
        rope_copies = rope_sites * rows if cache == "fp8_ds_mla" else 0
        assert c["cp.async.cg.shared.global"] == q_copies + rope_copies, c
        if "registers" in c:
            assert c["registers"] <= 255 and c["spill"] <= (8 if hw else 0), (arch, c)
        print(arch, dtype, cache, c)


SPARSE_SIGNATURE_SCRIPT = r"""
import re
from torch_mla.ops import registry
for cache in ("plain", "e4m3", "fp8_ds_mla"):
    fn = registry.compiled(registry.SparseStepConfig("sm80", "bf16", cache), "sm_86")
    try:
        fn()
    except Exception as e:  # the message names the parameters the loaded function takes
        print(cache, re.search(r"Expects (\d+) parameters", str(e)).group(1),
              re.search(r"mKV: ([^)]*\))", str(e)).group(1),
              re.search(r"mKVScale: ([^)]*\)?)\)`", str(e)).group(1))
"""


def signature_run():
    return python("-c", SPARSE_SIGNATURE_SCRIPT, env={"CUTE_DSL_ARCH": None},
                  fresh=("TORCH_MLA_CACHE_DIR",))


@ahead(signature_run)
def test_loaded_sparse_steps_take_kv_scale_explicitly():
    """A step loaded from the disk cache takes every defaulted argument of its __call__
    (TVM-FFI): the sparse steps' last, kv_scale, is a tensor for an e4m3 cache and None
    otherwise, and run_sparse_step passes it either way (the dense steps' fp8 arguments
    failed on the H200 for want of this)."""
    res = result(signature_run())
    assert res.returncode == 0, res.stderr[-4000:]
    lines = [x for x in res.stdout.splitlines() if x.split(" ")[0] in ("plain", "e4m3",
                                                                        "fp8_ds_mla")]
    assert_expected_inline("\n".join(lines), """\
plain 13 Tensor([n3, 64, 576], bfloat16) None
e4m3 13 Tensor([n3, 64, 576], uint8) Tensor([1], float32)
fp8_ds_mla 13 Tensor([n3, 64, 656], uint8) None""")


INDEXER_SCRIPT = r"""
import glob, json, os, re, sys
from torch_mla.ops import registry
from torch_mla.cute_kernels.sm90_indexer import IndexerLogitsSm90
out, seen = [], set()
for dtype, d, heads, s_q in json.loads(sys.argv[1]):
    config = registry.IndexerConfig(dtype, d, heads, s_q)
    registry.build(config, "sm_90a")
    new = set(glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx"))) - seen
    seen |= new
    (f,) = new
    ptx = open(f).read()
    c = {"config": [dtype, d, heads, s_q], "stages": IndexerLogitsSm90(
        dtype == "e4m3", d, heads, s_q).stages}
    for k in ["wgmma.mma_async", r"wgmma.mma_async.sync.aligned.m64n(\d+)k(\d+).f32.(\w+).\w+ ",
              "cp.async.bulk.tensor", "L2::cache_hint", "mbarrier.try_wait", "ld.local",
              "st.local", "vprintf", "trap;", ".minnctapersm 2", "max.f32", "st.global"]:
        c[k] = re.findall(k, ptx) if "(" in k else len(re.findall(re.escape(k), ptx))
    out.append(c)
print(json.dumps(out))
"""

INDEXER_CONFIGS = [("bf16", 128, 64, 2), ("e4m3", 128, 64, 1), ("bf16", 64, 8, 1),
                   ("e4m3", 64, 16, 2)]


def indexer_run():
    return python("-c", INDEXER_SCRIPT, json.dumps(INDEXER_CONFIGS),
                  env={"CUTE_DSL_ARCH": None, "CUTE_DSL_KEEP": "ptx"})


@ahead(indexer_run)
def test_sm90_indexer_compiles():
    """The DSA indexer kernel (cute_kernels/sm90_indexer.py) for V3.2's shapes (H 64, D 128,
    s_q 1-2) and small-model ones: one wgmma chain a page, m64 x (s_q * H) over D (k16 steps in
    bf16, k32 on e4m3 operands), TMA loads with an L2 hint (the pages' evict_first), mbarrier
    waits, two CTAs an SM, and no local memory, printf or trap."""
    res = result(indexer_run())
    assert res.returncode == 0, res.stderr[-4000:]
    for c in json.loads(res.stdout.strip().splitlines()[-1]):
        dtype, d, heads, s_q = c["config"]
        k = 32 if dtype == "e4m3" else 16
        ab = "e4m3" if dtype == "e4m3" else "bf16"
        shapes = c[r"wgmma.mma_async.sync.aligned.m64n(\d+)k(\d+).f32.(\w+).\w+ "]
        assert c["wgmma.mma_async"] == d // k, c
        assert shapes == [[str(heads * s_q), str(k), ab]] * (d // k), c
        # Q, then the first pages and the refills (e4m3: each page's scales too)
        assert c["cp.async.bulk.tensor"] >= 3 + 2 * (dtype == "e4m3"), c
        assert c["L2::cache_hint"] >= 2 and c["mbarrier.try_wait"] >= 2, c
        assert (c["ld.local"], c["st.local"], c["vprintf"], c["trap;"]) == (0, 0, 0, 0), c
        assert c[".minnctapersm 2"] == 1 and c["stages"] % 2 == 0, c
        # the epilogue: relu of each of a thread's s_q * H / 2 accumulator values
        assert c["max.f32"] >= heads * s_q // 2, c
    assert [c["stages"] for c in json.loads(res.stdout.strip().splitlines()[-1])] \
        == [4, 8, 8, 16]


SMALL_SCRIPT = r"""
import glob, json, os, re
from torch_mla.ops.registry import AppendKVConfig, ScheduleConfig, build
build(ScheduleConfig(), "sm_90a")
build(ScheduleConfig(), "sm_80")
build(AppendKVConfig("bf16", "fp32", "int64"), "sm_90a")
build(AppendKVConfig("fp16", "fp16", "int32"), "sm_90a")
build(AppendKVConfig("e4m3", "bf16", "int64"), "sm_90a")
build(AppendKVConfig("e4m3", "fp32", "int32"), "sm_89")
out = []
for f in sorted(glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx"))):
    lines = open(f).read().splitlines()
    calls = [i for i, l in enumerate(lines) if "call.uni" in l]
    # every local store fills the argument buffer of the printf call that follows it
    printf_args = all("vprintf" in lines[min([c for c in calls if c > i], default=0)]
                      for i, l in enumerate(lines) if "st.local" in l)
    text = "\n".join(lines)
    kernel = ("schedule" if "DecodeSchedule" in f else
              "append_kv_fp8" if "AppendKVFp8" in f else "append_kv")
    out.append({"kernel": kernel,
                "target": re.search(r"\.target (\S+)", text)[1],
                "printf_args_only": printf_args,
                **{k: len(re.findall(re.escape(k), text)) for k in
                   ["ld.local", "st.local", "call.uni (retval0), vprintf", "trap;", "bar.sync",
                    "shfl.sync", "st.global.v4", "ld.global.v4", "cvt.rn.bf16x2.f32",
                    "st.global.v2.b32", "div.rn.f32", "cvt.rn.satfinite.e4m3x2.f32"]}})
print(json.dumps(out))
"""


PORTABLE_SCRIPT = r"""
import glob, json, os, re, sys
from torch_mla.ops.registry import CombineKernelConfig, DecodeConfig, build
from torch_mla.cute_kernels.sm80_decode import Sm80DecodeConfig
dt, causal = sys.argv[1], sys.argv[2] == "causal"
out = {}
for arch in sys.argv[3].split(","):
    cfg = Sm80DecodeConfig.from_heuristic(arch)  # (the tiles the compile entry picks)
    build(DecodeConfig("sm80", dt, causal), arch)
    build(CombineKernelConfig(dt, 4), arch)
    counts = {}
    for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], f"*.{arch}.ptx")):
        ptx = open(f).read()
        kind = "decode" if "MLADecodeSm80" in f else "combine"
        c = counts.setdefault(kind, {"block_n": cfg.block_n, "block_m": cfg.block_m})
        c["target"] = re.search(r"^\.target (\S+)", ptx, re.M).group(1)
        for k in ["mma.sync.aligned.m16n8k16.row.col.f32", "cp.async.cg.shared.global",
                  "cp.async.commit_group", "cp.async.wait_group", "ldmatrix.sync.aligned",
                  "ldmatrix.sync.aligned.m8n8.x4.trans", "ld.local", "st.local", "wgmma",
                  "cp.async.bulk", "mbarrier", "griddepcontrol.launch_dependents",
                  "griddepcontrol.wait", "barrier.arrive", "bar.arrive", "bar.sync",
                  "barrier.sync"]:
            c[k] = len(re.findall(re.escape(k), ptx))
    out[arch] = counts
print(json.dumps(out))
"""


def small_run():
    return python("-c", SMALL_SCRIPT, env={"CUTE_DSL_ARCH": None, "CUTE_DSL_KEEP": "ptx"})


@ahead(small_run)
def test_small_kernels_compile_for_sm80_and_sm90():
    """The one-launch schedule (sm_90a and sm_80) and append_kv (over an e4m3 cache too, sm_90a
    and sm_89): no local memory but printf's argument buffer, the value checks' printf + trap,
    16-byte cache stores (8-byte ones of e4m3: x / kv_scale by div.rn, then a saturating cvt)."""
    res = result(small_run())
    assert res.returncode == 0, res.stderr[-4000:]
    ptx = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted((p["kernel"], p["target"]) for p in ptx) == [
        ("append_kv", "sm_90a"), ("append_kv", "sm_90a"), ("append_kv_fp8", "sm_89"),
        ("append_kv_fp8", "sm_90a"), ("schedule", "sm_80"), ("schedule", "sm_90a")], ptx
    for p in ptx:
        assert p["ld.local"] == 0 and p["printf_args_only"], p
        assert p["trap;"] == p["call.uni (retval0), vprintf"] > 0, p  # each message, then trap
        if p["kernel"] == "schedule":
            # block scans: warp shuffles and a few barriers, one CTA
            assert p["shfl.sync"] > 0 and p["bar.sync"] >= 3, p
        elif p["kernel"] == "append_kv":
            assert p["st.global.v4"] == 2, p  # kv_c and k_pe vectors: 16-byte stores
        else:  # kv_c and k_pe: 8 values each, divided, converted in pairs, one 8-byte store
            assert (p["st.global.v2.b32"], p["div.rn.f32"],
                    p["cvt.rn.satfinite.e4m3x2.f32"], p["st.global.v4"]) == (2, 16, 8, 0), p
    fp32_src = [p for p in ptx if p["kernel"] == "append_kv" and p["cvt.rn.bf16x2.f32"]]
    assert len(fp32_src) == 1 and fp32_src[0]["ld.global.v4"] == 4, ptx  # 32-byte source vectors


SM100_SCRIPT = r"""
import glob, json, os, re, sys
import cutlass, cutlass.cute as cute
from torch_mla.contract import compile_step_kernel
from torch_mla.cute_kernels import sm100_decode
from torch_mla.cute_kernels.decode_step import MLADecodeStep
dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[sys.argv[1]]
causal = sys.argv[2] == "causal"
if len(sys.argv) > 3:  # a configuration past the shared-memory budget must not compile
    sm100_decode.KV_STAGES = int(sys.argv[3])
kernel = sm100_decode.MLADecodeSm100(dt, causal)
try:  # what mla_decode would run: the decode kernel and the combine behind one host call
    compile_step_kernel(MLADecodeStep(kernel, dt), dt, "sm_100a")
except AssertionError as e:
    print(json.dumps({"assert": str(e)}))
    sys.exit(0)
files = [open(f).read() for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx"))]
counts = {"decode": {}, "combine": {}, "smem_bytes": kernel.smem_bytes,
          "targets": sum(f.count(".target sm_100a") for f in files)}
ptxs = [p for f in files for p in f.split(".entry ")[1:]]  # one kernel each
assert len(ptxs) == 5, len(ptxs)  # the decode kernel, four combine variants
for ptx in ptxs:
    kind = "decode" if "MLADecodeSm100" in ptx.split("(", 1)[0] else "combine"
    for k in ["tcgen05.mma.cta_group::1.kind::f16", "tcgen05.alloc", "tcgen05.dealloc",
              "tcgen05.relinquish_alloc_permit", "tcgen05.commit", "tcgen05.ld.sync.aligned",
              "tcgen05.st.sync.aligned", "tcgen05.wait::ld", "tcgen05.wait::st",
              "tcgen05.fence::before_thread_sync", "tcgen05.fence::after_thread_sync",
              "cp.async.bulk.tensor", "wgmma", "ld.local", "st.local", "st.shared.v4",
              "st.global.v4", "griddepcontrol.launch_dependents", "call.uni"]:
        counts[kind][k] = counts[kind].get(k, 0) + len(re.findall(re.escape(k), ptx))
print(json.dumps(counts))
"""


def sm100_run(dtype, causal, stages=None):
    # (the arch is a compile option: no CUTE_DSL_ARCH is needed)
    return python("-c", SM100_SCRIPT, dtype, causal, *([stages] if stages else []),
                  env={"CUTE_DSL_ARCH": None, "CUTE_DSL_KEEP": "ptx"})


def _sm100_compile(*argv):
    res = result(sm100_run(*argv))
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def portable_run(dtype, causal, archs):
    return python("-c", PORTABLE_SCRIPT, dtype, causal, ",".join(archs),
                  env={"CUTE_DSL_ARCH": None, "CUTE_DSL_KEEP": "ptx"}, timeout=1200)


def compile_portable(dtype, causal, archs):
    res = result(portable_run(dtype, causal, archs))
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@ahead(sm100_run)
@pytest.mark.parametrize("dtype,causal", [("bf16", "causal"), ("fp16", "plain")])
def test_sm100_kernel_compiles(dtype, causal):
    """The SM100 kernel (never run on hardware) compiles for sm_100a on the CPU, and its PTX
    has the instructions of the design (docs/sm100-design.md)."""
    counts = _sm100_compile(dtype, causal)
    dec = counts["decode"]
    assert counts["targets"] == 1, counts  # one module: the step's five kernels
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
    assert dec["call.uni"] == 0, dec  # a call would serialise the MMAs' issue (see combine.py)
    # P goes to shared memory in 16-byte stores; O to global memory in 16-byte stores.
    assert dec["st.shared.v4"] == 4 and dec["st.global.v4"] == 8 * (4 + 8), dec
    assert dec["griddepcontrol.launch_dependents"] == 1, dec
    # Q 72 KB + 2 pages 144 KB + P 8 KB + barriers, within sm_100's 227 KB per block.
    assert 224 * 1024 < counts["smem_bytes"] <= 227 * 1024, counts["smem_bytes"]
    comb = counts["combine"]
    assert comb["tcgen05.mma.cta_group::1.kind::f16"] == 0, comb
    # the input checks' two messages per variant: printf's arguments are the only local stores
    assert comb["ld.local"] == 0 and comb["st.local"] == 9 * 4 and comb["call.uni"] == 3 * 4, comb


@ahead(lambda: sm100_run("bf16", "plain", "3"))
def test_sm100_shared_memory_budget_is_checked_at_compile_time():
    """A third page buffer (72 KB more) does not fit: the compile stops with the numbers."""
    counts = _sm100_compile("bf16", "plain", "3")
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


# bf16 for every arch family the portable kernel serves (each tile configuration at least once:
# sm_80 64x32x2, sm_86/89/120a 32x16x3, sm_100a 64x64x2); fp16 and causal masking once (the
# rest of the source is shared). About 10-20 s per compile on a CPU.
@ahead(portable_run)
@pytest.mark.parametrize("dtype,causal,archs", [
    ("bf16", "plain", ["sm_80", "sm_86", "sm_89", "sm_100a", "sm_120a"]),
    ("fp16", "causal", ["sm_86"]),
])
def test_portable_kernel_compiles(dtype, causal, archs):
    counts = compile_portable(dtype, causal, archs)
    assert sorted(counts) == sorted(archs)
    for arch, kinds in counts.items():
        dec, comb = kinds["decode"], kinds["combine"]
        assert dec["target"] == comb["target"] == arch, (arch, dec["target"])
        # Per stage and warp: 36 k-steps x (block_n / 16) n8-tiles of Q K^T, (block_n / 16)
        # k-steps x 32 n8-tiles of P V, all mma.sync; nothing from SM90 on.
        steps = dec["block_n"] // 16
        assert dec["mma.sync.aligned.m16n8k16.row.col.f32"] == 36 * steps + 32 * steps, dec
        # With two quads (block_m 64) the late one waits for its stage at its own place, and
        # arrives once a turn at the barrier that lets the other refill (sm80_decode.py, Lag).
        lag = dec["block_m"] == 64
        assert dec["cp.async.cg.shared.global"] > 0, dec
        assert dec["cp.async.wait_group"] == (2 if lag else 1), dec
        # Arrivals: the late quad's (lag), a quad's at the other's rope barrier, and a quad
        # without rows standing in there (sm80_decode.py, _stage).
        assert dec["barrier.arrive"] + dec["bar.arrive"] == (3 if lag else 0), dec
        # One aligned barrier (bar.sync: every thread of the CTA at that instruction), the
        # segment's first; the others are barrier.sync without .aligned, since warps meet there
        # from different places (the stage barrier's two sites, the quads' own barriers).
        assert dec["bar.sync"] == 1 and dec["barrier.sync"] > 0, dec
        assert dec["cp.async.commit_group"] >= 2, dec  # double-buffered (or deeper)
        # ldmatrix per stage and warp: per k-step of Q K^T (18, half of them), Q of the quad's
        # two row groups and K (block_n / 2 keys: one .x2 or .x4 per 16); per k-step of P V, P
        # of the two row groups and V^T of its 128 output columns (2 chunks x 4 .x4.trans).
        # (176 at 64x64 with warp pairs, 148 in quads, now 112.)
        qk_loads = 18 * (2 + max(1, steps // 2))
        assert dec["ldmatrix.sync.aligned"] == qk_loads + 2 * steps + 2 * 4 * steps, dec
        assert dec["ldmatrix.sync.aligned.m8n8.x4.trans"] == 2 * 4 * steps, dec
        assert dec["wgmma"] == dec["cp.async.bulk"] == dec["mbarrier"] == 0, dec
        assert dec["ld.local"] == dec["st.local"] == 0, dec
        # the combine's input checks: printf's arguments (3 + 4 vector stores) are its only
        # local memory
        assert comb["ld.local"] == 0 and comb["st.local"] == 9, comb
        # Programmatic dependent launch only where it exists (griddepcontrol: sm_90 on).
        pdl = int(arch[3:].rstrip("a")) >= 90
        assert dec["griddepcontrol.launch_dependents"] == int(pdl), (arch, dec)
        assert (comb["griddepcontrol.wait"] > 0) == pdl, (arch, comb)


def host_dsl_script(tmp_path, name: str, text: str) -> str:
    """The stdout of a host-side CuTe DSL script (run on the CPU; the DSL compiles from source
    files only, so it is written to tmp_path / name), with this tree first on PYTHONPATH."""
    script = tmp_path / name
    script.write_text(text)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stdout


# Host-side CuTe DSL (runs on the CPU): every element of each view the portable kernel takes at
# a runtime index (warp `quarter` of a quad) against its buffer's layout at the element's
# coordinate, and where each view starts (keys and P columns of its half, V^T of its columns);
# then the P that P V reads as the warp of each row group (all 32 lanes): its rows, addresses.
PORTABLE_VIEWS_SCRIPT = r"""
import cutlass, cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import warp
from torch_mla.cute_kernels.sm80_decode import (Sm80DecodeConfig, smem_layouts, tiled_mmas,
                                                warp_views)

@cute.jit
def misplaced(view, coords, layout) -> Int32:
    bad = Int32(0)
    for i in cutlass.range(cute.size(view), unroll=1):
        at = Int32(view.iterator.toint()) // 2 + Int32(cute.crd2idx(i, view.layout))
        if at != Int32(cute.crd2idx(coords[i], layout)):
            bad += 1
    return bad

@cute.jit
def check(cfg: cutlass.Constexpr):
    _, k_layout, p_layout = smem_layouts(cfg)
    smem = cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.smem, assumed_align=1024)
    sK, sP = cute.make_tensor(smem, k_layout), cute.make_tensor(smem, p_layout)
    # flat coordinates (key, d, stage) and (row, column): crd2idx takes them for the layouts'
    # hierarchical shapes too
    cK = cute.make_identity_tensor(cute.product_each(k_layout.shape))
    cP = cute.make_identity_tensor(cute.product_each(p_layout.shape))
    for quarter in cutlass.range(4, unroll=1):
        views, coords = warp_views(cfg, sK, sP, quarter), warp_views(cfg, cK, cP, quarter)
        bad_v = Int32(0)
        for c in cutlass.range_constexpr(len(views[2])):
            bad_v += misplaced(views[2][c], coords[2][c], k_layout)
        cute.printf("%dx%dx%d quarter %d: K from key %d: %d of %d, P from column %d: %d of %d, "
                    "V^T from d %d, %d: %d of %d misplaced\n",
                    cfg.block_m, cfg.block_n, cfg.stages, quarter,
                    coords[0][0][0], misplaced(views[0], coords[0], k_layout),
                    cute.size(views[0]),
                    coords[1][0][1], misplaced(views[1], coords[1], p_layout),
                    cute.size(views[1]), coords[2][0][0][1], coords[2][1][0][1],
                    bad_v, len(views[2]) * cute.size(views[2][0]))
    # as the kernel's ld_P
    ld_P = cute.make_tiled_copy_A(
        cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), cutlass.BFloat16),
        tiled_mmas(cfg, cutlass.BFloat16)[1])
    for g in cutlass.range(cfg.block_m // 16, unroll=1):
        bad, lo, hi = Int32(0), Int32(cfg.block_m), Int32(-1)
        for lane in cutlass.range(32, unroll=1):
            thr = ld_P.get_slice(g * 32 + lane)
            view, coords = thr.partition_S(sP), thr.partition_S(cP)
            bad += misplaced(view, coords, p_layout)
            for i in cutlass.range(cute.size(coords), unroll=1):
                lo, hi = cutlass.min(lo, coords[i][0]), cutlass.max(hi, coords[i][0])
        cute.printf("%dx%dx%d P V reads P rows %d..%d as row group %d: %d misplaced\n",
                    cfg.block_m, cfg.block_n, cfg.stages, lo, hi, g, bad)

for tiles in [(64, 64, 2), (64, 32, 2), (32, 16, 3), (64, 32, 3)]:
    check(Sm80DecodeConfig(*tiles))
"""


def test_portable_warp_views_address_their_buffers(tmp_path):
    """The keys and P columns (halves) and V^T columns (quarters) that each warp of a quad takes
    at a runtime offset start where they should and address the elements of their buffers. A
    view at an offset inside a swizzle atom is addressed with the offset twice
    (nvidia-cutlass-dsl 4.8.1); with P in block_n-wide atoms, the second warp's P went to the
    wrong place (all of it at 64x64 and 64x32 tiles), found on the H200."""
    stdout = host_dsl_script(tmp_path, "views.py", PORTABLE_VIEWS_SCRIPT)
    lines = [x for x in stdout.splitlines() if "misplaced" in x]
    assert_expected_inline("\n".join(lines), """\
64x64x2 quarter 0: K from key 0: 0 of 36864, P from column 0: 0 of 2048, V^T from d 0, 64: 0 of 16384 misplaced
64x64x2 quarter 1: K from key 32: 0 of 36864, P from column 32: 0 of 2048, V^T from d 128, 192: 0 of 16384 misplaced
64x64x2 quarter 2: K from key 0: 0 of 36864, P from column 0: 0 of 2048, V^T from d 256, 320: 0 of 16384 misplaced
64x64x2 quarter 3: K from key 32: 0 of 36864, P from column 32: 0 of 2048, V^T from d 384, 448: 0 of 16384 misplaced
64x64x2 P V reads P rows 0..15 as row group 0: 0 misplaced
64x64x2 P V reads P rows 16..31 as row group 1: 0 misplaced
64x64x2 P V reads P rows 32..47 as row group 2: 0 misplaced
64x64x2 P V reads P rows 48..63 as row group 3: 0 misplaced
64x32x2 quarter 0: K from key 0: 0 of 18432, P from column 0: 0 of 1024, V^T from d 0, 64: 0 of 8192 misplaced
64x32x2 quarter 1: K from key 16: 0 of 18432, P from column 16: 0 of 1024, V^T from d 128, 192: 0 of 8192 misplaced
64x32x2 quarter 2: K from key 0: 0 of 18432, P from column 0: 0 of 1024, V^T from d 256, 320: 0 of 8192 misplaced
64x32x2 quarter 3: K from key 16: 0 of 18432, P from column 16: 0 of 1024, V^T from d 384, 448: 0 of 8192 misplaced
64x32x2 P V reads P rows 0..15 as row group 0: 0 misplaced
64x32x2 P V reads P rows 16..31 as row group 1: 0 misplaced
64x32x2 P V reads P rows 32..47 as row group 2: 0 misplaced
64x32x2 P V reads P rows 48..63 as row group 3: 0 misplaced
32x16x3 quarter 0: K from key 0: 0 of 13824, P from column 0: 0 of 256, V^T from d 0, 64: 0 of 6144 misplaced
32x16x3 quarter 1: K from key 8: 0 of 13824, P from column 8: 0 of 256, V^T from d 128, 192: 0 of 6144 misplaced
32x16x3 quarter 2: K from key 0: 0 of 13824, P from column 0: 0 of 256, V^T from d 256, 320: 0 of 6144 misplaced
32x16x3 quarter 3: K from key 8: 0 of 13824, P from column 8: 0 of 256, V^T from d 384, 448: 0 of 6144 misplaced
32x16x3 P V reads P rows 0..15 as row group 0: 0 misplaced
32x16x3 P V reads P rows 16..31 as row group 1: 0 misplaced
64x32x3 quarter 0: K from key 0: 0 of 27648, P from column 0: 0 of 1024, V^T from d 0, 64: 0 of 12288 misplaced
64x32x3 quarter 1: K from key 16: 0 of 27648, P from column 16: 0 of 1024, V^T from d 128, 192: 0 of 12288 misplaced
64x32x3 quarter 2: K from key 0: 0 of 27648, P from column 0: 0 of 1024, V^T from d 256, 320: 0 of 12288 misplaced
64x32x3 quarter 3: K from key 16: 0 of 27648, P from column 16: 0 of 1024, V^T from d 384, 448: 0 of 12288 misplaced
64x32x3 P V reads P rows 0..15 as row group 0: 0 misplaced
64x32x3 P V reads P rows 16..31 as row group 1: 0 misplaced
64x32x3 P V reads P rows 32..47 as row group 2: 0 misplaced
64x32x3 P V reads P rows 48..63 as row group 3: 0 misplaced""")


# Host-side CuTe DSL: the Q K^T sources of warp kh of a quad (the ldmatrix partitions moved by
# k_half_view and q_views: k-step j of kh at column 256 kh + 16 j, row group 2 quad + m 16 m rows
# down) against Q's and K's layouts at the element's coordinate; and the S exchange slots
# (exchange_offsets): the sP slot is exactly the quad's rows of P's columns of its half, the K
# slot lies wholly in the rope columns (512..575) of the stage's buffer, and the four K slots of
# a CTA tile them (starts 0, 1, 2, 3 slots in).
PORTABLE_QK_SCRIPT = r"""
import cutlass, cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import warp
from torch_mla.cute_kernels.sm80_decode import (D_QK, Sm80DecodeConfig, exchange_offsets,
                                                k_half_view, q_views, smem_layouts, tiled_mmas)

@cute.jit
def moved(view, coords, layout, d_row: Int32, d_col: Int32) -> Int32:
    bad = Int32(0)
    for i in cutlass.range(cute.size(view), unroll=1):
        at = Int32(view.iterator.toint()) // 2 + Int32(cute.crd2idx(i, view.layout))
        c = coords[i]
        crd = (c[0] + d_row, c[1] + d_col)
        if cutlass.const_expr(cute.rank(layout) == 3):  # K: stage 0
            crd = (c[0] + d_row, c[1] + d_col, 0)
        if at != Int32(cute.crd2idx(crd, layout)):
            bad += 1
    return bad

@cute.jit
def check(cfg: cutlass.Constexpr):
    bm, bn, st = cfg.block_m, cfg.block_n, cfg.stages
    q_layout, k_layout, p_layout = smem_layouts(cfg)
    smem = cute.make_ptr(cutlass.BFloat16, 0, cute.AddressSpace.smem, assumed_align=1024)
    sQ, sK = cute.make_tensor(smem, q_layout), cute.make_tensor(smem, k_layout)
    cQ = cute.make_identity_tensor((bm, D_QK))
    cK = cute.make_identity_tensor((bn, D_QK))
    tiled_qk = tiled_mmas(cfg, cutlass.BFloat16)[0]
    ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), cutlass.BFloat16)
    ld_Q = cute.make_tiled_copy_A(ldsm, tiled_qk)
    ld_K = cute.make_tiled_copy_B(
        cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4 if bn // 2 >= 16 else 2),
                            cutlass.BFloat16), tiled_qk)
    for quad in cutlass.range(bm // 32, unroll=1):
        for kh in cutlass.range(2, unroll=1):
            bad_q, bad_k = Int32(0), Int32(0)
            for lane in cutlass.range(32, unroll=1):
                thr = ld_Q.get_slice(2 * quad * 32 + lane)
                views = q_views(k_half_view(thr.partition_S(sQ), bm, kh))
                coords = thr.partition_S(cQ)
                for m in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(16):
                        bad_q += moved(views[m][None, None, j], coords[None, None, j], q_layout,
                                       16 * m, 256 * kh)
                    for j in cutlass.range_constexpr(2):  # the rope k-steps, a runtime k
                        k = 32 + 2 * kh + j
                        bad_q += moved(q_views(thr.partition_S(sQ))[m][None, None, k],
                                       coords[None, None, k], q_layout, 16 * m, 0)
                thr = ld_K.get_slice(lane)
                view = k_half_view(thr.partition_S(sK[None, None, 0]), bn, kh)
                coords = thr.partition_S(cK)
                for j in cutlass.range_constexpr(16):
                    bad_k += moved(view[None, None, j], coords[None, None, j], k_layout, 0,
                                   256 * kh)
                for j in cutlass.range_constexpr(2):
                    k = 32 + 2 * kh + j
                    bad_k += moved(thr.partition_S(sK[None, None, 0])[None, None, k],
                                   coords[None, None, k], k_layout, 0, 0)
            cute.printf("%dx%dx%d quad %d k half %d: Q %d, K %d misplaced\n", bm, bn, st, quad,
                        kh, bad_q, bad_k)
    # The exchange slots (bytes) of stage buffer st - 1: the k-half-0 warp's in the quad's rows
    # of P's columns `half`, the k-half-1 warp's in that buffer's rope columns, where the slots
    # of the CTA's pairs must not overlap (each prints where its slot starts there).
    slot = 16 * (bn // 2) * 4
    rope0 = 2 * Int32(cute.crd2idx((0, 512, st - 1), k_layout))
    for quad in cutlass.range(bm // 32, unroll=1):
        for half in cutlass.range(2, unroll=1):
            in_p, in_k = exchange_offsets(cfg, quad, half, st - 1)
            in_slot_p, in_slot_k = Int32(0), Int32(0)
            for r in cutlass.range(32, unroll=1):
                for c in cutlass.range(bn // 2, unroll=1):
                    b = 2 * Int32(cute.crd2idx((32 * quad + r, half * (bn // 2) + c), p_layout))
                    if b >= in_p and b < in_p + slot:
                        in_slot_p += 1
            for key in cutlass.range(bn, unroll=1):
                for c in cutlass.range(512, 576, unroll=1):
                    b = 2 * Int32(cute.crd2idx((key, c, st - 1), k_layout))
                    if b >= in_k and b < in_k + slot:
                        in_slot_k += 1
            cute.printf("%dx%dx%d quad %d half %d: slots of %d B, in P's %d B, in the rope's %d B "
                        "from +%d\n", bm, bn, st, quad, half, slot, 2 * in_slot_p,
                        2 * in_slot_k, in_k - rope0)

for tiles in [(64, 64, 2), (64, 32, 2), (32, 16, 3), (64, 32, 3)]:
    check(Sm80DecodeConfig(*tiles))
"""


def test_portable_qk_views_and_exchange_slots(tmp_path):
    """Each warp's Q K^T sources at its half of the k-steps (a runtime pointer offset of whole
    swizzle atoms) address the right elements, and the S exchange slots cover only memory that
    is dead when they are used (exchange_offsets says why)."""
    stdout = host_dsl_script(tmp_path, "qk_views.py", PORTABLE_QK_SCRIPT)
    lines = [x for x in stdout.splitlines() if "misplaced" in x or "slots" in x]
    assert_expected_inline("\n".join(lines), """\
64x64x2 quad 0 k half 0: Q 0, K 0 misplaced
64x64x2 quad 0 k half 1: Q 0, K 0 misplaced
64x64x2 quad 1 k half 0: Q 0, K 0 misplaced
64x64x2 quad 1 k half 1: Q 0, K 0 misplaced
64x64x2 quad 0 half 0: slots of 2048 B, in P's 2048 B, in the rope's 2048 B from +0
64x64x2 quad 0 half 1: slots of 2048 B, in P's 2048 B, in the rope's 2048 B from +2048
64x64x2 quad 1 half 0: slots of 2048 B, in P's 2048 B, in the rope's 2048 B from +4096
64x64x2 quad 1 half 1: slots of 2048 B, in P's 2048 B, in the rope's 2048 B from +6144
64x32x2 quad 0 k half 0: Q 0, K 0 misplaced
64x32x2 quad 0 k half 1: Q 0, K 0 misplaced
64x32x2 quad 1 k half 0: Q 0, K 0 misplaced
64x32x2 quad 1 k half 1: Q 0, K 0 misplaced
64x32x2 quad 0 half 0: slots of 1024 B, in P's 1024 B, in the rope's 1024 B from +0
64x32x2 quad 0 half 1: slots of 1024 B, in P's 1024 B, in the rope's 1024 B from +1024
64x32x2 quad 1 half 0: slots of 1024 B, in P's 1024 B, in the rope's 1024 B from +2048
64x32x2 quad 1 half 1: slots of 1024 B, in P's 1024 B, in the rope's 1024 B from +3072
32x16x3 quad 0 k half 0: Q 0, K 0 misplaced
32x16x3 quad 0 k half 1: Q 0, K 0 misplaced
32x16x3 quad 0 half 0: slots of 512 B, in P's 512 B, in the rope's 512 B from +0
32x16x3 quad 0 half 1: slots of 512 B, in P's 512 B, in the rope's 512 B from +512
64x32x3 quad 0 k half 0: Q 0, K 0 misplaced
64x32x3 quad 0 k half 1: Q 0, K 0 misplaced
64x32x3 quad 1 k half 0: Q 0, K 0 misplaced
64x32x3 quad 1 k half 1: Q 0, K 0 misplaced
64x32x3 quad 0 half 0: slots of 1024 B, in P's 1024 B, in the rope's 1024 B from +0
64x32x3 quad 0 half 1: slots of 1024 B, in P's 1024 B, in the rope's 1024 B from +1024
64x32x3 quad 1 half 0: slots of 1024 B, in P's 1024 B, in the rope's 1024 B from +2048
64x32x3 quad 1 half 1: slots of 1024 B, in P's 1024 B, in the rope's 1024 B from +3072""")


def test_portable_tiles_fit_each_arch():
    from torch_mla.cute_kernels.sm80_decode import Sm80DecodeConfig, smem_per_block

    rows = []
    for arch in ["sm_80", "sm_86", "sm_87", "sm_89", "sm_90a", "sm_100a", "sm_103a", "sm_110a",
                 "sm_120a", "sm_121a"]:
        cfg = Sm80DecodeConfig.from_heuristic(arch)
        assert cfg.smem_bytes() + 1024 <= smem_per_block(arch), (arch, cfg)  # + alignment
        rows.append(f"{arch} {cfg.block_m}x{cfg.block_n}x{cfg.stages} {cfg.num_threads} threads "
                    f"{cfg.smem_bytes()} B of {smem_per_block(arch)}")
    assert_expected_inline("\n".join(rows), """\
sm_80 64x32x2 256 threads 152576 B of 166912
sm_86 32x16x3 128 threads 93696 B of 101376
sm_87 64x32x2 256 threads 152576 B of 166912
sm_89 32x16x3 128 threads 93696 B of 101376
sm_90a 64x64x2 256 threads 230400 B of 232448
sm_100a 64x64x2 256 threads 230400 B of 232448
sm_103a 64x64x2 256 threads 230400 B of 232448
sm_110a 64x64x2 256 threads 230400 B of 232448
sm_120a 32x16x3 128 threads 93696 B of 101376
sm_121a 32x16x3 128 threads 93696 B of 101376""")
