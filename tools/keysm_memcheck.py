"""One decode per cache format on the keys-on-M kernel (TORCH_MLA_KEYSM=1) under
compute-sanitizer (memcheck): 16, 32 and 64 query columns, lengths off the page size and 0, NaN past
each length, huge unused block-table ids, one request split over parts and short ones whole;
run as ``compute-sanitizer --tool memcheck python -m tools.keysm_memcheck``. Prints each case's
largest error against the reference. With TORCH_MLA_KEYSM_RS=1 the fp8 cases run the ping-pong
variant (cute_kernels/sm90_keysm_rs_decode.py; at 64 columns its two warpgroups split them); with
TORCH_MLA_KEYSM_FAST=1 the fp8 cases run in fast mode (compute="fp8"), those of 8, 16 and 32
columns on that variant's fast mode (cute_kernels/sm90_keysm_fast_decode.py)."""

import os

import torch

import torch_mla
from torch_mla.reference import mla_decode_reference, quantize_fp8
from torch_mla.testing import make_decode_inputs


def main() -> None:
    os.environ["TORCH_MLA_KEYSM"] = "1"
    torch.manual_seed(0)
    for fp8 in (False, True):
        for s_q, h_q in ((1, 8), (1, 16), (2, 16), (2, 32)):
            inp = make_decode_inputs([3000, 65, 0, 130], s_q, h_q, device="cuda")
            cache, kw = inp.kv_cache, {}
            compute = "exact"
            if fp8:
                kw["kv_scale"] = (cache.float().nan_to_num(0).abs().amax() / 448).reshape(1)
                cache = quantize_fp8(cache.float(), kw["kv_scale"])
                if os.environ.get("TORCH_MLA_KEYSM_FAST") == "1":
                    compute = "fp8"
            out, lse = torch_mla.mla_decode(inp.q, cache, inp.block_table, inp.cache_seqlens,
                                            causal=s_q > 1, compute=compute, **kw)
            ref, ref_lse = mla_decode_reference(inp.q, cache, inp.block_table, inp.cache_seqlens,
                                                576**-0.5, s_q > 1, 512, **kw)
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            print(f"fp8={fp8} ({compute}) s_q={s_q} h_q={h_q}: max |out - ref| {err:.2e}, lse "
                  f"equal where infinite: {torch.equal(lse.isinf(), ref_lse.isinf())}")


if __name__ == "__main__":
    main()
