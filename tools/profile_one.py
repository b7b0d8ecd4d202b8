"""Runs one anchor configuration a few times (for ncu):
python -m tools.profile_one B S_Q S_K H_Q [bf16|exact|fp8]
(bf16: the anchor's 16-bit cache, the default; exact / fp8: that cache quantized to e4m3 per
tensor, decoded in mla_decode's compute mode of that name)."""

import sys

import torch

import torch_mla
from torch_mla.testing import make_anchor_inputs, quantize_per_tensor


def main(argv: list[str]) -> None:
    b, s_q, s_k, h_q = (int(x) for x in argv[:4])
    mode = argv[4] if len(argv) > 4 else "bf16"
    inp = make_anchor_inputs(b, s_q, h_q, s_k)
    cache, fp8 = inp.kv_cache, {}
    if mode != "bf16":
        cache, kv_scale = quantize_per_tensor(inp.kv_cache)
        fp8 = {"kv_scale": kv_scale, "compute": mode}
    sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
    torch_mla.set_value_checks(False)
    for _ in range(4):
        torch_mla.mla_decode(inp.q, cache, inp.block_table, inp.cache_seqlens, sched,
                             causal=s_q > 1, **fp8)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
