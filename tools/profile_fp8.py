"""Runs one anchor configuration over an fp8 cache a few times (for ncu):
python tools/profile_fp8.py B S_Q S_K H_Q [exact|fp8]"""

import sys

import torch

import torch_mla
from torch_mla.reference import quantize_fp8
from torch_mla.testing import make_anchor_inputs

b, s_q, s_k, h_q = (int(x) for x in sys.argv[1:5])
mode = sys.argv[5] if len(sys.argv) > 5 else "fp8"
inp = make_anchor_inputs(b, s_q, h_q, s_k)
kv_scale = (inp.kv_cache.float().abs().amax() / 448).reshape(1)
cache = quantize_fp8(inp.kv_cache, kv_scale)
sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
torch_mla.set_value_checks(False)
for _ in range(4):
    torch_mla.mla_decode(inp.q, cache, inp.block_table, inp.cache_seqlens, sched,
                         causal=s_q > 1, kv_scale=kv_scale, compute=mode)
torch.cuda.synchronize()
