"""What the split-KV decode kernels (sm90_decode, sm100_decode, sm80_decode) share on the host.

DecodeKernel.__call__ is every decode kernel's jit entry point, on the decode arguments of
torch_mla/contract.py (DECODE_KERNEL_ARGS, then FP8_ARGS for a float8_e4m3fn-cache kernel). It
launches the kernel's device function on a grid of (m-blocks of block_m query rows, schedule
parts) CTAs, one wave (torch_mla.scheduling):

    kernel(inputs, tensors, scale_log2, extra)  ->  body(inputs, tensors, scale_log2, *extra)

``kernel`` (the one device entry, defined here) calls the subclass's ``body``, which holds the
kernel's code. The kernel's ``_prepare(mQ, mKV, fp8)`` returns (inputs, extra): how Q and the
cache reach the device (a TmaLoads, or the tensors themselves), and what the kernel takes after
the scale (the Fp8Args where it reads them, its layouts, copies and MMAs); it also sets
``self.shared_storage`` (shared_struct).
``tensors`` (SplitKVTensors) are the schedule's and the outputs' tensors, which every kernel
reads and writes the same way (splitkv.py).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Float32, const_expr

from ..constants import BLOCK_M
from . import splitkv


class SplitKVTensors(NamedTuple):
    """The tensors of the split-KV walk and its results (contract.py's shapes; rows =
    s_q * h_q), passed to a decode kernel's device function as one argument."""

    block_table: cute.Tensor  # (b, max_blocks) int32
    seqlens: cute.Tensor  # (b,) int32
    metadata: cute.Tensor  # (num_parts, 8) int32: the schedule
    num_splits: cute.Tensor  # (b + 1,) int32
    out: cute.Tensor  # (b, rows, 512)
    lse: cute.Tensor  # (b, h_q, s_q) fp32
    oacc: cute.Tensor  # (slots, rows, 512) fp32
    lseacc: cute.Tensor  # (slots, rows) fp32, log2 domain


class TmaLoads(NamedTuple):
    """How Q and the cache reach a TMA kernel: each one's TMA atom and the tensor view its
    coordinates index (cpasync.make_tiled_tma_atom's pair)."""

    q_atom: cute.CopyAtom
    q_view: cute.Tensor
    kv_atom: cute.CopyAtom
    kv_view: cute.Tensor


class Fp8Args(NamedTuple):
    """The float8_e4m3fn-cache arguments (contract.py's FP8_ARGS), all None for a 16-bit
    cache."""

    kv_scale: cute.Tensor  # (1,) fp32, the cache's dequantization scale
    q_scale: cute.Tensor  # (1,) fp32, q's scale, read where q_scaled != 0
    q_scaled: object  # Int32


def aligned(dtype, n: int):
    """A shared_struct field: n elements of dtype, 1 KB aligned (the swizzle atoms' period)."""
    return cute.struct.Align[cute.struct.MemRange[dtype, n], 1024]


def shared_struct(**fields):
    """A kernel's shared memory: the struct of `fields` (name=type), in order."""
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


class DecodeKernel:
    """A split-KV decode kernel: a subclass sets num_threads (and block_m where a CTA takes
    other than the schedule's 64 query rows) and defines _prepare and the device function
    ``body`` (the device code, called by ``kernel``); kv_fp8 kernels take FP8_ARGS."""

    block_m = BLOCK_M  # query rows a CTA
    cluster_m = 1  # CTAs a cluster along the query rows (launch)
    kv_fp8 = False  # over a float8_e4m3fn cache: takes kv_scale, q_scale, q_scaled

    can_implement = staticmethod(splitkv.supports)

    def _table_blocks(self, mBlockTable):
        """How many 64-key blocks the table's rows cover (the walk stops there; the sparse
        kernels' walk: blocks of entries)."""
        return mBlockTable.shape[1]

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, rows, 576), rows 16-byte aligned
        mKV: cute.Tensor,  # (num_blocks, 64, 576), rows 16-byte aligned, any page/row stride
        mBlockTable: cute.Tensor,  # (b, max_blocks) int32
        mSeqlens: cute.Tensor,  # (b,) int32
        mMeta: cute.Tensor,  # (num_parts, 8) int32
        mNumSplits: cute.Tensor,  # (b + 1,) int32
        mO: cute.Tensor,  # (b, rows, 512)
        mLSE: cute.Tensor,  # (b, h_q, s_q) fp32
        mOacc: cute.Tensor,  # (slots, rows, 512) fp32
        mLSEacc: cute.Tensor,  # (slots, rows) fp32, log2 domain
        scale_log2: Float32,
        stream,
        mKVScale: cute.Tensor = None,  # kv_fp8: (1,) fp32, the cache's dequantization scale
        mQScale: cute.Tensor = None,  # kv_fp8: (1,) fp32, q's scale (read if q_scaled != 0)
        q_scaled=None,  # kv_fp8: Int32, 1 when q_scale applies
    ):
        fp8 = Fp8Args(mKVScale, mQScale, q_scaled)
        # A kernel without kv_fp8 would ignore the scales: refused at compile time.
        assert self.kv_fp8 or all(x is None for x in fp8), (
            f"{type(self).__name__} takes no float8_e4m3fn-cache arguments")
        inputs, extra = self._prepare(mQ, mKV, fp8)
        tensors = SplitKVTensors(mBlockTable, mSeqlens, mMeta, mNumSplits, mO, mLSE, mOacc,
                                 mLSEacc)
        # A CTA per block_m query rows and schedule part (a cluster of cluster_m CTAs along
        # the rows: a subclass's CTAs of one part that share work; the host picks such a
        # kernel only where the m-blocks divide into clusters).
        num_m_blocks = (mO.shape[1] + self.block_m - 1) // self.block_m
        launch = {}
        if const_expr(self.cluster_m > 1):
            launch["cluster"] = [self.cluster_m, 1, 1]
        self.kernel(inputs, tensors, scale_log2, extra).launch(
            grid=[num_m_blocks, mMeta.shape[0], 1],
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            **launch,
        )


    @cute.kernel
    def kernel(self, inputs: tuple, tensors: SplitKVTensors, scale_log2: Float32, extra: tuple):
        """The device function of every decode kernel (the arguments of the module docstring):
        the subclass's ``body``."""
        self.body(inputs, tensors, scale_log2, *extra)


# --- compile entry (ops/registry.py: DecodeConfig) ---------------------------------------------


def compile_decode(config, arch: str):
    """The decode kernel of a DecodeConfig alone (its backend's kernel file's
    ``decode_kernel(config, arch)``), compiled for arch."""
    import importlib

    from ..contract import compile_decode_kernel, dsl_dtype

    backend = importlib.import_module(f"{__package__}.{config.backend}_decode")
    return compile_decode_kernel(backend.decode_kernel(config, arch), dsl_dtype(config.dtype),
                                 arch)
