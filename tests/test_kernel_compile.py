"""Every CuTe DSL kernel compiles for its GPUs on a machine without one (the arch is a compile
option), and the PTX uses the instructions the design relies on (SM90: wgmma, TMA,
stmatrix/ldmatrix; portable: cp.async, ldmatrix, mma.sync) and no local memory."""

import json
import os
import subprocess
import sys

import pytest
from expecttest import assert_expected_inline

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


PORTABLE_SCRIPT = r"""
import glob, json, os, re, sys
import cutlass, cutlass.cute as cute
from torch_mla.ops.dispatch import _has_pdl, compile_combine, compile_decode_sm80
from torch_mla.cute_kernels.combine import MLACombine
from torch_mla.cute_kernels.sm80_decode import MLADecodeSm80, Sm80DecodeConfig
dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[sys.argv[1]]
causal = sys.argv[2] == "causal"
out = {}
for arch in sys.argv[3].split(","):
    cfg = Sm80DecodeConfig.from_heuristic(arch)
    compile_decode_sm80(cute, cutlass, MLADecodeSm80(dt, causal, cfg, _has_pdl(arch)), dt, arch)
    compile_combine(cute, cutlass, MLACombine(dt, 512, 4, _has_pdl(arch)), dt, arch)
    counts = {}
    for f in glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], f"*.{arch}.ptx")):
        ptx = open(f).read()
        kind = "decode" if "MLADecodeSm80" in f else "combine"
        c = counts.setdefault(kind, {"block_n": cfg.block_n})
        c["target"] = re.search(r"^\.target (\S+)", ptx, re.M).group(1)
        for k in ["mma.sync.aligned.m16n8k16.row.col.f32", "cp.async.cg.shared.global",
                  "cp.async.commit_group", "cp.async.wait_group", "ldmatrix.sync.aligned",
                  "ldmatrix.sync.aligned.m8n8.x4.trans", "ld.local", "st.local", "wgmma",
                  "cp.async.bulk", "mbarrier", "griddepcontrol.launch_dependents",
                  "griddepcontrol.wait"]:
            c[k] = len(re.findall(re.escape(k), ptx))
    out[arch] = counts
print(json.dumps(out))
"""


def compile_portable(tmp_path, dtype, causal, archs):
    env = dict(os.environ, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    env.pop("CUTE_DSL_ARCH", None)
    res = subprocess.run([sys.executable, "-c", PORTABLE_SCRIPT, dtype, causal, ",".join(archs)],
                         env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# bf16 for every arch family the portable kernel serves (each tile configuration at least once:
# sm_80 64x32x2, sm_86/89/120a 32x16x3, sm_100a 64x64x2); fp16 and causal masking once (the
# rest of the source is shared). About 10-20 s per compile on a CPU.
@pytest.mark.parametrize("dtype,causal,archs", [
    ("bf16", "plain", ["sm_80", "sm_86", "sm_89", "sm_100a", "sm_120a"]),
    ("fp16", "causal", ["sm_86"]),
])
def test_portable_kernel_compiles(tmp_path, dtype, causal, archs):
    counts = compile_portable(tmp_path, dtype, causal, archs)
    assert sorted(counts) == sorted(archs)
    for arch, kinds in counts.items():
        dec, comb = kinds["decode"], kinds["combine"]
        assert dec["target"] == comb["target"] == arch, (arch, dec["target"])
        # Per stage and warp: 36 k-steps x (block_n / 16) n8-tiles of Q K^T, (block_n / 16)
        # k-steps x 32 n8-tiles of P V, all mma.sync; nothing from SM90 on.
        steps = dec["block_n"] // 16
        assert dec["mma.sync.aligned.m16n8k16.row.col.f32"] == 36 * steps + 32 * steps, dec
        assert dec["cp.async.cg.shared.global"] > 0 and dec["cp.async.wait_group"] == 1, dec
        assert dec["cp.async.commit_group"] >= 2, dec  # double-buffered (or deeper)
        assert dec["ldmatrix.sync.aligned"] > 0, dec
        assert dec["ldmatrix.sync.aligned.m8n8.x4.trans"] == 4 * steps * 4, dec  # V, 4 chunks
        assert dec["wgmma"] == dec["cp.async.bulk"] == dec["mbarrier"] == 0, dec
        assert dec["ld.local"] == dec["st.local"] == 0, dec
        assert comb["ld.local"] == comb["st.local"] == 0, comb
        # Programmatic dependent launch only where it exists (griddepcontrol: sm_90 on).
        pdl = int(arch[3:].rstrip("a")) >= 90
        assert dec["griddepcontrol.launch_dependents"] == int(pdl), (arch, dec)
        assert (comb["griddepcontrol.wait"] > 0) == pdl, (arch, comb)


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
