"""Writes new tokens' latents into the paged MLA cache: cache[slot[t]] = [kv_c[t] | k_pe[t]].

One thread per 16-byte vector of a cache row (576 elements of bf16/fp16 = 72 vectors), CTAs of
TOKENS_PER_CTA tokens x 72 threads: thread v of token t loads kv_c[t, 8v : 8v + 8] (v < 64) or
k_pe[t, 8(v - 64) : ...] (a 16-byte load, two for fp32 sources), converts to the cache dtype and
stores 16 bytes. A negative slot (padding) writes nothing; so does a slot past the cache, with
or without the checks, so the kernel never writes out of bounds.

Checks (runtime flags; each failure prints its message and traps, see device_error.py):
  check_range    a slot >= the cache's slots (num_blocks x 64) fails.
  check_repeats  two tokens writing one slot (slots >= 0) fail: thread v of token t compares
     slot[t] with slot[j] for j < t, j = v (mod 72), so each pair is compared once, by the later
     token. That is T^2 / 2 int reads in all, from L1/L2 (the slot array is a few KB); at
     T = 2048 it is 2M reads, ~14 per thread on average, up to ~28 for the last tokens (8 in
     flight at a time), spread over the grid's
     CTAs: about as long as the copy itself (2048 x 1152 bytes). The host asks for it up to
     that size and checks longer (prefill-sized) slot arrays with torch ops (ops/cache.py).

A float8_e4m3fn cache (AppendKVFp8; passed as its bytes, uint8) takes the same threads: each
converts its 8 values to fp32, divides them by kv_scale (div.rn, as the reference's
``x.float() / kv_scale``), rounds them to e4m3 with saturation at +-448 (cvt.rn.satfinite,
the reference's clamp then round to nearest even; NaN stays NaN) and stores 8 bytes.

Limits: d_v = 512 and d_rope = 64 (a 576-wide cache row), cache bf16/fp16 (any SM80+) or
float8_e4m3fn (SM89+: the e4m3 cvt) with one latent head, sources bf16/fp16/fp32 with
contiguous, 16-byte aligned rows, slots int32/int64.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from ..constants import D_ROPE, D_V
from .device_error import fail
from .ptx import e4m3x4

VEC = 8  # elements a thread writes: 16 bytes of bf16/fp16, 8 of e4m3
VECS = (D_V + D_ROPE) // VEC  # 72 per cache row
TOKENS_PER_CTA = 4
REPEAT_BATCH = 8  # earlier slots loaded at once by the repeat check


class AppendKV:
    """Compiled per (cache dtype, source dtype, slot dtype); the token count and the cache size
    are runtime values."""

    fp8 = False

    def __init__(self, cache_dtype, source_dtype):
        self.cache_dtype = cache_dtype
        self.source_dtype = source_dtype

    @cute.jit
    def __call__(
        self,
        mCache: cute.Tensor,  # (num_blocks, 64, 1, 576) cache dtype
        mKvC: cute.Tensor,  # (T, 512) source dtype, rows 16-byte aligned
        mKPe: cute.Tensor,  # (T, 64) source dtype, rows 16-byte aligned
        mSlots: cute.Tensor,  # (T,) int32/int64
        check_range: Int32,  # nonzero: a slot past the cache fails
        check_repeats: Int32,  # nonzero: a slot >= 0 written twice fails
        stream,
    ):
        self.launch(mCache, mKvC, mKPe, mSlots, check_range, check_repeats, None, stream)

    @cute.jit
    def launch(self, mCache, mKvC, mKPe, mSlots, check_range, check_repeats, mScale, stream):
        T = mSlots.shape[0]
        self.kernel(mCache, mKvC, mKPe, mSlots, check_range, check_repeats, mScale).launch(
            grid=[(T + TOKENS_PER_CTA - 1) // TOKENS_PER_CTA, 1, 1],
            block=[TOKENS_PER_CTA * VECS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mCache, mKvC, mKPe, mSlots, check_range, check_repeats, mScale):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        t = bidx * TOKENS_PER_CTA + tidx // VECS
        v = tidx % VECS
        T = mSlots.shape[0]
        num_slots = Int64(mCache.shape[0]) * mCache.shape[1]
        if t < T:
            slot = Int64(mSlots[t])
            if (check_range != 0) & (v == 0) & (slot >= num_slots):
                fail("torch_mla.append_kv: slot_mapping[%d] = %lld, but the cache has only %lld "
                     "slots (num_blocks x 64)", t, slot, num_slots)
            if (check_repeats != 0) & (slot >= 0):
                # REPEAT_BATCH loads in flight before the first compare (a branch per value
                # would otherwise wait for each load in turn); past t: a clamped index.
                for j0 in cutlass.range(v, t, REPEAT_BATCH * VECS, unroll=1):
                    other = [mSlots[cutlass.min(j0 + k * VECS, t - 1)]
                             for k in range(REPEAT_BATCH)]
                    for k in cutlass.range_constexpr(REPEAT_BATCH):
                        if (j0 + k * VECS < t) & (Int64(other[k]) == slot):
                            fail("torch_mla.append_kv: slot_mapping[%d] and slot_mapping[%d] "
                                 "both write slot %lld; slots >= 0 must be distinct",
                                 j0 + k * VECS, t, slot)
            if (slot >= 0) & (slot < num_slots):
                page = Int32(slot // mCache.shape[1])
                row = Int32(slot % mCache.shape[1])
                dst = cute.local_tile(mCache[page, row, 0, None], (VEC,), (v,))
                if v < D_V // VEC:
                    self.copy(cute.local_tile(mKvC[t, None], (VEC,), (v,)), dst, mScale)
                else:
                    self.copy(cute.local_tile(mKPe[t, None], (VEC,), (v - D_V // VEC,)), dst,
                              mScale)

    @cute.jit
    def copy(self, src: cute.Tensor, dst: cute.Tensor, mScale):
        x = src.load()
        if const_expr(mScale is not None):
            # e4m3 bytes: x / kv_scale, rounded and saturated, as two words (8-byte store).
            y = cute.make_rmem_tensor(VEC, Float32)
            y.store(x.to(Float32))
            scale = mScale[0]
            w = cute.make_rmem_tensor(VEC // 4, Int32)
            for i in cutlass.range_constexpr(VEC // 4):
                w[i] = e4m3x4(*[y[4 * i + k] / scale for k in range(4)])
            cute.autovec_copy(w, cute.recast_tensor(dst, Int32))
        else:
            if const_expr(self.source_dtype != self.cache_dtype):
                x = x.to(self.cache_dtype)
            dst.store(x)


class AppendKVFp8(AppendKV):
    """A float8_e4m3fn cache, passed as uint8 bytes, with its float32 [1] kv_scale."""

    fp8 = True

    def __init__(self, source_dtype):
        super().__init__(cutlass.Uint8, source_dtype)

    @cute.jit
    def __call__(
        self,
        mCache: cute.Tensor,  # (num_blocks, 64, 1, 576) uint8 (the e4m3 bytes)
        mKvC: cute.Tensor,
        mKPe: cute.Tensor,
        mSlots: cute.Tensor,
        check_range: Int32,
        check_repeats: Int32,
        mScale: cute.Tensor,  # (1,) float32: cache value = e4m3 * kv_scale
        stream,
    ):
        self.launch(mCache, mKvC, mKPe, mSlots, check_range, check_repeats, mScale, stream)


# --- compile entry (ops/registry.py: AppendKVConfig) ------------------------------------------


def compile_append_kv(config, arch: str):
    """append_kv for a cache of config.cache ("e4m3": AppendKVFp8), sources of config.source
    and slots of config.slot, compiled for arch."""
    from ..contract import compile_append_kernel, dsl_dtype

    source = dsl_dtype(config.source)
    kernel = (AppendKVFp8(source) if config.cache == "e4m3"
              else AppendKV(dsl_dtype(config.cache), source))
    return compile_append_kernel(kernel, dsl_dtype(config.slot), arch)
