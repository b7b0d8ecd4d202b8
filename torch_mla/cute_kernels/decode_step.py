"""One decode step as one host call: the split-KV decode kernel, then the combine.

Each call of a compiled CuTe DSL function through TVM-FFI costs microseconds of host time
(argument conversion, the launcher); a decode step at small batch is bounded by host time, so the
two launches of a step go through one compiled function. The combine is compiled in all of its
variants (constants.COMBINE_VARIANTS; scheduling.CombineConfig) and the host code picks one by a
runtime index: host-side control flow, no device cost, and one compile per (decode kernel,
dtype, causal).

Works with any decode kernel (decode_base.DecodeKernel): its ``__call__`` takes (q, kv,
block_table, seqlens, meta, num_splits, out, lse, oacc, lseacc, scale_log2, stream, kv_scale,
q_scale, q_scaled; the last three None unless kv_fp8) and writes the partial results combine.py
merges.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32

from ..constants import COMBINE_VARIANTS  # the variants, in the runtime index's order
from .combine import MLACombine


class MLADecodeStep:
    """decode, then combine (variant ``COMBINE_VARIANTS[combine_variant]``)."""

    def __init__(self, decode, dtype, d_v: int = 512, use_pdl: bool = True):
        # use_pdl: the combine starts early as a programmatic dependent (sm_90 and later).
        self.decode = decode
        # A float8_e4m3fn-cache decode kernel (MLADecodeSm90(kv_fp8=True)) takes its scales.
        self.kv_fp8 = getattr(decode, "kv_fp8", False)
        self.combines = [MLACombine(dtype, d_v, w, use_pdl, u) for w, u in COMBINE_VARIANTS]
        assert len(self.combines) == 4, "combine() has a branch for each variant"

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, rows, d_qk)
        mKV: cute.Tensor,  # (num_blocks, 64, d_qk)
        mBlockTable: cute.Tensor,  # (b, max_blocks) int32
        mSeqlens: cute.Tensor,  # (b,) int32
        mMeta: cute.Tensor,  # (num_parts, 8) int32
        mNumSplits: cute.Tensor,  # (b + 1,) int32
        mO: cute.Tensor,  # (b, rows, d_v)
        mLSE: cute.Tensor,  # (b, h_q, s_q) fp32
        mOacc: cute.Tensor,  # (slots, rows, d_v) fp32
        mLSEacc: cute.Tensor,  # (slots, rows) fp32
        scale_log2: Float32,
        combine_variant: Int32,
        stream,
        mKVScale: cute.Tensor = None,  # kv_fp8: (1,) fp32
        mQScale: cute.Tensor = None,  # kv_fp8: (1,) fp32, read when q_scaled != 0
        q_scaled=None,  # kv_fp8: Int32, 1 when q_scale applies
    ):
        self.decode(mQ, mKV, mBlockTable, mSeqlens, mMeta, mNumSplits, mO, mLSE, mOacc, mLSEacc,
                    scale_log2, stream, mKVScale, mQScale, q_scaled)
        self.combine(combine_variant, (mNumSplits, mOacc, mLSEacc, mO, mLSE, mBlockTable,
                                       mSeqlens, mKV.shape[0], stream))

    @cute.jit
    def combine(self, combine_variant: Int32, args: tuple):
        """Launches combine variant ``combine_variant`` (a runtime index) on args (traced inside
        the step's jit)."""
        if combine_variant == 0:
            self.combines[0](*args)
        elif combine_variant == 1:
            self.combines[1](*args)
        elif combine_variant == 2:
            self.combines[2](*args)
        else:
            self.combines[3](*args)


# --- compile entry (ops/registry.py: DecodeStepConfig) ----------------------------------------


def compile_step(config, arch: str):
    """The decode step of a DecodeStepConfig: its backend's decode kernel (that kernel file's
    ``decode_kernel(config, arch)``) and the combine variants, compiled for arch."""
    import importlib

    from ..contract import compile_step_kernel, dsl_dtype, has_pdl

    backend = importlib.import_module(f"{__package__}.{config.backend}_decode")
    dtype = dsl_dtype(config.dtype)
    step = MLADecodeStep(backend.decode_kernel(config, arch), dtype, use_pdl=has_pdl(arch))
    return compile_step_kernel(step, dtype, arch)
