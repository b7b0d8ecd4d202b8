"""Runs one anchor configuration a few times (for ncu):
python tools/profile_one.py B S_Q S_K H_Q [bf16|exact|fp8]
(bf16: the anchor's 16-bit cache, the default; exact / fp8: that cache quantized to e4m3 per
tensor, decoded in mla_decode's compute mode of that name)."""

import sys

import torch

import torch_mla
from torch_mla.reference import quantize_fp8
from torch_mla.testing import make_anchor_inputs

b, s_q, s_k, h_q = (int(x) for x in sys.argv[1:5])
mode = sys.argv[5] if len(sys.argv) > 5 else "bf16"
inp = make_anchor_inputs(b, s_q, h_q, s_k)
cache, fp8 = inp.kv_cache, {}
if mode != "bf16":
    kv_scale = (inp.kv_cache.float().abs().amax() / 448).reshape(1)
    cache, fp8 = quantize_fp8(inp.kv_cache, kv_scale), {"kv_scale": kv_scale, "compute": mode}
sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
torch_mla.set_value_checks(False)
for _ in range(4):
    torch_mla.mla_decode(inp.q, cache, inp.block_table, inp.cache_seqlens, sched,
                         causal=s_q > 1, **fp8)
torch.cuda.synchronize()
