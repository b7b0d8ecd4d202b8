"""The SM90 sparse kernel's gather on the CPU (cute_kernels/sm90_sparse_decode.py,
gather_offsets): which 16-byte chunk of which key row each lane of the loading warp copies at
each step, and where it lands in the 128-byte-swizzled 64 x 64 tile the MMAs read."""

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
