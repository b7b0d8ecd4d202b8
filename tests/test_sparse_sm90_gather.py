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
