"""Tensor parallelism: transformers' head-sharded attention, swapped, on CPU ranks (gloo).

The two-rank runs launch ``tools/check_multi_gpu.py --device cpu --only tp`` (torchrun, 2 CPU
processes): tiny DeepSeek-V2 (transformers' own plan) and DeepSeek-V3 (``mla_tp_plan``), fp32,
swapped vs unswapped tensor-parallel models, eager and compiled (fullgraph): greedy tokens
identical, teacher-forced logits within 1e-4; and on an FP8 latent cache, the same scales on both
ranks and the unsharded model's logits. The in-process tests use a one-rank mesh.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import expecttest
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, DeepseekV3Config  # noqa: E402

from torch_mla.modules import MultiheadLatentAttention, mla_tp_plan, swap_mla_attention  # noqa: E402
from torch_mla.modules.tensor_parallel import head_shard  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_two_ranks_swapped_matches_unswapped_tensor_parallel():
    proc = subprocess.run(
        [sys.executable, "tools/check_multi_gpu.py", "--device", "cpu", "--only", "tp"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={k: v for k, v in os.environ.items() if k != "OUT"})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-5000:]
    runs = re.findall(r"\[ok\] TP DeepSeek-(V2|V3).*?heads per rank \[3\]; (.*)", out)
    assert [kind for kind, _ in runs] == ["V2", "V3"], out
    for _, line in runs:
        parts = re.findall(r"tokens identical (\d)/3 requests, teacher-forced logits max "
                           r"\|diff\| ([0-9.e+-]+)", line)
        assert len(parts) == 2 and "fullgraph" in line, line  # eager, compiled
        for same, err in parts:
            assert same == "3" and float(err) <= 1e-4, line
        # The fp8 latent cache: one scale per layer, the same on both ranks, and the sharded
        # model's logits the unsharded one's (fp32: the ranks' latents round alike; 5e-6 seen).
        fp8 = re.findall(r"fp8 cache: scales equal on every rank: True, teacher-forced logits vs "
                         r"the unsharded model's max \|diff\| ([0-9.e+-]+)", line)
        assert len(fp8) == 1 and float(fp8[0]) <= 1e-4, line


def v3_model():
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=1)
    return AutoModelForCausalLM.from_config(config).eval()


def shard(lin, mesh, placement):
    from torch.distributed.tensor import distribute_tensor

    lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.data, mesh, [placement]))


class TestHeadShard(expecttest.TestCase):
    def test_plan_for_each_query_projection(self):
        config = v3_model().config
        self.assertExpectedInline(str(mla_tp_plan(config)), """{'model.layers.*.self_attn.q_b_proj': 'colwise', 'model.layers.*.self_attn.kv_a_proj_with_mqa': 'mla_kv_a_proj', 'model.layers.*.self_attn.kv_b_proj': 'colwise', 'model.layers.*.self_attn.o_proj': 'rowwise'}""")
        config.q_lora_rank = None
        assert "model.layers.*.self_attn.q_proj" in mla_tp_plan(config)

    def test_whole_weights_are_not_sharded(self):
        attn = v3_model().model.layers[0].self_attn
        assert head_shard(attn) is None

    def test_head_sharded_attention_keeps_its_heads_and_output(self):
        from torch.distributed.tensor import Shard

        mesh = init_one_rank()
        hf = v3_model()
        ours = swap_mla_attention(v3_model())
        ours.load_state_dict(hf.state_dict())
        attn = ours.model.layers[0].self_attn
        for name, p in (("q_b_proj", Shard(0)), ("kv_b_proj", Shard(0)), ("o_proj", Shard(1))):
            shard(getattr(attn, name), mesh, p)
        swapped = MultiheadLatentAttention.from_hf(attn)
        assert swapped.num_heads == 4 and swapped.tp_group is not None
        ours.model.layers[0].self_attn = swapped
        ids = torch.randint(0, 64, (2, 5))
        with torch.no_grad():
            torch.testing.assert_close(ours(ids, use_cache=False).logits,
                                       hf(ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)

    def test_other_sharding_is_refused(self):
        from torch.distributed.tensor import Shard

        mesh = init_one_rank()
        attn = v3_model().model.layers[0].self_attn
        shard(attn.q_b_proj, mesh, Shard(0))
        shard(attn.kv_b_proj, mesh, Shard(0))
        shard(attn.o_proj, mesh, Shard(0))  # colwise, not rowwise
        with self.assertRaises(NotImplementedError) as e:
            head_shard(attn, "layer 0")
        self.assertExpectedInline(str(e.exception), """layer 0.o_proj.weight is sharded as (Shard(dim=0),), not (Shard(dim=1),): MultiheadLatentAttention runs tensor-parallel only with the heads split as DeepSeek-V2's tp_plan splits them (torch_mla.modules.mla_tp_plan(config))""")


def init_one_rank():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))
