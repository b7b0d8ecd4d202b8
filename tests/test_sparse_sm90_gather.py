"""The SM90 sparse kernel's gather on the CPU (cute_kernels/sm90_sparse_decode.py): which
16-byte chunk of which key row each lane of the loading warp copies at each step, and where it
lands (gather_offsets: the 128-byte-swizzled 16-bit tile the MMAs read; gather8_offsets and
fp8_tile_offset: the dense kernel's fp8 staging; the 656-byte rows' rope tile and scales)."""

from test_sparse_fp8_gather import swizzled

from torch_mla.cute_kernels.sm90_sparse_decode import ROWS_PER_LANE, gather_offsets


def test_every_chunk_of_a_tile_is_copied_once_to_its_swizzled_place():
    seen = {}
    for j in range(ROWS_PER_LANE):
        lines = set()
        for lane in range(32):
            row, c, off = gather_offsets(lane, j)
            assert (row, c) not in seen
            seen[row, c] = off
            # 16-bit values: element offset of column 8 c in the tile, in bytes
            assert off == 2 * swizzled(row, 8 * c, 64)
            lines.add(row)
        # one warp instruction: 4 whole rows (4 x 128 contiguous bytes of the cache)
        assert len(lines) == 4
    assert sorted(seen) == [(r, c) for r in range(64) for c in range(8)]
    assert sorted(seen.values()) == list(range(0, 64 * 128, 16))  # the tile, no overlap


def test_keysm_656_byte_stage_layout():
    # The keys-on-M sparse kernel's stage for the 656-byte rows (sm90_keysm_decode: 8 e4m3
    # tiles, the bf16 rope tile, the scales): the regions do not overlap and the rope tile is
    # 1 KB aligned; the gather's rope destinations (gather8: chunk cc of row r at
    # r * 128 + (cc ^ r % 8) * 16) are the work buffer's swizzled 16-bit tile, so the
    # consumers' linear copy keeps every value at its column; each expansion wave lies in one
    # tile, whose 128-column group _expand reads the scale of.
    from torch_mla.cute_kernels.sm90_keysm_decode import (
        GROUP_SCALES_AT,
        GROUP_STAGE_BYTES,
        ROPE_TILE_AT,
        TILE_ELEMS,
        fp8_unit,
    )

    assert ROPE_TILE_AT == 8 * TILE_ELEMS and ROPE_TILE_AT % 1024 == 0
    assert GROUP_SCALES_AT == ROPE_TILE_AT + 2 * TILE_ELEMS
    assert GROUP_STAGE_BYTES == GROUP_SCALES_AT + 16 * 64 and GROUP_STAGE_BYTES % 1024 == 0
    seen = set()
    for row in range(64):
        for cc in range(8):
            off = row * 128 + ((cc ^ (row % 8)) << 4)
            assert off == 2 * swizzled(row, 8 * cc, 64)
            seen.add(off)
    assert sorted(seen) == list(range(0, 8192, 16))
    n_cons = 128
    for w in range(8 * 256 // n_cons):
        tiles = {fp8_unit(w * n_cons + t)[0] // TILE_ELEMS for t in range(n_cons)}
        assert tiles == {w // 2}
        assert (w * n_cons // 256) // 2 == (w // 2) // 2  # _expand's group of the wave

def test_fp8_gather_and_staging_layout():
    # The SM90 sparse kernel's FP8 gather (gather8_offsets: every 16-byte chunk of an fp8 tile
    # once, 8 whole 64-byte rows an instruction) into the dense kernel's kv_fp8 staging
    # (fp8_tile_offset), and the 656-byte rows' extra regions: the bf16 rope tile in place (16-bit
    # tile 8) and each half's scales (group_scale_offset), which overlap no staged byte and lie in
    # the 16-bit region the half's own expansion writes (so they are read before it).
    from torch_mla.cute_kernels.sm90_decode import fp8_expand_addrs, group_scale_offset
    from torch_mla.cute_kernels.sm90_sparse_decode import (
        TILE8,
        TILE16,
        fp8_tile_offset,
        gather8_offsets,
    )

    seen = set()
    for j in range(8):
        rows = set()
        for lane in range(32):
            row, c, off = gather8_offsets(lane, j)
            assert off == row * 64 + c * 16 and (row, c) not in seen
            seen.add((row, c))
            rows.add(row)
        assert len(rows) == 8
    assert len(seen) == 64 * 4
    for cache, tiles in (("e4m3", range(9)), ("fp8_ds_mla", range(8))):
        regions = []
        for t in tiles:
            h, t0, nt = (0, 0, 4) if t < 4 else (1, 4, 4 if cache == "fp8_ds_mla" else 5)
            start = fp8_tile_offset(cache, t)
            # the dense kernel's staging: the upper part of the half's 16-bit region, which
            # _expand_half reads at fp8_expand_addrs' source offsets
            assert start == t0 * TILE16 + nt * TILE8 + (t - t0) * TILE8
            assert start - t0 * TILE16 == fp8_expand_addrs(nt, 2 * (t - t0), 0)[0]
            assert start + TILE8 <= (t0 + nt) * TILE16
            regions.append((start, start + TILE8))
        if cache == "fp8_ds_mla":
            regions.append((8 * TILE16, 9 * TILE16))  # the rope tile, 16-bit, in place
            for h in range(2):
                at = group_scale_offset(h)
                regions.append((at, at + 512))
                half = (4 * h * TILE16, (4 * h + 4) * TILE16)  # what the half's expansion writes
                assert half[0] <= at and at + 512 <= half[1] and at % 8 == 0
        regions.sort()
        assert all(a[1] <= b[0] for a, b in zip(regions, regions[1:])), regions
        assert regions[-1][1] <= 9 * TILE16  # inside the page buffer


def test_sparse_walks_count_blocks_of_entries():
    # Every sparse kernel's walk covers ceil(topk / 64) blocks of a token's entries (the dense
    # kernels' default, the block table's width, would walk topk "pages").
    from types import SimpleNamespace

    from torch_mla.cute_kernels.sm80_sparse_decode import MLASparseDecodeSm80
    from torch_mla.cute_kernels.sm90_keysm_sparse_decode import MLASparseDecodeKeysM
    from torch_mla.cute_kernels.sm90_sparse_decode import MLASparseDecodeSm90

    for cls in (MLASparseDecodeSm80, MLASparseDecodeSm90, MLASparseDecodeKeysM):
        for topk, blocks in ((64, 1), (100, 2), (2048, 32)):
            assert cls._table_blocks(None, SimpleNamespace(shape=(3, topk))) == blocks, cls


def test_four_warps_share_a_gather_once_each():
    # The SM90 sparse kernel's refill is issued by the four warps of a warpgroup (load_warps):
    # warp_steps gives each a quarter of the steps; together every step once, and each step's
    # entry half h (which of a lane's two entries names the step's rows) is the one the single
    # warp gather uses (a compile-time value in both).
    from torch_mla.cute_kernels.sm90_sparse_decode import (
        MLASparseDecodeSm90,
        gather8_offsets,
        warp_steps,
    )

    for steps, offsets in ((ROWS_PER_LANE, gather_offsets), (8, gather8_offsets)):
        whole = dict(warp_steps(steps, None))
        assert sorted(whole) == list(range(steps))
        shared = [s for w in range(4) for s in warp_steps(steps, w)]
        assert sorted(j for j, _ in shared) == list(range(steps))
        for j, h in shared:
            assert h == whole[j]
            # the step's rows are entries of half h
            assert all(offsets(lane, j)[0] // 32 == h for lane in range(32))
    assert MLASparseDecodeSm90.load_warps == 4
    assert MLASparseDecodeSm90.k_arrivals == 4 * 33


def test_sparse_pingpong_gather_covers_the_stage():
    """gather_lines (cute_kernels/sm90_keysm_rs_sparse_decode.py): over its 8 steps and 9 groups
    the 32 lanes' 16-byte copies cover each of the stage's 64 rows x 576 bytes once, each from
    the same bytes of the row's cache line, with the row's entry from the lane's slots[h] (h:
    keys 0..31 or 32..63); each instruction writes 8 whole 64-byte runs of rows."""
    from torch_mla.cute_kernels.sm90_keysm_rs_sparse_decode import gather_lines_offsets

    seen = set()
    for j in range(8):
        for t in range(9):
            runs = {}
            for lane in range(32):
                row, h, byte, dst = gather_lines_offsets(lane, j, t)
                assert h == row // 32 and dst == row * 576 + byte
                assert all(dst + i not in seen for i in range(16))
                seen.update(dst + i for i in range(16))
                runs.setdefault(row, []).append(byte)
            assert len(runs) == 8 and all(sorted(b) == list(range(64 * t, 64 * t + 64, 16))
                                          for b in runs.values())
    assert seen == set(range(64 * 576))


def test_sparse_pingpong_ds_gather_places_every_byte():
    """Over the 656-byte rows (DS_ROW_BYTES 704 a ring row): gather_lines' 8 steps x 10 copies
    and gather_ds_scales' 2 a lane write each row's 512 e4m3 bytes to 0..511 of its slot, its 16
    bytes of scales to DS_SCALES_AT, its 128 bytes of rope chunk u to ds_rope_chunk(row, u), each
    byte once and from the same row's cache bytes (values 0..511, scales 512, rope 528 + 16 u),
    and nothing else of the stage."""
    from torch_mla.constants import FP8_DS_MLA_ROPE_AT, FP8_DS_MLA_SCALES_AT
    from torch_mla.cute_kernels.sm90_keysm_rs_sparse_decode import (
        DS_ROW_BYTES,
        DS_SCALES_AT,
        ds_rope_chunk,
        gather_copies,
        gather_lines_offsets,
    )

    placed = {}  # stage byte -> (row, cache byte)

    def put(row, src, dst):
        for i in range(16):
            assert dst + i not in placed
            placed[dst + i] = (row, src + i)

    for j in range(8):
        for t in range(gather_copies(True)):
            for lane in range(32):
                row, h, byte, dst = gather_lines_offsets(lane, j, t, True)
                assert h == row // 32 and row == lane // 4 + 8 * j
                put(row, byte, dst)
    for lane in range(32):  # gather_ds_scales: the lane's own keys lane, lane + 32
        for h in range(2):
            row = lane + 32 * h
            put(row, FP8_DS_MLA_SCALES_AT, row * DS_ROW_BYTES + DS_SCALES_AT)
    want = {}
    for row in range(64):
        for b in range(512):
            want[row * DS_ROW_BYTES + b] = (row, b)
        for b in range(16):
            want[row * DS_ROW_BYTES + DS_SCALES_AT + b] = (row, FP8_DS_MLA_SCALES_AT + b)
        for u in range(8):
            for b in range(16):
                want[row * DS_ROW_BYTES + ds_rope_chunk(row, u) + b] = (
                    row, FP8_DS_MLA_ROPE_AT + 16 * u + b)
    assert placed == want
