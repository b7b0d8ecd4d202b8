"""Internal hooks of torch_mla that the tools and benchmarks use, in one place: a decode
kernel's raw arguments, the decode kernel and the combine timed alone, whether a kernel runs,
the portable kernel with other tiles, a forced combine variant. Internal but kept stable for
tools/ and benchmarks/; not for applications (torch_mla's public API is in its package
docstring). Apart from torch_mla.testing so that the ops' first-use check, which builds its
inputs there, does not import the dispatch back.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING

import torch

from .constants import D_QK, D_V, LOG2_E, PAGE_SIZE
from .testing import DecodeInputs, graph_time_us

if TYPE_CHECKING:
    from .ops.schedule import DecodeSchedule



def kernel_args(inp: DecodeInputs, sched: DecodeSchedule) -> tuple:
    """The SM90 decode kernel's arguments for ``inp`` and schedule ``sched`` (as
    torch_mla/ops/dispatch.py passes them), with fresh output and workspace buffers: (q
    [b, rows, 576], kv [pages, 64, 576], block_table, seqlens, metadata, num_splits, out
    [b, rows, 512], lse [b, h_q, s_q], out_acc [slots, rows, 512] fp32, lse_acc [slots, rows]
    fp32, scale_log2)."""
    q = inp.q
    b, s_q, h_q, _ = q.shape
    rows = s_q * h_q
    slots = b + sched.metadata.shape[0]
    return (q.reshape(b, rows, D_QK), inp.kv_cache.view(-1, PAGE_SIZE, D_QK), inp.block_table,
            inp.cache_seqlens, sched.metadata, sched.num_splits,
            torch.empty(b, rows, D_V, dtype=q.dtype, device=q.device),
            torch.empty(b, h_q, s_q, dtype=torch.float32, device=q.device),
            torch.empty(slots, rows, D_V, dtype=torch.float32, device=q.device),
            torch.empty(slots, rows, dtype=torch.float32, device=q.device),
            D_QK**-0.5 * LOG2_E)


def breakdown_us(inp: DecodeInputs, sched: DecodeSchedule, causal: bool) -> tuple[float, float]:
    """(SM90 decode kernel alone, combine kernel alone) in us, each captured and replayed on its
    own (:func:`graph_time_us`); bf16/fp16 ``inp`` on an H100/H200."""
    from .ops import dispatch, registry

    b, s_q, h_q = inp.q.shape[:3]
    dt = registry.dtype_name(inp.q.dtype)
    decode = registry.compiled(registry.DecodeConfig("sm90", dt, causal and s_q > 1),
                               registry.SM90_ARCH)
    choice = dispatch.combine_config(b, sched.metadata.shape[0], s_q * h_q,
                                     dispatch.device_num_sms(inp.q.device))
    combine = registry.compiled(registry.CombineKernelConfig(dt, choice.warps_per_row,
                                                             choice.unroll), registry.SM90_ARCH)
    args = kernel_args(inp, sched)
    num_splits, out3, lse, oacc, lseacc = args[5:10]
    # (The decode kernel alone takes its fp8 arguments too: None, None, None for a 16-bit cache.)
    t_dec = graph_time_us(lambda: decode(*args, None, None, None))
    table, lens = args[2], args[3]
    t_comb = graph_time_us(lambda: combine(num_splits, oacc, lseacc, out3, lse, table, lens,
                                           args[1].shape[0]))
    return t_dec, t_comb


def runs_kernel(q: torch.Tensor, kv_cache: torch.Tensor, d_v: int = D_V) -> bool:
    """Whether mla_decode runs a CuTe DSL kernel for inputs like these (else the reference)."""
    from .ops.dispatch import find_decode_kernel

    return find_decode_kernel(q, kv_cache, d_v) is not None


@contextlib.contextmanager
def portable_kernel(tiles: tuple[int, int, int] | None = None, on: bool = True):
    """Within it, mla_decode runs the portable (SM80-class) kernel (TORCH_MLA_PORTABLE=1), built
    with ``tiles`` = (block_m, block_n, stages) when given (its heuristic's otherwise); with
    ``on=False`` the default kernel instead. The environment and the step are restored after."""
    from .ops import dispatch, registry

    old_env = os.environ.get("TORCH_MLA_PORTABLE")
    old = dispatch.STEPS["sm80"]
    if on:
        os.environ["TORCH_MLA_PORTABLE"] = "1"
    else:
        os.environ.pop("TORCH_MLA_PORTABLE", None)
    if tiles:
        dispatch.STEPS["sm80"] = lambda dtype, causal, index: registry.compiled(
            registry.DecodeStepConfig("sm80", registry.dtype_name(dtype), causal, tiles=tiles),
            dispatch.device_arch(index))
    try:
        yield
    finally:
        dispatch.STEPS["sm80"] = old
        if old_env is None:
            os.environ.pop("TORCH_MLA_PORTABLE", None)
        else:
            os.environ["TORCH_MLA_PORTABLE"] = old_env


@contextlib.contextmanager
def combine_warps(warps_per_row: int, unroll: int = 4):
    """Within it, mla_decode's combine merges each row with ``warps_per_row`` warps, ``unroll``
    pieces at once (one of constants.COMBINE_VARIANTS) whatever CombineConfig's heuristic would
    choose."""
    from .constants import COMBINE_VARIANTS
    from .ops import dispatch

    old = dispatch.combine_variant
    index = COMBINE_VARIANTS.index((warps_per_row, unroll))
    dispatch.combine_variant = lambda batch, num_parts, rows, num_sms=132: index
    try:
        yield
    finally:
        dispatch.combine_variant = old
