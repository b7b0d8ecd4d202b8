"""The portable sparse kernel's FP8 gather on the CPU (cute_kernels/sm80_sparse_decode.py,
_gather_fp8): which bytes each thread of a key row loads and where their values land in the
swizzled 16-bit tile (pure Python, then against the DSL's own layout of the stage buffers), and
the e4m3 -> 16-bit conversion's PTX (ptx._e4m3_asm, SM89's cvt and the integer path before it)
run by a small interpreter of the instructions it uses, byte for byte against torch."""

import re
import struct

import numpy as np
import pytest
import torch
from expecttest import assert_expected_inline
from test_kernel_compile import host_dsl_script

from torch_mla.constants import D_QK, D_V, FP8_DS_MLA_ROPE_AT, FP8_DS_MLA_SCALES_AT
from torch_mla.cute_kernels.ptx import _e4m3_asm
from torch_mla.cute_kernels.sm80_sparse_decode import ROPE_TILE, fp8_unit_offsets, fp8_units


def swizzled(row: int, col: int, bn: int) -> int:
    """Element offset of (key row, column) in a stage buffer, written out from smem_layouts:
    8 x 64 atoms (rows first, then the 9 column tiles), chunk (col % 64) // 8 XOR row % 8."""
    line = (col // 64) * bn * 64 + (row // 8) * 512 + (row % 8) * 64
    return line + (((col % 64) // 8) ^ (row % 8)) * 8 + col % 8


@pytest.mark.parametrize("cache", ["e4m3", "fp8_ds_mla"])
def test_each_value_of_a_row_is_loaded_once_and_lands_at_its_column(cache):
    # The 8 threads of a row, the two load calls of a stage (rope tile; latent tiles): every
    # e4m3 value is read once (bytes 16 u .. 16 u + 15 of unit u), from the row's e4m3 bytes
    # only, with the scale of its 128-value group, and goes where the 16-bit path's cp.async
    # puts that column (the 656-byte rows' bf16 rope, chunk j of tile 8 by cp.async: not here).
    n_e4m3 = D_QK if cache == "e4m3" else D_V
    for bn in (64, 32, 16):
        for row in range(bn):
            seen = []
            for j in range(8):
                for cols in ((ROPE_TILE, ROPE_TILE + 1), (0, ROPE_TILE)):
                    for u, g in fp8_units(cache, j, cols):
                        if u >= 32 and j >= 4:
                            continue  # the kernel's j < 4 (units 32-35)
                        d0, d1 = fp8_unit_offsets(u, row, bn)
                        assert (u // 4 == ROPE_TILE) == (cols[0] == ROPE_TILE)
                        for e in range(16):
                            col = 16 * u + e
                            assert (d0 if e < 8 else d1) + e % 8 == swizzled(row, col, bn)
                            assert g == (None if cache == "e4m3" else col // 128)
                            seen.append(col)
            assert sorted(seen) == list(range(n_e4m3)), (bn, row)
    assert FP8_DS_MLA_SCALES_AT == 16 * 32 and FP8_DS_MLA_ROPE_AT == 16 * 33  # 16-byte loads


# Host-side CuTe DSL: fp8_unit_offsets (the gather's destinations, at runtime Int32 rows and
# units as in the kernel) against the stage buffers' own layout at (row, column, stage).
LAYOUT_SCRIPT = r"""
import cutlass, cutlass.cute as cute
from cutlass import Int32
from torch_mla.cute_kernels.sm80_decode import D_QK, Sm80DecodeConfig, smem_layouts
from torch_mla.cute_kernels.sm80_sparse_decode import fp8_unit_offsets

@cute.jit
def check(cfg: cutlass.Constexpr):
    bn, st = cfg.block_n, cfg.stages
    _, k_layout, _ = smem_layouts(cfg)
    bad = Int32(0)
    for stage in cutlass.range(st, unroll=1):
        for row in cutlass.range(bn, unroll=1):
            for u in cutlass.range(D_QK // 16, unroll=1):
                d0, d1 = fp8_unit_offsets(u, row, bn)
                for e in cutlass.range(16, unroll=1):
                    d = d0 + e
                    if e >= 8:
                        d = d1 + e - 8
                    if stage * bn * D_QK + d != Int32(cute.crd2idx((row, 16 * u + e, stage),
                                                                   k_layout)):
                        bad += 1
    cute.printf("%dx%dx%d: %d of %d values misplaced\n", cfg.block_m, bn, st, bad,
                st * bn * D_QK)

for tiles in [(64, 64, 2), (64, 32, 2), (32, 16, 3)]:
    check(Sm80DecodeConfig(*tiles))
"""


def test_gather_destinations_match_the_stage_buffer_layout(tmp_path):
    stdout = host_dsl_script(tmp_path, "fp8_layout.py", LAYOUT_SCRIPT)
    lines = [x for x in stdout.splitlines() if "misplaced" in x]
    assert_expected_inline("\n".join(lines), """\
64x64x2: 0 of 73728 values misplaced
64x32x2: 0 of 36864 values misplaced
32x16x3: 0 of 27648 values misplaced""")


# ---- the conversion's PTX, interpreted --------------------------------------------------------

def _f16(bits: int) -> np.float16:
    return np.array([bits], dtype=np.uint16).view(np.float16)[0]


def _f16_bits(x) -> int:
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _round16(x: float, bf16: bool) -> int:
    t = torch.tensor([x], dtype=torch.float32).to(torch.bfloat16 if bf16 else torch.float16)
    return int(t.view(torch.int16).item()) & 0xFFFF


def run_asm(asm: str, operands: list) -> dict:
    """The shared memory (address -> 32-bit word) one _e4m3_asm block writes, operands $0.. as
    32-bit words. Only the instructions _e4m3_asm emits, with PTX's semantics: x2 forms put
    the first source operand (cvt from f32) or the upper input byte (cvt from e4m3x2) in the
    upper half; prmt's default mode picks bytes of {b, a} by the selector's nibbles."""
    reg, mem = {}, {}

    def val(x):
        x = x.strip()
        if x.startswith("$"):
            return operands[int(x[1:])]
        if x.startswith("0x") or x.isdigit():
            return int(x, 0)
        return reg[x]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        if op == "st.shared.v4.b32":
            addr, regs = re.match(r"\[(\S+)\], \{(.*)\}", rest).groups()
            for i, r in enumerate(regs.split(",")):
                mem[val(addr) + 4 * i] = val(r)
            continue
        dst, *src = [x.strip() for x in re.split(r",(?![^{]*\})", rest)]
        if op == "mov.b32" and dst.startswith("{"):  # unpack into two 16-bit registers
            lo, hi = dst.strip("{}").split(",")
            w = val(src[0])
            reg[lo.strip()], reg[hi.strip()] = w & 0xFFFF, w >> 16
            continue
        if op == "mov.b32" and src[0].startswith("{"):  # pack
            lo, hi = src[0].strip("{}").split(",")
            reg[dst] = val(lo) | val(hi) << 16
            continue
        a = [val(x) for x in src]
        if op == "mov.b32":
            out = a[0]
        elif op == "and.b32":
            out = a[0] & a[1]
        elif op == "or.b32":
            out = a[0] | a[1]
        elif op == "shl.b32":
            out = (a[0] << a[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            pool = (a[1] << 32 | a[0]).to_bytes(8, "little")
            out = int.from_bytes(bytes(pool[(a[2] >> 4 * i) & 7] for i in range(4)), "little")
        elif op == "cvt.rn.f16x2.e4m3x2":
            e = torch.tensor([a[0] & 0xFF, a[0] >> 8], dtype=torch.uint8).view(torch.float8_e4m3fn)
            h = e.to(torch.float16).view(torch.int16).tolist()
            out = (h[0] & 0xFFFF) | (h[1] & 0xFFFF) << 16
        elif op == "mul.rn.f16x2":
            out = 0
            for s in (0, 16):
                p = np.float32(_f16(a[0] >> s & 0xFFFF)) * np.float32(_f16(a[1] >> s & 0xFFFF))
                out |= _f16_bits(np.float16(p)) << s  # (exact here: a power of two)
        elif op == "cvt.f32.f16":
            out = struct.unpack("<I", struct.pack("<f", float(_f16(a[0]))))[0]
        elif op == "mul.rn.f32":
            p = np.float32(_f32(a[0])) * np.float32(_f32(a[1]))
            out = struct.unpack("<I", struct.pack("<f", p))[0]
        elif op in ("cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32"):
            bf16 = "bf16" in op
            out = _round16(_f32(a[1]), bf16) | _round16(_f32(a[0]), bf16) << 16
        else:
            raise NotImplementedError(op)
        reg[dst] = out
    return mem


@pytest.mark.parametrize("hw", [True, False])
@pytest.mark.parametrize("bf16", [True, False])
@pytest.mark.parametrize("scale", [None, 2.0**-7, 0.0123])
def test_e4m3_conversion_ptx_gives_torchs_values(hw, bf16, scale):
    # Every e4m3 byte, 16 a block: values k of the block at dst0 + 2 k (k < 8) and dst1 +
    # 2 (k - 8), each torch's e4m3 -> float32 (times the float32 scale, rounded to float32) ->
    # the 16-bit type. NaN bytes: NaN from the cvt; the integer path's +-480 (never read).
    dt = torch.bfloat16 if bf16 else torch.float16
    asm = _e4m3_asm(bf16, scale is not None, hw)
    for block in range(16):
        data = torch.arange(16 * block, 16 * block + 16, dtype=torch.uint8)
        words = data.view(torch.int32).tolist()
        ops = [0x100, 0x200] + [w & 0xFFFFFFFF for w in words]
        if scale is not None:
            ops.append(struct.unpack("<I", struct.pack("<f", scale))[0])
        mem = run_asm(asm, ops)
        raw = np.array([mem[a + 4 * i] for a in (0x100, 0x200) for i in range(4)],
                       dtype=np.uint32).tobytes()
        got = torch.frombuffer(bytearray(raw), dtype=dt).float()
        want = data.view(torch.float8_e4m3fn).float()
        if scale is not None:
            want = want * torch.tensor(scale, dtype=torch.float32)
        want = want.to(dt).float()
        nan = want.isnan()
        assert torch.equal(got[~nan], want[~nan]), (block, got, want)
        if hw:
            assert got[nan].isnan().all()
        elif scale is None:
            assert (got[nan].abs() == 480).all()


def test_split_producer_lanes_cover_each_chunk_once_without_bank_conflicts():
    """The split kernel's producer over the 656-byte rows (sm90_split_sparse_decode:
    token_of_lane, token_store_offsets): over a buffer half, the 128 threads' 2 keys x 4 chunks
    name each (key, 16-byte chunk) of the half exactly once; each chunk's bf16 values land
    where fp8_store_offsets (the producer kernel's layout, the one the MMAs read) puts them;
    and each 16-byte store's four phases of 8 lanes touch 8 distinct 16-byte bank groups."""
    from torch_mla.cute_kernels.sm90_producer_sparse_decode import fp8_store_offsets
    from torch_mla.cute_kernels.sm90_split_sparse_decode import token_of_lane, token_store_offsets

    for h in range(2):
        named = []
        for warp in range(4):
            for lane in range(32):
                for u in range(2):
                    key, q = token_of_lane(warp, lane, u)
                    for d in range(4):
                        named.append((key, 4 * d + q))
                        assert token_store_offsets(h, d, key, q) == fp8_store_offsets(
                            h, key, 4 * d + q), (h, warp, lane, u, d)
        assert sorted(named) == [(k, c) for k in range(64) for c in range(16)]
        for warp in range(4):
            for u in range(2):
                for d in range(4):
                    for half in range(2):  # (values 0-7, then 8-15: one store each)
                        for phase in range(4):
                            groups = {token_store_offsets(h, d, *token_of_lane(warp, x, u))[half]
                                      % 128 // 16 for x in range(8 * phase, 8 * phase + 8)}
                            assert len(groups) == 8, (h, warp, u, d, half, phase)


def test_split_sector_lanes_write_whole_sectors():
    """The pair's store layout (sector_store_offsets; round u is the CTA's rank):
    each thread's two chunks (values 64 d + 8 q and 64 d + 32 + 8 q of its key) land where
    fp8_store_offsets puts those values; over both ranks every (key, 8-value chunk) of a half
    is named once; each store instruction's 32 lanes write whole 32-byte sectors (each sector
    twice, its two halves), and each phase of 8 lanes touches 8 distinct 16-byte bank groups."""
    from torch_mla.cute_kernels.sm90_producer_sparse_decode import fp8_store_offsets
    from torch_mla.cute_kernels.sm90_split_sparse_decode import (
        sector_load_offsets,
        sector_store_offsets,
        token_of_lane,
    )

    for h in range(2):
        named = []
        for u in range(2):
            for warp in range(4):
                for lane in range(32):
                    key, q = token_of_lane(warp, lane, u)
                    for d in range(4):
                        # (each 8-byte piece's values: their 16-value chunk and its half)
                        for at, place in zip(sector_load_offsets(h, d, q),
                                             sector_store_offsets(h, d, key, q)):
                            assert at % 8 == 0 and 256 * h <= at < 256 * h + 256
                            assert at // 128 == 2 * h + d // 2  # (the scale scales[d // 2])
                            named.append((key, at // 8))
                            assert place == fp8_store_offsets(h, key, at // 16 - 16 * h)[
                                at // 8 % 2], (h, d, q, at)
            for warp in range(4):
                for d in range(4):
                    for half in range(2):  # (one store instruction each)
                        places = [sector_store_offsets(h, d, *token_of_lane(warp, x, u))[half]
                                  for x in range(32)]
                        sectors = [p // 32 for p in places]
                        assert all(sectors.count(c) == 2 for c in sectors), (h, u, warp, d)
                        assert len(set(places)) == 32
                        for phase in range(4):
                            groups = {p % 128 // 16 for p in places[8 * phase:8 * phase + 8]}
                            assert len(groups) == 8, (h, u, warp, d, half, phase)
        assert sorted(named) == [(k, c) for k in range(64) for c in range(32 * h, 32 * h + 32)]
