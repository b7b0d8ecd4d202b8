"""First-use check of a kernel that has not yet been validated on the GPU it runs on.

The SM100 kernel is compile-checked on the CPU but has not run on a Blackwell GPU, and the
portable dense decode kernel has run only on an H200 (forced). Before a process uses either on a
GPU other than compute capability 9.0 (dispatch.find_decode_kernel), it runs on a few small random
problems whose caches are NaN-poisoned wherever the kernel must not read (slots past each length,
spare pages; unused block-table entries are huge ids), and its output and lse are compared with
the reference; the dispatch falls back to the reference, with a warning, if anything differs.
"""

from __future__ import annotations

import torch

from ..constants import D_QK, D_V
from ..reference import mla_decode_reference
from ..scheduling import DecodeSplitConfig, default_num_sms
from ..testing import make_decode_inputs

# (lengths, s_q, h_q, causal): page edges and an empty request, two 64-row blocks with causal
# masking, one long request split over many parts (the combine merges it).
PROBLEMS = (
    ([1, 63, 64, 65, 130, 0], 1, 16, False),
    ([200, 7, 64], 2, 64, True),
    ([1000], 4, 32, True),
)
# FlashMLA's test tolerance for the output (P is rounded to bf16/fp16 before P @ V, as there);
# lse is fp32 throughout (tests/test_kernel_sm90.py uses the same).
OUT_TOL = {torch.bfloat16: (8e-4, 2.01 / 128), torch.float16: (4e-4, 3e-3)}
LSE_TOL = (1e-4, 1e-4)


def check_kernel(run, device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Runs ``run`` (the signature of dispatch's ``run_sm90``) on PROBLEMS on ``device``.

    The problems are drawn on the CPU from a fixed seed and the reference runs there in fp32.
    Returns None when every output and lse matches, else one line saying where it first
    differed (or what the kernel raised).
    """
    gen = torch.Generator().manual_seed(0)
    scale = D_QK**-0.5
    for lens, s_q, h_q, causal in PROBLEMS:
        what = f"lengths {lens}, s_q {s_q}, h_q {h_q}, causal {causal}"
        inp = make_decode_inputs(lens, s_q, h_q, dtype=dtype, generator=gen)
        ref_out, ref_lse = mla_decode_reference(inp.q, inp.kv_cache, inp.block_table,
                                                inp.cache_seqlens, scale, causal, D_V)
        q, kv, table, seqlens = (t.to(device) for t in (inp.q, inp.kv_cache, inp.block_table,
                                                        inp.cache_seqlens))
        # The schedule get_decode_schedule(seqlens, s_q, h_q) makes, through the op: the
        # dispatch imports this module, and ops/schedule.py imports the dispatch.
        num_parts = DecodeSplitConfig.from_heuristic(s_q, h_q, default_num_sms(seqlens.device))
        meta, splits = torch.ops.torch_mla.get_decode_schedule(seqlens, num_parts.num_parts)
        try:
            out, lse = run(q, kv, table, seqlens, meta, splits, scale, causal)
            out, lse = out.float().cpu(), lse.float().cpu()
        except Exception as e:  # a kernel that cannot run is as unusable as a wrong one
            return f"{what}: {type(e).__name__}: {e}"
        diff = compare(out, lse, ref_out.float(), ref_lse, OUT_TOL[dtype])
        if diff is not None:
            return f"{what}: {diff}"
    return None


def compare(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
            out_tol: tuple[float, float]) -> str | None:
    """None if out [b, s_q, h_q, d_v] and lse [b, h_q, s_q] (fp32, CPU) match the reference
    within (atol, rtol), +inf lse where the reference has it; else the first difference."""
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        return f"shapes {tuple(out.shape)}, {tuple(lse.shape)}, expected " \
               f"{tuple(ref_out.shape)}, {tuple(ref_lse.shape)}"
    for name, got, ref, (atol, rtol) in (("out", out, ref_out, out_tol),
                                         ("lse", lse, ref_lse, LSE_TOL)):
        same_inf = (got == ref) & torch.isinf(ref)
        bad = ~(((got - ref).abs() <= atol + rtol * ref.abs()) | same_inf)
        if bad.any():
            idx = tuple(int(i) for i in bad.nonzero()[0])
            return (f"{name}{list(idx)} = {got[idx].item():.6g}, reference "
                    f"{ref[idx].item():.6g} ({int(bad.sum())} of {bad.numel()} values differ)")
    return None
