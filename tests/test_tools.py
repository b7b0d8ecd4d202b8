"""The development tools on CPU: their arithmetic, and that the trace build (tools/trace_decode.py)
compiles while the shipped SM90 kernel has no trace in it (their GPU parts run on the H200 only)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tools import trace_decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_trace_summary_reads_the_slot_layout():
    """Two CTAs, three segments, stamps in ns: the means come out of the right slots."""
    per_seg = 10  # start, Q, first S, WG0 loop end, WG1 loop end, E, synced, staged, bulk, E1
    stamps = torch.zeros(2, 64, dtype=torch.int64)
    stamps[0, 0], stamps[0, 63] = 1000, 13200
    stamps[0, 1:11] = torch.tensor([2000, 2500, 3000, 7000, 7400, 9000, 8000, 8500, 8800, 8900])
    stamps[0, 11:21] = torch.tensor([9500, 9600, 10000, 12000, 11900, 13000, 12300, 12600,
                                     12900, 13100])
    stamps[1, 0], stamps[1, 63] = 1100, 3700
    stamps[1, 1:11] = torch.tensor([1500, 1700, 2000, 2500, 2600, 3600, 2800, 3100, 3400, 3500])
    segs = [[(5, True), (3, False)], [(1, True)]]
    s = trace_decode.summarize(stamps, segs, per_seg, 6)
    approx = pytest.approx
    assert s["span"] == approx(12.2) and s["start_skew"] == approx(0.1)
    assert s["end_min"] == approx(2.7) and s["end_max"] == approx(12.2)
    assert s["q_latency"] == approx((0.5 + 0.1 + 0.2) / 3)
    assert s["first_s"] == approx((0.5 + 0.4 + 0.3) / 3)
    assert s["per_block"] == approx(1.0)  # (7.0 - 3.0) / 4 and (12.0 - 10.0) / 2
    assert s["epi_sync"] == approx((0.6 + 0.3 + 0.2) / 3)
    assert s["epi_stage"] == approx((0.5 + 0.3 + 0.3) / 3)
    assert s["epi_bulk"] == approx((0.3 + 0.3 + 0.3) / 3)
    assert s["epi_rest"] == approx((0.2 + 0.1 + 0.2) / 3)
    assert s["wg1_after"] == approx((-0.1 + 0.1 - 0.1) / 3)
    assert s["epilogue"] == approx((1.6 + 1.1 + 1.0) / 3)
    assert s["gap_next"] == approx(0.5)  # only CTA 0 has a next segment
    assert s["segs_per_cta"] == approx(1.5)


def test_pair_times_buckets_by_start_and_skips_segment_tails():
    """One CTA, two segments of 9 and 6 blocks: pairs stamped at pair0 + pairs * k + i."""
    pair0, pairs = 64, 32
    stamps = torch.zeros(1, 128, dtype=torch.int64)
    stamps[0, 0] = 1000
    # segment 0: 5 pairs starting at 2, 8, 13, 17, 21 us -> durations 6, 5, 4 kept; the last two
    # pairs (17 -> 21, and the last one, which has no successor) are left out
    stamps[0, 64:69] = torch.tensor([3000, 9000, 14000, 18000, 22000])
    # segment 1: 3 pairs at 31, 35, 39 us -> only the first pair's duration (4) is kept
    stamps[0, 96:99] = torch.tensor([32000, 36000, 40000])
    segs = [[(9, True), (6, True)]]
    res = trace_decode.pair_times(stamps, segs, pair0, pairs, 2, bucket_us=10.0)
    assert res == {0.0: (pytest.approx(6.0), 2), 10.0: (pytest.approx(4.0), 1),
                   30.0: (pytest.approx(4.0), 1)}


def test_trace_slots_fit_the_table():
    """The per-segment slots end before the end slot, which comes before the pair slots."""
    td = trace_decode
    assert 1 + td.TRACE_PER_SEG * td.TRACE_SEGS <= td.TRACE_END < td.TRACE_PAIR0
    assert td.TRACE_PAIR0 + td.TRACE_PAIRS * td.TRACE_PAIR_SEGS <= td.EV0
    assert td.EV0 + 2 * td.EV_PAIRS * td.EV_KINDS <= td.TRACE_SLOTS
    assert all(len(names) == td.EV_KINDS - 1 for names in td.EVENTS.values())


def test_pair_events_reads_each_warpgroup_s_slots():
    """Two CTAs; WG0's pairs 1-3 and WG1's pairs 1-2 stamped (us * 1000 ns), WG1's pair 3
    left unstamped: medians of each event after its pair's start, the spans, the pair time."""
    td = trace_decode
    stamps = torch.zeros(2, td.TRACE_SLOTS, dtype=torch.int64)

    def put(cta, wg, pair, ev, us):
        stamps[cta, td.EV0 + (td.EV_PAIRS * wg + pair) * td.EV_KINDS + ev] = int(us * 1000)

    for cta in (0, 1):
        for pair in (1, 2, 3, 4):  # (pair 4 only gives pair 3 its next start)
            t0 = 100.0 * pair + cta
            put(cta, 0, pair, 0, t0)
            for ev, dt in ((1, 0.5), (2, 1.0), (3, 1.2), (4, 1.5 + cta), (5, 1.6), (6, 2.0),
                           (7, 3.0)):
                put(cta, 0, pair, ev, t0 + dt)
            if pair != 3:
                put(cta, 1, pair, 0, t0 + 0.25)
                put(cta, 1, pair, 1, t0 + 0.75)
    res = td.pair_events(stamps, first=1, last=3)
    assert res[0]["t1"] == pytest.approx(0.5) and res[0]["t7"] == pytest.approx(3.0)
    # half 0's expansion takes 0.3 us in CTA 0, 1.3 in CTA 1: the median of six is the upper
    assert res[0]["expand half 0"] == pytest.approx(1.3)
    assert res[0]["expand half 1"] == pytest.approx(0.4)
    assert res[0]["start to the other's scale"] == pytest.approx(0.5)
    assert res[0]["pair"] == pytest.approx(100.0)
    assert res[1]["t1"] == pytest.approx(0.5) and res[1]["t2"] != res[1]["t2"]  # (nan: none)
    assert res[1]["pair"] == pytest.approx(100.0)  # (pair 1 -> 2; 2 -> 3 is unstamped)


TRACE_SCRIPT = r"""
import glob, json, os, sys
from tools import trace_decode

trace_decode.traced_kernel(False, kv_fp8=sys.argv[1] == "fp8")
files = glob.glob(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "*.ptx"))
print(json.dumps({"traced": sum(open(f).read().count("%globaltimer") for f in files)}))
"""


@pytest.mark.parametrize("cache,reads", [("bf16", 49), ("fp8", 57)])
def test_trace_build_compiles(tmp_path, cache, reads):
    """The trace build (one more argument, the stamp table; over an e4m3 cache, exact mode, its
    arguments after it) reads %globaltimer at each point (tests/test_kernel_compile.py checks
    that the shipped kernels read none). The segment and kernel points: the kernel's start and
    end, the segment's points 0-5 and 9, WG0's pair start in each of its three pair variants
    (has1, has2 compile-time), point 6 of the epilogue and 7, 8 of the output store (one
    instance a dtype: fp32 partials, bf16 output): 2 + 7 + 3 + 1 + 2 * 2 = 17. The pair events:
    WG0's pair start again (3 variants), its events 1 (3), 2 and 7 (the variant with a next
    S: 2); WG1's start and events 1, 2 in each of its five pair calls (15) and 7 (1); the
    halves' landing (bf16) or landing and expansion (fp8) in the four Q K^T calls of
    those (two segment starts, the two pair variants with a next S): 4 x 2 or 4 x 4. bf16: 17
    + 3 + 5 + 16 + 8 = 49; fp8: 57."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="ptx",
               CUTE_DSL_DUMP_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", TRACE_SCRIPT, cache], env=env,
                         capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    counts = json.loads(res.stdout.strip().splitlines()[-1])
    assert counts == {"traced": reads}, counts


def test_ptxas_figures_parses_the_dsl_remarks():
    """tools/ptxas_figures.py reads each entry's registers and spill from the DSL's ptxas
    remarks (wrapped lines, the name on the line after "Compiling entry function")."""
    from tools import ptxas_figures

    text = """          ptxas info    : Compiling entry function
          'kernel_cutlass_kernel_torch_mlacute_kernelscombineMLACombine_object_at__tensor_x'
          for 'sm_90a'
          ptxas         .     88 bytes stack frame, 20 bytes spill stores, 28 bytes spill loads
          ptxas info    : Used 64 registers, used 1 barriers, 88 bytes cumulative stack size
          ptxas info    : Compiling entry function
          'some_other_kernel' for 'sm_90a'
          ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
          ptxas info    : Used 168 registers, used 1 barriers"""
    assert ptxas_figures.figures(text) == [
        {"kernel": "combine.MLACombine", "registers": 64, "spill_stores": 20, "spill_loads": 28,
         "stack": 88},
        {"kernel": "some_other_kernel", "registers": 168, "spill_stores": 0, "spill_loads": 0,
         "stack": 0}]
    assert [ptxas_figures.parse_value(v) for v in ("16", "true", "bf16")] == [16, True, "bf16"]


def test_sass_loads_reads_nvdisasm_output():
    """tools/sass_loads.py: the kernels of nvdisasm's output, and in the region around the fp8
    conversion each load, wait and fence, and the first read of each load's registers (a load
    issued after the wait shows as such; predicates stripped)."""
    from tools import sass_loads

    sass = """
        .section .text.kernel_a,"ax",@progbits
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        .section .text.kernel_Split_b,"ax",@progbits
        /*0000*/                   LDG.E.EL.LTC256B.128.CONSTANT R40, desc[UR30][R24.64] ;
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR17+0x38200], R9 ;
        /*0020*/              @!P0 LDG.E.EL.64.CONSTANT R60, desc[UR30][R36.64+0x208] ;
        /*0030*/                   IADD3 R5, R6, R7, RZ ;
        /*0040*/                   F2FP.F16.E4M3.UNPACK_B R71, R41.reuse ;
        /*0050*/                   MEMBAR.ALL.CTA ;
        /*0060*/                   F2FP.F16.E4M3.UNPACK_B R72, R61 ;
"""
    found = sass_loads.kernels(sass)
    assert list(found) == ["kernel_a", "kernel_Split_b"]
    ins = sass_loads.instructions(found["kernel_Split_b"])
    assert [op for _, op, _ in ins][:3] == ["LDG.E.EL.LTC256B.128.CONSTANT",
                                            "SYNCS.PHASECHK.TRANS64.TRYWAIT",
                                            "LDG.E.EL.64.CONSTANT"]
    assert sass_loads.load_order(ins, before=4) == [
        "     0  LDG.E.EL.LTC256B.128.CONSTANT R40, desc[UR30][R24.64]",
        "     1  SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR17+0x38200], R9",
        "     2  LDG.E.EL.64.CONSTANT R60, desc[UR30][R36.64+0x208]",
        "     4    first use of the load at 0: F2FP.F16.E4M3.UNPACK_B",
        "     5  MEMBAR.ALL.CTA",
        "     6    first use of the load at 2: F2FP.F16.E4M3.UNPACK_B"]
    # a store reads every register it names; a leading predicate and the register after it are
    # written; an LDG's address read is a use; a register written before it is read drops its
    # load; an LDG.64 writes two registers
    more = sass_loads.instructions("""
        /*0000*/                   LDG.E.64 R10, desc[UR4][R2.64] ;
        /*0010*/                   LDG.E R20, desc[UR4][R4.64] ;
        /*0020*/                   SHFL.IDX PT, R30, R31, R32, 0x1f ;
        /*0030*/                   STS [R11+0x10], R40 ;
        /*0040*/                   MOV R20, R41 ;
        /*0050*/                   LDG.E R50, desc[UR4][R10.64] ;
        /*0060*/                   F2FP.F16.E4M3.UNPACK_B R60, R20 ;
""")
    assert sass_loads.load_order(more, before=6) == [
        "     0  LDG.E.64 R10, desc[UR4][R2.64]",
        "     1  LDG.E R20, desc[UR4][R4.64]",
        "     3    first use of the load at 0: STS",
        "     5  LDG.E R50, desc[UR4][R10.64]"]


def test_ptxas_figures_on_a_build():
    """The tool on a real build (the combine at 16 warps a row, ~5 s): one line with figures."""
    res = subprocess.run([sys.executable, "-m", "tools.ptxas_figures", "CombineKernelConfig",
                          "dtype=bf16", "warps_per_row=16"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("combine.MLACombine: ")]
    assert len(lines) == 1 and " registers, " in lines[0] and "spill stores" in lines[0], res.stdout
    assert int(lines[0].split(": ")[1].split(" ")[0]) > 0


def test_sparse_trace_summary_keeps_nanoseconds_of_globaltimer_stamps():
    """tools/trace_sparse.py's summary of one CTA with two 8-block segments whose %globaltimer
    stamps sit near 1.8e18 ns, as on the GPU: the phases come out to the nanosecond (a double
    holds such a stamp only to 256 ns, so the difference is taken in int64 first), and the
    first segment's phases apart from the later one's."""
    from tools import trace_sparse as ts

    base = 1_800_000_000_000_000_123
    stamps = torch.zeros(1, ts.TRACE_SLOTS, dtype=torch.int64)
    stamps[0, 0], stamps[0, ts.TRACE_END] = base, base + 90_001
    for k, t0 in enumerate((base + 1_001, base + 40_003)):  # the segments' start stamps
        for i, p in enumerate(ts.POINTS):
            stamps[0, ts.segment_slot(k, p)] = t0 + 1_000 * i + 7 * (k + 1) * (i > 0)
        blocks = ts.TRACE_BLOCK0 + ts.TRACE_BLOCKS * k
        stamps[0, blocks:blocks + 8] = t0 + 3_000 + 2_901 * torch.arange(8)
    s = ts.summarize(stamps, [[(8, False), (8, False)]])
    q = ts.POINTS.index("q")
    assert s["phases"]["q_wait"] == pytest.approx((1_000 * q + 7) / 1e3, abs=1e-9)
    assert s["phases_later"]["q_wait"] == pytest.approx((1_000 * q + 14) / 1e3, abs=1e-9)
    assert s["block"] == (pytest.approx(2.901, abs=1e-9), 2 * 4)  # (blocks 2-6 of each)
    assert s["span"] == pytest.approx(90.001, abs=1e-9)
