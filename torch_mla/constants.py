"""The numbers of the MLA decode contract, defined once: the ops, the reference, the schedule
and every kernel import them from here (no module spells them again).

Pure Python (no torch, no DSL import), so kernel modules and host code can both use it.
"""

import math

# DeepSeek's latent: 512 compressed KV values and 64 RoPE key values a token, cached together.
D_V = 512  # value width (the compressed latent); the output's width
D_ROPE = 64  # the RoPE part of the key
D_QK = D_V + D_ROPE  # 576: query / key width
PAGE_SIZE = 64  # tokens a cache page (block) holds
BLOCK_M = 64  # query rows (s_q * h_q) a decode CTA tile holds
# The keys-on-M SM90 kernel's query columns a CTA (cute_kernels/sm90_keysm_decode.py): rows
# padded up to one of these; wgmma's N from 8 up, two consumer warpgroups of 32 at 64.
KEYSM_COLUMNS = (8, 16, 32, 64)
# Where the dispatch picks it by default: s_q * h_q <= 32 (measured on the H200, bf16 and e4m3
# caches, b 1-128: 0.57-0.96x the heads-on-M kernel's time at 8-32 rows, 1.11-1.27x at 64 rows
# and b 128; docs/kernels/keysm.md "Kernel choice"). TORCH_MLA_KEYSM=1 extends it to 64 rows,
# TORCH_MLA_KEYSM=0 turns it off.
KEYSM_DEFAULT_ROWS = 32
# The ping-pong keys-on-M kernel over an e4m3 cache (cute_kernels/sm90_keysm_rs_decode.py): its
# columns in exact mode (at 64 its two warpgroups split the columns instead of alternating
# pages: opt-in; run on an H100 in sessions 26 and 50); its fast mode
# (cute_kernels/sm90_keysm_fast_decode.py, a subclass) takes the ping-pong ones.
KEYSM_RS_COLUMNS = (8, 16, 32, 64)
KEYSM_FAST_COLUMNS = (8, 16, 32)
# Fast mode takes that variant from this batch on, by columns (at 32 columns and b 1 the
# heads-on-M fast mode is faster; docs/kernels/keysm.md "Session 23").
KEYSM_FAST_MIN_BATCH = {8: 1, 16: 1, 32: 4}
# The ping-pong variant is the exact mode's default from this batch on, by columns (below it the
# keys-on-M kernel is faster: one warpgroup a page, less work a segment; docs/kernels/keysm.md
# "Kernel choice over an e4m3 cache" and, for 32 columns, "Session 23"); 64 columns: only with
# TORCH_MLA_KEYSM_RS=1 (and TORCH_MLA_KEYSM=1, which gives the keys-on-M kernel 64 rows).
KEYSM_RS_MIN_BATCH = {8: 8, 16: 8, 32: 32}

# The schedule's metadata, int32 [num_parts, METADATA_WIDTH], one row a part (scheduling.py):
META_BEGIN_REQ = 0  # first request of the part
META_BEGIN_BLK = 1  # its first key block
META_END_REQ = 2  # last request of the part (inclusive)
META_END_BLK = 3  # the block after its last one, in the last request (exclusive)
META_BEGIN_SPLIT = 4  # piece index of the part's first segment within its request
METADATA_WIDTH = 8  # columns 5-7 reserved (0)

# FlashMLA's metadata kernel charges 5 blocks per segment (a sequential greedy fill); the closed
# form in scheduling.py charges them per request start (see there).
OVERHEAD_BLOCKS = 5
# The combine kernel's variants, (warps that merge one row, pieces a warp loads at once):
# scheduling.CombineConfig picks one of them; the decode step compiles all of them and takes the
# index at run time. (16, 4) takes 80 registers a thread (one 512-thread CTA an SM), (16, 2) 59
# (two an SM).
COMBINE_VARIANTS = ((1, 4), (4, 4), (16, 4), (16, 2))

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# DeepSeek-V3.2's FP8 cache for sparse decode (FlashMLA's "V32_FP8Sparse", vLLM's fp8_ds_mla),
# one 656-byte row a token: D_V e4m3 values, a float32 scale per FP8_TILE of them, then the D_ROPE
# RoPE values in bf16 (not quantized). reference_sparse.py documents the bytes.
FP8_TILE = 128  # values one scale covers
FP8_NUM_TILES = D_V // FP8_TILE  # 4
FP8_DS_MLA_SCALES_AT = D_V  # byte offset of the scales (512)
FP8_DS_MLA_ROPE_AT = FP8_DS_MLA_SCALES_AT + 4 * FP8_NUM_TILES  # byte offset of the RoPE part (528)
FP8_DS_MLA_BYTES = FP8_DS_MLA_ROPE_AT + 2 * D_ROPE  # 656
