"""Runs one anchor configuration a few times (for ncu): python tools/profile_one.py B S_Q S_K H_Q"""

import sys

import torch

import torch_mla
from torch_mla.testing import make_anchor_inputs

b, s_q, s_k, h_q = (int(x) for x in sys.argv[1:5])
inp = make_anchor_inputs(b, s_q, h_q, s_k)
sched = torch_mla.get_decode_schedule(inp.cache_seqlens, s_q, h_q)
torch_mla.set_value_checks(False)
for _ in range(4):
    torch_mla.mla_decode(inp.q, inp.kv_cache, inp.block_table, inp.cache_seqlens, sched,
                         causal=s_q > 1)
torch.cuda.synchronize()
